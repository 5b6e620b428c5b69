"""Step-time profiles from the planner's performance model: every (model, system, TP, KV
dtype) the planner ranks becomes a `pdserve.profile/1` file a simulated engine runs on.

The planner's step (bench/plan/perf.py) is overhead + layer floor + linear(T) +
elementwise(T) + allreduce(T) + attention. The token-proportional part is tabulated at the token counts
below (it is a roofline: flat while weight streaming dominates, then linear in T); the
attention parts are linear in their work, so they are single rates:
  decode:  max(KV bytes per context token / HBM, attention FLOPs per context token / peak)
  prefill: attention FLOPs per causal (new token x context token) pair / peak.
A step of one prompt thus costs what `Engine.prefill_s` says, and one of B decodes at
context c what `Engine.step_s(B, c)` says (tests/bench/sim check both).
"""

from __future__ import annotations

from typing import Any

from bench.plan.perf import Engine
from bench.plan.specs import load_model, load_system
from bench.sim.errors import SimError
from serve.sim.profile import ProfileStep, Transfer

TOKEN_POINTS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def engine_of(model: str, system: str, tp: int = 1, kv_dtype: str = "fp8") -> Engine:
    from bench.plan.errors import PlanError

    try:
        return Engine(load_model(model), load_system(system), tp, kv_dtype)
    except PlanError as exc:
        raise SimError(str(exc)) from None


def planner_step(e: Engine, network: str | None = None) -> ProfileStep:
    """The planner's step model of engine `e` as a profile (with `network`'s KV link, if given)."""
    # The per-layer kernel floor (measured-kernel systems) is a fixed cost per step, like the overhead.
    overhead = e.system.step_overhead_ms / 1000.0 + e.model.layers * e.system.layer_floor_us * 1e-6
    # The roofline's knee (where the GEMMs stop streaming weights and start computing) is a
    # table point too: linear interpolation across it would cut the corner.
    lo, hi = e.linear_s(1), e.linear_s(1 << 20) / (1 << 20)  # weight streaming; compute per token
    knee = round(lo / hi) if hi > 0 else 0
    tokens = sorted({*TOKEN_POINTS, *((knee,) if 1 < knee < TOKEN_POINTS[-1] else ())})
    points = tuple((t, e.linear_s(t) + e.elementwise_s(t) + e.allreduce_s(t)) for t in tokens)
    decode_per_ctx = e.decode_attention_s(1, 1)
    prefill_per_pair = e.prefill_attention_s(1, 1)  # one prompt of 1 token: 1 causal pair
    transfer = None
    if network is not None:
        if network not in e.system.network_gbps:
            raise SimError(f"system {e.system.name!r} has no network {network!r}: "
                           f"{', '.join(sorted(e.system.network_gbps))}")
        gbps = e.system.network_gbps[network] * e.system.efficiency["network"]
        transfer = Transfer(gbps, 0.0)
    return ProfileStep(overhead, points, prefill_per_pair, decode_per_ctx, e.kv_bytes_per_token // e.tp, transfer,
                       label=f"planner:{e.system.name}")


def planner_profile(model: str, system: str, tp: int = 1, kv_dtype: str = "fp8",
                    network: str | None = None) -> dict[str, Any]:
    """A `pdserve.profile/1` document from the planner's model."""
    e = engine_of(model, system, tp, kv_dtype)
    step = planner_step(e, network)
    return step.to_dict(source={"kind": "planner", "model_file": "bench/plan/perf.py", "network": network},
                        model=e.model.name, system=e.system.name, tp=tp, kv_cache_dtype=kv_dtype)
