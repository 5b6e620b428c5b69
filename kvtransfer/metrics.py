"""KV transfer stats and their `pdserve_kv_*` Prometheus metrics, without vLLM.

`KvStats` is what the worker side counts between two reports; vLLM carries it from the
engine's worker to its stat loggers as a plain dict (`to_dict` / `from_dict`, the only two
conversions), wrapped in `kvtransfer.stats.PdKVStats`. `KvMetrics` folds each report into
the metrics a worker exports on /metrics. This module imports only msgspec,
prometheus_client and the standard library, so a process without vLLM (a simulated
worker, a test) exports the same metrics the same way.
"""

from __future__ import annotations

from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtransfer.errors import SettingsError

COUNTERS = ("reads", "blocks_read", "bytes_read", "failures", "lease_expiries", "recomputes",
            "releases_sent", "blocks_released", "requests_held", "pushes", "blocks_pushed", "bytes_pushed",
            "push_failures")


class KvStats(msgspec.Struct, kw_only=True):
    """One report's worth of KV transfer stats. Mutable: the worker side counts into it
    during a step (vLLM's own stats objects work the same way); `aggregate` returns a new
    one and leaves both inputs alone."""

    reads: int = 0  # completed loads into this engine, READ (pull) or WRITE received (push); one per request
    blocks_read: int = 0
    bytes_read: int = 0
    failures: int = 0  # loads that failed (each also a recompute)
    lease_expiries: int = 0  # held requests freed unread by lease
    recomputes: int = 0
    releases_sent: int = 0  # releases this reader sent to holders
    blocks_released: int = 0  # held blocks released by their reader
    requests_held: int = 0  # requests whose blocks were held for a remote decode
    pushes: int = 0  # holder side, push mode: WRITEs into a decode engine that completed
    blocks_pushed: int = 0
    bytes_pushed: int = 0
    push_failures: int = 0  # holder side: WRITEs that failed or ran out of time (the decode recomputes)
    read_seconds: list[float] = []  # one entry per completed READ
    read_bytes: list[int] = []  # bytes of that READ (for GB/s)
    held_blocks: int | None = None  # gauge: blocks held for remote decodes right now (None: not reported)

    def is_empty(self) -> bool:
        return not any(getattr(self, k) for k in COUNTERS) and not self.read_seconds and self.held_blocks is None

    def aggregate(self, other: KvStats) -> KvStats:
        """Counters and READ lists added up; the gauge is the later report's, if it has one."""
        return KvStats(**{k: getattr(self, k) + getattr(other, k) for k in COUNTERS},
                       read_seconds=[*self.read_seconds, *other.read_seconds],
                       read_bytes=[*self.read_bytes, *other.read_bytes],
                       held_blocks=other.held_blocks if other.held_blocks is not None else self.held_blocks)

    def gbps(self) -> float:
        """Achieved GB/s over the READs of this report: sum(read_bytes) / sum(read_seconds) / 1e9,
        0 without READs."""
        secs = sum(self.read_seconds)
        return sum(self.read_bytes) / secs / 1e9 if secs else 0.0

    def reduce(self) -> dict[str, int | float]:
        """vLLM's summary of an interval: the counters, `gbps`, and `held_blocks` (0 if unreported)."""
        return {**{k: getattr(self, k) for k in COUNTERS}, "gbps": self.gbps(), "held_blocks": self.held_blocks or 0}

    def to_dict(self) -> dict[str, Any]:
        """The dict vLLM carries between processes (every field, `held_blocks` None if unreported)."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvStats:
        """Back from `to_dict`'s dict. Missing keys take their defaults, unknown keys are
        ignored; a wrong type raises SettingsError naming the key."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise SettingsError(f"KV stats: {exc}") from None


TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5)


class KvMetrics:
    """The `pdserve_kv_*` metrics, registered in `registry` (in this order)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.held_blocks_now = 0  # KV blocks a prefill worker holds for remote decodes (last report)
        self.kv_reads = Counter("pdserve_kv_reads", "Completed KV loads into this engine: READs (pull) or WRITEs "
                                "received (push); one per request", registry=r)
        self.kv_blocks = Counter("pdserve_kv_blocks_transferred", "KV blocks read from prefill engines", registry=r)
        self.kv_bytes = Counter("pdserve_kv_bytes_transferred", "KV bytes read from prefill engines", registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_duration_seconds", "Duration of one request's KV load: its READ (pull), or from sending "
                                      "the push to its notification (push)",
                                    buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_gbps = Gauge("pdserve_kv_transfer_gbps", "Achieved GB/s of the last KV READs", registry=r)
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "KV loads that failed", registry=r)
        self.kv_expiries = Counter("pdserve_kv_lease_expiries", "Held requests freed unread by lease", registry=r)
        self.kv_recomputes = Counter("pdserve_kv_recomputes", "Requests recomputed locally after a failed load",
                                     registry=r)
        self.kv_held_requests = Counter("pdserve_kv_held_requests", "Requests whose blocks were held for a remote decode",
                                        registry=r)
        self.kv_released = Counter("pdserve_kv_blocks_released", "Held blocks released by their reader", registry=r)
        self.kv_decode_recomputed = Counter(
            "pdserve_kv_decode_recomputed_prompt_tokens",
            "Prompt tokens a decode engine computed although the prefill sent their KV (0 when it ran only the "
            "new token; the last prompt token each with --first-token-from decode; whole prompts after a failed "
            "load)", registry=r)
        self.kv_held_blocks = Gauge("pdserve_kv_held_blocks", "Blocks held for remote decodes now", registry=r)
        self.kv_pushes = Counter("pdserve_kv_pushes", "KV WRITEs into decode engines that completed (push mode)",
                                 registry=r)
        self.kv_bytes_pushed = Counter("pdserve_kv_bytes_pushed", "KV bytes written into decode engines (push mode)",
                                       registry=r)
        self.kv_push_failures = Counter("pdserve_kv_push_failures",
                                        "KV WRITEs into decode engines that failed or timed out (push mode)", registry=r)

    def observe(self, stats: KvStats | dict[str, Any]) -> None:
        """Fold one stats report (a KvStats, or the dict vLLM hands stat loggers) into the metrics."""
        s = stats if isinstance(stats, KvStats) else KvStats.from_dict(stats)
        self.kv_reads.inc(s.reads)
        self.kv_blocks.inc(s.blocks_read)
        self.kv_bytes.inc(s.bytes_read)
        for secs in s.read_seconds:
            self.kv_seconds.observe(secs)
        if sum(s.read_seconds) > 0:
            self.kv_gbps.set(s.gbps())
        self.kv_failures.inc(s.failures)
        self.kv_expiries.inc(s.lease_expiries)
        self.kv_recomputes.inc(s.recomputes)
        self.kv_held_requests.inc(s.requests_held)
        self.kv_released.inc(s.blocks_released)
        self.kv_pushes.inc(s.pushes)
        self.kv_bytes_pushed.inc(s.bytes_pushed)
        self.kv_push_failures.inc(s.push_failures)
        if s.held_blocks is not None:
            self.kv_held_blocks.set(s.held_blocks)
            self.held_blocks_now = int(s.held_blocks)
