"""Building a vLLM AsyncLLM engine for a worker, with this machine's CPU settings.

Only the worker process imports this module (it imports vLLM). The CPU environment must
be in place before vLLM is imported, so `cpu_environment` is applied by the CLI first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve.cpu_attention import DEFAULT as CPU_ATTN_DEFAULT
from serve.cpu_attention import ENV as CPU_ATTN_ENV
from serve.errors import ConfigError


MALLOC_TRIM_S = 30
ONEDNN_CACHE = 128  # oneDNN primitives kept process-wide (oneDNN's default: 1024)


def cpu_environment(host_ip: str, cpu_cores: str | None, kv_cache_gib: float) -> dict[str, str]:
    """The environment a CPU vLLM engine needs here (see shared/platform.md).

    - VLLM_HOST_IP: otherwise vLLM picks a non-loopback address.
    - VLLM_CPU_KVCACHE_SPACE: otherwise the KV cache is sized from total RAM.
    - VLLM_CPU_OMP_THREADS_BIND: pin the engine to its own core(s); vLLM's automatic
      binding spreads one worker over both cores and runs ~10x slower with a KV connector.
    - ONEDNN_PRIMITIVE_CACHE_CAPACITY: vllm-cpu runs its linear layers through oneDNN,
      which compiles and caches one matmul primitive per distinct token count; oneDNN keeps
      1024 by default, and a prefill engine, whose steps have a new token count almost
      every time, grows by hundreds of MiB until that cache is full. vLLM's own per-layer
      caches still hold the 32 most recent shapes of each layer.
    - PDSERVE_MALLOC_TRIM_S: hand freed heap memory back every so often (serve.allocator),
      or the engine's RSS climbs with glibc's retained free chunks (primitives compiled
      and dropped, activations of varying size).
    - PDSERVE_CPU_ATTN_ISA: "vec", vLLM's AVX-512/AVX2 attention kernel, not its AMX one,
      which gives wrong tokens on the embedded model (serve.cpu_attention).
    A value already in the environment wins for these three; PDSERVE_MALLOC_TRIM_S=0 turns
    trimming off, PDSERVE_CPU_ATTN_ISA=auto leaves the kernel to vLLM.
    """
    env = {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE)),
        "PDSERVE_MALLOC_TRIM_S": os.environ.get("PDSERVE_MALLOC_TRIM_S", str(MALLOC_TRIM_S)),
        CPU_ATTN_ENV: os.environ.get(CPU_ATTN_ENV, CPU_ATTN_DEFAULT),
        "VLLM_HOST_IP": host_ip,
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cpu_cores and cpu_cores != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    return env


def apply_environment(env: dict[str, str]) -> None:
    for key, value in env.items():
        os.environ[key] = value


@dataclass
class EngineStats:
    """Latest scheduler view of the engine, fed by `StatsCollector`.

    `on_kv_stats` receives the KV connector's stats dict (kvtransfer.stats) each time the
    engine reports one.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    on_kv_stats: Callable[[dict[str, Any]], None] | None = None


COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--compilation-config", "-cc")
CHUNKED_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")


def _chose(passthrough: list[str], flags: tuple[str, ...]) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") or (flag == "-O" and arg.startswith("-O"))
               for arg in passthrough for flag in flags)


def with_cpu_defaults(passthrough: list[str]) -> list[str]:
    """vLLM flags pdserve adds on CPU, each only where the user did not choose it.

    - `--enforce-eager`: vllm-cpu 0.32.0's compiled (inductor) model gives wrong greedy
      output for the embedded SmolLM2 model (eager and Hugging Face agree: "The capital of
      France is Paris."; the compiled graph answers "L'Etoile, la Marseillaise, ..."), its
      compile cache fails to reload ("'function' object has no attribute
      'finalize_loading'"), and compiling costs ~60 s per start. Eager is correct and
      starts in seconds.
    - `--no-enable-chunked-prefill`: with chunked prefill, vllm-cpu 0.32's engine core dies
      on the first request with a `seed` whose prompt is prefilled in more than one step
      ("RuntimeError: CPU Generator does not use offset": the model runner rewinds the
      seeded generator for the sample it discards after a partial prefill, and a CPU
      generator cannot rewind). Without chunking no prefill is partial, so nothing is
      rewound; the step's token budget becomes max(max_model_len, 2048), so every prompt
      fits in one step.
    """
    added = []
    if not _chose(passthrough, COMPILE_FLAGS):
        added.append("--enforce-eager")
    if not _chose(passthrough, CHUNKED_PREFILL_FLAGS):
        added.append("--no-enable-chunked-prefill")
    return [*added, *passthrough]


def seeds_supported(vllm_config: Any) -> bool:
    """Whether this engine can serve requests with a `seed` (see `with_cpu_defaults`)."""
    return not (is_cpu_platform() and vllm_config.scheduler_config.enable_chunked_prefill)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_avx512_or_amx() -> bool:
    """x86 with AVX-512 or AMX: what vLLM's CPU attention needs for an fp8 KV cache (the test
    its CPU backend makes when it builds its attention metadata), and for fast 16-bit kernels."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def slow_cpu_hint(dtype: str, on_cpu: bool, fast_kernels) -> str | None:
    """A warning for a CPU without AVX-512 or AMX running a 16-bit model: vLLM's CPU kernels
    are much slower there (measured on the embedded model, AVX2 only: prefill 4.8x faster
    with --dtype float32, decode 1.4x slower). `fast_kernels` is called only when it matters."""
    if not on_cpu or str(dtype) not in ("auto", "bfloat16", "bf16", "float16", "half") or fast_kernels():
        return None
    return ("this CPU has neither AVX-512 nor AMX: vLLM's 16-bit CPU kernels are slow here "
            "(prefill measured 4.8x faster with --dtype float32 on the embedded model, decode 1.4x slower)")


def check_kv_cache_dtype(kv_cache_dtype: str, on_cpu: bool, fp8_supported) -> None:
    """ConfigError (one line) for an fp8 KV cache that vLLM's CPU backend cannot hold here:
    vLLM itself fails only deep in engine start-up, after loading the weights.
    `fp8_supported` is called only when it matters."""
    if on_cpu and str(kv_cache_dtype).startswith("fp8") and not fp8_supported():
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: vLLM's CPU backend keeps an fp8 KV cache only on "
                          "x86 with AVX-512 or AMX, and this CPU has neither; use --kv-cache-dtype auto")


def parse_engine_args(model: str, passthrough: list[str], served_model_name: str) -> Any:
    """vLLM's own engine arguments, parsed from the worker's extra flags verbatim."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if is_cpu_platform():
        passthrough = with_cpu_defaults(passthrough)

    parser = FlexibleArgumentParser(prog="pdserve worker (vLLM engine arguments)")
    parser = AsyncEngineArgs.add_cli_args(parser)
    try:
        ns = parser.parse_args(["--model", model, "--served-model-name", served_model_name, *passthrough])
    except SystemExit as exc:
        raise ConfigError(f"invalid vLLM engine arguments: {' '.join(passthrough)}") from exc
    check_kv_cache_dtype(ns.kv_cache_dtype, is_cpu_platform(), cpu_avx512_or_amx)
    return AsyncEngineArgs.from_cli_args(ns)


def stats_logger_factory(stats: EngineStats) -> Any:
    """A vLLM stat-logger factory that copies scheduler stats into `stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StatsCollector(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            stats.kv_usage = scheduler_stats.kv_cache_usage
            kv = scheduler_stats.kv_connector_stats
            if kv and stats.on_kv_stats is not None:
                stats.on_kv_stats(kv)

        def log_engine_initialized(self) -> None:
            pass

    return StatsCollector


def start_engine(engine_args: Any, stats: EngineStats) -> Any:
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(engine_args, stat_loggers=[stats_logger_factory(stats)])


def kv_transfer_config(role: str, engine_id: str, side_channel_host: str, side_channel_port: int,
                       lease_seconds: float, transport: str, fault_pause_s: float = 0.0,
                       transfer_mode: str = "auto") -> str:
    """`--kv-transfer-config` JSON that loads pdserve's own connector (kvtransfer.connector)."""
    import json

    from kvtransfer.protocol import ConnectorSettings

    extra = ConnectorSettings(engine_id=engine_id, side_channel_host=side_channel_host,
                              side_channel_port=side_channel_port, lease_seconds=lease_seconds,
                              transport=transport, transfer_mode=transfer_mode,
                              fault_pause_s=fault_pause_s).to_extra_config()
    return json.dumps({
        "kv_connector": "PdConnector",
        "kv_connector_module_path": "kvtransfer.connector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        # A failed or expired read is recomputed locally instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    })
