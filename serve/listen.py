"""The HTTP listening socket, bound before anything slow starts, and served by uvicorn.

A worker binds its port first and only then loads its engine (tens of seconds). A port in use
fails at once, in one line, instead of after the engine is up; and nothing else on the host
(an outgoing connection handed that port as its ephemeral one, a sibling worker starting at
the same moment) can take the port meanwhile. Connections that arrive while the engine loads
wait in the listen backlog; probes time out as they would against a closed port.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Any

from serve.errors import PdserveError

BACKLOG = 2048  # uvicorn's default
# Ports bound only later (seconds after they are chosen: by an engine once it has loaded, or
# by a server a script starts) are drawn from below the kernel's ephemeral range (32768 and
# up here): a port from bind(0) is one that any outgoing connection, or a sibling starting at
# the same moment, may be handed meanwhile (seen: "Address already in use").
LATE_PORT_RANGE = (20000, 32000)
_handed: set[int] = set()  # never the same port twice from one process


def _address(host: str, port: int) -> tuple[int, int, int, tuple]:
    """(family, type, proto, sockaddr) to bind on `host` (IPv4 or IPv6); PdserveError if unknown."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PdserveError(f"--host {host}: {exc.strerror}") from None
    return family, kind, proto, addr


def late_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port that is free now on `host`, for a listener that binds it later; with `count`,
    the first of that many consecutive ports all free now (e.g. a launcher's base port)."""
    family, kind, proto, addr = _address(host, 0)
    lo, hi = LATE_PORT_RANGE
    if not 1 <= count <= hi - lo:
        raise PdserveError(f"cannot hand out {count} consecutive ports (1 to {hi - lo})")
    for _ in range(200):
        port = random.randint(lo, hi - count + 1)
        block = range(port, port + count)
        if any(q in _handed for q in block) or not all(_free(family, kind, proto, addr, q) for q in block):
            continue
        _handed.update(block)
        return port
    if count > 1:
        raise PdserveError(f"no {count} consecutive free ports on {host} in {lo}-{hi}")
    with socket.socket(family, kind, proto) as s:  # a crowded range: any free port
        try:
            s.bind(addr)
        except OSError as exc:
            raise PdserveError(f"no free port on {host}: {exc.strerror or exc}") from None
        return s.getsockname()[1]


def _free(family: int, kind: int, proto: int, addr: tuple, port: int) -> bool:
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind((addr[0], port, *addr[2:]))
        except OSError:
            return False
    return True


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); PdserveError when that cannot be had."""
    family, kind, proto, addr = _address(host, port)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise PdserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # A forked child (an engine process started by fork rather than spawn) must not keep the
    # port open after this process dies.
    os.register_at_fork(after_in_child=sock.close)
    return sock


# Idle keep-alive connections live this long on the server: past the clients' own expiry
# (httpx's 5 s), so a client never sends on a connection the server is closing at that very
# moment (uvicorn's default, also 5 s, raced the frontend's reuse of its worker connections).
KEEP_ALIVE_S = 30


def serve(app: Any, sock: socket.socket, *, log_level: str, graceful_timeout_s: float) -> int:
    """Run `app` on `sock` until shutdown (as uvicorn.run would, on a socket already bound).
    A SIGTERM or SIGINT is re-raised by uvicorn after its graceful shutdown, as with uvicorn.run."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=max(1, int(graceful_timeout_s)),
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0 if server.started else 3  # uvicorn's STARTUP_FAILURE: the app's startup failed
