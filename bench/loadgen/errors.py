"""The load generator's errors. Everything it raises on bad input derives from LoadgenError
(a bench.errors.BenchError); the CLI prints its message on one line and exits 2."""

from __future__ import annotations

from bench.errors import BenchError


class LoadgenError(BenchError):
    """Bad configuration or input for `pdserve bench profile` and its tools."""


class TokenizerError(LoadgenError):
    """The tokenizer that must count tokens could not be loaded."""


class DatasetError(LoadgenError):
    """An input file (trace, artifact) is missing or malformed."""
