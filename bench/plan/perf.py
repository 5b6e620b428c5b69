"""The planner's performance model: step times of prefill and decode from the model's shape
against a system's peak compute and memory bandwidth. Everything the planner predicts comes
from the functions here; efficiency factors and their sources live in data/systems.json.

Per GPU, with tensor parallelism `tp` splitting weights, KV heads and FLOPs evenly:

  linear(T tokens)   = max(2 * P_lin * T / tp / (peak * e_gemm),   W / tp / (hbm * e_hbm))
                       P_lin: parameters touched per token (all layers' projections and MLP,
                       plus the LM head); W: weight bytes. A GEMM is bound by its FLOPs or by
                       streaming its weights once, whichever is slower (roofline).
  prefill_attn(S)    = 4 * L * H * d * S(S+1)/2 / tp / (peak_bf16 * e_prefill_attn)   (causal)
  decode_attn(B, c)  = max(B * c * kv_bytes_per_token / tp / (hbm * e_decode_attn),
                           4 * L * H * d * c * B / tp / (peak_bf16 * e_prefill_attn))
  allreduce(T)       = tp > 1: 2 * L all-reduces of T * hidden * 2 bytes, each
                       2 (tp - 1) / tp * bytes / (nvlink * e_nvlink) + the system's
                       all-reduce latency (allreduce_latency_us); where the system's measured
                       all-reduce curve covers the TP (allreduce_curve), that curve at the
                       message size instead
  elementwise(T)     = T * L * 2 bytes * (10 hidden + 3 intermediate + 2 (H + KV heads) d)
                       / tp / (hbm * e_hbm): RMSNorms, residual adds, SiLU*mul and RoPE read
                       and write bf16 activations once each
  layer floor        = L * layer_floor_us: what a layer's kernels take however small their work
                       (4 GEMMs and the attention kernel at their measured minimum latency;
                       0 in the roofline-only model)
  step               = overhead + linear + attention + elementwise + allreduce + layer floor
                       (no overlap)

  kv_bytes_per_token = 2 (K and V) * L * KV heads * d * bytes(kv dtype)   (fp8: 1, bf16: 2)
  KV transfer(S)     = S * kv_bytes_per_token / (network * e_network)

Aggregated (in-flight batching, vLLM V1's scheduler): B requests decode together, one token
each per step; the step's remaining token budget (`max_num_batched_tokens` - B) takes prompt
tokens. In steady state B new prompts of ISL tokens arrive per OSL steps: r = B * ISL / OSL
prompt tokens per step on average. They do not spread evenly: a prompt goes through in
chunks of c = min(ISL, budget - B) tokens (the whole prompt when chunked prefill is off),
each riding on one step, so a share f = min(1, r / c) of steps is a mixed step (B decodes +
c prompt tokens, compute-bound) and the rest decode only (weight-streaming bound):
  TPOT = f * step(B decode at ISL + OSL/2, c prefill) + (1 - f) * step(B decode)
(spreading r evenly over every step would hide the prompts' compute under the weight
streaming of a memory-bound decode step). A new prompt waits half a step on average, then
goes through in ceil(ISL / c) mixed steps: TTFT = 0.5 * TPOT + chunks * step(B, c prefill).
When r > c the steps cannot keep up with B: the sustainable rate is c / ISL prompts per
mixed step. Prompts also wait behind each other for the budget: an M/D/1 queue whose
service is a prompt's mixed steps (shared by the prompts one step's budget holds), fed at
the replica's request rate, adds rho * service / (2 (1 - rho)) to TTFT.

Aggregated, synchronized (`predict_agg_waves`): a closed-loop benchmark whose requests all
have the same ISL and OSL (the guide's load test: fixed lengths, ignore_eos) keeps its B
requests in step: they finish together and the next B prompts are prefilled together, in
ceil(B * ISL / budget) steps, before B decode together: TTFT = those prefill steps,
TPOT = step(B decode at ISL + OSL/2). It is how such a check measures, not how open traffic
behaves, so the planner ranks with the steady-state model and the checks use this one.

Disaggregated: a prefill worker runs `b` prompts per step (S_p = step of b * ISL tokens,
times `prefill_latency` for its KV connector's work); requests queue in front of it (M/D/1:
wait = rho * S_p / (2 (1 - rho))) and the highest utilisation rho <= `prefill_utilisation`
that keeps TTFT = wait + S_p + KV transfer + one decode step within target sets its capacity
rho * b / S_p. A decode worker holds B requests for OSL - 1 steps of TPOT = step(B decode at
ISL + OSL/2) * `decode_latency`, its slots `decode_occupancy` full on average: capacity
decode_occupancy * B / ((OSL - 1) * TPOT). The system serves min(P * prefill capacity,
D * decode capacity) requests/s. The four factors are the system profile's "disagg" block
(sources in data/systems.json: AIConfigurator's rate-matching and latency corrections,
which its authors calibrated against measured disaggregated deployments).

Throughput per GPU = requests/s * OSL / GPUs; per user = 1 / TPOT; request latency =
TTFT + (OSL - 1) * TPOT; concurrency = requests/s * latency (Little's law).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.plan.specs import ModelShape, SystemSpec
from serve.sim.profile import ProfileStep, from_dict

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2}
_PROFILES: dict[int, tuple[dict, ProfileStep]] = {}  # parsed measured profiles, by their document


def interpolate_us(curve: list[list[float]], size: float) -> float:
    """A measured [[bytes, us], ...] curve (ascending) at `size` bytes: linear in log-log between
    points, the smallest message's latency below them, proportional to size above them."""
    if size <= curve[0][0]:
        return curve[0][1]
    if size >= curve[-1][0]:
        return curve[-1][1] * size / curve[-1][0]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if size <= b1:
            f = math.log(size / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return curve[-1][1]  # unreachable: size < the last point


@dataclass(frozen=True)
class Engine:
    """One engine (a replica or a prefill/decode worker): model, system, TP, dtypes."""

    model: ModelShape
    system: SystemSpec
    tp: int
    kv_dtype: str = "fp8"
    weight_dtype: str = "bf16"

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def weight_bytes(self) -> float:
        return self.model.weight_params * DTYPE_BYTES[self.weight_dtype]

    def _peak(self, dtype: str) -> float:
        return self.system.peak_tflops[dtype if dtype in self.system.peak_tflops else "bf16"] * 1e12

    def linear_s(self, tokens: float) -> float:
        e = self.system.efficiency
        flops = 2 * self.model.linear_params * tokens / self.tp
        compute = flops / (self._peak(self.weight_dtype) * e["gemm"])
        memory = self.weight_bytes / self.tp / (self.system.hbm_gbps * 1e9 * e["hbm"])
        return max(compute, memory)

    def elementwise_s(self, tokens: float) -> float:
        m = self.model
        elems = 10 * m.hidden + 3 * m.intermediate + 2 * (m.heads + m.kv_heads) * m.head_dim
        return tokens * m.layers * 2 * elems / self.tp / (self.system.hbm_gbps * 1e9 * self.system.efficiency["hbm"])

    def _attn_flops_per_token_ctx(self) -> float:
        m = self.model
        return 4 * m.layers * m.heads * m.head_dim

    def prefill_attention_s(self, isl: float, prompts: float = 1.0) -> float:
        e = self.system.efficiency
        flops = self._attn_flops_per_token_ctx() * isl * (isl + 1) / 2 * prompts / self.tp
        return flops / (self._peak("bf16") * e["prefill_attention"])

    def decode_attention_s(self, batch: float, ctx: float) -> float:
        e = self.system.efficiency
        memory = batch * ctx * self.kv_bytes_per_token / self.tp / (self.system.hbm_gbps * 1e9 * e["decode_attention"])
        compute = self._attn_flops_per_token_ctx() * ctx * batch / self.tp / (self._peak("bf16") * e["prefill_attention"])
        return max(memory, compute)

    def allreduce_s(self, tokens: float) -> float:
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.hidden * 2
        curve = (self.system.allreduce_curve or {}).get(str(self.tp))
        if curve:
            return 2 * self.model.layers * interpolate_us(curve, size) * 1e-6
        per = 2 * (self.tp - 1) / self.tp * size / (self.system.nvlink_gbps * 1e9 * self.system.efficiency["nvlink"])
        return 2 * self.model.layers * (per + self.system.allreduce_latency_us * 1e-6)

    @property
    def profile(self) -> ProfileStep | None:
        """The system's measured step model, if a profile stands for it (specs.system_of_profile)."""
        doc = self.system.step_profile
        if doc is None:
            return None
        got = _PROFILES.get(id(doc))
        if got is None or got[0] is not doc:
            got = _PROFILES[id(doc)] = (doc, from_dict(doc, self.system.name))
        return got[1]

    def step_s(self, decode_batch: float, ctx: float, prefill_tokens: float = 0.0, prefill_isl: float = 0.0) -> float:
        """One engine step: `decode_batch` sequences at context `ctx` plus `prefill_tokens`
        tokens of prompts of length `prefill_isl` (their share of those prompts' attention).
        A measured profile's step model stands for the roofline when the system has one."""
        prof = self.profile
        if prof is not None:
            tokens = decode_batch + prefill_tokens
            pairs = prefill_tokens * (prefill_isl + 1) / 2 if prefill_tokens and prefill_isl else 0.0
            return (prof.overhead_s + (prof.tokens_seconds(tokens) if tokens else 0.0)
                    + prof.decode_context_s * decode_batch * ctx + prof.prefill_pair_s * pairs)
        t = self.system.step_overhead_ms / 1000.0
        t += self.linear_s(decode_batch + prefill_tokens)
        t += self.decode_attention_s(decode_batch, ctx) if decode_batch else 0.0
        if prefill_tokens and prefill_isl:
            t += self.prefill_attention_s(prefill_isl, prefill_tokens / prefill_isl)
        t += self.elementwise_s(decode_batch + prefill_tokens)
        t += self.allreduce_s(decode_batch + prefill_tokens)
        return t + self.model.layers * self.system.layer_floor_us * 1e-6

    def prefill_s(self, isl: float, prompts: int = 1) -> float:
        return self.step_s(0, 0, isl * prompts, isl)

    def max_tokens_in_kv(self) -> float:
        s = self.system
        if s.step_profile is not None:
            return float(s.step_profile["kv_cache_tokens"])
        free = s.memory_gib * s.kv_memory_fraction - self.weight_bytes / self.tp / 2**30 - s.activation_reserve_gib
        return max(0.0, free * 2**30 / (self.kv_bytes_per_token / self.tp))

    def max_batch(self, isl: int, osl: int) -> int:
        return int(self.max_tokens_in_kv() // (isl + osl))

    def kv_transfer_s(self, isl: float, network: str) -> float:
        bw = self.system.network_gbps[network] * 1e9 * self.system.efficiency["network"]
        return isl * self.kv_bytes_per_token / bw


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    request_latency_ms: float
    requests_per_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    concurrency: float
    gpus: int


def _finish(ttft_s: float, tpot_s: float, rps: float, osl: int, gpus: int) -> Prediction:
    latency = ttft_s + (osl - 1) * tpot_s
    tps = rps * osl
    return Prediction(ttft_s * 1e3, tpot_s * 1e3, latency * 1e3, rps, tps, tps / gpus, 1.0 / tpot_s,
                      rps * latency, gpus)


def predict_agg(e: Engine, batch: int, replicas: int, isl: int, osl: int) -> Prediction:
    """Aggregated: `replicas` engines of `e.tp` GPUs, `batch` requests in flight each."""
    ctx = isl + osl / 2
    budget = e.system.max_num_batched_tokens
    chunk = float(isl) if not e.system.chunked_prefill else float(min(isl, max(budget - batch, 1)))
    per_step = batch * isl / osl  # prompt tokens per step the batch needs
    mixed_share = min(1.0, per_step / chunk)
    mixed = e.step_s(batch, ctx, chunk, isl)
    tpot = mixed_share * mixed + (1 - mixed_share) * e.step_s(batch, ctx)
    chunks = math.ceil(isl / chunk)
    # Prompts queue for the budget behind each other (M/D/1): each holds `chunks` mixed steps,
    # shared with the others that fit in the same steps' budget.
    service = chunks * mixed / max(1, (budget - batch) // isl if e.system.chunked_prefill else 1)
    rate = batch / ((osl - 1) * tpot + chunks * mixed)  # prompts/s into one replica
    rho = min(rate * service, 0.95)
    ttft = 0.5 * tpot + chunks * mixed + rho * service / (2 * (1 - rho))
    latency = ttft + (osl - 1) * tpot
    rps = replicas * batch / latency
    if per_step > chunk:  # every step is mixed and still short of prompt tokens: prompt-bound
        rps = min(rps, replicas * chunk / isl / mixed)
    return _finish(ttft, tpot, rps, osl, replicas * e.tp)


def predict_agg_waves(e: Engine, batch: int, replicas: int, isl: int, osl: int) -> Prediction:
    """Aggregated under a closed loop of fixed-length requests (see the module docstring)."""
    budget = e.system.max_num_batched_tokens
    total = batch * isl
    chunks = math.ceil(total / budget)
    ttft = chunks * e.step_s(0, 0, total / chunks, isl)
    tpot = e.step_s(batch, isl + osl / 2)
    latency = ttft + (osl - 1) * tpot
    return _finish(ttft, tpot, replicas * batch / latency, osl, replicas * e.tp)


def predict_disagg_waves(pe: Engine, de: Engine, batch: int, isl: int, osl: int, network: str) -> Prediction:
    """One prefill and one decode worker under a closed loop of `batch` fixed-length requests
    (as `predict_agg_waves`): the prompts are prefilled together in ceil(batch * ISL / budget)
    steps, the prefill worker's first token is the first token (pdserve's default path), then
    the decode worker READs the KV and the batch decodes together."""
    budget = pe.system.max_num_batched_tokens
    total = batch * isl
    chunks = math.ceil(total / budget)
    ttft = chunks * pe.step_s(0, 0, total / chunks, isl) * pe.system.disagg["prefill_latency"]
    tpot = de.step_s(batch, isl + osl / 2) * de.system.disagg["decode_latency"]
    latency = ttft + pe.kv_transfer_s(isl, network) + (osl - 1) * tpot
    return _finish(ttft, tpot, batch / latency, osl, pe.tp + de.tp)


def prefill_capacity(e: Engine, prompts: int, isl: int, ttft_budget_s: float) -> tuple[float, float]:
    """(requests/s one prefill worker sustains within the TTFT budget, its TTFT there).
    `ttft_budget_s` is what is left for queueing + prefill after transfer and decode."""
    d = e.system.disagg
    s = e.prefill_s(isl, prompts) * d["prefill_latency"]
    if s > ttft_budget_s:
        return 0.0, s
    # M/D/1 wait rho*s/(2(1-rho)) + s <= budget  ->  rho <= 2(b - s) / (2(b - s) + s)
    slack = ttft_budget_s - s
    rho = min(d["prefill_utilisation"], 2 * slack / (2 * slack + s))
    wait = rho * s / (2 * (1 - rho))
    return rho * prompts / s, wait + s


def decode_tpot_s(de: Engine, decode_batch: int, isl: int, osl: int) -> float:
    """A disaggregated decode worker's step: the engine step plus its KV connector's share."""
    return de.step_s(decode_batch, isl + osl / 2) * de.system.disagg["decode_latency"]


@dataclass(frozen=True)
class DisaggUnit:
    """One prefill and one decode worker of a disaggregated layout: what P and D scale."""

    ttft_s: float
    tpot_s: float
    prefill_rps: float  # one prefill worker's requests/s within the TTFT target
    decode_rps: float  # one decode worker's

    def predict(self, prefill_workers: int, decode_workers: int, osl: int, gpus: int) -> Prediction:
        rps = min(prefill_workers * self.prefill_rps, decode_workers * self.decode_rps)
        return _finish(self.ttft_s, self.tpot_s, rps, osl, gpus)


def disagg_unit(pe: Engine, de: Engine, prefill_batch: int, decode_batch: int, isl: int, osl: int,
                ttft_target_ms: float, network: str) -> DisaggUnit:
    tpot = decode_tpot_s(de, decode_batch, isl, osl)
    transfer = pe.kv_transfer_s(isl, network)
    cap_p, ttft_p = prefill_capacity(pe, prefill_batch, isl, ttft_target_ms / 1000.0 - transfer - tpot)
    cap_d = de.system.disagg["decode_occupancy"] * decode_batch / (max(osl - 1, 1) * tpot)
    return DisaggUnit(ttft_p + transfer + tpot, tpot, cap_p, cap_d)


def predict_disagg(pe: Engine, de: Engine, prefill_workers: int, decode_workers: int, prefill_batch: int,
                   decode_batch: int, isl: int, osl: int, ttft_target_ms: float, network: str) -> Prediction:
    unit = disagg_unit(pe, de, prefill_batch, decode_batch, isl, osl, ttft_target_ms, network)
    return unit.predict(prefill_workers, decode_workers, osl, prefill_workers * pe.tp + decode_workers * de.tp)
