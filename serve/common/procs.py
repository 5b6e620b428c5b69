"""Children in their own process group, and the `/proc` walker.

`Child` starts a command in a new session (so stopping it stops everything it spawned, such
as vLLM's engine-core processes), logs its output to a file, waits for HTTP readiness and
stops it: SIGTERM to the group, SIGKILL to what is left after the grace period. `pdserve up`,
the benchmarks and the tests all start servers this way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO


class ChildExited(RuntimeError):
    """A child exited before it became ready."""


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group led by `proc` (gone already: nothing)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Iterable[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every group (last started first), wait up to `grace_s` in all, then SIGKILL
    whatever is left and reap."""
    procs = list(procs)
    for p in reversed(procs):
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        signal_group(p, signal.SIGKILL)
        if p.poll() is None:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """GET `url` answered 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local URLs)
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_ready(url: str, procs: Iterable[subprocess.Popen], timeout: float,
                     on_exit: Callable[[subprocess.Popen], str] | None = None, poll_s: float = 0.5) -> None:
    """Wait until GET `url` answers 200; fail early (ChildExited) when one of `procs` exits,
    and with TimeoutError after `timeout` seconds."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                detail = on_exit(p) if on_exit else ""
                raise ChildExited(f"exited with status {p.returncode} before {url} was ready{detail}")
        if http_ok(url):
            return
        time.sleep(poll_s)
    raise TimeoutError(f"not ready after {timeout:.0f}s: {url}")


class Child:
    """One command in its own process group, its output in `log_path`."""

    def __init__(self, name: str, cmd: list[str], log_path: str | os.PathLike | None = None, *,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 stdout: IO | int | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.log_path = Path(log_path) if log_path is not None else None
        self._log: IO | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
            stdout = self._log
        self.popen = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout,
                                      stderr=subprocess.STDOUT if stdout is not None else None,
                                      stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def tail(self, n: int = 40) -> str:
        if self.log_path is None:
            return ""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_http(self, url: str, timeout: float) -> None:
        """Until GET `url` is 200; RuntimeError with the log's tail if the child exits or
        the time runs out."""
        try:
            wait_until_ready(url, [self.popen], timeout)
        except (ChildExited, TimeoutError) as exc:
            raise RuntimeError(f"{self.name} {exc}:\n{self.tail()}") from None

    def send_signal(self, sig: int) -> None:
        """`sig` to the whole process group."""
        signal_group(self.popen, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """`sig` to the group, up to `timeout` s to exit, then SIGKILL to what is left."""
        signal_group(self.popen, sig)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        signal_group(self.popen, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)
        if self._log is not None:
            self._log.close()


# -- the /proc walker ---------------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def cmdline(pid: int) -> str:
    """The command line, arguments joined by spaces ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def children_map() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every live process."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            ppid = parent_of(int(d))
            if ppid is not None:
                out.setdefault(ppid, []).append(int(d))
    return out


def children(pid: int) -> list[int]:
    """Direct children of `pid`."""
    return sorted(children_map().get(pid, []))


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (not `pid` itself), parents before children."""
    kids = children_map()
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += kids.get(p, [])
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    return [pid, *descendants(pid)]


def meminfo_available_gib(default: float = 16.0) -> float:
    """MemAvailable from /proc/meminfo, in GiB (`default` where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return default
