"""The benchmarks' error: bad flags, or a server they start that exits or never becomes ready
(the message names its log). A bench.errors.BenchError: one line at the CLI, exit 2."""

from __future__ import annotations

from bench.errors import BenchError


class PerfError(BenchError):
    """A benchmark of pdserve itself could not run."""
