"""Prompts of exact token counts; Mooncake trace parsing and replay plans."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from bench.loadgen.config import add_profile_arguments, config_from_args
from bench.loadgen.dataset import PlanBuilder, parse_mooncake
from bench.loadgen.errors import DatasetError, LoadgenError
from bench.loadgen.prompts import PromptBuilder
from bench.loadgen.runner import next_gap


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from bench.loadgen.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct", model_dir)


def cfg_of(argv):
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    return config_from_args(p.parse_args(["-m", "smollm2-135m-instruct", *argv]))


def server_count_chat(tok, content: str) -> int:
    """What vLLM (and pdserve's frontend) count as prompt_tokens for one user message."""
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("isl", [40, 97, 513])
def test_chat_prompts_have_exact_length_template_included(hf_tokenizer, isl):
    b = PromptBuilder(hf_tokenizer, "chat")
    assert b.overhead > 0  # SmolLM2's template adds a system prompt
    rng = random.Random(1)
    texts = b.fit([b.build(isl, rng) for _ in range(5)], [isl] * 5, rng)
    assert [server_count_chat(hf_tokenizer, t) for t in texts] == [isl] * 5


def test_completion_prompts_have_exact_length(hf_tokenizer):
    b = PromptBuilder(hf_tokenizer, "completions")
    rng = random.Random(2)
    texts = b.fit([b.build(n, rng) for n in (1, 17, 300)], [1, 17, 300], rng)
    assert [len(hf_tokenizer.encode(t)) for t in texts] == [1, 17, 300]


def test_too_short_for_the_template_is_an_error(hf_tokenizer):
    b = PromptBuilder(hf_tokenizer, "chat")
    with pytest.raises(LoadgenError, match="too short"):
        b.build(b.overhead, random.Random(0))


def test_fit_repairs_texts_that_are_off(hf_tokenizer):
    b = PromptBuilder(hf_tokenizer, "completions")
    rng = random.Random(3)
    texts = b.fit(["hello", b.words_text(80, rng)], [10, 50], rng)
    assert [len(hf_tokenizer.encode(t)) for t in texts] == [10, 50]


def test_plan_with_shared_prefixes(hf_tokenizer):
    cfg = cfg_of(["--isl", "200", "--osl", "5", "--num-requests", "12", "--num-prefix-prompts", "2",
                  "--prefix-prompt-length", "64", "--random-seed", "7"])
    warm, sessions = PlanBuilder(cfg, PromptBuilder(hf_tokenizer, "chat")).build()
    assert warm == [] and len(sessions) == 12
    contents = [s.turns[0].content for s in sessions]
    prefixes = {" ".join(c.split(" ")[:64]) for c in contents}
    assert len(prefixes) == 2  # every prompt starts with one of the two prefixes
    for s in sessions:
        assert server_count_chat(hf_tokenizer, s.turns[0].content) == 200
        body = json.loads(s.turns[0].body)
        assert body["max_tokens"] == 5 and body["model"] == "smollm2-135m-instruct"


def test_plan_lengths_follow_the_stddev(hf_tokenizer):
    cfg = cfg_of(["--isl", "120", "--isl-stddev", "20", "--osl", "30", "--osl-stddev", "5", "--num-requests", "40"])
    _, sessions = PlanBuilder(cfg, PromptBuilder(hf_tokenizer, "chat")).build()
    isls = [s.turns[0].isl for s in sessions]
    assert len(set(isls)) > 5
    for s in sessions[:8]:
        assert server_count_chat(hf_tokenizer, s.turns[0].content) == s.turns[0].isl


def write_trace(tmp_path, lines):
    f = tmp_path / "trace.jsonl"
    f.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return f


def test_mooncake_parsing(tmp_path):
    f = write_trace(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
                               {"timestamp": 250, "input_length": 300, "output_length": 4, "hash_ids": [1]}])
    entries = parse_mooncake(f)
    assert [(e.timestamp_ms, e.input_length, e.output_length, e.hash_ids) for e in entries] == [
        (0.0, 600, 10, (1, 2)), (250.0, 300, 4, (1,))]


@pytest.mark.parametrize("line, message", [
    ("{not json", "trace.jsonl:2: invalid JSON"),
    ({"output_length": 3}, "trace.jsonl:2: missing field 'input_length'"),
    ({"input_length": 0, "output_length": 3}, "input_length must be >= 1"),
])
def test_mooncake_bad_lines_name_the_line(tmp_path, line, message):
    f = write_trace(tmp_path, [{"input_length": 5, "output_length": 1}, line])
    with pytest.raises(DatasetError, match=message):
        parse_mooncake(f)


def test_trace_plan_shares_blocks_and_keeps_the_schedule(tmp_path, hf_tokenizer):
    f = write_trace(tmp_path, [{"timestamp": 1000, "input_length": 150, "output_length": 3, "hash_ids": [7, 8]},
                               {"timestamp": 1400, "input_length": 120, "output_length": 2, "hash_ids": [7, 9]},
                               {"timestamp": 1100, "input_length": 90, "output_length": 2, "hash_ids": [5]}])
    cfg = cfg_of(["--input-file", str(f), "--fixed-schedule", "--fixed-schedule-auto-offset", "--isl-block-size", "32"])
    b = PromptBuilder(hf_tokenizer, "chat")
    _, sessions = PlanBuilder(cfg, b).build()
    # sorted by timestamp, offset to the first one
    assert [s.at_s for s in sessions] == [0.0, 0.1, 0.4]
    by_len = {s.turns[0].isl: s.turns[0].content.split(" ") for s in sessions}
    assert by_len[150][:32] == by_len[120][:32]  # hash id 7: the same first block
    assert by_len[150][32:64] != by_len[120][32:64]
    for s in sessions:
        assert server_count_chat(hf_tokenizer, s.turns[0].content) == s.turns[0].isl
        assert json.loads(s.turns[0].body)["max_tokens"] == s.turns[0].osl


def test_arrival_gaps_have_the_requested_mean():
    rng = random.Random(0)
    for pattern in ("poisson", "gamma"):
        gaps = [next_gap(pattern, 50.0, 4.0, rng) for _ in range(20000)]
        assert sum(gaps) / len(gaps) == pytest.approx(0.02, rel=0.03)
    assert next_gap("constant", 50.0, 1.0, rng) == 0.02
    # gamma with a large shape is more regular than poisson
    var = lambda xs: sum((x - 0.02) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var([next_gap("gamma", 50.0, 10.0, rng) for _ in range(5000)]) < var(
        [next_gap("poisson", 50.0, 1.0, rng) for _ in range(5000)])
