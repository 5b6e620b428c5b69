"""The servers a benchmark starts: pdserve's own processes (or vLLM's OpenAI server, to
compare against), each in its own process group through serve.common.procs, their output in
one log file per set-up. Stopping a set stops what each process spawned too (vLLM's engine
cores): SIGTERM to every group, last started first, SIGKILL after the grace period.

A server that exits before it is ready, or is not ready in time, is a PerfError naming the
log. Ports come from serve.listen.late_port (free now, bound seconds later by the server).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO

import httpx

from bench.perf.errors import PerfError
from serve.common.procs import Child, ChildExited, stop_groups, wait_until_ready
from serve.listen import late_port

HOST = "127.0.0.1"


def free_port() -> int:
    return late_port(HOST)


def url_of(port: int) -> str:
    return f"http://{HOST}:{port}"


def reset_prefix_cache(url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
    """Empty a worker's prefix cache, so a run starts from the same cache state. vLLM answers
    `{"reset": false}` while blocks are in use (held for a decode, or a request finishing),
    so ask again until it is done, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{url}/reset_prefix_cache", headers=headers, timeout=timeout)
        if r.status_code != 200:
            raise PerfError(f"{url}/reset_prefix_cache: HTTP {r.status_code} {r.text[:200]}")
        if r.json().get("reset") is True:
            return
        if time.monotonic() > deadline:
            raise PerfError(f"{url}: the prefix cache could not be reset in {timeout:.0f} s (blocks still in use)")
        time.sleep(0.5)


def pdserve(*args: str) -> list[str]:
    """The command line of `pdserve ARGS...` with this interpreter."""
    return [sys.executable, "-m", "serve.cli", *args]


class Servers:
    """The processes of one benchmark set-up, all writing to `log` (an open binary file)."""

    def __init__(self, log: IO[bytes], grace_s: float = 30.0) -> None:
        self.log = log
        self.grace_s = grace_s
        self.children: list[Child] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `cmd` in its own group; returns at once (see `ready`)."""
        child = Child(name, cmd, env=env, stdout=self.log)
        self.children.append(child)
        return child

    def ready(self, child: Child, url: str, timeout: float = 300.0) -> None:
        """Wait until GET `url` (the child's health URL) is 200. Fails early, as a PerfError,
        when any process of the set exits."""
        names = {c.popen.pid: c.name for c in self.children}
        try:
            wait_until_ready(url, [c.popen for c in self.children], timeout,
                             on_exit=lambda p: f" ({names.get(p.pid, '?')})", poll_s=0.1)
        except (ChildExited, TimeoutError) as e:
            raise PerfError(f"{child.name}: {e}; its log: {self.log.name}") from None

    def serve(self, name: str, cmd: list[str], url: str, env: dict[str, str] | None = None,
              timeout: float = 300.0) -> Child:
        """`start`, then `ready` on `url`."""
        child = self.start(name, cmd, env)
        self.ready(child, url, timeout)
        return child

    def stop(self) -> None:
        stop_groups([c.popen for c in self.children], self.grace_s)
        self.children.clear()

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

