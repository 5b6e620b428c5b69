"""`pdserve worker`: from settings to a serving process.

The HTTP port is taken first (a port in use fails at once, in one line), then the CPU
environment is set (before vLLM is imported), the engine options pdserve owns are added
(`--kv-transfer-config` for the KV connector, `--kv-events-config` for the router's KV
events), and the worker app is served on the socket already bound.
"""

from __future__ import annotations

import json
import logging
import os

from serve import flags, listen
from serve.errors import PdserveError
from serve.step_hook import ENV as STEP_ENV
from serve.worker.settings import WorkerSettings
from serve.worker.sockets import ipc_endpoint

log = logging.getLogger("pdserve.cli")


def kv_transfer_flags(s: WorkerSettings, passthrough: list[str]) -> list[str]:
    """`--kv-transfer-config` that loads pdserve's connector, for prefill/decode workers."""
    if not s.kv_transfer:
        return []
    if any(a.startswith("--kv-transfer-config") for a in passthrough):
        raise PdserveError("--kv-transfer-config is set by pdserve for prefill/decode workers; drop it")
    from kvtransfer.transport import resolve
    from serve.engine import kv_transfer_config

    port = s.kv_side_channel_port or listen.late_port(s.host)
    engine_id = s.worker_id or f"{s.role}-{os.getpid()}-{port}"
    return ["--kv-transfer-config", kv_transfer_config(s.role, engine_id, s.dial_host, port, s.kv_lease_seconds,
                                                       resolve(s.kv_transport), s.kv_fault_pause_s,
                                                       s.transfer_mode or "pull")]


def kv_events_flags(s: WorkerSettings, passthrough: list[str]) -> list[str]:
    """`--kv-events-config` for vLLM's publisher; sets `s.kv_events_endpoint` (what routers dial).

    vLLM's publisher binds only wildcard TCP endpoints (an explicit host makes it connect),
    and ipc:// ones. A loopback worker publishes on a Unix socket in a private directory, so
    its events stay on this host; any other publishes on all interfaces, and routers
    subscribe to the advertised address."""
    if not s.publish_kv_events or any(a.startswith("--kv-events-config") for a in passthrough):
        return []
    ipc = None
    if not s.kv_events_port and flags.is_loopback_host(s.host) and flags.is_loopback_host(s.dial_host):
        try:
            ipc = ipc_endpoint(f"kv-events-{s.port}")
        except OSError as exc:
            log.warning("KV events on TCP instead of a private Unix socket: %s", exc)
    if ipc is not None:
        bind = s.kv_events_endpoint = ipc
    else:
        ev_port = s.kv_events_port or listen.late_port(s.host)
        s.kv_events_endpoint = f"tcp://{s.dial_host}:{ev_port}"
        bind = f"tcp://*:{ev_port}"
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": bind, "topic": ""})]


def step_records_path(s: WorkerSettings) -> str:
    """A file of this worker's own for its engine's step records (removed when it stops)."""
    import tempfile

    from serve.worker.steps import sweep_dead

    sweep_dead(tempfile.gettempdir())  # files of killed workers
    return os.path.join(tempfile.gettempdir(), f"pdserve-steps-{s.port}-{os.getpid()}.jsonl")


def run(s: WorkerSettings, passthrough: list[str]) -> int:
    """Bind, load the engine and serve until stopped; the exit status."""
    if s.engine == "sim":
        from serve.sim import worker as sim_worker

        return sim_worker.run(s, passthrough)
    sock = listen.bind(s.host, s.port)
    s.port = sock.getsockname()[1]  # --port 0: the one the kernel chose
    from serve.engine import apply_environment, cpu_environment, parse_engine_args
    from serve.model import resolve_model, served_name

    apply_environment(cpu_environment(s.advertise_host or s.host, s.cpu_cores, s.kv_cache_gib))
    given = s.model or None
    s.model = resolve_model(given)
    s.served_model_name = s.served_model_name or served_name(given)
    if s.cluster_token:
        os.environ["PDSERVE_CLUSTER_TOKEN"] = s.cluster_token  # the KV connector (engine process) reads it
    s.step_records = step_records_path(s)
    os.environ[STEP_ENV] = s.step_records  # the engine core's plugin (serve.step_hook) writes there
    flags.warn_open("worker", s.host, s.cluster_token, "generate and register")
    passthrough = [*passthrough, *kv_transfer_flags(s, passthrough), *kv_events_flags(s, passthrough)]
    engine_args = parse_engine_args(s.model, passthrough, s.served_model_name)
    from serve.engine import cpu_avx512_or_amx, is_cpu_platform, slow_cpu_hint

    if hint := slow_cpu_hint(engine_args.dtype, is_cpu_platform(), cpu_avx512_or_amx):
        log.warning("pdserve worker: %s", hint)
    from serve.worker.app import Worker, build_app
    from serve.worker.vllm_backend import VllmBackend

    app = build_app(Worker(s, VllmBackend(engine_args)))
    # The worker removes its ipc socket when it stops (uvicorn re-raises SIGTERM after its
    # shutdown, so nothing after this call runs); sockets of killed workers are swept by the
    # next worker that makes one (`ipc_endpoint`).
    return listen.serve(app, sock, log_level=s.log_level, graceful_timeout_s=s.graceful_timeout_s)
