"""Sending the load: client processes, each an asyncio loop with its own connection pool.

The main process builds every prompt and body, splits the sessions round-robin over W client
processes (spawned, so they import nothing heavy), and lets each run:

  warmup   its share of warmup sessions, closed loop at its share of the concurrency;
  (barrier: all report warm, the main process sends one start time)
  profile  closed loop (`--concurrency`), open loop (`--request-rate`, each process at
           rate/W with the arrival process, optionally capped by its share of the
           concurrency), or a fixed schedule (`at_s` of each session);
           `--benchmark-duration` stops new requests and cancels what is still in flight
           after the grace period.

Each request runs under `--request-timeout-seconds`; a timeout is an error, never a hang.
Parsing waits until the phase is over. A stop message (Ctrl-C in the main process, or SIGINT
in the client) cancels what is in flight and sends back what was recorded, so partial
results are written. Messages on the pipe: ("warm",), ("progress", done, errors),
("records", [Record]) from the client; ("start", t0_ns), ("stop",) to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.loadgen.dataset import Session
from bench.loadgen.http import HTTPError, Pool, RawResponse, request_head
from bench.loadgen.records import ErrorInfo, Record, parse_response

PROGRESS_EVERY_S = 0.25


@dataclass
class ClientPlan:
    worker: int
    workers: int
    host: str
    port: int
    path: str
    headers: dict[str, str]
    chat: bool
    streaming: bool
    base_body: dict[str, Any]
    warmup: list[Session]
    sessions: list[Session]
    concurrency: int | None  # this process's share (closed loop, or the cap of an open loop)
    warmup_concurrency: int
    request_rate: float | None  # this process's share
    arrival: str = "poisson"
    smoothness: float = 1.0
    fixed_schedule: bool = False
    duration_s: float | None = None
    grace_s: float = 30.0
    timeout_s: float = 600.0
    num_requests: int | None = None  # this process's share of the request budget
    seed: int = 0
    extra_inputs: dict[str, Any] = field(default_factory=dict)


def arrival_rng(seed: int, worker: int = 0) -> random.Random:
    """The random stream of one client process's arrival gaps (the simulator draws the same)."""
    return random.Random(f"{seed}:{worker}")


def next_gap(pattern: str, rate: float, smoothness: float, rng: random.Random) -> float:
    """Seconds to the next arrival at `rate` per second. constant: 1/rate; poisson:
    exponential with mean 1/rate; gamma: gamma with shape k=smoothness and mean 1/rate (k=1 is
    poisson, larger is more regular)."""
    if pattern == "constant":
        return 1.0 / rate
    if pattern == "poisson":
        return rng.expovariate(rate)
    return rng.gammavariate(smoothness, 1.0 / (rate * smoothness))


async def sleep_until(due: float) -> None:
    """Sleep until time.perf_counter() >= due. Loop timers (uvloop's are in whole ms) may
    fire early; a scheduled send must never go before its time."""
    while (left := due - time.perf_counter()) > 0:
        await asyncio.sleep(left)


class Client:
    """One client process's loop: sessions -> requests -> records."""

    def __init__(self, plan: ClientPlan, send: Any) -> None:
        self.plan = plan
        self.send = send  # callable(msg)
        self.pool = Pool(plan.host, plan.port)
        self.done = 0
        self.errors = 0
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()
        self.pending: list[tuple[Record, RawResponse | None]] = []
        self.sent = 0

    # -- one request ------------------------------------------------------------------------
    def _body(self, session: Session, t: int, history: list[dict]) -> bytes:
        turn = session.turns[t]
        if turn.body is not None:
            return turn.body
        body = dict(self.plan.base_body)
        body["messages"] = history + [{"role": "user", "content": turn.content}]
        if turn.osl:
            body["max_tokens"] = turn.osl
        body.update(self.plan.extra_inputs)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _request(self, session: Session, t: int, history: list[dict],
                       phase: str) -> tuple[Record, RawResponse | None]:
        p = self.plan
        body = self._body(session, t, history)
        data = request_head("POST", p.host, p.port, p.path, p.headers, len(body)) + body
        turn = session.turns[t]
        rec = Record(session.index, t, phase, p.worker, time.perf_counter_ns(), time.time_ns(),
                     expected_isl=turn.isl, requested_osl=turn.osl, streaming=p.streaming)
        resp = None
        try:
            async with asyncio.timeout(p.timeout_s):
                resp = await self.pool.request(data)
        except TimeoutError:
            rec.end_ns = time.perf_counter_ns()
            rec.error = ErrorInfo(None, "RequestTimeout", f"no complete response within {p.timeout_s:g} s")
        except HTTPError as e:
            rec.end_ns = time.perf_counter_ns()
            rec.error = ErrorInfo(None, "ConnectionError", str(e))
        except asyncio.CancelledError:
            rec.end_ns = time.perf_counter_ns()
            rec.cancelled = True
            self.pending.append((rec, None))
            raise
        return rec, resp

    async def _session(self, session: Session, phase: str) -> None:
        history: list[dict] = []
        multi = len(session.turns) > 1
        for t, turn in enumerate(session.turns):
            if self.stopping or (self.plan.num_requests is not None and phase == "profiling"
                                 and self.sent >= self.plan.num_requests):
                return
            if t and turn.delay_ms > 0:
                await asyncio.sleep(turn.delay_ms / 1000.0)
            if phase == "profiling":
                self.sent += 1
            rec, resp = await self._request(session, t, history, phase)
            if multi and resp is not None:
                parse_response(rec, resp, self.plan.chat)
                resp = None
            self.pending.append((rec, resp))
            self.done += 1
            if rec.error is not None:
                self.errors += 1
                return  # a failed turn ends its session: the history is broken
            if multi:
                history += [{"role": "user", "content": turn.content}, {"role": "assistant", "content": rec.text}]

    # -- phases -----------------------------------------------------------------------------
    async def _closed_loop(self, sessions: list[Session], users: int, phase: str, cycle: bool,
                           deadline: float | None) -> None:
        queue = deque(sessions)

        budget = self.plan.num_requests if phase == "profiling" else None

        async def user() -> None:
            while queue and not self.stopping:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                if budget is not None and self.sent >= budget:
                    return  # a cycling pool would otherwise spin here until the deadline
                s = queue.popleft()
                if cycle:
                    queue.append(s)
                await self._session(s, phase)

        await self._run_all([user() for _ in range(max(1, users))])

    async def _open_loop(self, sessions: list[Session], deadline: float | None, t0: float) -> None:
        p = self.plan
        sem = asyncio.Semaphore(p.concurrency) if p.concurrency else None
        rng = arrival_rng(p.seed, p.worker)
        rate = p.request_rate or 1.0
        # Processes interleave: a constant schedule at rate/W, offset by worker/rate_total.
        t = p.worker / (rate * p.workers) if p.arrival == "constant" else 0.0
        started: set[asyncio.Task] = set()

        async def one(s: Session) -> None:
            try:
                await self._session(s, "profiling")
            finally:
                if sem is not None:
                    sem.release()

        i = 0
        while not self.stopping and sessions:
            if p.fixed_schedule:
                if i >= len(sessions):
                    break
                due = t0 + (sessions[i].at_s or 0.0)
            else:
                if deadline is None and i >= len(sessions):
                    break
                due = t0 + t
                t += next_gap(p.arrival, rate, p.smoothness, rng)
            if deadline is not None and due >= deadline:
                break
            if p.num_requests is not None and self.sent >= p.num_requests:
                break
            await sleep_until(due)
            if sem is not None:
                await sem.acquire()
                if self.stopping or (deadline is not None and time.perf_counter() >= deadline):
                    sem.release()  # the slot freed too late: past the run's end
                    break
            task = asyncio.ensure_future(one(sessions[i % len(sessions)]))
            started.add(task)
            self.tasks.add(task)
            task.add_done_callback(started.discard)
            task.add_done_callback(self.tasks.discard)
            i += 1
        if started:
            await asyncio.gather(*list(started), return_exceptions=True)

    async def _run_all(self, coros: list) -> None:
        tasks = [asyncio.ensure_future(c) for c in coros]
        self.tasks.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.tasks.difference_update(tasks)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self.send(("progress", self.done, self.errors))

    def stop(self) -> None:
        self.stopping = True
        for t in list(self.tasks):
            t.cancel()

    async def warmup(self) -> None:
        if self.plan.warmup:
            await self._closed_loop(self.plan.warmup, self.plan.warmup_concurrency, "warmup", False, None)

    async def profile(self, t0_ns: int) -> None:
        p = self.plan
        t0 = t0_ns / 1e9  # perf_counter seconds, shared by all client processes
        await sleep_until(t0)
        deadline = t0 + p.duration_s if p.duration_s else None
        self.done = self.errors = 0
        progress = asyncio.ensure_future(self._progress())
        try:
            body = (self._open_loop(p.sessions, deadline, t0) if (p.request_rate or p.fixed_schedule)
                    else self._closed_loop(p.sessions, p.concurrency or 1, "profiling",
                                           cycle=p.duration_s is not None, deadline=deadline))
            work = asyncio.ensure_future(body)
            if deadline is None:
                await work
            else:
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.perf_counter()) + p.grace_s):
                        await asyncio.shield(work)
                except TimeoutError:
                    self.stop()
                    await asyncio.gather(work, return_exceptions=True)
        finally:
            progress.cancel()
        self.send(("progress", self.done, self.errors))

    def records(self) -> list[Record]:
        out = []
        for rec, resp in self.pending:
            if resp is not None and not rec.cancelled:
                parse_response(rec, resp, self.plan.chat)
            out.append(rec)
        self.pending.clear()
        return out


def client_main(conn: Any) -> None:
    """Entry point of a client process: plan in, records out (see module docstring)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    plan: ClientPlan = conn.recv()
    asyncio.run(_client(plan, conn))


async def _client(plan: ClientPlan, conn: Any) -> None:
    loop = asyncio.get_running_loop()
    client = Client(plan, conn.send)
    inbox: asyncio.Queue = asyncio.Queue()

    def readable() -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("stop",)
            loop.remove_reader(conn.fileno())
        if msg[0] == "stop":
            client.stop()
        inbox.put_nowait(msg)

    loop.add_reader(conn.fileno(), readable)
    # The loop may make the pipe non-blocking; a large records message must not fail with EAGAIN.
    os.set_blocking(conn.fileno(), True)
    loop.add_signal_handler(signal.SIGINT, client.stop)
    loop.add_signal_handler(signal.SIGTERM, client.stop)
    try:
        await client.warmup()
        conn.send(("warm",))
        while True:
            msg = await inbox.get()
            if msg[0] in ("start", "stop"):
                break
        if msg[0] == "start" and not client.stopping:
            await client.profile(msg[1])
        conn.send(("records", client.records()))
    finally:
        client.pool.close()
        loop.remove_reader(conn.fileno())
