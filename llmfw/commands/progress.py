"""A dependency-free progress bar on stderr (silent when stderr is not a terminal unless forced)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``with ProgressBar("loading") as bar: bar.update(0.5)`` draws ``loading [#####     ] 50%``."""

    def __init__(self, label: str, *, width: int = 30, stream: TextIO | None = None, enabled: bool | None = None):
        self.label = label
        self.width = width
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = -1.0
        self._start = time.perf_counter()

    def update(self, fraction: float, what: str = "") -> bool:
        fraction = min(max(fraction, 0.0), 1.0)
        if self.enabled and (fraction - self._last >= 0.01 or fraction >= 1.0) and fraction != self._last:
            self._last = fraction
            filled = int(self.width * fraction)
            bar = "#" * filled + " " * (self.width - filled)
            suffix = f" {what}" if what else ""
            self.stream.write(f"\r{self.label} [{bar}] {fraction * 100:5.1f}%{suffix}\033[K")
            self.stream.flush()
        return True

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._last >= 0:
            self.stream.write(f"\r{self.label} done in {time.perf_counter() - self._start:.1f}s\033[K\n")
            self.stream.flush()
