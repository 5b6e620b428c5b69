"""The test doubles' error (a bench.errors.BenchError): one line at the CLI, exit 2."""

from __future__ import annotations

from bench.errors import BenchError


class FakeServerError(BenchError):
    """The fake server could not start (its address is taken or cannot be bound)."""
