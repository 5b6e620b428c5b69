"""`EngineBackend` over vLLM's AsyncLLM: sampling options become SamplingParams, vLLM's
request outputs become `TokenDelta`s, and KV transfer params cross through the one
conversion in `kvtransfer.protocol`. Only a worker with `--engine vllm` imports vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from serve import protocol as p
from serve.engine import EngineStats, seeds_supported, start_engine
from serve.worker.backend import EngineFacts, EngineLoad, InvalidRequest


def _finish_reason(reason: str | None) -> p.FinishReason:
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    return "stop"


def _kv_wait(out: Any) -> float | None:
    """A decode request's wait in the engine from queued to first scheduled: its KV load (and
    any queueing before it), from vLLM's per-request stats where it keeps them."""
    m = getattr(out, "metrics", None)
    queued, scheduled = getattr(m, "queued_ts", 0.0), getattr(m, "scheduled_ts", 0.0)
    if not queued or not scheduled:
        return None
    return max(0.0, scheduled - queued)


def kv_bytes_per_block(cfg: Any) -> int:
    """KV bytes of one block over all layers (K and V; the bytes a READ of it moves), from
    the engine's own config; 0 where it cannot say (the frontend then sizes transfers in
    blocks)."""
    try:
        import torch

        mc, pc, cc = cfg.model_config, cfg.parallel_config, cfg.cache_config
        dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
        if isinstance(dtype, str):
            dtype_bytes = 1 if dtype.startswith("fp8") else 4 if dtype in ("float32", "float") else 2
        else:
            dtype_bytes = torch.empty((), dtype=dtype).element_size()
        return int(2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * dtype_bytes
                   * cc.block_size)
    except Exception:  # noqa: BLE001 - a fact for routing estimates, never a reason not to start
        return 0


class VllmBackend:
    name = "vllm"

    def __init__(self, engine_args: Any) -> None:
        self.engine_args = engine_args
        self.stats = EngineStats()
        self.engine: Any = None

    @property
    def on_kv_stats(self) -> Callable[[Any], None] | None:
        return self.stats.on_kv_stats

    @on_kv_stats.setter
    def on_kv_stats(self, sink: Callable[[Any], None] | None) -> None:
        self.stats.on_kv_stats = sink

    async def start(self) -> EngineFacts:
        self.engine = start_engine(self.engine_args, self.stats)
        cfg = self.engine.vllm_config
        return EngineFacts(max_model_len=cfg.model_config.max_model_len, block_size=cfg.cache_config.block_size,
                           kv_cache_dtype=str(cfg.cache_config.cache_dtype),
                           num_kv_blocks=int(cfg.cache_config.num_gpu_blocks or 0), seeds=seeds_supported(cfg),
                           kv_bytes_per_block=kv_bytes_per_block(cfg))

    def sampling_params(self, req: p.GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from kvtransfer.protocol import remote_decode_request, to_vllm_params

        s = req.sampling
        extra = None
        if req.remote_decode:
            extra = {"kv_transfer_params": remote_decode_request()}
        elif req.kv_transfer is not None:
            extra = {"kv_transfer_params": to_vllm_params(req.kv_transfer, req.kv_transfer_mode)}
        try:
            return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                  ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
                                  stop_token_ids=list(s.stop_token_ids) or None, detokenize=False,
                                  output_kind=RequestOutputKind.DELTA, extra_args=extra)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(str(exc)) from None

    async def generate(self, req: p.GenerateRequest) -> AsyncIterator[p.TokenDelta]:
        from kvtransfer.protocol import from_vllm_params

        params = self.sampling_params(req)
        first = True
        async for out in self.engine.generate({"prompt_token_ids": req.prompt_token_ids}, params, req.request_id):
            comp = out.outputs[0]
            yield p.TokenDelta(
                token_ids=list(comp.token_ids),
                finished=out.finished,
                finish_reason=_finish_reason(comp.finish_reason) if out.finished else None,
                num_prompt_tokens=len(req.prompt_token_ids) if first else None,
                num_cached_tokens=out.num_cached_tokens if (first or out.finished) else None,
                kv_transfer=from_vllm_params(out.kv_transfer_params) if out.finished else None,
                kv_load_s=_kv_wait(out) if first and req.kv_transfer is not None else None,
            )
            first = False

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def reset_prefix_cache(self) -> bool:
        ok = await self.engine.reset_prefix_cache()
        return bool(ok) if ok is not None else True

    def load(self) -> EngineLoad:
        return EngineLoad(self.stats.running, self.stats.waiting, self.stats.kv_usage)

    @property
    def dead(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine, "errored", False))

    def metrics_text(self) -> bytes:
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY)

    async def stop(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
