"""Metric math on recorded timestamps: exact values, one test per metric."""

from __future__ import annotations

import math

import pytest

from bench.loadgen import metrics as M
from bench.loadgen.records import ErrorInfo, Record
from bench.loadgen.stats import summarize

MS = 1_000_000


def rec(start_ms: float, content_ms: list[float], osl: int | None = None, isl: int | None = 100,
        streaming: bool = True, error: ErrorInfo | None = None, end_ms: float | None = None) -> Record:
    r = Record(session=0, turn=0, phase="profiling", worker=0, start_ns=int(start_ms * MS), wall_start_ns=0,
               streaming=streaming, error=error)
    r.content_ns = [int(c * MS) for c in content_ms]
    r.end_ns = int((end_ms if end_ms is not None else (content_ms[-1] if content_ms else start_ms)) * MS)
    r.osl = osl if osl is not None else len(content_ms)
    r.isl = isl
    return r


def test_ttft_is_first_content_minus_start():
    assert M.time_to_first_token(rec(1000, [1200, 1220, 1240])) == 200 * MS


def test_ttft_needs_streaming():
    assert M.time_to_first_token(rec(0, [50], streaming=False)) is None


def test_time_to_second_token():
    assert M.time_to_second_token(rec(0, [200, 230, 240])) == 30 * MS
    assert M.time_to_second_token(rec(0, [200])) is None


def test_request_latency_is_last_content_minus_start():
    assert M.request_latency(rec(10, [200, 220, 260], end_ms=270)) == 250 * MS


def test_itl_is_decode_time_over_osl_minus_one():
    # TTFT 200, latency 200 + 4 * 20 = 280 over 5 tokens: (280 - 200) / 4 = 20 ms.
    r = rec(0, [200, 220, 240, 260, 280])
    assert M.inter_token_latency(r) == 20 * MS
    # OSL from usage can exceed the chunk count (several tokens per chunk): uses OSL.
    r2 = rec(0, [200, 300], osl=11)
    assert M.inter_token_latency(r2) == 100 * MS / 10
    assert M.inter_token_latency(rec(0, [200], osl=1)) is None


def test_inter_chunk_latency_is_every_gap():
    assert M.inter_chunk_latency(rec(0, [200, 220, 250, 300])) == [20 * MS, 30 * MS, 50 * MS]
    assert M.inter_chunk_latency(rec(0, [200])) is None


def test_per_user_throughput_is_inverse_itl():
    r = rec(0, [200, 220, 240, 260, 280])  # ITL 20 ms
    assert M.output_token_throughput_per_user(r) == pytest.approx(50.0)


def test_e2e_output_throughput():
    r = rec(0, [100, 200, 300, 400])  # 4 tokens in 400 ms
    assert M.e2e_output_token_throughput(r) == pytest.approx(10.0)


def test_sequence_lengths_come_from_the_record():
    r = rec(0, [1, 2, 3], osl=7, isl=42)
    assert M.output_sequence_length(r) == 7
    assert M.input_sequence_length(r) == 42


def run_records() -> list[Record]:
    return [
        rec(0, [100, 110, 120], isl=10),          # ends at 120 ms
        rec(50, [250, 300, 350], isl=20),         # ends at 350 ms
        rec(100, [], error=ErrorInfo(500, "internal_server_error", "boom"), end_ms=500),
    ]


def test_benchmark_duration_spans_first_start_to_last_end():
    assert M.benchmark_duration(run_records()) == 500 * MS


def test_counts_and_totals():
    rs = run_records()
    assert M.request_count(rs) == 2
    assert M.error_request_count(rs) == 1
    assert M.total_osl(rs) == 6
    assert M.total_isl(rs) == 30


def test_throughputs_divide_by_duration():
    rs = run_records()
    assert M.request_throughput(rs) == pytest.approx(2 / 0.5)
    assert M.output_token_throughput(rs) == pytest.approx(6 / 0.5)
    assert M.input_token_throughput(rs) == pytest.approx(30 / 0.5)


def test_goodput_counts_requests_meeting_every_slo():
    rs = run_records()  # TTFTs 100 and 200 ms; ITLs 10 and 50 ms
    assert M.good_request_count(rs, {"time_to_first_token": 150}) == 1
    assert M.good_request_count(rs, {"time_to_first_token": 250, "inter_token_latency": 20}) == 1
    assert M.good_request_count(rs, {"time_to_first_token": 250, "inter_token_latency": 50}) == 2
    assert M.goodput(rs, {"time_to_first_token": 150}) == pytest.approx(1 / 0.5)
    # Per-user throughput is larger-is-better: 1/10ms = 100 tok/s, 1/50ms = 20 tok/s.
    assert M.good_request_count(rs, {"output_token_throughput_per_user": 50}) == 1


def test_goodput_fails_requests_lacking_the_metric():
    r = rec(0, [100], streaming=False)
    assert not M.is_good(r, {"time_to_first_token": 1000})


def test_error_summary_groups_by_code_type_message():
    e1 = ErrorInfo(500, "internal_server_error", "boom")
    e2 = ErrorInfo(None, "RequestTimeout", "slow")
    rs = [rec(0, [], error=e1), rec(0, [], error=e1), rec(0, [], error=e2), rec(0, [1])]
    assert M.error_summary(rs) == [
        {"error_details": {"code": 500, "type": "internal_server_error", "message": "boom"}, "count": 2},
        {"error_details": {"code": None, "type": "RequestTimeout", "message": "slow"}, "count": 1},
    ]


def test_summarize_stats():
    s = summarize([1 * MS, 2 * MS, 3 * MS, 4 * MS], "ms", MS)
    assert s["avg"] == 2.5 and s["min"] == 1 and s["max"] == 4 and s["sum"] == 10 and s["count"] == 4
    assert s["p50"] == 2.5  # linear interpolation
    assert s["p90"] == pytest.approx(3.7)
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std
    assert summarize([], "ms") is None
