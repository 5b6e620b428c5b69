"""`pdserve sim`'s engine flags: a light module (the CLI builds its parser from it at every
`pdserve` start; the options module reads the parsed values)."""

from __future__ import annotations

# The engine flags `pdserve worker --engine sim` takes; dests carry "engine_" (bench profile's
# --isl-block-size already has dest block_size).
ENGINE_FLAGS = (("--max-num-seqs", int), ("--max-model-len", int), ("--block-size", int), ("--num-gpu-blocks", int),
                ("--max-num-batched-tokens", int), ("--kv-cache-dtype", str), ("--sim-step-model", str),
                ("--sim-profile", str), ("--sim-kv-bandwidth-gbps", float), ("--sim-kv-latency-ms", float))


def engine_dest(flag: str) -> str:
    return "engine_" + flag.lstrip("-").replace("-", "_")
