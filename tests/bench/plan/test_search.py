"""SLA filtering, ranking, plan.json round trip, and the guide's case."""

from __future__ import annotations

import json

import msgspec
import pytest

from bench.plan.errors import PlanError
from bench.plan.perf import Prediction
from bench.plan.grid import load_grid
from bench.plan.report import PlanInputs, plan, read_plan, write
from bench.plan.search import Layout, Targets, _meets, pareto, rank
from serve.deploy.plan import PLAN_SCHEMA, Plan

GUIDE = PlanInputs("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "h200_sxm", 4, 4000, 500, 600, 16.67)


def pred(gpu: float, user: float, ttft: float = 100, tpot: float = 10, gpus: int = 1) -> Prediction:
    return Prediction(ttft, tpot, ttft + 10 * tpot, 1.0, gpu * gpus, gpu, user, 1.0, gpus)


def test_sla_filter():
    t = Targets(ttft_ms=600, tpot_ms=16.67)
    assert _meets(pred(1, 1, 600, 16.67), t)
    assert not _meets(pred(1, 1, 601, 10), t)
    assert not _meets(pred(1, 1, 100, 16.7), t)


def test_rank_by_tokens_per_gpu_then_per_user():
    a = Layout("agg", pred(100, 50))
    b = Layout("agg", pred(200, 10))
    c = Layout("agg", pred(100, 60))
    assert rank([a, b, c]) == [b, c, a]


def test_pareto_front():
    pts = [Layout("agg", pred(100, 10)), Layout("agg", pred(80, 20)), Layout("agg", pred(70, 15)),
           Layout("agg", pred(50, 40)), Layout("agg", pred(90, 5, ttft=900))]
    front = pareto(pts, Targets(600, 100))
    assert [(x.pred.tokens_per_s_per_gpu, x.pred.tokens_per_s_per_user) for x in front] == [(50, 40), (80, 20), (100, 10)]


def test_guide_case_aggregated_wins_with_tp1_replicas(tmp_path):
    doc = plan(GUIDE)
    assert isinstance(doc, Plan)
    a, d = doc.agg_best, doc.disagg_best
    assert doc.winner == "agg" and doc.best() == a
    assert (a.tp, a.replicas) == (1, 4)
    assert d is not None and doc.disagg_over_agg < 1
    assert a.ttft_ms <= 600 and a.tpot_ms <= 16.67 and d.ttft_ms <= 600 and d.tpot_ms <= 16.67
    # AIConfigurator's figures on the guide's case (its call sets no KV dtype: the model's, bf16):
    # within 15% of the version the reference grid uses (0.12.0, vLLM 0.24.0 tables), and within
    # 20% of the guide's published ones (an older AIConfigurator on vLLM 0.12.0 tables, which its
    # own newer release puts 11% and 16% lower: 3,365.9 and 2,591.8 against 3,785.20 and 3,067.51).
    assert doc.kv_dtype == "bf16"
    aic = next(r for r in load_grid()["cases"] if r["part"] == "guide")["aic"]
    assert 0.85 <= a.tokens_per_s_per_gpu / aic["agg"]["tokens_per_s_per_gpu"] <= 1.15
    assert 0.85 <= d.tokens_per_s_per_gpu / aic["disagg"]["tokens_per_s_per_gpu"] <= 1.15
    assert 0.8 <= a.tokens_per_s_per_gpu / 3785.20 <= 1.2 and 0.8 <= d.tokens_per_s_per_gpu / 3067.51 <= 1.2
    assert "--workers 4" in doc.launch.up and "--tensor-parallel-size 1" in doc.launch.up
    c = round(a.concurrency)
    assert f"--concurrency {c} " in doc.load_test and f"--num-requests {40 * c} " in doc.load_test
    assert "ignore_eos:true" in doc.load_test


def test_plan_files_round_trip(tmp_path):
    doc = plan(GUIDE)
    write(doc, tmp_path)
    back = read_plan(tmp_path)
    assert back == doc and back == read_plan(tmp_path / "plan.json")
    assert back.schema == PLAN_SCHEMA
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw == msgspec.to_builtins(doc)  # every field, None included, as plan.json has always had
    assert list(raw) == ["schema", "inputs", "model", "system", "targets", "kv_dtype", "agg_best", "disagg_best",
                         "winner", "disagg_over_agg", "agg_top", "disagg_top", "pareto", "searched", "launch",
                         "load_test", "near_tie", "other_launch", "other_load_test"]
    rows = (tmp_path / "agg_best.csv").read_text().splitlines()
    assert "tokens_per_s_per_gpu" in rows[0].split(",")
    assert float(rows[1].split(",")[2]) == pytest.approx(doc.agg_best.tokens_per_s_per_gpu, rel=1e-6)
    assert (tmp_path / "disagg_best.csv").read_text().startswith("rank,layout,tokens_per_s_per_gpu")
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    assert "pdserve up --mode agg" in (tmp_path / "launch.sh").read_text()
    (tmp_path / "bad.json").write_text('{"schema": "other/9"}')
    with pytest.raises(PlanError, match="not a pdserve.plan/1 plan"):
        read_plan(tmp_path / "bad.json")


def test_tighter_targets_filter_more():
    loose = plan(GUIDE)
    tight = plan(PlanInputs(GUIDE.model, GUIDE.system, 4, 4000, 500, 600, 8.0))
    assert tight.agg_best.tpot_ms <= 8.0
    assert tight.agg_best.tokens_per_s_per_gpu < loose.agg_best.tokens_per_s_per_gpu
    none = plan(PlanInputs(GUIDE.model, GUIDE.system, 4, 4000, 500, 1.0, 16.67))
    assert none.winner is None and none.agg_best is None and none.best() is None and none.launch is None


def test_rdma_beats_tcp_for_disaggregation():
    rdma = plan(PlanInputs("Llama-3.1-70B-Instruct", "h100_sxm", 16, 8000, 200, 2000, 50, network="rdma"))
    tcp = plan(PlanInputs("Llama-3.1-70B-Instruct", "h100_sxm", 16, 8000, 200, 2000, 50, network="tcp"))
    assert rdma.disagg_best.tokens_per_s_per_gpu > tcp.disagg_best.tokens_per_s_per_gpu


def test_bad_inputs_are_plan_errors():
    for bad in (PlanInputs(GUIDE.model, GUIDE.system, 0, 1, 1, 1, 1),
                PlanInputs(GUIDE.model, GUIDE.system, 4, 1, 1, 0, 1),
                PlanInputs(GUIDE.model, "nope", 4, 1, 1, 1, 1)):
        with pytest.raises(PlanError):
            plan(bad)


def test_a_layout_is_charged_for_every_gpu_of_the_budget():
    """On 8 GPUs, a disaggregated layout on 6 of them is ranked by its tokens/s over all 8
    (the idle 2 are not free), and every layout uses at most the budget."""
    from bench.plan.search import disagg_layouts
    from bench.plan.specs import load_model, load_system

    t = Targets(ttft_ms=2000, tpot_ms=50)
    seen = 0
    for lay in disagg_layouts(load_model("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1"), load_system("h200_sxm"), 8,
                              16000, 100, t, "bf16", "bf16", "rdma"):
        used = lay.prefill_workers * lay.prefill_tp + lay.decode_workers * lay.decode_tp
        assert used == lay.pred.gpus <= 8
        assert lay.pred.tokens_per_s_per_gpu == pytest.approx(lay.pred.tokens_per_s / 8)
        seen += used < 8
    assert seen > 0
