"""The KV micro benchmark runs real NIXL transfers between two processes and writes its JSON."""

import json

from bench.perf.kv import micro

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True


def test_micro_benchmark_writes_all_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(micro, "BLOCK_SIZES", [64 << 10, 1 << 20])
    micro.run(str(tmp_path), total_mib=8, transports=["shm"], repeats=2)
    data = json.loads((tmp_path / "bench_kv.json").read_text())
    cases = data["cases"]
    assert [(c["transport"], c["block_bytes"]) for c in cases] == [("shm", 64 << 10), ("shm", 1 << 20)]
    for c in cases:
        assert c["total_bytes"] == 8 << 20
        for key in ("read_gbps", "write_gbps", "memcpy_gbps"):
            assert c[key] > 0
        assert abs(c["ratio_to_memcpy"] - c["read_gbps"] / c["memcpy_gbps"]) < 1e-9
        for key in ("read_gbps", "write_gbps", "memcpy_gbps"):
            s = c[f"{key}_spread"]
            assert s["n"] == 2 and s["min"] <= s["median"] == c[key] <= s["max"]


def test_ucxx_without_its_environment_is_one_line(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**__import__("os").environ, "PDSERVE_UCXX_PYTHON": str(tmp_path / "nope" / "python")}
    r = subprocess.run([sys.executable, "-m", "serve.cli", "bench", "kv", "--impls", "ucxx", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"pdserve bench kv: error: --impls ucxx: no UCXX environment at {tmp_path / 'nope' / 'python'}; "
        "run `make ucxx` (or set PDSERVE_UCXX_PYTHON)"), r.stderr
    assert not (tmp_path / "bench_kv.json").exists()
