"""`pdserve bench profile` asks pdserve's frontend for each request's TTFT by stage
(X-PDSERVE-Timing) and keeps it: in every profile_export.jsonl line (`pdserve_timing`) and
summarised in profile_export_aiperf.json (`server_ttft`, `server_stage_<stage>`), streaming
and not, against the real frontend in front of simulated workers."""

from __future__ import annotations

import json

import pytest

from tests.bench.loadgen.test_profile_fake import profile
from tests.helpers.simthread import ThreadedSimCluster

FLAGS = ["--max-num-seqs", "8", "--block-size", "16", "--num-gpu-blocks", "1024", "--sim-step-model", "constant:0.02"]


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
def test_profile_records_and_summarises_the_servers_stages(model_dir, tmp_path, streaming):
    with ThreadedSimCluster(model_dir, ["prefill", "decode"], engine_flags=FLAGS) as c:
        result, m = profile(c.url, model_dir, tmp_path, "--isl", "64", "--osl", "4", "--num-requests", "4",
                            "--concurrency", "2", "--extra-inputs", "ignore_eos:true",
                            *(["--streaming"] if streaming else []))
    assert len(result.records) == 4 and all(r.ok for r in result.records)
    lines = [json.loads(line) for line in (tmp_path / "profile_export.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        t = line["pdserve_timing"]
        assert t["path"] == "disagg"
        assert abs(sum(t["stages_ms"].values()) - t["ttft_ms"]) <= 5.0
        assert t["stages_ms"]["prefill"] >= 20.0  # the prefill worker's step
    doc = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert doc["server_ttft"]["count"] == 4 and doc["server_stage_prefill"]["p50"] >= 20.0
    assert m["server_ttft"]["avg"] == pytest.approx(sum(v["avg"] for k, v in m.items() if k.startswith("server_stage_")),
                                                    abs=0.01)
    # The server's TTFT lies inside the client's.
    if streaming:
        assert doc["server_ttft"]["avg"] <= doc["time_to_first_token"]["avg"]
