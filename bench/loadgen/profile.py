"""`pdserve bench profile`: build the requests, run the client processes, collect records.

`run(cfg)` returns a ProfileResult; export.write_artifacts turns it into files. Ctrl-C (or
SIGTERM) stops the clients, which send back what they recorded, and the partial result is
written with `was_cancelled: true`. Every wait on a client has a timeout.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any

from bench.loadgen.config import ProfileConfig
from bench.loadgen.dataset import PlanBuilder, Session
from bench.loadgen.errors import LoadgenError
from bench.loadgen.progress import Progress
from bench.loadgen.prompts import PromptBuilder
from bench.loadgen.records import Record
from bench.loadgen.runner import ClientPlan, client_main
from bench.loadgen.tokenizer import load_tokenizer

RATE_PER_CLIENT = 300.0  # req/s one client process sustains with room to spare
INFLIGHT_PER_CLIENT = 256
START_LEAD_S = 0.05


@dataclass
class ProfileResult:
    cfg: ProfileConfig
    records: list[Record]
    warmup: list[Record]
    start_wall_ns: int
    end_wall_ns: int
    was_cancelled: bool = False
    workers: int = 1
    client_cpu_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # A run of `pdserve sim` (no server, no client): what was simulated (layout, step model, ...).
    simulation: dict[str, Any] | None = None


def auto_workers(cfg: ProfileConfig, n_sessions: int) -> int:
    """Client processes: `--workers-max`, else one per RATE_PER_CLIENT req/s or
    INFLIGHT_PER_CLIENT concurrent requests; never more than the CPUs, the sessions, or the
    concurrency (each process needs at least one request in flight)."""
    if cfg.workers:
        w = cfg.workers
    else:
        w = 1
        if cfg.request_rate:
            w = max(w, math.ceil(cfg.request_rate / RATE_PER_CLIENT))
        if cfg.concurrency:
            w = max(w, math.ceil(cfg.concurrency / INFLIGHT_PER_CLIENT))
        w = min(w, os.cpu_count() or 1)
    if cfg.concurrency:
        w = min(w, cfg.concurrency)
    return max(1, min(w, max(1, n_sessions)))


def _share(total: int | None, w: int, k: int) -> int | None:
    if total is None:
        return None
    return total // w + (1 if k < total % w else 0)


def client_plans(cfg: ProfileConfig, base_body: dict, warmup: list[Session], sessions: list[Session],
                 w: int) -> list[ClientPlan]:
    host, _, rest = cfg.url.removeprefix("http://").partition(":")
    port_s, _, prefix = rest.partition("/")
    path = (("/" + prefix) if prefix else "") + cfg.path
    plans = []
    for k in range(w):
        conc = _share(cfg.concurrency, w, k)
        plans.append(ClientPlan(
            worker=k, workers=w, host=host, port=int(port_s), path=path, headers=cfg.headers,
            chat=cfg.endpoint_type == "chat", streaming=cfg.streaming, base_body=base_body,
            warmup=warmup[k::w], sessions=sessions[k::w],
            concurrency=conc if (conc or cfg.request_rate or cfg.fixed_schedule) else 1,
            warmup_concurrency=max(1, _share(cfg.concurrency or 1, w, k) or 1),
            request_rate=(cfg.request_rate / w) if cfg.request_rate else None,
            arrival=cfg.arrival, smoothness=cfg.arrival_smoothness,
            fixed_schedule=cfg.fixed_schedule, duration_s=cfg.benchmark_duration, grace_s=cfg.grace_period,
            timeout_s=cfg.request_timeout_s,
            num_requests=_share(cfg.num_requests, w, k) if cfg.num_requests else None,
            seed=cfg.random_seed, extra_inputs=cfg.extra_inputs))
    return plans


def check_reachable(cfg: ProfileConfig) -> None:
    host, _, rest = cfg.url.removeprefix("http://").partition(":")
    port = int(rest.partition("/")[0])
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise LoadgenError(f"cannot reach {cfg.url}: {e.strerror or e}") from None


def finalize(records: list[Record], tokenizer) -> None:
    """ISL/OSL of each record: the server's usage where given, else the prompt builder's
    count (ISL) and the tokenized output text (OSL)."""
    need = [r for r in records if r.ok and r.completion_tokens is None]
    if need:
        enc = tokenizer([r.text for r in need], add_special_tokens=False)["input_ids"]
        for r, ids in zip(need, enc):
            r.osl = len(ids)
    for r in records:
        if r.completion_tokens is not None:
            r.osl = r.completion_tokens
        r.isl = r.prompt_tokens if r.prompt_tokens is not None else r.expected_isl


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, *_: object) -> None:
        self.requested = True


def run(cfg: ProfileConfig, progress_enabled: bool = True) -> ProfileResult:
    tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
    builder = PlanBuilder(cfg, PromptBuilder(tokenizer, cfg.endpoint_type))
    warmup, sessions = builder.build()
    check_reachable(cfg)
    w = auto_workers(cfg, len(sessions))
    plans = client_plans(cfg, builder.base_body(), warmup, sessions, w)
    total = cfg.num_requests or (None if cfg.benchmark_duration else sum(len(s.turns) for s in sessions))
    progress = Progress(total, cfg.benchmark_duration, progress_enabled and cfg.ui != "none")

    ctx = mp.get_context("spawn")
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    procs, conns = [], []
    cpu0 = os.times()
    try:
        for plan in plans:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(child,), daemon=True, name=f"pdserve-load-{plan.worker}")
            proc.start()
            child.close()
            parent.send(plan)
            procs.append(proc)
            conns.append(parent)
        return _drive(cfg, plans, procs, conns, progress, stop, tokenizer, w, cpu0)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for c in conns:
            c.close()


def _drive(cfg: ProfileConfig, plans: list[ClientPlan], procs: list, conns: list, progress: Progress,
           stop: _Stop, tokenizer, w: int, cpu0: os.times_result) -> ProfileResult:
    # Generous bounds on every wait: a warmup of n requests can take n x timeout in the
    # worst case, but a dead client process is noticed within a poll interval.
    warm_limit = time.monotonic() + cfg.request_timeout_s * max(1, len(plans[0].warmup) + 1) + 60
    waiting = set(range(len(conns)))
    stopped_sent = False
    if any(p.warmup for p in plans):
        progress.start("warmup")
    records: list[Record] = []
    done = [0] * len(conns)
    errors = [0] * len(conns)
    while waiting:
        if stop.requested and not stopped_sent:
            for c in conns:
                _safe_send(c, ("stop",))
            stopped_sent = True
        if time.monotonic() > warm_limit:
            raise LoadgenError("client processes did not finish the warmup in time")
        for c in mp_wait([conns[i] for i in waiting], timeout=0.25):
            i = conns.index(c)
            msg = _recv(c, procs[i])
            if msg[0] == "warm":
                waiting.discard(i)
            elif msg[0] == "records":  # stopped during warmup
                records += msg[1]
                waiting.discard(i)
        _check_alive(procs, waiting)
    start_wall = time.time_ns()
    t0 = time.perf_counter_ns() + int(START_LEAD_S * 1e9)
    progress.start("profiling")
    if not stop.requested:
        for c in conns:
            _safe_send(c, ("start", t0))
    pending = set(range(len(conns))) - {i for i in range(len(conns)) if any(r.worker == i for r in records)}
    span = cfg.benchmark_duration + cfg.grace_period if cfg.benchmark_duration else None
    while pending:
        if stop.requested and not stopped_sent:
            for c in conns:
                _safe_send(c, ("stop",))
            stopped_sent = True
        for c in mp_wait([conns[i] for i in pending], timeout=0.25):
            i = conns.index(c)
            msg = _recv(c, procs[i])
            if msg[0] == "progress":
                done[i], errors[i] = msg[1], msg[2]
                progress.update(sum(done), sum(errors))
            elif msg[0] == "records":
                records += msg[1]
                pending.discard(i)
        _check_alive(procs, pending)
        if span is not None and time.perf_counter_ns() > t0 + (span + 60) * 1e9 and not stopped_sent:
            for c in conns:
                _safe_send(c, ("stop",))
            stopped_sent = True
    progress.finish()
    end_wall = time.time_ns()
    for p in procs:
        p.join(timeout=10)
    cpu1 = os.times()
    profiling = [r for r in records if r.phase == "profiling"]
    warm = [r for r in records if r.phase == "warmup"]
    finalize(profiling, tokenizer)
    finalize(warm, tokenizer)
    profiling.sort(key=lambda r: r.start_ns)
    cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
    return ProfileResult(cfg, profiling, warm, start_wall, end_wall, was_cancelled=stop.requested,
                         workers=w, client_cpu_s=cpu)


def _safe_send(conn, msg) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, OSError):
        pass


def _recv(conn, proc):
    try:
        return conn.recv()
    except (EOFError, OSError):
        raise LoadgenError(f"client process {proc.name} exited unexpectedly (exit code {proc.exitcode})") from None


def _check_alive(procs: list, waiting: set[int]) -> None:
    for i in waiting:
        if not procs[i].is_alive() and procs[i].exitcode not in (0, None):
            raise LoadgenError(f"client process {procs[i].name} died (exit code {procs[i].exitcode})")
