"""The GPU KV benchmark (`pdserve bench kv --gpu`): its host-to-host case runs real NIXL here;
the GPU cases report, not crash, where CUDA is missing."""

import json

import numpy as np
import pytest

from bench.perf.errors import PerfError
from bench.perf.kv import gpu
from tests.bench.commands import parser

# Imports torch (tests/conftest.py groups such modules).
IMPORTS_TORCH = True


def test_case_names_map_to_nixl_memory_types():
    assert gpu.parse_case("vram-dram") == ("VRAM", "DRAM")
    assert gpu.parse_case("dram-vram") == ("DRAM", "VRAM")
    with pytest.raises(PerfError, match="unknown GPU KV case 'vram-hbm'"):
        gpu.parse_case("vram-hbm")


def test_descriptors_are_distinct_aligned_blocks_inside_the_buffer():
    d = gpu.descs(np.random.default_rng(0), 16, 4096, 1 << 20, 64 * 4096, 3)
    assert d.shape == (16, 3) and d.dtype == np.uint64
    offsets = d[:, 0] - (1 << 20)
    assert len(set(offsets.tolist())) == 16 and all(o % 4096 == 0 and o + 4096 <= 64 * 4096 for o in offsets)
    assert set(d[:, 1].tolist()) == {4096} and set(d[:, 2].tolist()) == {3}
    with pytest.raises(PerfError, match="do not fit"):
        gpu.descs(np.random.default_rng(0), 65, 4096, 0, 64 * 4096, 0)


def test_spread_reports_min_median_max():
    assert gpu.spread([3.0, 1.0, 2.0, 10.0, 4.0]) == {"min": 1.0, "median": 3.0, "max": 10.0, "n": 5}


def test_host_case_moves_real_bytes_and_gpu_cases_are_reported_unavailable(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(gpu, "BLOCK_SIZES", [64 << 10])
    cases = ["dram-dram"] + ([] if torch.cuda.is_available() else ["vram-vram"])
    res = gpu.run(str(tmp_path), total_mib=4, cases=cases, repeats=3)
    data = json.loads((tmp_path / "bench_kv_gpu.json").read_text())
    assert data == json.loads(json.dumps(res))
    (row,) = [c for c in data["cases"] if c["case"] == "dram-dram"]
    assert row["total_bytes"] == 4 << 20 and row["torch_copy_gbps"] is None
    for key in ("read_gbps", "write_gbps"):
        s = row[key]
        assert s["n"] == 3 and 0 < s["min"] <= s["median"] <= s["max"]
    if not torch.cuda.is_available():
        assert "CUDA" in data["unavailable"]["vram-vram"] or "cuda" in data["unavailable"]["vram-vram"]


def test_cli_rejects_an_unknown_case_in_one_line(capsys):
    from bench.cli import run

    args = parser().parse_args(["bench", "kv", "--gpu", "vram-hbm", "--out", "/nonexistent/x"])
    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdserve bench kv: error: unknown GPU KV case 'vram-hbm'; "
                   "choose from vram-vram, vram-dram, dram-vram, dram-dram"]
