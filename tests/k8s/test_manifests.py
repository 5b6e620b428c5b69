"""The kustomize overlays: they render, validate against a pinned Kubernetes version, and
obey the deployment rules (resources, probes, RDMA only on GPUs, RWX cache, selectors)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.k8s.manifests import (GPU_OVERLAYS, K8S, KUBERNETES_VERSION, OVERLAYS, VAR, by_kind, env_of, pod_specs,
                                 render, render_dir, worker_containers)

UCX_RDMA = {"UCX_TLS": "rc_x,rc,dc_x,dc,cuda_copy,cuda_ipc", "UCX_RNDV_SCHEME": "get_zcopy", "UCX_RNDV_THRESH": "0"}


def validate(docs: list[dict]) -> None:
    import kubernetes_validate

    for d in docs:
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} is invalid for Kubernetes {KUBERNETES_VERSION}: "
                        f"{exc.message} at {'/'.join(map(str, exc.path))}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "Job", "PodDisruptionBudget"} <= kinds
    validate(docs)


def test_servicemonitor_component_renders(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "disagg", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "servicemonitor", tmp_path)]}))
    docs = render_dir(tmp_path)
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    validate([d for d in docs if d["kind"] != "ServiceMonitor"])  # a CRD: not in the core schemas
    scraped = {n for n, s in by_kind(docs, "Service").items()
               if all(s["metadata"].get("labels", {}).get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())}
    assert scraped == {"pdserve-frontend", "pdserve-prefill", "pdserve-decode"}
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resources_and_every_server_has_probes(overlay):
    docs = render(overlay)
    for name, _, spec in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), f"{name}/{c['name']} lacks {part}"
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        if name in ("pdserve-model-cache", "pdserve-autoscaler"):  # not servers of the model (autoscaler: its own test)
            continue
        for c in spec["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["path"] in ("/health", "/live") and get["port"] in ports, (name, probe, get)
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"   # out of rotation when unhealthy or draining
            assert c["livenessProbe"]["httpGet"]["path"] == "/live"      # a busy engine is not restarted
            assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["pdserve", "drain"]
            args = c["args"]
            graceful = float(args[args.index("--graceful-timeout") + 1])
            assert spec["terminationGracePeriodSeconds"] > graceful + 5, name


def test_grace_period_covers_the_request_timeout():
    docs = render("disagg")
    fe = by_kind(docs, "Deployment")["pdserve-frontend"]["spec"]["template"]["spec"]
    args = fe["containers"][0]["args"]
    timeout = float(args[args.index("--request-timeout") + 1])
    for name, spec, c in worker_containers(docs):
        a = c["args"]
        assert float(a[a.index("--graceful-timeout") + 1]) >= timeout, name
    assert fe["terminationGracePeriodSeconds"] >= timeout


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_request_rdma_ipc_lock_and_ucx(overlay):
    docs = render(overlay)
    workers = worker_containers(docs)
    assert workers
    for name, spec, c in workers:
        for part in ("requests", "limits"):
            assert c["resources"][part]["rdma/hca_shared_devices"] == "1", name
            assert c["resources"][part]["nvidia.com/gpu"] == "1", name
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        env = env_of(c, docs)
        assert {k: env[k] for k in UCX_RDMA} == UCX_RDMA
        assert env["PDSERVE_KV_TRANSPORT"] == "rdma" and env["PDSERVE_KV_CACHE_DTYPE"] == "fp8"
    # The frontend gets none of it.
    fe = by_kind(docs, "Deployment")["pdserve-frontend"]["spec"]["template"]["spec"]["containers"][0]
    assert "rdma/hca_shared_devices" not in fe["resources"]["limits"] and "securityContext" in fe
    assert "IPC_LOCK" not in json.dumps(fe)


def test_cpu_overlay_has_no_gpu_or_rdma():
    docs = render("cpu")
    text = json.dumps(docs)
    for word in ("rdma/", "IPC_LOCK", "UCX_", "nvidia.com"):
        assert word not in text, word
    for name, spec, c in worker_containers(docs):
        assert env_of(c, docs)["PDSERVE_KV_TRANSPORT"] == "tcp"
        assert spec["securityContext"]["runAsNonRoot"] is True
    assert by_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_MODEL"] == "smollm2-135m-instruct"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_cache_is_one_rwx_volume_filled_by_one_job(overlay):
    docs = render(overlay)
    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    params = yaml.safe_load((K8S / "base" / "params.yaml").read_text())["data"]
    assert pvc["spec"]["storageClassName"] == params["storageClassName"]
    (job,) = by_kind(docs, "Job").values()
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["model", "download"]
    assert not any(m.get("readOnly") for m in c["volumeMounts"])
    for name, _, spec in pod_specs(docs):
        if name == job["metadata"]["name"] or name == "pdserve-autoscaler":  # the autoscaler needs no model
            continue
        # serving pods mount the cache read-only and wait for the Job, never download
        assert spec["initContainers"][0]["args"][:2] == ["model", "wait"]
        for c in spec["containers"]:
            assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"] == "model-cache")
            assert env_of(c, docs)["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontend_service_selects_only_frontend_pods(overlay):
    docs = render(overlay)
    svc = by_kind(docs, "Service")["pdserve-frontend"]
    sel = svc["spec"]["selector"]
    matched = {name for name, meta, _ in pod_specs(docs)
               if all(meta.get("labels", {}).get(k) == v for k, v in sel.items())}
    assert matched == {"pdserve-frontend"}
    disc = by_kind(docs, "Service")["pdserve-frontend-discovery"]
    assert disc["spec"]["clusterIP"] == "None" and disc["spec"]["publishNotReadyAddresses"] is True
    assert disc["spec"]["selector"] == sel


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_identity_discovery_and_expanded_args(overlay):
    docs = render(overlay)
    for name, spec, c in worker_containers(docs):
        env = env_of(c, docs)
        assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "$(POD_UID)" in env["PDSERVE_WORKER_ID"] and env["PDSERVE_ADVERTISE_HOST"] == "$(POD_IP)"
        assert env["PDSERVE_FRONTEND"].startswith("dns+http://pdserve-frontend-discovery:")
        assert env["PDSERVE_CLUSTER_TOKEN"] == {"secretKeyRef": {"name": "pdserve-cluster-token", "key": "token"}}
        assert "--trust-remote-code" not in c["args"]  # the shipped models need no custom code
        for arg in c["args"] + [str(v) for v in env.values() if isinstance(v, str)]:
            for var in VAR.findall(arg):
                assert var in env, f"{name}: $({var}) is not defined"
        ann = next(meta for n, meta, _ in pod_specs(docs) if n == name)["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert set(pdbs) == {name for name, _, _ in worker_containers(docs)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontend_takes_its_secrets_from_secrets(overlay):
    docs = render(overlay)
    fe = by_kind(docs, "Deployment")["pdserve-frontend"]["spec"]["template"]["spec"]["containers"][0]
    env = env_of(fe, docs)
    assert env["PDSERVE_CLUSTER_TOKEN"] == {"secretKeyRef": {"name": "pdserve-cluster-token", "key": "token"}}
    assert env["PDSERVE_API_KEY"]["secretKeyRef"]["name"] == "pdserve-api-keys"
    assert "--api-key" not in fe["args"] and "--cluster-token" not in fe["args"]  # never on a command line
    assert not by_kind(docs, "Secret")  # secrets are made in the cluster, not shipped


def test_disagg_overlay_is_the_guides_demo():
    docs = render("disagg")
    deps = by_kind(docs, "Deployment")
    assert {n: d["spec"]["replicas"] for n, d in deps.items()} == {
        "pdserve-frontend": 1, "pdserve-prefill": 2, "pdserve-decode": 2}
    envs = {name: env_of(c, docs) for name, _, c in worker_containers(docs)}
    assert envs["pdserve-prefill"]["PDSERVE_MAX_NUM_SEQS"] == "1"
    assert envs["pdserve-decode"]["PDSERVE_MAX_NUM_SEQS"] == "1024"
    assert {e["PDSERVE_TENSOR_PARALLEL_SIZE"] for e in envs.values()} == {"1"}
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    names = {n: {m.get("pods", m.get("object", {})).get("metric", {}).get("name") for m in h["spec"]["metrics"]}
             for n, h in hpas.items()}
    assert names == {"pdserve-prefill": {"pdserve_worker_queued_requests", "pdserve_frontend_ttft_p90_seconds"},
                     "pdserve-decode": {"pdserve_worker_kv_usage_ratio", "pdserve_frontend_itl_p90_seconds"}}
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {"pdserve-prefill", "pdserve-decode"}


def test_agg_overlay_is_the_planned_baseline():
    docs = render("agg")
    deps = by_kind(docs, "Deployment")
    assert {n: d["spec"]["replicas"] for n, d in deps.items()} == {"pdserve-frontend": 1, "pdserve-agg": 4}
    assert set(by_kind(docs, "HorizontalPodAutoscaler")) == {"pdserve-agg"}
