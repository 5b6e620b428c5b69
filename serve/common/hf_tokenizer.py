"""Loading a Hugging Face tokenizer without importing torch, where that gives the same one.

`AutoTokenizer` imports transformers' model machinery and with it torch: about 4 s of CPU in
every new process here, for the frontend, the load generator and the fake server alike. For
a local directory whose `tokenizer_config.json` names the plain fast tokenizer
(`PreTrainedTokenizerFast`, `TokenizersBackend` in transformers 5) of a model type that
AutoTokenizer resolves to that same class, that class is loaded directly (tokenizers +
transformers' tokenization module only). Anything else goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types checked to resolve a plain-class tokenizer_config to the plain class (no
# model-specific tokenizer, no hub-class override in AutoTokenizer).
PLAIN_MODEL_TYPES = frozenset({"llama"})


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def direct_class(source: str) -> Any | None:
    """The tokenizer class to load `source` with, when the direct path applies; else None."""
    d = Path(source).expanduser()
    if not (d / "tokenizer.json").is_file():
        return None
    cfg = _json(d / "tokenizer_config.json")
    if cfg.get("tokenizer_class") not in PLAIN_CLASSES or "auto_map" in cfg:
        return None
    model = _json(d / "config.json")
    if model.get("model_type") not in PLAIN_MODEL_TYPES or model.get("tokenizer_class") not in (None, *PLAIN_CLASSES):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4: no such module; AutoTokenizer it is
        return None
    return TokenizersBackend


def from_pretrained(source: str, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(source, **kwargs)`, without torch where it can be."""
    cls = direct_class(source)
    if cls is not None:
        return cls.from_pretrained(source, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **kwargs)
