"""Whether splitting a request pays: transport-aware conditional disaggregation.

`--conditional-disagg-tokens auto` skips the prefill stage when moving the prompt's KV costs
more than the decode worker saves by not prefilling it itself:

    split  when  transfer(uncached blocks x bytes per block) + the prefill worker's queue
                 <  the decode worker's own prefill of its uncached tokens

Every figure is measured, none configured: the frontend reports each finished stage here
(`observe_transfer`: bytes a decode worker read from a holder and how long its wait for
them took; `observe_prefill`: tokens a worker computed and how long it took to its first
token), and `SplitCosts` keeps, per worker, a decayed least-squares line through them
(`OnlineLine`: seconds = intercept + slope x size; the transfer's intercept is its per-READ
latency, its slope one over the bandwidth). A worker without enough samples of its own
borrows the pool's line (every worker's samples of that kind): the same hardware is the
usual case. With nothing measured yet the request is split (the default path), which is
also how the first samples come. A line that no sample has renewed for `STALE_S` counts as
not measured: a link judged too slow once is tried again (a split) at least that often, so
one slow sample cannot keep auto local for good.

`decide` is a pure function of the estimates; no I/O here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass

MIN_SAMPLES = 3  # samples a line needs before it predicts
DECAY = 0.98  # weight of the older samples at each new one (about the last 50 count)
STALE_S = 60.0  # a line without a new sample for this long is measured again


class OnlineLine:
    """seconds = a + b * x by exponentially decayed least squares, a >= 0 and b >= 0.
    Sizes that barely vary cannot separate a from b: then the line goes through the origin."""

    __slots__ = ("n", "w", "sx", "sy", "sxx", "sxy", "updated")

    def __init__(self) -> None:
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.updated = float("-inf")  # when the last sample came (the costs' clock)

    def add(self, x: float, y: float, at: float = 0.0) -> None:
        d = DECAY
        self.updated = at
        self.n += 1
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    @property
    def ready(self) -> bool:
        return self.n >= MIN_SAMPLES

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) with no samples."""
        if self.w <= 0:
            return 0.0, 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 1e-9 * max(1.0, mx * mx):
            b = (self.sxy / self.w - mx * my) / var
            a = my - b * mx
            if b >= 0 and a >= 0:
                return a, b
            if b < 0:  # bigger costs less: noise; the mean is the best line
                return my, 0.0
        # Through the origin (sizes all alike, or a negative intercept).
        return (0.0, self.sxy / self.sxx) if self.sxx > 0 else (my, 0.0)

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


@dataclass(frozen=True, slots=True)
class SplitEstimate:
    """The estimates behind one decision (seconds; None where nothing is measured yet)."""

    uncached_tokens: int  # the prompt's tokens the decode worker has not cached
    transfer_bytes: int | None  # what the decode worker would read: uncached blocks x bytes per block
    transfer_s: float | None  # latency + bytes / bandwidth to the chosen prefill worker
    prefill_queue_s: float | None  # the prefill worker's queued prefill work
    local_prefill_s: float | None  # the decode worker computing the uncached tokens itself
    bandwidth_gbps: float | None = None  # the transfer line's, for the explanation
    read_latency_s: float | None = None

    @property
    def split_s(self) -> float | None:
        if self.transfer_s is None:
            return None
        return self.transfer_s + (self.prefill_queue_s or 0.0)


def decide(est: SplitEstimate) -> tuple[bool, str]:
    """(split?, why). Splits unless both sides are estimated and the transfer (with the
    prefill worker's queue) costs at least what the decode worker saves."""
    if est.uncached_tokens <= 0:
        return False, "all of the prompt is cached on the decode worker"
    if est.split_s is None or est.local_prefill_s is None:
        return True, "not measured yet: split (the default)"
    if est.split_s < est.local_prefill_s:
        return True, f"transfer + queue {est.split_s * 1e3:.1f} ms < local prefill {est.local_prefill_s * 1e3:.1f} ms"
    return False, f"transfer + queue {est.split_s * 1e3:.1f} ms >= local prefill {est.local_prefill_s * 1e3:.1f} ms"


class SplitCosts:
    """Per-worker transfer and prefill lines, fed by finished stages."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.transfer: dict[str, OnlineLine] = {}  # holder (prefill worker) -> seconds per byte moved
        self.prefill: dict[str, OnlineLine] = {}  # worker -> seconds per token computed
        self.transfer_pool = OnlineLine()
        self.prefill_pool = OnlineLine()

    def observe_transfer(self, holder: str, nbytes: int, seconds: float) -> None:
        self._observe(self.transfer, self.transfer_pool, holder, nbytes, seconds)

    def observe_prefill(self, worker: str, tokens: int, seconds: float) -> None:
        self._observe(self.prefill, self.prefill_pool, worker, tokens, seconds)

    def _observe(self, own: dict[str, OnlineLine], pool: OnlineLine, worker: str, size: int, seconds: float) -> None:
        if size <= 0 or seconds < 0:
            return
        now = self.clock()
        own.setdefault(worker, OnlineLine()).add(float(size), seconds, now)
        pool.add(float(size), seconds, now)

    def forget(self, worker: str) -> None:
        """A worker gone from the pool (its lines with it)."""
        self.transfer.pop(worker, None)
        self.prefill.pop(worker, None)

    def prune(self, keep: Container[str]) -> None:
        """Forget the workers not in `keep` (the pool's now)."""
        for lines in (self.transfer, self.prefill):
            for w in [w for w in lines if w not in keep]:
                del lines[w]

    def _line(self, own: dict[str, OnlineLine], pool: OnlineLine, worker: str) -> OnlineLine | None:
        fresh = self.clock() - STALE_S
        line = own.get(worker)
        if line is not None and line.ready:
            return line if line.updated >= fresh else None
        return pool if pool.ready and pool.updated >= fresh else None

    def estimate(self, *, uncached_tokens: int, transfer_bytes: int | None, prefill_worker: str, decode_worker: str,
                 queued_prefill_tokens: int) -> SplitEstimate:
        t = self._line(self.transfer, self.transfer_pool, prefill_worker)
        pp = self._line(self.prefill, self.prefill_pool, prefill_worker)
        local = self._line(self.prefill, self.prefill_pool, decode_worker)
        bw = lat = transfer_s = None
        if transfer_bytes is not None and transfer_bytes <= 0:
            transfer_s = 0.0  # nothing to move
        elif t is not None and transfer_bytes is not None:  # None: the holder does not say its block bytes
            lat, slope = t.coefficients()
            bw = (1.0 / slope / 1e9) if slope > 0 else None
            transfer_s = t.predict(transfer_bytes)
        queue_s = pp.coefficients()[1] * queued_prefill_tokens if pp is not None else None
        local_s = local.predict(uncached_tokens) if local is not None and uncached_tokens > 0 else None
        return SplitEstimate(uncached_tokens=uncached_tokens, transfer_bytes=transfer_bytes, transfer_s=transfer_s,
                             prefill_queue_s=queue_s, local_prefill_s=local_s, bandwidth_gbps=bw, read_latency_s=lat)
