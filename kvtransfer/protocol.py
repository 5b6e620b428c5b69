"""kvtransfer's typed messages, its handshake, and vLLM's `kv_transfer_params`.

`EngineMetadata` is what an engine tells a peer in the handshake: protocol version, model,
dtypes, block size, layout, TP size, base addresses and the NIXL agent metadata. Two
engines may exchange blocks only if `check_compatible` passes; any mismatch names both
values. `TransferParams` is the typed form of vLLM's `kv_transfer_params` dict; the two
conversions to and from that dict are the only place the dict is touched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, Literal

import msgspec

from kvtransfer.errors import HandshakeError
from kvtransfer.layout import KVLayout, shape_signature

PROTOCOL_VERSION = 1
PARAMS_KEY = "pdserve_kv"


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


class Acquire(msgspec.Struct, frozen=True, tag="acquire"):
    """Decode side asks to read a held request's blocks; the lease is pinned while it reads."""

    request_id: str
    engine_id: str
    auth: str = ""


class Release(msgspec.Struct, frozen=True, tag="release"):
    """Decode side is done (read complete, failed, or not needed): free the blocks."""

    request_id: str
    engine_id: str
    auth: str = ""


class Reply(msgspec.Struct, frozen=True, tag="reply"):
    status: Literal["ok", "pending", "gone", "error"]
    message: str = ""
    metadata: EngineMetadata | None = None


Message = Hello | Acquire | Release | Reply


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


def to_vllm_params(p: TransferParams) -> dict[str, Any]:
    """`kv_transfer_params` for the decode request (the one conversion to vLLM's dict)."""
    return {PARAMS_KEY: {"do_remote_prefill": True, "remote": msgspec.to_builtins(p)}}


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and isinstance(params.get(PARAMS_KEY), dict)
                and params[PARAMS_KEY].get("do_remote_decode"))


def from_vllm_params(params: dict[str, Any] | None) -> TransferParams | None:
    """The remote prefill a decode request should read, or None (plain request)."""
    if not params or not isinstance(params.get(PARAMS_KEY), dict):
        return None
    inner = params[PARAMS_KEY]
    if not inner.get("do_remote_prefill") or "remote" not in inner:
        return None
    return msgspec.convert(inner["remote"], TransferParams)
