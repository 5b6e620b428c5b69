"""The load generator's one root error. Everything it raises on bad input derives from
ProfileError; the CLI prints its message on one line and exits 2."""

from __future__ import annotations


class ProfileError(Exception):
    """Bad configuration or input for `pdserve bench profile` and its tools."""


class TokenizerError(ProfileError):
    """The tokenizer that must count tokens could not be loaded."""


class DatasetError(ProfileError):
    """An input file (trace, artifact) is missing or malformed."""
