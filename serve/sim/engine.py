"""The simulated engine: a continuous-batching scheduler over a real block table.

Each step schedules running requests first (one decode token each, or the next prefill
chunk), then admits waiting ones while the batch has room (`max_num_seqs`), the step has
token budget (`max_num_batched_tokens`) and the block table has space; a decode that
cannot grow preempts the newest running request (its blocks freed, recomputed later), as
vLLM does. The step lasts what the `StepModel` says; then prefill progress is applied,
finished prefills sample their first token, decodes their next (`tokens.token_at`).

KV transfer hooks: a request that arrives with its KV loaded elsewhere (`load_done`) has
its prompt computed but its last token, as vLLM's connector scheduling does; a request
marked `hold` keeps its blocks after finishing until `release`. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from kvtransfer.protocol import TransferParams
from serve import protocol as p
from serve.sim.blocks import BlockTable, NoSpace
from serve.sim.timing import StepModel
from serve.sim.tokens import Vocabulary, is_stop, request_key, token_at

log = logging.getLogger("pdserve.sim")


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 256
    max_model_len: int = 8192
    block_size: int = 128
    num_blocks: int = 4096
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    eos_rate: float = 1 / 64
    speedup: float = 1.0  # modelled step times are divided by this (leases, polls, timeouts are not)


@dataclass(eq=False)  # compared by identity: `in` over the batch must not compare fields
class SimRequest:
    request_id: str
    prompt: list[int]
    sampling: p.SamplingOptions
    key: bytes
    hold: bool = False  # keep the blocks after finishing (a prefill for a remote decode)
    output: list[int] = field(default_factory=list)
    in_prefill: bool = True
    target: int = 0  # tokens this prefill computes before sampling (the prompt; after a preemption, all so far)
    computed: int = 0  # tokens of this prefill whose KV exists
    cached: int = 0  # prompt tokens found in the local prefix cache
    external: int = 0  # prompt tokens whose KV came from another engine
    allocated: bool = False
    loading: bool = False  # waiting for its KV from a remote engine
    finished: str | None = None  # finish reason
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = 0.0
    # Tokens at the prompt's end that are output already (the prefill's token a decode
    # continues after): they count in the output's positions, so a split request's tokens
    # are an unsplit one's; `remote_tokens` is how many prompt tokens the remote KV covers.
    offset: int = 0
    remote_tokens: int | None = None
    kv_load_s: float | None = None  # how long it waited for its remote KV (reported on its first line)
    is_running: bool = False  # in `SimEngine.running` (kept with it: a membership test without a scan)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class StepCounters:
    """Totals since start, exported as vLLM's own counters."""

    steps: int = 0
    prompt_local_compute: int = 0
    prompt_local_cache_hit: int = 0
    prompt_external: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class SimEngine:
    # Each request's output key (`request_key`: a hash of its prompt and seed) for `token_at`;
    # the offline engine draws tokens from the seed alone and turns it off.
    keyed = True

    def __init__(self, cfg: SimConfig, vocab: Vocabulary, step_model: StepModel, table: BlockTable,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.cfg = cfg
        self.vocab = vocab
        self.step_model = step_model
        self.table = table
        self.clock = clock
        self.sleep = sleep
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.counters = StepCounters()
        # A finished request marked `hold`: keep its blocks, return its transfer params.
        self.on_finished: Callable[[SimRequest], TransferParams | None] | None = None
        # Each step run: (wall-clock start, seconds, decode contexts, prefill chunks).
        self.on_step: Callable[[float, float, list[int], list[list[int]]], None] | None = None
        self.slowdown = 1.0  # a fault (`POST /sim/fault` slow_step): steps take this many times longer
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dead: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    # -- requests ---------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], sampling: p.SamplingOptions, hold: bool = False,
            loading: bool = False, remote_tokens: int | None = None) -> SimRequest:
        """`remote_tokens`: how many prompt tokens a remote prefill's KV covers; the ones after
        it are that prefill's output (its first token), which this request continues."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already running")
        if len(prompt) + sampling.max_tokens > self.cfg.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds max_model_len "
                             f"{self.cfg.max_model_len}")
        if self.table.blocks_needed(len(prompt) + sampling.max_tokens) > self.cfg.num_blocks:
            # It could never be scheduled whole: refuse it now rather than leave it waiting.
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) needs more KV blocks "
                             f"than the cache holds ({self.cfg.num_blocks} of {self.cfg.block_size} tokens)")
        if not self.cfg.enable_chunked_prefill and len(prompt) > self.cfg.max_num_batched_tokens:
            raise ValueError(f"prompt ({len(prompt)}) exceeds max_num_batched_tokens "
                             f"{self.cfg.max_num_batched_tokens} without chunked prefill")
        base = len(prompt) if remote_tokens is None else max(1, min(remote_tokens, len(prompt)))
        key = request_key(prompt[:base], sampling) if self.keyed else b""
        req = SimRequest(request_id, prompt, sampling, key, hold=hold, loading=loading,
                         arrival=self.clock(), offset=len(prompt) - base, remote_tokens=remote_tokens)
        self.requests[request_id] = req
        self.waiting.append(req)
        self._wake.set()
        return req

    def load_done(self, req: SimRequest, ok: bool) -> None:
        """The request's remote KV arrived (ok) or failed (recompute the prompt here)."""
        if not req.loading or req.finished:
            return
        req.loading = False
        req.kv_load_s = self.clock() - req.arrival
        if ok:
            try:
                cached = self.table.allocate(req.request_id, req.prompt)
            except NoSpace:
                ok = False  # no room for the transferred blocks: compute locally when there is
            else:
                req.allocated = True
                req.cached = cached
                req.target = len(req.prompt)
                # As vLLM: the tokens the remote KV covers are computed, and at least the last
                # prompt token runs here, to sample (it is the prefill's token when one came along).
                covered = len(req.prompt) if req.remote_tokens is None else min(req.remote_tokens, len(req.prompt))
                req.computed = min(covered, len(req.prompt) - 1)
                req.external = req.computed - cached
                self.table.commit(req.request_id, req.prompt[:req.computed])
        self._wake.set()

    def kill(self, reason: str = "killed by fault injection") -> None:
        """The engine dies (a fault): every request ends in an error, nothing runs again."""
        self.dead = RuntimeError(reason)
        if self._task is not None:
            self._task.cancel()
        for req in list(self.requests.values()):
            self._finish(req, "error")

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while True:
                if not self.running and not any(not r.loading for r in self.waiting):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must not hang every request
            log.exception("simulated engine died")
            self.dead = exc
            for req in list(self.requests.values()):
                self._finish(req, "error")
            raise

    def schedule(self) -> list[tuple[SimRequest, int]]:
        budget = self.cfg.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        for req in list(self.running):
            if budget <= 0:
                break
            if not req.is_running:  # preempted below
                continue
            if req.in_prefill:
                n = min(req.target - req.computed, budget)
            else:
                n = 1
                total = len(req.prompt) + len(req.output) + 1
                while not self.table.try_grow(req.request_id, total):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                if not req.is_running:
                    continue
            batch.append((req, n))
            budget -= n
        blocked = False  # a request found no room: later ones that need room wait too (first come, first served)
        for req in list(self.waiting):
            if len(self.running) >= self.cfg.max_num_seqs or budget <= 0:
                break
            if req.loading or (blocked and not req.allocated):
                continue
            if not req.allocated:
                context = req.context
                try:
                    cached = self.table.allocate(req.request_id, context)
                except NoSpace:
                    # Those whose KV already arrived hold their blocks: they still run (else
                    # they and the head of the queue would wait for each other forever).
                    blocked = True
                    continue
                if not req.output:
                    req.cached = cached
                req.allocated = True
                req.computed = cached
                req.target = len(context)
            n = req.target - req.computed
            if n > budget:
                if not self.cfg.enable_chunked_prefill:
                    break
                n = budget
            self.waiting.remove(req)
            self.running.append(req)
            req.is_running = True
            batch.append((req, n))
            budget -= n
        return [(r, n) for r, n in batch if r.is_running]  # a preemption may have taken one back

    async def _step(self) -> None:
        batch = self.schedule()
        if not batch:
            # Nothing fits (every waiting request lacks blocks held by others): wait for a change.
            self._wake.clear()
            await self._wake.wait()
            return
        start = time.time()
        seconds = self.step_time(batch)
        await self.sleep(seconds)
        if self.on_step is not None:  # the worker's step records (modelled time, as slept)
            decodes, chunks = self.batch_shape(batch)
            self.on_step(start, seconds, decodes, [list(c) for c in chunks])
        self.complete(batch)

    @staticmethod
    def batch_shape(batch: list[tuple[SimRequest, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """(each decode's context, each prefill chunk as (computed, new) tokens)."""
        decodes = [len(r.prompt) + len(r.output) for r, n in batch if not r.in_prefill]
        chunks = [(r.computed, n) for r, n in batch if r.in_prefill]
        return decodes, chunks

    def step_time(self, batch: list[tuple[SimRequest, int]]) -> float:
        """The step model's time for `batch` (per-request decode contexts and prefill chunks),
        divided by the speed-up (`--sim-speedup`: modelled step times only)."""
        decodes, chunks = self.batch_shape(batch)
        return self.step_model.step_seconds(decodes, chunks) / self.cfg.speedup * self.slowdown

    def complete(self, batch: list[tuple[SimRequest, int]]) -> None:
        """The step is over: apply its prefill progress, sample its tokens. The offline
        simulator calls `schedule`, `step_time` and this on its virtual clock; the live loop
        sleeps between them."""
        self.counters.steps += 1
        for req, n in batch:
            if req.finished:  # aborted during the step
                continue
            if req.in_prefill:
                req.computed += n
                self.counters.prompt_local_compute += n
                if req.computed < req.target:
                    continue
                req.in_prefill = False
                if not req.output:
                    self.counters.prompt_local_cache_hit += req.cached
                    self.counters.prompt_external += req.external
                self.table.commit(req.request_id, req.context if req.output else req.prompt)
            self._sample(req)

    def _sample(self, req: SimRequest) -> None:
        # Positions and min_tokens count the output the prompt already carries (`offset`).
        pos = req.offset + len(req.output)
        sampling = req.sampling if not req.offset else msgspec.structs.replace(
            req.sampling, min_tokens=req.sampling.min_tokens + req.offset)
        tok = token_at(req.key, pos, self.vocab, sampling, self.cfg.eos_rate)
        req.output.append(tok)
        self.counters.generation_tokens += 1
        if len(req.output) > 1:
            self.table.commit(req.request_id, req.prompt + req.output[:-1])
        reason = None
        if is_stop(tok, pos, self.vocab, sampling):
            reason = "stop"
        elif len(req.output) >= req.sampling.max_tokens:
            reason = "length"
        first = len(req.output) == 1
        params = self._finish(req, reason, announce=False) if reason is not None else None
        req.deltas.put_nowait(p.TokenDelta(
            token_ids=[tok], finished=reason is not None, finish_reason=reason,
            num_prompt_tokens=len(req.prompt) if first else None,
            num_cached_tokens=(req.cached + req.external) if (first or reason) else None, kv_transfer=params,
            kv_load_s=req.kv_load_s if first else None))

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        req.is_running = False
        self.table.free(req.request_id)
        req.allocated = False
        req.in_prefill = True  # recomputed with its output so far, as vLLM recomputes a preempted request
        req.computed = 0
        self.waiting.appendleft(req)
        self.counters.preemptions += 1

    def _finish(self, req: SimRequest, reason: str, announce: bool = True) -> TransferParams | None:
        """End the request; a held one's blocks go to `on_finished`, which returns its transfer params."""
        if req.finished:
            return None
        req.finished = reason
        self.requests.pop(req.request_id, None)
        if req.is_running:
            self.running.remove(req)
            req.is_running = False
        if req in self.waiting:
            self.waiting.remove(req)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        if announce:
            req.deltas.put_nowait(p.TokenDelta(finished=True, finish_reason=reason))  # type: ignore[arg-type]
        params = None
        if req.hold and reason in ("stop", "length") and self.on_finished is not None:
            params = self.on_finished(req)  # the holder keeps the blocks (and frees them later)
        else:
            self.table.free(req.request_id)
        self._wake.set()
        return params
