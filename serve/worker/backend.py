"""The seam between the worker protocol and what runs the model.

`Worker` (serve.worker.app) speaks HTTP; an `EngineBackend` generates. `VllmBackend`
(serve.worker.vllm_backend) wraps vLLM's AsyncLLM; a simulated backend (serve.sim) models
an engine without vLLM. Both take the same `GenerateRequest` and yield the same
`TokenDelta`s, so everything above this line is shared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from serve import protocol as p


@dataclass(frozen=True)
class EngineFacts:
    """What a started engine says about itself (goes into the worker's /info)."""

    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    num_kv_blocks: int
    seeds: bool = True
    kv_bytes_per_block: int = 0  # KV bytes of one block, all layers; 0: unknown


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class InvalidRequest(ValueError):
    """The request cannot run on this engine (bad sampling options, say): a final error line."""


class EngineBackend(Protocol):
    name: str  # "vllm" or "sim": the worker's /info `engine`
    on_kv_stats: Callable[[Any], None] | None  # set by the worker: where KV connector stats go

    async def start(self) -> EngineFacts:
        """Load the engine; called once, in the worker's lifespan."""

    def generate(self, req: p.GenerateRequest) -> AsyncIterator[p.TokenDelta]:
        """The request's deltas, the last one `finished`; InvalidRequest before the first."""

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raises when the engine cannot serve."""

    async def reset_prefix_cache(self) -> bool: ...

    def load(self) -> EngineLoad: ...

    @property
    def dead(self) -> bool:
        """The engine died and will not come back (liveness fails)."""

    def metrics_text(self) -> bytes:
        """The engine's own Prometheus series (`vllm:*`)."""

    async def stop(self) -> None:
        """Stop the engine and free what it holds (the worker's shutdown)."""
