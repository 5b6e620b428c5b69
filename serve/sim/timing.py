"""How long one engine step takes: the pluggable model of the simulated engine.

`StepModel.step_seconds(decode_contexts, prefill_chunks)` gets, for one step, the context
length of every decoding request (per request, not an average) and every prefill chunk
as (tokens already computed, tokens computed now). `ConstantStep` is the default;
`LinearStep` adds per-token costs. The cluster simulator supplies a faithful model
calibrated on real vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StepModel(Protocol):
    name: str

    def step_seconds(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float: ...


@dataclass(frozen=True)
class ConstantStep:
    seconds: float = 0.005
    name: str = "constant"

    def step_seconds(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        return self.seconds


@dataclass(frozen=True)
class LinearStep:
    """base + per prefill token + per decode request + per token of decode context."""

    base_s: float = 0.004
    prefill_token_s: float = 2e-5
    decode_seq_s: float = 1e-4
    context_token_s: float = 1e-7
    name: str = "linear"

    def step_seconds(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        return (self.base_s + self.prefill_token_s * sum(n for _, n in prefill_chunks)
                + self.decode_seq_s * len(decode_contexts) + self.context_token_s * sum(decode_contexts))


def parse_step_model(spec: str) -> StepModel:
    """`constant[:SECONDS]` or `linear[:BASE,PREFILL_TOKEN,DECODE_SEQ,CONTEXT_TOKEN]`."""
    name, _, args = spec.partition(":")
    try:
        values = [float(v) for v in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"--sim-step-model {spec!r}: numbers expected after ':'") from None
    if any(v < 0 for v in values):
        raise ValueError(f"--sim-step-model {spec!r}: times must be >= 0")
    if name == "constant" and len(values) <= 1:
        return ConstantStep(*values)
    if name == "linear" and len(values) <= 4:
        return LinearStep(*values)
    raise ValueError(f"--sim-step-model {spec!r}: constant[:SECONDS] or linear[:BASE,PREFILL_TOKEN,DECODE_SEQ,"
                     "CONTEXT_TOKEN]")
