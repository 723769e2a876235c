"""The bar of ``gpuopt predict --generate.prompts_file``: completions done, tokens/s and the time left.

Lightning's predict bar counts batches, and continuous generation is one batch. On a terminal it redraws one line
(at most ten times a second); in a log file it writes a line every ``log_every`` seconds."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

__all__ = ["GenerationProgress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``'1:02:03'``, ``'2:03'`` or ``'3 s'``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}" if minutes else f"{secs} s"


class GenerationProgress:
    """Counts completions and generated tokens; draws ``generating 37/256 completions | 1,234 tokens/s | ETA 0:42``.

    Example::

        bar = GenerationProgress(total=256)
        job = GenerationJob(requests, on_finished=lambda d: (writer.add(d), bar.finished()), on_step=bar.step)

    Args:
        total: Completions to generate.
        stream: Where the bar goes (``None``: standard error).
        log_every: Seconds between lines when ``stream`` is not a terminal.
    """

    def __init__(
        self, total: int, stream: Optional[TextIO] = None, log_every: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.1 if self.tty else log_every
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.tokens = 0
        self._drawn = self.start

    @property
    def seconds(self) -> float:
        return self.clock() - self.start

    def step(self, tokens: int) -> None:
        """Count ``tokens`` sampled by one forward."""
        self.tokens += tokens
        self._maybe_draw()

    def finished(self, n: int = 1) -> None:
        """Count ``n`` finished completions."""
        self.done += n
        self._maybe_draw()

    def line(self) -> str:
        elapsed = self.seconds
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = "?" if not self.done else format_seconds(elapsed * (self.total - self.done) / self.done)
        return f"generating {self.done}/{self.total} completions | {rate:,.0f} tokens/s | ETA {eta}"

    def _maybe_draw(self) -> None:
        now = self.clock()
        if now - self._drawn < self.interval and self.done < self.total:
            return
        self._drawn = now
        self.stream.write(("\r" + self.line() + "\033[K") if self.tty else self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
