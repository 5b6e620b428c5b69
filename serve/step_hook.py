"""Per-step records from vLLM's engine core: what each step computed and how long it took.

`register` is a vLLM general plugin (entry point `vllm.general_plugins`), so vLLM runs it in
each of its processes. It does nothing unless `PDSERVE_STEP_RECORDS` names a file (pdserve's
workers set it for their engine); then, in the process that runs the engine core, it wraps
`EngineCore.step` (schedule, execute, update: one step of continuous batching) and appends
one JSON line per step that ran the model:

    {"t": 1764780000.123, "s": 0.0123, "d": [517, 90], "p": [[0, 256]]}

`t` wall-clock start, `s` seconds, `d` each decode's context (tokens it attends to, its new
token included), `p` each prefill chunk as [tokens already computed, new tokens]: the
arguments of a simulated engine's `step_seconds(decode_contexts, prefill_chunks)`, which
`pdserve bench calibrate --steps` fits. A request scheduled for one token is a decode (a
one-token prefill chunk costs the same). The worker reads the file (`serve.worker.steps`):
its `pdserve_worker_step_seconds` histogram and `GET /steps`.

The file is rotated at `ROTATE_BYTES` (renamed to `<path>.1`, the reader follows), each line
flushed as written (a killed engine loses nothing), and a failure to record never touches
the step: it is logged once and recording stops.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

ENV = "PDSERVE_STEP_RECORDS"
ROTATE_BYTES = 16 * 2**20

log = logging.getLogger("vllm.pdserve.steps")

_patched = False


def batch_of(scheduler_output: Any) -> tuple[list[int], list[list[int]]]:
    """(decode contexts, prefill chunks [computed, new]) of one vLLM SchedulerOutput."""
    n = scheduler_output.num_scheduled_tokens
    decodes: list[int] = []
    prefills: list[list[int]] = []

    def add(req_id: str, computed: int) -> None:
        new = n.get(req_id, 0)
        if new == 1:
            decodes.append(computed + 1)
        elif new > 1:
            prefills.append([computed, new])

    for r in scheduler_output.scheduled_new_reqs:
        add(r.req_id, r.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        add(req_id, computed)
    return decodes, prefills


class StepWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self.f = self._open()
        self.broken = False

    def _open(self) -> Any:
        import fcntl

        f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the process's life
        fcntl.flock(f, fcntl.LOCK_SH)  # "in use": workers sweeping leftover files skip it
        return f

    def write(self, start: float, seconds: float, decodes: list[int], prefills: list[list[int]]) -> None:
        if self.broken:
            return
        try:
            self.f.write(json.dumps({"t": round(start, 6), "s": round(seconds, 7), "d": decodes, "p": prefills},
                                    separators=(",", ":")) + "\n")
            self.f.flush()
            if self.f.tell() >= ROTATE_BYTES:
                self.f.close()
                os.replace(self.path, self.path + ".1")
                self.f = self._open()
        except Exception:  # noqa: BLE001 - never take a step down over a record
            self.broken = True
            log.exception("pdserve: step records to %s failed; recording stops", self.path)


def wrap_step(step: Any, writer: StepWriter, last: dict[str, Any]) -> Any:
    """`EngineCore.step` wrapped: time it, and record the batch `Scheduler.schedule` gave it."""

    def timed_step(self: Any) -> Any:
        last["out"] = None
        t0, c0 = time.time(), time.perf_counter()
        result = step(self)
        seconds = time.perf_counter() - c0
        out = last["out"]
        if out is not None and out.total_num_scheduled_tokens > 0:
            try:
                decodes, prefills = batch_of(out)
            except Exception:  # noqa: BLE001 - a vLLM whose SchedulerOutput changed shape
                writer.broken = True
                log.exception("pdserve: cannot read this vLLM's scheduler output; step records stop")
                return result
            writer.write(t0, seconds, decodes, prefills)
        return result

    timed_step.__wrapped__ = step  # type: ignore[attr-defined]
    return timed_step


def register() -> None:
    """vLLM general plugin: record steps in this process if pdserve asked for it."""
    global _patched
    path = os.environ.get(ENV)
    if not path or _patched:
        return
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001 - not an engine process of this vLLM
        return
    _patched = True
    last: dict[str, Any] = {"out": None}
    schedule = Scheduler.schedule

    def recording_schedule(self: Any, *args: Any, **kw: Any) -> Any:
        out = schedule(self, *args, **kw)
        last["out"] = out
        return out

    recording_schedule.__wrapped__ = schedule  # type: ignore[attr-defined]
    writer: StepWriter | None = None

    def lazy_step(self: Any) -> Any:
        # The file is opened by the process that steps (the engine core), not by every
        # process that loads plugins.
        nonlocal writer
        if writer is None:
            writer = StepWriter(path)
            EngineCore.step = wrap_step(step, writer, last)
            log.info("pdserve: step records to %s (pid %d)", path, os.getpid())
        return EngineCore.step(self)

    step = EngineCore.step
    Scheduler.schedule = recording_schedule
    EngineCore.step = lazy_step
    batched = getattr(EngineCore, "step_with_batch_queue", None)
    if batched is not None:
        warned = False

        def batch_queue_step(self: Any) -> Any:
            # Several batches in flight (async scheduling, pipeline parallelism): a call is not
            # one step's time, so nothing is recorded; say so once.
            nonlocal warned
            if not warned:
                warned = True
                log.warning("pdserve: this engine runs batches through a queue (async scheduling or pipeline "
                            "parallelism): no step records (%s stays empty)", path)
            return batched(self)

        EngineCore.step_with_batch_queue = batch_queue_step
