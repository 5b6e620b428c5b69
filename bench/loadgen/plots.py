"""PNG plots of a run (matplotlib, headless Agg backend):

  ttft_distribution.png   histogram of TTFT (streaming runs)
  itl_distribution.png    histogram of ITL (streaming runs)
  latency_over_time.png   request latency (and TTFT) of each request against its start time
  throughput_over_time.png  output tokens/s and completed requests/s in 1 s bins
"""

from __future__ import annotations

from pathlib import Path

from bench.loadgen import metrics as M
from bench.loadgen.profile import ProfileResult


def pyplot():
    """matplotlib.pyplot on the headless Agg backend (imported on first use: plots are optional work)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _hist(values: list[float], title: str, xlabel: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(values, bins=min(60, max(5, len(values) // 5)), color="#4477aa")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(result: ProfileResult, out: Path) -> list[Path]:
    ok = [r for r in result.records if r.ok]
    if not ok:
        return []
    out.mkdir(parents=True, exist_ok=True)
    written = []
    ttft = [v / 1e6 for r in ok if (v := M.time_to_first_token(r)) is not None]
    itl = [v / 1e6 for r in ok if (v := M.inter_token_latency(r)) is not None]
    if ttft:
        _hist(ttft, "Time to first token", "ms", out / "ttft_distribution.png")
        written.append(out / "ttft_distribution.png")
    if itl:
        _hist(itl, "Inter-token latency", "ms", out / "itl_distribution.png")
        written.append(out / "itl_distribution.png")
    plt = pyplot()
    t0 = min(r.start_ns for r in result.records)
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [(r.start_ns - t0) / 1e9 for r in ok]
    ax.scatter(xs, [M.request_latency(r) / 1e6 for r in ok], s=4, label="request latency")  # type: ignore[operator]
    if ttft:
        ax.scatter([(r.start_ns - t0) / 1e9 for r in ok if M.time_to_first_token(r) is not None], ttft, s=4,
                   label="TTFT")
    ax.set_xlabel("request start (s)")
    ax.set_ylabel("ms")
    ax.set_title("Latency over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_over_time.png", dpi=100)
    plt.close(fig)
    written.append(out / "latency_over_time.png")
    end = max((r.end_ns - t0) / 1e9 for r in ok)
    bins = max(1, int(end) + 1)
    toks = [0.0] * bins
    reqs = [0.0] * bins
    for r in ok:
        b = min(bins - 1, int((r.end_ns - t0) / 1e9))
        toks[b] += r.osl or 0
        reqs[b] += 1
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(bins), toks, label="output tokens/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(range(bins), reqs, color="#cc6677", label="requests/s")
    ax2.set_ylabel("requests/s")
    ax.set_title("Throughput over time (1 s bins)")
    fig.tight_layout()
    fig.savefig(out / "throughput_over_time.png", dpi=100)
    plt.close(fig)
    written.append(out / "throughput_over_time.png")
    return written
