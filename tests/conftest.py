"""Shared fixtures: real processes on 127.0.0.1, one engine shared by the whole session.

Engines are expensive here (a vLLM AsyncLLM starts its own engine-core process: ~30-70 s
and 3-4 GB on 2 cores), so the aggregated worker and its frontend start once per test
session and every test that needs them shares them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE_READY_TIMEOUT_S = 420.0
LOG_DIR = Path(os.environ.get("PDSERVE_TEST_LOGS", "/tmp/pdserve-test-logs"))


def free_port() -> int:
    """A port for a server a test starts (it binds seconds later): below the ephemeral range."""
    from serve.listen import late_port

    return late_port("127.0.0.1")


class Proc:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 wrapper: list[str] | None = None) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = LOG_DIR / f"{name}-{os.getpid()}-{time.time_ns()}.log"
        self.log = open(self.log_path, "wb")
        full_env = {**os.environ, **(env or {})}
        cmd = [*(wrapper or []), sys.executable, "-m", "serve.cli", *args]
        self.popen = subprocess.Popen(cmd, cwd=ROOT, env=full_env,
                                      stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready at {url} after {timeout:.0f}s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def model_dir() -> str:
    from serve.model import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from serve.frontend.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def agg_worker(model_dir: str) -> Iterator[str]:
    port = free_port()
    proc = Proc("agg-worker", ["worker", "--role", "agg", "--host", "127.0.0.1", "--port", str(port),
                               "--model", model_dir, "--served-model-name", "smollm2-135m-instruct",
                               "--cpu-cores", "0", "--kv-cache-gib", "1", "--max-num-seqs", "32"])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", ENGINE_READY_TIMEOUT_S)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def frontend(agg_worker: str, model_dir: str) -> Iterator[str]:
    port = free_port()
    proc = Proc("frontend", ["frontend", "--host", "127.0.0.1", "--port", str(port), "--model", model_dir,
                             "--served-model-name", "smollm2-135m-instruct", "--worker", agg_worker])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", 120)
        yield url
    finally:
        proc.stop()


MODEL = "smollm2-135m-instruct"
