"""`--conditional-disagg-tokens auto` in the offline simulator: the frontend's real routing
learns the link from the simulated transfers and prefills. Over a TCP-class link (1 GB/s)
moving an 8,000-token prompt's KV costs more than prefilling it on the decode worker (GPU
step times from the planner), so auto keeps long documents local; over an RDMA-class link
it splits nearly everything. Always split (0) splits everything either way."""

from __future__ import annotations

from bench.sim.studies import _by_class, _run, mixed_trace


def test_auto_keeps_long_prompts_local_on_a_slow_link_and_splits_on_a_fast_one(tmp_path):
    trace = tmp_path / "trace.jsonl"
    mixed_trace(trace, 240, rate=14.0)
    shares = {}
    for link, bw, lat in (("tcp", "1", "1"), ("rdma", "45", "0.05")):
        for value in ("0", "auto"):
            out = tmp_path / f"{link}-{value}"
            doc, _, _ = _run(["--mode", "disagg", "--prefill", "4", "--decode", "4", "--sim-kv-bandwidth-gbps", bw,
                              "--sim-kv-latency-ms", lat, "--input-file", str(trace), "--fixed-schedule",
                              "--conditional-disagg-tokens", value], out)
            assert doc["simulated"] is True and doc["request_count"]["avg"] == 240
            paths = doc["simulation"]["paths"]
            shares[link, value] = paths.get("disagg", 0) / sum(paths.values())
            by_class = _by_class(out / "profile_export.jsonl")
            assert by_class["long"]["ttft_p50_ms"] > by_class["short"]["ttft_p50_ms"] > 0
    assert shares["tcp", "0"] == shares["rdma", "0"] == 1.0
    # Half the trace is long: on TCP auto keeps (most of) them local, on RDMA it splits them.
    assert shares["tcp", "auto"] < 0.7 and shares["rdma", "auto"] > 0.9
