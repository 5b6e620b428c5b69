"""The planner's performance model as a step-time profile: a simulated step costs what the
planner says the same step costs."""

from __future__ import annotations

import pytest

from bench.plan.perf import Engine
from bench.plan.specs import load_model, load_system
from bench.sim.errors import SimError
from bench.sim.profiles import TOKEN_POINTS, planner_profile, planner_step
from serve.sim.profile import from_dict


@pytest.mark.parametrize("model, system, tp", [("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", 1),
                                               ("meta-llama/Llama-3.1-70B-Instruct", "h200_sxm", 4)])
def test_profile_steps_equal_the_planners(model, system, tp):
    e = Engine(load_model(model), load_system(system), tp, "fp8")
    s = planner_step(e)
    for isl in (128, 1024, 4096):  # a prompt alone in a step (a token count in the table)
        assert s.step_seconds([], [(0, isl)]) == pytest.approx(e.prefill_s(isl), rel=1e-9)
    for b, ctx in ((1, 1000), (32, 2000), (256, 4000)):  # b decodes at context ctx
        if b in TOKEN_POINTS:
            assert s.step_seconds([ctx] * b, []) == pytest.approx(e.step_s(b, ctx), rel=1e-9)
    # Between the table's points the roofline is interpolated: within 2% of the planner.
    assert s.step_seconds([2000] * 32, [(0, 300)]) == pytest.approx(e.step_s(32, 2000, 300, 300), rel=0.02)


def test_the_profile_document_round_trips_and_carries_the_network():
    doc = planner_profile("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", 1, "fp8", "tcp")
    s = from_dict(doc)
    e = Engine(load_model("meta-llama/Llama-3.1-8B-Instruct"), load_system("h100_sxm"), 1, "fp8")
    assert s.kv_bytes_per_token == e.kv_bytes_per_token
    assert s.transfer.bandwidth_gbps == pytest.approx(e.system.network_gbps["tcp"] * e.system.efficiency["network"])
    assert doc["source"]["kind"] == "planner" and doc["system"] == "h100_sxm"


def test_unknown_system_or_network_is_a_sim_error():
    with pytest.raises(SimError, match="unknown system"):
        planner_profile("meta-llama/Llama-3.1-8B-Instruct", "tpu9")
    with pytest.raises(SimError, match="no network 'carrier-pigeon'"):
        planner_profile("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", network="carrier-pigeon")
