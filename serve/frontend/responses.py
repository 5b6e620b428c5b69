"""OpenAI response bodies and SSE chunks as typed structs (msgspec), rendered once.

The shapes follow OpenAI's API as vLLM's server writes them: `logprobs: null` on every
choice, a first chat chunk with `{"role": "assistant", "content": ""}`, `usage: null` on
each chunk when `stream_options.include_usage` asks for a final usage chunk.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

DONE = b"data: [DONE]\n\n"


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens))


class AssistantMessage(msgspec.Struct, frozen=True):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None


class ChunkBase(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    # The stage breakdown (serve.frontend.timing) on a stream's last chunk, when the client
    # sent X-PDSERVE-Timing: 1; absent otherwise.
    pdserve_timing: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(ChunkBase, frozen=True, kw_only=True):
    choices: list[ChatChunkChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET  # null on each chunk with include_usage


class CompletionChunk(ChunkBase, frozen=True, kw_only=True):
    choices: list[CompletionChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class UsageChunk(ChunkBase, frozen=True, kw_only=True):
    choices: list[ChatChunkChoice] = []
    usage: Usage


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    max_model_len: int | msgspec.UnsetType = msgspec.UNSET  # known once a worker is in rotation


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def now() -> int:
    return int(time.time())


_enc = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def sse(msg: msgspec.Struct) -> bytes:
    """One `data:` event."""
    return b"data: " + _enc.encode(msg) + b"\n\n"


class ChunkWriter:
    """Renders the chunks of one stream (chat or completion) with its fixed id, created and model."""

    def __init__(self, kind: str, request_id: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = now()
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._usage = None if include_usage else msgspec.UNSET

    def role(self) -> bytes:
        return self._chat(Delta(role="assistant", content=""), None)

    def text(self, text: str | None, finish_reason: str | None,
             timing: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET) -> bytes:
        if self.kind == "chat":
            return self._chat(Delta(content=text) if text else Delta(), finish_reason, timing)
        return sse(CompletionChunk(id=self.id, object=self.object, created=self.created, model=self.model,
                                   choices=[CompletionChoice(text=text or "", finish_reason=finish_reason)],
                                   usage=self._usage, pdserve_timing=timing))

    def usage(self, usage: Usage, timing: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET) -> bytes:
        return sse(UsageChunk(id=self.id, object=self.object, created=self.created, model=self.model, usage=usage,
                              pdserve_timing=timing))

    def _chat(self, delta: Delta, finish_reason: str | None,
              timing: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET) -> bytes:
        return sse(ChatCompletionChunk(id=self.id, object=self.object, created=self.created, model=self.model,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                                       usage=self._usage, pdserve_timing=timing))


def final_body(kind: str, request_id: str, model: str, text: str, finish_reason: str | None,
               usage: Usage) -> msgspec.Struct:
    """The whole (non-streaming) response."""
    if kind == "chat":
        return ChatCompletion(id=request_id, created=now(), model=model, usage=usage, choices=[
            ChatChoice(message=AssistantMessage("assistant", text), finish_reason=finish_reason)])
    return Completion(id=request_id, created=now(), model=model, usage=usage, choices=[
        CompletionChoice(text=text, finish_reason=finish_reason)])
