"""The planner's one root error: bad models, systems, targets or plan files. The CLI prints
its message on one line and exits 2."""

from __future__ import annotations


class PlanError(Exception):
    """Bad input to `pdserve plan` or its calibration and checking tools."""
