"""Calibration recovers a known system from runs it generated; compare-plan lines a run up
against the plan's prediction."""

from __future__ import annotations

import json

import pytest

from bench.plan.calibrate import _predict, _system, calibrate, compare_plan
from bench.plan.errors import PlanError
from bench.plan.report import PlanInputs, plan, write
from bench.plan.specs import load_model

TRUE = _system(4e10, 6e9, 0.015, 1.5)
MODEL = load_model("smollm2-135m-instruct")


def fake_run(tmp_path, name: str, concurrency: int, isl: int = 256, osl: int = 32):
    run = {"model": "smollm2-135m-instruct", "isl": isl, "osl": osl, "concurrency": concurrency}
    ttft, tpot = _predict(TRUE, run, MODEL)
    d = tmp_path / name
    d.mkdir()
    doc = {"input_config": {"models": {"items": [{"name": "smollm2-135m-instruct"}]},
                            "endpoint": {"streaming": True},
                            "datasets": [{"prompts": {"isl": {"mean": isl}}}],
                            "phases": [{"kind": "profiling", "concurrency": concurrency}]},
           "input_sequence_length": {"unit": "tokens", "avg": isl},
           "output_sequence_length": {"unit": "tokens", "avg": osl},
           "time_to_first_token": {"unit": "ms", "avg": ttft, "p50": ttft},
           "inter_token_latency": {"unit": "ms", "avg": tpot, "p50": tpot},
           "output_token_throughput": {"unit": "tokens/sec", "avg": 123.0}}
    (d / "profile_export_aiperf.json").write_text(json.dumps(doc))
    return d, ttft, tpot


def test_calibration_predicts_a_held_out_concurrency(tmp_path):
    a, _, _ = fake_run(tmp_path, "c2", 2)
    b, _, _ = fake_run(tmp_path, "c8", 8)
    out = tmp_path / "cpu-local.json"
    doc = calibrate([str(a), str(b)], str(out), 1.5)
    assert json.loads(out.read_text())["name"] == "cpu-local"
    fitted = _system(doc["peak_tflops"]["bf16"] * 1e12, doc["hbm_gbps"] * 1e9, doc["step_overhead_ms"] / 1e3, 1.5)
    run = {"model": "smollm2-135m-instruct", "isl": 256, "osl": 32, "concurrency": 4}
    want, got = _predict(TRUE, run, MODEL), _predict(fitted, run, MODEL)
    assert got[0] == pytest.approx(want[0], rel=0.05) and got[1] == pytest.approx(want[1], rel=0.05)


def test_compare_plan_repredicts_at_the_run_concurrency(tmp_path, capsys):
    profile = tmp_path / "cpu-local.json"
    profile.write_text(json.dumps(TRUE.to_dict()))
    doc = plan(PlanInputs("smollm2-135m-instruct", str(profile), 1, 256, 32, 10000, 1000))
    write(doc, tmp_path / "plan")
    run, ttft, tpot = fake_run(tmp_path, "c3", 3)
    rows = {r["metric"]: r for r in compare_plan(str(tmp_path / "plan"), str(run))["rows"]}
    assert rows["TTFT p50 (ms)"]["ratio"] == pytest.approx(1.0, rel=0.02)
    assert rows["TPOT/ITL p50 (ms)"]["ratio"] == pytest.approx(1.0, rel=0.02)
    assert "measured/predicted" in capsys.readouterr().out


def test_calibrate_rejects_what_it_cannot_use(tmp_path):
    with pytest.raises(PlanError, match="one or more"):
        calibrate([], None, 1.5)
    d = tmp_path / "x"
    d.mkdir()
    (d / "profile_export_aiperf.json").write_text("{}")
    with pytest.raises(PlanError, match="not a `pdserve bench profile` summary"):
        calibrate([str(d)], str(tmp_path / "o.json"), 1.5)
