"""Prompts with exact token counts under the run's tokenizer.

A prompt's length is what the server reports as `usage.prompt_tokens`: for the chat endpoint
the chat template is applied with the generation prompt (as vLLM does), for completions the
tokenizer's special tokens (a BOS, say) are added. `--isl` is that whole count, template and
any shared prefix included.

How counts are made exact: the text is built from words that are one token each, both with
and without a leading space (" the", "the"). Byte-level BPE and SentencePiece tokenizers split
text at spaces before merging, so n such words joined by spaces are n tokens. Every prompt is
still checked with the tokenizer afterwards (`fit`), and trimmed or padded a word at a time
until it matches; a tokenizer for which that does not converge is an error, never a silent
miscount. Tokenizing every prompt costs about 1 s per million tokens on this machine, so for
large runs a random sample is tokenized and the rest checked by word count (`fit(sample=...)`);
any mismatch in the sample makes it tokenize all of them.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from bench.loadgen.errors import LoadgenError

# Common English words; those that are one token (with and without a leading space) under
# the run's tokenizer become the word pool. The vocabulary is scanned only if too few are.
_COMMON = """
the of and to in is for on that with as it at by from this be or an are was not but have
all can will one more time has they which about their out new over what up other there
into some may first any year work only people use make made like most over such just
long last under great state know each while place still world after much both year house
part plan light water small large point right head city local game early order river
market power money family story music field study rule line book word ground black white
green blue red open close fire stone wind rain snow tree road ship train plane cloud sun
moon star sea lake hill farm bird fish horse dog cat king queen child woman man friend
table door window paper letter note page list group team club member level class price
value cost rate number system program data test model design form style color voice sound
image video film show news report review event party day week month hour night morning
summer winter spring fall north south east west center side front back top bottom left
""".split()

MIN_POOL = 64


class PromptBuilder:
    """Builds prompt texts of exact token counts for one tokenizer and endpoint type."""

    def __init__(self, tokenizer: Any, endpoint_type: str) -> None:
        if endpoint_type not in ("chat", "completions"):
            raise LoadgenError(f"endpoint type {endpoint_type!r}: expected chat or completions")
        self.tok = tokenizer
        self.chat = endpoint_type == "chat"
        self.words = self._word_pool()
        self.overhead = self._overhead()

    # -- counting, the way the server counts ---------------------------------------------
    def count(self, content: str) -> int:
        """Tokens the server counts for a prompt whose (user) content is `content`."""
        if self.chat:
            text = self.tok.apply_chat_template([{"role": "user", "content": content}],
                                                tokenize=False, add_generation_prompt=True)
            return len(self.tok.encode(text, add_special_tokens=False))
        return len(self.tok.encode(content))

    def count_messages(self, messages: list[dict]) -> int:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))

    def _content_tokens(self, texts: Sequence[str]) -> list[int]:
        enc = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in enc]

    def _overhead(self) -> int:
        """Tokens a prompt has beyond its content's own: chat template, or BOS/EOS."""
        sample = " ".join(self.words[:8])
        return self.count(sample) - self._content_tokens([sample])[0]

    def _single(self, text: str) -> bool:
        return len(self.tok.encode(text, add_special_tokens=False)) == 1

    def _word_pool(self) -> list[str]:
        seen: set[str] = set()
        pool = []
        for w in _COMMON:
            if w not in seen and self._single(w) and self._single(" " + w):
                seen.add(w)
                pool.append(w)
        if len(pool) < MIN_POOL:
            pool += self._scan_vocab(seen, MIN_POOL * 4)
        if len(pool) < 8:
            raise LoadgenError("the tokenizer has too few single-token words to build prompts of exact length")
        return pool

    def _scan_vocab(self, seen: set[str], limit: int) -> list[str]:
        found = []
        for tid in range(min(len(self.tok), 200_000)):
            s = self.tok.decode([tid])
            w = s.strip()
            if (s.startswith(" ") and w.isascii() and w.isalpha() and 3 <= len(w) <= 10
                    and w not in seen and self._single(w) and self._single(" " + w)):
                seen.add(w)
                found.append(w)
                if len(found) >= limit:
                    break
        return found

    # -- building ---------------------------------------------------------------------------
    def words_text(self, n: int, rng: random.Random) -> str:
        """n pool words joined by spaces: n tokens."""
        return " ".join(rng.choices(self.words, k=n))

    def min_isl(self) -> int:
        return self.overhead + 1

    def content_budget(self, isl: int) -> int:
        """Content tokens of a prompt of `isl` tokens in all."""
        budget = isl - self.overhead
        if budget < 1:
            kind = "the chat template" if self.chat else "special tokens"
            raise LoadgenError(f"input length {isl} is too short: {kind} alone take {self.overhead} tokens "
                               f"(the smallest is {self.min_isl()})")
        return budget

    def build(self, isl: int, rng: random.Random, prefix: str = "", prefix_tokens: int = 0) -> str:
        """A content text whose whole prompt is exactly `isl` tokens; starts with `prefix`
        (of `prefix_tokens` tokens) when given."""
        budget = self.content_budget(isl)
        if prefix and prefix_tokens >= budget:
            raise LoadgenError(f"prefix of {prefix_tokens} tokens leaves no room in a prompt of {isl} tokens "
                               f"(content budget {budget})")
        rest = self.words_text(budget - prefix_tokens, rng)
        return f"{prefix} {rest}" if prefix else rest

    def fit(self, texts: list[str], targets: list[int], rng: random.Random,
            sample: int | None = None) -> list[str]:
        """Check each content text against its target prompt length and correct it by whole
        words until it matches. Raises LoadgenError if a text does not converge.

        With `sample`, only that many texts (chosen at random) are tokenized when all the
        texts are plain pool words (one token per word by construction); if any of them is
        off, all are tokenized."""
        out = list(texts)
        todo = list(range(len(out)))
        if sample is not None and len(out) > sample:
            words = [len(t.split(" ")) for t in out]
            if all(w == t - self.overhead for w, t in zip(words, targets)):
                picked = rng.sample(todo, sample)
                counts = self._content_tokens([out[i] for i in picked])
                if all(n == targets[i] - self.overhead for i, n in zip(picked, counts)):
                    return out
        for _ in range(8):
            if not todo:
                return out
            counts = self._content_tokens([out[i] for i in todo])
            wrong = []
            for i, n in zip(todo, counts):
                diff = (targets[i] - self.overhead) - n
                if diff == 0:
                    continue
                wrong.append(i)
                if diff > 0:
                    out[i] = out[i] + " " + self.words_text(diff, rng)
                else:
                    words = out[i].split(" ")
                    out[i] = " ".join(words[:max(1, len(words) + diff)])
            todo = wrong
        if todo:
            raise LoadgenError(f"could not build prompts of exact length under this tokenizer "
                               f"({len(todo)} of {len(out)} off)")
        return out

    def check_whole(self, content: str, isl: int) -> None:
        """Count one prompt end to end (template included); the batch check counts contents
        only, so this guards the template-overhead assumption."""
        n = self.count(content)
        if n != isl:
            raise LoadgenError(f"prompt built for {isl} tokens counts {n} with the chat template applied")
