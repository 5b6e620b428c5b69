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
from serve.sim.profile import ProfileError, load as load_profile
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
    kv_latency_s: float = 0.0  # per READ, on top of bytes over the bandwidth
    startup_s: float = 0.0  # the engine's start-up delay (a new worker is not ready at once)
    bytes_per_block: int = 0  # KV bytes of one block, all layers (what a READ of it moves)


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
    p.add_argument("--sim-step-model", default=None)
    p.add_argument("--sim-profile", default=None)
    p.add_argument("--sim-speedup", type=float, default=1.0)
    p.add_argument("--sim-startup-s", type=float, default=0.0)
    p.add_argument("--sim-kv-bandwidth-gbps", type=float, default=None)
    p.add_argument("--sim-kv-latency-ms", type=float, default=None)
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
    step, bandwidth, latency_s = _step_source(ns)
    # A profile knows its model's KV bytes per token; without one, the model directory's shape.
    per_token = getattr(step, "kv_bytes_per_token", 0)
    per_block = per_token * cfg.block_size if per_token else \
        shape.bytes_per_block_layer(cfg.block_size, cfg.kv_cache_dtype) * shape.num_layers
    blocks = ns.num_gpu_blocks if ns.num_gpu_blocks is not None else int(kv_cache_gib * 2**30 // per_block)
    if blocks < 1:
        raise ConfigError("the simulated KV cache holds no block: raise --kv-cache-gib or --num-gpu-blocks")
    if not ns.sim_speedup > 0:
        raise ConfigError("--sim-speedup must be > 0")
    if not ns.sim_startup_s >= 0:
        raise ConfigError("--sim-startup-s must be >= 0")
    return SimOptions(replace(cfg, num_blocks=blocks, speedup=ns.sim_speedup), step, shape, bandwidth, latency_s,
                      ns.sim_startup_s, per_block)


def _step_source(ns: argparse.Namespace) -> tuple[StepModel, float, float]:
    """The step model (--sim-step-model or --sim-profile, not both) and the KV link (the
    flags, else the profile's transfer block, else instant)."""
    if ns.sim_step_model is not None and ns.sim_profile is not None:
        raise ConfigError("--sim-step-model and --sim-profile: one step-time source, not both")
    bandwidth, latency_s = 0.0, 0.0
    if ns.sim_profile is not None:
        try:
            step: StepModel = load_profile(ns.sim_profile)
        except ProfileError as exc:
            raise ConfigError(f"--sim-profile {exc}") from None
        if step.transfer is not None:
            bandwidth, latency_s = step.transfer.bandwidth_gbps, step.transfer.latency_s
    else:
        try:
            step = parse_step_model(ns.sim_step_model or "constant")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if ns.sim_kv_bandwidth_gbps is not None:
        if ns.sim_kv_bandwidth_gbps < 0:
            raise ConfigError("--sim-kv-bandwidth-gbps must be >= 0")
        bandwidth = ns.sim_kv_bandwidth_gbps
    if ns.sim_kv_latency_ms is not None:
        if ns.sim_kv_latency_ms < 0:
            raise ConfigError("--sim-kv-latency-ms must be >= 0")
        latency_s = ns.sim_kv_latency_ms / 1000.0
    return step, bandwidth, latency_s
