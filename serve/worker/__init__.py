"""The worker role, by concern:

- `settings`: `WorkerSettings` and the flags of `pdserve worker`;
- `main`: from settings to a serving process (port first, engine options, serve);
- `app`: `Worker`, one async method per endpoint of the worker protocol, and `build_app`;
- `registration`: `WorkerRegistration`, lease renewal with the frontends;
- `metrics`: `pdserve_worker_*` and the KV connector's `pdserve_kv_*`;
- `sockets`: the private directory of a loopback worker's KV-event socket.

Importing this package imports no engine; `serve.worker.app` does so only when a worker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serve.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from serve.worker.app import Worker, build_app

__all__ = ["Worker", "WorkerSettings", "build_app"]


def __getattr__(name: str) -> Any:
    if name in ("Worker", "build_app"):
        from serve.worker import app

        return getattr(app, name)
    raise AttributeError(name)
