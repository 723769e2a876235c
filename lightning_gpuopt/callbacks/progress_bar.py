"""Progress bars whose training bar counts a resumed epoch from where it stopped, with its total and ETA.

Lightning's bars count a fit resumed inside an epoch past their total (``84/?``, ``84/40``); these
also write logged lines above the bar and whole numbers as such (``docs/callbacks.md``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

__all__ = [
    "ResumedRichProgressBar",
    "ResumedTQDMProgressBar",
    "default_progress_bar",
    "train_bar_span",
    "whole_numbers_as_text",
]


def train_bar_span(trainer: pl.Trainer) -> tuple[int, Optional[int]]:
    """``(done, total)`` of this epoch's training bar, in batches: ``done`` ran before this fit; ``total`` is
    the epoch's batches up to ``max_steps`` (``None``: an endless loader without ``max_steps``)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    total: float = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches  # batches, not steps
        total = min(total, done + left)
    return done, (None if math.isinf(total) else int(total))


class _AboveTheBars(logging.Handler):
    """A console handler's records, written by the bar (``write``): above it, on a line of their own."""

    def __init__(self, console: logging.StreamHandler, write: Callable[[str, Any], None]) -> None:
        super().__init__(console.level)
        self.console, self.write = console, write
        self.setFormatter(console.formatter)
        self.filters = list(console.filters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record), self.console.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: a handler reports its failure, never raises
            self.handleError(record)


class _LinesAboveTheBars:
    """While the bar is set up, the console lines of Lightning's loggers are written by it, above the bar."""

    LOGGERS = ("lightning.pytorch", "lightning.fabric")
    _swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]]

    def _write_above(self, text: str, stream: Any) -> None:
        raise NotImplementedError

    def _take_log_lines(self) -> None:
        if getattr(self, "_swapped", None):
            return
        self._swapped = []
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:  # a console, not a file
                    above = _AboveTheBars(handler, self._write_above)
                    logger.handlers[logger.handlers.index(handler)] = above
                    self._swapped.append((logger, handler, above))

    def _put_back_handlers(self) -> None:
        for logger, handler, above in getattr(self, "_swapped", []):
            if above in logger.handlers:
                logger.handlers[logger.handlers.index(above)] = handler
        self._swapped = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]  # the bar's, next in the MRO
        if self.is_enabled:  # type: ignore[attr-defined]
            self._take_log_lines()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._put_back_handlers()
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]


class ResumedTQDMProgressBar(_LinesAboveTheBars, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar``, starting at a resumed epoch's batch, with logged lines above it."""

    def _write_above(self, text: str, stream: Any) -> None:
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        Tqdm.write(text, file=stream)  # clears the bars, writes the line, draws the bars again

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown after an error: the bars end their line here, so the message that follows
        # (gpuopt's one-line error, a SIGTERM's save) starts a line of its own.
        for name in ("train_progress_bar", "val_progress_bar", "test_progress_bar", "predict_progress_bar"):
            try:
                bar = getattr(self, name)
            except TypeError:  # Lightning's property for a bar not made yet
                continue
            if not bar.disable:
                bar.close()
        self._put_back_handlers()

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._start_at_resumed_batch(trainer)  # Lightning calls no on_train_epoch_start in a fit resumed mid-epoch

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._start_at_resumed_batch(trainer)

    def _start_at_resumed_batch(self, trainer: pl.Trainer) -> None:
        done, total = train_bar_span(trainer)
        bar = self.train_progress_bar
        bar.total, bar.initial, bar.n, bar.last_print_n = total, done, done, done  # rate = (n - initial) / time
        bar.refresh()


class ResumedRichProgressBar(_LinesAboveTheBars, RichProgressBar):
    """Lightning's ``RichProgressBar``, starting at a resumed epoch's batch, with logged lines above it."""

    def _write_above(self, text: str, stream: Any) -> None:
        if self.progress is not None and self.progress.live.is_started:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            stream.write(text + "\n")
            stream.flush()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)  # Lightning's: stops the live display
        self._put_back_handlers()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_at_resumed_batch(trainer)  # Lightning calls no on_train_epoch_start in a fit resumed mid-epoch

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._start_at_resumed_batch(trainer)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning writes "Epoch 0/-2" for a run bounded by max_steps (max_epochs -1): no epoch total then.
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return whole_numbers_as_text(super().get_metrics(trainer, pl_module))

    def _start_at_resumed_batch(self, trainer: pl.Trainer) -> None:
        if self.progress is None or self.is_disabled:
            return
        done, total = train_bar_span(trainer)
        if self.train_progress_bar_id is None:  # resumed mid-epoch: Lightning would add it at the first batch's end
            self.train_progress_bar_id = self.progress.add_task(f"Epoch {trainer.current_epoch}", total=total)
        if total is not None:  # reset also clears the speed samples: the rate covers this fit's batches
            self.progress.reset(self.train_progress_bar_id, total=total, completed=done)
            self.refresh()


def whole_numbers_as_text(items: dict[str, Any]) -> dict[str, Any]:
    """The bar's items with every ``int`` as text: Rich formats numbers with ``.3f`` (``643.000`` tokens/s)."""
    return {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in items.items()}


def default_progress_bar() -> ProgressBar:
    """The bar Lightning would add by default (Rich when ``rich`` is installed, else tqdm), resuming right."""
    return ResumedRichProgressBar() if RequirementCache("rich>=10.2.2") else ResumedTQDMProgressBar()
