"""The autoscaler's decision: the cheapest layout that meets the TTFT and ITL targets at the
load it forecasts, reached in bounded steps, with hysteresis.

Each interval (`Controller.step`):
1. The load: the larger of the rate just observed and Holt's forecast one start-up time
   plus one interval ahead (a worker started now serves from then on), with the recent
   intervals' ISL/OSL samples; plus, per pool, the requests waiting in its engines spread
   over a start-up time (a backlog must drain too). A pool scaled down within
   `reverse_guard_s` grows again only for that load with each rate estimate less `up_rate_z`
   (1) of its standard errors (a Poisson count's; the smoothed level's is 0.58 of it): one
   noisy interval alone does not undo a scale-down, a sustained rise does. A pool needs the
   larger of its count for those samples and for the last interval's alone (at least
   `MIN_SAMPLES` of them): when prompts turn long, the pooled samples lag by the intervals
   they pool.
2. Under the model (serve/autoscale/model.py) TTFT depends on the prefill pool and ITL on
   the decode pool, so each pool's smallest count that meets its target is found on its
   own (a scan up from the pool's minimum): `need`. The smallest that meets it with margin
   (`down_margin` x target) at the rate plus `down_rate_z` (2) standard errors of one
   interval's arrival count (a Poisson count: sqrt(rate / interval); 16% at 1.3 req/s over
   30 s, 4% at 22) is `comfortable`: a scale-down that a noisy interval would undo is not
   taken.
   Aggregated: one pool, both targets.
3. Feedback: when the interval's measured percentile missed a target although the model
   says the current pool meets it, the model is optimistic there: that pool needs one worker
   more than it has (TTFT: prefill or agg; ITL: decode or agg), when two intervals in a row
   missed, the load not falling, and its last scale-up has had a start-up time and an
   interval to show (a backlog drains on its own).
4. Up at once (at most `max(max_step_up_workers, max_step_up x current)` workers per
   interval, as Kubernetes' HPA defaults to the larger of +4 pods and +100% per period;
   workers still starting count as capacity). Down only to `comfortable`, by at most
   `max(1, max_step_down x current)`, once the smaller pool has been enough with margin for
   `down_sustain_s`, never while the trend rises (a scale-down there is soon undone), never
   within `reverse_guard_s` (at least 10 minutes, whatever
   `cooldown_s` is) of this pool's last scale-up, and at most once per `cooldown_s`.
Every decision carries the observation, the load it sized for, the candidates it scored
with their predictions, and its reason (GET /autoscaler shows the last ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serve.autoscale.model import INF, Engine, Load, Prediction, predict_agg, predict_disagg
from serve.autoscale.observe import Observation, Pool, Trend

MIN_REVERSE_GUARD_S = 600.0
MIN_SAMPLES = 20  # requests in one interval for its own length distribution to size a pool


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    itl_s: float
    percentile: float = 90.0


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64
    min_agg: int = 1
    max_agg: int = 64
    max_workers: int = 128

    def of(self, pool: str) -> tuple[int, int]:
        return {"prefill": (self.min_prefill, self.max_prefill), "decode": (self.min_decode, self.max_decode),
                "agg": (self.min_agg, self.max_agg)}[pool]


@dataclass(frozen=True)
class Policy:
    mode: str  # "disagg" | "agg"
    targets: Targets
    bounds: Bounds = Bounds()
    interval_s: float = 30.0
    cooldown_s: float = 60.0
    startup_s: float = 60.0
    down_margin: float = 0.8
    down_sustain_s: float = 90.0
    reverse_guard_s: float = MIN_REVERSE_GUARD_S
    max_step_up: float = 2.0
    # A pool of one or two cannot double its way to a shifted load in one interval: a live
    # ISL shift needed 5 prefill workers from 1, and +200% gave 3, one interval (and one
    # missed window) later. Kubernetes' HPA scales up by at least 4 pods a period by default.
    max_step_up_workers: int = 4
    max_step_down: float = 0.25
    # A scale-down must hold through the noisiest interval the next 10 minutes (the reversal
    # guard) are likely to bring: about 20 intervals of 30 s, whose largest Poisson count lies
    # about 2 standard errors above the mean. With 1 SE a live pool loss at 2.4 req/s took a
    # prefill worker off on a low interval (2.27 req/s) and added it back 270 s later at 2.87.
    down_rate_z: float = 2.0
    # Within the reversal guard of a pool's scale-down, the rate just observed and the trend's
    # forecast count by their lower bounds, `up_rate_z` standard errors below: in a live ISL
    # shift at 1.8 req/s a 30-s interval of 75 arrivals (2.5 req/s, the trace's own Poisson
    # excursion) added workers to both pools 60 s after they were taken off; with the observed
    # rate's bound alone, Holt's forecast (2.35) still did. Everywhere (the diurnal's rise),
    # the bound cost a window at 2 prefill workers (one interval later).
    up_rate_z: float = 1.0

    @property
    def pools(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.mode == "disagg" else ("agg",)


@dataclass
class Decision:
    t: float
    current: dict[str, int]
    desired: dict[str, int]
    reason: str
    load: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    observation: dict[str, Any] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)  # what the actuator did for it

    @property
    def changed(self) -> bool:
        return self.current != self.desired

    def to_dict(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "current": self.current, "desired": self.desired, "changed": self.changed,
                "reason": self.reason, "load": self.load, "candidates": self.candidates,
                "observation": self.observation, "actions": self.actions}


class Controller:
    """One autoscaler's state across intervals. `engines` maps each pool to its Engine."""

    def __init__(self, policy: Policy, engines: dict[str, Engine]) -> None:
        self.policy = policy
        self.engines = dict(engines)
        self.trend = Trend()
        self.scale = 1.0
        self.enough_since: dict[str, float | None] = {p: None for p in policy.pools}
        self.last_up: dict[str, float] = {p: -math.inf for p in policy.pools}
        self.last_down: dict[str, float] = {p: -math.inf for p in policy.pools}
        self.last_change: dict[str, float] = {p: -math.inf for p in policy.pools}
        self.prev_missed: set[str] = set()
        self.prev_rate: float | None = None

    # -- the model ---------------------------------------------------------------------------
    def _engine(self, pool: str) -> Engine:
        e = self.engines[pool]
        return Engine(e.step, e.max_num_seqs, e.max_num_batched_tokens, e.kv_tokens, e.scale * self.scale)

    def predict(self, counts: dict[str, int], load: Load) -> Prediction:
        pct = self.policy.targets.percentile
        if self.policy.mode == "disagg":
            return predict_disagg(self._engine("prefill"), self._engine("decode"), counts.get("prefill", 0),
                                  counts.get("decode", 0), load, pct)
        return predict_agg(self._engine("agg"), counts.get("agg", 0), load, pct)

    def _meets(self, pool: str, n: int, load: Load, margin: float) -> bool:
        t = self.policy.targets
        if self.policy.mode == "agg":
            return self.predict({"agg": n}, load).meets(t.ttft_s, t.itl_s, margin)
        big = 10**6  # the other pool unconstrained: each pool answers for its own metric
        if pool == "prefill":
            return self.predict({"prefill": n, "decode": big}, load).ttft_s <= t.ttft_s * margin
        return self.predict({"prefill": big, "decode": n}, load).itl_s <= t.itl_s * margin

    def smallest(self, pool: str, load: Load, margin: float = 1.0) -> int:
        """The pool's smallest count within its bounds that meets its target(s); its maximum
        when none does."""
        lo, hi = self.policy.bounds.of(pool)
        n = lo
        while n < hi and not self._meets(pool, n, load, margin):
            n = n + 1 if n < 8 else n + max(1, n // 8)  # finer where one worker matters more
        return min(n, hi)

    # -- one interval ------------------------------------------------------------------------
    def step(self, obs: Observation) -> Decision:
        pol = self.policy
        self.trend.update(obs)
        if obs.step_scale is not None and obs.step_scale > 0:
            self.scale = 0.7 * self.scale + 0.3 * obs.step_scale
        now_load = self.trend.load(0.0, floor=obs.rate)
        ahead = self.trend.load(pol.startup_s + pol.interval_s, floor=obs.rate)
        load = ahead if ahead.rate >= now_load.rate else now_load  # scale-downs hold at its upper bound
        rising = ahead.rate > now_load.rate  # the trend: no scale-down on the way up
        # what a pool scaled down within the guard must carry before it grows again: the same
        # load, each rate estimate less `up_rate_z` of its standard errors
        holt = max(self.trend.rate_at(0.0), self.trend.rate_at(pol.startup_s + pol.interval_s))
        level_se = self.trend.level_noise() * self._se(self.trend.rate_at(0.0))
        lower = Load(max(0.0, obs.rate - pol.up_rate_z * self._se(obs.rate), holt - pol.up_rate_z * level_se),
                     load.isl, load.osl)
        current = {p: obs.pools.get(p).provisioned if obs.pools.get(p) else 0 for p in pol.pools}
        desired = dict(current)
        reasons = []
        # A backlog in a pool's engines is extra load for that pool: drained within a start-up time.
        sized = {p: self._with_backlog(load, obs.pools.get(p)) for p in pol.pools}
        guard = max(pol.reverse_guard_s, MIN_REVERSE_GUARD_S)
        up_load = {p: lower if obs.t - self.last_down[p] < guard else load for p in pol.pools}
        need = {p: self._need(p, up_load[p], obs) for p in pol.pools}
        comfortable = {p: max(need[p], self.smallest(p, self._upper(sized[p]), pol.down_margin)) for p in pol.pools}
        missed = self._missed(obs, current, load)
        for p in pol.pools:
            lo, hi = pol.bounds.of(p)
            cur = current[p]
            want = max(need[p], cur + 1 if p in missed else 0, lo)
            if cur < want:
                step = max(1, pol.max_step_up_workers, math.ceil(cur * pol.max_step_up))
                desired[p] = min(want, cur + step, hi)
                reasons.append(f"{p} {cur}->{desired[p]}: " + (
                    f"measured p{pol.targets.percentile:g} missed its target at {cur}" if p in missed and need[p] <= cur
                    else f"{need[p]} needed for {up_load[p].rate:.2f} req/s"))
                self.enough_since[p] = None
                continue
            if comfortable[p] < cur and p not in missed:
                since = self.enough_since[p]
                if since is None:
                    self.enough_since[p] = since = obs.t
                held = obs.t - since
                if held < pol.down_sustain_s:
                    reasons.append(f"{p} holds {cur}: {comfortable[p]} would do, for {held:.0f} of "
                                   f"{pol.down_sustain_s:.0f} s")
                elif rising:
                    reasons.append(f"{p} holds {cur}: the load is rising ({now_load.rate:.2f} req/s now, "
                                   f"{ahead.rate:.2f} forecast)")
                elif obs.t - self.last_up[p] < guard:
                    reasons.append(f"{p} holds {cur}: scaled up {obs.t - self.last_up[p]:.0f} s ago (< {guard:.0f} s)")
                elif obs.t - self.last_change[p] < pol.cooldown_s:
                    reasons.append(f"{p} holds {cur}: cooling down")
                else:
                    step = max(1, math.floor(cur * pol.max_step_down))
                    desired[p] = max(comfortable[p], cur - step, lo)
                    reasons.append(f"{p} {cur}->{desired[p]}: {comfortable[p]} meet the targets with "
                                   f"{pol.down_margin:.0%} margin for {held:.0f} s")
            else:
                self.enough_since[p] = None
        total = sum(desired.values())
        if total > pol.bounds.max_workers:  # trim what was added, the pool furthest over its need first
            for p in sorted(pol.pools, key=lambda q: desired[q] - need[q], reverse=True):
                cut = min(total - pol.bounds.max_workers, max(0, desired[p] - max(current[p], pol.bounds.of(p)[0])))
                desired[p] -= cut
                total -= cut
            reasons.append(f"capped at --max-workers {pol.bounds.max_workers}")
        for p in pol.pools:
            if desired[p] != current[p]:
                self.last_change[p] = obs.t
                if desired[p] < current[p]:
                    self.last_down[p] = obs.t
                if desired[p] > current[p]:
                    self.last_up[p] = obs.t
                    self.enough_since[p] = None  # a scale-down keeps its clock: the next step follows
        return Decision(obs.t, current, desired, "; ".join(reasons) or "targets met; no change",
                        {"rate": round(load.rate, 4), "observed_rate": round(obs.rate, 4),
                         "rate_lower_bound": round(lower.rate, 4),  # sized for within a scale-down's guard
                         "isl_mean": round(load.isl_mean, 1), "osl_mean": round(load.osl_mean, 1),
                         "step_scale": round(self.scale, 4)},
                        self._candidates(current, desired, need, load), obs.summary(pol.targets.percentile))

    def _need(self, pool: str, load: Load, obs: Observation) -> int:
        """The pool's smallest count for `load` plus its backlog, and for the last interval's
        lengths alone when it has `MIN_SAMPLES` requests (a shift shows there first)."""
        n = self.smallest(pool, self._with_backlog(load, obs.pools.get(pool)))
        if len(obs.isl) >= MIN_SAMPLES:
            latest = Load(load.rate, list(obs.isl), list(obs.osl))
            n = max(n, self.smallest(pool, self._with_backlog(latest, obs.pools.get(pool))))
        return n

    def _upper(self, load: Load) -> Load:
        """The load at its rate's upper bound: `down_rate_z` Poisson standard errors of one
        interval's count above it."""
        return Load(load.rate + self.policy.down_rate_z * self._se(load.rate), load.isl, load.osl)

    def _se(self, rate: float) -> float:
        """One Poisson standard error of a rate measured over one interval."""
        return math.sqrt(max(rate, 0.0) / max(self.policy.interval_s, 1e-9))

    def _with_backlog(self, load: Load, pool: Pool | None) -> Load:
        if pool is None or pool.waiting <= 0:
            return load
        drain_s = max(self.policy.startup_s, self.policy.interval_s)
        return Load(load.rate + pool.waiting / drain_s, load.isl, load.osl)

    def _missed(self, obs: Observation, current: dict[str, int], load: Load) -> set[str]:
        """Pools whose target the interval missed although the model says they meet it, with
        nothing of theirs still starting and no scale-up of theirs within a start-up time
        (the last one's effect is not measured yet; a backlog drains on its own)."""
        t, out = self.policy.targets, set()
        if len(obs.ttft_s) < 20:  # too few requests for a percentile
            return out
        ttft, itl = obs.percentile("ttft", t.percentile), obs.percentile("itl", t.percentile)
        if self.policy.mode == "agg":
            if ((ttft or 0) > t.ttft_s or (itl or 0) > t.itl_s) and self._settled(obs, "agg"):
                out.add("agg")
            return out
        if (ttft or 0) > t.ttft_s and self._meets("prefill", current["prefill"], load, 1.0):
            out.add("prefill")
        if (itl or 0) > t.itl_s and self._meets("decode", current["decode"], load, 1.0):
            out.add("decode")
        out = {p for p in out if self._settled(obs, p)}
        # Twice in a row, the load not falling: a single interval's miss is often a backlog
        # draining after a scale-up, not a pool too small.
        prev, self.prev_missed = self.prev_missed, out
        falling = self.prev_rate is not None and obs.rate < 0.9 * self.prev_rate
        self.prev_rate = obs.rate
        return set() if falling else out & prev

    def _settled(self, obs: Observation, pool: str) -> bool:
        pool_obs = obs.pools.get(pool)
        starting = pool_obs.starting if pool_obs else 0
        return starting == 0 and obs.t - self.last_up[pool] >= self.policy.startup_s + self.policy.interval_s

    def _candidates(self, current: dict[str, int], desired: dict[str, int], need: dict[str, int],
                    load: Load) -> list[dict[str, Any]]:
        seen, out = set(), []
        for c in (current, desired, need, *({**need, p: max(1, need[p] - 1)} for p in need)):
            key = tuple(sorted(c.items()))
            if key in seen:
                continue
            seen.add(key)
            pred = self.predict(c, load)
            t = self.policy.targets
            out.append({"layout": dict(c), "workers": sum(c.values()), "ttft_s": _r(pred.ttft_s),
                        "itl_s": _r(pred.itl_s), "meets": pred.meets(t.ttft_s, t.itl_s)})
        return out


def _r(x: float) -> float | None:
    return None if x == INF else round(x, 5)
