"""Where a worker registers: frontend URLs, optionally expanded through DNS.

`http://host:port` is one frontend. `dns+http://name:port` is every address `name` resolves
to, looked up again at each lease renewal: on Kubernetes, a headless Service over the
frontend pods (with `publishNotReadyAddresses`, so a frontend with no workers yet, and so
not ready, can still be registered with). Frontend replicas that come and go are picked up
without restarting any worker.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

DNS_PREFIX = "dns+"


def is_dns(url: str) -> bool:
    return url.startswith(DNS_PREFIX)


def check(url: str) -> str:
    """Validate a `--frontend` value; returns it unchanged or raises ValueError."""
    parts = urlsplit(url[len(DNS_PREFIX):] if is_dns(url) else url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--frontend {url!r}: expected http://HOST:PORT or dns+http://NAME:PORT")
    return url


def _host(addr: str) -> str:
    return f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr


async def expand(url: str, timeout_s: float = 5.0) -> list[str]:
    """The frontend base URLs behind `url` now (sorted, de-duplicated). A name that does not
    resolve gives no URL (the caller logs and retries at the next renewal)."""
    if not is_dns(url):
        return [url.rstrip("/")]
    parts = urlsplit(url[len(DNS_PREFIX):])
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
        # arrives as the lookup finishes, and the caller's task then never stops.
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, asyncio.TimeoutError):
        return []
    addrs = sorted({info[4][0] for info in infos})
    path = parts.path.rstrip("/")
    return [f"{parts.scheme}://{_host(a)}:{port}{path}" for a in addrs]
