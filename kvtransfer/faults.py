"""Test-only fault hooks of the worker side; inert in production (nothing sets them there).

A pause before each READ's acquire, from `fault_pause_s` in the connector's extra config
(`--kv-fault-pause-seconds`) or, while it exists, from the file named by
PDSERVE_KV_FAULT_PAUSE_FILE (its content: the seconds), so a test can hold a transfer at
that point and kill or restart a peer meanwhile. Touches no NIXL and no sockets.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

FAULT_PAUSE_FILE_ENV = "PDSERVE_KV_FAULT_PAUSE_FILE"


def pause_from_file() -> float:
    """The seconds held by the file named by PDSERVE_KV_FAULT_PAUSE_FILE; 0 when it is
    unset, missing or unreadable."""
    path = os.environ.get(FAULT_PAUSE_FILE_ENV)
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return max(0.0, float(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def pause_before_read(configured_s: float, sleep: Callable[[float], None] = time.sleep) -> float:
    """Pause for the configured seconds, else the file's; return how long it paused."""
    pause = configured_s or pause_from_file()
    if pause:
        sleep(pause)
    return pause
