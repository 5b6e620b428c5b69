"""The simulated engine's options, parsed from the same engine flags pdserve users pass to
vLLM (`--max-num-seqs 16 --block-size 16 ...`), plus `--sim-*` options of its own. Any other
engine option is refused in one line: the simulator models only what it knows.

The model directory, when there is one, gives the defaults a vLLM engine would take from
it: `max_model_len` (max_position_embeddings) and the bytes of one KV block (layers x KV
heads x head size x 2 x dtype bytes x block size), which size the cache from
`--kv-cache-gib` when `--num-gpu-blocks` is not given.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from serve.errors import ConfigError
from serve.sim.engine import SimConfig
from serve.sim.timing import StepModel, parse_step_model

KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
                  "fp8_e5m2": 1, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    max_model_len: int = 8192
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64

    @classmethod
    def from_model_dir(cls, model: str | None) -> ModelShape:
        path = Path(model).expanduser() / "config.json" if model else None
        if path is None or not path.is_file():
            return cls()
        c = json.loads(path.read_text())
        heads = int(c.get("num_attention_heads") or 1)
        head_dim = int(c.get("head_dim") or (int(c.get("hidden_size") or 64 * heads) // heads))
        return cls(max_model_len=int(c.get("max_position_embeddings") or 8192),
                   num_layers=int(c.get("num_hidden_layers") or 1),
                   num_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim)

    def bytes_per_block_layer(self, block_size: int, kv_cache_dtype: str) -> int:
        return 2 * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES.get(kv_cache_dtype, 2) * block_size


@dataclass(frozen=True)
class SimOptions:
    engine: SimConfig
    step_model: StepModel
    shape: ModelShape
    kv_bandwidth_gbps: float = 0.0  # 0: a simulated READ takes no time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve worker --engine sim", add_help=False, exit_on_error=False,
                                allow_abbrev=False)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--kv-cache-dtype")
    # Accepted so a launch command `pdserve plan` writes runs as is; recorded in the engine
    # config, it changes neither the block pool nor (with the default step model) step times.
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int)
    p.add_argument("--sim-step-model", default="constant")
    p.add_argument("--sim-kv-bandwidth-gbps", type=float, default=0.0)
    p.add_argument("--sim-eos-rate", type=float, default=None)
    return p


def parse_sim_options(passthrough: list[str], model: str | None, kv_cache_gib: float) -> SimOptions:
    """SimOptions from engine flags; ConfigError (one line) on anything else."""
    try:
        ns, unknown = _parser().parse_known_args(passthrough)
    except (argparse.ArgumentError, ValueError) as exc:
        raise ConfigError(f"--engine sim: {exc}") from None
    if unknown:
        raise ConfigError(f"--engine sim does not model engine option {unknown[0]} (it takes --max-num-seqs, "
                          "--max-model-len, --block-size, --num-gpu-blocks, --[no-]enable-prefix-caching, "
                          "--max-num-batched-tokens, --[no-]enable-chunked-prefill, --kv-cache-dtype, "
                          "--tensor-parallel-size, --sim-*)")
    shape = ModelShape.from_model_dir(model)
    cfg = SimConfig()
    mml = ns.max_model_len or shape.max_model_len
    chunked = True if ns.enable_chunked_prefill is None else ns.enable_chunked_prefill
    batched = ns.max_num_batched_tokens or (2048 if chunked else max(mml, 2048))
    cfg = replace(cfg, max_model_len=mml, enable_chunked_prefill=chunked, max_num_batched_tokens=batched)
    for name in ("max_num_seqs", "block_size", "kv_cache_dtype", "tensor_parallel_size"):
        if getattr(ns, name) is not None:
            cfg = replace(cfg, **{name: getattr(ns, name)})
    if ns.enable_prefix_caching is not None:
        cfg = replace(cfg, enable_prefix_caching=ns.enable_prefix_caching)
    if ns.sim_eos_rate is not None:
        if not 0 <= ns.sim_eos_rate <= 1:
            raise ConfigError("--sim-eos-rate must be within 0..1")
        cfg = replace(cfg, eos_rate=ns.sim_eos_rate)
    if cfg.kv_cache_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: one of {', '.join(KV_DTYPE_BYTES)}")
    if min(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, cfg.max_num_batched_tokens,
           cfg.tensor_parallel_size) < 1:
        raise ConfigError("--max-num-seqs, --max-model-len, --block-size, --max-num-batched-tokens and "
                          "--tensor-parallel-size must be >= 1")
    if not chunked and batched < mml:
        raise ConfigError(f"--max-num-batched-tokens {batched} < --max-model-len {mml} without chunked prefill")
    per_block = shape.bytes_per_block_layer(cfg.block_size, cfg.kv_cache_dtype) * shape.num_layers
    blocks = ns.num_gpu_blocks if ns.num_gpu_blocks is not None else int(kv_cache_gib * 2**30 // per_block)
    if blocks < 1:
        raise ConfigError("the simulated KV cache holds no block: raise --kv-cache-gib or --num-gpu-blocks")
    if ns.sim_kv_bandwidth_gbps < 0:
        raise ConfigError("--sim-kv-bandwidth-gbps must be >= 0")
    try:
        step = parse_step_model(ns.sim_step_model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return SimOptions(replace(cfg, num_blocks=blocks), step, shape, ns.sim_kv_bandwidth_gbps)
