"""A worker's port and its registration, without an engine: the port is taken before the
engine loads (a port in use fails at once, in one line), and leaving rotation stops the
renewals within a bound even when a renewal swallows its cancel."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import pytest

from serve import listen
from serve import protocol as p
from serve.worker import registration as registration_mod
from serve.cli import main
from serve.errors import PdserveError
from serve.worker import Worker, WorkerSettings

FRONTEND = "http://frontend.test:8000"


def test_a_port_in_use_fails_at_once_in_one_line(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PdserveError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen.bind("127.0.0.1", port)
        t0 = time.monotonic()
        assert main(["worker", "--role", "agg", "--port", str(port)]) == 2
        took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pdserve worker: error: cannot listen on 127.0.0.1:{port}: Address already in use"], err
    assert took < 60  # no engine was started (that alone takes longer here)


def test_the_bound_port_is_held_and_not_kept_by_forked_children():
    sock = listen.bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog before anything serves it
        pid = os.fork()
        if pid == 0:  # an engine process started by fork (vLLM's CPU engines are spawned)
            os._exit(0 if sock.fileno() == -1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept the listening socket"
    finally:
        sock.close()


def test_late_ports_are_below_the_ephemeral_range_free_and_never_repeated():
    low, high = listen.LATE_PORT_RANGE
    ports = [listen.late_port("127.0.0.1") for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(low <= port <= high for port in ports)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert high < int(f.read().split()[0])
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_block_of_late_ports_is_free_whole_and_never_handed_again(monkeypatch):
    """A launcher's base port: all `count` ports free now, none handed out again."""
    monkeypatch.setattr(listen, "_handed", set())  # blocks other tests in this process drew do not count
    base = listen.late_port("127.0.0.1", 7)
    with socket.socket() as taken:  # a port inside the next draw's block is in use: skipped
        try:
            taken.bind(("127.0.0.1", base + 20))
        except OSError:
            pass  # something else holds it: in use all the same
        # later draws: disjoint blocks, any of which another process on the host may hold meanwhile
        later = [base + 30 + 7 * k for k in range(100)]
        draws = iter([base + 17, *later])
        monkeypatch.setattr(listen.random, "randint", lambda lo, hi: next(draws))
        port = listen.late_port("127.0.0.1", 7)
        assert port in later
        assert set(range(port, port + 7)) <= listen._handed
    for port in range(base, base + 7):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    draws = iter([base + 3] * 200)
    with pytest.raises(PdserveError, match="no 7 consecutive free ports"):
        listen.late_port("127.0.0.1", 7)  # every draw overlaps a block already handed out
    with pytest.raises(PdserveError, match="cannot hand out 0 consecutive ports"):
        listen.late_port("127.0.0.1", 0)


def test_late_ports_follow_the_host_family_and_an_unknown_host_is_a_clear_error():
    port = listen.late_port("::1")  # an IPv6 host: an IPv6 socket, not a crash
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
    with pytest.raises(PdserveError, match="--host no-such-host.invalid"):
        listen.late_port("no-such-host.invalid")
    with pytest.raises(PdserveError, match="--host no-such-host.invalid"):
        listen.bind("no-such-host.invalid", 0)


def _worker(posts: list[tuple[float, str]], lease_s: float = 0.6) -> Worker:
    def handler(request: httpx.Request) -> httpx.Response:
        posts.append((time.monotonic(), request.url.path))
        return httpx.Response(200, json={"ok": True})

    w = Worker(WorkerSettings(role="decode", frontends=[FRONTEND], lease_seconds=lease_s, worker_id="decode-t"), None)
    w.info = p.WorkerInfo(worker_id="decode-t", role="decode", url=w.settings.url, model="m", served_model_name="m",
                          max_model_len=2048, block_size=16, kv_cache_dtype="auto", num_kv_blocks=10)
    w._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return w


async def _registered(posts: list, n: int) -> None:
    async with asyncio.timeout(10):
        while sum(path == "/internal/register" for _, path in posts) < n:
            await asyncio.sleep(0.02)


def test_leaving_rotation_stops_renewals_then_deregisters():
    posts: list[tuple[float, str]] = []

    async def run() -> None:
        w = _worker(posts)
        w.registration.start()
        await _registered(posts, 2)
        task = w.registration.task
        await w._leave_rotation()
        assert task.done() and w.registration.task is None
        left = len(posts)
        await asyncio.sleep(0.6)  # three renewal intervals
        assert len(posts) == left
        await w._http.aclose()

    asyncio.run(run())
    paths = [path for _, path in posts]
    assert paths[-1] == "/internal/deregister" and paths.count("/internal/deregister") == 1, paths


def test_leaving_rotation_is_bounded_when_a_renewal_swallows_its_cancel(monkeypatch):
    """Python 3.11's asyncio.wait_for can swallow a cancel that arrives as its inner await
    finishes; a renewal loop hit by it kept running, and shutdown waited on it for ever."""
    monkeypatch.setattr(registration_mod, "REGISTER_STOP_S", 3.0)
    posts: list[tuple[float, str]] = []
    swallowed = []

    async def run() -> None:
        w = _worker(posts)
        in_lookup = asyncio.Event()

        async def frontend_urls() -> list[str]:
            in_lookup.set()
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # what wait_for did, once
            return [FRONTEND]

        w.registration.frontend_urls = frontend_urls  # type: ignore[method-assign]
        w.registration.start()
        await _registered(posts, 1)
        in_lookup.clear()
        async with asyncio.timeout(10):
            await in_lookup.wait()  # the next renewal is in its lookup: the cancel lands there
        task = w.registration.task
        t0 = time.monotonic()
        await w._leave_rotation()
        assert time.monotonic() - t0 < 3.0
        assert task.done()
        registers = sum(path == "/internal/register" for _, path in posts)
        await asyncio.sleep(0.6)
        assert sum(path == "/internal/register" for _, path in posts) == registers
        await w._http.aclose()

    asyncio.run(run())
    assert swallowed == [True]
    assert [path for _, path in posts][-1] == "/internal/deregister"
