"""A frontend and simulated workers in this process and event loop, on loopback sockets.

For tests and the cluster simulator: the real frontend app and real worker apps (over
`SimBackend`s) served by uvicorn on 127.0.0.1, workers registering with the frontend over
HTTP, prefill and decode workers handing KV over the real side channel. `kill(url)` stops a
worker as SIGKILL would: its connections are reset, it never deregisters, its side channel
goes silent.

    async with SimCluster(model, ["prefill", "decode"]) as c:
        r = await c.client.post(f"{c.url}/v1/completions", json={...})
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from typing import Any

import httpx

from serve import listen
from serve.frontend.app import Frontend, build_app as build_frontend
from serve.frontend.settings import FrontendSettings
from serve.sim import worker as sim_worker
from serve.sim.tokens import Vocabulary
from serve.worker.app import Worker, build_app as build_worker
from serve.worker.settings import WorkerSettings

HOST = "127.0.0.1"


class _Served:
    def __init__(self, app: Any, sock: socket.socket) -> None:
        import uvicorn

        self.sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, host=HOST, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=2, lifespan="on", timeout_keep_alive=listen.KEEP_ALIVE_S)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def wait_started(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while not self.server.started:
                if self.task.done():
                    self.task.result()
                    raise RuntimeError("server exited during start-up")
                await asyncio.sleep(0.01)

    async def stop(self, force: bool = False) -> None:
        self.server.force_exit = force
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await self.task
        self.sock.close()


class SimCluster:
    def __init__(self, model: str, roles: list[str], *, served_model_name: str = "smollm2-135m-instruct",
                 engine_flags: list[str] | None = None, frontend: dict[str, Any] | None = None,
                 worker: dict[str, Any] | None = None, per_worker: dict[int, dict[str, Any]] | None = None,
                 cluster_token: str | None = None, ready_timeout_s: float = 60.0) -> None:
        self.model = model
        self.roles = roles
        self.name = served_model_name
        self.engine_flags = engine_flags or ["--max-num-seqs", "64", "--block-size", "16", "--num-gpu-blocks", "2048"]
        self.frontend_overrides = frontend or {}
        self.worker_overrides = worker or {}
        self.per_worker = per_worker or {}
        self.cluster_token = cluster_token
        self.ready_timeout_s = ready_timeout_s
        self.vocab = Vocabulary.from_model_dir(model)
        self.frontend: Frontend | None = None
        self.fe: _Served | None = None
        self.workers: dict[str, Worker] = {}
        self.served: dict[str, _Served] = {}
        self.client = httpx.AsyncClient(timeout=60.0)

    @property
    def url(self) -> str:
        return self.fe.url

    async def __aenter__(self) -> SimCluster:
        settings = FrontendSettings(model=self.model, served_model_name=self.name, cluster_token=self.cluster_token,
                                    **{"block_size": 16, "poll_interval_s": 0.2, **self.frontend_overrides})
        self.frontend = Frontend(settings)
        self.fe = _Served(build_frontend(settings, self.frontend), listen.bind(HOST, 0))
        await self.fe.wait_started()
        for i, role in enumerate(self.roles):
            await self.add_worker(role, **self.per_worker.get(i, {}))
        await self.wait_in_rotation(len(self.roles))
        return self

    async def add_worker(self, role: str, **overrides: Any) -> str:
        sock = listen.bind(HOST, 0)
        port = sock.getsockname()[1]
        flags = overrides.pop("engine_flags", self.engine_flags)
        # A 10 s registration lease: every worker and the frontend share this one event loop,
        # and a burst of requests on a busy machine once delayed renewals past a 2 s lease (the
        # only worker left rotation: 503s). A killed worker still leaves at once (failed polls).
        s = WorkerSettings(role=role, host=HOST, port=port, frontends=[self.fe.url], lease_seconds=10.0,
                           model=self.model, served_model_name=self.name, kv_transfer=role != "agg",
                           cluster_token=self.cluster_token, engine="sim", worker_id=f"sim-{role}-{port}",
                           **{**self.worker_overrides, **overrides})
        w = sim_worker.build(dataclasses.replace(s), list(flags), self.vocab)
        served = _Served(build_worker(w), sock)
        await served.wait_started()
        self.workers[served.url] = w
        self.served[served.url] = served
        return served.url

    async def wait_in_rotation(self, n: int, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.ready_timeout_s)
        while len(self.in_rotation()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.in_rotation())} of {n} workers in rotation")
            await asyncio.sleep(0.05)

    def in_rotation(self, role: str | None = None) -> list[str]:
        pool = self.frontend.pool if self.frontend else None
        if pool is None:
            return []
        return [e.url for e in pool.available() if role is None or (e.info and e.info.role == role)]

    def urls(self, role: str) -> list[str]:
        return [u for u, w in self.workers.items() if w.settings.role == role]

    async def kill(self, url: str) -> None:
        """As SIGKILL: connections reset, no deregistration, side channel silent, engine gone."""
        w, served = self.workers.pop(url), self.served.pop(url)
        w.registration.stopping = True
        if w.registration.task is not None:
            w.registration.task.cancel()

        async def nothing(*_: Any) -> None:
            return None

        w.registration.deregister = nothing  # type: ignore[method-assign]
        for conn in list(served.server.server_state.connections):
            if conn.transport is not None:
                conn.transport.abort()
        # Not force_exit: that would skip the lifespan shutdown and leave the engine running.
        await served.stop()

    async def __aexit__(self, *exc: Any) -> None:
        # All at once: each may wait out its graceful shutdown.
        await asyncio.gather(*(self.served.pop(url).stop() for url in list(self.served)))
        self.workers.clear()
        if self.fe is not None:
            await self.fe.stop()
        await self.client.aclose()
