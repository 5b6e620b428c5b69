"""The torch-free tokenizer load gives exactly AutoTokenizer's tokenizer, and only where it
applies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from serve.common.hf_tokenizer import direct_class, from_pretrained

# Some tests import torch (or vLLM): this module shares a unit with the others that do (tests/conftest.py).
IMPORTS_TORCH = True

TEXTS = ["Hello world", "  leading spaces and trailing  ", "naïve café — 東京 🙂", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n\treturn x ** 2\n", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def test_same_tokenizer_as_autotokenizer(model_dir):
    from transformers import AutoTokenizer

    ours, theirs = from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert direct_class(model_dir) is not None  # the embedded model takes the direct path
    assert type(ours) is type(theirs)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for gen in (True, False):
        assert (ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
                == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen))


def test_direct_path_only_for_the_plain_class_of_a_checked_model_type(model_dir, tmp_path):
    def variant(name: str, tok_cfg: dict | None = None, cfg: dict | None = None) -> str:
        d = tmp_path / name
        shutil.copytree(model_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf", "*.bin"))
        for file, change in (("tokenizer_config.json", tok_cfg), ("config.json", cfg)):
            if change is not None:
                doc = json.loads((d / file).read_text())
                doc.update(change)
                (d / file).write_text(json.dumps(doc))
        return str(d)

    assert direct_class(variant("same")) is not None
    assert direct_class(variant("own-class", {"tokenizer_class": "LlamaTokenizer"})) is None
    assert direct_class(variant("remote-code", {"auto_map": {"AutoTokenizer": ["x.T", None]}})) is None
    assert direct_class(variant("other-type", cfg={"model_type": "deepseek_v3"})) is None
    no_json = Path(variant("no-json"))
    (no_json / "tokenizer.json").unlink()
    assert direct_class(str(no_json)) is None
    assert direct_class("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: AutoTokenizer decides


def test_a_new_process_loads_it_without_torch(model_dir):
    code = ("import sys; from serve.frontend.tokenizer import Tokenizer; t = Tokenizer(sys.argv[1]); "
            "assert t.encode('hi', add_special_tokens=False); print(sorted({'torch', 'vllm'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
