"""Router decision microbenchmark: a 4,000-token prompt, 64 prefill workers, 100k blocks
indexed. Reports p50/p99 of a whole decision (hashing included) and of scoring alone.

    python -m bench.router.micro [--workers 64] [--blocks 100000] [--tokens 4000] [--iters 2000]

(`bench.router.micro` runs this module, bench.perf.router_micro.)

Targets: decision p50 <= 200 us, scoring p50 <= 50 us. Pure Python, no I/O.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from router.router import Candidate, PrefillRouter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router.micro", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    r = PrefillRouter(args.block_size, "kv", use_kv_events=False, ttl_s=1e9, rng=rng)
    workers = [f"http://10.0.0.{i}:8100" for i in range(args.workers)]
    # Fill the index: random prefixes spread over the workers, args.blocks blocks in all.
    per = args.tokens // args.block_size
    filled = 0
    prompts = []
    while filled < args.blocks:
        ids = [rng.randrange(49152) for _ in range(args.tokens)]
        h = r.hashes(ids)
        r.index.record_routed(rng.choice(workers), h)
        filled += len(h)
        if len(prompts) < 64:
            prompts.append(ids)
    cands = [Candidate(w, inflight_prefill_blocks=rng.randrange(20)) for w in workers]
    decision, scoring = [], []
    for i in range(args.iters):
        ids = prompts[i % len(prompts)][: args.tokens // 2] + [rng.randrange(49152) for _ in range(args.tokens // 2)]
        t0 = time.perf_counter()
        h = r.hashes(ids)
        t1 = time.perf_counter()
        r.route_prefill(h, cands, len(ids), record=False)
        t2 = time.perf_counter()
        decision.append(t2 - t0)
        scoring.append(t2 - t1)

    def q(xs, p):
        return statistics.quantiles(xs, n=100)[p - 1] * 1e6

    out = {"workers": args.workers, "indexed_blocks": r.index.num_blocks(), "prompt_tokens": args.tokens,
           "blocks_per_prompt": per, "decision_p50_us": q(decision, 50), "decision_p99_us": q(decision, 99),
           "scoring_p50_us": q(scoring, 50), "scoring_p99_us": q(scoring, 99)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
