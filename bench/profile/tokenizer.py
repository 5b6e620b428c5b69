"""Load the tokenizer that counts tokens for a run.

The tokenizer is `--tokenizer` if given, else the model's own (`-m`): a local Hugging Face
directory, the embedded model's name (`smollm2-135m-instruct`, or its hub id
`HuggingFaceTB/SmolLM2-135M-Instruct`), or a hub name where the hub can be reached (or is in
the local Hugging Face cache). When none of these loads, the run stops with TokenizerError:
counting tokens with another model's tokenizer would make every ISL and OSL silently wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.profile.errors import TokenizerError

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


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The transformers tokenizer for this run, or TokenizerError naming what failed."""
    source = resolve_tokenizer_source(model, tokenizer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors...
        which = "--tokenizer" if tokenizer else "-m/--model"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(
            f"cannot load the tokenizer {source!r} (from {which}): {first}. "
            "Pass --tokenizer with a local Hugging Face directory of the served model's tokenizer"
        ) from e
