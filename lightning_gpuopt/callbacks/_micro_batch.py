"""What changing the micro-batch of a running fit takes beyond the batch-size attribute: the
validation cadence, and the check that the training loader really uses the new size."""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_hasattr

from lightning_gpuopt.callbacks._trial_step import batch_len

__all__ = ["check_batch", "check_can_set_micro_batch", "keep_validation_cadence", "late_checkpoint_choice"]


def keep_validation_cadence(trainer: pl.Trainer, old: int, new: int) -> None:
    """An integer ``val_check_interval`` counts micro-batches: rescale it from micro-batch ``old`` to
    ``new`` so validation still runs every as many samples, or say why it cannot be.

    Example::

        keep_validation_cadence(trainer, old=8, new=4)  # val_check_interval 100 -> 200

    Args:
        trainer: The running Trainer.
        old: The micro-batch the interval was set for.
        new: The micro-batch from now on.
    """
    interval = trainer.val_check_interval
    if not isinstance(interval, int) or old == new:
        return
    if (interval * old) % new == 0:
        trainer.val_check_interval = interval * old // new
    else:
        rank_zero_warn(
            f"AutoBatchSize: val_check_interval={interval} batches of {old} samples is not a whole number of "
            f"micro-batches of {new}, so it is left as is and validation runs every {interval * new} samples instead "
            f"of {interval * old}. Use a val_check_interval that is a multiple of {new // math.gcd(old, new)}."
        )


def loader_batch_size(loader: Any) -> Optional[int]:
    """The batch size a DataLoader says it uses (``batch_size``, or its batch sampler's); ``None`` when it says none."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def check_batch(trainer: pl.Trainer, batch: Any, expected: int, attr: str, replicas: int) -> bool:
    """Raise, with the fix, if the training loader does not use the micro-batch ``expected``.

    A DataLoader built once (in ``__init__`` or ``setup()``) ignores the batch size set on ``attr``
    afterwards, and the run would train another global batch than the one reported. The loader's
    own ``batch_size`` is compared; a loader without one (a custom batch sampler) is judged by the
    samples in ``batch`` (the first dimension of its first tensor). Returns ``False`` when the
    batch cannot tell (a short last batch of an epoch): check the next one. Warns once, and
    returns ``True``, when neither tells.

    Example::

        check_batch(trainer, batch, expected=12, attr="batch_size", replicas=1)

    Args:
        trainer: The running Trainer (in ``on_train_batch_start``).
        batch: The training batch.
        expected: The micro-batch it must hold.
        attr: The batch-size attribute that was set, for the message.
        replicas: Data-parallel ranks, for the message.
    """
    held, what = loader_batch_size(trainer.train_dataloader), "the training DataLoader's batch_size is"
    if held is None:
        held, what = batch_len(batch), "the training batch holds"
        if held is None:
            rank_zero_warn(
                f"AutoBatchSize: neither the training loader (no batch_size) nor its batch (no tensor) says how many "
                f"samples it holds, so whether it uses micro-batch {expected} cannot be checked: make sure "
                f"train_dataloader() builds its loader from `{attr}`."
            )
            return True
        if held < expected and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return False
    if held != expected:
        accumulate = trainer.accumulate_grad_batches
        raise ValueError(
            f"AutoBatchSize set the micro-batch to {expected} through `{attr}`, but {what} {held}, so each optimizer "
            f"step would train {held} x {accumulate} x {replicas} = {held * accumulate * replicas} samples instead of "
            f"the global batch {expected * accumulate * replicas}. The training DataLoader ignores `{attr}`: build it "
            f"inside train_dataloader() from self.{attr} (not once in __init__ or setup()), or remove AutoBatchSize "
            "and set the batch size yourself."
        )
    return True


def late_checkpoint_choice(saved: int, searched: int, same_batch: bool) -> tuple[bool, str, bool]:
    """Which micro-batch to keep when a checkpoint's arrives after this run's search.

    FSDP/FSDP2/DeepSpeed restore callbacks after ``on_fit_start``, so the search has run. The
    checkpoint's micro-batch is used when it is smaller than what the search found to fit (so it
    fits) and the per-device batch is the same: the run continues as the checkpoint's did
    (Lightning's loop counters count its micro-batches). Returns ``(use_saved, message, warn)``.

    Example::

        late_checkpoint_choice(saved=4, searched=8, same_batch=True)  # (True, "...", False)

    Args:
        saved: The checkpoint's micro-batch.
        searched: The one this run's search chose.
        same_batch: Whether the per-device batch is the checkpoint's.
    """
    arrived = (
        f"AutoBatchSize: the checkpoint's micro-batch ({saved}) arrived after this run's search (the strategy "
        f"restores callbacks after fit start)"
    )
    if saved < searched and same_batch:
        return (
            True,
            f"{arrived}; continuing with it, as the checkpoint's run did (the search found {searched} to fit)",
            False,
        )
    message = f"{arrived}; keeping the search's micro-batch {searched}."
    if saved == searched:
        return False, message, False
    why = (
        f"{saved} is larger than what fits here"
        if same_batch
        else "the per-device batch changed since the checkpoint (another global batch or number of devices)"
    )
    return (
        False,
        (
            f"{message} Not the checkpoint's, because {why}. Its loop counters count micro-batches of {saved}, so "
            "Lightning's batch count in this epoch is off (the data position, kept in samples, is not)."
        ),
        True,
    )


def check_can_set_micro_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str, max_micro: Optional[int]
) -> None:
    """Raise, with the fix, if ``AutoBatchSize`` cannot set this fit's micro-batch (at ``setup``, before any work).

    Args:
        trainer: The Trainer about to fit.
        pl_module: Its module.
        attr: The batch-size attribute to set, on the datamodule or the module.
        max_micro: ``AutoBatchSize.max_micro_batch_size``.
    """
    if trainer.strategy.root_device.type == "cpu" and max_micro is None:
        raise ValueError(
            "AutoBatchSize on CPU needs max_micro_batch_size: running out of host memory kills the process "
            "instead of raising an error, so the search must be bounded. Set AutoBatchSize(max_micro_batch_size=...)."
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "AutoBatchSize needs automatic optimization (it sets trainer.accumulate_grad_batches); "
            f"{type(pl_module).__name__} sets automatic_optimization=False."
        )
    if not lightning_hasattr(pl_module, attr):
        raise ValueError(
            f"AutoBatchSize sets the micro-batch through a `{attr}` attribute of the datamodule or the module, and "
            f"neither {type(pl_module).__name__} nor the datamodule has one: add it (and use it in train_dataloader()), "
            "or name yours with AutoBatchSize(batch_size_attr=...)."
        )
