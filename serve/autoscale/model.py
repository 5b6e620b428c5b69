"""What a layout would deliver under a load: TTFT and ITL at a percentile, from an engine step
model (the simulator's: `serve.sim.timing.StepModel`, e.g. a `pdserve.profile/1` measured on
the hardware or written by the planner), scaled by what the workers' steps measure online.

Pure functions of (layout, load, engine): no clocks, no I/O.

Disaggregated (P prefill, D decode workers):
- Prefill: each prompt is one step of its ISL tokens (s(isl)); the pool is an M/G/c queue
  (c = P) fed at the request rate. The wait follows Allen-Cunneen (Erlang C times the
  service variability), its tail exponential with the queue's drain rate; TTFT at the
  percentile is that of the wait plus the prompt's own service (over the ISL sample), not
  the sum of their two percentiles.
  With P at utilisation >= 1 the prediction is infinite.
- Decode: by Little's law a decode worker holds n = rate x (OSL - 1) x ITL / D requests; ITL is
  the step of n contexts at ISL + OSL/2, solved as a fixed point; its percentile adds the
  Poisson spread of n (n + z sqrt(n), at most the slots) and the longest contexts. A worker
  has c slots (`max_num_seqs`, fewer when its KV holds fewer whole requests): a request
  that finds them full waits for one, an M/G/c queue whose service is a request's OSL - 1
  steps. The wait comes between the first token (the prefill's, streamed at once) and the
  second, so it adds wait / (OSL - 1) to the request's inter-token latency as clients
  measure it. With n >= c the queue grows without bound: the prediction is infinite.
Aggregated (A workers): each one takes rate / A; a share f of its steps carries a prompt
(mixed), the rest decode only (as the planner's aggregated model); ITL's percentile is the
mixed step once more than (100 - percentile)% of steps are mixed; TTFT is an M/G/1 wait for
the prompt's mixed step plus that step (the percentile of their sum, as for prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from serve.sim.timing import StepModel

INF = float("inf")


@dataclass(frozen=True)
class Load:
    """The traffic a layout is sized for: requests/s and samples of prompt and output lengths."""

    rate: float
    isl: Sequence[int]
    osl: Sequence[int]

    @property
    def isl_mean(self) -> float:
        return sum(self.isl) / len(self.isl) if self.isl else 0.0

    @property
    def osl_mean(self) -> float:
        return sum(self.osl) / len(self.osl) if self.osl else 0.0


@dataclass(frozen=True)
class Engine:
    """One worker's engine: its step model, scaled by the measured/modelled step ratio."""

    step: StepModel
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_tokens: int = 10**9  # KV capacity in tokens (blocks x block size)
    scale: float = 1.0

    def prefill_s(self, isl: int) -> float:
        return self.step.step_seconds([], [(0, isl)]) * self.scale

    def decode_s(self, n: float, ctx: float) -> float:
        k = max(1, round(n))
        return self.step.step_seconds([int(ctx)] * k, []) * self.scale

    def mixed_s(self, n: float, ctx: float, chunk: int) -> float:
        k = max(0, round(n))
        return self.step.step_seconds([int(ctx)] * k, [(0, chunk)]) * self.scale


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float
    detail: dict[str, float]

    def meets(self, ttft_s: float, itl_s: float, margin: float = 1.0) -> bool:
        return self.ttft_s <= ttft_s * margin and self.itl_s <= itl_s * margin


def z_of(percentile: float) -> float:
    """The standard normal quantile at `percentile` (bisection on erf)."""
    p = min(max(percentile / 100.0, 1e-6), 1 - 1e-6)
    lo, hi = -8.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def quantile(xs: Sequence[float], percentile: float) -> float:
    """Exact percentile of a sample (linear interpolation between order statistics)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * percentile / 100.0
    i = int(k)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (k - i)


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in M/M/c with offered load a = rate x service."""
    if a >= c:
        return 1.0
    if c > a + 12 * math.sqrt(a) + 30:  # far more servers than work: no arrival waits (< 1e-20)
        return 0.0
    term, total = 1.0, 1.0
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c / (1 - a / c)
    return last / (total + last)


def wait_law(c: int, rate: float, service: Sequence[float]) -> tuple[float, float]:
    """The wait in an M/G/c queue (Allen-Cunneen, exponential tail): (P(wait), the tail's
    rate), P(W > x) = P(wait) exp(-rate x); P(wait) 1 and rate 0 when the queue is overloaded."""
    if rate <= 0 or not service:
        return 0.0, INF
    mean = sum(service) / len(service)
    if mean <= 0:
        return 0.0, INF
    var = sum((s - mean) ** 2 for s in service) / len(service)
    cs2 = var / (mean * mean)
    a = rate * mean
    if a >= c:
        return 1.0, 0.0
    return erlang_c(c, a), (c / mean - rate) * 2 / (1 + cs2)


def queue_wait(c: int, rate: float, service: Sequence[float], percentile: float) -> float:
    """The wait's percentile in an M/G/c queue (Allen-Cunneen, exponential tail)."""
    pw, drain = wait_law(c, rate, service)
    if drain == 0.0:
        return INF
    tail = 1 - percentile / 100.0
    if pw <= tail:
        return 0.0
    return math.log(pw / tail) / drain


def wait_plus_service(c: int, rate: float, service: Sequence[float], percentile: float) -> float:
    """The percentile of (wait + own service), the wait as `wait_law` and independent of the
    service sample: P(W + S > t) = mean over s of P(W > t - s). Adding the two percentiles
    instead overstates it (both tails at once). Bisection on t over at most 256 service
    quantiles (never below the service's own percentile)."""
    pw, drain = wait_law(c, rate, service)
    if drain == 0.0:
        return INF
    if pw <= 0.0:  # nobody waits
        return quantile(service, percentile)
    s = sorted(service)
    if len(s) > 256:
        s = [s[(len(s) - 1) * i // 255] for i in range(256)]
    tail = 1 - percentile / 100.0

    def exceed(t: float) -> float:
        return sum(1.0 if x > t else pw * math.exp(-drain * (t - x)) for x in s) / len(s)

    # A bracket: past the longest service plus the wait's own percentile, P(W + S > t) <= tail.
    lo, hi = 0.0, s[-1] + (math.log(pw / tail) / drain if pw > tail else 0.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exceed(mid) > tail else (lo, mid)
        if hi - lo <= 1e-6 * hi:
            break
    return hi


def decode_slots(e: Engine, isl_mean: float, osl_mean: float) -> int:
    """Requests a decode worker serves at once: its batch cap, or the whole requests
    (prompt and answer) its KV holds, whichever is fewer."""
    return int(min(e.max_num_seqs, e.kv_tokens // max(1.0, isl_mean + osl_mean)))


def _decode_itl(e: Engine, per_worker_rate: float, osl: float, ctx: float, slots: int) -> float:
    """The decode step time n requests in flight give, n = rate x (OSL - 1) x ITL (a fixed
    point, the batch at most `slots`); infinite when the slots cannot keep up (n >= slots)."""
    if slots < 1 or per_worker_rate * max(osl - 1, 1) * e.decode_s(slots, ctx) >= slots:
        return INF  # even a full batch finishes requests slower than they come: the slot queue grows
    itl = e.decode_s(1, ctx)
    for _ in range(50):
        n = min(per_worker_rate * max(osl - 1, 1) * itl, slots)
        nxt = e.decode_s(n, ctx)
        if abs(nxt - itl) <= 1e-6 * itl:
            return nxt
        itl = nxt
    return itl


def predict_disagg(prefill: Engine, decode: Engine, p: int, d: int, load: Load, percentile: float) -> Prediction:
    if p < 1 or d < 1:
        return Prediction(INF, INF, {})
    isl, osl = load.isl or [1], load.osl or [1]
    service = [prefill.prefill_s(x) for x in isl]
    wait = queue_wait(p, load.rate, service, percentile)
    ttft = wait_plus_service(p, load.rate, service, percentile)
    osl_mean = max(load.osl_mean, 1.0)
    ctx = load.isl_mean + osl_mean / 2
    slots = decode_slots(decode, load.isl_mean, osl_mean)
    per_worker = load.rate / d
    itl_mean = _decode_itl(decode, per_worker, osl_mean, ctx, slots)
    if itl_mean == INF:
        return Prediction(ttft, INF, {"prefill_wait_s": wait, "decode_slots": slots})
    n = per_worker * max(osl_mean - 1, 1) * itl_mean
    n_hi = n + z_of(percentile) * math.sqrt(max(n, 0.0))
    ctx_hi = quantile(isl, percentile) + quantile(osl, percentile) / 2
    step = decode.decode_s(min(n_hi, slots), max(ctx, ctx_hi * 0.5 + ctx * 0.5))
    # The wait for a slot: each request holds one for its OSL - 1 steps.
    slot_wait = queue_wait(slots, per_worker, [max(x - 1, 1) * itl_mean for x in osl], percentile)
    itl = step + slot_wait / max(osl_mean - 1, 1)
    rho_p = load.rate * (sum(service) / len(service)) / p
    return Prediction(ttft, max(itl, itl_mean), {"prefill_wait_s": wait, "prefill_utilisation": rho_p,
                                                 "decode_batch": n, "itl_mean_s": itl_mean,
                                                 "decode_slot_wait_s": slot_wait, "decode_slots": slots})


def predict_agg(e: Engine, a: int, load: Load, percentile: float, chunked: bool = True) -> Prediction:
    if a < 1:
        return Prediction(INF, INF, {})
    rate = load.rate / a
    isl_mean, osl_mean = load.isl_mean or 1, load.osl_mean or 1
    ctx = isl_mean + osl_mean / 2
    itl = e.decode_s(1, ctx)
    mixed = share = chunk = 0.0
    for _ in range(50):
        n = rate * max(osl_mean - 1, 1) * itl
        if n > e.max_num_seqs or n * ctx > e.kv_tokens:
            return Prediction(INF, INF, {"batch": n})
        chunk = min(isl_mean, max(e.max_num_batched_tokens - n, 1)) if chunked else isl_mean
        steps_per_prompt = math.ceil(isl_mean / chunk)
        mixed = e.mixed_s(n, ctx, int(chunk))
        share = min(1.0, rate * steps_per_prompt * itl)  # mixed steps per step
        if share >= 1.0:
            return Prediction(INF, INF, {"batch": n, "mixed_share": share})
        nxt = share * mixed + (1 - share) * e.decode_s(n, ctx)
        if abs(nxt - itl) <= 1e-6 * itl:
            itl = nxt
            break
        itl = nxt
    itl_p = mixed if share > 1 - percentile / 100.0 else itl
    service = [math.ceil(x / chunk) * mixed for x in (load.isl or [1])]
    wait = queue_wait(1, rate, service, percentile)
    ttft = 0.5 * itl + wait_plus_service(1, rate, service, percentile)
    return Prediction(ttft, max(itl_p, itl), {"batch": rate * osl_mean * itl, "mixed_share": share,
                                              "prompt_wait_s": wait, "itl_mean_s": itl})
