"""Step-time profiles (`pdserve.profile/1`): one file format for a simulated engine's step
times, whether they come from the planner's performance model or were measured on real
hardware (`pdserve bench calibrate`). The planner reads the same file as a system.

    {"format": "pdserve.profile/1",
     "source": {"kind": "planner" | "measured", ...},       what made it, free-form besides kind
     "model": "...", "system": "...", "tp": 1, "kv_cache_dtype": "fp8",
     "kv_bytes_per_token": 131072,                           K and V of every layer, per token
     "step": {
        "overhead_s": 0.0012,                                 fixed cost of any step
        "tokens": [[1, 0.004], [256, 0.0045], ...],           time of the token-proportional work
                                                              (GEMMs, norms, all-reduce) by the step's
                                                              tokens, piecewise linear, extended
                                                              linearly past the last point
        "prefill_attention_s_per_pair": 1.1e-12,              per (new token x context token) pair
        "decode_attention_s_per_context_token": 2.0e-9},      per context token of each decode
     "transfer": {"bandwidth_gbps": 25.0, "latency_s": 0.0002}}   optional: KV transfer link

`ProfileStep.step_seconds(decode_contexts, prefill_chunks)`: overhead + tokens(T) + per decode
its context x decode rate + per prefill chunk (c computed, n new) its causal pairs
n*c + n(n+1)/2 x prefill rate, T being the step's decode requests plus prefill tokens.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "pdserve.profile/1"


class ProfileError(ValueError):
    """A profile file that cannot be used (one line, naming the file and the field)."""


@dataclass(frozen=True)
class Transfer:
    bandwidth_gbps: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class ProfileStep:
    overhead_s: float
    token_points: tuple[tuple[int, float], ...]
    prefill_pair_s: float
    decode_context_s: float
    kv_bytes_per_token: int = 0
    transfer: Transfer | None = None
    label: str = "profile"

    @property
    def name(self) -> str:
        return self.label

    def tokens_seconds(self, tokens: int) -> float:
        pts = self.token_points
        if tokens <= pts[0][0]:
            return pts[0][1] * tokens / pts[0][0] if pts[0][0] else pts[0][1]
        i = bisect.bisect_left(pts, (tokens, float("-inf")))
        if i >= len(pts):  # past the last point: the last segment's slope
            (x0, y0), (x1, y1) = pts[-2] if len(pts) > 1 else (0, 0.0), pts[-1]
        else:
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def step_seconds(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        tokens = len(decode_contexts)
        pairs = 0.0
        for c, n in prefill_chunks:
            tokens += n
            pairs += n * c + n * (n + 1) / 2
        if not tokens:
            return self.overhead_s
        return (self.overhead_s + self.tokens_seconds(tokens) + self.decode_context_s * sum(decode_contexts)
                + self.prefill_pair_s * pairs)

    def to_dict(self, **meta: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {"format": FORMAT, **meta, "kv_bytes_per_token": self.kv_bytes_per_token,
                               "step": {"overhead_s": self.overhead_s, "tokens": [list(p) for p in self.token_points],
                                        "prefill_attention_s_per_pair": self.prefill_pair_s,
                                        "decode_attention_s_per_context_token": self.decode_context_s}}
        if self.transfer is not None:
            doc["transfer"] = {"bandwidth_gbps": self.transfer.bandwidth_gbps, "latency_s": self.transfer.latency_s}
        return doc


def _num(where: str, v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v:
        raise ProfileError(f"{where}: {field} must be a number >= 0, got {v!r}")
    return float(v)


def from_dict(doc: Any, where: str = "profile") -> ProfileStep:
    if not isinstance(doc, dict):
        raise ProfileError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise ProfileError(f"{where}: format {doc.get('format')!r}, expected {FORMAT!r}")
    step = doc.get("step")
    if not isinstance(step, dict):
        raise ProfileError(f"{where}: no 'step' object")
    raw = step.get("tokens")
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{where}: step.tokens must be a non-empty list of [tokens, seconds]")
    points: list[tuple[int, float]] = []
    for p in raw:
        if not (isinstance(p, list) and len(p) == 2):
            raise ProfileError(f"{where}: step.tokens entries are [tokens, seconds], got {p!r}")
        t = _num(where, p[0], "step.tokens[].tokens")
        if t < 1 or int(t) != t:
            raise ProfileError(f"{where}: step.tokens[].tokens must be an integer >= 1, got {p[0]!r}")
        points.append((int(t), _num(where, p[1], "step.tokens[].seconds")))
    points.sort()
    if len({t for t, _ in points}) != len(points):
        raise ProfileError(f"{where}: step.tokens has repeated token counts")
    transfer = None
    if doc.get("transfer") is not None:
        tr = doc["transfer"]
        if not isinstance(tr, dict):
            raise ProfileError(f"{where}: transfer must be an object")
        bw = _num(where, tr.get("bandwidth_gbps"), "transfer.bandwidth_gbps")
        if bw <= 0:
            raise ProfileError(f"{where}: transfer.bandwidth_gbps must be > 0")
        transfer = Transfer(bw, _num(where, tr.get("latency_s", 0.0), "transfer.latency_s"))
    src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    label = f"profile:{src.get('kind', '?')}:{doc.get('system', '?')}"
    return ProfileStep(overhead_s=_num(where, step.get("overhead_s", 0.0), "step.overhead_s"),
                       token_points=tuple(points),
                       prefill_pair_s=_num(where, step.get("prefill_attention_s_per_pair", 0.0),
                                           "step.prefill_attention_s_per_pair"),
                       decode_context_s=_num(where, step.get("decode_attention_s_per_context_token", 0.0),
                                             "step.decode_attention_s_per_context_token"),
                       kv_bytes_per_token=int(_num(where, doc.get("kv_bytes_per_token", 0), "kv_bytes_per_token")),
                       transfer=transfer, label=label)


def load(path: str | Path) -> ProfileStep:
    """Read a profile file; ProfileError (one line) if it is missing or malformed."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ProfileError(f"{p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ProfileError(f"{p}: invalid JSON: {exc}") from None
    return from_dict(doc, str(p))
