"""`pdserve sim`: one offline simulation, from options to artifacts.

The artifacts are `bench profile`'s (profile_export.jsonl, profile_export_aiperf.json/.csv,
console table; `pdserve bench compare` reads them), marked `"simulated": true` with the
simulated layout and step model under `"simulation"`, plus:
  sim_workers.json   per worker: busy fraction (utilisation), steps, prompt tokens computed
                     and served from its prefix cache, preemptions, requests it finished
  sim_series.jsonl   every --series-interval simulated seconds: time, requests done, and per
                     worker [running, waiting, KV usage]
"""

from __future__ import annotations

import gc
import json
import random
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.loadgen.config import ProfileConfig
from bench.loadgen.export import write_artifacts
from bench.loadgen.profile import ProfileResult
from bench.loadgen.records import ErrorInfo, Record
from bench.sim.cluster import OfflineCluster
from bench.sim.flow import Flow, Link
from bench.sim.loop import Loop
from bench.sim.workload import Driver, build_sessions
from serve.frontend.settings import FrontendSettings
from serve.sim.engine import SimConfig
from serve.sim.timing import StepModel


@dataclass
class Fault:
    at_s: float
    role: str
    count: int


@dataclass
class SimSpec:
    roles: list[str]
    engine: SimConfig
    step_model: StepModel
    bytes_per_block: int
    link: Link
    settings: FrontendSettings
    faults: list[Fault] = field(default_factory=list)
    series_interval_s: float = 5.0
    describe: dict[str, Any] = field(default_factory=dict)
    per_role: dict[str, tuple[SimConfig, StepModel]] = field(default_factory=dict)  # roles with engines of their own
    # Called once before the run with (loop, cluster, finished flows, total requests): an
    # autoscaler schedules its intervals here (bench/sim/scaling.py).
    hook: Callable[[Loop, OfflineCluster, list[Flow], int], None] | None = None


def record_of(flow: Flow, base_ns: int) -> Record:
    times = flow.times
    start = round(flow.arrival * 1e9)
    rec = Record(session=flow.session, turn=flow.turn, phase="profiling", worker=0, start_ns=start,
                 wall_start_ns=base_ns + start, end_ns=round(flow.end * 1e9),
                 content_ns=array("q", np.rint(np.asarray(times) * 1e9).astype(np.int64).tobytes()),
                 prompt_tokens=flow.isl, completion_tokens=len(times), expected_isl=flow.isl,
                 requested_osl=flow.osl, isl=flow.isl, osl=len(times), streaming=True)
    if flow.error is not None:
        status, kind, message = flow.error
        rec.error = ErrorInfo(status, kind, message)
    return rec


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.last = 0.0

    def show(self, now_s: float, done: int, final: bool = False) -> None:
        if not self.enabled:
            return
        wall = time.monotonic() - self.t0
        if not final and wall - self.last < 0.5:
            return
        self.last = wall
        width = 30
        filled = int(width * done / self.total) if self.total else width
        sys.stderr.write(f"\rSIMULATED [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, "
                         f"{now_s:,.1f} s simulated, {wall:,.1f} s wall" + ("\n" if final else ""))
        sys.stderr.flush()


def simulate(cfg: ProfileConfig, spec: SimSpec, progress: bool = True) -> tuple[ProfileResult, dict[str, Any]]:
    """Run the workload of `cfg` through the cluster of `spec`; the result and the stats."""
    loop = Loop()
    cluster = OfflineCluster(loop, spec.settings, spec.roles, spec.engine, spec.step_model, spec.bytes_per_block,
                             spec.link, per_role=spec.per_role)
    # The router breaks ties (and samples, with a temperature, and picks at random in random
    # mode) from its own stream: seeded here, the same seed gives the same simulation.
    cluster.routing.router.rng = random.Random(f"{cfg.random_seed}:router")
    sessions = build_sessions(cfg)
    flows: list[Flow] = []
    driver = Driver(cfg, sessions, cluster, loop, flows.append)
    total = driver.limit
    bar = Progress(total, progress)
    series = []
    workers = list(cluster.workers.values())

    def poll() -> None:
        cluster.poll()
        # Stop once nothing else is scheduled (with requests left, `simulate` then says so).
        if len(flows) < total and loop.pending() > 1:
            loop.after(spec.settings.poll_interval_s, poll)

    def sample() -> None:
        series.append({"t": round(loop.now, 3), "done": len(flows),
                       "workers": {w.url: [len(w.engine.running), len(w.engine.waiting), round(w.table.usage, 4)]
                                   for w in workers}})
        if len(flows) < total and loop.pending() > 1:
            loop.after(spec.series_interval_s, sample)

    def kill(fault: Fault) -> None:
        alive = [w for w in cluster.workers.values() if w.role == fault.role and w.alive and not w.draining]
        for w in alive[:fault.count]:
            cluster.kill(w.url)

    loop.at(spec.settings.poll_interval_s, poll)
    loop.at(0.0, sample)
    for f in spec.faults:
        loop.at(f.at_s, kill, f)
    if spec.hook is not None:
        spec.hook(loop, cluster, flows, total)
    wall0, t0 = time.time_ns(), time.monotonic()
    driver.start()
    # Millions of small live objects (blocks, index entries, token times): the cyclic
    # collector's full passes would dominate; nothing here relies on it during the run.
    gc_was = gc.isenabled()
    gc.disable()
    try:
        loop.run(tick=lambda: bar.show(loop.now, len(flows)))
    finally:
        if gc_was:
            gc.enable()
    bar.show(loop.now, len(flows), final=True)
    wall_s = time.monotonic() - t0
    if cluster.flows:  # every request must end: a flow left in the cluster is a simulator bug
        raise RuntimeError(f"{len(cluster.flows)} simulated requests never finished")
    records = [record_of(f, wall0) for f in flows]
    end = max((r.end_ns for r in records), default=0)
    last_s = max((f.end for f in flows), default=0.0)
    result = ProfileResult(cfg, records, [], wall0, wall0 + end, simulation={
        **spec.describe, "virtual_seconds": round(last_s, 3), "wall_seconds": round(wall_s, 3),
        "requests_per_wall_second": round(len(records) / wall_s, 1) if wall_s else None,
        "events": loop.events, "recomputes": cluster.recomputes,
        # prefills given up at --prefill-timeout: sent and still running, or held in the gate
        "prefill_timeouts": {"sent": cluster.prefill_timeouts,
                             "gate": cluster.gate.timeouts if cluster.gate is not None else 0},
        "paths": _count(f.path or "refused" for f in flows)})
    stats = {"workers": {w.url: {
        "role": w.role, "alive": w.alive,
        "utilisation": round(w.engine.busy_s / last_s, 4) if last_s else 0.0,
        "steps": w.engine.counters.steps, "prompt_tokens_computed": w.engine.counters.prompt_local_compute,
        "prompt_tokens_cached": w.engine.counters.prompt_local_cache_hit,
        "prompt_tokens_transferred": w.engine.counters.prompt_external,
        "preemptions": w.engine.counters.preemptions, "finished": dict(w.engine.counters.finished)}
        for w in cluster.workers.values()}, "series": series}
    return result, stats


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return out


def write(result: ProfileResult, stats: dict[str, Any]) -> dict[str, Any]:
    """The run's artifacts in `--artifact-dir`; returns the summary metrics."""
    metrics = write_artifacts(result, plots=False)
    out = Path(result.cfg.artifact_dir)
    (out / "sim_workers.json").write_text(json.dumps(stats["workers"], indent=1) + "\n")
    with open(out / "sim_series.jsonl", "w") as f:
        for row in stats["series"]:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return metrics
