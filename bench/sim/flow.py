"""The offline cluster's parts: one request's flow through it (and what the client saw of it),
a simulated worker, the KV link between workers."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serve.sim.blocks import BlockTable

from bench.sim.engine import OfflineEngine


def ended(flow: Flow) -> None:
    """A finished flow's `on_done`."""


@dataclass
class Link:
    bandwidth_gbps: float = 0.0  # 0: instant
    latency_s: float = 0.0


@dataclass
class SimWorker:
    url: str
    role: str
    engine: OfflineEngine
    table: BlockTable
    alive: bool = True
    draining: bool = False  # leaving: out of rotation, finishing what it has (bench/sim/scaling.py)


@dataclass
class Flow:
    """One request through the cluster, and what the client saw of it."""

    request_id: str
    session: int
    turn: int
    prompt: list[int]
    osl: int
    seed: int
    arrival: float
    on_done: Callable[[Flow], None]
    times: array = field(default_factory=lambda: array("d"))  # virtual time of each token
    end: float = 0.0
    error: tuple[int, str, str] | None = None  # (HTTP status, type, message)
    path: str = ""
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    blocks: int = 0
    cached_tokens: int = 0
    isl: int = 0  # the prompt's length (the prompt itself is dropped when the request ends)
    reserved: list[tuple[str, str]] = field(default_factory=list)  # load-tracker reservations held
    roles: tuple[str, ...] = ("agg",)  # the decode stage's roles (a retry's candidates)
    tried: set[str] = field(default_factory=set)
    sent: float = 0.0  # when its current stage was sent to a worker
    uncached_tokens: int = 0  # the prompt's tokens the decode worker had not cached (the router's view)
    uncached_blocks: int = 0  # what its decode worker reads from the holder (blocks it lacks)
    transfer_bytes: int = 0  # those blocks' bytes, as the router estimated them
    plan: Any = None  # a split request's RoutePlan until its decode stage is sent
    prefill_until: float = 0.0  # a split request's prefill deadline (virtual time)
