"""The embedded model: conversion from the bundled GGUF, fix-ups, path resolution."""

import json
from pathlib import Path

import pytest

from serve import model as m
from serve.errors import ModelError

# A conversion in this process (torch), no engine: a unit of its own (tests/conftest.py).
STARTS_NO_ENGINE = True


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    # A real conversion into a fresh directory (~20 s), independent of the shared cache.
    return m.prepare_embedded_model(tmp_path_factory.mktemp("model") / "smollm2")


@pytest.mark.engine  # torch: a real conversion, ~20-40 s
def test_conversion_produces_a_loadable_hf_directory(converted):
    assert m.is_ready(converted)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert "quantization_config" not in cfg  # dequantized: plain bf16 weights
    assert (converted / "model.safetensors").stat().st_size > 200_000_000


@pytest.mark.engine  # torch: a real conversion, ~20-40 s
def test_tokenizer_fixups(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1 and tok.eos_token_id == 2
    # Digits are split one by one, as in the original SmolLM2 tokenizer.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "_model_name_or_path" not in cfg


@pytest.mark.engine  # torch: a real conversion, ~20-40 s
def test_prepare_is_idempotent(converted):
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    assert m.prepare_embedded_model(converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_root_override(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert m.embedded_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"


def test_resolve_model(tmp_path):
    assert m.resolve_model("org/some-model") == "org/some-model"  # hub id, left to the loader
    with pytest.raises(ModelError, match="no such directory"):
        m.resolve_model("./does/not/exist")
    with pytest.raises(ModelError, match="config.json"):
        m.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert m.resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    assert m.served_name(str(tmp_path)) == tmp_path.name
    assert m.served_name(None) == m.EMBEDDED_MODEL_NAME
