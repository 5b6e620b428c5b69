"""`EngineBackend` of a simulated worker: the modelled engine behind the real worker protocol.

Everything above it is the real worker (`serve.worker.app`): the same endpoints, metrics,
registration, access tokens and drain. What it emits says it is simulated: `/info` has
`engine: "sim"`, `/metrics` has `pdserve_sim_engine_info`, and its log lines start with
"sim". It needs neither vLLM nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
import dataclasses
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serve import listen, protocol as p
from serve.sim.blocks import BlockTable
from serve.sim.config import SimOptions
from serve.sim.engine import SimEngine, SimRequest
from serve.sim.events import EventPublisher
from serve.sim.kv import Holder, Reader, StatsBox, sim_metadata
from serve.sim.tokens import Vocabulary
from serve.worker.backend import EngineFacts, EngineLoad, InvalidRequest

log = logging.getLogger("pdserve.sim")
REPORT_S = 0.05


@dataclass(frozen=True)
class SimRole:
    role: str  # agg | prefill | decode
    engine_id: str
    model: str
    served_model_name: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    lease_s: float = 30.0
    read_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    cluster_token: str | None = None
    kv_events_bind: str | None = None  # where to publish KV events (None: not published)
    fault_pause_s: float = 0.0  # test-only: a decode waits this long before it acquires
    side_channel_auto: bool = False  # the port was picked here (late_port): another may be tried


class SimBackend:
    name = "sim"

    def __init__(self, opts: SimOptions, role: SimRole, vocab: Vocabulary | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts = opts
        self.role = role
        self.vocab = vocab or Vocabulary.from_model_dir(role.model)
        self.clock = clock
        self.on_kv_stats: Callable[[Any], None] | None = None
        self.on_step: Callable[[float, float, list[int], list[list[int]]], None] | None = None
        self.stats = StatsBox()
        self.events = EventPublisher(role.kv_events_bind) if role.kv_events_bind else None
        cfg = opts.engine
        self.table = BlockTable(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                on_event=self.events.add if self.events else None)
        self.engine: SimEngine | None = None
        self.holder: Holder | None = None
        self.reader: Reader | None = None
        self._metadata = None
        self._loads: set[asyncio.Task] = set()
        self._report: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> EngineFacts:
        cfg, r = self.opts.engine, self.role
        if self.opts.startup_s > 0:  # a new engine is not ready at once (--sim-startup-s, wall-clock)
            log.info("sim engine %s: starting (%.1f s)", r.engine_id, self.opts.startup_s)
            await asyncio.sleep(self.opts.startup_s)
        self.engine = SimEngine(cfg, self.vocab, self.opts.step_model, self.table, clock=self.clock)
        self.engine.on_step = self.on_step
        for attempt in range(10):
            side = f"tcp://{r.side_channel_host}:{r.side_channel_port}"
            self._metadata = sim_metadata(r.engine_id, r.model, cfg.kv_cache_dtype, cfg.block_size, cfg.num_blocks,
                                          self.opts.shape.num_layers,
                                          max(1, self.opts.bytes_per_block // self.opts.shape.num_layers), side)
            if r.role != "prefill":
                break
            try:
                self.holder = Holder(self.table, lambda: self._metadata, side, r.lease_s, r.read_timeout_s,
                                     r.cluster_token, self.stats, clock=self.clock)
                break
            except zmq.ZMQError as exc:
                # A port picked free a moment ago can be taken by another process starting at
                # the same time (hundreds of workers at once): pick again.
                if exc.errno != zmq.EADDRINUSE or not r.side_channel_auto or attempt == 9:
                    raise
                r = self.role = dataclasses.replace(r, side_channel_port=listen.late_port(r.side_channel_host))
        if r.role == "prefill":
            self.holder.engine_id = r.engine_id
            self.engine.on_finished = lambda req: self.holder.hold(req, side)
            self.holder.start()
        elif r.role == "decode":
            self.reader = Reader(lambda: self._metadata, r.cluster_token, r.handshake_timeout_s,
                                 self.opts.kv_bandwidth_gbps, self.stats, r.fault_pause_s, self.opts.kv_latency_s,
                                 cfg.speedup)
        self.engine.start()
        self._report = asyncio.create_task(self._report_loop())
        log.info("sim engine %s (%s): %d blocks of %d tokens, max_num_seqs %d, step model %s", r.engine_id, r.role,
                 cfg.num_blocks, cfg.block_size, cfg.max_num_seqs, self.opts.step_model.name)
        return EngineFacts(max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                           kv_cache_dtype=cfg.kv_cache_dtype, num_kv_blocks=cfg.num_blocks, seeds=True,
                           kv_bytes_per_block=self.opts.bytes_per_block)

    async def stop(self) -> None:
        for t in list(self._loads):
            t.cancel()
        if self._report is not None:
            self._report.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._report
        if self.engine is not None:
            await self.engine.stop()
        if self.holder is not None:
            await self.holder.stop()
        if self.reader is not None:
            self.reader.close()
        if self.events is not None:
            self.events.close()

    def routes(self) -> list:
        """The simulated worker's own route: `POST /sim/fault` (serve.sim.faults)."""
        from serve.sim import faults

        return faults.routes(self)

    async def kill(self) -> None:
        """A fault: the engine dies, its side channel goes silent; the process lives on."""
        if self.engine is not None:
            self.engine.kill()
        if self.holder is not None:
            holder, self.holder = self.holder, None
            await holder.stop()

    def shutdown(self) -> None:
        """Synchronous part of the stop (the worker's lifespan awaits `stop` first when it can)."""
        if self.events is not None:
            self.events.close()
            self.events = None

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            self.report()

    def report(self) -> None:
        """Publish pending KV events and hand KV stats to the worker's metrics."""
        if self.events is not None:
            self.events.flush()
        if self.holder is not None:
            self.holder.settle()
        if self.on_kv_stats is not None:
            self.on_kv_stats(self.stats.take(self.holder.held_blocks if self.holder else None))

    # -- requests ---------------------------------------------------------------------
    def _check(self, req: p.GenerateRequest) -> None:
        s = req.sampling
        if s.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if s.temperature < 0:
            raise InvalidRequest(f"temperature must be non-negative, got {s.temperature}")
        if not 0 < s.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
        if s.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be non-negative, got {s.min_tokens}")

    async def generate(self, req: p.GenerateRequest) -> AsyncIterator[p.TokenDelta]:
        self._check(req)
        if self.engine is None or self.engine.dead is not None:
            raise RuntimeError("the simulated engine is not running")
        if req.kv_transfer is not None and self.reader is None:
            raise InvalidRequest(f"this {self.role.role} worker cannot load remote KV")
        try:
            sim = self.engine.add(req.request_id, list(req.prompt_token_ids), req.sampling,
                                  hold=req.remote_decode and self.holder is not None,
                                  loading=req.kv_transfer is not None,
                                  remote_tokens=req.kv_transfer.num_tokens if req.kv_transfer is not None else None)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if req.kv_transfer is not None:
            task = asyncio.create_task(self._load(sim, req.kv_transfer))
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)
        while True:
            delta = await sim.deltas.get()
            yield delta
            if delta.finished:
                return

    async def _load(self, sim: SimRequest, params: Any) -> None:
        ok = False
        try:
            ok = await self.reader.load(params)
        finally:
            if self.engine is not None:
                self.engine.load_done(sim, ok)

    async def abort(self, request_id: str) -> None:
        if self.engine is not None and self.engine.abort(request_id):
            return
        if self.holder is not None:
            self.holder.abort(request_id)

    async def check_health(self) -> None:
        if self.engine is None or self.engine.dead is not None:
            raise RuntimeError(f"simulated engine dead: {self.engine.dead if self.engine else 'not started'}")

    async def reset_prefix_cache(self) -> bool:
        return self.table.reset()

    def load(self) -> EngineLoad:
        e = self.engine
        if e is None:
            return EngineLoad()
        return EngineLoad(e.num_running, e.num_waiting, self.table.usage)

    @property
    def dead(self) -> bool:
        return self.engine is not None and self.engine.dead is not None

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """vLLM's own series that pdserve reads, from the simulated engine, read at scrape time."""

    def __init__(self, backend: SimBackend) -> None:
        self.b = backend

    def collect(self):
        b = self.b
        labels = {"model_name": b.role.served_model_name, "engine": "0"}
        names, values = list(labels), list(labels.values())
        info = GaugeMetricFamily("pdserve_sim_engine_info", "A simulated engine (not vLLM): its step model",
                                 labels=["step_model", "role"])
        info.add_metric([b.opts.step_model.name, b.role.role], 1)
        yield info
        e = b.engine
        running = e.num_running if e else 0
        waiting = e.num_waiting if e else 0
        for name, doc, value in (("vllm:num_requests_running", "Requests in model execution batches", running),
                                 ("vllm:num_requests_waiting", "Requests waiting to be processed", waiting),
                                 ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", b.table.usage)):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g
        c = e.counters if e else None
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source",
                                        labels=[*names, "source"])
        for source, value in (("local_compute", c.prompt_local_compute if c else 0),
                              ("local_cache_hit", c.prompt_local_cache_hit if c else 0),
                              ("external_kv_transfer", c.prompt_external if c else 0)):
            by_source.add_metric([*values, source], value)
        yield by_source
        for name, doc, value in (("vllm:generation_tokens", "Number of generation tokens processed",
                                  c.generation_tokens if c else 0),
                                 ("vllm:num_preemptions", "Cumulative number of preemptions",
                                  c.preemptions if c else 0)):
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            yield m
