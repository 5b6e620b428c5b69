"""Search: every aggregated and disaggregated layout within the GPU budget, predicted with
perf.py, filtered by the TTFT and TPOT targets, ranked by output tokens/s per GPU of the
budget: a layout that leaves GPUs idle is charged for them (the cluster's throughput over
all its GPUs, as AIConfigurator ranks by `tokens/s/gpu_cluster`), so 5P+1D on 6 of 8 GPUs
is not ranked as if the other 2 cost nothing.

Aggregated: TP in {1, 2, 4, 8} (within one node), replicas = GPUs // TP, batch from 1 up
to what the KV cache holds. Disaggregated: prefill TP and prompts per step, decode TP and
batch, and every split of the budget into P prefill and D decode workers. Ties go to the
layout with more tokens/s per user, then fewer GPUs. `Layout.to_plan` is the row plan.json
writes (serve.deploy.plan.PlannedLayout); the targets are plan.json's Targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Iterator

from bench.plan.perf import Engine, Prediction, disagg_unit, predict_agg
from bench.plan.specs import ModelShape, SystemSpec
from serve.deploy.plan import PlannedLayout, Targets

TPS = (1, 2, 4, 8)
PREFILL_BATCHES = (1, 2, 4, 8)


def batch_candidates(limit: int) -> list[int]:
    out = list(range(1, 8)) + list(range(8, 64, 4)) + list(range(64, 256, 8)) + list(range(256, 2049, 32))
    return [b for b in out if b <= limit]


@dataclass(frozen=True)
class Layout:
    mode: str  # "agg" | "disagg"
    pred: Prediction
    tp: int = 1
    replicas: int = 0
    batch: int = 0
    prefill_tp: int = 0
    prefill_workers: int = 0
    prefill_batch: int = 0
    decode_tp: int = 0
    decode_workers: int = 0
    decode_batch: int = 0
    meets: bool = True

    @property
    def name(self) -> str:
        if self.mode == "agg":
            return f"agg {self.replicas}x tp{self.tp} batch {self.batch}"
        return (f"disagg {self.prefill_workers}P(tp{self.prefill_tp}, {self.prefill_batch}/step) + "
                f"{self.decode_workers}D(tp{self.decode_tp}, batch {self.decode_batch})")

    def to_plan(self) -> PlannedLayout:
        """The layout as plan.json writes it: its pools, its name and its prediction, flat."""
        own = {k: getattr(self, k) for k in ("mode", "tp", "replicas", "batch", "prefill_tp", "prefill_workers",
                                              "prefill_batch", "decode_tp", "decode_workers", "decode_batch", "meets")}
        return PlannedLayout(**own, layout=self.name, **asdict(self.pred))


def _per_budget(p: Prediction, total: int) -> Prediction:
    """The layout's output tokens/s over every GPU of the budget (`p.gpus` stays the GPUs it uses)."""
    return replace(p, tokens_per_s_per_gpu=p.tokens_per_s / max(total, 1))


def _meets(p: Prediction, t: Targets) -> bool:
    return p.ttft_ms <= t.ttft_ms and p.tpot_ms <= t.tpot_ms and p.requests_per_s > 0


def _tps(total: int, system: SystemSpec) -> list[int]:
    if system.step_profile is not None:  # measured at one TP: that one only
        tp = int(system.step_profile.get("tp", 1))
        return [tp] if tp <= total else []
    return [tp for tp in TPS if tp <= total and tp <= system.gpus_per_node]


def agg_layouts(model: ModelShape, system: SystemSpec, total: int, isl: int, osl: int, t: Targets,
                kv_dtype: str, weight_dtype: str) -> Iterator[Layout]:
    for tp in _tps(total, system):
        e = Engine(model, system, tp, kv_dtype, weight_dtype)
        replicas = total // tp
        for b in batch_candidates(e.max_batch(isl, osl)):
            p = _per_budget(predict_agg(e, b, replicas, isl, osl), total)
            yield Layout("agg", p, tp=tp, replicas=replicas, batch=b, meets=_meets(p, t))


def disagg_layouts(model: ModelShape, system: SystemSpec, total: int, isl: int, osl: int, t: Targets,
                   kv_dtype: str, weight_dtype: str, network: str) -> Iterator[Layout]:
    if total < 2:
        return
    tps = _tps(total - 1, system)
    engines = {tp: Engine(model, system, tp, kv_dtype, weight_dtype) for tp in tps}
    for dtp in tps:
        de = engines[dtp]
        for db in batch_candidates(de.max_batch(isl, osl)):
            for ptp in tps:
                pe = engines[ptp]
                for pb in PREFILL_BATCHES:
                    if pb > 1 and pb * isl > system.max_num_batched_tokens:
                        continue
                    if pe.max_batch(isl, 1) < pb:
                        continue
                    unit = disagg_unit(pe, de, pb, db, isl, osl, t.ttft_ms, network)
                    if unit.prefill_rps <= 0 or unit.decode_rps <= 0:
                        continue
                    cap_p, cap_d = unit.prefill_rps, unit.decode_rps  # one worker of each role
                    for P in range(1, (total - dtp) // ptp + 1):
                        D_max = (total - P * ptp) // dtp
                        if D_max < 1:
                            break
                        # the fewest decode workers that keep up with P prefill workers, or all
                        need = max(1, min(D_max, -(-P * cap_p // cap_d)))
                        for D in {int(need), max(1, int(need) - 1)}:
                            p = _per_budget(unit.predict(P, D, osl, P * ptp + D * dtp), total)
                            yield Layout("disagg", p, prefill_tp=ptp, prefill_workers=P, prefill_batch=pb,
                                         decode_tp=dtp, decode_workers=D, decode_batch=db, meets=_meets(p, t))


def rank(layouts: list[Layout]) -> list[Layout]:
    return sorted(layouts, key=lambda x: (-x.pred.tokens_per_s_per_gpu, -x.pred.tokens_per_s_per_user, x.pred.gpus))


def pareto(layouts: list[Layout], t: Targets) -> list[Layout]:
    """Layouts meeting the TTFT target that no other such layout beats on both tokens/s/GPU
    and tokens/s/user (TPOT is the x axis, so it is not filtered)."""
    pts = [x for x in layouts if x.pred.ttft_ms <= t.ttft_ms and x.pred.requests_per_s > 0]
    front: list[Layout] = []
    for x in sorted(pts, key=lambda x: (-x.pred.tokens_per_s_per_user, -x.pred.tokens_per_s_per_gpu)):
        if not front or x.pred.tokens_per_s_per_gpu > front[-1].pred.tokens_per_s_per_gpu:
            front.append(x)
    return front
