"""The command line: the guide's exact AIPerf command, aliases, and one-line errors."""

from __future__ import annotations

import argparse
import shlex

import pytest

from bench.loadgen.config import add_profile_arguments, config_from_args, parse_extra_inputs, parse_goodput
from bench.loadgen.errors import LoadgenError

GUIDE = """aiperf profile \\
  -m nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1 \\
  --endpoint-type chat \\
  -u http://localhost:8000 \\
  --isl 4000 --isl-stddev 0 \\
  --osl 500 --osl-stddev 0 \\
  --num-requests 800 \\
  --concurrency 30 \\
  --streaming \\
  --extra-inputs "ignore_eos:true" \\
  --num-warmup-requests 40 \\
  --ui-type simple"""


def parse(argv: list[str]):
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_guide_command_parses_unchanged():
    argv = shlex.split(GUIDE.replace("\\\n", " "))
    assert argv[:2] == ["aiperf", "profile"]
    cfg = parse(argv[2:])
    assert cfg.model == "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1"
    assert cfg.endpoint_type == "chat" and cfg.path == "/v1/chat/completions"
    assert cfg.url == "http://localhost:8000"
    assert (cfg.isl, cfg.isl_stddev, cfg.osl, cfg.osl_stddev) == (4000, 0, 500, 0)
    assert cfg.num_requests == 800 and cfg.concurrency == 30 and cfg.streaming
    assert cfg.extra_inputs == {"ignore_eos": True}
    assert cfg.warmup_requests == 40 and cfg.ui == "simple"
    assert cfg.mode == "concurrency"


def test_aliases():
    cfg = parse(["--model-names", "m", "--request-count", "5", "--warmup-request-count", "2",
                 "--synthetic-input-tokens-mean", "64", "--output-tokens-mean", "8", "--arrival-pattern", "gamma",
                 "--request-rate", "10", "--ui", "none", "--output-artifact-dir", "/tmp/x", "--stream"])
    assert (cfg.num_requests, cfg.warmup_requests, cfg.isl, cfg.osl) == (5, 2, 64, 8)
    assert cfg.arrival == "gamma" and cfg.mode == "request_rate" and cfg.ui == "none" and cfg.streaming
    assert str(cfg.artifact_dir) == "/tmp/x"


def test_rate_and_concurrency_cap_together():
    cfg = parse(["-m", "m", "--request-rate", "5", "--concurrency", "2", "--arrival", "poisson"])
    assert cfg.request_rate == 5 and cfg.concurrency == 2 and cfg.mode == "request_rate"


def test_extra_inputs_values_are_json_when_json():
    assert parse_extra_inputs(["ignore_eos:true", "temperature:0.5", "stop:x", '{"top_k": 3}']) == {
        "ignore_eos": True, "temperature": 0.5, "stop": "x", "top_k": 3}
    with pytest.raises(LoadgenError, match="key:value"):
        parse_extra_inputs(["novalue"])


def test_goodput_parsing():
    assert parse_goodput("time_to_first_token:600 inter_token_latency:16.67") == {
        "time_to_first_token": 600.0, "inter_token_latency": 16.67}
    with pytest.raises(LoadgenError, match="unknown metric"):
        parse_goodput("ttft:600")
    with pytest.raises(LoadgenError, match="not a number"):
        parse_goodput("time_to_first_token:fast")
    with pytest.raises(LoadgenError, match="positive"):
        parse_goodput("time_to_first_token:-1")


@pytest.mark.parametrize("argv, message", [
    (["-m", "m", "--concurrency", "0"], "--concurrency must be > 0"),
    (["-m", "m", "--isl", "-3"], "--isl must be > 0"),
    (["-m", "m", "-u", "https://x"], "only http://"),
    (["-m", "m", "--fixed-schedule"], "--fixed-schedule replays"),
    (["-m", "m", "--input-file", "/nonexistent.jsonl"], "no such file"),
    (["-m", "m", "--num-prefix-prompts", "2"], "go together"),
    (["-m", "m", "--endpoint-type", "completions", "--conversation-turn-mean", "3"], "need --endpoint-type chat"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(LoadgenError, match=message) as e:
        parse(argv)
    assert "\n" not in str(e.value)


def test_cli_reports_a_bad_flag_in_one_line(capsys):
    from serve.cli import main

    assert main(["bench", "profile", "-m", "m", "--concurrency", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pdserve bench profile: error: --concurrency must be > 0, got 0"


def test_missing_tokenizer_stops_the_run(capsys, monkeypatch):
    from serve.cli import main

    # Offline, as this machine is (without it the same error comes after a 3 s connect timeout).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    code = main(["bench", "profile", "-m", "no-such-org/no-such-model-xyz", "--ui-type", "none",
                 "--artifact-dir", "/tmp/pdserve-test-none"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("pdserve bench profile: error: cannot load the tokenizer 'no-such-org/no-such-model-xyz'")
    assert len(err.splitlines()) == 1
