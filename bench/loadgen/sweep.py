"""`pdserve bench sweep`: `bench profile` at several concurrencies, then the Pareto front of
throughput per GPU against throughput per user.

Each concurrency runs into `<artifact-dir>/concurrency<C>/` with the profile's usual files.
`<artifact-dir>/sweep.csv` has one row per concurrency:
  tokens_per_s_per_gpu  = output token throughput / --gpus
  tokens_per_s_per_user = mean per-user output throughput (1 / ITL) when streaming, else
                          mean E2E output throughput per user (OSL / request latency)
plus TTFT/ITL p50 and p99 and `pareto` (1 when no other point is at least as good on both
axes and better on one). `pareto.csv` keeps the front; `pareto.png` draws all points and it.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.loadgen.config import ProfileConfig
from bench.loadgen.errors import LoadgenError

COLUMNS = ("concurrency", "requests", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "output_token_throughput",
           "request_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors", "pareto")


def _get(m: dict[str, Any], tag: str, stat: str = "avg") -> float | None:
    v = m.get(tag)
    return None if v is None else v.get(stat)


def point(concurrency: int, requests: int, metrics: dict[str, Any], gpus: int) -> dict[str, Any]:
    tput = _get(metrics, "output_token_throughput") or 0.0
    per_user = _get(metrics, "output_token_throughput_per_user")
    if per_user is None:
        per_user = _get(metrics, "e2e_output_token_throughput") or 0.0
    return {"concurrency": concurrency, "requests": requests, "tokens_per_s_per_gpu": tput / gpus,
            "tokens_per_s_per_user": per_user, "output_token_throughput": tput,
            "request_throughput": _get(metrics, "request_throughput"),
            "ttft_p50_ms": _get(metrics, "time_to_first_token", "p50"),
            "ttft_p99_ms": _get(metrics, "time_to_first_token", "p99"),
            "itl_p50_ms": _get(metrics, "inter_token_latency", "p50"),
            "itl_p99_ms": _get(metrics, "inter_token_latency", "p99"),
            "errors": int(_get(metrics, "error_request_count") or 0), "pareto": 0}


def mark_pareto(points: list[dict[str, Any]], x: str = "tokens_per_s_per_user",
                y: str = "tokens_per_s_per_gpu") -> list[dict[str, Any]]:
    """Set `pareto` = 1 on the points no other point dominates (>= on both, > on one)."""
    for p in points:
        p["pareto"] = int(not any(
            q is not p and q[x] >= p[x] and q[y] >= p[y] and (q[x] > p[x] or q[y] > p[y]) for q in points))
    return points


def write_csv(points: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for p in points:
            w.writerow({k: p.get(k) for k in COLUMNS})


def plot(points: list[dict[str, Any]], path: Path, gpus: int) -> None:
    from bench.loadgen.plots import pyplot  # noqa: PLC0415

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([p["tokens_per_s_per_user"] for p in points], [p["tokens_per_s_per_gpu"] for p in points])
    for p in points:
        ax.annotate(f"c={p['concurrency']}", (p["tokens_per_s_per_user"], p["tokens_per_s_per_gpu"]), fontsize=8)
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["tokens_per_s_per_user"])
    ax.plot([p["tokens_per_s_per_user"] for p in front], [p["tokens_per_s_per_gpu"] for p in front],
            color="#cc6677", label="Pareto front")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel(f"output tokens/s per GPU ({gpus} GPU{'s' if gpus > 1 else ''})")
    ax.set_title("Throughput per GPU vs per user")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: ProfileConfig, concurrencies: list[int], gpus: int, requests_per_concurrency: int | None) -> int:
    from bench.loadgen.export import write_artifacts  # noqa: PLC0415
    from bench.loadgen.profile import run as run_profile  # noqa: PLC0415

    if not concurrencies or any(c < 1 for c in concurrencies):
        raise LoadgenError("--concurrencies: give one or more positive integers")
    if gpus < 1:
        raise LoadgenError("--gpus must be >= 1")
    root = Path(cfg.artifact_dir)
    points = []
    for c in concurrencies:
        n = c * requests_per_concurrency if requests_per_concurrency else (cfg.num_requests or 10 * c)
        one = replace(cfg, concurrency=c, num_requests=n, artifact_dir=root / f"concurrency{c}")
        print(f"== sweep: concurrency {c}, {n} requests", flush=True)
        result = run_profile(one)
        metrics = write_artifacts(result)
        points.append(point(c, n, metrics, gpus))
        if result.was_cancelled:
            break
    mark_pareto(points)
    root.mkdir(parents=True, exist_ok=True)
    write_csv(points, root / "sweep.csv")
    write_csv([p for p in points if p["pareto"]], root / "pareto.csv")
    plot(points, root / "pareto.png", gpus)
    print(f"sweep: {root / 'sweep.csv'}, {root / 'pareto.csv'}, {root / 'pareto.png'}")
    return 0
