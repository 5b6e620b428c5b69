"""`pdserve plan --simulate`: the closed-form search's best layouts run through the cluster
simulator (bench/sim, the frontend's real router, the same planner step model), ranked by
simulated goodput per GPU.

For each of the top `--simulate-top` layouts of each mode (default 5), one offline simulation
of the stated workload: `bench profile`'s workload flags from `--sim-workload` (length spread,
shared prefixes, sessions, a request rate and arrival pattern) or a Mooncake trace from
`--trace` (replayed on its timestamps); without either, fixed ISL/OSL arriving as a Poisson
process at the layout's planned request rate (so a layout whose closed form overrates it
queues, and its goodput shows it), 3-20x its planned concurrency in requests (about 400k
output tokens). Goodput, as AIPerf defines it,
counts the requests meeting both targets (TTFT and inter-token latency) per second; goodput
per GPU is that times OSL over the layout's GPUs. Every simulated figure is labelled
simulated; the closed-form ones stand beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.plan.errors import PlanError
from serve.deploy.plan import Plan, PlannedLayout

TOKEN_BUDGET = 400_000  # output tokens per simulation when the request count is automatic


def layout_argv(x: PlannedLayout) -> list[str]:
    if x.mode == "agg":
        return ["--mode", "agg", "--workers", str(x.replicas), "--tp", str(x.tp), "--max-num-seqs", str(x.batch)]
    return ["--mode", "disagg", "--prefill", str(x.prefill_workers), "--decode", str(x.decode_workers),
            "--tp", str(x.decode_tp), "--max-num-seqs", str(x.decode_batch)]


def workload_argv(doc: Plan, x: PlannedLayout, requests: int | None, workload: str | None,
                  trace: str | None) -> list[str]:
    i = doc.inputs
    out = ["--isl", str(i.isl), "--osl", str(i.osl), "--extra-inputs", "ignore_eos:true", "--streaming",
           "--goodput", f"time_to_first_token:{i.ttft_ms:g} inter_token_latency:{i.tpot_ms:g}"]
    conc = max(1, round(x.concurrency))
    if trace:
        return out + ["--input-file", trace, "--custom-dataset-type", "mooncake_trace", "--fixed-schedule"]
    extra = shlex.split(workload) if workload else []
    n = requests or max(3 * conc, min(20 * conc, TOKEN_BUDGET // max(i.osl, 1)))
    if not any(a in extra for a in ("--request-rate", "--concurrency")):
        out += ["--request-rate", f"{x.requests_per_s:.6g}", "--arrival", "poisson"]
    if not any(a in extra for a in ("--num-requests", "--request-count", "--benchmark-duration")):
        out += ["--num-requests", str(n)]
    return out + extra


def _spec(argv: list[str], out: Path):  # -> (args, SimSpec)
    from bench.sim.cli import add_command
    from bench.sim.options import spec_from_args

    sub = argparse.ArgumentParser(prog="pdserve").add_subparsers()
    add_command(sub)
    args = sub.choices["sim"].parse_args([*argv, "--artifact-dir", str(out), "--ui-type", "none"])
    return args, spec_from_args(args)


def simulate_layout(doc: Plan, x: PlannedLayout, out: Path, requests: int | None = None,
                    workload: str | None = None, trace: str | None = None) -> dict[str, Any]:
    """One layout through the offline simulator: its simulated figures."""
    from bench.loadgen.config import config_from_args
    from bench.sim.errors import SimError
    from bench.sim.run import simulate, write

    i = doc.inputs
    common = ["--sim-system", i.system, "--sim-model", i.model, "--network", i.network,
              "--kv-cache-dtype", doc.kv_cache_dtype, "--max-model-len", str(max(4096, 2 * (i.isl + i.osl))),
              "--max-concurrent-requests", "100000", "--max-queued-requests", "100000"]
    argv = [*common, *layout_argv(x), *workload_argv(doc, x, requests, workload, trace)]
    try:
        args, spec = _spec(argv, out)
        if x.mode == "disagg":  # prefill workers: their own TP and prompts per step
            _, pspec = _spec([*common, "--tp", str(x.prefill_tp), "--max-num-seqs", str(x.prefill_batch),
                              *workload_argv(doc, x, requests, workload, trace)], out / "prefill-engine")
            spec.per_role["prefill"] = (pspec.engine, pspec.step_model)
        cfg = config_from_args(args, "pdserve sim " + shlex.join(argv))
    except SimError as e:
        raise PlanError(f"--simulate {x.layout}: {e}") from None
    t0 = time.monotonic()
    result, stats = simulate(cfg, spec, progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        write(result, stats)
    m = json.loads((out / "profile_export_aiperf.json").read_text())

    def p(metric: str, stat: str) -> float | None:
        return (m.get(metric) or {}).get(stat)
    good = p("goodput", "avg") or 0.0
    ok = sum(1 for r in result.records if r.ok)
    return {"simulated": True, "requests": len(result.records), "ok": ok, "wall_s": round(time.monotonic() - t0, 2),
            "ttft_p50_ms": p("time_to_first_token", "p50"), "ttft_p90_ms": p("time_to_first_token", "p90"),
            "itl_p50_ms": p("inter_token_latency", "p50"), "itl_p90_ms": p("inter_token_latency", "p90"),
            "output_tps": p("output_token_throughput", "avg"), "goodput_rps": good,
            # over every GPU of the budget, as the closed form ranks (bench/plan/search.py)
            "goodput_tokens_per_s_per_gpu": good * i.osl / max(i.total_gpus, x.gpus, 1),
            "artifact_dir": str(out)}


def simulate_plan(doc: Plan, top: int = 5, requests: int | None = None, workload: str | None = None,
                  trace: str | None = None, out_dir: str | None = None) -> list[dict[str, Any]]:
    """The top layouts of each mode, simulated, best simulated goodput per GPU first."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-plan-sim-") as tmp:
        base = Path(out_dir) if out_dir else Path(tmp)
        for mode, layouts in (("agg", doc.agg_top[:top]), ("disagg", doc.disagg_top[:top])):
            for n, x in enumerate(layouts, 1):
                sim = simulate_layout(doc, x, base / f"{mode}-{n}", requests, workload, trace)
                rows.append({"mode": mode, "closed_form_rank": n, "layout": x.layout, "gpus": x.gpus,
                             "closed_form": {"ttft_ms": x.ttft_ms, "tpot_ms": x.tpot_ms,
                                             "tokens_per_s_per_gpu": x.tokens_per_s_per_gpu,
                                             "concurrency": x.concurrency},
                             "sim": sim})
    rows.sort(key=lambda r: -r["sim"]["goodput_tokens_per_s_per_gpu"])
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("#", "mode", "closed-form tok/s/GPU", "SIMULATED goodput tok/s/GPU", "TTFT p90 ms (cf/sim)",
            "ITL p50 ms (cf TPOT/sim)", "layout")
    lines = ["ranked by SIMULATED goodput per GPU (requests meeting both targets x OSL / the budget's GPUs):",
             " | ".join(head)]
    for n, r in enumerate(rows, 1):
        cf, s = r["closed_form"], r["sim"]
        lines.append(" | ".join((str(n), r["mode"], f"{cf['tokens_per_s_per_gpu']:,.1f}",
                                 f"{s['goodput_tokens_per_s_per_gpu']:,.1f}",
                                 f"{cf['ttft_ms']:,.1f} / {_f(s['ttft_p90_ms'])}",
                                 f"{cf['tpot_ms']:,.2f} / {_f(s['itl_p50_ms'])}", r["layout"])))
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"
