"""A measured step-time profile (`pdserve.profile/1`, what `bench calibrate --steps` writes)
stands for a system in `pdserve plan`: the planner's step times are the profile's, its KV
capacity the profile's, and only the TP it was measured at is ranked."""

from __future__ import annotations

import json

import pytest

from bench.plan.errors import PlanError
from bench.plan.perf import Engine
from bench.plan.report import PlanInputs, plan, read_plan, write
from bench.plan.specs import load_model, load_system
from serve.sim.profile import ProfileStep

STEP = ProfileStep(overhead_s=0.045, token_points=((8, 0.002), (256, 0.03), (2048, 0.45)), prefill_pair_s=2.5e-6,
                   decode_context_s=1e-6)


def profile_file(tmp_path, **extra) -> str:
    doc = STEP.to_dict(source={"kind": "measured"}, model="smollm2-135m-instruct", system="this-box", tp=1,
                       kv_cache_dtype="auto")
    doc.update({"kv_cache_tokens": 46592, **extra})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_planners_steps_are_the_profiles(tmp_path):
    system = load_system(profile_file(tmp_path))
    assert system.name == "this-box" and system.step_profile is not None
    e = Engine(load_model("smollm2-135m-instruct"), system, 1, "bf16")
    assert e.prefill_s(256) == pytest.approx(STEP.step_seconds([], [(0, 256)]))
    assert e.step_s(8, 300) == pytest.approx(STEP.step_seconds([300] * 8, []))
    assert e.step_s(4, 300, 256, 256) == pytest.approx(STEP.step_seconds([300] * 4, [(0, 256)]))
    assert e.max_tokens_in_kv() == 46592


def test_plan_ranks_the_profiled_tp_only_and_keeps_the_profile_in_plan_json(tmp_path):
    doc = plan(PlanInputs("smollm2-135m-instruct", profile_file(tmp_path), 4, 256, 64, 2000, 200))
    assert doc.winner in ("agg", "disagg")
    assert {r.tp for r in doc.agg_top} == {1} and doc.agg_best.replicas == 4
    assert {(r.prefill_tp, r.decode_tp) for r in doc.disagg_top} <= {(1, 1)}
    # The predicted TTFT is at least the profile's own prefill of the 256-token prompt.
    assert doc.agg_best.ttft_ms >= STEP.step_seconds([], [(0, 256)]) * 1e3 * 0.999
    write(doc, tmp_path / "out")
    again = read_plan(tmp_path / "out")
    assert again.system.step_profile["kv_cache_tokens"] == 46592


def test_a_profile_without_its_kv_capacity_is_a_one_line_error(tmp_path):
    path = profile_file(tmp_path)
    doc = json.loads(open(path).read())
    del doc["kv_cache_tokens"]
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(PlanError, match="needs kv_cache_tokens"):
        load_system(path)
