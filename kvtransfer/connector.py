"""PdConnector: the KVConnectorBase_V1 that vLLM loads (`kv_connector="PdConnector"`,
`kv_connector_module_path="kvtransfer.connector"`). A thin front: scheduler-role methods
go to `PdScheduler`, worker-role methods to `PdWorker`.

Settings come from `kv_connector_extra_config`, read once into a typed
`kvtransfer.protocol.ConnectorSettings` (its fields and defaults are listed there):
    engine_id, side_channel_host, side_channel_port (required), side_channel_bind_all,
    lease_seconds, read_timeout_s, handshake_timeout_s, transport (rdma|shm|tcp|auto),
    transfer_mode (push|pull|auto), fault_pause_s (tests)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtransfer import transport
from kvtransfer.protocol import ConnectorSettings, resolve_transfer_mode
from kvtransfer.scheduler import PdConnectorMetadata, PdScheduler
from kvtransfer.stats import PdKVStats
from kvtransfer.worker import PdWorker, WorkerConfig, default_engine_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        self.settings = settings
        self.engine_id = str(settings.engine_id or ktc.engine_id or default_engine_id())
        bind, advertise = settings.side_channel_endpoints()
        block_size = vllm_config.cache_config.block_size
        self._scheduler: PdScheduler | None = None
        self._worker: PdWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PdScheduler(self.engine_id, advertise, block_size, settings.lease_seconds)
        else:
            mc = vllm_config.model_config
            dtype = str(mc.dtype).removeprefix("torch.")
            kv_dtype = str(vllm_config.cache_config.cache_dtype)
            transport_name = transport.resolve(settings.transport)
            cfg = WorkerConfig(
                engine_id=self.engine_id, bind_endpoint=bind, advertise_endpoint=advertise,
                lease_seconds=settings.lease_seconds, read_timeout_s=settings.read_timeout_s,
                handshake_timeout_s=settings.handshake_timeout_s,
                transport=transport_name, model=str(mc.served_model_name or mc.model),
                dtype=dtype, kv_cache_dtype=dtype if kv_dtype == "auto" else kv_dtype, block_size=block_size,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                transfer_mode=resolve_transfer_mode(settings.transfer_mode, transport_name),
                fault_pause_s=settings.fault_pause_s,
            )
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self._worker = PdWorker(cfg, num_blocks)

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdConnectorMetadata):
            self._worker.begin_step(connector_metadata)  # holds before the forward (PdWorker.begin_step)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole requests load before they are scheduled (async), never per layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull model: the decode side reads; nothing is pushed

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self) -> PdKVStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdKVStats | None:
        return PdKVStats(data=data) if data is not None else PdKVStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(idle=scheduler_output.total_num_scheduled_tokens == 0)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
