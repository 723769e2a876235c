"""Progress bars whose training bar counts a resumed epoch from where it stopped, with its total and ETA.

Lightning's bars count batches of the epoch (``batch_idx + 1``) against ``max_steps - global_step``. Both
start at zero in a fresh fit; in a fit resumed inside an epoch the count starts at the resumed batch while
the total shrank by the steps already done, so the count passes the total: tqdm then shows ``84/?`` with
no ETA, Rich ``84/40``, and the rate starts at the resumed batch over a second. These bars start the count
at the resumed batch (the rate and ETA cover this fit's batches) and total the epoch as a fresh fit would.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

__all__ = ["ResumedRichProgressBar", "ResumedTQDMProgressBar", "default_progress_bar", "train_bar_span"]


def train_bar_span(trainer: pl.Trainer) -> tuple[int, Optional[int]]:
    """``(done, total)`` of this epoch's training bar, in batches: ``done`` batches of the epoch ran before
    this fit (0 unless it resumed inside the epoch); ``total`` is the epoch's batches up to ``max_steps``
    (``None`` for an endless loader without ``max_steps``)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    total: float = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches  # batches, not steps
        total = min(total, done + left)
    return done, (None if math.isinf(total) else int(total))


class ResumedTQDMProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` whose training bar starts at a resumed epoch's batch (see the module)."""

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


class ResumedRichProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` whose training bar starts at a resumed epoch's batch (see the module)."""

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
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), int):
            items["v_num"] = str(items["v_num"])  # a log version, not a metric: "0", not Rich's "0.000"
        return items

    def _start_at_resumed_batch(self, trainer: pl.Trainer) -> None:
        if self.progress is None or self.is_disabled:
            return
        done, total = train_bar_span(trainer)
        if self.train_progress_bar_id is None:  # resumed mid-epoch: Lightning would add it at the first batch's end
            self.train_progress_bar_id = self.progress.add_task(f"Epoch {trainer.current_epoch}", total=total)
        if total is not None:  # reset also clears the speed samples: the rate covers this fit's batches
            self.progress.reset(self.train_progress_bar_id, total=total, completed=done)
            self.refresh()


def default_progress_bar() -> ProgressBar:
    """The bar Lightning would add by default (Rich when ``rich`` is installed, else tqdm), resuming right."""
    return ResumedRichProgressBar() if RequirementCache("rich>=10.2.2") else ResumedTQDMProgressBar()
