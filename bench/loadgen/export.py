"""A run's artifacts, in AIPerf's layout so tools that read AIPerf's files read ours.

In `--artifact-dir`:
  profile_export.jsonl        one line per profiling request: {"metadata", "metrics", "error"}
  profile_export_aiperf.json  run summary: one key per metric tag ({unit, avg, p50, ...} or
                              {unit, avg}), error_summary, input_config, start/end time...
  profile_export_aiperf.csv   two sections: per-request metrics with stats, then run metrics
  profile_export_console.txt  the console table
  plots/*.png                 see plots.py
Times are in ms, throughputs per second. `time_per_output_token` repeats
`inter_token_latency` under vLLM's name.
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.loadgen import metrics as M
from bench.loadgen.profile import ProfileResult
from bench.loadgen.stats import STAT_KEYS, scalar, summarize

SCHEMA_VERSION = "1.4"  # the AIPerf export schema these files follow
CONSOLE_ROWS = ("time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency",
                "time_per_output_token", "output_token_throughput_per_user", "output_sequence_length",
                "input_sequence_length")
RUN_METRICS = (
    # tag, header, unit, value function
    ("request_throughput", "Request Throughput", "requests/sec", lambda rs, slo: M.request_throughput(rs)),
    ("output_token_throughput", "Output Token Throughput", "tokens/sec", lambda rs, slo: M.output_token_throughput(rs)),
    ("input_token_throughput", "Input Token Throughput", "tokens/sec", lambda rs, slo: M.input_token_throughput(rs)),
    ("request_count", "Request Count", "requests", lambda rs, slo: M.request_count(rs)),
    ("error_request_count", "Error Request Count", "requests", lambda rs, slo: M.error_request_count(rs)),
    ("total_osl", "Total Output Sequence Length", "tokens", lambda rs, slo: M.total_osl(rs)),
    ("total_isl", "Total Input Sequence Length", "tokens", lambda rs, slo: M.total_isl(rs)),
)


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6


def per_request_values(records: list[M.Record]) -> dict[str, list[float]]:
    """Each per-request metric's values over successful requests (ICL pooled)."""
    out: dict[str, list[float]] = {tag: [] for tag in M.PER_REQUEST}
    for r in records:
        if not r.ok:
            continue
        for tag, (_, fn) in M.PER_REQUEST.items():
            v = fn(r)
            if v is None:
                continue
            if isinstance(v, list):
                out[tag].extend(v)
            else:
                out[tag].append(v)  # type: ignore[arg-type]
    return out


def summary(result: ProfileResult) -> dict[str, Any]:
    """The metrics of profile_export_aiperf.json: tag -> stats dict."""
    recs = result.records
    slos = result.cfg.goodput
    out: dict[str, Any] = {}
    values = per_request_values(recs)
    for tag, (info, _) in M.PER_REQUEST.items():
        s = summarize(values[tag], info.unit, info.scale)
        if s is not None:
            out[tag] = s
    for tag, _, unit, fn in RUN_METRICS:
        s = scalar(fn(recs, slos), unit)
        if s is not None:
            out[tag] = s
    dur = M.benchmark_duration(recs)
    if dur:
        out["benchmark_duration"] = scalar(dur, "sec", 1e9)
    if slos:
        out["good_request_count"] = scalar(M.good_request_count(recs, slos), "requests")
        g = M.goodput(recs, slos)
        if g is not None:
            out["goodput"] = scalar(g, "requests/sec")
    cancelled = sum(1 for r in recs if r.cancelled)
    if cancelled:
        out["cancelled_request_count"] = scalar(cancelled, "requests")
    out.update(server_timing_summary(recs))
    return out


SERVER_STAGES = ("queue", "tokenize", "route", "prefill", "kv_transfer", "decode_first_step", "other")


def server_timing_summary(records: list[M.Record]) -> dict[str, Any]:
    """The server's own TTFT and its stages (pdserve's X-PDSERVE-Timing), in ms, over the
    successful requests that carried them: `server_ttft`, `server_stage_<stage>`. A stage a
    request's path does not have counts as 0 for it, so the stages' averages add up to the
    server TTFT's."""
    timed = [r.server_timing for r in records if r.ok and r.server_timing and r.server_timing.get("ttft_ms") is not None]
    if not timed:
        return {}
    out = {"server_ttft": summarize([t["ttft_ms"] for t in timed], "ms")}
    for stage in SERVER_STAGES:
        values = [float((t.get("stages_ms") or {}).get(stage, 0.0)) for t in timed]
        if any(values):
            out[f"server_stage_{stage}"] = summarize(values, "ms")
    return out


def _headers() -> dict[str, str]:
    h = {tag: info.header for tag, (info, _) in M.PER_REQUEST.items()}
    h.update({tag: header for tag, header, _, _ in RUN_METRICS})
    h.update({"benchmark_duration": "Benchmark Duration", "goodput": "Goodput",
              "good_request_count": "Good Request Count", "cancelled_request_count": "Cancelled Request Count",
              "server_ttft": "Server Time to First Token"})
    h.update({f"server_stage_{s}": f"Server TTFT Stage {s}" for s in SERVER_STAGES})
    return h


def input_config(result: ProfileResult) -> dict[str, Any]:
    cfg = result.cfg
    return {
        "models": {"items": [{"name": cfg.model}]},
        "endpoint": {"urls": [cfg.url], "type": cfg.endpoint_type, "path": cfg.path,
                     "streaming": cfg.streaming, "extra": cfg.extra_inputs},
        "datasets": [{"name": "main", "type": "trace" if cfg.input_file else "synthetic",
                      "file": str(cfg.input_file) if cfg.input_file else None,
                      "prompts": {"isl": {"mean": cfg.isl, "stddev": cfg.isl_stddev},
                                  "osl": {"mean": cfg.osl, "stddev": cfg.osl_stddev},
                                  "prefix": {"pool_size": cfg.num_prefix_prompts, "length": cfg.prefix_prompt_length}},
                      "sessions": {"count": cfg.num_sessions, "turns": cfg.session_turns}}],
        "phases": [p for p in (
            {"name": "warmup", "kind": "warmup", "exclude_from_results": True, "requests": cfg.warmup_requests,
             "concurrency": cfg.concurrency or 1} if cfg.warmup_requests else None,
            {"name": "profiling", "kind": "profiling", "type": cfg.mode, "requests": cfg.num_requests,
             "concurrency": cfg.concurrency, "request_rate": cfg.request_rate,
             "arrival": cfg.arrival if cfg.request_rate else None, "duration": cfg.benchmark_duration},
        ) if p],
        "artifacts": {"dir": str(cfg.artifact_dir)},
        "slos": cfg.goodput,
        "tokenizer": {"name": cfg.tokenizer or cfg.model},
        "random_seed": cfg.random_seed,
        "runtime": {"ui": cfg.ui, "workers": result.workers},
    }


def export_json(result: ProfileResult, metrics: dict[str, Any]) -> dict[str, Any]:
    try:
        from importlib.metadata import version as _v  # noqa: PLC0415

        version = _v("pdserve")
    except Exception:  # not installed as a distribution (running from a checkout)
        version = "dev"
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "aiperf_version": None,
        "generator": f"pdserve {version}",
        "benchmark_id": uuid.uuid4().hex[:12],
    }
    doc.update(metrics)
    doc.update({
        "input_config": input_config(result),
        "run_info": {"cli_command": result.cfg.cli_command, "client_processes": result.workers},
        "was_cancelled": result.was_cancelled,
        "is_complete": not result.was_cancelled,
        "error_summary": M.error_summary(result.records),
        "start_time": datetime.fromtimestamp(result.start_wall_ns / 1e9).isoformat(),
        "end_time": datetime.fromtimestamp(result.end_wall_ns / 1e9).isoformat(),
    })
    if result.simulation is not None:
        doc["simulated"] = True  # `pdserve sim`: a modelled cluster, not a measured one
        doc["simulation"] = result.simulation
    if result.warmup:
        warm = ProfileResult(result.cfg, result.warmup, [], result.start_wall_ns, result.end_wall_ns)
        doc["warmup_metrics"] = summary(warm)
    return doc


def export_csv(metrics: dict[str, Any]) -> str:
    headers = _headers()
    buf = io.StringIO()
    w = csv.writer(buf)

    def name(tag: str, unit: str) -> str:
        return f"{headers.get(tag, tag)} ({unit})" if unit not in ("requests", "count") else headers.get(tag, tag)

    def num(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, int):
            return str(v)
        return f"{float(v):.2f}"

    per = {t: m for t, m in metrics.items() if "p50" in m}
    run = {t: m for t, m in metrics.items() if "p50" not in m}
    w.writerow(["Metric", *STAT_KEYS])
    for tag in sorted(per, key=lambda t: headers.get(t, t)):
        m = per[tag]
        w.writerow([name(tag, m["unit"]), *[num(m.get(k)) for k in STAT_KEYS]])
    w.writerow([])
    w.writerow(["Metric", "Value"])
    for tag in sorted(run, key=lambda t: headers.get(t, t)):
        w.writerow([name(tag, run[tag]["unit"]), num(run[tag]["avg"])])
    return buf.getvalue()


def record_line(r: M.Record) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if r.ok:
        for tag, (info, fn) in M.PER_REQUEST.items():
            v = fn(r)
            if v is None:
                continue
            if isinstance(v, list):
                metrics[tag] = {"value": [x / info.scale for x in v], "unit": info.unit}
            else:
                metrics[tag] = {"value": v / info.scale if info.scale != 1 else v, "unit": info.unit}
    if r.prompt_tokens is not None:
        metrics["usage_prompt_tokens"] = {"value": r.prompt_tokens, "unit": "tokens"}
    if r.completion_tokens is not None:
        metrics["usage_completion_tokens"] = {"value": r.completion_tokens, "unit": "tokens"}
    end_wall = r.wall_start_ns + ((r.end_ns or r.start_ns) - r.start_ns)
    return {
        "metadata": {"session_num": r.session, "conversation_id": f"session-{r.session}", "turn_index": r.turn,
                     "request_start_ns": r.wall_start_ns, "request_end_ns": end_wall,
                     "worker_id": f"client_{r.worker}", "benchmark_phase": r.phase,
                     "was_cancelled": r.cancelled},
        "metrics": metrics,
        "error": None if r.error is None else {"code": r.error.code, "type": r.error.type, "message": r.error.message},
        **({"pdserve_timing": r.server_timing} if r.server_timing is not None else {}),
    }


def console_table(result: ProfileResult, metrics: dict[str, Any]) -> str:
    headers = _headers()
    cols = ("avg", "min", "max", "p99", "p90", "p50", "std")
    rows = []
    for tag in CONSOLE_ROWS:
        m = metrics.get(tag)
        if m:
            rows.append([f"{headers[tag]} ({m['unit']})", *[f"{m[c]:,.2f}" for c in cols]])
    for tag in ("output_token_throughput", "request_throughput", "goodput", "request_count",
                "error_request_count", "cancelled_request_count", "benchmark_duration"):
        m = metrics.get(tag)
        if m:
            unit = "" if m["unit"] in ("requests",) else f" ({m['unit']})"
            rows.append([f"{headers[tag]}{unit}", f"{m['avg']:,.2f}"] + ["N/A"] * (len(cols) - 1))
    head = ["Metric", *cols]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"

    title = f"pdserve bench profile | {result.cfg.model} | {result.cfg.mode}"
    out = [title, line, fmt(head), line, *[fmt(r) for r in rows], line]
    errs = M.error_summary(result.records)
    for e in errs[:5]:
        d = e["error_details"]
        out.append(f"error x{e['count']}: {d['code']} {d['type']}: {d['message'][:160]}")
    if result.was_cancelled:
        out.append("run cancelled: partial results")
    return "\n".join(out)


def write_artifacts(result: ProfileResult, plots: bool = True) -> dict[str, Any]:
    """Write every artifact; returns the summary metrics."""
    d = Path(result.cfg.artifact_dir)
    d.mkdir(parents=True, exist_ok=True)
    metrics = summary(result)
    with open(d / "profile_export.jsonl", "w") as f:
        for r in result.records:
            f.write(json.dumps(record_line(r), separators=(",", ":")) + "\n")
    (d / "profile_export_aiperf.json").write_text(json.dumps(export_json(result, metrics), indent=2) + "\n")
    (d / "profile_export_aiperf.csv").write_text(export_csv(metrics))
    table = console_table(result, metrics)
    (d / "profile_export_console.txt").write_text(table + "\n")
    print(table)
    if plots:
        from bench.loadgen.plots import write_plots  # noqa: PLC0415

        write_plots(result, d / "plots")
    print(f"artifacts: {d}")
    return metrics


def load_summary(path: Path) -> dict[str, Any]:
    """profile_export_aiperf.json of an artifact dir (or the file itself)."""
    from bench.files import read_json  # noqa: PLC0415
    from bench.loadgen.errors import DatasetError  # noqa: PLC0415

    f, doc = read_json(path, "profile_export_aiperf.json", DatasetError)
    if not isinstance(doc, dict):
        raise DatasetError(f"{f}: not a profile summary")
    return doc
