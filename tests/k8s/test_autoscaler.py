"""The autoscaler's Kubernetes components: the actuator (RBAC, its overlay) and the HPAs that
follow `pdserve_autoscaler_desired_replicas` render with `kubectl kustomize`, validate
strictly, run the real `pdserve autoscale` command line, and exclude each other and the
raw-metric HPAs."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.k8s.manifests import K8S, VAR, by_kind, env_of, expand, kubectl, render, render_dir
from tests.k8s.test_manifests import validate


def _compose(tmp_path, components: list[str]) -> os.PathLike:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "base", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / c, tmp_path) for c in components]}))
    return tmp_path


def _autoscaler_argv(docs: list[dict]) -> list[str]:
    dep = by_kind(docs, "Deployment")["pdserve-autoscaler"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = env_of(c, docs)
    argv = [expand(a, env) for a in c["args"]]
    for a in argv:
        assert not VAR.findall(a), f"undefined variable in {a}"
    return argv


def _parse(argv: list[str]):
    from serve.cli import build_parser

    return build_parser().parse_args(argv)


def test_the_acting_overlay_renders_validates_and_runs_pdserve_autoscale(tmp_path):
    from serve.autoscale.cli import load_profile

    docs = render("disagg-autoscaled")
    validate(docs)
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in docs}  # nothing else sets replicas
    assert by_kind(docs, "ConfigMap")["pdserve-scaling-owner"]["data"]["owner"] == "autoscaler-actuator"
    dep = by_kind(docs, "Deployment")["pdserve-autoscaler"]
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"  # one controller, ever
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "pdserve-autoscaler" and pod["automountServiceAccountToken"] is True
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["resources"]["limits"]
    args = _parse(_autoscaler_argv(docs))
    assert args.actuator == "kubernetes" and not args.dry_run and args.mode == "disagg"
    assert args.frontend == ["dns+http://pdserve-frontend-discovery:8000"]
    assert (args.ttft, args.itl, args.percentile) == (600.0, 16.67, 90.0)
    # the profile the pod mounts is the component's file, and it loads
    (vol,) = [v for v in pod["volumes"] if v["name"] == "profile"]
    cm = by_kind(docs, "ConfigMap")[vol["configMap"]["name"]]
    profile = tmp_path / "profile.json"
    profile.write_text(cm["data"]["profile.json"])
    step, _ = load_profile(str(profile))
    assert 0 < step.step_seconds([1000] * 8, []) < step.step_seconds([1000] * 64, [])
    assert args.profile == "/etc/pdserve/profile/profile.json"
    # the Deployments it scales are the ones it is allowed to scale
    role = by_kind(docs, "Role")["pdserve-autoscaler"]
    scale_rule = next(r for r in role["rules"] if r["resources"] == ["deployments/scale"])
    assert {"get", "patch"} <= set(scale_rule["verbs"]) and scale_rule["apiGroups"] == ["apps"]
    assert {args.prefill_deployment, args.decode_deployment} <= set(scale_rule["resourceNames"])
    assert {args.prefill_deployment, args.decode_deployment} <= set(by_kind(docs, "Deployment"))
    pods_rule = next(r for r in role["rules"] if r["resources"] == ["pods"])
    assert {"list", "patch"} <= set(pods_rule["verbs"]) and "delete" not in pods_rule["verbs"]
    binding = by_kind(docs, "RoleBinding")["pdserve-autoscaler"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve-autoscaler"}]
    assert binding["roleRef"]["name"] == "pdserve-autoscaler"
    svc = by_kind(docs, "Service")["pdserve-autoscaler"]
    assert svc["metadata"]["labels"]["pdserve.io/scrape"] == "true"


@pytest.mark.parametrize("mode,hpa_component,pools", [
    ("disagg", "autoscaler-hpa", ("prefill", "decode")), ("agg", "autoscaler-hpa-agg", ("agg",))])
def test_hpas_follow_the_desired_replicas_metric(tmp_path, mode, hpa_component, pools):
    workers = "disagg-workers" if mode == "disagg" else "agg-workers"
    docs = render_dir(_compose(tmp_path, [workers, "gpu", "autoscaler", hpa_component]))
    validate(docs)
    args = _parse(_autoscaler_argv(docs))
    assert args.dry_run and args.actuator is None  # it recommends; the HPAs act
    assert "Role" not in {d["kind"] for d in docs}  # and it needs no access to the API
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"pdserve-{p}" for p in pools}
    deployments = by_kind(docs, "Deployment")
    for pool in pools:
        spec = hpas[f"pdserve-{pool}"]["spec"]
        assert spec["scaleTargetRef"]["name"] in deployments
        (metric,) = spec["metrics"]
        obj = metric["object"]
        assert obj["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "pdserve-autoscaler"}
        assert obj["metric"] == {"name": "pdserve_autoscaler_desired_replicas",
                                 "selector": {"matchLabels": {"pool": pool}}}
        assert obj["target"] == {"type": "AverageValue", "averageValue": "1"}  # desired = the metric's value
        assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 0
    adapter = (K8S / "metrics-adapter" / "prometheus-adapter-values.yaml").read_text()
    assert "name: {as: pdserve_autoscaler_desired_replicas}" in adapter


@pytest.mark.parametrize("a,b", [("autoscaler-actuator", "autoscaler-hpa"),
                                 ("autoscaler-actuator", "autoscaling-disagg"),
                                 ("autoscaler-hpa", "autoscaling-disagg"),
                                 ("autoscaler-hpa-agg", "autoscaling-agg")])
def test_two_owners_of_the_replicas_do_not_render(tmp_path, a, b):
    workers = "agg-workers" if "agg" in a + b and "disagg" not in a + b else "disagg-workers"
    path = _compose(tmp_path, [workers, "gpu", "autoscaler", a, b])
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "may not add resource with an already registered id" in r.stderr, r.stderr[-500:]
