"""The load generator against pdserve itself (real engine): the prompt lengths it builds are
exactly what the server counts as prompt_tokens, chat template included."""

from __future__ import annotations

import argparse

import pytest

from bench.loadgen.config import add_profile_arguments, config_from_args
from bench.loadgen.profile import run as run_profile

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_tokens_match_the_server(frontend, model_dir, tmp_path, endpoint):
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    cfg = config_from_args(p.parse_args([
        "-m", "smollm2-135m-instruct", "-u", frontend, "--endpoint-type", endpoint, "--isl", "57", "--isl-stddev", "9",
        "--osl", "4", "--extra-inputs", "ignore_eos:true", "--num-requests", "4", "--concurrency", "2",
        "--streaming", "--ui-type", "none", "--artifact-dir", str(tmp_path)]))
    result = run_profile(cfg)
    assert len(result.records) == 4
    for r in result.records:
        assert r.ok, r.error
        assert r.prompt_tokens is not None and r.prompt_tokens == r.expected_isl
        assert r.completion_tokens == 4 and len(r.content_ns) >= 1
