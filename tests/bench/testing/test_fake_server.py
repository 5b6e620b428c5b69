"""The fake OpenAI server in process: it speaks the same SSE stream as the real frontend
(read here with serve.common.sse), says it is fake, fails on schedule, and a port it cannot
take is one FakeServerError."""

from __future__ import annotations

import httpx
import pytest

from bench.testing.errors import FakeServerError
from bench.testing.fake_server import FakeServer, FakeServerConfig
from serve.common.sse import SseStream, text_of


async def started(**cfg) -> tuple[FakeServer, str]:
    server = FakeServer(FakeServerConfig(port=0, **cfg))
    port = await server.start()
    return server, f"http://127.0.0.1:{port}"


async def test_streams_max_tokens_words_then_usage_and_done():
    server, url = await started(model="m")
    try:
        async with httpx.AsyncClient() as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 5,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                stream = SseStream()
                events = [e async for e in stream.aparse(r.aiter_lines())]
            models = (await c.get(f"{url}/v1/models")).json()
    finally:
        await server.stop()
    assert stream.done
    assert text_of(events) == " the of and to in"
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert all(e["id"].endswith("-fake") for e in events)
    assert models["data"][0]["owned_by"] == "pdserve-fake"


async def test_fails_every_nth_generation():
    server, url = await started(fail_every=2)
    try:
        async with httpx.AsyncClient() as c:
            codes = [(await c.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code
                     for _ in range(4)]
    finally:
        await server.stop()
    assert codes == [200, 500, 200, 500]


async def test_a_taken_port_is_one_error():
    server, url = await started()
    try:
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(FakeServerError, match=f"cannot listen on 127.0.0.1:{port}"):
            await FakeServer(FakeServerConfig(port=port)).start()
    finally:
        await server.stop()
