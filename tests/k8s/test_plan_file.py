"""serve.deploy.plan: the typed plan file. Files written so far load (the first ones lacked
kv_dtype and parts of the system profile), anything else is one line naming the file, and
serve's deployment code never imports bench."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bench.plan.report import PlanInputs, plan
from serve.deploy.plan import (DISAGG_NEUTRAL, PLAN_SCHEMA, DeployError, Plan, Pool, decode_plan, load_plan,
                               write_plan)
from tests.conftest import ROOT

GUIDE = PlanInputs("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "h200_sxm", 4, 4000, 500, 600, 16.67)


@pytest.fixture(scope="module")
def guide() -> Plan:
    return plan(GUIDE)


def test_write_and_load_a_file_or_its_directory(tmp_path, guide):
    f = write_plan(guide, tmp_path / "d")
    assert f == tmp_path / "d" / "plan.json"
    assert load_plan(tmp_path / "d") == guide == load_plan(f)
    assert f.read_bytes() == guide.to_json() and f.read_bytes().endswith(b"}\n")


def test_every_field_is_written_none_included(guide):
    none = plan(PlanInputs(GUIDE.model, GUIDE.system, 4, 4000, 500, 1.0, 16.67))
    doc = json.loads(none.to_json())
    assert doc["schema"] == PLAN_SCHEMA
    assert {k: doc[k] for k in ("agg_best", "disagg_best", "winner", "launch", "load_test")} == dict.fromkeys(
        ("agg_best", "disagg_best", "winner", "launch", "load_test"))
    assert doc["inputs"] == {"model": GUIDE.model, "system": "h200_sxm", "total_gpus": 4, "isl": 4000, "osl": 500,
                             "ttft_ms": 1.0, "tpot_ms": 16.67, "backend": "vllm", "kv_dtype": "bf16",
                             "weight_dtype": "bf16", "network": "rdma", "roofline_only": False}
    assert set(json.loads(guide.to_json())["agg_best"]) == {
        "mode", "tp", "replicas", "batch", "prefill_tp", "prefill_workers", "prefill_batch", "decode_tp",
        "decode_workers", "decode_batch", "meets", "layout", "ttft_ms", "tpot_ms", "request_latency_ms",
        "requests_per_s", "tokens_per_s", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "concurrency", "gpus"}


def test_a_first_generation_plan_still_loads(tmp_path, guide):
    # What `pdserve plan` wrote before plans carried kv_dtype, the activation reserve and the
    # disaggregation factors; and a key a newer writer might add.
    doc = json.loads(guide.to_json())
    del doc["kv_dtype"], doc["system"]["activation_reserve_gib"], doc["system"]["disagg"]
    doc["future_key"] = {"x": 1}
    (tmp_path / "plan.json").write_text(json.dumps(doc, indent=2))
    old = load_plan(tmp_path)
    assert old.kv_dtype is None and old.kv_cache_dtype == GUIDE.kv_dtype
    assert old.system.activation_reserve_gib == 2.0 and old.system.disagg == DISAGG_NEUTRAL
    assert old.agg_best == guide.agg_best and old.launch == guide.launch


def test_best_and_pools(guide):
    assert guide.best() is guide.agg_best and guide.best("disagg") is guide.disagg_best
    a, d = guide.agg_best, guide.disagg_best
    assert a.pools() == {"agg": Pool(a.replicas, a.tp, a.batch)}
    assert d.pools() == {"prefill": Pool(d.prefill_workers, d.prefill_tp, d.prefill_batch),
                         "decode": Pool(d.decode_workers, d.decode_tp, d.decode_batch)}


@pytest.mark.parametrize("text, says", [
    ('{"schema": "other/9"}', "not a pdserve.plan/1 plan (schema 'other/9')"),
    ("[1, 2]", "not a pdserve.plan/1 plan (schema None)"),
    ("{not json", "invalid JSON"),
    ('{"schema": "pdserve.plan/1", "inputs": {}}', "not a valid pdserve.plan/1 plan: Object missing required field"),
])
def test_anything_else_is_one_line_naming_the_file(tmp_path, text, says):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(DeployError) as e:
        load_plan(f)
    assert str(e.value).startswith(f"{f}: ") and says in str(e.value) and "\n" not in str(e.value)


def test_wrong_types_name_the_field(guide):
    doc = msgspec.to_builtins(guide)
    doc["agg_best"]["replicas"] = "four"
    with pytest.raises(DeployError, match=r"Expected `int`, got `str` - at `\$.agg_best.replicas`"):
        decode_plan(json.dumps(doc), "p.json")
    doc = msgspec.to_builtins(guide)
    doc["winner"] = "hybrid"
    with pytest.raises(DeployError, match="winner"):
        decode_plan(json.dumps(doc), "p.json")


def test_a_missing_file(tmp_path):
    with pytest.raises(DeployError, match="No such file"):
        load_plan(tmp_path / "nope")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("bench."):
            out.add(node.value)  # importlib with a literal name
    return out


def test_serve_deploy_never_imports_bench():
    for f in ("plan.py", "k8s.py"):
        assert not {m for m in _imports(ROOT / "serve" / "deploy" / f) if m.split(".")[0] == "bench"}, f
    code = ("import sys, serve.deploy.k8s, serve.deploy.plan; "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] == 'bench') or 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
