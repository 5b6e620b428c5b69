"""OpenAI-compatible request models (pydantic, at the HTTP edge) and response bodies.

Unknown fields are accepted and ignored, as OpenAI clients send many optional ones;
known fields with values pdserve does not support (n > 1, logprobs, tools, several
prompts) are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.frontend.errors import APIError, bad_request

MAX_STOP_STRINGS = 16


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logprobs: Any = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return [s for s in items if s]

    def check_supported(self) -> None:
        if self.n != 1:
            raise bad_request(f"n={self.n} is not supported: pdserve returns one choice (n=1)", "n")
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported", "logprobs")
        extra = self.model_extra or {}
        for key in ("tools", "functions", "response_format", "best_of", "echo", "suffix"):
            value = extra.get(key)
            if value not in (None, False, [], {}, 1) and not (key == "response_format" and value == {"type": "text"}):
                raise bad_request(f"'{key}' is not supported by pdserve", key)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]

    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise bad_request("several prompts in one request are not supported; send one prompt", "prompt")
        return p[0]  # type: ignore[return-value]


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")),
                       "invalid_request_error", loc or None) from None
