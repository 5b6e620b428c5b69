"""The cluster simulator's error (a bench.errors.BenchError): a bad trace, profile, layout
or option. `pdserve sim` prints it on one line and exits 2."""

from __future__ import annotations

from bench.errors import BenchError


class SimError(BenchError):
    """Bad input to `pdserve sim`."""
