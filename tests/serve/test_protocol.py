"""Worker protocol messages round-trip and refuse malformed input."""

import msgspec
import pytest

from serve import protocol as p


def test_generate_request_round_trip():
    req = p.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                            sampling=p.SamplingOptions(max_tokens=5, temperature=0.0, seed=7, ignore_eos=True))
    back = p.decoder(p.GenerateRequest)(p.encode(req))
    assert back == req
    assert back.protocol_version == p.PROTOCOL_VERSION


def test_token_delta_omits_defaults():
    raw = p.encode(p.TokenDelta(token_ids=[5]))
    assert raw == b'{"token_ids":[5]}'
    assert p.decoder(p.TokenDelta)(raw).finished is False


def test_malformed_messages_are_rejected():
    dec = p.decoder(p.GenerateRequest)
    with pytest.raises(msgspec.ValidationError):
        dec(b'{"request_id": "x", "prompt_token_ids": ["a"], "sampling": {"max_tokens": 1}}')
    with pytest.raises(msgspec.ValidationError):
        dec(b'{"request_id": "x", "prompt_token_ids": [1]}')
    with pytest.raises(msgspec.ValidationError):
        p.decoder(p.WorkerInfo)(b'{"worker_id": "w", "role": "janitor"}')
