"""Errors of the serve package.

    PdserveError                 root: every error pdserve raises on purpose
    ├── ConfigError              bad flags or settings (one line at the CLI)
    ├── ModelError               model cannot be found or prepared
    └── WorkerError              a worker failed, timed out or is unreachable
        └── NoWorkerAvailable    no healthy worker to route to (HTTP 503)

The frontend maps these to the OpenAI error envelope at the HTTP edge only.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Root of pdserve's own errors."""


class ConfigError(PdserveError):
    pass


class ModelError(PdserveError):
    pass


class WorkerError(PdserveError):
    pass


class NoWorkerAvailable(WorkerError):
    pass


class WorkerRefused(WorkerError):
    """A worker answered 503 before starting a request (draining, or its engine not up):
    nothing reached its engine, so another worker may take it."""
