"""The planner's error: bad models, systems, targets or plan files (a bench.errors.BenchError).
The CLI prints its message on one line and exits 2."""

from __future__ import annotations

from bench.errors import BenchError


class PlanError(BenchError):
    """Bad input to `pdserve plan` or its calibration and checking tools."""
