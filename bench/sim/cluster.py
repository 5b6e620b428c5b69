"""A cluster on the virtual clock: simulated engines behind the frontend's real routing.

What is real here (the production code, called as the frontend calls it): the worker pool
(`serve.frontend.pool.WorkerPool`, each worker registered with the `WorkerInfo` a
simulated worker sends, its `WorkerLoad` refreshed every `poll_interval_s` as the poller
does), the routing glue (`serve.frontend.routing.Routing`: filters, the PrefillRouter's
costs and picker, conditional disaggregation), the load tracker, and the prefix index fed
by the engines' own KV events (vLLM's event types, applied as the KV-event subscriber
applies them). Admission follows the frontend's limits: `max_active_requests` served at
once, `max_queued_requests` waiting (FIFO), the next refused with 429.

What is modelled: each engine (`bench.sim.engine.OfflineEngine`, the simulated worker's
scheduler and block table), the KV transfer (all held blocks' bytes over the link's
bandwidth plus a per-READ latency), and nothing else: the frontend's and the client's own
CPU time is left out (on a GPU cluster it overlaps the engines' steps).

A split request follows the frontend's default path: with `--max-prefills-per-worker` it
waits in the frontend's prefill gate (bench/sim/gate.py) for a prefill worker with room; the
prefill worker computes the prompt and its first token (streamed at once), holds its blocks;
the decode worker, chosen again by the load as the prefill ends (`Routing.decode_for`), reads
them, continues after that token, and the prefill's blocks are freed when the read is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from router.events import Event
from serve import protocol as p
from serve.errors import NoWorkerAvailable
from serve.frontend.pool import WorkerPool
from serve.frontend.routing import Routing
from serve.frontend.settings import FrontendSettings
from serve.sim.blocks import BlockTable
from serve.sim.engine import SimConfig, SimRequest
from serve.sim.kv import transfer_seconds
from serve.sim.timing import StepModel

from bench.sim.engine import OfflineEngine
from bench.sim.flow import Flow, Link, SimWorker, ended
from bench.sim.gate import OfflineGate
from bench.sim.loop import Loop

MODEL = "sim"


class OfflineCluster:
    def __init__(self, loop: Loop, settings: FrontendSettings, roles: list[str], cfg: SimConfig, step_model: StepModel,
                 bytes_per_block: int, link: Link, tp: int = 1,
                 per_role: dict[str, tuple[SimConfig, StepModel]] | None = None) -> None:
        self.loop = loop
        self.settings = settings
        self.cfg = cfg
        # Roles whose engines differ from the rest (a disaggregated layout with prefill and
        # decode workers of different TP): their own engine options and step model.
        self.per_role = per_role or {}
        self.link = link
        self.bytes_per_block = bytes_per_block
        self.pool = WorkerPool(settings.served_model_name, [], settings.poll_interval_s, settings.max_poll_failures,
                               client=None, clock=loop.clock)  # type: ignore[arg-type]  (no HTTP offline)
        self.routing = Routing(settings, self.pool)
        self.workers: dict[str, SimWorker] = {}
        self.flows: dict[str, Flow] = {}
        self.active = 0
        self.queue: deque[Flow] = deque()
        self._draining = False
        self.finished = 0
        self.recomputes = 0  # decode workers that computed a prompt whose KV could not be read
        self.prefill_timeouts = 0  # prefills sent and given up at --prefill-timeout (the decode worker prefilled)
        self.tp = tp
        self.on_submit: Callable[[Flow], None] | None = None  # sees every arrival (an autoscaler's observer)
        cap = settings.max_prefills_per_worker
        self.gate = OfflineGate(cap, self.routing.load, lambda: self.routing.eligible(("prefill",)), loop,
                                settings.prefill_timeout_s) if cap else None
        for i, role in enumerate(roles):
            self.add_worker(f"http://sim-{role}-{i}:8100", role, step_model)

    # -- workers --------------------------------------------------------------------------
    def add_worker(self, url: str, role: str, step_model: StepModel) -> SimWorker:
        cfg, step_model = self.per_role.get(role, (self.cfg, step_model))
        index = self.routing.router.index
        on_event: Callable[[Event], None] | None = None
        if self.settings.use_kv_events and self.settings.router_mode == "kv":
            def on_event(ev: Event, url: str = url) -> None:
                index.apply(url, ev)
        table = BlockTable(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, on_event=on_event)
        w: SimWorker

        def on_token(req: SimRequest) -> None:
            self._token(w, req)

        engine = OfflineEngine(cfg, step_model, table, self.loop, on_token)
        if role == "prefill":
            engine.on_finished = lambda req: None  # the holder keeps the blocks until the READ is done
        w = SimWorker(url, role, engine, table)
        self.workers[url] = w
        info = p.WorkerInfo(worker_id=url.rsplit("/", 1)[-1], role=role, url=url, model=MODEL,  # type: ignore[arg-type]
                            served_model_name=self.settings.served_model_name, max_model_len=cfg.max_model_len,
                            block_size=cfg.block_size, kv_cache_dtype=cfg.kv_cache_dtype,
                            num_kv_blocks=cfg.num_blocks, engine="sim", kv_bytes_per_block=self.bytes_per_block)
        reply = self.pool.register(p.Registration(info=info, lease_seconds=float("inf")))
        if not reply.accepted:
            raise ValueError(reply.message)
        self._poll_one(w)
        if role == "prefill":
            self._kick_gate()  # a joining prefill worker takes waiters
        return w

    def kill(self, url: str) -> None:
        """The worker dies as SIGKILL would: its requests end in errors, its blocks are gone,
        and the frontend notices at its next failed polls (`max_poll_failures`)."""
        w = self.workers[url]
        w.alive = False
        w.engine.stopped = True
        for flow in [f for f in self.flows.values() if w in (f.prefill, f.decode)]:
            if flow.decode is w and (url, "decode") in flow.reserved:
                self._fail(flow, 502, "worker_error", f"worker {url} died")
            elif flow.decode is w:
                pass  # not contacted yet (its prefill runs elsewhere): its send finds it dead and retries
            elif not flow.times:
                # Its prefill worker died mid-prefill: the decode worker computes the prompt
                # itself (the frontend's fallback), with the whole answer to generate.
                self._unreserve(flow, url, "prefill")
                self._fallback(flow)
            # else: the decode worker's READ finds the holder gone (`_loaded`) and recomputes
        self.routing.router.index.remove_worker(url)
        self._kick_gate()

    def drain(self, url: str) -> None:
        """The worker leaves rotation and finishes what it has (a real drain tells the
        frontend at once, as this poll does)."""
        w = self.workers[url]
        w.draining = True
        self._poll_one(w)

    def retire(self, url: str) -> None:
        """A drained worker with nothing left in flight stops and deregisters."""
        w = self.workers[url]
        w.alive = False
        w.engine.stopped = True
        entry = self.pool.workers.get(url)
        if entry is not None and entry.info is not None:
            self.pool.deregister(entry.info.worker_id)
        self.routing.router.index.remove_worker(url)

    def _poll_one(self, w: SimWorker) -> None:
        entry = self.pool.workers.get(w.url)
        if entry is None:
            return
        if not w.alive:
            entry.failures += 1
            if entry.failures >= self.pool.max_failures:
                entry.healthy = False
            return
        e = w.engine
        usage = w.table.usage
        entry.load = p.WorkerLoad(worker_id=entry.info.worker_id if entry.info else w.url,
                                  active_requests=len(e.requests), running_requests=len(e.running),
                                  waiting_requests=len(e.waiting), kv_usage=usage,
                                  active_blocks=round(usage * w.table.num_blocks), draining=w.draining)

    def poll(self) -> None:
        for w in self.workers.values():
            self._poll_one(w)

    # -- requests -------------------------------------------------------------------------
    def submit(self, flow: Flow) -> None:
        if self.on_submit is not None:
            self.on_submit(flow)
        s = self.settings
        if self.active < s.max_active_requests and not self.queue:
            self._start(flow)
        elif len(self.queue) < s.max_queued_requests:
            self.queue.append(flow)
        else:
            self._end(flow, (429, "rate_limit_error", "the frontend's queue is full"))

    def _start(self, flow: Flow) -> None:
        self.active += 1
        self.flows[flow.request_id] = flow
        try:
            plan = self.routing.plan(flow.prompt)
        except NoWorkerAvailable as exc:
            self._fail(flow, 503, "service_unavailable", str(exc))
            return
        flow.path = plan.reason
        flow.blocks = plan.prompt_blocks
        flow.roles = plan.decode_roles
        flow.decode = self.workers[plan.decode.url]
        flow.uncached_tokens, flow.transfer_bytes = plan.uncached_tokens, plan.transfer_bytes
        dd = plan.decode_decision
        flow.uncached_blocks = dd.prompt_blocks - dd.overlap_blocks if dd is not None else plan.prompt_blocks
        if plan.prefill is None:
            self._send_decode(flow, flow.prompt, flow.osl)
            return
        flow.plan = plan
        # The prefill stage's budget, the gate's wait included (the frontend's --prefill-timeout).
        flow.prefill_until = self.loop.now + self.settings.prefill_timeout_s
        if self.gate is None:
            self._granted(flow, plan)
        else:
            self.gate.admit(plan, lambda plan: self._granted(flow, plan), lambda: self._gate_timeout(flow))

    def _granted(self, flow: Flow, plan: Any) -> None:
        flow.plan = plan
        flow.prefill = self.workers[plan.prefill.url]
        self._send_prefill(flow)

    def _gate_timeout(self, flow: Flow) -> None:
        """No prefill worker had room within the prefill timeout: the decode worker prefills."""
        self._fallback(flow)

    def _fallback(self, flow: Flow) -> None:
        """No prefill (timed out, or its worker gone): the decode worker, chosen again by the
        load now as the frontend does after a prefill stage, computes the prompt itself."""
        flow.prefill = None
        self._rechoose_decode(flow, flow.plan)
        flow.path = "fallback"
        self._send_decode(flow, flow.prompt, flow.osl)

    def _prefill_expired(self, flow: Flow) -> None:
        """The frontend gives up on a prefill still running at --prefill-timeout: it closes the
        stream, the worker aborts the request and frees its blocks, the decode worker prefills."""
        pw = flow.prefill
        if pw is None or flow.times or self.flows.get(flow.request_id) is not flow:
            return  # it ended, or its prefill did (or fell back) in time
        if pw.alive:
            if flow.request_id in pw.engine.requests:
                pw.engine.abort(flow.request_id)
            if pw.table.holds(flow.request_id):
                pw.table.free(flow.request_id)
            pw.engine.token_times.pop(flow.request_id, None)
            pw.engine.kick()
        self._unreserve(flow, pw.url, "prefill")
        self.prefill_timeouts += 1
        self._kick_gate()
        self._fallback(flow)

    def _rechoose_decode(self, flow: Flow, plan: Any) -> None:
        """The decode worker chosen again by the load now, as the frontend does when a prefill ends."""
        flow.plan = None
        if plan is None:
            return
        plan = self.routing.decode_for(plan, len(flow.prompt))
        flow.decode = self.workers[plan.decode.url]
        dd = plan.decode_decision
        flow.uncached_blocks = dd.prompt_blocks - dd.overlap_blocks if dd is not None else plan.prompt_blocks

    def _kick_gate(self) -> None:
        # From the loop, not from inside an engine's step or a kill: a grant adds to an engine.
        if self.gate is not None and self.gate.held:
            self.loop.at(self.loop.now, self.gate.kick)

    def _send_prefill(self, flow: Flow) -> None:
        pw = flow.prefill
        assert pw is not None
        if not pw.alive:
            # Unreachable prefill worker: the frontend counts a fallback and the decode
            # worker computes the prompt itself.
            self.pool.report_failure(pw.url)
            self._fallback(flow)
            return
        self._reserve(flow, pw.url, "prefill")
        self._add(flow, pw, flow.prompt, 1, hold=True)
        if flow.request_id in self.flows:
            self.loop.at(flow.prefill_until, self._prefill_expired, flow)

    def _send_decode(self, flow: Flow, prompt: list[int], max_tokens: int, remote_tokens: int | None = None) -> None:
        """To the chosen decode (or aggregated) worker; one that is unreachable is reported
        to the pool and the next least-loaded one not yet tried gets it, as the frontend's
        retry after a connection error does."""
        while flow.decode is not None and not flow.decode.alive:
            self.pool.report_failure(flow.decode.url)
            flow.tried.add(flow.decode.url)
            try:
                entry = self.routing.next_worker(flow.roles, flow.tried, len(flow.prompt))
            except NoWorkerAvailable as exc:
                self._fail(flow, 503, "service_unavailable", str(exc))
                return
            flow.decode = self.workers[entry.url]
        dw = flow.decode
        assert dw is not None
        self._reserve(flow, dw.url, "decode")
        self._add(flow, dw, prompt, max_tokens, remote_tokens=remote_tokens)

    def _add(self, flow: Flow, w: SimWorker, prompt: list[int], max_tokens: int, hold: bool = False,
             remote_tokens: int | None = None) -> None:
        sampling = p.SamplingOptions(max_tokens=max_tokens, temperature=0.0, seed=flow.seed, ignore_eos=True)
        flow.sent = self.loop.now
        try:
            w.engine.add(flow.request_id, prompt, sampling, hold=hold, loading=remote_tokens is not None,
                         remote_tokens=remote_tokens)
            w.engine.token_times[flow.request_id] = flow.times
        except ValueError as exc:
            self._fail(flow, 400, "invalid_request_error", str(exc))
            return
        w.engine.kick()

    def _token(self, w: SimWorker, req: SimRequest) -> None:
        flow = self.flows.get(req.request_id)
        if flow is None:
            return
        if w is flow.prefill and w.role == "prefill" and len(flow.times) == 1:
            # The prefill's token: streamed at once; the decode worker continues after it.
            self._unreserve(flow, w.url, "prefill")
            self._kick_gate()
            flow.cached_tokens = req.cached
            self.routing.costs.observe_prefill(w.url, len(flow.prompt) - req.cached, self.loop.now - flow.sent)
            if flow.osl <= 1:
                w.table.free(req.request_id)  # nothing left for a decode: release at once
                w.engine.kick()
                self._end(flow)
                return
            self._rechoose_decode(flow, flow.plan)
            held = w.table.blocks_of(req.request_id) if w.table.holds(req.request_id) else []
            # The decode worker reads the blocks it lacks (its own prefix cache serves the rest).
            nbytes = min(len(held), flow.uncached_blocks) * self.bytes_per_block
            self._send_decode(flow, flow.prompt + req.output, flow.osl - 1, remote_tokens=len(flow.prompt))
            if flow.request_id in self.flows:
                self.loop.after(transfer_seconds(nbytes, self.link.bandwidth_gbps, self.link.latency_s), self._loaded,
                                flow)
            return
        if (len(flow.times) == 1 and w is flow.decode and not flow.tried
                and flow.path in ("conditional", "no-prefill-worker", "fallback")):
            # The decode worker prefilled the prompt itself: what the split estimates learn from.
            self.routing.costs.observe_prefill(w.url, flow.uncached_tokens, self.loop.now - flow.sent)
        if req.finished:
            if not flow.path == "disagg":
                flow.cached_tokens = req.cached
            self._unreserve(flow, w.url, "decode")
            self._end(flow)

    def _loaded(self, flow: Flow) -> None:
        """The decode worker's READ of the held blocks is done: it schedules the request, and
        the prefill worker frees the blocks."""
        dw, pw = flow.decode, flow.prefill
        if dw is None or pw is None or flow.request_id not in self.flows:
            return
        req = dw.engine.requests.get(flow.request_id)
        if pw.alive:
            self.routing.costs.observe_transfer(pw.url, flow.transfer_bytes, self.loop.now - flow.sent)
        if req is not None:
            # A dead holder's blocks cannot be read: the decode engine recomputes the prompt.
            dw.engine.load_done(req, ok=pw.alive)
            dw.engine.kick()
        if not pw.alive:
            self.recomputes += 1
            return
        pw.table.free(flow.request_id)
        pw.engine.kick()

    def _fail(self, flow: Flow, status: int, kind: str, message: str) -> None:
        for w in (flow.prefill, flow.decode):
            if w is not None:
                w.engine.token_times.pop(flow.request_id, None)
            if w is not None and w.alive:
                if flow.request_id in w.engine.requests:
                    w.engine.abort(flow.request_id)
                if w.table.holds(flow.request_id):
                    w.table.free(flow.request_id)
                w.engine.kick()
        self._end(flow, (status, kind, message))

    def _reserve(self, flow: Flow, url: str, stage: str) -> None:
        self.routing.load.acquire(url, stage, flow.blocks)  # type: ignore[arg-type]
        flow.reserved.append((url, stage))

    def _unreserve(self, flow: Flow, url: str, stage: str) -> None:
        if (url, stage) in flow.reserved:
            flow.reserved.remove((url, stage))
            self.routing.load.release(url, stage, flow.blocks)  # type: ignore[arg-type]

    def _end(self, flow: Flow, error: tuple[int, str, str] | None = None) -> None:
        for url, stage in list(flow.reserved):
            self._unreserve(flow, url, stage)
        flow.end = self.loop.now
        flow.error = error
        flow.isl, flow.prompt, flow.plan = len(flow.prompt), [], None
        if self.flows.pop(flow.request_id, None) is not None:
            self.active -= 1
            if self.queue and not self._draining:
                # Queued requests start from the loop, not from here: a start that fails at once
                # would otherwise end, and start the next, one call deeper each time.
                self._draining = True
                self.loop.at(self.loop.now, self._drain)
        self.finished += 1
        # Called once, then dropped: its closure holds the prompt (a kept flow must not).
        done, flow.on_done = flow.on_done, ended
        done(flow)

    def _drain(self) -> None:
        self._draining = False
        while self.queue and self.active < self.settings.max_active_requests:
            self._start(self.queue.popleft())
