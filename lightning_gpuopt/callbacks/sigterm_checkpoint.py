"""`SigtermCheckpoint`: on SIGTERM or a first Ctrl-C, save ``last.ckpt`` where ``--ckpt_path last`` finds it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_gpuopt.option_checks import check_file_name, from_command_line, option
from lightning_gpuopt.internals import (
    mark_sigterm_received,
    require_internals,
    settle_validation_counters,
    sigterm_notice_logger,
)
from lightning_gpuopt.resume import microbatches_since_step, restart_interrupted_validation

__all__ = ["SigtermCheckpoint"]


class _OwnSigterm(logging.Filter):
    """Leaves out Lightning's "Received SIGTERM: 15" for the SIGTERM a Ctrl-C was turned into: said once, by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Received SIGTERM" not in record.getMessage()


class SigtermCheckpoint(Callback):
    """Writes a resumable checkpoint when the process receives SIGTERM (a scheduler's preemption or ``kill``).

    After the current micro-batch the run is saved into the first ``ModelCheckpoint``'s ``last.ckpt``,
    the file ``fit(ckpt_path="last")`` looks for; a first Ctrl-C does the same, a second stops at once.
    Only SIGTERM during ``fit`` saves. With several processes, a SIGTERM that reaches only some of them
    stops every rank after the same micro-batch. Details: ``docs/reliability.md``.

    Example::

        trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True, every_n_train_steps=500),
                                     ExactResume(), SigtermCheckpoint()])
        trainer.fit(module, datamodule=data)           # kill -TERM <pid>: ckpt/last.ckpt is written
        trainer.fit(module, datamodule=data, ckpt_path="last")  # continues from it

    Args:
        filename: Name of the file written in the ``ModelCheckpoint``'s folder, without ``.ckpt``.
    """

    def __init__(self, filename: str = "last") -> None:
        check_file_name("SigtermCheckpoint", "filename", filename)
        self.filename = filename
        self._previous_sigint: Any = None
        self._own_sigterm = _OwnSigterm()
        self._interrupted = False
        self._saving = False  # inside this callback's own save
        self._validation_step: Optional[int] = None  # the step whose validation the checkpoint interrupted
        self._group: Any = None  # a gloo group of every rank, for agreeing on a SIGTERM (several processes only)
        self._launcher: Any = None
        self._received = False  # this process received SIGTERM; the ranks agree on it after each micro-batch

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # The first Ctrl-C: hand the second one back to the previous handler, then take Lightning's SIGTERM path.
        self._restore_sigint()
        self._interrupted = True
        rank_zero_info("SigtermCheckpoint: Ctrl-C; saving last.ckpt after this batch (Ctrl-C again to stop at once).")
        sigterm_notice_logger().addFilter(self._own_sigterm)  # until teardown
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def _target(self, trainer: pl.Trainer) -> Optional[str]:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return os.path.join(callback.dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)
        return None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not any(isinstance(c, ModelCheckpoint) for c in trainer.checkpoint_callbacks):
            if from_command_line():  # gpuopt adds this callback itself: checkpointing off is a choice, not remarked on
                return
            rank_zero_warn(
                "SigtermCheckpoint: the Trainer has no ModelCheckpoint, so a SIGTERM saves nothing. Add a "
                f"ModelCheckpoint that keeps last.ckpt ({option('ModelCheckpoint', 'save_last', True)}), or remove "
                "SigtermCheckpoint."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning has taken its snapshot of the handlers (it puts them all back at teardown). Only the main
        # thread may set handlers; Lightning handles no SIGTERM on Windows.
        if os.name == "posix" and threading.current_thread() is threading.main_thread():
            self._interrupted = False
            if self._previous_sigint is None:
                self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
            if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
                self._handle_sigterm_across_ranks(trainer)
        if self._validation_step is not None:  # Lightning has read the loop state: the validation runs next
            require_internals(trainer, "SigtermCheckpoint (resuming an interrupted validation)")
            settle_validation_counters(trainer)
            rank_zero_info(f"SigtermCheckpoint: running the validation of step {self._validation_step} again, "
                           "which the checkpoint's SIGTERM interrupted.")
            self._validation_step = None

    def _handle_sigterm_across_ranks(self, trainer: pl.Trainer) -> None:
        require_internals(trainer, "SigtermCheckpoint (a SIGTERM agreed on by every rank)")
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank calls this hook, in the same order
        self._launcher, self._received = trainer.strategy.launcher, False
        # Lightning's handler, which broadcasts, is put back at teardown
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._received and self._launcher is not None:
            self._launcher.kill(signum)  # the processes this one started on its node (none under torchrun or SLURM)
        self._received = True

    def _agree_on_sigterm(self, trainer: pl.Trainer) -> None:
        """Every rank learns whether any received SIGTERM; Lightning then stops them all after the same micro-batch."""
        if self._group is None:
            return
        flag = torch.tensor([int(self._received)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and not trainer.received_sigterm:
            rank_zero_info("SigtermCheckpoint: a process of this run received SIGTERM; every rank stops after this "
                           "batch.")
            mark_sigterm_received(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._agree_on_sigterm(trainer)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._agree_on_sigterm(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        interrupted_validation = (
            self._saving and trainer.state.fn == "fit" and trainer.validating and not trainer.sanity_checking
            and microbatches_since_step(trainer) == 0 and "loops" in checkpoint
        )
        if interrupted_validation:
            restart_interrupted_validation(checkpoint["loops"]["fit_loop"])
            checkpoint.setdefault("callbacks", {})[self.state_key] = {"validation_step": trainer.global_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validation_step = state_dict.get("validation_step")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_sigint()
        sigterm_notice_logger().removeFilter(self._own_sigterm)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group, self._launcher = None, None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking or trainer.fast_dev_run:
            return
        if trainer.state.fn != "fit":  # validate/test/predict: the file may be the very checkpoint being read
            return
        path = self._target(trainer)
        if path is None:
            return
        self._saving = True
        try:
            trainer.save_checkpoint(path, weights_only=False)  # the full training state, to resume from
        finally:
            self._saving = False
        cause = "Ctrl-C" if self._interrupted else "SIGTERM"
        rank_zero_info(f"SigtermCheckpoint: received {cause}; saved {path} (resume with --ckpt_path last).")
