"""kvtransfer's typed messages, its handshake, and vLLM's `kv_transfer_params`.

`EngineMetadata` is what an engine tells a peer in the handshake: protocol version, model,
dtypes, block size, layout, TP size, base addresses and the NIXL agent metadata. Two
engines may exchange blocks only if `check_compatible` passes; any mismatch names both
values. `TransferParams` is the typed form of vLLM's `kv_transfer_params` dict; the two
conversions to and from that dict are the only place the dict is touched.
`ConnectorSettings` is the typed form of the connector's `kv_connector_extra_config`, with
its one pair of conversions (`to_extra_config` / `from_extra_config`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvtransfer.errors import HandshakeError, SettingsError
from kvtransfer.layout import KVLayout, shape_signature

PROTOCOL_VERSION = 1
PARAMS_KEY = "pdserve_kv"

# How a pair moves a request's blocks. pull: the decode engine READs the holder's blocks
# (one-sided on RDMA). push: the decode engine sends where its blocks are (`Push`), the holder
# WRITEs them and notifies. Additive to protocol version 1: a holder lists the modes it serves
# in `EngineMetadata.transfer_modes` (older holders send none: pull only).
TransferMode = Literal["pull", "push"]
TRANSFER_MODES = ("pull", "push")


def resolve_transfer_mode(mode: str, transport: str) -> TransferMode:
    """`auto` is pull on RDMA (a one-sided READ needs nothing from the holder) and push on
    every other transport (there a READ is served by the holder's progress: measured slower,
    README "KV transfer modes"); `pull`/`push` are taken as given."""
    if mode == "auto":
        return "pull" if transport == "rdma" else "push"
    if mode not in TRANSFER_MODES:
        raise SettingsError(f"unknown KV transfer mode {mode!r}; choose push, pull or auto")
    return mode  # type: ignore[return-value]


def pair_mode(wanted: str, holder_modes: tuple[str, ...]) -> TransferMode:
    """The mode a decode engine that wants `wanted` uses with a holder serving `holder_modes`:
    push only when both can, else pull (every holder serves pull)."""
    return "push" if wanted == "push" and "push" in holder_modes else "pull"


def notif_tag(request_id: str) -> bytes:
    """The NIXL notification a holder sends with a pushed request's WRITE (and alone, with
    FAILED_SUFFIX appended, when the push failed)."""
    return f"pdserve-kv:{request_id}".encode()


FAILED_SUFFIX = b":failed"


class EngineMetadata(msgspec.Struct, frozen=True, kw_only=True):
    protocol_version: int
    engine_id: str
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    tp_size: int
    layout: KVLayout
    agent_name: str
    agent_metadata: bytes
    side_channel: str
    transfer_modes: tuple[str, ...] = ("pull",)  # what this engine serves as a holder (not compared)

    def compat_fields(self) -> dict[str, Any]:
        return {
            "protocol version": self.protocol_version,
            "model": self.model,
            "dtype": self.dtype,
            "KV cache dtype": self.kv_cache_dtype,
            "block size": self.block_size,
            "tensor-parallel size": self.tp_size,
            "layer count": self.layout.num_layers,
            "layout": self.layout.layout_name,
            "block shape": shape_signature(self.layout),
        }

    def compat_hash(self) -> str:
        return compat_hash(self.compat_fields())


def compat_hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def check_compatible(local: EngineMetadata, remote: EngineMetadata) -> None:
    """Raise HandshakeError naming the first field that differs, with both values."""
    if local.compat_hash() == remote.compat_hash():
        return
    lf, rf = local.compat_fields(), remote.compat_fields()
    diffs = [f"{k}: local {lf[k]!r} vs remote {rf[k]!r}" for k in lf if lf[k] != rf[k]]
    raise HandshakeError(f"engine {remote.engine_id} is incompatible with {local.engine_id}: " + "; ".join(diffs))


# -- side channel --------------------------------------------------------------------
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"


def cluster_token() -> str | None:
    """The cluster token this engine process was started with (never put in vLLM's config,
    which vLLM logs)."""
    return os.environ.get(TOKEN_ENV) or None


def engine_auth(token: str | None, engine_id: str) -> str:
    """What an engine presents on every side-channel message: HMAC-SHA256(token, engine id).
    Empty without a token."""
    if not token:
        return ""
    return hmac.new(token.encode(), engine_id.encode(), hashlib.sha256).hexdigest()


def authorized(token: str | None, engine_id: str, auth: str) -> bool:
    return not token or hmac.compare_digest(engine_auth(token, engine_id), auth)


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    protocol_version: int
    engine_id: str
    auth: str = ""  # engine_auth(): only engines holding the cluster token get an answer
    metadata: EngineMetadata | None = None  # the decode engine's own, so a holder can push to it


class Acquire(msgspec.Struct, frozen=True, tag="acquire"):
    """Decode side asks to read a held request's blocks; the lease is pinned while it reads."""

    request_id: str
    engine_id: str
    auth: str = ""


class Release(msgspec.Struct, frozen=True, tag="release"):
    """Decode side is done (read complete, failed, or not needed): free the blocks. In push
    mode the reply also means the holder's WRITE into the decode's blocks is over (done or
    cancelled): after it, nothing more lands there."""

    request_id: str
    engine_id: str
    auth: str = ""


class Push(msgspec.Struct, frozen=True, tag="push"):
    """Decode side (push mode) has allocated `block_ids` and asks the holder to WRITE its
    `holder_block_ids` there, then notify (`notif_tag`). Answered "ok" once the WRITE is
    posted, or "pending"/"gone"/"error" as an acquire. The holder gives up on the WRITE
    `budget_s` after receiving this, less a margin: before the decode side's own deadline."""

    request_id: str
    engine_id: str
    block_ids: list[int]
    holder_block_ids: list[int]
    budget_s: float
    auth: str = ""


class Reply(msgspec.Struct, frozen=True, tag="reply"):
    status: Literal["ok", "pending", "gone", "error"]
    message: str = ""
    metadata: EngineMetadata | None = None


Message = Hello | Acquire | Release | Push | Reply


# -- kv_transfer_params ---------------------------------------------------------------
class TransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill engine hands to the decode engine for one request."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    side_channel: str
    lease_seconds: float


def remote_decode_request() -> dict[str, Any]:
    """`kv_transfer_params` for a prefill request whose decode happens elsewhere."""
    return {PARAMS_KEY: {"do_remote_decode": True}}


def to_vllm_params(p: TransferParams, mode: str | None = None) -> dict[str, Any]:
    """`kv_transfer_params` for the decode request (the one conversion to vLLM's dict); `mode`
    asks for push or pull for this load alone (`requested_mode`)."""
    inner: dict[str, Any] = {"do_remote_prefill": True, "remote": msgspec.to_builtins(p)}
    if mode is not None:
        inner["mode"] = mode
    return {PARAMS_KEY: inner}


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and isinstance(params.get(PARAMS_KEY), dict)
                and params[PARAMS_KEY].get("do_remote_decode"))


def requested_mode(params: dict[str, Any] | None) -> str | None:
    """A decode request's own transfer mode (`{"pdserve_kv": {..., "mode": "push"|"pull"}}`),
    overriding its engine's for this request (benchmarks compare modes on one pair); None
    when absent. An unknown mode raises SettingsError."""
    inner = params.get(PARAMS_KEY) if params else None
    mode = inner.get("mode") if isinstance(inner, dict) else None
    if mode is not None and mode not in TRANSFER_MODES:
        raise SettingsError(f"kv_transfer_params.{PARAMS_KEY}.mode {mode!r}: choose push or pull")
    return mode


def from_vllm_params(params: dict[str, Any] | None) -> TransferParams | None:
    """The remote prefill a decode request should read, or None (plain request)."""
    if not params or not isinstance(params.get(PARAMS_KEY), dict):
        return None
    inner = params[PARAMS_KEY]
    if not inner.get("do_remote_prefill") or "remote" not in inner:
        return None
    return msgspec.convert(inner["remote"], TransferParams)


@dataclass(frozen=True)
class LoadSpec:
    """One read the scheduler hands its worker side (in the connector metadata): the holder's
    blocks `remote_block_ids` into this engine's `local_block_ids`."""

    request_id: str
    remote: TransferParams
    local_block_ids: list[int]
    remote_block_ids: list[int]
    mode: str | None = None  # this request's own transfer mode (requested_mode); None: the engine's


# -- kv_connector_extra_config -------------------------------------------------------------
class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What `kv_connector_extra_config` carries to PdConnector (all optional, each with its
    one default here). Empty strings mean "not set": `engine_id` then falls back to the
    KVTransferConfig's engine id or a generated one, `side_channel_host` to VLLM_HOST_IP
    or 127.0.0.1; `side_channel_port` must be set (the scheduler advertises it before the
    worker binds)."""

    engine_id: str = ""
    side_channel_host: str = ""  # advertised to readers (and bound, unless side_channel_bind_all)
    side_channel_port: int = 0
    side_channel_bind_all: bool = False  # bind 0.0.0.0, still advertise side_channel_host
    lease_seconds: float = 30.0  # a held request's blocks are freed this long after it finished, if unread
    read_timeout_s: float = 30.0  # a READ not done this long after its acquire fails (recompute)
    handshake_timeout_s: float = 5.0  # each side-channel call; a pending hold is awaited this long at least
    transport: str = "auto"  # rdma | shm | tcp | auto (kvtransfer.transport)
    transfer_mode: str = "auto"  # push | pull | auto (resolve_transfer_mode): how this engine reads as decode
    fault_pause_s: float = 0.0  # test-only: pause before each READ's acquire (never set in production)

    # Written only when set away from their default, so the config pdserve hands vLLM (and
    # vLLM logs) carries the same keys as before these settings were typed.
    _ONLY_IF_SET = ("side_channel_bind_all", "read_timeout_s", "handshake_timeout_s", "transfer_mode",
                    "fault_pause_s")

    def side_channel_endpoints(self) -> tuple[str, str]:
        """(bind, advertise) endpoints of this engine's side channel."""
        host = self.side_channel_host or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        if not self.side_channel_port:
            raise SettingsError("kv_connector_extra_config.side_channel_port is required (the scheduler "
                                "advertises it before the worker binds)")
        bind_host = "0.0.0.0" if self.side_channel_bind_all else host
        return f"tcp://{bind_host}:{self.side_channel_port}", f"tcp://{host}:{self.side_channel_port}"

    def to_extra_config(self) -> dict[str, Any]:
        """The `kv_connector_extra_config` dict (the one conversion to it)."""
        defaults = ConnectorSettings()
        return {f: getattr(self, f) for f in self.__struct_fields__
                if f not in self._ONLY_IF_SET or getattr(self, f) != getattr(defaults, f)}

    @classmethod
    def from_extra_config(cls, extra: Any) -> ConnectorSettings:
        """From `kv_connector_extra_config` (the one conversion from it). None values count
        as unset; numbers given as strings are accepted. An unknown key or a value of the
        wrong type raises SettingsError naming the key."""
        if extra is None:
            return cls()
        if not isinstance(extra, dict):
            raise SettingsError(f"kv_connector_extra_config must be a mapping, not {type(extra).__name__}")
        types = {f.name: f.type for f in msgspec.structs.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key not in types:
                raise SettingsError(f"kv_connector_extra_config.{key}: unknown key for PdConnector "
                                    f"(known: {', '.join(types)})")
            if value is None:
                continue
            try:
                values[key] = msgspec.convert(value, types[key], strict=False)
            except msgspec.ValidationError as exc:
                raise SettingsError(f"kv_connector_extra_config.{key}: {exc} (got {value!r})") from None
        return cls(**values)
