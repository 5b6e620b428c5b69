"""Rendering pdserve's kustomize overlays for the tests: `kubectl kustomize` on this image."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("agg", "disagg", "cpu", "disagg-autoscaled")
GPU_OVERLAYS = ("agg", "disagg", "disagg-autoscaled")
# Pinned: what the manifests are validated against (kubectl on this image is 1.32).
KUBERNETES_VERSION = "1.32.0"
WORKER_ROLES = ("agg", "prefill", "decode")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl not found on PATH: the k8s tests render overlays with `kubectl kustomize` "
                    "(install kubectl >= 1.27, which bundles kustomize v5)")
    return path


def render_dir(path: Path) -> list[dict[str, Any]]:
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{r.stderr}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@functools.lru_cache(maxsize=None)
def _render_cached(overlay: str) -> str:
    return yaml.safe_dump_all(render_dir(K8S / "overlays" / overlay))


def render(overlay: str) -> list[dict[str, Any]]:
    """The rendered objects of an overlay (a fresh copy per call)."""
    return [d for d in yaml.safe_load_all(_render_cached(overlay)) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(object name, pod template metadata, pod spec) of every workload."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = d["spec"]["template"]
            out.append((d["metadata"]["name"], t.get("metadata", {}), t["spec"]))
    return out


def worker_containers(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(deployment, pod spec, worker container) of every worker pool."""
    out = []
    for name, meta, spec in pod_specs(docs):
        if meta.get("labels", {}).get("app.kubernetes.io/component") in WORKER_ROLES:
            out.append((name, spec, next(c for c in spec["containers"] if c["name"] == "worker")))
    return out


def env_of(container: dict, docs: list[dict]) -> dict[str, Any]:
    """The container's env: ConfigMap envFrom first, then env (which wins), as Kubernetes does."""
    env: dict[str, Any] = {}
    maps = by_kind(docs, "ConfigMap")
    for src in container.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]].get("data", {}))
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (unknown references stay as they are)."""
    return VAR.sub(lambda m: str(env[m.group(1)]) if m.group(1) in env else m.group(0), value)
