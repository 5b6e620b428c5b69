"""The embedded default model's name and pdserve's cache directory (no I/O on import)."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    """`PDSERVE_CACHE`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def embedded_model_dir() -> Path:
    """Where `pdserve model prepare` writes the embedded model's Hugging Face directory."""
    return cache_root() / "models" / EMBEDDED_MODEL_NAME
