"""Where one request's time to first token went, stage by stage.

Stages, each a duration (seconds) measured by the frontend unless said otherwise:
- `queue`: waiting for a serving slot (admission);
- `tokenize`: the chat template and the tokenizer;
- `route`: choosing the workers;
- `prefill`: the prefill worker's call, from send to its answer (queue and compute there,
  the network both ways); where no prefill worker took part (aggregated, conditional,
  no prefill worker in rotation), the one worker's time to its first token;
- `kv_transfer`: the decode worker's wait for the prefill's KV, as that worker reports it: a
  simulated worker its load time, a vLLM worker its engine's wait from queued to first
  scheduled (the KV load, and any queueing before it), where vLLM keeps per-request stats;
- `decode_first_step`: the rest of the decode worker's time to its first token;
- `other`: what is left of the TTFT (parsing, sending, detokenizing, the event loop).

Which stages a TTFT is made of, per path:
- aggregated, conditional, no prefill worker: queue + tokenize + route + prefill + other;
- disaggregated, the prefill's token streamed (the default): queue + tokenize + route +
  prefill + other;
- disaggregated with `--first-token-from decode`, a seeded request, or after a failed
  prefill (fallback): queue + tokenize + route + prefill + kv_transfer + decode_first_step
  + other (a fallback's `prefill` is the failed attempt, its `decode_first_step` the local
  prefill).
`other` is the remainder, so the stages add up to the TTFT.
"""

from __future__ import annotations

import time
from typing import Any

STAGES = ("queue", "tokenize", "route", "prefill", "kv_transfer", "decode_first_step", "other")
HEADER = "x-pdserve-timing"  # request: "1" asks for the breakdown; response: the breakdown (JSON)


class RequestTiming:
    def __init__(self, received: float) -> None:
        self.received = received
        self.stages: dict[str, float] = {}
        self.path: str | None = None
        self.ttft: float | None = None
        self._open: dict[str, float] = {}

    def start(self, stage: str, at: float | None = None) -> None:
        self._open[stage] = time.monotonic() if at is None else at

    def stop(self, stage: str, at: float | None = None) -> float:
        """End an open stage (once the first token came, stages no longer count) and return
        its duration."""
        t0 = self._open.pop(stage, None)
        if t0 is None:
            return 0.0
        took = max(0.0, (time.monotonic() if at is None else at) - t0)
        self.add(stage, took)
        return took

    def add(self, stage: str, seconds: float) -> None:
        if self.ttft is None:
            self.stages[stage] = self.stages.get(stage, 0.0) + max(0.0, seconds)

    def first_token(self, at: float) -> None:
        """The first token reached the frontend: the TTFT, and `other` as its remainder."""
        if self.ttft is not None:
            return
        self.ttft = max(0.0, at - self.received)
        self.stages["other"] = max(0.0, self.ttft - sum(v for k, v in self.stages.items() if k != "other"))

    def to_dict(self) -> dict[str, Any]:
        """The breakdown a client asked for (`X-PDSERVE-Timing: 1`), in milliseconds."""
        return {"path": self.path, "ttft_ms": None if self.ttft is None else round(self.ttft * 1e3, 3),
                "stages_ms": {k: round(self.stages[k] * 1e3, 3) for k in STAGES if k in self.stages}}
