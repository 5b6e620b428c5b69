"""Each GPU system's own measured kernel efficiencies (bench/plan/kernels.py, kernels.json):
shipped in the package, applied by load_system through the fitted kernel scales, and off in
the roofline-only model."""

from __future__ import annotations

import json

import pytest

from bench.plan.kernels import KERNELS_FORMAT, MEASURED, shipped
from bench.plan.specs import KERNEL_MEASURES, data_file, load_system


def test_the_shipped_file_measures_every_datasheet_system_with_its_provenance():
    from importlib.resources import files

    doc = json.loads(files("bench.plan.data").joinpath("kernels.json").read_text())
    assert doc["format"] == KERNELS_FORMAT and doc["aiconfigurator"] and "bench.plan.kernels" in doc["made_by"]
    systems = data_file("systems.json")["systems"]
    assert set(shipped()) == set(systems)
    for name, m in shipped().items():
        assert all(0 < m[k] <= 1 for k in MEASURED if not k.endswith("_us")), name
        assert 1 < m["allreduce_latency_us"] < 100 and m["rows"]["gemm"] > 10 and m["tables"]["gemm"]
        assert 5 < m["layer_floor_us"] < 100 and m["rows"]["floor_gemms"] > 10
    # What motivates the file: B200's kernels reach less of its datasheet than Hopper's do.
    b, h = shipped()["b200_sxm"], shipped()["h100_sxm"]
    assert b["gemm"] < h["gemm"] and b["allreduce_latency_us"] > h["allreduce_latency_us"]


@pytest.mark.parametrize("name", ["h100_sxm", "b200_sxm"])
def test_a_measured_system_takes_its_efficiencies_from_its_kernels_times_the_fitted_scale(name):
    scale = data_file("systems.json")["defaults"]["kernel_scale"]
    m = shipped()[name]
    s = load_system(name)
    for k in KERNEL_MEASURES:
        assert s.efficiency[k] == pytest.approx(min(1.0, scale[k] * m[k]))
        assert "kernels.json" in s.sources[k]
    assert s.allreduce_latency_us == pytest.approx(scale["allreduce_latency_us"] * m["allreduce_latency_us"])
    assert s.step_overhead_ms == pytest.approx(scale["step_overhead_ms"])
    assert s.efficiency["network"] == data_file("systems.json")["defaults"]["efficiency"]["network"]


def test_the_roofline_only_model_gives_every_system_the_same_efficiencies():
    defaults = data_file("systems.json")["defaults"]
    a, b = load_system("h200_sxm", kernels=False), load_system("b200_sxm", kernels=False)
    assert a.efficiency == b.efficiency == defaults["efficiency"]
    assert a.allreduce_latency_us == b.allreduce_latency_us == defaults["allreduce_latency_us"]
    assert load_system("b200_sxm").efficiency["gemm"] < load_system("h200_sxm").efficiency["gemm"]


def test_plan_roofline_only_is_recorded_and_changes_the_b200_prediction():
    from bench.plan.report import PlanInputs, plan

    args = dict(model="meta-llama/Llama-3.1-8B-Instruct", system="b200_sxm", total_gpus=8, isl=4000, osl=500,
                ttft_ms=2000.0, tpot_ms=50.0)
    measured, roofline = plan(PlanInputs(**args)), plan(PlanInputs(**args, roofline_only=True))
    assert roofline.inputs.roofline_only and not measured.inputs.roofline_only
    assert measured.system.efficiency["gemm"] < roofline.system.efficiency["gemm"]
    from bench.plan.report import summary_text

    assert "b200_sxm's own measured kernels" in summary_text(measured)
    assert "step model: roofline-only" in summary_text(roofline)
    # Slower kernels: fewer tokens/s/GPU from the same GPUs.
    assert measured.agg_best.tokens_per_s_per_gpu < roofline.agg_best.tokens_per_s_per_gpu


def test_a_measured_all_reduce_curve_is_interpolated_log_log_and_extended_in_proportion():
    from bench.plan.perf import interpolate_us

    curve = [[1024, 10.0], [4096, 40.0], [16384, 40.0]]
    assert interpolate_us(curve, 512) == 10.0  # below the smallest message: its latency
    assert interpolate_us(curve, 4096) == pytest.approx(40.0)
    assert interpolate_us(curve, 2048) == pytest.approx(20.0)  # log-log: latency ~ size between 1 and 4 KiB
    assert interpolate_us(curve, 8192) == pytest.approx(40.0)
    assert interpolate_us(curve, 32768) == pytest.approx(80.0)  # past the largest: in proportion to size


def test_the_step_takes_the_measured_all_reduce_at_its_tp_and_a_floor_per_layer():
    from dataclasses import replace

    from bench.plan.perf import Engine
    from bench.plan.specs import load_model

    model = load_model("meta-llama/Llama-3.1-8B-Instruct")
    s = load_system("b200_sxm")
    assert s.allreduce_curve and set(s.allreduce_curve) == {"2", "4", "8"} and s.layer_floor_us > 0
    scale = data_file("systems.json")["defaults"]["kernel_scale"]
    raw = shipped()["b200_sxm"]["allreduce_us"]["8"]
    assert s.allreduce_curve["8"][0][1] == pytest.approx(raw[0][1] * scale["allreduce_latency_us"])
    e = Engine(model, s, 8, "bf16", "bf16")
    tokens = 4  # 4 * hidden * 2 bytes = 32 KiB: a measured message size, taken as measured
    at = {b: us for b, us in s.allreduce_curve["8"]}[tokens * model.hidden * 2]
    assert e.allreduce_s(tokens) == pytest.approx(2 * model.layers * at * 1e-6)
    # A TP the curve does not cover falls back to latency + bandwidth.
    no_curve = Engine(model, replace(s, allreduce_curve={"2": s.allreduce_curve["2"]}), 8, "bf16", "bf16")
    assert no_curve.allreduce_s(tokens) > 2 * model.layers * s.allreduce_latency_us * 1e-6
    floorless = Engine(model, replace(s, layer_floor_us=0.0), 8, "bf16", "bf16")
    assert e.step_s(16, 2000) - floorless.step_s(16, 2000) == pytest.approx(model.layers * s.layer_floor_us * 1e-6)
    roofline = load_system("b200_sxm", kernels=False)
    assert roofline.layer_floor_us == 0.0 and roofline.allreduce_curve is None


def test_the_shipped_kernel_scale_is_what_gridfit_fits_on_the_fit_part_alone():
    """Provenance: `python -m bench.plan.gridfit` from its fixed start, on the fit part (no B200,
    no 70B), gives the scales systems.json ships."""
    from bench.plan import gridfit
    from bench.plan.grid import HELD_OUT_MODEL, HELD_OUT_SYSTEM, load_grid

    rows = [r for r in load_grid()["cases"] if r["part"] == "fit"]
    assert rows and all(r["system"] != HELD_OUT_SYSTEM and r["model"] != HELD_OUT_MODEL for r in rows)
    got = gridfit.fit_params(rows, kernels=True)
    shipped_scale = data_file("systems.json")["defaults"]["kernel_scale"]
    assert set(got) == set(shipped_scale)
    for k, v in got.items():
        assert v == pytest.approx(shipped_scale[k], abs=1e-3), k
