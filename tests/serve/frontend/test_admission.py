"""Bounded admission in the frontend: unit behaviour, then a real frontend under a flood."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import httpx
import pytest

from serve.frontend.admission import Admission, Overloaded
from tests.conftest import MODEL, Proc, free_port
from tests.helpers.workerclient import stream_in_background


def test_admission_bounds_active_and_queued_and_hands_slots_over_in_order():
    async def go():
        a = Admission(max_active=1, max_queued=2)
        t1, t2, t3 = a.enter(), a.enter(), a.enter()
        with pytest.raises(Overloaded):
            a.enter()
        far = time.monotonic() + 10
        await t1.wait(far)
        order: list[int] = []

        async def serve(t, n):
            await t.wait(far)
            order.append(n)
            await asyncio.sleep(0.01)
            t.release()

        tasks = [asyncio.create_task(serve(t2, 2)), asyncio.create_task(serve(t3, 3))]
        await asyncio.sleep(0.05)
        assert (a.active, a.queued, order) == (1, 2, [])
        t1.release()
        await asyncio.gather(*tasks)
        assert order == [2, 3] and (a.active, a.queued) == (0, 0)
        t1.release()  # idempotent
        assert (a.active, a.queued) == (0, 0)

    asyncio.run(go())


def test_queued_request_times_out_and_gives_its_place_back():
    async def go():
        a = Admission(max_active=1, max_queued=1)
        busy = a.enter()
        await busy.wait(time.monotonic() + 1)
        waiting = a.enter()
        with pytest.raises(TimeoutError):
            await waiting.wait(time.monotonic() + 0.05)
        waiting.release()
        assert (a.active, a.queued) == (1, 0)
        again = a.enter()  # there is room again
        busy.release()
        await again.wait(time.monotonic() + 1)
        again.release()
        assert (a.active, a.queued) == (0, 0)

    asyncio.run(go())


def test_cancelled_waiter_does_not_leak_a_slot():
    async def go():
        a = Admission(max_active=1, max_queued=1)
        busy = a.enter()
        await busy.wait(time.monotonic() + 1)
        waiting = a.enter()
        task = asyncio.create_task(waiting.wait(time.monotonic() + 10))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        waiting.release()
        busy.release()
        assert (a.active, a.queued) == (0, 0)

    asyncio.run(go())


# The request that holds the only slot streams up to 2,000 tokens (20 s on the 10 ms-a-step
# simulated worker) and is hung up on once the test is done with it: the flood arrives while it
# is held even on a loaded machine, and the test does not wait for it to finish.
HOLD = 2000


class Holder:
    """A streaming chat that holds a slot until `release()` hangs up on it."""

    def __init__(self, url: str, body: dict):
        self.first = threading.Event()
        self.hangup = threading.Event()
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "max_tokens": HOLD, "stream": True},
                          timeout=120) as r:
            self.status = r.status_code
            for _ in r.iter_lines():
                self.first.set()
                if self.hangup.is_set():
                    return

    def release(self) -> None:
        self.hangup.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def wait_metric(url: str, line: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while line not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, f"timed out waiting for {line!r}"
        time.sleep(0.05)


def test_frontend_refuses_a_flood_with_429_and_serves_what_it_accepted(sim_worker, model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("frontend-admission", ["frontend", "--port", str(port), "--model", model_dir,
                                       "--served-model-name", MODEL, "--worker", sim_worker,
                                       "--max-concurrent-requests", "1", "--max-queued-requests", "1",
                                       "--queue-timeout", "120"])
    try:
        proc.wait_http(f"{url}/health", 120)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                "ignore_eos": True, "temperature": 0}
        results: list[httpx.Response] = []
        lock = threading.Lock()

        def one(max_tokens: int = 16):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": max_tokens}, timeout=120)
            with lock:
                results.append(r)

        holder = Holder(url, body)  # holds the only slot until released
        assert holder.first.wait(60)
        wait_metric(url, "pdserve_frontend_inflight_requests 1.0")
        flood = [threading.Thread(target=one) for _ in range(10)]
        for t in flood:
            t.start()
        # One of the ten queues behind the holder; the nine others are refused at once.
        deadline = time.monotonic() + 60
        while len(results) < 9:
            assert time.monotonic() < deadline, [r.status_code for r in results]
            time.sleep(0.05)
        wait_metric(url, "pdserve_frontend_queued_requests 1.0")
        holder.release()  # hanging up frees the slot for the queued one
        for t in flood:
            t.join(120)
        assert holder.status == 200
        codes = sorted(r.status_code for r in results)
        assert codes == [200] + [429] * 9, codes
        for r in results:
            if r.status_code == 429:
                err = r.json()["error"]
                assert err["code"] == "server_overloaded" and int(r.headers["retry-after"]) > 0
            else:
                assert r.json()["usage"]["completion_tokens"] == 16
        m = httpx.get(f"{url}/metrics").text
        assert 'pdserve_frontend_rejected_requests_total{reason="overloaded"} 9.0' in m
        assert "pdserve_frontend_queued_requests 0.0" in m

        # A refused request is answered before its body is read: it costs no buffer.
        holder = Holder(url, body)
        assert holder.first.wait(60)
        wait_metric(url, "pdserve_frontend_inflight_requests 1.0")
        queued = threading.Thread(target=one)
        queued.start()
        wait_metric(url, "pdserve_frontend_queued_requests 1.0")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 4000000\r\n\r\n{")  # 4 MB announced, 1 byte sent
            reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 429"), reply[:200]
        holder.release()
        queued.join(120)
        wait_metric(url, "pdserve_frontend_inflight_requests 0.0")

        # SIGTERM with a stream in flight: new connections are refused, the stream finishes,
        # the process exits within its graceful timeout.
        t, lines, started = stream_in_background(url, {**body, "max_tokens": 96})
        assert started.wait(60)
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # the listener closes at once
            try:
                httpx.get(f"{url}/v1/models", timeout=2)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                # Refused, or (a connection the kernel queued just before the listener closed)
                # dropped unanswered, or reset (ECONNRESET: seen once in the suite): either way
                # no new request is served.
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.1)
        t.join(60)
        assert lines[-1] == "[DONE]" and not any('"error"' in x for x in lines)
        proc.popen.wait(timeout=40)
        assert time.monotonic() - t0 < 40
    finally:
        proc.stop()
