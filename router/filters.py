"""The filter stage: which workers may take a request at all, before any scoring.

Filters are pure functions over `WorkerView`s (what the frontend knows of each worker):
out of rotation or draining, wrong role, already tried, or a KV layout that cannot
exchange blocks with the worker chosen for the other stage. What survives goes to the
scorers; what is filtered out is never scored, so a draining worker can never win.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: str  # agg | prefill | decode
    in_rotation: bool = True  # healthy, lease valid
    draining: bool = False
    block_size: int = 0
    kv_cache_dtype: str = "auto"


def eligible(views: Iterable[WorkerView], roles: Collection[str], exclude: Collection[str] = ()) -> list[WorkerView]:
    """In rotation, not draining, of one of `roles`, not in `exclude`."""
    return [v for v in views if v.in_rotation and not v.draining and v.role in roles and v.worker_id not in exclude]


def kv_compatible(a: WorkerView, b: WorkerView) -> bool:
    """Two workers can exchange KV blocks: same block size and KV cache dtype."""
    return a.block_size == b.block_size and a.kv_cache_dtype == b.kv_cache_dtype


def compatible_with(views: Iterable[WorkerView], peer: WorkerView) -> list[WorkerView]:
    return [v for v in views if kv_compatible(v, peer)]
