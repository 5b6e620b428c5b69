"""One connection pool per origin: requests to one worker reuse its connection, and a worker
that left has its connections closed."""

import asyncio

import httpx

from serve.common.origins import PerOriginTransport


class CountingServer:
    """A minimal keep-alive HTTP/1.1 server that counts its connections and their ends."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()


async def test_one_pool_per_worker_reused_and_closed_when_the_worker_leaves():
    a, b = CountingServer(), CountingServer()
    url_a, url_b = await a.start(), await b.start()
    transport = PerOriginTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        for _ in range(3):
            for url in (url_a, url_b):
                assert (await client.get(f"{url}/load")).text == "ok"
        assert (a.accepted, b.accepted) == (1, 1)  # each worker's connection reused
        assert len(transport.pools) == 2
        transport.forget(url_a)
        assert len(transport.pools) == 1
        for _ in range(50):
            if a.closed:
                break
            await asyncio.sleep(0.02)
        assert (a.closed, b.closed) == (1, 0)
        assert (await client.get(f"{url_a}/load")).text == "ok"  # a later request opens a new pool
        assert a.accepted == 2
    a.server.close()
    b.server.close()


async def test_a_stream_in_flight_survives_its_worker_leaving():
    """A draining worker finishes its streams: forgetting its origin must not cut them."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"one\n", b"two\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    transport = PerOriginTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        async with client.stream("GET", f"{url}/generate") as resp:
            got = []
            async for chunk in resp.aiter_bytes():
                got.append(chunk)
                transport.forget(url)  # mid-stream, as a deregistration would
            assert b"".join(got) == b"one\ntwo\n"
        assert transport.pools == {}
    server.close()
