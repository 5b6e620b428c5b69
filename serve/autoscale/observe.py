"""What the autoscaler sees each interval, and its short forecast of the next ones.

An `Observation` is one interval's exact record: the requests that arrived (rate, their ISL
and OSL), the latencies of those that finished (every TTFT and ITL sample, so a percentile
near a target is exact, not a histogram bucket's edge), the frontend's queue, and each
pool's workers by state. `Trend` forecasts the request rate with Holt's linear smoothing
(level and slope), never below zero; length samples are pooled over the last intervals.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from serve.autoscale.model import Load, quantile


@dataclass
class Pool:
    ready: int = 0  # serving (past their start-up and warm-up)
    starting: int = 0  # launched, not yet serving
    draining: int = 0  # leaving: finishing their streams
    waiting: int = 0  # requests queued in the pool's engines (no slot or budget yet)

    @property
    def provisioned(self) -> int:
        """What the pool will have once starts finish and drains end."""
        return self.ready + self.starting


@dataclass
class Observation:
    t: float  # end of the interval (s)
    interval_s: float
    arrivals: int
    isl: list[int] = field(default_factory=list)
    osl: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    failed: int = 0
    queued: int = 0
    pools: dict[str, Pool] = field(default_factory=dict)
    step_scale: float | None = None  # measured / modelled step time of warm workers (median)
    complete: bool = True  # False: the pools could not be seen (no frontend answered)

    @property
    def rate(self) -> float:
        return self.arrivals / self.interval_s if self.interval_s > 0 else 0.0

    def percentile(self, what: str, p: float) -> float | None:
        xs = self.ttft_s if what == "ttft" else self.itl_s
        return quantile(xs, p) if xs else None

    def summary(self, p: float) -> dict:
        return {"t": round(self.t, 3), "rate": round(self.rate, 4), "arrivals": self.arrivals,
                "isl_mean": round(sum(self.isl) / len(self.isl), 1) if self.isl else None,
                "osl_mean": round(sum(self.osl) / len(self.osl), 1) if self.osl else None,
                f"ttft_p{p:g}_s": _r(self.percentile("ttft", p)), f"itl_p{p:g}_s": _r(self.percentile("itl", p)),
                "finished": len(self.ttft_s), "failed": self.failed, "queued": self.queued,
                "pools": {k: vars(v) for k, v in self.pools.items()}, "step_scale": _r(self.step_scale)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


class Trend:
    """Holt's linear smoothing of the request rate, and pooled length samples."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.2, keep: int = 3, max_samples: int = 4000) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.slope = 0.0
        self.interval_s = 0.0
        self.lengths: deque[tuple[list[int], list[int]]] = deque(maxlen=keep)
        self.max_samples = max_samples

    def update(self, obs: Observation) -> None:
        x = obs.rate
        self.interval_s = obs.interval_s
        if self.level is None:
            self.level = x
        else:
            prev = self.level
            self.level = self.alpha * x + (1 - self.alpha) * (prev + self.slope)
            self.slope = self.beta * (self.level - prev) + (1 - self.beta) * self.slope
        if obs.isl:
            self.lengths.append((list(obs.isl), list(obs.osl)))

    def level_noise(self) -> float:
        """The level's standard error in units of one interval's (exponential smoothing of
        independent counts: sqrt(alpha / (2 - alpha)), 0.58 at alpha 0.5)."""
        return math.sqrt(self.alpha / (2 - self.alpha))

    def rate_at(self, horizon_s: float) -> float:
        """The level plus the slope over the horizon, within [0, 1.25 x level]: a trend does
        not run away from a single step in the load."""
        if self.level is None:
            return 0.0
        steps = horizon_s / self.interval_s if self.interval_s > 0 else 0.0
        return min(max(0.0, self.level + self.slope * steps), 1.25 * self.level)

    def load(self, horizon_s: float, floor: float = 0.0) -> Load:
        """The load to size for: the forecast `horizon_s` ahead (never below `floor`, e.g. the
        rate just observed), with the recent intervals' length samples."""
        isl: list[int] = []
        osl: list[int] = []
        for a, b in self.lengths:
            isl += a
            osl += b
        return Load(max(self.rate_at(horizon_s), floor), _thin(isl, self.max_samples), _thin(osl, self.max_samples))


def _thin(xs: Sequence[int], n: int) -> list[int]:
    if len(xs) <= n:
        return list(xs)
    step = len(xs) / n
    return [xs[int(i * step)] for i in range(n)]
