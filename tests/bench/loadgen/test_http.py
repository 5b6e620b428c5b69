"""Response framing and SSE splitting, on bytes split at awkward places."""

from __future__ import annotations

from bench.loadgen.http import RawResponse, decode_chunked
from bench.loadgen.records import Record, parse_response, sse_events


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_decode_chunked_across_split_pieces():
    wire = chunk(b"hello ") + chunk(b"world") + b"0\r\n\r\n"
    for cut in range(1, len(wire)):
        pieces = [(1, wire[:cut]), (2, wire[cut:])]
        out = decode_chunked(pieces)
        assert b"".join(p for _, p in out) == b"hello world"
        # payload bytes keep the timestamp of the piece they arrived in
        assert sum(len(p) for t, p in out if t == 1) == len(b"hello world"[:max(0, min(11, _payload_before(wire, cut)))])


def _payload_before(wire: bytes, cut: int) -> int:
    # count payload bytes of the two data chunks within wire[:cut]
    n = 0
    spans = [(3, 9), (14, 19)]  # "6\r\nhello \r\n5\r\nworld\r\n"
    for a, b in spans:
        n += max(0, min(cut, b) - a)
    return n


def test_sse_events_take_the_timestamp_of_their_last_byte():
    pieces = [(10, b"data: {\"a\":"), (20, b"1}\n\ndata: [DO"), (30, b"NE]\n\n")]
    assert sse_events(pieces) == [(20, '{"a":1}'), (30, "[DONE]")]


def test_sse_crlf_and_comments():
    assert sse_events([(5, b": ping\r\n\r\ndata: x\r\n\r\n")]) == [(5, "x")]
    assert sse_events([(6, b"event: delta\ndata: a\ndata:b\n\n")]) == [(6, "a\nb")]


def _resp(events: list[bytes], status: int = 200) -> RawResponse:
    wire = b"".join(chunk(b"data: " + e + b"\n\n") for e in events) + b"0\r\n\r\n"
    return RawResponse(status=status, headers={"content-type": "text/event-stream"}, chunked=True,
                       pieces=[(100 + i, wire[i * 40:(i + 1) * 40]) for i in range((len(wire) + 39) // 40)],
                       end_ns=999)


def test_parse_stream_counts_content_responses_and_usage():
    events = [b'{"choices":[{"delta":{"role":"assistant","content":""}}]}',
              b'{"choices":[{"delta":{"content":"Hi"}}]}',
              b'{"choices":[{"delta":{"reasoning_content":"hmm"}}]}',
              b'{"choices":[{"delta":{},"finish_reason":"stop"}]}',
              b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}', b"[DONE]"]
    r = parse_response(Record(0, 0, "profiling", 0, 0, 0, streaming=True), _resp(events), chat=True)
    assert r.ok and r.text == "Hihmm" and len(r.content_ns) == 2
    assert (r.prompt_tokens, r.completion_tokens) == (7, 2)


def test_parse_midstream_error_and_http_error():
    r = parse_response(Record(0, 0, "profiling", 0, 0, 0, streaming=True),
                       _resp([b'{"choices":[{"text":"a"}]}', b'{"error":{"message":"engine died","type":"internal","code":502}}']),
                       chat=False)
    assert r.error is not None and (r.error.code, r.error.type, r.error.message) == (502, "internal", "engine died")
    body = b'{"error":{"message":"too long","type":"invalid_request_error"}}'
    resp = RawResponse(status=400, headers={"content-type": "application/json"}, pieces=[(1, body)], end_ns=2)
    r = parse_response(Record(0, 0, "profiling", 0, 0, 0), resp, chat=True)
    assert r.error is not None and (r.error.code, r.error.type, r.error.message) == (400, "invalid_request_error", "too long")


def test_a_late_crlf_of_the_previous_response_is_skipped():
    import asyncio

    from bench.loadgen.http import Pool, _Conn

    async def go():
        loop = asyncio.get_running_loop()
        conn = _Conn(Pool("h", 1))

        class T:
            def write(self, data):
                pass

        conn.transport = T()  # type: ignore[assignment]
        fut = loop.create_future()
        conn.send(b"GET / HTTP/1.1\r\n\r\n", fut)
        conn.data_received(b"\r\n")  # tail of the previous chunked response
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        resp = await fut
        return resp.status, b"".join(p for _, p in resp.pieces)

    assert asyncio.run(go()) == (200, b"ok")


def test_idle_connections_past_their_expiry_are_not_reused():
    """A connection idle longer than the pool's expiry is closed, not written to (the server
    may be closing it on its own keep-alive timer); a fresher one is reused."""
    import asyncio

    from bench.loadgen.http import Pool, request_head

    async def main() -> tuple[int, int, int, int]:
        served = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed it
                n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(n)
                served.append(writer.get_extra_info("peername"))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        body = b"{}"
        req = request_head("POST", "127.0.0.1", port, "/x", {}, len(body)) + body
        pool = Pool("127.0.0.1", port, idle_expiry_s=0.2)
        assert (await pool.request(req)).status == 200
        assert (await pool.request(req)).status == 200  # at once: the same connection
        reused = pool.opened
        await asyncio.sleep(0.3)
        assert (await pool.request(req)).status == 200  # past the expiry: a new connection
        pool.close()
        server.close()
        return reused, pool.opened, pool.expired, len(set(served))

    reused, opened, expired, peers = asyncio.run(main())
    assert (reused, opened, expired, peers) == (1, 2, 1, 2)
