"""Reading an OpenAI Server-Sent-Events stream: one parser for clients, benchmarks and tests.

A stream is `data: <json>` lines separated by blank lines and closed by `data: [DONE]`.
`events` yields the decoded JSON objects (an `{"error": ...}` event included, as it came);
`SseStream` also records whether `[DONE]` arrived.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

DONE = "[DONE]"
PREFIX = "data: "


def payload(line: str) -> str | None:
    """The payload of a `data:` line, or None for any other line (blank, comment, event:)."""
    if line.startswith("data:"):
        return line[5:].lstrip(" ").rstrip("\r\n")
    return None


class SseStream:
    """Parses lines into events; `done` tells whether `data: [DONE]` was seen, `lines`
    counts the `data:` lines (including `[DONE]`)."""

    def __init__(self) -> None:
        self.done = False
        self.lines = 0

    def feed(self, line: str) -> Any | None:
        """The event a line carries, or None (not a data line, or [DONE])."""
        data = payload(line)
        if data is None:
            return None
        self.lines += 1
        if data == DONE:
            self.done = True
            return None
        return json.loads(data)

    def parse(self, lines: Iterable[str]) -> Iterator[Any]:
        for line in lines:
            event = self.feed(line)
            if event is not None:
                yield event

    async def aparse(self, lines: AsyncIterable[str]) -> AsyncIterator[Any]:
        async for line in lines:
            event = self.feed(line)
            if event is not None:
                yield event


def events(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON events of a stream's lines, without [DONE]."""
    return SseStream().parse(lines)


def events_of_text(text: str) -> list[Any]:
    """The JSON events of a whole stream body."""
    return list(events(text.splitlines()))


def text_of(events_: Iterable[Any]) -> str:
    """Concatenated content of chat (`delta.content`) or completion (`text`) chunks."""
    parts = []
    for ev in events_:
        for choice in ev.get("choices") or ():
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if piece:
                parts.append(piece)
    return "".join(parts)
