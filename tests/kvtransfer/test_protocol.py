"""Handshake compatibility and the kv_transfer_params conversion."""

import pytest

from kvtransfer.errors import HandshakeError
from kvtransfer.layout import KVLayout, Region
from kvtransfer.protocol import (
    PROTOCOL_VERSION, EngineMetadata, TransferParams, check_compatible, from_vllm_params,
    remote_decode_request, to_vllm_params, wants_remote_decode,
)


def md(**kw) -> EngineMetadata:
    layout = KVLayout(num_blocks=10, block_size=128, device="DRAM", layout_name="block-major",
                      layers=[[Region(1000 * i, 100, 100)] for i in range(kw.pop("layers", 30))])
    base = dict(protocol_version=PROTOCOL_VERSION, engine_id="e", model="m", dtype="bfloat16",
                kv_cache_dtype="auto", block_size=128, tp_size=1, layout=layout, agent_name="a",
                agent_metadata=b"x", side_channel="tcp://127.0.0.1:1")
    base.update(kw)
    return EngineMetadata(**base)


def test_identical_engines_are_compatible_whatever_their_addresses():
    a = md(engine_id="p")
    b = md(engine_id="d", agent_name="other", side_channel="tcp://127.0.0.1:2")
    check_compatible(a, b)
    assert a.compat_hash() == b.compat_hash()


@pytest.mark.parametrize("field,local,remote,label", [
    ("kv_cache_dtype", "auto", "fp8", "KV cache dtype"),
    ("block_size", 128, 16, "block size"),
    ("tp_size", 1, 2, "tensor-parallel size"),
    ("dtype", "bfloat16", "float16", "dtype"),
    ("model", "m", "other-model", "model"),
    ("protocol_version", PROTOCOL_VERSION, PROTOCOL_VERSION + 1, "protocol version"),
])
def test_mismatch_names_both_values(field, local, remote, label):
    with pytest.raises(HandshakeError) as e:
        check_compatible(md(**{field: local}), md(**{field: remote}))
    msg = str(e.value)
    assert label in msg and repr(local) in msg and repr(remote) in msg


def test_layer_count_mismatch():
    with pytest.raises(HandshakeError, match="layer count: local 30 vs remote 24"):
        check_compatible(md(), md(layers=24))


def test_params_round_trip():
    p = TransferParams(engine_id="p", request_id="r", block_ids=[3, 4], num_tokens=200,
                       side_channel="tcp://127.0.0.1:9", lease_seconds=30.0)
    assert from_vllm_params(to_vllm_params(p)) == p
    assert from_vllm_params(None) is None
    assert from_vllm_params({"other_connector": {}}) is None
    assert wants_remote_decode(remote_decode_request())
    assert not wants_remote_decode(to_vllm_params(p))


def test_a_load_may_ask_for_its_own_transfer_mode():
    from kvtransfer.errors import SettingsError
    from kvtransfer.protocol import requested_mode

    p = TransferParams(engine_id="p", request_id="r", block_ids=[3], num_tokens=20,
                       side_channel="tcp://127.0.0.1:9", lease_seconds=30.0)
    assert requested_mode(to_vllm_params(p)) is None
    assert requested_mode(to_vllm_params(p, "pull")) == "pull" and from_vllm_params(to_vllm_params(p, "pull")) == p
    with pytest.raises(SettingsError, match="mode 'sideways': choose push or pull"):
        requested_mode(to_vllm_params(p, "sideways"))
