"""`python -m bench.perf.near_ties`: prompts whose greedy answer sits on a near-tie.

A near-tie is a position among the first 32 generated tokens where the top two candidates'
logprobs are within `--gap` (default 0.05) of each other: there, any difference in
arithmetic between two paths (a split request against an unsplit one, a cached prefix against
a fresh one) can flip the greedy token and every token after it. Such prompts are the ones a
token-identity test must include.

It runs the embedded model in vLLM's offline engine with pdserve's CPU settings (eager, no
chunked prefill, the "vec" attention kernel) over candidate chat prompts (the issue's Romeo
and Juliet prompt first, then questions padded to several lengths), and writes
`tests/serve/data/near_ties.json` (below the current directory; `--out` elsewhere): each prompt (as chat messages), its token count, the
positions of its near-ties and their gaps, and the engine settings used.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Relative to where it runs (the checkout's root): the test data the suite reads.
OUT = Path("tests") / "serve" / "data" / "near_ties.json"

ROMEO = ("Summarise the plot of Romeo and Juliet. "
         + "Please include the details of every scene, the names of the characters and what happens to them. " * 17)
QUESTIONS = ["Name three colors.", "Why is the sky blue?", "Write a haiku about rain.", "What is a prime number?",
             "Give me a recipe for pancakes.", "Explain photosynthesis simply.", "List four animals that fly.",
             "What does a compiler do?", "Describe the water cycle.", "Tell me a fact about Mars."]
PADS = (0, 40, 120)


def candidates() -> list[list[dict[str, str]]]:
    out = [[{"role": "user", "content": ROMEO.strip()}]]
    for q in QUESTIONS:
        for pad in PADS:
            text = (" ".join(f"Note {i}: keep the answer short." for i in range(pad // 8)) + " " + q).strip()
            out.append([{"role": "user", "content": text}])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gap", type=float, default=0.05, help="top-2 logprob gap that counts as a near-tie (default 0.05)")
    p.add_argument("--positions", type=int, default=32, help="generated positions searched (default 32)")
    p.add_argument("--keep", type=int, default=6, help="near-tie prompts kept (default 6)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("PDSERVE_CPU_ATTN_ISA", "vec")
    from vllm import LLM, SamplingParams

    from serve.model import resolve_model

    model = resolve_model(None)
    llm = LLM(model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, enable_chunked_prefill=False)
    params = SamplingParams(temperature=0, max_tokens=args.positions, logprobs=2, ignore_eos=True)
    found = []
    for messages in candidates():
        out = llm.chat(messages, params, use_tqdm=False)[0]
        ties = []
        for pos, lp in enumerate(out.outputs[0].logprobs or []):
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            if len(top) >= 2 and top[0] - top[1] <= args.gap:
                ties.append({"position": pos, "gap": round(top[0] - top[1], 4)})
        if ties:
            found.append({"messages": messages, "prompt_tokens": len(out.prompt_token_ids), "near_ties": ties})
        llm.reset_prefix_cache()
    keep = found[:1] + sorted(found[1:], key=lambda f: min(t["gap"] for t in f["near_ties"]))[:args.keep - 1]
    doc = {"made_by": "python -m bench.perf.near_ties", "gap": args.gap, "positions": args.positions,
           "engine": {"dtype": "bfloat16", "enforce_eager": True, "enable_chunked_prefill": False,
                      "cpu_attention": "vec", "prefix_cache": "reset before each prompt"},
           "searched": len(candidates()), "prompts": keep}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(found)} of {len(candidates())} prompts have a near-tie; kept {len(keep)} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
