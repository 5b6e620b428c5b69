"""Access control at pdserve's HTTP edges: an ASGI gate in front of an app.

Two secrets, never interchangeable:
- the **API key** (`--api-key` / `PDSERVE_API_KEY`, several allowed): clients send
  `Authorization: Bearer KEY` to the frontend's OpenAI endpoints; a miss is 401 in the
  OpenAI error envelope;
- the **cluster token** (`--cluster-token` / `PDSERVE_CLUSTER_TOKEN`): frontends and workers
  send it as `X-PDSERVE-Token` on every internal call (registration, generate, abort, load,
  drain) and the KV side channel carries an HMAC of it (kvtransfer.protocol.engine_auth); a miss is 401 and is logged.

Health, liveness and metrics stay open by default (probes and scrapers carry no secret);
`--auth-exempt-paths` changes that list. A pure ASGI gate (not Starlette's
BaseHTTPMiddleware), so streaming responses and client-disconnect detection are untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

log = logging.getLogger("pdserve.auth")

TOKEN_HEADER = "x-pdserve-token"
DEFAULT_EXEMPT = ("/health", "/live", "/metrics")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def matches(secret: str | None, offered: str | None) -> bool:
    return bool(secret) and offered is not None and hmac.compare_digest(secret.encode(), offered.encode())


def token_headers(token: str | None) -> dict[str, str]:
    return {TOKEN_HEADER: token} if token else {}


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


def _bearer(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def _client(scope: Scope) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "?"


def openai_401(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


async def _send_json(send: Callable, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """Checks every HTTP request before `app` sees it.

    - paths in `exempt` pass;
    - paths under `internal_prefix` (or every path when `internal_prefix` is "/") need the
      cluster token when one is set;
    - the rest need one of `api_keys` when any is set.
    """

    def __init__(self, app: ASGIApp, *, api_keys: Iterable[str] = (), cluster_token: str | None = None,
                 exempt: Iterable[str] = DEFAULT_EXEMPT, internal_prefix: str = "/internal/",
                 role: str = "frontend") -> None:
        self.app = app
        self.api_keys = [k for k in api_keys if k]
        self.cluster_token = cluster_token or None
        self.exempt = frozenset(exempt)
        self.internal_prefix = internal_prefix
        self.role = role

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.internal_prefix == "/" or path.startswith(self.internal_prefix):
            if self.cluster_token and not matches(self.cluster_token, _header(scope, TOKEN_HEADER.encode())):
                log.warning("%s: refused %s %s from %s: missing or wrong cluster token", self.role,
                            scope.get("method"), path, _client(scope))
                await _send_json(send, 401, json.dumps({"error": "missing or wrong cluster token"}).encode())
                return
        elif self.api_keys:
            offered = _bearer(scope)
            if not any(matches(k, offered) for k in self.api_keys):
                msg = ("You didn't provide an API key. Send it as `Authorization: Bearer KEY`."
                       if offered is None else "Incorrect API key provided.")
                await _send_json(send, 401, openai_401(msg), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)
