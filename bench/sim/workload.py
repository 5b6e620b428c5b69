"""What a simulation sends, from `bench profile`'s own options (the same flags, parsed by
`bench.loadgen.config`): synthetic sessions (ISL/OSL with spread, a shared-prefix pool,
multi-turn sessions whose later turns carry the conversation so far) or a Mooncake trace
(`--input-file`, each hash id one block of `--isl-block-size` tokens, equal ids equal
tokens), sent closed-loop (`--concurrency`), open-loop (`--request-rate` with `--arrival`
poisson, constant or gamma, optionally capped by `--concurrency`) or at the trace's
timestamps (`--fixed-schedule`). Prompts are token ids (no tokenizer, no chat template).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.loadgen.config import ProfileConfig
from bench.loadgen.dataset import TraceEntry, parse_mooncake, shape_rng
from bench.loadgen.errors import LoadgenError
from bench.loadgen.runner import arrival_rng, next_gap
from bench.sim.cluster import OfflineCluster
from bench.sim.flow import Flow
from bench.sim.engine import output_token
from bench.sim.errors import SimError
from bench.sim.loop import Loop

TOKEN_LOW, TOKEN_SPAN = 1000, 30000


@dataclass
class SimTurn:
    make: Callable[[], list[int]]  # this turn's new tokens (after the conversation so far), made when sent
    osl: int
    delay_s: float = 0.0  # after the previous turn's answer
    isl: int = 0  # the new tokens' count (first turns: the prompt's length)

    @property
    def content(self) -> list[int]:
        return self.make()


@dataclass
class SimSession:
    index: int
    turns: list[SimTurn]
    at_s: float | None = None


def _length(rng: random.Random, mean: int, stddev: float, low: int = 1) -> int:
    return max(low, round(rng.gauss(mean, stddev))) if stddev > 0 else max(low, mean)


def _tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids from `rng`'s next 4n bytes (each little-endian uint32 into the span)."""
    return (np.frombuffer(rng.randbytes(4 * n), dtype="<u4") % TOKEN_SPAN + TOKEN_LOW).tolist()


def build_sessions(cfg: ProfileConfig) -> list[SimSession]:
    rng = random.Random(cfg.random_seed)
    if cfg.input_file is not None:
        return _from_trace(cfg)
    if cfg.osl is None:
        raise SimError("--osl is needed (the simulated engine runs each request to its output length)")
    turns_mean = max(1, cfg.session_turns)
    n = cfg.num_sessions or (-(-(cfg.num_requests or 0) // turns_mean) if cfg.num_requests else 0)
    if not n:
        raise SimError("say how much to send: --num-requests, --conversation-num or --input-file")
    prefixes = [_tokens(rng, cfg.prefix_prompt_length) for _ in range(cfg.num_prefix_prompts)]
    shape = shape_rng(cfg.random_seed)  # turns, ISL, OSL, prefix: what `bench profile` draws from this seed
    out = []
    for i in range(n):
        turns = []
        for t in range(_length(shape, turns_mean, cfg.session_turns_stddev)):
            isl = _length(shape, cfg.isl, cfg.isl_stddev, cfg.prefix_prompt_length if prefixes else 1)
            osl = _length(shape, cfg.osl, cfg.osl_stddev)
            prefix = shape.randrange(len(prefixes)) if t == 0 and prefixes else None
            seed = rng.getrandbits(64)
            make = functools.partial(_content, prefixes, prefix, seed, isl, cfg.prefix_prompt_length)
            turns.append(SimTurn(make, osl, cfg.session_turn_delay_ms / 1000.0 if t else 0.0, isl))
        out.append(SimSession(i, turns))
    return out


def _content(prefixes: list[list[int]], prefix: int | None, seed: int, isl: int, prefix_len: int) -> list[int]:
    """A synthetic turn's tokens (made when sent: 100,000 prompts need not all be held)."""
    rng = random.Random(seed)
    if prefix is None:
        return _tokens(rng, isl)
    return prefixes[prefix] + _tokens(rng, max(1, isl - prefix_len))


def _from_trace(cfg: ProfileConfig) -> list[SimSession]:
    try:
        entries = parse_mooncake(cfg.input_file)  # type: ignore[arg-type]
    except LoadgenError as exc:
        raise SimError(str(exc)) from None
    bs = cfg.block_size
    blocks: dict[int, list[int]] = {}
    out = []
    t0 = min((e.timestamp_ms for e in entries if e.timestamp_ms is not None), default=0.0)
    def make(i: int, e: TraceEntry) -> list[int]:
        toks: list[int] = []
        for h in e.hash_ids:
            if h not in blocks:
                blocks[h] = _tokens(random.Random(h * 1_000_003 + cfg.random_seed), bs)
            toks += blocks[h]
        if len(toks) < e.input_length:
            toks += _tokens(random.Random(i * 7919 + cfg.random_seed + 1), e.input_length - len(toks))
        return toks[:e.input_length]

    for i, e in enumerate(entries):
        at = (e.timestamp_ms - t0) / 1000.0 if cfg.fixed_schedule and e.timestamp_ms is not None else None
        out.append(SimSession(i, [SimTurn(functools.partial(make, i, e), max(1, e.output_length or cfg.osl or 1))],
                              at))
    if cfg.num_requests:
        out = out[:cfg.num_requests]
    return out


class Driver:
    """Sends the sessions into the cluster on the virtual clock and keeps every finished flow."""

    def __init__(self, cfg: ProfileConfig, sessions: list[SimSession], cluster: OfflineCluster, loop: Loop,
                 on_flow: Callable[[Flow], None]) -> None:
        self.cfg = cfg
        self.sessions = sessions
        self.cluster = cluster
        self.loop = loop
        self.on_flow = on_flow
        self.limit = cfg.num_requests or sum(len(s.turns) for s in sessions)
        self.sent = 0
        self.next_session = 0
        self.deadline = cfg.benchmark_duration if cfg.benchmark_duration else float("inf")
        self.free_slots = cfg.concurrency or 0
        self.waiting_sessions: list[SimSession] = []
        # The arrivals `bench profile` draws (one client process): the same seed, the same gaps.
        self.rng = arrival_rng(cfg.random_seed)

    def start(self) -> None:
        cfg = self.cfg
        if cfg.fixed_schedule:
            for s in self.sessions:
                self.loop.at(s.at_s or 0.0, self._open, s)
        elif cfg.request_rate:
            t = 0.0
            for s in self.sessions:
                self.loop.at(t, self._open, s)
                t += self._gap(cfg.request_rate)
        else:
            for _ in range(cfg.concurrency or 1):
                self._next_closed()

    def _gap(self, rate: float) -> float:
        return next_gap(self.cfg.arrival, rate, self.cfg.arrival_smoothness, self.rng)

    # -- closed loop: each slot runs one session after another ---------------------------
    def _next_closed(self) -> None:
        if self.next_session < len(self.sessions) and self.sent < self.limit and self.loop.now < self.deadline:
            s = self.sessions[self.next_session]
            self.next_session += 1
            self._turn(s, 0, [], closed=True)

    # -- open loop: sessions start on schedule, capped by --concurrency if given ----------
    def _open(self, s: SimSession) -> None:
        if self.loop.now >= self.deadline:
            return
        if self.cfg.concurrency:
            if self.free_slots <= 0:
                self.waiting_sessions.append(s)
                return
            self.free_slots -= 1
        self._turn(s, 0, [], closed=False)

    def _session_done(self, closed: bool) -> None:
        # The next session starts from the loop, not from here: a request that fails at once
        # would otherwise start the next one call deeper each time.
        if closed:
            self.loop.at(self.loop.now, self._next_closed)
        elif self.cfg.concurrency:
            self.free_slots += 1
            if self.waiting_sessions:
                self.free_slots -= 1
                self.loop.at(self.loop.now, self._turn, self.waiting_sessions.pop(0), 0, [], False)

    def _turn(self, s: SimSession, t: int, history: list[int], closed: bool) -> None:
        if t >= len(s.turns) or self.sent >= self.limit or self.loop.now >= self.deadline:
            self._session_done(closed)
            return
        self.sent += 1
        turn = s.turns[t]
        prompt = history + turn.content
        seed = (self.cfg.random_seed * 1_000_003 + s.index * 1009 + t) & 0x7FFFFFFF

        def done(flow: Flow) -> None:
            self.on_flow(flow)
            if t + 1 < len(s.turns):  # the next turn carries this one's prompt and answer
                answer = [output_token(seed, i) for i in range(len(flow.times))]
                self.loop.after(s.turns[t + 1].delay_s, self._turn, s, t + 1, prompt + answer, closed)
            else:
                self._session_done(closed)

        flow = Flow(f"s{s.index}-t{t}", s.index, t, prompt, turn.osl, seed, self.loop.now, done)
        self.cluster.submit(flow)
