"""The planner's reference grid: AIConfigurator's best aggregated and disaggregated layouts on
a fixed set of cases, and pdserve's planner compared with them.

  python -m bench.plan.grid aic --aic .venv-aic/bin/aiconfigurator   # (re)make the grid
  python -m bench.plan.grid compare                                  # pdserve plan vs the grid

`aic` runs `aiconfigurator cli default` once per case (its own environment: `make
aiconfigurator`) and writes bench/plan/data/aic_grid.json: per case, AIConfigurator's best
layout of each mode (tokens/s/GPU, TTFT, TPOT, the layout) and the winner, with the exact
command and version. `compare` runs pdserve's search on the same cases (the KV and GEMM
dtypes AIConfigurator reported) and prints, per case and in total, whether the winners agree
and the ratio of best tokens/s/GPU per mode, the fit part and the held-out part apart. The
figure is agreement with AIConfigurator, not accuracy.

The cases are a design, not a sample: every fit model on every fit system at four workloads
(ISL/OSL from chats to 16k-token documents), alternating tight and loose targets, with GPU
budgets cycling through what the model fits; then a model and a system the fit never sees.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.plan.errors import PlanError

GRID_FORMAT = "pdserve.aic-grid/1"
GRID_FILE = "aic_grid.json"  # in bench.plan.data
AIC_VERSION = "0.12.0"  # the newest release here; its vLLM perf database (0.24.0) covers h100, h200, b200, l40s
PERF_DB = "0.24.0"

# Models: pdserve's name -> AIConfigurator's model path (a Hugging Face id whose config it ships,
# or None: a config.json written from pdserve's own shape).
MODELS = {
    "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1": None,
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3.1-8B",
    "Qwen/Qwen3-32B": "Qwen/Qwen3-32B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B",
}
FIT_MODELS = ("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-32B")
FIT_SYSTEMS = ("h200_sxm", "h100_sxm")
HELD_OUT_MODEL = "meta-llama/Llama-3.1-70B-Instruct"
HELD_OUT_SYSTEM = "b200_sxm"
SYSTEMS = (*FIT_SYSTEMS, HELD_OUT_SYSTEM)
WORKLOADS = ((1000, 1000), (4000, 500), (8000, 200), (16000, 100))  # (ISL, OSL)
TARGETS = {"tight": (300.0, 10.0), "loose": (2000.0, 50.0)}  # (TTFT ms, TPOT ms)
# The guide's own case for disaggregation: large models, long prompts and long answers, a
# TTFT that allows the prompt and a TPOT that a prefill-laden aggregated step strains.
LONG_WORKLOADS = ((8000, 1000), (16000, 500))
LONG_TARGET = ("long", (2000.0, 20.0))
GPUS = {"nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1": (4, 8), "meta-llama/Llama-3.1-8B-Instruct": (8, 16),
        "Qwen/Qwen3-32B": (8, 16, 32), "meta-llama/Llama-3.1-70B-Instruct": (16, 32)}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    system: str
    total_gpus: int
    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float
    part: str  # "fit" | "held-out" | "guide"


def cases() -> list[Case]:
    """The grid's cases, in a fixed order (see the module docstring)."""
    out = [Case("guide", "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "h200_sxm", 4, 4000, 500, 600.0, 16.67, "guide")]
    def add(model: str, system: str, w: int, part: str, long: bool = False) -> None:
        # Targets alternate with the workload, the system and the model; GPU budgets cycle
        # with the workload and the model: each workload meets both targets on each model.
        mi, si = list(MODELS).index(model), SYSTEMS.index(system)
        tname = ("tight", "loose")[(w + si + mi) % 2]
        gpus = GPUS[model][(w + mi + si // 2) % len(GPUS[model])]
        isl, osl = (LONG_WORKLOADS if long else WORKLOADS)[w]
        ttft, tpot = TARGETS[tname]
        if long:
            tname, (ttft, tpot) = LONG_TARGET
        short = model.split("/")[-1].split("-Instruct")[0]
        out.append(Case(f"{short}-{system}-{gpus}g-{isl}-{osl}-{tname}", model, system, gpus, isl, osl, ttft, tpot,
                        part))

    for model in FIT_MODELS:
        for system in FIT_SYSTEMS:
            for w in range(len(WORKLOADS)):
                add(model, system, w, "fit")
    for system in FIT_SYSTEMS:
        for w in range(len(WORKLOADS)):
            add(HELD_OUT_MODEL, system, w, "held-out")
    for model in MODELS:
        for w in range(len(WORKLOADS)):
            add(model, HELD_OUT_SYSTEM, w, "held-out")
    for model in FIT_MODELS[1:]:  # long prompts and answers: models of 8B and up
        for system in FIT_SYSTEMS:
            for w in range(len(LONG_WORKLOADS)):
                add(model, system, w, "fit", long=True)
    for system in FIT_SYSTEMS:
        for w in range(len(LONG_WORKLOADS)):
            add(HELD_OUT_MODEL, system, w, "held-out", long=True)
    for model in FIT_MODELS[1:] + (HELD_OUT_MODEL,):
        for w in range(len(LONG_WORKLOADS) if "8B" not in model else 1):
            add(model, HELD_OUT_SYSTEM, w, "held-out", long=True)
    return out


# -- AIConfigurator ------------------------------------------------------------------------

def _model_path(model: str, tmp: Path) -> str:
    if MODELS[model]:
        return str(MODELS[model])
    from bench.plan.specs import load_model

    m = load_model(model)
    d = tmp / m.name.split("/")[-1]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim, "intermediate_size": m.intermediate, "vocab_size": m.vocab,
        "tie_word_embeddings": m.tied_embeddings, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0}))
    return str(d)


def aic_command(aic: str, c: Case, model_path: str, save_dir: str) -> list[str]:
    return [aic, "cli", "default", "--model-path", model_path, "--system", c.system, "--total-gpus",
            str(c.total_gpus), "--isl", str(c.isl), "--osl", str(c.osl), "--ttft", str(c.ttft_ms), "--tpot",
            str(c.tpot_ms), "--backend", "vllm", "--perf-db-version", PERF_DB, "--top-n", "1", "--no-color",
            "--save-dir", save_dir]


def _f(row: dict[str, str], key: str) -> float:
    return float(row[key])


def _best(csv_path: Path, mode: str) -> dict[str, Any] | None:
    """Row 1 of AIConfigurator's best_config_topn.csv for a mode, in pdserve's words."""
    if not csv_path.is_file():
        return None
    rows = list(csv.DictReader(csv_path.open()))
    if not rows:
        return None
    r = rows[0]
    out: dict[str, Any] = {"tokens_per_s_per_gpu": _f(r, "tokens/s/gpu"), "ttft_ms": _f(r, "ttft"),
                           "tpot_ms": _f(r, "tpot"), "tokens_per_s_per_user": _f(r, "tokens/s/user"),
                           "requests_per_s": _f(r, "seq/s"), "concurrency": _f(r, "concurrency"),
                           "gpus": int(_f(r, "num_total_gpus"))}
    if mode == "agg":  # `gpus`: one replica's
        out.update(tp=int(_f(r, "tp")), batch=int(_f(r, "bs")), kv_dtype=r["kvcache"], gemm_dtype=r["gemm"])
    else:  # `gpus`: one P+D unit's
        out.update(prefill_tp=int(_f(r, "(p)tp")), prefill_workers=int(_f(r, "(p)workers")),
                   prefill_batch=int(_f(r, "(p)bs")), decode_tp=int(_f(r, "(d)tp")),
                   decode_workers=int(_f(r, "(d)workers")), decode_batch=int(_f(r, "(d)bs")),
                   prefill_rps_per_worker=_f(r, "(p)seq/s/worker"), decode_rps_per_worker=_f(r, "(d)seq/s/worker"),
                   kv_dtype=r["(d)kvcache"], gemm_dtype=r["(d)gemm"])
    out["row"] = {k: v for k, v in r.items() if k and not k.startswith("_")}  # every column, as written
    return out


def settle(row: dict[str, Any]) -> dict[str, Any]:
    """Mark each mode's best as meeting the case's targets or not (AIConfigurator 0.12.0 has
    reported a best disaggregated row over the TPOT target where none met it), and name the
    winner from those that meet them."""
    aic = row["aic"]
    for mode in ("agg", "disagg"):
        b = aic[mode]
        if b is not None:
            b["meets"] = b["ttft_ms"] <= row["ttft_ms"] and b["tpot_ms"] <= row["tpot_ms"]
    ok = {m: aic[m] if aic[m] and aic[m]["meets"] else None for m in ("agg", "disagg")}
    aic["winner"] = _winner(ok["agg"], ok["disagg"])
    return row


def _winner(agg: dict | None, dis: dict | None) -> str | None:
    if agg and dis:
        return "agg" if agg["tokens_per_s_per_gpu"] >= dis["tokens_per_s_per_gpu"] else "disagg"
    return "agg" if agg else ("disagg" if dis else None)


def _doc(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": GRID_FORMAT, "aiconfigurator": AIC_VERSION, "backend": "vllm", "perf_db_version": PERF_DB,
            "made_by": "python -m bench.plan.grid aic --aic PATH/TO/aiconfigurator (make aiconfigurator installs it)",
            "fit": {"models": list(FIT_MODELS), "systems": list(FIT_SYSTEMS)},
            "held_out": {"model": HELD_OUT_MODEL, "system": HELD_OUT_SYSTEM}, "cases": rows}


def run_aic(aic: str, out: Path) -> dict[str, Any]:
    """Run every case not already in `out` with the same command (a rerun resumes), writing
    the grid after each."""
    done: dict[str, dict[str, Any]] = {}
    if out.is_file():
        done = {r["command"]: r for r in json.loads(out.read_text()).get("cases", [])}
    rows = []
    all_cases = cases()
    with tempfile.TemporaryDirectory(prefix="pdserve-aic-") as tmp:
        t = Path(tmp)
        for i, c in enumerate(all_cases):
            save = t / f"case{i}"
            mp = MODELS[c.model] or f"<config.json of {c.model} from bench/plan/data/models.json>"
            shown = " ".join(["aiconfigurator", *aic_command(aic, c, mp, "DIR")[1:-2]])
            if shown in done:
                rows.append(done[shown])
                continue
            cmd = aic_command(aic, c, _model_path(c.model, t / "models"), str(save))
            t0 = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            found = {m: next(iter(save.rglob(f"{m}/best_config_topn.csv")), None) for m in ("agg", "disagg")}
            agg = _best(found["agg"], "agg") if found["agg"] else None
            dis = _best(found["disagg"], "disagg") if found["disagg"] else None
            if proc.returncode != 0 and (agg or dis or "No successful experiment" not in proc.stderr + proc.stdout):
                raise PlanError(f"case {c.name}: aiconfigurator exited {proc.returncode}: {proc.stderr[-500:]}")
            rows.append(settle({**asdict(c), "aic": {"agg": agg, "disagg": dis}, "command": shown}))
            print(f"[{i + 1}/{len(all_cases)}] {c.name}: agg {agg and agg['tokens_per_s_per_gpu']} disagg "
                  f"{dis and dis['tokens_per_s_per_gpu']} -> {rows[-1]['aic']['winner']} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
            out.write_text(json.dumps(_doc(rows), indent=1) + "\n")
    doc = _doc(rows)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# -- pdserve's planner on the grid ---------------------------------------------------------

def load_grid(path: str | None = None) -> dict[str, Any]:
    if path:
        from bench.files import read_json

        return read_json(Path(path), None, PlanError)[1]
    from bench.plan.specs import data_file

    return data_file(GRID_FILE)


_DTYPES = {"bfloat16": "bf16", "float16": "bf16", "fp8": "fp8", "float8": "fp8", "fp8_block": "fp8"}


def plan_case(row: dict[str, Any], roofline_only: bool = False) -> dict[str, Any]:
    """pdserve's best layout of each mode on one grid case, in the grid's dtypes."""
    from bench.plan.report import PlanInputs, plan

    ref = row["aic"]["agg"] or row["aic"]["disagg"] or {}
    kv = _DTYPES.get(ref.get("kv_dtype", "bfloat16"), "bf16")
    gemm = _DTYPES.get(ref.get("gemm_dtype", "bfloat16"), "bf16")
    p = plan(PlanInputs(model=row["model"], system=row["system"], total_gpus=row["total_gpus"], isl=row["isl"],
                        osl=row["osl"], ttft_ms=row["ttft_ms"], tpot_ms=row["tpot_ms"], backend="vllm",
                        kv_dtype=kv, weight_dtype=gemm, network="rdma",
                        roofline_only=roofline_only))

    def best(x: Any) -> dict[str, Any] | None:
        return None if x is None else {"tokens_per_s_per_gpu": x.tokens_per_s_per_gpu, "ttft_ms": x.ttft_ms,
                                       "tpot_ms": x.tpot_ms, "layout": x.layout}
    return {"agg": best(p.agg_best), "disagg": best(p.disagg_best), "winner": p.winner, "near_tie": p.near_tie}


NEAR_TIE = 0.05


def compare(grid: dict[str, Any], roofline_only: bool = False) -> dict[str, Any]:
    """Per case: both tools' winners and best tokens/s/GPU per mode; totals per part."""
    rows = []
    for row in grid["cases"]:
        ours, ref = plan_case(row, roofline_only), row["aic"]
        r: dict[str, Any] = {"name": row["name"], "part": row["part"], "aic_winner": ref["winner"],
                             "winner": ours["winner"], "near_tie": ours["near_tie"]}
        for mode in ("agg", "disagg"):
            a, o = ref[mode], ours[mode]
            a = a if a and a.get("meets", True) else None
            r[f"{mode}_ratio"] = o["tokens_per_s_per_gpu"] / a["tokens_per_s_per_gpu"] if a and o else None
        if ref["winner"] and ref["agg"] and ref["disagg"] and ref["agg"].get("meets", True) \
                and ref["disagg"].get("meets", True):
            x, y = ref["agg"]["tokens_per_s_per_gpu"], ref["disagg"]["tokens_per_s_per_gpu"]
            r["aic_near_tie"] = abs(x - y) / max(x, y) <= NEAR_TIE
        else:
            r["aic_near_tie"] = False
        rows.append(r)
    summary = {part: _summary([r for r in rows if r["part"] in parts])
               for part, parts in (("fit", ("fit",)), ("guide", ("guide",)), ("held-out", ("held-out",)),
                                         ("all", ("fit", "guide", "held-out")))}
    return {"cases": rows, "summary": summary}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    decided = [r for r in rows if r["aic_winner"] and not r["aic_near_tie"]]
    out: dict[str, Any] = {"cases": len(rows), "decided": len(decided),
                           "near_ties": sum(r["aic_near_tie"] for r in rows),
                           "same_winner": sum(r["winner"] == r["aic_winner"] for r in decided),
                           "aic_disagg_wins": sum(r["aic_winner"] == "disagg" for r in rows)}
    out["same_winner_share"] = out["same_winner"] / len(decided) if decided else None
    # Apart, never instead: where pdserve's own plan calls a near tie it tells its user to measure
    # both layouts, so a different winner there is not a confident wrong answer.
    sure = [r for r in decided if not r.get("near_tie")]
    out["pdserve_near_ties"] = len(decided) - len(sure)
    out["same_winner_pdserve_sure"] = sum(r["winner"] == r["aic_winner"] for r in sure)
    out["pdserve_sure"] = len(sure)
    for mode in ("agg", "disagg"):
        errs = [abs(r[f"{mode}_ratio"] - 1) for r in rows if r[f"{mode}_ratio"] is not None]
        out[f"{mode}_error_median"] = statistics.median(errs) if errs else None
        out[f"{mode}_error_max"] = max(errs) if errs else None
        out[f"{mode}_compared"] = len(errs)
    return out


def table(result: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    lines = ["| case | part | AIC winner | pdserve winner | agg ratio | disagg ratio |", "|---|---|---|---|---|---|"]
    for r in result["cases"]:
        tie = " (near tie)" if r["aic_near_tie"] else ""
        ours = " (near tie)" if r.get("near_tie") else ""
        lines.append(f"| {r['name']} | {r['part']} | {r['aic_winner']}{tie} | {r['winner']}{ours} "
                     f"| {pct(r['agg_ratio'])} | {pct(r['disagg_ratio'])} |")
    lines.append("")
    for part, s in result["summary"].items():
        lines.append(f"{part}: {s['cases']} cases, same winner {s['same_winner']}/{s['decided']} decided "
                     f"({s['near_ties']} near ties apart; AIC disagg wins {s['aic_disagg_wins']}); "
                     f"tokens/s/GPU vs AIC: agg |err| median {pct(s['agg_error_median'])} "
                     f"max {pct(s['agg_error_max'])}, disagg median "
                     f"{pct(s['disagg_error_median'])} max {pct(s['disagg_error_max'])}; where pdserve is not itself "
                     f"at a near tie: same winner {s['same_winner_pdserve_sure']}/{s['pdserve_sure']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan.grid", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aic", help="run AIConfigurator on every case and write the grid")
    a.add_argument("--aic", default=".venv-aic/bin/aiconfigurator", help="the aiconfigurator executable")
    a.add_argument("--out", default=str(Path(__file__).parent / "data" / GRID_FILE))
    c = sub.add_parser("compare", help="pdserve's planner against the grid")
    c.add_argument("--grid", default=None, help="a grid file (default: the one shipped in bench.plan.data)")
    c.add_argument("--out", default=None, help="also write the comparison as JSON here")
    c.add_argument("--roofline-only", action="store_true",
                   help="the roofline-only model: one set of efficiencies for every system, no measured kernels")
    args = p.parse_args(argv)
    try:
        if args.cmd == "aic":
            if not Path(args.aic).is_file():
                raise PlanError(f"{args.aic}: no aiconfigurator there (make aiconfigurator installs it)")
            run_aic(args.aic, Path(args.out))
            return 0
        result = compare(load_grid(args.grid), args.roofline_only)
    except PlanError as e:
        print(f"bench.plan.grid: error: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
