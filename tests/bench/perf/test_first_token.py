"""`pdserve bench first-token` end to end on simulated workers (the real frontend, `pdserve up`,
a second frontend with --first-token-from decode, real HTTP): it writes its table and JSON,
labelled simulated, and the answers of both disaggregated paths equal the aggregated ones."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_first_token_benchmark_on_simulated_workers(tmp_path):
    out = tmp_path / "ft"
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "bench", "first-token", "--engine", "sim",
                           "--isl", "64", "--osl", "4", "--requests", "2", "--concurrency-high", "2",
                           "--sim-step-model", "constant:0.002", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SIMULATED" in proc.stdout
    doc = json.loads((out / "bench_first_token.json").read_text())
    assert doc["simulated"] is True
    row = doc["by_isl"]["64"]
    assert row["new"]["same_answers_as_agg"] == "2/2" and row["old"]["same_answers_as_agg"] == "2/2"
    assert all(row[k]["ttft_vs_agg"] > 0 and row[k]["ttst_vs_agg"] > 0 for k in ("new", "old"))
    # At concurrency 2: both paths' agreement with the aggregated stack, beside its own
    # run-to-run agreement (simulated answers do not depend on the batch: all equal).
    assert set(row["c2"]) == {"agg", "new", "old"} and row["c2"]["new"]["output_tps"] > 0
    assert [row["c2"][k]["same_answers_as_agg"] for k in ("agg", "new", "old")] == ["4/4"] * 3
    assert "concurrency 2: answers equal to the aggregated stack's first run" in proc.stdout


def test_the_default_simulated_step_model_parses():
    import argparse

    from bench.perf.first_token import add_parser
    from serve.sim.timing import LinearStep, parse_step_model

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    args = sub.choices["first-token"].parse_args([])
    assert parse_step_model(args.sim_step_model) == LinearStep(0.01, 0.0001, 0.00005)
