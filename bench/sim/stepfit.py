"""A measured step-time profile (`pdserve.profile/1`) fitted to engine step records.

`pdserve bench calibrate --steps SRC...` reads the steps a worker's engine recorded
(`GET /steps` on a worker, or a file of its records: see `serve.step_hook`) and fits the
profile's step model to them:

    seconds = overhead + tokens(T) + decode_rate x sum(decode contexts) + prefill_rate x causal pairs

T is the step's tokens (one per decode, the new tokens of each prefill chunk), tokens() is
piecewise linear through knots at 8, 16, 32, ... tokens (zero at 0, linear below the first
knot), and the pairs of a prefill chunk with c tokens computed and n new are n*c + n(n+1)/2.
The unknowns are non-negative and tokens() never decreases (it is fitted as non-negative
increments between knots), by non-negative least squares on the relative error (each step
weighted by 1/its time: a 2 ms decode step counts as much as a 1 s prefill), with two weak
priors for what the steps cannot tell (`_priors`: tokens() straight where no step bends it;
attention pairs no larger than needed, which decides when every prompt has one length). Knots
past the largest step's tokens are dropped; the last one kept is at or above it.

Reported beside the profile: the fit's relative error per kind of step (prefill only,
decode only, mixed), p50 and p90: how well one model explains every step it saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.sim.errors import SimError
from serve.sim.profile import FORMAT, ProfileStep

KNOTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
Step = tuple[float, list[int], list[list[int]]]  # (seconds, decode contexts, prefill chunks [computed, new])


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """min |a x - b| subject to x >= 0 (Lawson and Hanson's active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > 1e-12 * max(1.0, np.abs(w).max())).any():
            break
        j = int(np.argmax(np.where(~passive, w, -np.inf)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def _tokens(decodes: Sequence[int], prefills: Sequence[Sequence[int]]) -> int:
    return len(decodes) + sum(n for _, n in prefills)


def _pairs(prefills: Sequence[Sequence[int]]) -> float:
    return float(sum(n * c + n * (n + 1) / 2 for c, n in prefills))


def _hat(t: float, knots: Sequence[int]) -> np.ndarray:
    """tokens(t) = sum y_j hat_j(t): piecewise linear through (0, 0) and (knot_j, y_j)."""
    row = np.zeros(len(knots))
    prev = 0
    for j, k in enumerate(knots):
        if t <= k:
            f = (t - prev) / (k - prev)
            row[j] = f
            if j > 0:
                row[j - 1] = 1 - f
            return row
        prev = k
    row[-1] = 1.0 + (t - knots[-1]) / (knots[-1] - (knots[-2] if len(knots) > 1 else 0))  # past the last knot
    if len(knots) > 1:
        row[-2] = -(t - knots[-1]) / (knots[-1] - knots[-2])
    return row


def fit(steps: Sequence[Step]) -> tuple[ProfileStep, dict[str, Any]]:
    """The step model that best explains `steps`, and its relative errors."""
    steps = [s for s in steps if s[0] > 0 and _tokens(s[1], s[2]) > 0]
    if len(steps) < 8:
        raise SimError(f"{len(steps)} steps with work: at least 8 are needed to fit a profile")
    top = max(_tokens(d, p) for _, d, p in steps)
    knots = [k for k in KNOTS if k < top]
    last = KNOTS[-1]
    while last < top:  # steps past the table (chunked prefill off, a long context): keep doubling
        last *= 2
        if last < top:
            knots.append(last)
    knots.append(next((k for k in KNOTS if k >= top), last))
    # A knot needs steps near it (within a factor of 2): between two supported knots the
    # curve is a straight line, not free values no step constrains (a profile calibrated on
    # few decodes and long prompts would otherwise price 16 decodes as 4).
    counts = sorted(_tokens(d, p) for _, d, p in steps)
    knots = [k for k in knots[:-1] if _near(counts, k)] + knots[-1:]
    nk = len(knots)
    # Columns: overhead, increments of tokens() at each knot (cumulative: monotone), decode rate, prefill rate.
    cum = np.tril(np.ones((nk, nk)))  # y = cum @ delta
    rows, y = [], []
    for s, d, p in steps:
        hat = _hat(_tokens(d, p), knots)
        rows.append(np.concatenate(([1.0], hat @ cum, [float(sum(d)), _pairs(p)])))
        y.append(s)
    a, b = np.array(rows), np.array(y)
    w = 1.0 / b
    aw, bw = np.vstack([a * w[:, None], _priors(steps, knots)]), np.concatenate([b * w, np.zeros(nk)])
    scale = np.abs(aw).max(axis=0)
    scale[scale == 0] = 1.0
    x = nnls(aw / scale, bw) / scale
    overhead, delta, rate_d, rate_p = x[0], x[1:1 + nk], x[1 + nk], x[2 + nk]
    ys = cum @ delta
    step = ProfileStep(overhead_s=float(overhead), token_points=tuple((k, float(v)) for k, v in zip(knots, ys)),
                       prefill_pair_s=float(rate_p), decode_context_s=float(rate_d), label="profile:measured")
    errors: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
    for s, d, p in steps:
        kind = "mixed" if d and p else "prefill" if p else "decode"
        errors[kind].append(abs(step.step_seconds(d, [tuple(c) for c in p]) / s - 1))  # type: ignore[misc]
    report = {"steps": len(steps), "max_step_tokens": top,
              "relative_error": {k: {"steps": len(v), "p50": _q(v, 0.5), "p90": _q(v, 0.9)}
                                 for k, v in errors.items() if v}}
    return step, report


SMOOTH = 0.1  # weight of a slope change between adjacent token segments (relative to a typical slope)
PAIR_PRIOR = 0.1  # weight of the attention-pair term's share of a typical prefill step


def _priors(steps: Sequence[Step], knots: Sequence[int]) -> np.ndarray:
    """Weak priors, rows of the weighted system whose target is 0, for what the steps leave
    undetermined (a step's own row weighs 1 against these 0.1s, and there are hundreds):
    - tokens() bends only where steps say so: each interior knot adds SMOOTH x (the change of
      slope there) / a typical seconds per token. Between knots no step is near, the curve is
      then a straight line, not one flat segment and one steep one.
    - the attention-pair term is no larger than the steps need: PAIR_PRIOR x its share of a
      typical prefill step. When every prompt has the same length, pairs are a fixed multiple
      of tokens and the two cannot be told apart; the linear layers (tokens) then take the cost
      (at 256 tokens attention is a few percent of a small model's prefill FLOPs)."""
    nk = len(knots)
    rows = np.zeros((nk, 1 + nk + 2))
    # A typical slope of tokens() where its bends matter: that of the steps with prompts in them.
    # Over every step it is a decode step's seconds per token (one token each), 30x a prefill's
    # on an AVX-512 CPU, which made the smoothing 30x weaker than meant: two noisy 512-token
    # prefills and one of 768 then bent tokens() steep and flat, and prompts past 768 tokens
    # cost nothing more (the CPU check's c8 and c16 TTFT -62% and -82%).
    with_prompts = [s for s in steps if s[2]] or list(steps)
    per_token = float(np.median([s / max(1, _tokens(d, p)) for s, d, p in with_prompts]))
    edges = [0, *knots]
    for j in range(1, nk):  # slope of segment j minus slope of segment j+1, in increments of tokens()
        rows[j - 1, 1 + j - 1] = SMOOTH / (edges[j] - edges[j - 1]) / per_token
        rows[j - 1, 1 + j] = -SMOOTH / (edges[j + 1] - edges[j]) / per_token
    prefills = [(s, _pairs(p)) for s, d, p in steps if p]
    if prefills:
        seconds, pairs = np.median([s for s, _ in prefills]), np.median([q for _, q in prefills])
        rows[nk - 1, -1] = PAIR_PRIOR * pairs / seconds
    return rows


def _near(sorted_counts: list[int], k: int) -> bool:
    import bisect

    i = bisect.bisect_left(sorted_counts, k / 2)
    return i < len(sorted_counts) and sorted_counts[i] <= 2 * k


def _q(v: list[float], q: float) -> float:
    v = sorted(v)
    return round(v[min(len(v) - 1, int(q * len(v)))], 4)


def parse_records(lines: Iterable[str], where: str) -> list[Step]:
    out: list[Step] = []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            r = json.loads(line)
            out.append((float(r["s"]), [int(c) for c in r["d"]], [[int(c), int(n)] for c, n in r["p"]]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SimError(f"{where}:{i}: not a step record ({exc})") from None
    return out


def read_steps(src: str, token: str | None = None) -> tuple[list[Step], dict[str, Any]]:
    """Steps from a worker URL (`GET /steps`, its `/info` for the KV bytes) or a file: step
    records as JSON lines, or a saved `/steps` reply."""
    if src.startswith(("http://", "https://")):
        import httpx

        from serve.auth import token_headers

        base = src.rstrip("/")
        try:
            with httpx.Client(timeout=30, headers=token_headers(token)) as c:
                reply = c.get(f"{base}/steps").raise_for_status().json()
                info = c.get(f"{base}/info").raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SimError(f"{src}: cannot read its steps ({exc})") from None
        meta = {"source": src, "engine": reply.get("engine"), "simulated": reply.get("simulated"),
                "role": reply.get("role"),
                "kv_bytes_per_token": (info.get("kv_bytes_per_block") or 0) // max(1, info.get("block_size") or 1),
                "kv_cache_dtype": info.get("kv_cache_dtype"), "model": info.get("served_model_name"),
                "kv_cache_tokens": (info.get("num_kv_blocks") or 0) * (info.get("block_size") or 0)}
        return parse_records((json.dumps(r) for r in reply.get("steps", [])), src), meta
    path = Path(src)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SimError(f"{src}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("{") and '"steps"' in text.split("\n", 1)[0]:
        reply = json.loads(text)
        return parse_records((json.dumps(r) for r in reply.get("steps", [])), src), {
            "source": src, "engine": reply.get("engine"), "simulated": reply.get("simulated")}
    return parse_records(text.splitlines(), src), {"source": src}


def calibrate_steps(sources: list[str], out: str, token: str | None = None, system: str = "measured",
                    tp: int = 1) -> dict[str, Any]:
    """Fit one profile to every step of `sources` and write it to `out`."""
    steps: list[Step] = []
    metas = []
    for src in sources:
        got, meta = read_steps(src, token)
        steps += got
        metas.append({**meta, "steps": len(got)})
    step, report = fit(steps)
    kv = next((m["kv_bytes_per_token"] for m in metas if m.get("kv_bytes_per_token")), 0)
    simulated = any(m.get("simulated") for m in metas)
    doc = step.to_dict(source={"kind": "measured", "from": metas, "fit": report, "simulated": simulated,
                               "model_file": "bench/sim/stepfit.py"},
                       model=next((m["model"] for m in metas if m.get("model")), None), system=system,
                       tp=tp, kv_cache_dtype=next((m["kv_cache_dtype"] for m in metas if m.get("kv_cache_dtype")), None))
    doc["kv_bytes_per_token"] = kv
    cache = next((m["kv_cache_tokens"] for m in metas if m.get("kv_cache_tokens")), 0)
    if cache:
        doc["kv_cache_tokens"] = cache  # one engine's KV capacity (what the planner needs of a system)
    assert doc["format"] == FORMAT
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1) + "\n")
    label = " (SIMULATED steps)" if simulated else ""
    print(f"fitted {report['steps']} steps{label}: overhead {step.overhead_s * 1e3:.3f} ms, tokens(1..{report['max_step_tokens']}) "
          f"{step.tokens_seconds(1) * 1e3:.3f}..{step.tokens_seconds(report['max_step_tokens']) * 1e3:.3f} ms, "
          f"decode {step.decode_context_s * 1e9:.3f} ns per context token, "
          f"prefill {step.prefill_pair_s * 1e12:.3f} ps per pair")
    for kind, e in report["relative_error"].items():
        print(f"  {kind:<8} {e['steps']:>6} steps: relative error p50 {e['p50'] * 100:.1f}%, p90 {e['p90'] * 100:.1f}%")
    print(f"written: {target}")
    return doc
