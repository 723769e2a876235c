"""Out of memory later in training: redo the step with a smaller micro-batch, or save the last step and stop.

The decisions are ``AutoBatchSize``'s; these functions do the work, reaching Lightning's private loop
state through :mod:`lightning_gpuopt.internals`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gpuopt.callbacks.auto_batch.trial import forget_unfinished_scaler_step
from lightning_gpuopt.internals import (
    dump_checkpoint,
    move_batch_position,
    rebuild_train_loader,
    wrap_epoch_advance,
)
from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.oom import free_memory, is_oom_error
from lightning_gpuopt.protocols import ResumableData, saving_alone
from lightning_gpuopt.resume import rollback_fit_loop_state, step_boundary

__all__ = ["emergency_checkpoint", "is_sharded", "redo_step", "retry_on_oom", "stop_message"]


def retry_on_oom(trainer: pl.Trainer, recover: Callable[[Any, str], None]) -> Callable[[], None]:
    """Run each training batch again after ``recover(data_fetcher, message)`` when it runs out of memory;
    ``recover`` moves the loop back (:func:`redo_step`) or raises. Returns a function that undoes the wrapping."""

    def advance(original: Callable[[Any], None], data_fetcher: Any) -> None:
        while True:
            try:
                return original(data_fetcher)
            except Exception as err:
                if not is_oom_error(err):
                    raise
                message = str(err).splitlines()[0] if str(err) else type(err).__name__
            # Outside the `except`: the traceback, which holds the failed step's activations, is gone.
            discard_partial_step(trainer)
            recover(data_fetcher, message)

    return wrap_epoch_advance(trainer, advance)


def discard_partial_step(trainer: pl.Trainer) -> None:
    """Drop the gradients of a step that failed part-way, and the memory it held."""
    for opt in trainer.optimizers:
        opt.zero_grad(set_to_none=True)
    forget_unfinished_scaler_step(trainer)
    free_memory(trainer.strategy.root_device)


def redo_step(trainer: pl.Trainer, data_fetcher: Any, old: int, new: int, apply: Callable[[int], None]) -> None:
    """Move the fit loop back to the first micro-batch of the failed step, in micro-batches of ``new``.

    ``apply(new)`` sets the new micro-batch; the train loader is rebuilt in the same epoch, and a
    :class:`~lightning_gpuopt.protocols.ResumableData` datamodule is asked where the step started (other
    loaders restart the epoch and are fast-forwarded).
    """
    batches_before = step_boundary(trainer) * old // new  # samples of this epoch before the step, in new batches
    datamodule = trainer.datamodule
    data_state = datamodule.state_dict() if isinstance(datamodule, ResumableData) else None  # before anything changes
    apply(new)
    move_batch_position(trainer, batches_before)
    if data_state is not None:
        datamodule.load_state_dict(data_state)
    rebuild_train_loader(trainer, data_fetcher)
    for _ in range(0 if data_state is not None else batches_before):
        next(data_fetcher)


def emergency_checkpoint(trainer: pl.Trainer) -> Optional[str]:
    """Save the last completed step from this rank alone (no collectives: the others may be stuck), its loop
    counters and data position rolled back so a resume redoes the failed step; the path, or ``None`` (warned)."""
    directory = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
    path = os.path.join(directory, f"oom-step={trainer.global_step}-rank={trainer.global_rank}.ckpt")
    try:
        os.makedirs(directory, exist_ok=True)
        with saving_alone(trainer):
            checkpoint = dump_checkpoint(trainer)
        rollback_fit_loop_state(checkpoint["loops"]["fit_loop"], step_boundary(trainer))
        trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, path)
    except Exception as err:  # never hide the OOM behind a failed save
        rank_zero_warn(f"AutoBatchSize: could not save the emergency checkpoint {path}: {err}")
        return None
    return path


def is_sharded(trainer: pl.Trainer) -> bool:
    """Whether the weights are sharded across ranks (one rank alone cannot save them)."""
    return isinstance(trainer.strategy, (ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy))


def stop_message(trainer: pl.Trainer, micro: int, smaller: Optional[int], path: Optional[str]) -> str:
    """What to change after running out of memory at micro-batch ``micro`` (``smaller``: the next size to try)."""
    where = f"Saved the last completed step (global step {trainer.global_step}) to {path}. " if path else ""
    resume = f", resuming with {option('Trainer.fit', 'ckpt_path', path)}" if path else ""
    if smaller is None:
        fix = (
            "Even micro-batch 1 does not fit: make the model smaller in memory "
            f"({option('GPTModule', 'activation_checkpointing', True)}, "
            f"a shorter block_size, or FSDP2 across more GPUs){resume}"
        )
    else:
        fix = f"Run again with {option('AutoBatchSize', 'max_micro_batch_size', smaller)}{resume}"
    return f"AutoBatchSize: out of memory during training with micro-batch {micro}. {where}{fix}."
