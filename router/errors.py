"""Errors of the router package: `RouterError` is the root."""


class RouterError(Exception):
    """Root of the router's errors."""


class NoCandidates(RouterError):
    """No worker can take the request."""
