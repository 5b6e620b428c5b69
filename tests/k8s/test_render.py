"""`pdserve k8s render`: an overlay from plan.json reproduces the planned pools, replica
counts, TP and batch, and renders and validates like the shipped overlays."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from bench.plan.report import PlanInputs, plan, write
from serve.deploy import k8s
from serve.deploy.plan import DeployError, load_plan
from tests.bench.commands import pdserve
from tests.k8s.manifests import K8S, by_kind, env_of, render_dir, worker_containers
from tests.k8s.test_manifests import validate

GUIDE = PlanInputs("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "h200_sxm", 4, 4000, 500, 600, 16.67)


def manifests_installed() -> bool:
    try:
        return files(k8s.MANIFESTS_PACKAGE).joinpath("base").joinpath("kustomization.yaml").is_file()
    except ModuleNotFoundError:
        return False


def main(argv: list[str]) -> int:
    """`pdserve k8s render ...`; the checkout's k8s/ only where the install lacks serve.deploy.manifests
    (an editable install made before the package-dir mapping)."""
    if argv[:2] == ["k8s", "render"] and "--manifests" not in argv and not manifests_installed():
        argv = [*argv, "--manifests", str(K8S)]
    return pdserve(argv)


def planned(tmp_path, inputs: PlanInputs = GUIDE):
    doc = plan(inputs)
    write(doc, tmp_path / "plan")
    return doc


def rendered(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "overlay"
    assert main(["k8s", "render", "--plan", str(tmp_path / "plan"), "--out", str(out), *extra]) == 0
    docs = render_dir(out)
    validate(docs)
    return docs


def pools(docs: list[dict]) -> dict[str, tuple[int, str, str, str]]:
    """deployment -> (replicas, TP, max-num-seqs, GPUs per pod)."""
    deps = by_kind(docs, "Deployment")
    out = {}
    for name, _, c in worker_containers(docs):
        env = env_of(c, docs)
        gpus = c["resources"]["limits"].get("nvidia.com/gpu", "0")
        out[name] = (deps[name]["spec"]["replicas"], env["PDSERVE_TENSOR_PARALLEL_SIZE"], env["PDSERVE_MAX_NUM_SEQS"], gpus)
    return out


def test_render_winner_reproduces_the_aggregated_plan(tmp_path):
    doc = planned(tmp_path)
    assert doc.winner == "agg"
    a = doc.agg_best
    docs = rendered(tmp_path, "--storage-class", "cephfs", "--namespace", "llm")
    assert pools(docs) == {"pdserve-agg": (a.replicas, str(a.tp), str(a.batch), str(a.tp))}
    assert by_kind(docs, "PersistentVolumeClaim")["pdserve-model-cache"]["spec"]["storageClassName"] == "cephfs"
    assert {d["metadata"].get("namespace") for d in docs} == {"llm"}
    assert by_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_MODEL"] == GUIDE.model
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["pdserve-agg"]["spec"]
    assert hpa["minReplicas"] == a.replicas
    targets = {m["object"]["metric"]["name"]: m["object"]["target"]["value"] for m in hpa["metrics"] if "object" in m}
    assert targets == {"pdserve_frontend_ttft_p90_seconds": "540m", "pdserve_frontend_itl_p90_seconds": "15003u"}
    assert load_plan(tmp_path / "overlay") == doc  # the overlay carries its plan


# The guide's case at 8 GPUs with Llama 3.1 8B: its best disaggregated layout has TP 1 prefill
# and TP 2 decode workers (the guide's own, on 4 GPUs, is TP 1 on both sides).
MIXED_TP = PlanInputs("meta-llama/Llama-3.1-8B-Instruct", "h200_sxm", 8, 4000, 500, 600, 16.67)


def test_render_disagg_layout_with_mixed_tp(tmp_path):
    doc = planned(tmp_path, MIXED_TP)
    d = doc.disagg_best
    docs = rendered(tmp_path, "--layout", "disagg")
    assert pools(docs) == {
        "pdserve-prefill": (d.prefill_workers, str(d.prefill_tp), str(d.prefill_batch), str(d.prefill_tp)),
        "pdserve-decode": (d.decode_workers, str(d.decode_tp), str(d.decode_batch), str(d.decode_tp)),
    }
    assert d.prefill_tp != d.decode_tp  # the case exercises per-role TP
    for name, _, c in worker_containers(docs):
        assert env_of(c, docs)["PDSERVE_KV_TRANSPORT"] == "rdma"


def test_render_cpu_local_plan_gives_cpu_workers_and_the_embedded_model(tmp_path):
    profile = tmp_path / "cpu-local.json"
    profile.write_text(json.dumps({"name": "cpu-local", "peak_tflops": {"bf16": 0.2, "fp8": 0.2}, "hbm_gbps": 10,
                                   "memory_gib": 1.5, "nvlink_gbps": 1, "network_gbps": {"rdma": 1, "tcp": 1},
                                   "step_overhead_ms": 5.0, "activation_reserve_gib": 0.1}))
    planned(tmp_path, PlanInputs("smollm2-135m-instruct", str(profile), 2, 256, 64, 5000, 200))
    docs = rendered(tmp_path, "--layout", "disagg")
    assert set(pools(docs)) == {"pdserve-prefill", "pdserve-decode"}
    assert "nvidia.com" not in json.dumps(docs) and "rdma/" not in json.dumps(docs)
    assert by_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_MODEL"] == "smollm2-135m-instruct"
    for _, _, c in worker_containers(docs):
        assert c["image"].startswith("ghcr.io/pdserve/pdserve-cpu:")
        assert env_of(c, docs)["PDSERVE_KV_CACHE_DTYPE"] == "auto"


def test_render_adds_trust_remote_code_only_when_the_config_needs_it(tmp_path):
    cfg = tmp_path / "custom"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 9216, "vocab_size": 128256, "auto_map": {"AutoModelForCausalLM": "m.Model"}}))
    planned(tmp_path, PlanInputs(str(cfg), "h200_sxm", 4, 4000, 500, 600, 16.67))
    out = tmp_path / "overlay"
    # a config dir is not something the cache Job can download: the hub id must be given
    assert main(["k8s", "render", "--plan", str(tmp_path / "plan"), "--out", str(out)]) == 2
    docs = rendered(tmp_path, "--model", "acme/custom-4b")
    for _, _, c in worker_containers(docs):
        assert c["args"][-1] == "--trust-remote-code" and c["args"][:3] == ["worker", "--role", c["args"][2]]
    assert by_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_MODEL"] == "acme/custom-4b"


def test_render_refuses_bad_plans(tmp_path, capsys):
    planned(tmp_path, PlanInputs(GUIDE.model, GUIDE.system, 4, 4000, 500, 600, 16.67, network="tcp"))
    assert main(["k8s", "render", "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "o")]) == 2
    assert "only RDMA plans render" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    assert main(["k8s", "render", "--plan", str(tmp_path / "bad.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve k8s render: error:") and len(err.strip().splitlines()) == 1
    planned(tmp_path)
    assert main(["k8s", "render", "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "o"),
                 "--model", "./not-a-hub-id"]) == 2


def test_render_function_takes_options_and_a_plan_file(tmp_path):
    doc = planned(tmp_path)
    opts = k8s.RenderOptions(layout="agg", image="registry.local/pdserve:9", namespace="x",
                             manifests=None if manifests_installed() else str(K8S))
    out = k8s.render(tmp_path / "plan" / "plan.json", tmp_path / "o", opts)
    docs = render_dir(out)
    validate(docs)
    assert pools(docs)["pdserve-agg"][0] == doc.agg_best.replicas
    assert {c["image"] for _, _, c in worker_containers(docs)} == {"registry.local/pdserve:9"}


def test_manifests_come_from_the_installed_package_only(tmp_path, monkeypatch):
    planned(tmp_path)
    monkeypatch.setattr(k8s, "MANIFESTS_PACKAGE", "serve.deploy.no_such_manifests")
    with pytest.raises(DeployError, match="not installed: pass --manifests DIR"):
        k8s.render(tmp_path / "plan", tmp_path / "o")
    with pytest.raises(DeployError, match="is not pdserve's k8s/ directory"):
        k8s.render(tmp_path / "plan", tmp_path / "o", k8s.RenderOptions(manifests=str(tmp_path)))


def test_k8s_without_an_action_is_a_usage_error(capsys):
    assert pdserve(["k8s"]) == 2
    assert capsys.readouterr().err.startswith("pdserve k8s: error: usage:")
