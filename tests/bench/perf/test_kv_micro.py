"""The KV micro benchmark runs real NIXL transfers between two processes and writes its JSON."""

import json

from bench.perf.kv import micro

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True


def test_micro_benchmark_writes_all_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(micro, "BLOCK_SIZES", [64 << 10, 1 << 20])
    micro.run(str(tmp_path), total_mib=8, transports=["shm"])
    data = json.loads((tmp_path / "bench_kv.json").read_text())
    cases = data["cases"]
    assert [(c["transport"], c["block_bytes"]) for c in cases] == [("shm", 64 << 10), ("shm", 1 << 20)]
    for c in cases:
        assert c["total_bytes"] == 8 << 20
        for key in ("read_gbps", "write_gbps", "memcpy_gbps"):
            assert c[key] > 0
        assert abs(c["ratio_to_memcpy"] - c["read_gbps"] / c["memcpy_gbps"]) < 1e-9
