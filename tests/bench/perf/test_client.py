"""The benchmarks' streaming client against the fake server: chunk times, usage, and a
failed request as a PerfError."""

from __future__ import annotations

import httpx
import pytest

from bench.perf.client import percentile, stream_chat
from bench.perf.errors import PerfError
from bench.testing.fake_server import FakeServer, FakeServerConfig


async def test_stream_chat_times_each_chunk():
    server = FakeServer(FakeServerConfig(port=0, itl_ms=2.0, fail_every=2))
    url = f"http://127.0.0.1:{await server.start()}"
    try:
        async with httpx.AsyncClient() as c:
            t = await stream_chat(c, url, "fake-model", [{"role": "user", "content": "a b"}], 4)
            with pytest.raises(PerfError, match="HTTP 500"):
                await stream_chat(c, url, "fake-model", [{"role": "user", "content": "a b"}], 4)
    finally:
        await server.stop()
    assert t.text == " the of and to" and len(t.chunk_times) == 4 and len(t.itls()) == 3
    assert (t.prompt_tokens, t.completion_tokens) == (2, 4)
    # three programmed 2 ms gaps (lines may arrive together, so single gaps are not bounded)
    assert 0 < t.ttft_s <= t.latency_s and t.latency_s >= 0.006


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 50) != percentile([], 50)  # nan
