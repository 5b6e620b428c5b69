"""Simulated workers: the real worker app over a `SimBackend`, one or many per process.

`build(settings, passthrough)` makes one `Worker` (importable as an ASGI app through
`serve.worker.app.build_app`); `run(settings, passthrough)` serves `settings.replicas`
of them in one process, each on its own port, each registering on its own. A port in use
fails at once, in one line, as a vLLM worker's does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket

from serve import flags, listen
from serve.sim.backend import SimBackend, SimRole
from serve.sim.config import parse_sim_options
from serve.sim.tokens import Vocabulary
from serve.worker.app import Worker, build_app
from serve.worker.settings import WorkerSettings
from serve.worker.sockets import ipc_endpoint

log = logging.getLogger("pdserve.sim")


def _events_bind(s: WorkerSettings) -> str | None:
    """Where the simulated engine publishes KV events (as a vLLM worker would), and what
    routers dial (set on `s`)."""
    if not s.publish_kv_events:
        return None
    if not s.kv_events_port and flags.is_loopback_host(s.host) and flags.is_loopback_host(s.dial_host):
        try:
            s.kv_events_endpoint = ipc_endpoint(f"kv-events-{s.port}")
            return s.kv_events_endpoint
        except OSError as exc:
            log.warning("KV events on TCP instead of a private Unix socket: %s", exc)
    port = s.kv_events_port or listen.late_port(s.host)
    s.kv_events_endpoint = f"tcp://{s.dial_host}:{port}"
    return f"tcp://*:{port}"


def build(s: WorkerSettings, passthrough: list[str], vocab: Vocabulary | None = None) -> Worker:
    """One simulated worker for settings whose model is already resolved (a directory or name)."""
    opts = parse_sim_options(passthrough, s.model, s.kv_cache_gib)
    engine_id = s.worker_id or f"sim-{s.role}-{os.getpid()}-{s.port}"
    s.worker_id = engine_id
    role = SimRole(role=s.role, engine_id=engine_id, model=s.model, served_model_name=s.served_model_name,
                   side_channel_host=s.dial_host,
                   side_channel_port=s.kv_side_channel_port or listen.late_port(s.host),
                   side_channel_auto=not s.kv_side_channel_port,
                   lease_s=s.kv_lease_seconds, cluster_token=s.cluster_token, kv_events_bind=_events_bind(s),
                   fault_pause_s=s.kv_fault_pause_s)
    return Worker(s, SimBackend(opts, role, vocab))


def replica_settings(s: WorkerSettings, i: int, port: int) -> WorkerSettings:
    wid = f"{s.worker_id}-{i}" if s.worker_id and s.replicas > 1 else s.worker_id
    return dataclasses.replace(s, port=port, worker_id=wid, kv_side_channel_port=0 if s.replicas > 1 else
                               s.kv_side_channel_port, kv_events_port=0 if s.replicas > 1 else s.kv_events_port,
                               frontends=list(s.frontends))


def run(s: WorkerSettings, passthrough: list[str]) -> int:
    """Serve `s.replicas` simulated workers until SIGTERM/SIGINT; the exit status."""
    socks: list[socket.socket] = []
    try:
        for i in range(s.replicas):
            socks.append(listen.bind(s.host, s.port + i if s.port else 0))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    from serve.model import resolve_model, served_name

    given = s.model or None
    s = dataclasses.replace(s, model=resolve_model(given), served_model_name=s.served_model_name or served_name(given))
    flags.warn_open("worker", s.host, s.cluster_token, "generate and register")
    vocab = Vocabulary.from_model_dir(s.model)
    apps = [build_app(build(replica_settings(s, i, sock.getsockname()[1]), passthrough, vocab))
            for i, sock in enumerate(socks)]
    if len(apps) == 1:
        return listen.serve(apps[0], socks[0], log_level=s.log_level, graceful_timeout_s=s.graceful_timeout_s)
    return asyncio.run(_serve_many(apps, socks, s))


async def _serve_many(apps: list, socks: list[socket.socket], s: WorkerSettings) -> int:
    import uvicorn

    servers = []
    for app, sock in zip(apps, socks):
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(app, host=host, port=port, log_level=s.log_level, access_log=False,
                                timeout_graceful_shutdown=max(1, int(s.graceful_timeout_s)),
                                timeout_keep_alive=listen.KEEP_ALIVE_S)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # one handler for all, below
        servers.append(server)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    log.info("sim: %d simulated %s workers on ports %s", len(servers), s.role,
             ", ".join(str(sock.getsockname()[1]) for sock in socks))
    try:
        await asyncio.gather(*(srv.serve(sockets=[sock]) for srv, sock in zip(servers, socks)))
    finally:
        for sock in socks:
            sock.close()
    return 0 if all(srv.started for srv in servers) else 3
