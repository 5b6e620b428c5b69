"""Incremental detokenization against the embedded model's real tokenizer."""

import pytest

from serve.frontend.tokenizer import IncrementalDetokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Prices: 12345 euros, 3.14159 and 2^10 = 1024!",
    "Unicode: naïve café, Zürich, 東京タワー, emoji 🎉🚀 and ümlauts.",
    "  leading spaces\n\nand\ttabs   trailing  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) + detok.finish() == "🎉"


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_stop_string_truncates_and_never_leaks(tokenizer, chunk):
    text = "one two three STOP four five"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    out = []
    for i in range(0, len(ids), chunk):
        out.append(detok.add(ids[i:i + chunk]))
        if detok.stopped:
            break
    out.append(detok.finish())
    joined = "".join(out)
    assert detok.stopped
    assert joined == "one two three "
    assert "ST" not in joined


def test_no_stop_match_releases_held_text_at_finish(tokenizer):
    ids = tokenizer.encode("alpha beta gam", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma"])
    shown = detok.add(ids)
    assert not shown.endswith("gam")  # could still become "gamma"
    assert shown + detok.finish() == "alpha beta gam"
    assert not detok.stopped


def test_special_tokens_are_not_shown(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) + detok.finish() == "Hello"


def test_the_direct_decode_equals_transformers_decode(tokenizer):
    """Streaming decodes through the Rust tokenizer where transformers would do the same."""
    ids = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=True)]
    ids += [tokenizer.eos_token_id or 0, 0, 1, 2]  # special tokens are skipped by both
    for n in range(1, len(ids), 7):
        assert tokenizer.decode(ids[:n]) == tokenizer.hf.decode(ids[:n], skip_special_tokens=True)
