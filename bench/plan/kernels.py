"""Per-system kernel efficiencies measured on the silicon: what each GPU system's own GEMM,
attention and all-reduce kernels reach against its datasheet, from AIConfigurator's measured
per-operation tables (vLLM's kernels, collected on that GPU by AIConfigurator's authors).

  .venv-aic/bin/python -m bench.plan.kernels      # (re)make bench/plan/data/kernels.json
  python -m bench.plan.kernels --show             # print what the shipped file holds

Why: a roofline with one set of efficiencies for every GPU assumes that every GPU's kernels
reach the same share of its peak. They do not: in the tables, B200's large bf16 GEMMs reach
~69% of its dense peak where H100's reach ~80%, and its small all-reduce takes ~7 us where
Hopper's takes ~5 us. So the planner takes each system's efficiencies from its own kernels,
times one scale per operation (systems.json's `kernel_scale`) fitted once on the reference
grid's fit part: the scale carries what an isolated kernel does not show (the rest of the
layer, launch gaps), the measured figure what differs between systems. A system the fit
never saw (the grid's held-out B200) then gets its efficiencies from its own silicon, not
from the grid. What is measured, per system (one statistic each, the median of the rows named):

  gemm               bf16 GEMMs with m, n, k >= 4096: 2mnk / latency / peak bf16
  hbm                bf16 GEMMs with m <= 16 and n*k >= 4096^2 (weight streaming):
                     (weights + activations) bytes / latency / HBM bandwidth
  prefill_attention  causal context attention, bf16 KV, head_dim 128, no window, ISL >= 4096:
                     4 * heads * head_dim * ISL(ISL+1)/2 * batch / latency / peak bf16
  decode_attention   generation attention, bf16 KV, head_dim 128, no window, context >= 4095,
                     batch >= 16: K and V bytes read / latency / HBM bandwidth
  nvlink             all-reduce (vLLM custom all-reduce, CUDA graph) on the most GPUs measured,
                     the largest message: bus bandwidth 2 (n-1)/n * bytes / latency / NVLink
  allreduce_latency_us  the same all-reduce's smallest message: its latency
  allreduce_us       the same all-reduce's whole curve, per GPU count: [message bytes, latency
                     us] (the planner interpolates it: a TP all-reduce's cost is not a latency
                     plus a bandwidth, B200's has a bump at 128-256 KB)
  layer_floor_us     what one layer's kernels take however little work they have: 4 times the
                     median bf16 GEMM with m <= 16 and n*k <= 1024^2, plus the median generation
                     attention with batch <= 4 and context <= 256 (bf16 KV, head_dim 128)

Only the standard library is imported at module level; making the file needs pandas and
pyarrow (AIConfigurator's own environment: `make aiconfigurator`). Reading it needs neither.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

KERNELS_FORMAT = "pdserve.kernels/1"
KERNELS_FILE = "kernels.json"  # in bench.plan.data
MEASURED = ("gemm", "hbm", "prefill_attention", "decode_attention", "nvlink", "allreduce_latency_us", "layer_floor_us")
GEMMS_PER_LAYER = 4  # QKV, output projection, gate+up, down
FRAMEWORK = "vllm"


@functools.cache
def shipped() -> dict[str, Any]:
    """bench.plan.data's kernels.json: {system: {measure: value, ...}} (empty if absent)."""
    res = files("bench.plan.data").joinpath(KERNELS_FILE)
    try:
        doc = json.loads(res.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    if doc.get("format") != KERNELS_FORMAT:
        raise ValueError(f"bench.plan.data/{KERNELS_FILE}: format {doc.get('format')!r}, want {KERNELS_FORMAT!r}")
    return doc["systems"]


def _newest(path: Path) -> Path | None:
    """The newest vLLM version directory under an operation's folder (e.g. gemm/vllm/0.24.0)."""
    root = path / FRAMEWORK
    if not root.is_dir():
        return None
    versions = sorted((p for p in root.iterdir() if p.is_dir()),
                      key=lambda p: tuple(int(x) if x.isdigit() else 0 for x in p.name.split(".")))
    return versions[-1] if versions else None


def _table(system_dir: Path, op: str, name: str) -> tuple[Any, str] | None:
    import pandas as pd

    d = _newest(system_dir / op)
    if d is None or not (d / f"{name}.parquet").is_file():
        return None
    return pd.read_parquet(d / f"{name}.parquet"), d.name


def _full_attention(t: Any) -> Any:
    """Rows of plain (no sliding window) attention over a bf16 KV cache (older tables have no
    window column: every row is plain)."""
    t = t[t.kv_cache_dtype == "bfloat16"]
    return t[t.window_size == 0] if "window_size" in t.columns else t


def _allreduce_curves(t: Any) -> dict[str, list[list[float]]]:
    """{GPUs: [[message bytes, latency us], ...]}: the all-reduce as measured (vLLM custom
    all-reduce under CUDA graphs, bf16), every message size, for every GPU count."""
    t = t[(t.backend == "vllm_graph") & (t.allreduce_dtype == "bfloat16")]
    return {str(int(n)): [[int(m), round(float(lat) * 1e3, 3)] for m, lat in zip(x.message_size, x.latency)]
            for n, x in ((n, t[t.num_gpus == n].sort_values("message_size")) for n in sorted(t.num_gpus.unique()))}


def measure(system_dir: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    """One system's measured efficiencies (module docstring) from its AIConfigurator tables."""
    peak = spec["peak_tflops"]["bf16"] * 1e12
    hbm = spec["hbm_gbps"] * 1e9
    tables = {k: _table(system_dir, op, name) for k, op, name in (
        ("gemm", "gemm", "gemm_perf"), ("ctx", "attention", "context_attention_perf"),
        ("gen", "attention", "generation_attention_perf"), ("ar", "comm", "custom_allreduce_perf"))}
    if any(t is None for t in tables.values()):
        return None
    g = tables["gemm"][0]
    g = g[g.gemm_dtype == "bfloat16"]
    sec = g.latency / 1e3  # the tables' latencies are in ms
    big = g[(g.m >= 4096) & (g.n >= 4096) & (g.k >= 4096)]
    stream = g[(g.m <= 16) & (g.n * g.k >= 4096 * 4096)]
    c = _full_attention(tables["ctx"][0])
    c = c[(c.head_dim == 128) & (c.isl >= 4096)]
    a = _full_attention(tables["gen"][0])
    a = a[(a.head_dim == 128) & (a.step >= 4095) & (a.batch_size >= 16)]
    r = tables["ar"][0]
    r = r[(r.backend == "vllm_graph") & (r.allreduce_dtype == "bfloat16")]
    n = int(r.num_gpus.max())
    r = r[r.num_gpus == n].sort_values("message_size")
    if min(len(big), len(stream), len(c), len(a), len(r)) == 0:
        return None
    largest = r.iloc[-1]
    tiny_gemm = g[(g.m <= 16) & (g.n * g.k <= 1024 * 1024)]
    tiny_attn = _full_attention(tables["gen"][0])
    tiny_attn = tiny_attn[(tiny_attn.head_dim == 128) & (tiny_attn.batch_size <= 4) & (tiny_attn.step <= 256)]
    if min(len(tiny_gemm), len(tiny_attn)) == 0:
        return None
    floor_ms = GEMMS_PER_LAYER * float(tiny_gemm.latency.median()) + float(tiny_attn.latency.median())
    return {
        "gemm": round(float((2 * big.m * big.n * big.k / sec[big.index]).median() / peak), 4),
        "hbm": round(float(((stream.n * stream.k + stream.m * (stream.n + stream.k)) * 2 / sec[stream.index])
                           .median() / hbm), 4),
        "prefill_attention": round(float((4 * c.batch_size * c.num_heads * c.head_dim * c.isl * (c.isl + 1) / 2
                                          / (c.latency / 1e3)).median() / peak), 4),
        "decode_attention": round(float((a.batch_size * a.step * a.num_key_value_heads * a.head_dim * 2 * 2
                                         / (a.latency / 1e3)).median() / hbm), 4),
        "nvlink": round(float(2 * (n - 1) / n * largest.message_size / (largest.latency / 1e3)
                              / (spec["nvlink_gbps"] * 1e9)), 4),
        "allreduce_latency_us": round(float(r.iloc[0].latency * 1e3), 3),
        "layer_floor_us": round(floor_ms * 1e3, 3),
        "allreduce_us": _allreduce_curves(tables["ar"][0]),
        "tables": {"gemm": tables["gemm"][1], "attention": tables["ctx"][1], "comm": tables["ar"][1]},
        "rows": {"gemm": len(big), "hbm": len(stream), "prefill_attention": len(c), "decode_attention": len(a),
                 "allreduce_gpus": n, "floor_gemms": len(tiny_gemm), "floor_attention": len(tiny_attn),
                 "allreduce_bytes": [int(r.iloc[0].message_size), int(largest.message_size)]},
    }


def aic_data_dir() -> Path:
    import aiconfigurator_core  # AIConfigurator's own environment

    return Path(aiconfigurator_core.__file__).parent / "systems" / "data"


def make(data: Path) -> dict[str, Any]:
    from importlib.metadata import version

    systems = json.loads(files("bench.plan.data").joinpath("systems.json").read_text(encoding="utf-8"))["systems"]
    out = {}
    for name, spec in sorted(systems.items()):
        got = measure(data / name, spec) if (data / name).is_dir() else None
        if got is not None:
            out[name] = got
    return {"format": KERNELS_FORMAT, "aiconfigurator": version("aiconfigurator"),
            "made_by": ".venv-aic/bin/python -m bench.plan.kernels (make aiconfigurator first)",
            "what": __doc__.split("\n\n")[3].strip(), "systems": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--show", action="store_true", help="print the shipped file's figures and exit")
    p.add_argument("--aic-data", default=None, help="AIConfigurator's systems/data folder (default: its package's)")
    p.add_argument("--out", default=str(Path(__file__).parent / "data" / KERNELS_FILE))
    args = p.parse_args(argv)
    if args.show:
        for name, m in shipped().items():
            print(name + ": " + ", ".join(f"{k} {m[k]}" for k in MEASURED))
        return 0
    try:
        data = Path(args.aic_data) if args.aic_data else aic_data_dir()
    except ImportError:
        print("bench.plan.kernels: AIConfigurator is not installed here: run it with .venv-aic/bin/python "
              "(make aiconfigurator) or pass --aic-data", file=sys.stderr)
        return 2
    doc = make(data)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for name, m in doc["systems"].items():
        print(name + ": " + ", ".join(f"{k} {m[k]}" for k in MEASURED))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
