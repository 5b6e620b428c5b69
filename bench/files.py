"""Reading the JSON files bench tools exchange (profile summaries, system profiles, model
configs): one place that turns a missing or malformed file into the caller's one-line error.
plan.json has its own reader, serve.deploy.plan.load_plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, default_name: str | None, error: type[Exception]) -> tuple[Path, Any]:
    """(the file read, its JSON). `path` may be a folder holding `default_name`."""
    p = Path(path)
    f = p / default_name if default_name and p.is_dir() else p
    try:
        return f, json.loads(f.read_text())
    except OSError as e:
        raise error(f"{f}: {e.strerror or e}") from None
    except ValueError as e:
        raise error(f"{f}: invalid JSON: {e}") from None
