"""`pdserve k8s render --plan plan.json --out DIR`: a kustomize overlay for a planned layout.

The overlay is self-contained: DIR/pdserve/ is a copy of the repository's k8s/base and
k8s/components, and DIR/kustomization.yaml picks the worker pools, replica counts, TP,
batch (`--max-num-seqs`), KV dtype, GPUs per worker and autoscaling targets from the plan:

    kubectl apply -k DIR

A plan for `cpu-local` renders CPU workers (the embedded model, KV over TCP); any GPU system
renders GPU workers with RDMA. Plans for `--network tcp` are refused: the GPU components
assume RDMA.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench.plan.errors import PlanError

EMBEDDED = "smollm2-135m-instruct"
DEFAULT_IMAGES = {"gpu": "ghcr.io/pdserve/pdserve-gpu:0.1.0", "cpu": "ghcr.io/pdserve/pdserve-cpu:0.1.0"}
# Autoscaling aims below the plan's targets, so pools grow before the targets are missed.
HPA_TARGET_FRACTION = 0.9


def default_manifests() -> Path:
    return Path(__file__).resolve().parents[2] / "k8s"


def add_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("k8s", help="Kubernetes: render an overlay for a planned layout")
    ksub = k.add_subparsers(dest="k8s_command", metavar="ACTION")
    r = ksub.add_parser("render", help="write a kustomize overlay for a plan's layout (kubectl apply -k DIR)",
                        description=__doc__.split("\n\n")[1] if __doc__ else None)
    r.add_argument("--plan", required=True, help="plan.json from `pdserve plan` (or its --save-dir)")
    r.add_argument("--out", required=True, help="directory for the overlay (created; its pdserve/ is replaced)")
    r.add_argument("--layout", choices=["winner", "agg", "disagg"], default="winner",
                   help="which of the plan's best layouts to render (default: the winner)")
    r.add_argument("--model", default=None,
                   help="hub id to serve (default: the plan's model; needed when the plan was made from a config dir)")
    r.add_argument("--image", default=None, help="container image (default: the pdserve GPU or CPU image)")
    r.add_argument("--storage-class", default=None,
                   help="ReadWriteMany StorageClass of the model cache (default: the base's, nfs-client)")
    r.add_argument("--model-cache-size", default=None, help="model cache PVC size (default: 100Gi)")
    r.add_argument("--namespace", default=None, help="namespace for every object (default: none set)")
    r.add_argument("--trust-remote-code", action="store_true",
                   help="pass --trust-remote-code to the workers (also set when the plan's config dir has auto_map)")
    r.add_argument("--manifests", default=None, help="pdserve's k8s/ directory (default: the one beside this code)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "k8s_command", None) != "render":
        print("pdserve k8s: error: usage: pdserve k8s render --plan PLAN --out DIR", file=sys.stderr)
        return 2
    try:
        out = render(args)
    except PlanError as e:
        print(f"pdserve k8s render: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}/kustomization.yaml: kubectl apply -k {out}")
    return 0


# -- what to render -----------------------------------------------------------------------
def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def _model(plan: dict[str, Any], override: str | None, cpu: bool) -> str:
    if override:
        if override != EMBEDDED and not _is_hub_id(override):
            raise PlanError(f"--model {override!r}: expected a hub id (organisation/name) or {EMBEDDED}")
        return override
    given = str(plan.get("inputs", {}).get("model", ""))
    known = str(plan.get("model", {}).get("name", ""))
    if cpu:
        if EMBEDDED in (given.lower(), known.lower()) or known == "HuggingFaceTB/SmolLM2-135M-Instruct":
            return EMBEDDED
    for name in (given, known):
        if name == EMBEDDED or _is_hub_id(name):
            return name
    raise PlanError(f"the plan's model {given!r} is not a hub id: pass --model ORG/NAME (what the model-cache "
                    "Job downloads)")


def _needs_remote_code(plan: dict[str, Any]) -> bool:
    cfg = Path(str(plan.get("inputs", {}).get("model", ""))).expanduser() / "config.json"
    try:
        return "auto_map" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def _pools(best: dict[str, Any]) -> dict[str, dict[str, int]]:
    """role -> {replicas, tp, max_num_seqs}."""
    if best["mode"] == "agg":
        return {"agg": {"replicas": int(best["replicas"]), "tp": int(best["tp"]), "max_num_seqs": int(best["batch"])}}
    return {
        "prefill": {"replicas": int(best["prefill_workers"]), "tp": int(best["prefill_tp"]),
                    "max_num_seqs": int(best["prefill_batch"])},
        "decode": {"replicas": int(best["decode_workers"]), "tp": int(best["decode_tp"]),
                   "max_num_seqs": int(best["decode_batch"])},
    }


def _best(plan: dict[str, Any], layout: str) -> dict[str, Any]:
    mode = plan.get("winner") if layout == "winner" else layout
    if mode not in ("agg", "disagg"):
        raise PlanError("the plan has no winner (no layout met the targets): nothing to render")
    best = plan.get(f"{mode}_best")
    if not isinstance(best, dict):
        raise PlanError(f"the plan has no {mode} layout that meets its targets")
    for pool in _pools(best).values():
        if min(pool.values()) < 1:
            raise PlanError(f"the plan's {mode} layout {best.get('layout')!r} has an empty pool")
    return best


def _load_test(plan: dict[str, Any], best: dict[str, Any], model: str) -> str:
    """The plan's load test, at this layout's concurrency (x 40 requests), through the
    frontend Service (`kubectl port-forward svc/pdserve-frontend 8000`)."""
    import shlex

    i = plan.get("inputs", {})
    c = max(1, round(float(best.get("concurrency", 1))))
    return shlex.join(["pdserve", "bench", "profile", "-m", model, "--endpoint-type", "chat", "-u",
                       "http://localhost:8000", "--isl", str(i.get("isl")), "--isl-stddev", "0", "--osl",
                       str(i.get("osl")), "--osl-stddev", "0", "--num-requests", str(c * 40), "--concurrency", str(c),
                       "--streaming", "--extra-inputs", "ignore_eos:true", "--num-warmup-requests", str(c),
                       "--ui-type", "simple", "--goodput",
                       f"time_to_first_token:{i.get('ttft_ms'):g} inter_token_latency:{i.get('tpot_ms'):g}"])


# -- writing ------------------------------------------------------------------------------
def _worker_patch(role: str, pool: dict[str, int], kv_dtype: str, cpu: bool, args_list: list[str] | None) -> dict:
    env = [{"name": "PDSERVE_TENSOR_PARALLEL_SIZE", "value": str(pool["tp"])},
           {"name": "PDSERVE_MAX_NUM_SEQS", "value": str(pool["max_num_seqs"])},
           {"name": "PDSERVE_KV_CACHE_DTYPE", "value": kv_dtype}]
    container: dict[str, Any] = {"name": "worker", "env": env}
    if not cpu:
        gpus = str(pool["tp"])
        container["resources"] = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    if args_list is not None:
        container["args"] = args_list
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"pdserve-{role}"},
            "spec": {"template": {"spec": {"containers": [container]}}}}


def _hpa_patch(role: str, pool: dict[str, int], targets: dict[str, float], src: dict) -> dict:
    metrics = []
    for m in src["spec"]["metrics"]:
        m = json.loads(json.dumps(m))
        name = m.get("object", {}).get("metric", {}).get("name")
        if name == "pdserve_frontend_ttft_p90_seconds":
            m["object"]["target"]["value"] = f"{round(targets['ttft_ms'] * HPA_TARGET_FRACTION)}m"
        elif name == "pdserve_frontend_itl_p90_seconds":
            m["object"]["target"]["value"] = f"{round(targets['tpot_ms'] * HPA_TARGET_FRACTION * 1000)}u"
        metrics.append(m)
    n = pool["replicas"]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": f"pdserve-{role}"},
            "spec": {"minReplicas": n, "maxReplicas": max(2 * n, n + 1), "metrics": metrics}}


def _load_yaml_docs(path: Path) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _dump(path: Path, docs: list[dict], header: str = "") -> None:
    import yaml

    path.write_text(header + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))


def render(args: argparse.Namespace) -> Path:
    from bench.plan.report import read_plan

    src = Path(args.manifests) if args.manifests else default_manifests()
    if not (src / "base" / "kustomization.yaml").is_file() or not (src / "components").is_dir():
        raise PlanError(f"{src} is not pdserve's k8s/ directory (no base/kustomization.yaml): pass --manifests DIR")
    plan_path = Path(args.plan)
    plan = read_plan(plan_path / "plan.json" if plan_path.is_dir() else plan_path)
    inputs = plan.get("inputs", {})
    if inputs.get("network", "rdma") != "rdma":
        raise PlanError(f"the plan is for --network {inputs.get('network')}: only RDMA plans render (the GPU "
                        "components request RDMA devices)")
    system = str(inputs.get("system", ""))
    cpu = system == "cpu-local" or plan.get("system", {}).get("name") == "cpu-local"
    best = _best(plan, args.layout)
    pools = _pools(best)
    model = _model(plan, args.model, cpu)
    remote_code = args.trust_remote_code or _needs_remote_code(plan)
    kv_dtype = "auto" if cpu else str(plan.get("kv_dtype", "fp8"))
    mode = best["mode"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vendored = out / "pdserve"
    if vendored.exists():
        shutil.rmtree(vendored)
    shutil.copytree(src / "base", vendored / "base")
    shutil.copytree(src / "components", vendored / "components")

    comp = "disagg-workers" if mode == "disagg" else "agg-workers"
    components = [f"pdserve/components/{comp}", f"pdserve/components/{'cpu' if cpu else 'gpu'}"]
    patches: list[dict] = []
    for role, pool in pools.items():
        args_list = None
        if remote_code:
            deploy = next(d for d in _load_yaml_docs(src / "components" / comp / f"{role}.yaml")
                          if d["kind"] == "Deployment")
            args_list = [*deploy["spec"]["template"]["spec"]["containers"][0]["args"], "--trust-remote-code"]
        patches.append(_worker_patch(role, pool, kv_dtype, cpu, args_list))
    if not cpu:
        hpa_dir = f"autoscaling-{mode}"
        components.append(f"pdserve/components/{hpa_dir}")
        hpas = {d["metadata"]["name"]: d for d in _load_yaml_docs(src / "components" / hpa_dir / "hpa.yaml")}
        targets = plan.get("targets", {"ttft_ms": inputs.get("ttft_ms"), "tpot_ms": inputs.get("tpot_ms")})
        patches += [_hpa_patch(role, pool, targets, hpas[f"pdserve-{role}"]) for role, pool in pools.items()]
    patches.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pdserve-config"},
                    "data": {"PDSERVE_MODEL": model}})
    # The base's replacements have run by the time overlay patches apply: patch the PVC itself.
    pvc: dict[str, Any] = {}
    if args.storage_class:
        pvc["storageClassName"] = args.storage_class
    if args.model_cache_size:
        pvc["resources"] = {"requests": {"storage": args.model_cache_size}}
    if pvc:
        patches.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": "pdserve-model-cache"}, "spec": pvc})
    header = (f"# Rendered by `pdserve k8s render` from {plan_path} ({plan.get('schema')}): {best.get('layout')}\n"
              f"# predicted {best.get('tokens_per_s_per_gpu', 0):.1f} tokens/s/GPU, TTFT {best.get('ttft_ms', 0):.0f} ms, "
              f"TPOT {best.get('tpot_ms', 0):.2f} ms at concurrency {best.get('concurrency', 0):.0f}\n"
              f"# check it: {_load_test(plan, best, model)}\n"
              + ("# --trust-remote-code: the model's config.json needs custom code (auto_map) or it was asked for\n"
                 if remote_code else "# no --trust-remote-code: the model needs no custom code\n"))
    _dump(out / "patches.yaml", patches, header)
    image = args.image or DEFAULT_IMAGES["cpu" if cpu else "gpu"]
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        **({"namespace": args.namespace} if args.namespace else {}),
        "resources": ["pdserve/base"],
        "components": components,
        "images": [{"name": "pdserve", "newName": name, **({"newTag": tag} if tag else {})}],
        "replicas": [{"name": "pdserve-frontend", "count": 1}]
                    + [{"name": f"pdserve-{role}", "count": pool["replicas"]} for role, pool in pools.items()],
        "patches": [{"path": "patches.yaml"}],
    }
    _dump(out / "kustomization.yaml", [kustomization], header)
    (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    return out
