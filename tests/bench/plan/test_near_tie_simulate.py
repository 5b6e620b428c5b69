"""`pdserve plan` on near ties (both launches and load tests, a recommendation to measure
both) and `pdserve plan --simulate` (the best layouts of each mode through the offline
cluster simulator, ranked by simulated goodput per GPU, labelled simulated)."""

from __future__ import annotations

import json

from bench.plan.report import PlanInputs, plan, summary_text, write
from serve.cli import main

NEAR = PlanInputs("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", 8, 16000, 100, 2000, 50)


def test_a_near_tie_says_so_and_gives_both_architectures_commands(tmp_path):
    doc = plan(NEAR)
    assert doc.near_tie and abs(doc.disagg_over_agg - 1) <= 0.05
    other = "disagg" if doc.winner == "agg" else "agg"
    assert f"--mode {other}" in doc.other_launch.up and doc.other_load_test.startswith("pdserve bench profile")
    assert doc.other_load_test != doc.load_test
    text = summary_text(doc)
    assert "near tie" in text and "measure both" in text and doc.other_launch.up in text
    write(doc, tmp_path)
    assert doc.other_launch.up in (tmp_path / "launch.sh").read_text()
    far = plan(PlanInputs("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "h200_sxm", 4, 4000, 500, 600, 16.67))
    assert not far.near_tie and far.other_launch is None and "near tie" not in summary_text(far)


GUIDE_ARGS = ["plan", "--model", "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "--system", "h200_sxm", "--total-gpus", "4",
              "--isl", "4000", "--osl", "500", "--ttft", "600", "--tpot", "16.67"]


def test_plan_simulate_ranks_layouts_by_simulated_goodput(tmp_path, capsys):
    assert main([*GUIDE_ARGS, "--save-dir", str(tmp_path), "--simulate", "--simulate-top", "2",
                 "--sim-requests", "120"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "simulated.json").read_text())
    assert doc["simulated"] is True and len(doc["layouts"]) == 4
    assert {r["mode"] for r in doc["layouts"]} == {"agg", "disagg"}
    goodput = [r["sim"]["goodput_tokens_per_s_per_gpu"] for r in doc["layouts"]]
    assert goodput == sorted(goodput, reverse=True) and goodput[0] > 0
    for r in doc["layouts"]:
        assert r["sim"]["simulated"] is True and r["sim"]["requests"] == 120 and r["closed_form"]["tokens_per_s_per_gpu"] > 0
    assert "SIMULATED goodput" in out and "SIMULATED winner" in out


def test_plan_simulate_refuses_bad_options_in_one_line(tmp_path, capsys):
    assert main([*GUIDE_ARGS, "--save-dir", str(tmp_path), "--simulate", "--trace", str(tmp_path / "no")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("pdserve plan: error: --trace")
