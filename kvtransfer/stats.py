"""Connector stats as vLLM wants them: collected by the worker side, carried by vLLM to the
engine's stat loggers (as `scheduler_stats.kv_connector_stats`, a dict), exported by
pdserve as `pdserve_kv_*` (kvtransfer.metrics.KvMetrics).

`PdKVStats` is vLLM's `KVConnectorStats` around `kvtransfer.metrics.KvStats`: its `data`
is `KvStats.to_dict()`, and every operation goes through `KvStats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtransfer.metrics import COUNTERS, KvStats

__all__ = ["COUNTERS", "PdKVStats", "empty"]


def empty() -> dict[str, Any]:
    return KvStats().to_dict()


@dataclass
class PdKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=empty)

    @classmethod
    def of(cls, stats: KvStats) -> PdKVStats:
        return cls(data=stats.to_dict())

    @property
    def kv(self) -> KvStats:
        return KvStats.from_dict(self.data)

    def reset(self) -> None:
        self.data = empty()

    def is_empty(self) -> bool:
        return self.kv.is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = self.kv.aggregate(KvStats.from_dict(other.data)).to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        return self.kv.reduce()
