"""Reading a worker's NDJSON stream: lines split anywhere across chunks, the deadline, a
stall, and a response read to its end (so httpx keeps its connection)."""

import asyncio
import time

import httpx
import pytest

from serve.frontend.ndjson import NdjsonLines


def streamed(chunks, delay_s: float = 0.0):
    async def body():
        for c in chunks:
            if delay_s:
                await asyncio.sleep(delay_s)
            yield c

    async def handler(request):
        return httpx.Response(200, content=body())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def read_all(client, read_timeout_s=5.0, deadline_s=5.0):
    async with client.stream("POST", "http://w/generate") as resp:
        lines = NdjsonLines(resp, read_timeout_s)
        out = []
        while True:
            try:
                out.append(await lines.next(time.monotonic() + deadline_s))
            except StopAsyncIteration:
                return out, resp


async def test_lines_split_anywhere_across_chunks_come_out_whole():
    chunks = [b'{"a": 1}\n{"b"', b': 2}\n', b"\n", b'{"c": 3}\n{"d', b'": 4}']  # the last without a newline
    out, _ = await read_all(streamed(chunks))
    assert out == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b'{"d": 4}']


async def test_drain_reads_the_response_to_its_end():
    async with streamed([b'{"finished": true}\n', b"", b"\n"]).stream("POST", "http://w/generate") as resp:
        lines = NdjsonLines(resp, 5.0)
        assert await lines.next(time.monotonic() + 5) == b'{"finished": true}'
        assert not resp.is_closed
        await lines.drain()
        assert resp.is_closed  # read to its end: httpx returns a fully read response's connection to its pool


async def test_a_stall_past_the_read_timeout_and_a_past_deadline_are_timeouts():
    with pytest.raises(TimeoutError):  # the deadline is nearer than the read timeout: asyncio's timeout
        await read_all(streamed([b"{}\n", b"{}\n"], delay_s=1.0), read_timeout_s=30.0, deadline_s=0.2)
    async with streamed([b"{}\n"]).stream("POST", "http://w/generate") as resp:
        with pytest.raises(TimeoutError):  # already past
            await NdjsonLines(resp, 5.0).next(time.monotonic() - 1)


    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=_raising())))
    with pytest.raises(TimeoutError):  # httpx's read timeout becomes the same TimeoutError
        await read_all(client, read_timeout_s=1.0, deadline_s=60.0)


async def _raising():
    yield b"{}\n"
    raise httpx.ReadTimeout("stalled")
