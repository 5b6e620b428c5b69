"""Output tokens are a pure function of the request; the step models; the engine options."""

import pytest

from serve import protocol as p
from serve.errors import ConfigError
from serve.sim.config import parse_sim_options
from serve.sim.timing import ConstantStep, LinearStep, parse_step_model
from serve.sim.tokens import Vocabulary, is_stop, request_key, token_at

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True

VOCAB = Vocabulary(tuple(range(100, 200)), eos_id=2, size=256)


def greedy(**kw):
    return p.SamplingOptions(max_tokens=16, temperature=0.0, **kw)


def seq(prompt, sampling, n=16, vocab=VOCAB):
    key = request_key(prompt, sampling)
    return [token_at(key, i, vocab, sampling) for i in range(n)]


def test_greedy_and_seeded_outputs_repeat_and_depend_on_the_prompt():
    assert seq([1, 2, 3], greedy()) == seq([1, 2, 3], greedy())
    assert seq([1, 2, 3], greedy()) != seq([1, 2, 4], greedy())
    seeded = p.SamplingOptions(max_tokens=16, temperature=0.8, seed=7)
    assert seq([1, 2], seeded) == seq([1, 2], seeded)
    assert seq([1, 2], seeded) != seq([1, 2], p.SamplingOptions(max_tokens=16, temperature=0.8, seed=8))


def test_unseeded_sampling_differs_between_requests():
    s = p.SamplingOptions(max_tokens=16, temperature=1.0)
    assert seq([1, 2], s, 32) != seq([1, 2], s, 32)


def test_tokens_are_vocabulary_ids_and_eos_obeys_ignore_eos_and_min_tokens():
    out = seq(list(range(50)), greedy(), 2000)
    assert set(out) <= set(VOCAB.ids) | {2}
    assert 2 in out  # eos appears at about 1/64 per position
    assert 2 not in seq(list(range(50)), greedy(ignore_eos=True), 2000)
    s = greedy(min_tokens=5)
    assert not is_stop(2, 3, VOCAB, s) and is_stop(2, 4, VOCAB, s)
    assert is_stop(150, 0, VOCAB, greedy(stop_token_ids=(150,)))


def test_vocabulary_of_the_embedded_model_is_words(model_dir):
    from transformers import AutoTokenizer

    v = Vocabulary.from_model_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert v.eos_id == tok.eos_token_id and len(v.ids) > 1000
    text = tok.decode(list(v.ids[:50]))
    assert text.replace(" ", "").isalpha()


def test_step_models():
    assert ConstantStep(0.01).step_seconds([100] * 5, [(0, 512)]) == 0.01
    m = LinearStep(base_s=0.001, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=1e-6)
    assert m.step_seconds([100, 300], [(0, 1000)]) == pytest.approx(0.001 + 0.01 + 2e-4 + 4e-4)
    assert parse_step_model("linear:0.001,0,0,0").step_seconds([], []) == 0.001
    with pytest.raises(ValueError):
        parse_step_model("cubic")


def test_engine_options_accepted_and_refused():
    o = parse_sim_options(["--max-num-seqs", "8", "--block-size", "16", "--num-gpu-blocks", "100",
                           "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--max-model-len", "4096",
                           "--kv-cache-dtype", "fp8"], None, 1.0)
    e = o.engine
    assert (e.max_num_seqs, e.block_size, e.num_blocks, e.enable_prefix_caching, e.enable_chunked_prefill,
            e.max_model_len, e.max_num_batched_tokens, e.kv_cache_dtype) == (8, 16, 100, False, False, 4096, 4096,
                                                                            "fp8")
    with pytest.raises(ConfigError, match="does not model engine option --enforce-eager"):
        parse_sim_options(["--enforce-eager"], None, 1.0)
    # What `pdserve plan`'s launch command passes: recorded, the block pool unchanged.
    tp2 = parse_sim_options(["--tensor-parallel-size", "2"], None, 1.0).engine
    assert tp2.tensor_parallel_size == 2 and tp2.num_blocks == parse_sim_options([], None, 1.0).engine.num_blocks
    with pytest.raises(ConfigError, match="tensor-parallel-size must be >= 1"):
        parse_sim_options(["--tensor-parallel-size", "0"], None, 1.0)
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        parse_sim_options(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"], None, 1.0)
    # --kv-cache-gib sizes the cache from the model's shape when --num-gpu-blocks is not given.
    half = parse_sim_options(["--block-size", "16"], None, 0.5).engine.num_blocks
    full = parse_sim_options(["--block-size", "16"], None, 1.0).engine.num_blocks
    assert full == 2 * half
