"""Calibration and checking against measurements.

`pdserve bench calibrate ARTIFACT_DIR...` fits a system profile to `bench profile` runs
against an aggregated deployment (one engine per "GPU"; on this machine an engine pinned to
a core). It reads each run's ISL, OSL and concurrency from its input_config and its TTFT and
ITL p50, and finds the effective compute rate F, the effective memory bandwidth BW and (with
two or more runs) the per-step overhead O that make perf.predict_agg reproduce them, in the
least-squares sense on log(predicted / measured). Efficiency factors are set to 1: F and BW
are already effective rates. The profile is written to `cpu-local.json` in the pdserve cache
(`pdserve plan --system cpu-local` reads it) or to `--out`.

`pdserve bench compare-plan PLAN ARTIFACT_DIR` puts a run's measured TTFT, TPOT (ITL) and
throughput next to the plan's prediction for the winning layout, re-predicted at the run's
own concurrency when it differs from the plan's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.plan.errors import PlanError
from bench.plan.perf import Engine, predict_agg, predict_agg_waves
from bench.plan.specs import SystemSpec, cpu_local_path, load_model

ONES = {"gemm": 1.0, "prefill_attention": 1.0, "hbm": 1.0, "decode_attention": 1.0, "nvlink": 1.0, "network": 1.0}


def _measured(path: Path) -> dict[str, Any]:
    from bench.loadgen.export import load_summary

    doc = load_summary(path)
    try:
        ic = doc["input_config"]
        phase = [p for p in ic["phases"] if p.get("kind") == "profiling"][0]
        prompts = ic["datasets"][0]["prompts"]
        model = ic["models"]["items"][0]["name"]
    except (KeyError, IndexError, TypeError):
        raise PlanError(f"{path}: not a `pdserve bench profile` summary (no input_config)") from None
    if not ic["endpoint"].get("streaming"):
        raise PlanError(f"{path}: the run was not streaming: TTFT and ITL are needed")
    try:
        osl_cfg = prompts.get("osl") or {}
        fixed = (phase.get("type") == "concurrency" and not prompts["isl"].get("stddev")
                 and not osl_cfg.get("stddev") and bool(ic["endpoint"].get("extra", {}).get("ignore_eos")))
        return {"path": str(path), "model": model, "isl": doc["input_sequence_length"]["avg"], "waves": fixed,
                "osl": doc["output_sequence_length"]["avg"], "concurrency": phase.get("concurrency") or 1,
                "ttft_ms": doc["time_to_first_token"]["p50"], "tpot_ms": doc["inter_token_latency"]["p50"],
                "tokens_per_s": doc["output_token_throughput"]["avg"], "isl_requested": prompts["isl"]["mean"]}
    except KeyError as e:
        raise PlanError(f"{path}: the run has no {e.args[0]} (no successful streaming requests?)") from None


def _system(F: float, BW: float, O: float, memory_gib: float) -> SystemSpec:
    return SystemSpec(name="cpu-local", peak_tflops={"bf16": F / 1e12, "fp8": F / 1e12}, hbm_gbps=BW / 1e9,
                      memory_gib=memory_gib, nvlink_gbps=1.0, network_gbps={"rdma": 5.0, "tcp": 1.0},
                      efficiency=dict(ONES), step_overhead_ms=O * 1e3, kv_memory_fraction=1.0,
                      max_num_batched_tokens=8192, gpus_per_node=1,
                      activation_reserve_gib=0.0,  # no TP across CPU engines
                      chunked_prefill=False)  # pdserve's CPU workers run without it


def _predict(s: SystemSpec, run: dict[str, Any], model) -> tuple[float, float]:
    e = Engine(model, s, 1, kv_dtype="bf16", weight_dtype="bf16")
    fn = predict_agg_waves if run.get("waves") else predict_agg
    p = fn(e, int(run["concurrency"]), 1, round(run["isl"]), max(2, round(run["osl"])))
    return p.ttft_ms, p.tpot_ms


def _loss(s: SystemSpec, runs: list[dict[str, Any]], model) -> float:
    err = 0.0
    for r in runs:
        ttft, tpot = _predict(s, r, model)
        err += math.log(ttft / r["ttft_ms"]) ** 2 + math.log(tpot / r["tpot_ms"]) ** 2
    return err


def fit(runs: list[dict[str, Any]], memory_gib: float) -> tuple[SystemSpec, float]:
    """Coarse-to-fine search over log F, log BW (and O when there are 2+ runs)."""
    model = load_model(runs[0]["model"])
    fit_o = len(runs) >= 2
    lo = {"F": math.log(1e9), "BW": math.log(1e8), "O": 0.0}
    hi = {"F": math.log(1e15), "BW": math.log(1e13), "O": 0.2 if fit_o else 0.0}
    best = (float("inf"), 0.0, 0.0, 0.0)
    for _ in range(6):
        n = 24
        steps = {k: [(lo[k] + (hi[k] - lo[k]) * i / (n - 1)) for i in range(n)] for k in ("F", "BW")}
        os_ = [lo["O"] + (hi["O"] - lo["O"]) * i / 9 for i in range(10)] if fit_o else [0.0]
        for f in steps["F"]:
            for bw in steps["BW"]:
                for o in os_:
                    s = _system(math.exp(f), math.exp(bw), o, memory_gib)
                    loss = _loss(s, runs, model)
                    if loss < best[0]:
                        best = (loss, f, bw, o)
        _, f, bw, o = best
        span = {k: (hi[k] - lo[k]) / 6 for k in hi}
        lo = {"F": f - span["F"], "BW": bw - span["BW"], "O": max(0.0, o - span["O"])}
        hi = {"F": f + span["F"], "BW": bw + span["BW"], "O": o + span["O"] if fit_o else 0.0}
    loss, f, bw, o = best
    return _system(math.exp(f), math.exp(bw), o, memory_gib), loss


def calibrate(paths: list[str], out: str | None, memory_gib: float) -> dict[str, Any]:
    if not paths:
        raise PlanError("give one or more artifact dirs of `pdserve bench profile` runs, or --steps")
    runs = [_measured(Path(p)) for p in paths]
    models = {r["model"] for r in runs}
    if len(models) > 1:
        raise PlanError(f"runs of different models: {sorted(models)}")
    system, loss = fit(runs, memory_gib)
    model = load_model(runs[0]["model"])
    doc = system.to_dict()
    doc["calibration"] = {"runs": runs, "loss": loss, "model": model.name, "fitted": ["F", "BW"] + (["O"] if len(runs) > 1 else []),
                          "predicted": [dict(zip(("ttft_ms", "tpot_ms"), _predict(system, r, model))) for r in runs]}
    doc["source"] = "fitted by `pdserve bench calibrate` to " + ", ".join(r["path"] for r in runs)
    target = Path(out) if out else cpu_local_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2) + "\n")
    for r, p in zip(runs, doc["calibration"]["predicted"]):
        print(f"{r['path']}: concurrency {r['concurrency']}: TTFT p50 {r['ttft_ms']:.1f} ms (fit {p['ttft_ms']:.1f}), "
              f"ITL p50 {r['tpot_ms']:.2f} ms (fit {p['tpot_ms']:.2f})")
    print(f"cpu-local: F {system.peak_tflops['bf16'] * 1e3:.2f} GFLOP/s, BW {system.hbm_gbps:.2f} GB/s, "
          f"step overhead {system.step_overhead_ms:.2f} ms -> {target}")
    return doc


def compare_plan(plan_path: str, artifact: str) -> dict[str, Any]:
    from bench.plan.report import read_plan
    from bench.plan.specs import ModelShape

    doc = read_plan(Path(plan_path))
    run = _measured(Path(artifact))
    best = doc.best()
    if best is None:
        raise PlanError(f"{plan_path}: the plan has no winning layout")
    pred = {k: getattr(best, k) for k in ("ttft_ms", "tpot_ms", "tokens_per_s", "tokens_per_s_per_gpu", "concurrency")}
    if best.mode == "agg" and (run["waves"] or round(run["concurrency"]) != round(best.concurrency)):
        system = SystemSpec.from_plan(doc.system)  # the plan is self-contained: no re-read of profiles
        model = ModelShape.from_plan(doc.model)
        e = Engine(model, system, best.tp, doc.kv_cache_dtype, doc.inputs.weight_dtype)
        per = max(1, round(run["concurrency"] / best.replicas))
        fn = predict_agg_waves if run["waves"] else predict_agg
        p = fn(e, per, best.replicas, round(run["isl"]), max(2, round(run["osl"])))
        pred.update({k: getattr(p, k) for k in pred})
    rows = [("TTFT p50 (ms)", pred["ttft_ms"], run["ttft_ms"]), ("TPOT/ITL p50 (ms)", pred["tpot_ms"], run["tpot_ms"]),
            ("output tokens/s", pred["tokens_per_s"], run["tokens_per_s"]),
            ("output tokens/s/GPU", pred["tokens_per_s_per_gpu"], run["tokens_per_s"] / best.gpus)]
    how = "closed loop of fixed-length requests: synchronized" if run["waves"] else "steady state"
    print(f"plan {plan_path} ({best.layout}, predicted at concurrency {pred['concurrency']:.0f}, {how}) "
          f"vs run {artifact} (concurrency {run['concurrency']})")
    print(f"{'metric':22s} {'predicted':>12s} {'measured':>12s} {'measured/predicted':>19s}")
    out = []
    for name, p, m in rows:
        ratio = m / p if p else None
        out.append({"metric": name, "predicted": p, "measured": m, "ratio": ratio})
        print(f"{name:22s} {p:12.2f} {m:12.2f} {ratio:19.3f}")
    return {"layout": best.layout, "rows": out}
