"""`pdserve bench compare A B`: two runs side by side.

A and B are artifact dirs (or their profile_export_aiperf.json), ours or AIPerf's. For every
metric both have, the table shows A, B and B/A for avg and p50 (p99 for latencies too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.loadgen.export import load_summary

ORDER = ("time_to_first_token", "inter_token_latency", "time_per_output_token", "request_latency",
         "time_to_second_token", "output_token_throughput_per_user", "output_sequence_length",
         "input_sequence_length", "output_token_throughput", "request_throughput", "goodput",
         "request_count", "error_request_count", "benchmark_duration")


def _metrics(doc: dict[str, Any]) -> dict[str, dict]:
    return {k: v for k, v in doc.items() if isinstance(v, dict) and "unit" in v and "avg" in v}


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {metric, stat, unit, a, b, ratio} for the metrics both summaries have."""
    ma, mb = _metrics(a), _metrics(b)
    tags = [t for t in ORDER if t in ma and t in mb] + sorted(set(ma) & set(mb) - set(ORDER))
    rows = []
    for tag in tags:
        for stat in ("avg", "p50", "p99"):
            va, vb = ma[tag].get(stat), mb[tag].get(stat)
            if va is None or vb is None:
                continue
            rows.append({"metric": tag, "stat": stat, "unit": ma[tag]["unit"], "a": va, "b": vb,
                         "ratio": (vb / va) if va else None})
    return rows


def render(rows: list[dict[str, Any]], a_name: str, b_name: str) -> str:
    head = ["metric", "stat", "unit", "A", "B", "B/A"]
    body = [[r["metric"], r["stat"], r["unit"], f"{r['a']:,.3f}", f"{r['b']:,.3f}",
             "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"] for r in rows]
    widths = [max(len(x[i]) for x in body + [head]) for i in range(len(head))]
    lines = [f"A = {a_name}", f"B = {b_name}",
             "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
              for x in body]
    return "\n".join(lines)


def _name(path: str, doc: dict[str, Any]) -> str:
    return f"{path} (SIMULATED)" if doc.get("simulated") else path


def run(a: str, b: str) -> int:
    da, db = load_summary(Path(a)), load_summary(Path(b))
    rows = compare(da, db)
    print(render(rows, _name(a, da), _name(b, db)))
    if not rows:
        print("no metric in common")
        return 1
    return 0
