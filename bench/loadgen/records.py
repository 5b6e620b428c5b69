"""One request's outcome: raw timings and bytes -> a parsed Record.

Parsing happens after the response is complete (for multi-turn sessions, before the next
turn; otherwise after the run), never while bytes of other requests may be arriving late.

SSE events are split on blank lines; each event's timestamp is the arrival time of the piece
that completed it. An event is a *content response* when it carries text (`delta.content`,
`delta.reasoning_content`/`reasoning`, or completions' `text`); role-only, finish-only and
usage-only events are not. A `data: {"error": ...}` event makes the request an error, as a
non-200 status does (its OpenAI envelope gives type and message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from bench.loadgen.http import RawResponse, decode_chunked
from serve.common import sse


@dataclass(frozen=True)
class ErrorInfo:
    code: int | None
    type: str
    message: str


@dataclass
class Record:
    session: int
    turn: int
    phase: str  # "warmup" | "profiling"
    worker: int
    start_ns: int  # perf_counter_ns when the request was started
    wall_start_ns: int  # time.time_ns at the same moment
    end_ns: int = 0  # last byte of the response
    content_ns: list[int] = field(default_factory=list)  # arrival of each content response
    text: str = ""
    prompt_tokens: int | None = None  # usage, when the server reports it
    completion_tokens: int | None = None
    expected_isl: int | None = None
    requested_osl: int | None = None
    isl: int | None = None  # final: usage, else the prompt builder's count
    osl: int | None = None  # final: usage, else tokenized text
    streaming: bool = False
    error: ErrorInfo | None = None
    cancelled: bool = False
    # pdserve's frontend: the request's TTFT by stage (X-PDSERVE-Timing), {"path", "ttft_ms", "stages_ms"}
    server_timing: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled


def _content_of(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        d = c.get("delta") or c.get("message") or {}
        parts = [d.get("content"), d.get("reasoning_content"), d.get("reasoning")]
        return "".join(p for p in parts if isinstance(p, str))
    t = c.get("text")
    return t if isinstance(t, str) else ""


def _usage(rec: Record, obj: dict) -> None:
    u = obj.get("usage")
    if isinstance(u, dict):
        if isinstance(u.get("prompt_tokens"), int):
            rec.prompt_tokens = u["prompt_tokens"]
        if isinstance(u.get("completion_tokens"), int):
            rec.completion_tokens = u["completion_tokens"]


def _error_from(obj: dict, status: int | None) -> ErrorInfo:
    e = obj.get("error")
    if isinstance(e, dict):
        code = e.get("code")
        return ErrorInfo(code if isinstance(code, int) else status, str(e.get("type") or "error"),
                         str(e.get("message") or ""))
    if isinstance(e, str):
        return ErrorInfo(status, "error", e)
    return ErrorInfo(status, "error", json.dumps(obj)[:200])


def sse_events(pieces: list[tuple[int, bytes]]) -> list[tuple[int, str]]:
    """(timestamp, data payload) per SSE event, from de-chunked (timestamp, bytes) pieces.
    The framing (events end at a blank line, each stamped when its last byte arrived) is
    the load generator's; a `data:` line is read by serve.common.sse, like every SSE reader
    in pdserve. An event of several `data:` lines joins them with newlines."""
    out = []
    buf = b""
    for ts, data in pieces:
        buf += data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            event, buf = buf[:i], buf[i + 2:]
            lines = [d for ln in event.decode("utf-8", "replace").split("\n") if (d := sse.payload(ln)) is not None]
            if lines:
                out.append((ts, "\n".join(lines)))
    return out


def parse_response(rec: Record, resp: RawResponse, chat: bool) -> Record:
    """Fill `rec` from a complete response."""
    rec.end_ns = resp.end_ns
    pieces = decode_chunked(resp.pieces) if resp.chunked else resp.pieces
    ctype = resp.headers.get("content-type", "")
    if resp.status != 200:
        body = b"".join(p for _, p in pieces)
        try:
            obj = json.loads(body)
            rec.error = _error_from(obj if isinstance(obj, dict) else {"error": str(obj)}, resp.status)
        except ValueError:
            rec.error = ErrorInfo(resp.status, "http_error", body[:200].decode("utf-8", "replace"))
        return rec
    if "text/event-stream" in ctype:
        texts = []
        for ts, data in sse_events(pieces):
            if data == sse.DONE:
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                rec.error = ErrorInfo(None, "invalid_sse", data[:200])
                return rec
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                rec.error = _error_from(obj, None)
                return rec
            text = _content_of(obj, chat)
            if text:
                rec.content_ns.append(ts)
                texts.append(text)
            _usage(rec, obj)
            if isinstance(obj.get("pdserve_timing"), dict):
                rec.server_timing = obj["pdserve_timing"]
        rec.text = "".join(texts)
        if not rec.content_ns:
            rec.error = ErrorInfo(None, "empty_response", "the stream carried no content")
        return rec
    body = b"".join(p for _, p in pieces)
    try:
        obj = json.loads(body)
    except ValueError:
        rec.error = ErrorInfo(resp.status, "invalid_json", body[:200].decode("utf-8", "replace"))
        return rec
    if not isinstance(obj, dict) or "error" in obj:
        rec.error = _error_from(obj if isinstance(obj, dict) else {}, resp.status)
        return rec
    rec.text = _content_of(obj, chat)
    _usage(rec, obj)
    rec.content_ns = [resp.end_ns]
    rec.server_timing = _timing_header(resp.headers.get(TIMING_HEADER))
    return rec


TIMING_HEADER = "x-pdserve-timing"


def _timing_header(raw: str | None) -> dict | None:
    if not raw:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
