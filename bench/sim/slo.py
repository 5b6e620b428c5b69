"""SLO accounting for the autoscaler scenarios (bench/sim/scenarios.py, offline): per-minute
windows meeting both latency targets, the misses each load event caused, and decisions
reversed within 10 minutes. The targets are the scenarios' (live runs stretch them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TTFT_S, ITL_S, PERCENTILE = 2.0, 0.060, 90.0
WINDOW_S = 60.0


def lost_with_worker(r: Any, killed: list[str]) -> bool:
    """A request in flight on a worker the scenario killed, which ended in that worker's
    death (`Cluster.kill`): no layout keeps it."""
    return r.error is not None and any(f"worker {url} died" in r.error.message for url in killed)


def windows(records: list[Any], killed: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Per arrival minute: p90 TTFT and ITL, failures, and whether both targets held. A window
    is met when both p90s are within target and no request failed, apart from those lost with
    a worker the scenario killed (counted in `lost`): every layout loses them, autoscaled or
    static, so they cannot tell layouts apart."""
    from serve.autoscale.model import quantile

    if not records:
        return []
    base = min(r.start_ns for r in records)
    by: dict[int, list[Any]] = {}
    for r in records:
        by.setdefault(int((r.start_ns - base) / 1e9 // WINDOW_S), []).append(r)
    out = []
    for k in sorted(by):
        rs = by[k]
        ok = [r for r in rs if r.ok]
        lost = sum(1 for r in rs if lost_with_worker(r, list(killed)))
        ttft = [(r.content_ns[0] - r.start_ns) / 1e9 for r in ok if r.content_ns]
        itl = [(r.content_ns[-1] - r.content_ns[0]) / 1e9 / (len(r.content_ns) - 1) for r in ok if len(r.content_ns) > 1]
        t90, i90 = quantile(ttft, PERCENTILE), quantile(itl, PERCENTILE)
        out.append({"minute": k, "requests": len(rs), "failed": len(rs) - len(ok), "lost": lost,
                    "ttft_p90_s": round(t90, 4), "itl_p90_s": round(i90, 5),
                    "met": len(ok) + lost == len(rs) and t90 <= TTFT_S and i90 <= ITL_S})
    return out


def reversal_count(moves: Iterable[tuple[float, dict[str, int], dict[str, int]]], within_s: float = 600.0) -> int:
    """Pool-level direction changes within `within_s` of that pool's previous change, over
    (t, current, desired) decisions in time order."""
    n, last = 0, {}
    for t, current, desired in moves:
        for p in desired:
            delta = desired[p] - current[p]
            if delta == 0:
                continue
            sign = 1 if delta > 0 else -1
            if p in last and last[p][1] != sign and t - last[p][0] < within_s:
                n += 1
            last[p] = (t, sign)
    return n


def reversals(scaler: Any, within_s: float = 600.0) -> int:
    """`reversal_count` over an offline scaler's decisions."""
    return reversal_count(((d.t, d.current, d.desired) for d in scaler.decisions), within_s)


def misses_per_event(ws: list[dict[str, Any]], events: tuple[float, ...]) -> list[int]:
    """Missed windows attributed to each event: from its minute to the next event's."""
    out = []
    bounds = [int(e // WINDOW_S) for e in events] + [10**9]
    for a, b in zip(bounds, bounds[1:]):
        out.append(sum(1 for w in ws if a <= w["minute"] < b and not w["met"]))
    return out
