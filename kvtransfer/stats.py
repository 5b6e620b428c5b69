"""Connector stats: collected by the worker side, carried by vLLM to the engine's stat
loggers (as `scheduler_stats.kv_connector_stats`), exported by pdserve as `pdserve_kv_*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("reads", "blocks_read", "bytes_read", "failures", "lease_expiries", "recomputes",
            "releases_sent", "blocks_released", "requests_held")


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in COUNTERS}
    data["read_seconds"] = []  # one entry per completed READ
    data["read_bytes"] = []  # bytes of that READ (for GB/s)
    data["held_blocks"] = None  # gauge: blocks held for remote decodes right now
    return data


@dataclass
class PdKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=empty)

    def reset(self) -> None:
        self.data = empty()

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in COUNTERS) and not d.get("read_seconds") and d.get("held_blocks") is None

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + o.get(k, 0)
        self.data["read_seconds"] = self.data.get("read_seconds", []) + list(o.get("read_seconds", []))
        self.data["read_bytes"] = self.data.get("read_bytes", []) + list(o.get("read_bytes", []))
        if o.get("held_blocks") is not None:
            self.data["held_blocks"] = o["held_blocks"]
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        secs, nbytes = sum(d.get("read_seconds", [])), sum(d.get("read_bytes", []))
        return {**{k: d.get(k, 0) for k in COUNTERS},
                "gbps": (nbytes / secs / 1e9) if secs else 0.0,
                "held_blocks": d.get("held_blocks") or 0}
