"""`pdserve drain`: ask a frontend or worker to drain (`POST /internal/drain`) and report.
The server side is `serve.drain`; this module imports no web framework."""

from __future__ import annotations

import argparse


def add_arguments(d: argparse.ArgumentParser) -> None:
    import os

    d.add_argument("--url", default="http://127.0.0.1:8000", help="the process to drain (default: %(default)s)")
    d.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for in-flight requests (default: the process's --graceful-timeout)")
    d.add_argument("--settle", type=float, default=None,
                   help="seconds to keep serving first, for load balancers to notice (default: the process's)")
    d.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
                   help="the process's cluster token, if it has one (env PDSERVE_CLUSTER_TOKEN)")


def run_client(args: argparse.Namespace) -> int:
    """POST /internal/drain and report; 0 drained, 1 requests still in flight."""
    import httpx
    import msgspec

    from serve.auth import token_headers
    from serve.errors import PdserveError
    from serve.protocol import DrainReply

    params = {k: v for k, v in (("timeout", args.timeout), ("settle", args.settle)) if v is not None}
    for k, v in params.items():
        if v < 0:
            raise PdserveError(f"--{k} must be >= 0")
    wait = sum(params.values()) if params else 3600.0
    try:
        r = httpx.post(f"{args.url.rstrip('/')}/internal/drain", params=params, timeout=wait + 10.0,
                       headers=token_headers(args.cluster_token))
    except httpx.HTTPError as exc:
        raise PdserveError(f"{args.url}: {exc}") from exc
    if r.status_code != 200:
        raise PdserveError(f"{args.url}: HTTP {r.status_code}: {r.text[:200]}")
    try:
        body = msgspec.json.decode(r.content, type=DrainReply)
    except msgspec.DecodeError as exc:
        raise PdserveError(f"{args.url}: not a drain reply: {exc}") from None
    print(f"pdserve drain: {args.url}: " + ("drained" if body.drained else
          f"{body.active_requests} request(s) still in flight") + f" after {body.waited_s} s")
    return 0 if body.drained else 1
