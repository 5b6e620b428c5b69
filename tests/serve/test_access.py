"""Access control: API keys on the OpenAI endpoints, the cluster token on internal calls and
on the KV side channel (serve.auth, kvtransfer.side_channel)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from kvtransfer.protocol import PROTOCOL_VERSION, Acquire, Hello, Reply, engine_auth
from serve import protocol as p
from serve.auth import Gate
from tests.conftest import MODEL, Proc, free_port


async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


def call(gate: Gate, path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
            return await c.get(path, headers=headers or {})
    return asyncio.run(go())


def test_gate_api_keys_and_exempt_paths():
    gate = Gate(_ok_app, api_keys=["k1", "k2"], cluster_token=None)
    for path in ("/health", "/live", "/metrics"):
        assert call(gate, path).status_code == 200
    r = call(gate, "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and "didn't provide" in r.json()["error"]["message"]
    assert call(gate, "/v1/models", {"authorization": "Bearer nope"}).json()["error"]["message"] == \
        "Incorrect API key provided."
    for key in ("k1", "k2"):
        assert call(gate, "/v1/models", {"authorization": f"bearer {key}"}).status_code == 200
    assert call(gate, "/v1/models", {"authorization": "Basic k1"}).status_code == 401
    # Internal paths are not guarded by API keys, and no token is set: open.
    assert call(gate, "/internal/workers").status_code == 200
    closed = Gate(_ok_app, api_keys=["k1"], exempt=["/live"])
    assert call(closed, "/health").status_code == 401 and call(closed, "/live").status_code == 200


def test_gate_cluster_token(caplog):
    gate = Gate(_ok_app, api_keys=["k"], cluster_token="t0ken")
    with caplog.at_level(logging.WARNING, logger="pdserve.auth"):
        assert call(gate, "/internal/register").status_code == 401
        assert call(gate, "/internal/register", {"x-pdserve-token": "wrong"}).status_code == 401
        assert call(gate, "/internal/register", {"authorization": "Bearer k"}).status_code == 401  # a key is no token
    assert sum("missing or wrong cluster token" in r.message for r in caplog.records) == 3
    assert call(gate, "/internal/register", {"x-pdserve-token": "t0ken"}).status_code == 200
    assert call(gate, "/v1/models", {"x-pdserve-token": "t0ken"}).status_code == 401  # a token is no key
    worker = Gate(_ok_app, cluster_token="t0ken", internal_prefix="/")
    assert call(worker, "/generate").status_code == 401 and call(worker, "/load").status_code == 401
    assert call(worker, "/generate", {"x-pdserve-token": "t0ken"}).status_code == 200
    assert call(worker, "/health").status_code == 200 and call(worker, "/metrics").status_code == 200


def test_side_channel_refuses_engines_without_the_token(caplog):
    from kvtransfer.side_channel import SideChannelClient, SideChannelServer

    port = free_port()
    server = SideChannelServer(f"tcp://127.0.0.1:{port}", lambda: None,
                               lambda m: Reply("ok"), lambda m: Reply("ok"), token="s3cret")
    try:
        client = SideChannelClient(server.endpoint, 5.0)
        with caplog.at_level(logging.WARNING):
            for msg in (Hello(PROTOCOL_VERSION, "intruder"), Hello(PROTOCOL_VERSION, "intruder", "00"),
                        Acquire("req-1", "intruder", engine_auth("other-token", "intruder"))):
                reply = client.call(msg)
                assert reply.status == "error" and "unauthorized" in reply.message
        refusals = [r for r in caplog.records if "refused" in r.message and "intruder" in r.message]
        assert len(refusals) == 1  # logged once per engine, however often it retries
        # An engine with the token: its HMAC of its own id, not another engine's.
        assert client.call(Acquire("req-1", "decode-1", engine_auth("s3cret", "decode-1"))).status == "ok"
        assert client.call(Acquire("req-1", "decode-2", engine_auth("s3cret", "decode-1"))).status == "error"
        client.close()
    finally:
        server.close()


def test_frontend_with_api_key_and_cluster_token(sim_worker, model_dir, monkeypatch):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("frontend-auth", ["frontend", "--port", str(port), "--model", model_dir, "--served-model-name", MODEL,
                                  "--worker", sim_worker, "--cluster-token", "clu5ter"],
                env={"PDSERVE_API_KEY": "sk-a,sk-b"})
    try:
        proc.wait_http(f"{url}/health", 120)   # health stays open
        assert httpx.get(f"{url}/metrics").status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream},
                           headers={"authorization": "Bearer sk-b"}, timeout=60)
            assert r.status_code == 200, r.text
        # Registration: refused (and logged) with a wrong token, accepted with the right one.
        info = httpx.get(f"{sim_worker}/info").json()
        reg = p.encode(p.Registration(info=msgspec.convert({**info, "worker_id": "w-x", "url": "http://127.0.0.1:9"},
                                                           p.WorkerInfo), lease_seconds=1))
        assert httpx.post(f"{url}/internal/register", content=reg).status_code == 401
        assert httpx.post(f"{url}/internal/register", content=reg, headers={"x-pdserve-token": "nope"}).status_code == 401
        assert httpx.post(f"{url}/internal/register", content=reg, headers={"x-pdserve-token": "clu5ter"}).status_code == 200
        assert httpx.get(f"{url}/internal/workers").status_code == 401
        assert "missing or wrong cluster token" in proc.tail(200)
    finally:
        proc.stop()
