"""The simulated engine's output tokens: real vocabulary ids, a pure function of
(prompt ids, position, sampling options, seed).

So a request split across a prefill and a decode worker answers exactly as it would on
one worker, greedy (temperature 0) and seeded requests repeat, and the frontend's real
detokenizer, stop strings and usage see ordinary tokens. An unseeded request with
temperature > 0 draws from a per-request random seed, as a real sampler would differ run
to run. The end-of-sequence token comes with probability `eos_rate` per position (when
`ignore_eos` is off and `min_tokens` is reached); `stop_token_ids` end the output too.
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b
from pathlib import Path

from serve import protocol as p

DEFAULT_VOCAB = 49152  # the embedded SmolLM2's


@dataclass(frozen=True)
class Vocabulary:
    """Token ids the simulator emits (plain word pieces), and the end-of-sequence id."""

    ids: tuple[int, ...]
    eos_id: int | None
    size: int

    @classmethod
    def from_model_dir(cls, model: str | None) -> Vocabulary:
        """Word pieces of the model's tokenizer.json (byte-level BPE: 'Ġ' + letters), else
        a plain id range when there is no tokenizer to read."""
        path = Path(model).expanduser() / "tokenizer.json" if model else None
        if path is None or not path.is_file():
            return cls(tuple(range(1000, DEFAULT_VOCAB)), None, DEFAULT_VOCAB)
        # Read once per file version: a simulated cluster builds one per worker.
        return _read_vocabulary(str(path.resolve()), path.stat().st_mtime_ns)

    @classmethod
    def _read(cls, path: Path) -> Vocabulary:
        doc = json.loads(path.read_text())
        vocab: dict[str, int] = doc["model"]["vocab"]
        words = sorted(i for tok, i in vocab.items() if tok.startswith("Ġ") and tok[1:].isascii()
                       and tok[1:].isalpha() and 2 <= len(tok) <= 9)
        eos = None
        cfg = path.parent / "generation_config.json"
        if cfg.is_file():
            raw = json.loads(cfg.read_text()).get("eos_token_id")
            eos = raw[0] if isinstance(raw, list) and raw else raw if isinstance(raw, int) else None
        size = max(vocab.values()) + 1
        for added in doc.get("added_tokens", []):
            size = max(size, int(added.get("id", 0)) + 1)
        return cls(tuple(words) or tuple(range(size)), eos, size)


@lru_cache(maxsize=8)
def _read_vocabulary(path: str, mtime_ns: int) -> Vocabulary:
    return Vocabulary._read(Path(path))


def request_key(prompt_ids: Sequence[int], sampling: p.SamplingOptions) -> bytes:
    """What the output depends on besides the position: the prompt, and the sampling seed
    (none for greedy; a fresh random one for an unseeded sampled request)."""
    h = blake2b(array("I", prompt_ids).tobytes(), digest_size=16)
    if sampling.temperature > 0:
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        h.update(b"t%r|p%r|s%d" % (sampling.temperature, sampling.top_p, seed))
    return h.digest()


def token_at(key: bytes, position: int, vocab: Vocabulary, sampling: p.SamplingOptions,
             eos_rate: float = 1 / 64) -> int:
    """The output token at `position` (0 = the first generated token)."""
    d = blake2b(key + position.to_bytes(4, "little"), digest_size=8).digest()
    x = int.from_bytes(d, "little")
    if (vocab.eos_id is not None and not sampling.ignore_eos and position >= sampling.min_tokens
            and (x >> 40) / float(1 << 24) < eos_rate):
        return vocab.eos_id
    return vocab.ids[x % len(vocab.ids)]


def is_stop(token: int, position: int, vocab: Vocabulary, sampling: p.SamplingOptions) -> bool:
    """The token ends the output (finish reason `stop`)."""
    if position + 1 < sampling.min_tokens:
        return False
    if token in sampling.stop_token_ids:
        return True
    return not sampling.ignore_eos and vocab.eos_id is not None and token == vocab.eos_id
