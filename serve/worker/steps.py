"""A worker's engine steps: the `pdserve_worker_step_seconds` histogram and `GET /steps`.

A vLLM engine core writes one JSON line per step to a file (`serve.step_hook`); `StepLog.poll`
reads what is new there (following the writer's rotation to `<path>.1`). A simulated engine
hands its modelled steps to `StepLog.add` directly. Each step is observed in the histogram
and kept, the last `keep` of them, numbered, for `GET /steps?since=N` (what
`pdserve bench calibrate --steps` and an autoscaler read).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from serve import protocol as p

log = logging.getLogger("pdserve.worker.steps")

KEEP = 20_000


class StepLog:
    def __init__(self, path: str | None = None, keep: int = KEEP,
                 observe: Callable[[float], None] | None = None) -> None:
        self.path = path
        self.records: deque[p.StepRecord] = deque(maxlen=keep)
        self.next_seq = 0  # the number the next record gets
        self.observe = observe
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self._lock = threading.Lock()  # polls come from the event loop's worker threads

    def add(self, start: float, seconds: float, decodes: list[int], prefills: list[list[int]]) -> None:
        self.records.append(p.StepRecord(seq=self.next_seq, t=start, s=seconds, d=decodes, p=prefills))
        self.next_seq += 1
        if self.observe is not None:
            self.observe(seconds)

    def poll(self) -> int:
        """Read the steps the engine wrote since the last poll; how many. Blocking file I/O:
        handlers call it in a thread."""
        if not self.path:
            return 0
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return 0
            n = 0
            if self._inode is not None and st.st_ino != self._inode:
                # Rotated: finish the old file (now <path>.1), then start the new one.
                n += self._read(self.path + ".1")
                self._offset, self._partial = 0, b""
            elif st.st_size < self._offset:  # rotated twice between polls (or the inode reused)
                self._offset, self._partial = 0, b""
            self._inode = st.st_ino
            return n + self._read(self.path)

    def _read(self, path: str) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line: the rest comes later
        n = 0
        for line in lines:
            if not line:
                continue
            try:
                r = json.loads(line)
                self.add(float(r["t"]), float(r["s"]), [int(c) for c in r["d"]], [[int(a), int(b)] for a, b in r["p"]])
                n += 1
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("step records %s: a line skipped (%s)", path, exc)
        return n

    def since(self, seq: int) -> list[p.StepRecord]:
        """Kept records numbered `seq` or later (older ones are gone: the reply says from where)."""
        if not self.records:
            return []
        first = self.records[0].seq
        return list(self.records)[max(0, seq - first):]

    def remove_files(self) -> None:
        if self.path:
            for f in (self.path, self.path + ".1"):
                with contextlib.suppress(OSError):
                    os.unlink(f)


def sweep_dead(directory: str, prefix: str = "pdserve-steps-") -> None:
    """Remove step files no engine writes any more (their worker was killed and could not
    remove them). A writing engine holds a shared lock on its file (`serve.step_hook`); a
    file nobody locks is left over. (Not a pid check: workers in another PID namespace, as
    under `unshare --pid`, would see live workers' pids as dead.) A rotated `<file>.1` goes
    with its file."""
    import fcntl

    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix) or not name.endswith(".jsonl"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # an engine writes it
        except OSError:
            continue
        for stale in (path, path + ".1"):
            with contextlib.suppress(OSError):
                os.unlink(stale)
