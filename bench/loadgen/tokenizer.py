"""Load the tokenizer that counts tokens for a run.

The tokenizer is `--tokenizer` if given, else the model's own (`-m`): a local Hugging Face
directory, the embedded model's name (`smollm2-135m-instruct`, or its hub id
`HuggingFaceTB/SmolLM2-135M-Instruct`), or a hub name where the hub can be reached (or is in
the local Hugging Face cache). When none of these loads, the run stops with TokenizerError:
counting tokens with another model's tokenizer would make every ISL and OSL silently wrong.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from pathlib import Path
from typing import Any

from bench.loadgen.errors import TokenizerError

EMBEDDED_ALIASES = ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def resolve_tokenizer_source(model: str, tokenizer: str | None) -> str:
    """What `AutoTokenizer.from_pretrained` should load for this run (path or hub id)."""
    name = tokenizer or model
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local.resolve())
    if name.startswith((".", "/", "~")):
        raise TokenizerError(f"tokenizer {name!r}: no such directory")
    if name in EMBEDDED_ALIASES or name.lower() == EMBEDDED_ALIASES[0]:
        from serve.model import embedded_model_dir, is_ready, prepare_embedded_model
        from serve.errors import PdserveError

        path = embedded_model_dir()
        if not is_ready(path):
            try:
                prepare_embedded_model(path)
            except (PdserveError, ImportError) as e:
                raise TokenizerError(f"tokenizer for {name!r}: the embedded model is not prepared "
                                     f"({e}); run `pdserve model prepare` or pass --tokenizer PATH") from e
        return str(path)
    return name


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connect (so a hub download is worth trying;
    without this check an offline machine spends ~50 s in the hub client's retries)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    name, _, port = host.partition(":")
    try:
        socket.create_connection((name, int(port or 443)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The transformers tokenizer for this run, or TokenizerError naming what failed.
    Cached: a sweep loads it once."""
    source = resolve_tokenizer_source(model, tokenizer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    which = "--tokenizer" if tokenizer else "-m/--model"
    hint = "Pass --tokenizer with a local Hugging Face directory of the served model's tokenizer"
    from transformers.utils import logging as hf_logging

    from serve.common.hf_tokenizer import from_pretrained

    hf_logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        return from_pretrained(source, local_files_only=True)
    except Exception as e:  # not local, not in the hub cache (or broken): maybe the hub
        local_error = e
    if Path(source).is_dir() or not hub_reachable():
        first = str(local_error).strip().splitlines()[0] if str(local_error).strip() else type(local_error).__name__
        where = "" if Path(source).is_dir() else " (not in the local Hugging Face cache, and the hub is not reachable)"
        raise TokenizerError(f"cannot load the tokenizer {source!r} (from {which}){where}: {first}. {hint}")
    try:
        return from_pretrained(source)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"cannot load the tokenizer {source!r} (from {which}): {first}. {hint}") from e
