"""The load generator's metrics: one function each, formula in the docstring.

Per-request metrics take a Record and return a value in base units (ns, tokens, tokens/s)
or None where the metric does not apply (so it is left out, not counted as zero). Run-level
metrics take the list of profiling records. Tags, headers and units are AIPerf's, so files
we write read like AIPerf's. Only successful requests count, except error counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from bench.loadgen.records import Record

NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class MetricInfo:
    tag: str
    header: str
    unit: str  # display unit
    scale: float  # base value / scale = display value
    per_request: bool
    streaming_only: bool = False
    larger_is_better: bool = False


# -- per-request ---------------------------------------------------------------------------
def time_to_first_token(r: Record) -> int | None:
    """TTFT = first content response arrival - request start (streaming only)."""
    if not r.streaming or not r.content_ns:
        return None
    return r.content_ns[0] - r.start_ns


def time_to_second_token(r: Record) -> int | None:
    """TTST = second content response arrival - first content response arrival (streaming)."""
    if not r.streaming or len(r.content_ns) < 2:
        return None
    return r.content_ns[1] - r.content_ns[0]


def request_latency(r: Record) -> int | None:
    """Request latency = last content response arrival - request start (non-streaming: the
    response's last byte)."""
    if not r.content_ns:
        return None
    return r.content_ns[-1] - r.start_ns


def inter_token_latency(r: Record) -> float | None:
    """ITL = (request latency - TTFT) / (OSL - 1), for OSL >= 2. vLLM calls it TPOT
    (time per output token); both names are reported."""
    ttft, lat = time_to_first_token(r), request_latency(r)
    if ttft is None or lat is None or r.osl is None or r.osl < 2:
        return None
    return (lat - ttft) / (r.osl - 1)


def inter_chunk_latency(r: Record) -> list[int] | None:
    """ICL = [content_ns[i] - content_ns[i-1] for i >= 1]: every gap between consecutive
    content responses (streaming, at least two of them). Pooled over all requests."""
    if not r.streaming or len(r.content_ns) < 2:
        return None
    c = r.content_ns
    return [c[i] - c[i - 1] for i in range(1, len(c))]


def output_token_throughput_per_user(r: Record) -> float | None:
    """Per-user output throughput = 1 / ITL (tokens/s): the decode speed one user sees."""
    itl = inter_token_latency(r)
    if itl is None or itl <= 0:
        return None
    return NS_PER_S / itl


def output_sequence_length(r: Record) -> int | None:
    """OSL = usage.completion_tokens where the server reports it, else the tokenized output."""
    return r.osl


def input_sequence_length(r: Record) -> int | None:
    """ISL = usage.prompt_tokens where the server reports it, else the built prompt's count."""
    return r.isl


def e2e_output_token_throughput(r: Record) -> float | None:
    """E2E output throughput per user = OSL / request latency (tokens/s)."""
    lat = request_latency(r)
    if lat is None or not lat or r.osl is None:
        return None
    return r.osl * NS_PER_S / lat


PER_REQUEST: dict[str, tuple[MetricInfo, Callable[[Record], object]]] = {
    "time_to_first_token": (MetricInfo("time_to_first_token", "Time to First Token", "ms", 1e6, True, True), time_to_first_token),
    "time_to_second_token": (MetricInfo("time_to_second_token", "Time to Second Token", "ms", 1e6, True, True), time_to_second_token),
    "request_latency": (MetricInfo("request_latency", "Request Latency", "ms", 1e6, True), request_latency),
    "inter_token_latency": (MetricInfo("inter_token_latency", "Inter Token Latency", "ms", 1e6, True, True), inter_token_latency),
    "time_per_output_token": (MetricInfo("time_per_output_token", "Time per Output Token (= ITL)", "ms", 1e6, True, True), inter_token_latency),
    "inter_chunk_latency": (MetricInfo("inter_chunk_latency", "Inter Chunk Latency", "ms", 1e6, True, True), inter_chunk_latency),
    "output_token_throughput_per_user": (MetricInfo("output_token_throughput_per_user", "Output Token Throughput Per User", "tokens/sec/user", 1.0, True, True, True), output_token_throughput_per_user),
    "e2e_output_token_throughput": (MetricInfo("e2e_output_token_throughput", "E2E Output Token Throughput", "tokens/sec/user", 1.0, True, False, True), e2e_output_token_throughput),
    "output_sequence_length": (MetricInfo("output_sequence_length", "Output Sequence Length", "tokens", 1.0, True, False, True), output_sequence_length),
    "input_sequence_length": (MetricInfo("input_sequence_length", "Input Sequence Length", "tokens", 1.0, True), input_sequence_length),
}


# -- run-level -----------------------------------------------------------------------------
def benchmark_duration(records: Sequence[Record]) -> int | None:
    """Benchmark duration = last response end - first request start, over profiling
    requests (errors included: they took part in the load)."""
    if not records:
        return None
    start = min(r.start_ns for r in records)
    end = max(r.end_ns or r.start_ns for r in records)
    return end - start if end > start else None


def request_count(records: Sequence[Record]) -> int:
    """Request count = successful profiling requests."""
    return sum(1 for r in records if r.ok)


def error_request_count(records: Sequence[Record]) -> int:
    """Error request count = profiling requests that failed (HTTP or in-stream error, timeout,
    transport failure); cancelled ones are counted apart."""
    return sum(1 for r in records if r.error is not None)


def total_osl(records: Sequence[Record]) -> int:
    """Total output tokens = sum of OSL over successful requests."""
    return sum(r.osl or 0 for r in records if r.ok)


def total_isl(records: Sequence[Record]) -> int:
    """Total input tokens = sum of ISL over successful requests."""
    return sum(r.isl or 0 for r in records if r.ok)


def _per_s(count: float, records: Sequence[Record]) -> float | None:
    d = benchmark_duration(records)
    return count * NS_PER_S / d if d else None


def request_throughput(records: Sequence[Record]) -> float | None:
    """Request throughput = request count / benchmark duration (requests/s)."""
    return _per_s(request_count(records), records)


def output_token_throughput(records: Sequence[Record]) -> float | None:
    """Output token throughput = total output tokens / benchmark duration (tokens/s)."""
    return _per_s(total_osl(records), records)


def input_token_throughput(records: Sequence[Record]) -> float | None:
    """Input token throughput = total input tokens / benchmark duration (tokens/s)."""
    return _per_s(total_isl(records), records)


SMALLER_IS_BETTER = {
    "time_to_first_token": True, "time_to_second_token": True, "inter_token_latency": True,
    "time_per_output_token": True, "request_latency": True, "output_token_throughput_per_user": False,
}


def is_good(r: Record, slos: dict[str, float]) -> bool:
    """A request is good when it succeeded and meets every SLO: latency metrics (in ms) at or
    under their threshold, per-user throughput (tokens/s) at or over it. A metric the
    request lacks (e.g. TTFT without streaming) fails its SLO."""
    if not r.ok:
        return False
    for tag, threshold in slos.items():
        info, fn = PER_REQUEST[tag]
        value = fn(r)
        if value is None:
            return False
        shown = float(value) / info.scale  # type: ignore[arg-type]
        if SMALLER_IS_BETTER[tag]:
            if shown > threshold:
                return False
        elif shown < threshold:
            return False
    return True


def good_request_count(records: Sequence[Record], slos: dict[str, float]) -> int:
    """Good request count = successful requests meeting every SLO (see is_good)."""
    return sum(1 for r in records if is_good(r, slos))


def goodput(records: Sequence[Record], slos: dict[str, float]) -> float | None:
    """Goodput = good request count / benchmark duration (requests/s)."""
    return _per_s(good_request_count(records, slos), records)


def error_summary(records: Sequence[Record]) -> list[dict]:
    """Errors grouped by (code, type, message), most frequent first, as AIPerf lays it out:
    [{"error_details": {"code", "type", "message"}, "count"}]."""
    counts: dict[tuple, int] = {}
    for r in records:
        if r.error is not None:
            key = (r.error.code, r.error.type, r.error.message)
            counts[key] = counts.get(key, 0) + 1
    return [{"error_details": {"code": c, "type": t, "message": m}, "count": n}
            for (c, t, m), n in sorted(counts.items(), key=lambda kv: -kv[1])]
