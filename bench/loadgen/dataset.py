"""What a run sends: sessions of turns with their bodies and send times.

A Session is one conversation: single-turn for synthetic ISL/OSL runs and traces, several
turns with `--conversation-turn-mean`. `at_s` is when the session's first request is due,
relative to the start of the phase (None: as soon as a concurrency slot is free). Sessions
are plain dataclasses of str/bytes/numbers, so they pickle cheaply to client processes.

Mooncake traces (`--input-file`): one JSON object per line with `input_length`,
`output_length`, optional `timestamp` (ms) and `hash_ids`. Each hash id stands for one block
of `--isl-block-size` tokens; equal ids are equal text, so traces with shared prefixes produce
prompts with the same shared prefixes. With `--fixed-schedule` each request is sent at its
timestamp.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen.config import ProfileConfig
from bench.loadgen.errors import DatasetError, LoadgenError
from bench.loadgen.prompts import PromptBuilder

# Synthetic runs bounded only by --benchmark-duration cycle through this many sessions.
DURATION_POOL = 1000
FIT_SAMPLE = 64


@dataclass
class Turn:
    content: str
    isl: int | None  # expected prompt tokens (first turns; later turns include history)
    osl: int | None
    delay_ms: float = 0.0  # wait after the previous turn's reply
    body: bytes | None = None  # pre-encoded JSON for first turns


@dataclass
class Session:
    index: int
    turns: list[Turn]
    at_s: float | None = None
    hash_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TraceEntry:
    timestamp_ms: float | None
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_mooncake(path: Path) -> list[TraceEntry]:
    """Parse a Mooncake trace; a bad line is a DatasetError naming the line."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{n}: invalid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object")
        try:
            isl = int(obj["input_length"])
            osl = int(obj.get("output_length", 0) or 0)
            ts = obj.get("timestamp")
            ts = float(ts) if ts is not None else None
            ids = tuple(int(h) for h in obj.get("hash_ids") or ())
        except KeyError as e:
            raise DatasetError(f"{path}:{n}: missing field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise DatasetError(f"{path}:{n}: {e}") from e
        if isl < 1 or osl < 0:
            raise DatasetError(f"{path}:{n}: input_length must be >= 1 and output_length >= 0")
        out.append(TraceEntry(ts, isl, osl, ids))
    if not out:
        raise DatasetError(f"{path}: no entries")
    return out


def shape_rng(seed: int, warmup: bool = False) -> random.Random:
    """The random stream of a synthetic workload's shape: sessions' turns, each turn's ISL
    and OSL (drawn in that order), and the first turn's prefix (`pdserve sim` draws the same)."""
    return random.Random(f"{seed}:{'warmup' if warmup else 'shape'}")


def _length(rng: random.Random, mean: int, stddev: float, low: int) -> int:
    if stddev <= 0:
        return max(low, mean)
    return max(low, round(rng.gauss(mean, stddev)))


class PlanBuilder:
    """Turns a ProfileConfig into warmup and profiling sessions with encoded bodies."""

    def __init__(self, cfg: ProfileConfig, prompts: PromptBuilder) -> None:
        self.cfg = cfg
        self.p = prompts
        self.rng = random.Random(cfg.random_seed)
        self.prefixes = self._prefixes()
        self._blocks: dict[int, str] = {}

    def _prefixes(self) -> list[str]:
        n, length = self.cfg.num_prefix_prompts, self.cfg.prefix_prompt_length
        return [self.p.words_text(length, self.rng) for _ in range(n)]

    def base_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model}
        if self.cfg.streaming:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def encode(self, content: str, osl: int | None, history: list[dict] | None = None) -> bytes:
        body = self.base_body()
        if self.p.chat:
            body["messages"] = (history or []) + [{"role": "user", "content": content}]
        else:
            body["prompt"] = content
        if osl:
            body["max_tokens"] = osl
        body.update(self.cfg.extra_inputs)
        return json.dumps(body, separators=(",", ":")).encode()

    def _synthetic(self, n_sessions: int, start_index: int) -> list[Session]:
        cfg = self.cfg
        # The workload's shape (turns, lengths, which prefix) comes from a stream of its own, so
        # `pdserve sim` draws the same shape from the same seed (bench/sim/workload.py); the
        # text comes from `self.rng`.
        shape = shape_rng(cfg.random_seed, warmup=start_index < 0)
        sessions, contents, targets, where = [], [], [], []
        for s in range(n_sessions):
            turns = []
            for t in range(_length(shape, cfg.session_turns, cfg.session_turns_stddev, 1)):
                isl = _length(shape, cfg.isl, cfg.isl_stddev, self.p.min_isl() + cfg.prefix_prompt_length)
                osl = _length(shape, cfg.osl, cfg.osl_stddev, 1) if cfg.osl else None
                prefix = self.prefixes[shape.randrange(len(self.prefixes))] if self.prefixes and t == 0 else ""
                content = self.p.build(isl, self.rng, prefix, cfg.prefix_prompt_length if prefix else 0)
                turns.append(Turn(content, isl, osl, cfg.session_turn_delay_ms if t else 0.0))
                contents.append(content)
                targets.append(isl)
                where.append((s, t))
            sessions.append(Session(start_index + s, turns))
        self._fit(sessions, contents, targets, where)
        return sessions

    def _fit(self, sessions: list[Session], contents: list[str], targets: list[int],
             where: list[tuple[int, int]]) -> None:
        if not contents:
            return
        fitted = self.p.fit(contents, targets, self.rng, sample=FIT_SAMPLE)
        self.p.check_whole(fitted[0], targets[0])
        for (s, t), text in zip(where, fitted):
            turn = sessions[s].turns[t]
            turn.content = text
            if t == 0:
                turn.body = self.encode(text, turn.osl)

    def _block(self, h: int) -> str:
        if h not in self._blocks:
            self._blocks[h] = self.p.words_text(self.cfg.block_size, random.Random(f"{self.cfg.random_seed}:{h}"))
        return self._blocks[h]

    def _from_trace(self, entries: list[TraceEntry]) -> list[Session]:
        sessions, contents, targets, where = [], [], [], []
        for i, e in enumerate(entries):
            budget = self.p.content_budget(e.input_length)
            words: list[str] = []
            for h in e.hash_ids:
                if len(words) >= budget:
                    break
                words += self._block(h).split(" ")
            words = words[:budget]
            if len(words) < budget:
                words += self.p.words_text(budget - len(words), self.rng).split(" ")
            content = " ".join(words)
            osl = e.output_length or None
            sessions.append(Session(i, [Turn(content, e.input_length, osl)], hash_ids=list(e.hash_ids)))
            contents.append(content)
            targets.append(e.input_length)
            where.append((i, 0))
        self._fit(sessions, contents, targets, where)
        return sessions

    def build(self) -> tuple[list[Session], list[Session]]:
        """(warmup sessions, profiling sessions) for this config."""
        cfg = self.cfg
        warmup = self._synthetic(cfg.warmup_requests, -cfg.warmup_requests) if cfg.warmup_requests else []
        if cfg.input_file is not None:
            entries = parse_mooncake(cfg.input_file)
            if cfg.fixed_schedule:
                entries = self._window(entries)
            if cfg.num_requests:
                entries = entries[:cfg.num_requests]
            sessions = self._from_trace(entries)
            if cfg.fixed_schedule:
                base = entries[0].timestamp_ms if cfg.fixed_schedule_auto_offset else (cfg.fixed_schedule_start_offset or 0)
                for s, e in zip(sessions, entries):
                    s.at_s = max(0.0, (e.timestamp_ms - base) / 1000.0)  # type: ignore[operator]
            return warmup, sessions
        if cfg.num_sessions:
            n = cfg.num_sessions
        elif cfg.num_requests:
            n = cfg.num_requests
        elif cfg.benchmark_duration:
            n = DURATION_POOL
        else:
            n = 10
        return warmup, self._synthetic(n, 0)

    def _window(self, entries: list[TraceEntry]) -> list[TraceEntry]:
        if any(e.timestamp_ms is None for e in entries):
            raise DatasetError("--fixed-schedule needs a timestamp on every trace entry")
        lo, hi = self.cfg.fixed_schedule_start_offset, self.cfg.fixed_schedule_end_offset
        kept = [e for e in entries if (lo is None or e.timestamp_ms >= lo) and (hi is None or e.timestamp_ms <= hi)]
        if not kept:
            raise LoadgenError("no trace entries inside the fixed-schedule offsets")
        return sorted(kept, key=lambda e: e.timestamp_ms)  # type: ignore[arg-type, return-value]
