"""UCX transport profiles for NIXL, chosen with `--kv-transport` or detected.

- `rdma`: the deployment guide's settings for InfiniBand/RoCE (`UCX_TLS=rc_x,rc,dc_x,dc,
  cuda_copy,cuda_ipc`, `UCX_RNDV_SCHEME=get_zcopy`, `UCX_RNDV_THRESH=0`). Right only on real
  RDMA NICs: measured here, any finite `UCX_RNDV_THRESH` forces software emulation (~10x slower).
- `shm`: same host, UCX's defaults (cma zero-copy for READ); NIXL sets the rendezvous
  threshold itself. Needs processes that can see each other's memory (same PID namespace).
- `tcp`: `UCX_TLS=tcp` (READ emulated in software; the fallback across hosts without RDMA).

`detect()` picks `rdma` when an InfiniBand device is present, else `shm`. The profile env is
applied before the NIXL agent is created; the progress thread stays off (it halved
throughput on 2 cores), so the side that holds blocks keeps calling into NIXL.
"""

from __future__ import annotations

import os
from pathlib import Path

PROFILES: dict[str, dict[str, str]] = {
    "rdma": {
        "UCX_TLS": "rc_x,rc,dc_x,dc,cuda_copy,cuda_ipc",
        "UCX_RNDV_SCHEME": "get_zcopy",
        "UCX_RNDV_THRESH": "0",
    },
    "shm": {},
    "tcp": {"UCX_TLS": "tcp"},
}


def detect() -> str:
    ib = Path("/sys/class/infiniband")
    if ib.is_dir() and any(ib.iterdir()):
        return "rdma"
    return "shm"


def resolve(name: str | None) -> str:
    if name in (None, "", "auto"):
        return detect()
    if name not in PROFILES:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(PROFILES)} or auto")
    return name


def apply(name: str) -> dict[str, str]:
    """Set the profile's UCX variables (user-set ones win) and return what was set."""
    env = {k: v for k, v in PROFILES[name].items() if k not in os.environ}
    os.environ.update(env)
    return env
