"""Tokenization in the frontend: chat template, encoding, and streaming detokenization.

The router needs token ids, so prompts are tokenized here, once. `IncrementalDetokenizer`
turns a growing list of token ids into text deltas that never split a UTF-8 character
(a byte-level BPE token can hold part of one; its text then ends in U+FFFD until the
rest arrives) and that never show a stop string or its beginning.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from serve.errors import ModelError

REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, model: str) -> None:
        try:
            self.hf = _load(model, _version(model))
        except Exception as exc:  # transformers raises many types for a bad directory
            raise ModelError(f"cannot load the tokenizer of {model}: {exc}") from exc
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # Streaming decodes twice per token: straight to the Rust tokenizer where that is what
        # transformers' decode would do anyway (a fast tokenizer that cleans up no spaces),
        # a third of the time of going through transformers' Python layer.
        backend = getattr(self.hf, "backend_tokenizer", None)
        cleans = getattr(self.hf, "clean_up_tokenization_spaces", True)
        self._decode = backend.decode if backend is not None and not cleans else self.hf.decode

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.has_chat_template:
            raise ModelError("this model has no chat template; use /v1/completions")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=True)

    def vocab_size(self) -> int:
        return len(self.hf)


def _version(model: str) -> int:
    """A local tokenizer's file version (0 for a hub id): a changed file is loaded again."""
    f = Path(model).expanduser() / "tokenizer.json"
    return f.stat().st_mtime_ns if f.is_file() else 0


@lru_cache(maxsize=8)
def _load(model: str, version: int) -> Any:
    """One tokenizer per model in a process: frontends sharing a process (a simulated
    cluster, tests) share it, as one frontend's requests already do."""
    from serve.common.hf_tokenizer import from_pretrained

    return from_pretrained(model)


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, with stop strings.

    Keeps two offsets into the token list (as vLLM does): text is decoded from
    `prefix_offset` so that the tokenizer sees enough context to place spaces right,
    and only the part after `read_offset` is new. Text that might be the start of a stop
    string is held back until it is known not to be.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.stop = [s for s in (stop or []) if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is safe to show."""
        if self.stopped:
            return ""
        for tid in token_ids:
            self.ids.append(tid)
            prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
            full = self.tok.decode(self.ids[self.prefix_offset:])
            if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
                continue  # incomplete character: wait for the next token
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of stream: release whatever is held back (a trailing partial char is dropped)."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self.emitted - self.holdback)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                cut = min(hits)
                out = self.text[self.emitted:cut]
                self.text = self.text[:cut]
                self.emitted = cut
                self.stopped = True
                return out
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


def normalize_content(content: Any) -> str:
    """OpenAI message content: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        parts.append(part.text)
    return "".join(parts)
