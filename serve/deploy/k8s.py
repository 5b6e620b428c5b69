"""`pdserve k8s render --plan plan.json --out DIR`: a kustomize overlay for a planned layout.

The overlay is self-contained: DIR/pdserve/ is a copy of pdserve's manifests base and
components (the package serve.deploy.manifests, the repository's k8s/), and
DIR/kustomization.yaml picks the worker pools, replica counts, TP, batch
(`--max-num-seqs`), KV dtype, GPUs per worker and autoscaling targets from the plan:

    kubectl apply -k DIR

A plan for `cpu-local` renders CPU workers (the embedded model, KV over TCP); any GPU system
renders GPU workers with RDMA. Plans for `--network tcp` are refused: the GPU components
assume RDMA.

Reads a serve.deploy.plan.Plan; errors are serve.deploy.plan.DeployError, one line at the
CLI. It may not import bench (the planner is a client of serve, never the reverse).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from serve.deploy.plan import DeployError, Plan, PlannedLayout, Pool, decode_plan, plan_file

EMBEDDED = "smollm2-135m-instruct"
DEFAULT_IMAGES = {"gpu": "ghcr.io/pdserve/pdserve-gpu:0.1.0", "cpu": "ghcr.io/pdserve/pdserve-cpu:0.1.0"}
# Autoscaling aims below the plan's targets, so pools grow before the targets are missed.
HPA_TARGET_FRACTION = 0.9
MANIFESTS_PACKAGE = "serve.deploy.manifests"


def default_manifests() -> Traversable:
    """The manifests installed with pdserve (package data of serve.deploy.manifests)."""
    try:
        return files(MANIFESTS_PACKAGE)
    except ModuleNotFoundError:
        raise DeployError(f"pdserve's Kubernetes manifests ({MANIFESTS_PACKAGE}) are not installed: "
                          "pass --manifests DIR (the repository's k8s/)") from None


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add `k8s` to the `pdserve` subcommands; its `run` default runs it."""
    k = sub.add_parser("k8s", help="Kubernetes: render an overlay for a planned layout")
    k.set_defaults(run=run)
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
    r.add_argument("--manifests", default=None,
                   help=f"pdserve's k8s/ directory (default: the manifests installed with pdserve, {MANIFESTS_PACKAGE})")


@dataclass(frozen=True)
class RenderOptions:
    """What `pdserve k8s render` takes besides the plan and the output directory."""

    layout: str = "winner"  # "winner" | "agg" | "disagg"
    model: str | None = None
    image: str | None = None
    storage_class: str | None = None
    model_cache_size: str | None = None
    namespace: str | None = None
    trust_remote_code: bool = False
    manifests: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RenderOptions":
        return cls(layout=args.layout, model=args.model, image=args.image, storage_class=args.storage_class,
                   model_cache_size=args.model_cache_size, namespace=args.namespace,
                   trust_remote_code=args.trust_remote_code, manifests=args.manifests)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "k8s_command", None) != "render":
        print("pdserve k8s: error: usage: pdserve k8s render --plan PLAN --out DIR", file=sys.stderr)
        return 2
    try:
        out = render(args.plan, args.out, RenderOptions.from_args(args))
    except DeployError as e:
        print(f"pdserve k8s render: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}/kustomization.yaml: kubectl apply -k {out}")
    return 0


# -- what to render -----------------------------------------------------------------------
def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def _model(plan: Plan, override: str | None, cpu: bool) -> str:
    if override:
        if override != EMBEDDED and not _is_hub_id(override):
            raise DeployError(f"--model {override!r}: expected a hub id (organisation/name) or {EMBEDDED}")
        return override
    given, known = plan.inputs.model, plan.model.name
    if cpu:
        if EMBEDDED in (given.lower(), known.lower()) or known == "HuggingFaceTB/SmolLM2-135M-Instruct":
            return EMBEDDED
    for name in (given, known):
        if name == EMBEDDED or _is_hub_id(name):
            return name
    raise DeployError(f"the plan's model {given!r} is not a hub id: pass --model ORG/NAME (what the model-cache "
                      "Job downloads)")


def _needs_remote_code(plan: Plan) -> bool:
    cfg = Path(plan.inputs.model).expanduser() / "config.json"
    try:
        return "auto_map" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def _best(plan: Plan, layout: str) -> PlannedLayout:
    mode = plan.winner if layout == "winner" else layout
    if mode not in ("agg", "disagg"):
        raise DeployError("the plan has no winner (no layout met the targets): nothing to render")
    best = plan.best(mode)
    if best is None:
        raise DeployError(f"the plan has no {mode} layout that meets its targets")
    for pool in best.pools().values():
        if min(pool.replicas, pool.tp, pool.max_num_seqs) < 1:
            raise DeployError(f"the plan's {mode} layout {best.layout!r} has an empty pool")
    return best


def _load_test(plan: Plan, best: PlannedLayout, model: str) -> str:
    """The plan's load test, at this layout's concurrency (x 40 requests), through the
    frontend Service (`kubectl port-forward svc/pdserve-frontend 8000`)."""
    i = plan.inputs
    c = max(1, round(best.concurrency))
    return shlex.join(["pdserve", "bench", "profile", "-m", model, "--endpoint-type", "chat", "-u",
                       "http://localhost:8000", "--isl", str(i.isl), "--isl-stddev", "0", "--osl",
                       str(i.osl), "--osl-stddev", "0", "--num-requests", str(c * 40), "--concurrency", str(c),
                       "--streaming", "--extra-inputs", "ignore_eos:true", "--num-warmup-requests", str(c),
                       "--ui-type", "simple", "--goodput",
                       f"time_to_first_token:{i.ttft_ms:g} inter_token_latency:{i.tpot_ms:g}"])


# -- writing ------------------------------------------------------------------------------
def _worker_patch(role: str, pool: Pool, kv_dtype: str, cpu: bool, args_list: list[str] | None) -> dict:
    env = [{"name": "PDSERVE_TENSOR_PARALLEL_SIZE", "value": str(pool.tp)},
           {"name": "PDSERVE_MAX_NUM_SEQS", "value": str(pool.max_num_seqs)},
           {"name": "PDSERVE_KV_CACHE_DTYPE", "value": kv_dtype}]
    container: dict[str, Any] = {"name": "worker", "env": env}
    if not cpu:
        gpus = str(pool.tp)
        container["resources"] = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    if args_list is not None:
        container["args"] = args_list
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"pdserve-{role}"},
            "spec": {"template": {"spec": {"containers": [container]}}}}


def _hpa_patch(role: str, pool: Pool, plan: Plan, src: dict) -> dict:
    metrics = []
    for m in src["spec"]["metrics"]:
        m = json.loads(json.dumps(m))
        name = m.get("object", {}).get("metric", {}).get("name")
        if name == "pdserve_frontend_ttft_p90_seconds":
            m["object"]["target"]["value"] = f"{round(plan.targets.ttft_ms * HPA_TARGET_FRACTION)}m"
        elif name == "pdserve_frontend_itl_p90_seconds":
            m["object"]["target"]["value"] = f"{round(plan.targets.tpot_ms * HPA_TARGET_FRACTION * 1000)}u"
        metrics.append(m)
    n = pool.replicas
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": f"pdserve-{role}"},
            "spec": {"minReplicas": n, "maxReplicas": max(2 * n, n + 1), "metrics": metrics}}


def _load_yaml_docs(res: Traversable) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(res.read_text(encoding="utf-8")) if d]


def _dump(path: Path, docs: list[dict], header: str = "") -> None:
    import yaml

    path.write_text(header + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))


def _copy_tree(src: Traversable, dest: Path) -> None:
    """Copy a manifests folder (a directory, or package data that may live in a wheel or zip)."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name == "__pycache__" or entry.name.endswith((".py", ".pyc")):
            continue
        if entry.is_dir():
            _copy_tree(entry, dest / entry.name)
        else:
            (dest / entry.name).write_bytes(entry.read_bytes())


def _at(root: Traversable, *parts: str) -> Traversable:
    # One part per joinpath: Python 3.11's MultiplexedPath (a package without __init__.py,
    # as the manifests are) takes only one.
    for part in parts:
        root = root.joinpath(part)
    return root


def _manifests(given: str | None) -> Traversable:
    src: Traversable = Path(given) if given else default_manifests()
    if not _at(src, "base", "kustomization.yaml").is_file() or not _at(src, "components").is_dir():
        where = given or MANIFESTS_PACKAGE
        raise DeployError(f"{where} is not pdserve's k8s/ directory (no base/kustomization.yaml): pass --manifests DIR")
    return src


def render(plan_path: str | Path, out_dir: str | Path, opts: RenderOptions = RenderOptions()) -> Path:
    """Write the overlay for the plan in `plan_path` (plan.json or its directory) to `out_dir`;
    returns `out_dir`. DeployError for a plan that cannot be rendered as asked."""
    src = _manifests(opts.manifests)
    f = plan_file(plan_path)
    try:
        data = f.read_bytes()
    except OSError as e:
        raise DeployError(f"{f}: {e.strerror or e}") from None
    plan = decode_plan(data, str(f))
    inputs = plan.inputs
    if inputs.network != "rdma":
        raise DeployError(f"the plan is for --network {inputs.network}: only RDMA plans render (the GPU "
                          "components request RDMA devices)")
    cpu = inputs.system == "cpu-local" or plan.system.name == "cpu-local"
    best = _best(plan, opts.layout)
    pools = best.pools()
    model = _model(plan, opts.model, cpu)
    remote_code = opts.trust_remote_code or _needs_remote_code(plan)
    # vLLM's names: the planner's bf16 is the model's own dtype (auto), fp8 is fp8.
    kv_dtype = "auto" if cpu or plan.kv_cache_dtype == "bf16" else plan.kv_cache_dtype
    mode = best.mode

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vendored = out / "pdserve"
    if vendored.exists():
        shutil.rmtree(vendored)
    _copy_tree(_at(src, "base"), vendored / "base")
    _copy_tree(_at(src, "components"), vendored / "components")

    comp = "disagg-workers" if mode == "disagg" else "agg-workers"
    components = [f"pdserve/components/{comp}", f"pdserve/components/{'cpu' if cpu else 'gpu'}"]
    patches: list[dict] = []
    for role, pool in pools.items():
        args_list = None
        if remote_code:
            deploy = next(d for d in _load_yaml_docs(_at(src, "components", comp, f"{role}.yaml"))
                          if d["kind"] == "Deployment")
            args_list = [*deploy["spec"]["template"]["spec"]["containers"][0]["args"], "--trust-remote-code"]
        patches.append(_worker_patch(role, pool, kv_dtype, cpu, args_list))
    if not cpu:
        hpa_dir = f"autoscaling-{mode}"
        components.append(f"pdserve/components/{hpa_dir}")
        hpas = {d["metadata"]["name"]: d for d in _load_yaml_docs(_at(src, "components", hpa_dir, "hpa.yaml"))}
        patches += [_hpa_patch(role, pool, plan, hpas[f"pdserve-{role}"]) for role, pool in pools.items()]
    patches.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pdserve-config"},
                    "data": {"PDSERVE_MODEL": model}})
    # The base's replacements have run by the time overlay patches apply: patch the PVC itself.
    pvc: dict[str, Any] = {}
    if opts.storage_class:
        pvc["storageClassName"] = opts.storage_class
    if opts.model_cache_size:
        pvc["resources"] = {"requests": {"storage": opts.model_cache_size}}
    if pvc:
        patches.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": "pdserve-model-cache"}, "spec": pvc})
    header = (f"# Rendered by `pdserve k8s render` from {plan_path} ({plan.schema}): {best.layout}\n"
              f"# predicted {best.tokens_per_s_per_gpu:.1f} tokens/s/GPU, TTFT {best.ttft_ms:.0f} ms, "
              f"TPOT {best.tpot_ms:.2f} ms at concurrency {best.concurrency:.0f}\n"
              f"# check it: {_load_test(plan, best, model)}\n"
              + ("# --trust-remote-code: the model's config.json needs custom code (auto_map) or it was asked for\n"
                 if remote_code else "# no --trust-remote-code: the model needs no custom code\n"))
    _dump(out / "patches.yaml", patches, header)
    image = opts.image or DEFAULT_IMAGES["cpu" if cpu else "gpu"]
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        **({"namespace": opts.namespace} if opts.namespace else {}),
        "resources": ["pdserve/base"],
        "components": components,
        "images": [{"name": "pdserve", "newName": name, **({"newTag": tag} if tag else {})}],
        "replicas": [{"name": "pdserve-frontend", "count": 1}]
                    + [{"name": f"pdserve-{role}", "count": pool.replicas} for role, pool in pools.items()],
        "patches": [{"path": "patches.yaml"}],
    }
    _dump(out / "kustomization.yaml", [kustomization], header)
    (out / "plan.json").write_bytes(data)  # the plan as it was given, byte for byte
    return out
