"""Flags several roles share, and the environment-variable defaults behind them.

Each role's settings object (`WorkerSettings`, `FrontendSettings`, `UpSettings`) adds its
own flags with these helpers and builds itself from the parsed namespace; `serve.cli`
only dispatches.
"""

from __future__ import annotations

import argparse
import logging
import os

from serve.errors import PdserveError

DEFAULT_HOST = os.environ.get("PDSERVE_HOST", "127.0.0.1")
DEFAULT_EXEMPT = "/health,/live,/metrics"


def env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise PdserveError(f"{name}={raw!r} is not a number") from None


def paths(value: str) -> list[str]:
    """`--auth-exempt-paths`: comma-separated paths, each starting with /."""
    found = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in found if not v.startswith("/")]
    if bad:
        raise PdserveError(f"--auth-exempt-paths: {', '.join(bad)}: paths start with /")
    return found


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"),
                   help="local Hugging Face model directory, hub id, or the embedded model's name "
                        "(default: the embedded smollm2-135m-instruct; env PDSERVE_MODEL)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients put in `model` (default: derived from --model)")


def add_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
                   help="shared secret of frontends and workers: required on registration and every worker "
                        "endpoint, and (as an HMAC) on the KV side channel; unset: open, for one machine "
                        "(env PDSERVE_CLUSTER_TOKEN; `pdserve up` makes one)")
    p.add_argument("--auth-exempt-paths", default=os.environ.get("PDSERVE_AUTH_EXEMPT_PATHS", DEFAULT_EXEMPT),
                   help="comma-separated paths open without a key or token (default: /health,/live,/metrics; "
                        "env PDSERVE_AUTH_EXEMPT_PATHS)")


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="log level (default: info)")


def add_router(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router-mode", choices=["kv", "round-robin", "random"], default="kv",
                   help="how prefill workers are chosen: kv (KV-cache overlap and load), round-robin, random "
                        "(default: kv)")
    p.add_argument("--kv-overlap-score-weight", type=float, default=1.0,
                   help="weight of uncached prompt blocks in the prefill cost (default: 1.0)")
    p.add_argument("--router-temperature", type=float, default=0.0,
                   help="0 picks the lowest cost; > 0 samples by softmax of -cost (default: 0)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="route from the router's own decisions (approximate prefix index) instead of workers' KV events")
    p.add_argument("--conditional-disagg-tokens", type=conditional_disagg, default=0, metavar="N|auto",
                   help="skip the prefill stage when the prompt's uncached part on the decode worker is below N "
                        "tokens; 0 always splits; auto: when moving its KV (measured bandwidth and latency to the "
                        "prefill worker, plus that worker's queue) costs more than the decode worker's own prefill "
                        "(measured) (default: 0)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill may take before the decode worker prefills locally (default: 60)")
    p.add_argument("--first-token-from", choices=["prefill", "decode"], default="prefill",
                   help="disaggregated requests: stream the prefill worker's first token at once and have the "
                        "decode worker continue after it (prefill), or have the decode worker regenerate it "
                        "(decode, the old path); seeded requests always take the decode path (default: prefill)")


def conditional_disagg(value: str) -> int | str:
    """`--conditional-disagg-tokens`: a token count >= 0, or "auto"."""
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or auto, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 or auto, got {n}")
    return n


def router_flags(args: argparse.Namespace) -> list[str]:
    """The router flags of `args` as a command line (what `pdserve up` hands its frontend)."""
    return ["--router-mode", args.router_mode, "--kv-overlap-score-weight", str(args.kv_overlap_score_weight),
            "--router-temperature", str(args.router_temperature),
            "--conditional-disagg-tokens", str(args.conditional_disagg_tokens),
            "--prefill-timeout", str(args.prefill_timeout), "--first-token-from", args.first_token_from] + (
                ["--no-kv-events"] if args.no_kv_events else [])


def is_loopback_host(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_open(role: str, host: str, token: str | None, what: str) -> None:
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("pdserve.cli").warning("%s binds %s without a cluster token: anyone who reaches it can %s",
                                                 role, host, what)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
