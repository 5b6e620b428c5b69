"""The progress display (`--ui-type simple`): one bar redrawn in place on a terminal, a line
every 10% otherwise; `--ui-type none` shows nothing."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int | None, duration_s: float | None, enabled: bool,
                 stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.duration_s = duration_s
        self.enabled = enabled
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.last_decile = -1
        self.phase = "profiling"

    def start(self, phase: str) -> None:
        self.phase = phase
        self.t0 = time.monotonic()
        self.last_decile = -1

    def _fraction(self, done: int) -> float | None:
        if self.total:
            return min(1.0, done / self.total)
        if self.duration_s:
            return min(1.0, (time.monotonic() - self.t0) / self.duration_s)
        return None

    def update(self, done: int, errors: int) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        frac = self._fraction(done)
        rate = done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        text = f"{self.phase}: {done}{of} requests, {rate:.1f} req/s, {errors} errors, {elapsed:.1f} s"
        if self.tty:
            bar = ""
            if frac is not None:
                filled = int(frac * 30)
                bar = "[" + "#" * filled + "." * (30 - filled) + f"] {frac * 100:5.1f}% "
            self.stream.write("\r" + bar + text + "   ")
            self.stream.flush()
            return
        decile = int((frac or 0.0) * 10)
        if decile > self.last_decile:
            self.last_decile = decile
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
