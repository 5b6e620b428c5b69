"""The load generator end to end against the built-in fake server (real processes, real
sockets): exact token counts, measured delays bounded below by the programmed ones, errors
counted, AIPerf's artifact layout, schedules, sessions, sweep/compare, and Ctrl-C."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.loadgen.config import add_profile_arguments, config_from_args
from bench.loadgen.export import write_artifacts
from bench.loadgen.profile import START_LEAD_S
from bench.loadgen.profile import run as run_profile
from tests.conftest import ROOT, Proc, free_port

LAYOUT = json.loads((Path(__file__).parent / "data" / "aiperf_0.13_layout.json").read_text())
TTFT_MS, ITL_MS = 200.0, 20.0
# No upper bounds on measured times (a loaded machine adds any amount): the programmed delays
# bound them below, and the summaries must be exactly the records' own timestamps.


def fake_server(model_dir: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc("fake-server", ["bench", "fake-server", "--port", str(port), "--tokenizer", model_dir, *flags])
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", 60)
    return proc, url


@pytest.fixture(scope="module")
def slow_server(model_dir):
    proc, url = fake_server(model_dir, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS))
    yield url
    proc.stop()


def profile(url: str, model_dir: str, out: Path, *argv: str):
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    cfg = config_from_args(p.parse_args(["-m", "smollm2-135m-instruct", "--tokenizer", model_dir, "-u", url,
                                         "--ui-type", "none", "--artifact-dir", str(out), *argv]))
    result = run_profile(cfg)
    metrics = write_artifacts(result, plots=True)
    return result, metrics


def test_streaming_run_measures_programmed_delays(slow_server, model_dir, tmp_path):
    result, m = profile(slow_server, model_dir, tmp_path, "--isl", "64", "--osl", "10", "--num-requests", "8",
                        "--concurrency", "4", "--streaming", "--extra-inputs", "ignore_eos:true",
                        "--num-warmup-requests", "2", "--goodput", "time_to_first_token:5000")
    assert len(result.records) == 8 and len(result.warmup) == 2  # warmup excluded from results
    for r in result.records:
        assert r.ok
        assert (r.isl, r.osl, r.prompt_tokens, r.completion_tokens) == (64, 10, 64, 10)
        assert len(r.content_ns) == 10
    for stat in ("min", "p50", "max"):
        assert TTFT_MS <= m["time_to_first_token"][stat]
        # A request's ITL is (last - first token) / 9: a first token read late by the loaded
        # client (the server's sleeps still hold) shortens it by that delay / 9, hence the 5%.
        assert ITL_MS * 0.95 <= m["inter_token_latency"][stat]
    ttfts = [(r.content_ns[0] - r.start_ns) / 1e6 for r in result.records]
    itls = [(r.content_ns[-1] - r.content_ns[0]) / 1e6 / 9 for r in result.records]
    assert (m["time_to_first_token"]["min"], m["time_to_first_token"]["max"]) == \
        (pytest.approx(min(ttfts)), pytest.approx(max(ttfts)))
    assert (m["inter_token_latency"]["min"], m["inter_token_latency"]["max"]) == \
        (pytest.approx(min(itls)), pytest.approx(max(itls)))
    assert m["time_per_output_token"] == {**m["inter_token_latency"], "unit": "ms"}
    assert m["request_latency"]["min"] >= TTFT_MS + 9 * ITL_MS
    assert m["request_count"]["avg"] == 8 and m["error_request_count"]["avg"] == 0
    assert m["good_request_count"]["avg"] == 8
    assert m["output_sequence_length"]["sum"] == 80 and m["input_sequence_length"]["avg"] == 64
    dur_s = m["benchmark_duration"]["avg"]
    assert m["output_token_throughput"]["avg"] == pytest.approx(80 / dur_s)
    assert m["request_throughput"]["avg"] == pytest.approx(8 / dur_s)

    # AIPerf's layout: same stat keys and units for every metric both write; same CSV header.
    doc = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    shared = set(LAYOUT["metrics"]) & set(doc)
    assert {"time_to_first_token", "time_to_second_token", "inter_token_latency", "inter_chunk_latency",
            "request_latency", "output_token_throughput", "output_token_throughput_per_user",
            "output_sequence_length", "input_sequence_length", "request_throughput", "request_count",
            "benchmark_duration", "goodput", "good_request_count", "total_osl", "total_isl",
            "e2e_output_token_throughput", "input_token_throughput"} <= shared
    for tag in shared:
        assert sorted(doc[tag]) == LAYOUT["metrics"][tag]["keys"], tag
        assert doc[tag]["unit"] == LAYOUT["metrics"][tag]["unit"], tag
    for key in ("schema_version", "input_config", "was_cancelled", "is_complete", "error_summary",
                "start_time", "end_time", "warmup_metrics"):
        assert key in LAYOUT["top_level"] and key in doc
    assert doc["was_cancelled"] is False and doc["error_summary"] == []
    csv_text = (tmp_path / "profile_export_aiperf.csv").read_text()
    assert csv_text.splitlines()[0] == LAYOUT["csv_header"]
    lines = (tmp_path / "profile_export.jsonl").read_text().splitlines()
    assert len(lines) == 8
    first = json.loads(lines[0])
    assert sorted(first) == ["error", "metadata", "metrics"]
    assert set(first) - {"error"} <= set(LAYOUT["jsonl_top_level"])
    assert {"session_num", "turn_index", "request_start_ns", "request_end_ns", "benchmark_phase",
            "was_cancelled", "worker_id"} <= set(LAYOUT["jsonl_metadata"]) & set(first["metadata"])
    assert first["metrics"]["output_sequence_length"] == {"value": 10, "unit": "tokens"}
    assert len(first["metrics"]["inter_chunk_latency"]["value"]) == 9
    for png in ("ttft_distribution", "itl_distribution", "latency_over_time", "throughput_over_time"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 1000
    assert "Time to First Token (ms)" in (tmp_path / "profile_export_console.txt").read_text()


def test_errors_are_counted_by_type(model_dir, tmp_path):
    proc, url = fake_server(model_dir, "--fail-every", "3")
    try:
        result, m = profile(url, model_dir, tmp_path, "--endpoint-type", "completions", "--isl", "20",
                            "--osl", "4", "--num-requests", "9", "--concurrency", "2")
    finally:
        proc.stop()
    assert m["request_count"]["avg"] == 6 and m["error_request_count"]["avg"] == 3
    doc = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert doc["error_summary"] == [{"error_details": {"code": 500, "type": "internal_server_error",
                                                       "message": "programmed failure"}, "count": 3}]
    assert sorted(doc["error_summary"][0]) == LAYOUT["error_summary_item"]
    assert "time_to_first_token" not in m  # not streaming: no TTFT
    ok = [r for r in result.records if r.ok]
    assert all((r.isl, r.osl) == (20, 4) for r in ok)
    errors = [json.loads(x)["error"] for x in (tmp_path / "profile_export.jsonl").read_text().splitlines()]
    assert sum(e is not None for e in errors) == 3


def test_unreachable_server_is_a_clear_error(model_dir, tmp_path):
    from bench.loadgen.errors import LoadgenError

    with pytest.raises(LoadgenError, match="cannot reach http://127.0.0.1:"):
        profile(f"http://127.0.0.1:{free_port()}", model_dir, tmp_path, "--num-requests", "1")


def test_rate_with_cap_and_duration(slow_server, model_dir, tmp_path):
    result, m = profile(slow_server, model_dir, tmp_path, "--isl", "40", "--osl", "3", "--streaming",
                        "--request-rate", "20", "--arrival", "constant", "--concurrency", "3",
                        "--benchmark-duration", "2", "--benchmark-grace-period", "5")
    starts = sorted(r.start_ns for r in result.records)
    # The cap of 3 in flight (each ~240 ms) limits the rate to ~12.5/s, below the 20/s asked.
    assert 10 <= len(starts) <= 3 * 2 / 0.24 + 3
    assert (starts[-1] - starts[0]) / 1e9 < 2.0
    assert all(r.ok for r in result.records)


def test_multi_turn_sessions_send_the_history(slow_server, model_dir, tmp_path):
    result, m = profile(slow_server, model_dir, tmp_path, "--isl", "40", "--osl", "3", "--streaming",
                        "--conversation-num", "2", "--conversation-turn-mean", "3", "--concurrency", "2")
    by_session: dict[int, list] = {}
    for r in result.records:
        by_session.setdefault(r.session, []).append(r)
    assert sorted(by_session) == [0, 1]
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        assert turns[0].isl == 40
        assert turns[0].isl < turns[1].isl < turns[2].isl  # each turn carries the previous ones
        assert turns[0].end_ns <= turns[1].start_ns


def test_fixed_schedule_replays_trace_timestamps(slow_server, model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in [
        {"timestamp": 5000, "input_length": 80, "output_length": 2, "hash_ids": [1]},
        {"timestamp": 5300, "input_length": 90, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 5900, "input_length": 70, "output_length": 3, "hash_ids": [3]}]) + "\n")
    result, m = profile(slow_server, model_dir, tmp_path / "out", "--input-file", str(trace), "--fixed-schedule",
                        "--fixed-schedule-auto-offset", "--isl-block-size", "16", "--streaming")
    recs = sorted(result.records, key=lambda r: r.start_ns)
    assert [(r.isl, r.osl) for r in recs] == [(80, 2), (90, 2), (70, 3)]
    # Offsets from the schedule's origin (START_LEAD_S after the run's wall-clock start), not
    # from the first request: that one's own start lagged the schedule by 280 ms once under the
    # suite's load, which made the next one look 20 ms after it.
    offsets = [(r.wall_start_ns - result.start_wall_ns) / 1e6 - START_LEAD_S * 1e3 for r in recs]
    assert offsets[0] >= 0 and offsets[1] >= 300 and offsets[2] >= 900  # never before its time


def test_sweep_and_compare(slow_server, model_dir, tmp_path, capsys):
    from tests.bench.commands import pdserve as main

    base = ["-m", "smollm2-135m-instruct", "--tokenizer", model_dir, "-u", slow_server, "--isl", "40", "--osl", "3",
            "--streaming", "--ui-type", "none"]
    assert main(["bench", "sweep", *base, "--concurrencies", "1", "2", "--requests-per-concurrency", "2",
                 "--gpus", "2", "--artifact-dir", str(tmp_path / "sw")]) == 0
    rows = (tmp_path / "sw" / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("concurrency,requests,tokens_per_s_per_gpu,tokens_per_s_per_user")
    assert [r.split(",")[:2] for r in rows[1:]] == [["1", "2"], ["2", "4"]]
    assert (tmp_path / "sw" / "pareto.png").stat().st_size > 1000
    assert (tmp_path / "sw" / "pareto.csv").read_text().count("\n") >= 2
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "sw" / "concurrency1"), str(tmp_path / "sw" / "concurrency2")]) == 0
    out = capsys.readouterr().out
    assert "time_to_first_token" in out and "B/A" in out


def test_ctrl_c_writes_partial_results(slow_server, model_dir, tmp_path):
    import os
    import threading

    out = tmp_path / "partial"
    cmd = [sys.executable, "-m", "serve.cli", "bench", "profile", "-m", "smollm2-135m-instruct", "--tokenizer",
           model_dir, "-u", slow_server, "--isl", "40", "--osl", "10", "--streaming", "--num-requests", "400",
           "--concurrency", "2", "--ui-type", "simple", "--no-plots", "--artifact-dir", str(out)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    profiling = threading.Event()

    def read() -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            lines.append(raw.decode(errors="replace"))
            if lines[-1].startswith("profiling:"):
                profiling.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # wait until requests are flowing (tokenizer loaded, clients started, warm), then interrupt
        assert profiling.wait(90), "".join(lines)
        time.sleep(1)  # a few ~0.4 s requests finish
        os.killpg(p.pid, signal.SIGINT)
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(10)
    text = "".join(lines)
    assert code == 130, text
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["was_cancelled"] is True and doc["is_complete"] is False
    assert 0 < doc["request_count"]["avg"] < 400
    assert "run cancelled" in text


def test_request_timeouts_are_errors_not_hangs(slow_server, model_dir, tmp_path):
    t0 = time.monotonic()
    result, m = profile(slow_server, model_dir, tmp_path, "--isl", "40", "--osl", "3", "--streaming",
                        "--num-requests", "3", "--request-timeout-seconds", "0.1")
    assert time.monotonic() - t0 < 30
    assert m["error_request_count"]["avg"] == 3 and "request_count" in m and m["request_count"]["avg"] == 0
    assert {(r.error.type if r.error else None) for r in result.records} == {"RequestTimeout"}
