"""Process helpers for pdserve's benchmark scripts: free ports, readiness, clean stops.

Servers are started in their own session so that stopping one stops its engine-core
children too (SIGTERM to the group, SIGKILL after the grace period).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx


def free_port() -> int:
    """A port for a server a benchmark starts (it binds seconds later): below the ephemeral range."""
    from serve.listen import late_port

    return late_port("127.0.0.1")


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Wait until GET `url` answers 200; fail early if one of `procs` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"server exited with {p.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout:.0f}s: {url}")


def stop_group(procs: list[subprocess.Popen], grace_s: float = 30) -> None:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if p.poll() is None:
            p.wait(timeout=10)
