"""Summary statistics of a metric, in AIPerf's layout.

`summarize` returns {unit, avg, min, max, sum, p1 ... p99, std, count}: percentiles by linear
interpolation between closest ranks (numpy's default), std the population standard deviation
(ddof=0). Values are converted from base units to display units first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

STAT_KEYS = ("avg", "min", "max", "sum", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std")
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def summarize(values: Sequence[float], unit: str, scale: float = 1.0) -> dict | None:
    """Stats of `values` (base units) shown in `unit` (value / scale); None if empty."""
    if len(values) == 0:
        return None
    a = np.asarray(values, dtype=np.float64) / scale
    out: dict = {"unit": unit, "avg": float(a.mean())}
    pct = np.percentile(a, PERCENTILES)
    for p, v in zip(PERCENTILES, pct):
        out[f"p{p}"] = float(v)
    out["min"] = float(a.min())
    out["max"] = float(a.max())
    out["std"] = float(a.std())
    out["count"] = int(a.size)
    out["sum"] = float(a.sum())
    return out


def scalar(value: float | None, unit: str, scale: float = 1.0) -> dict | None:
    """A run-level metric: {unit, avg}."""
    if value is None:
        return None
    return {"unit": unit, "avg": float(value) / scale}
