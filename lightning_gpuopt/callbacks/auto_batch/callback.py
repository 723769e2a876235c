"""`AutoBatchSize`: the largest micro-batch that fits, with the global batch kept through gradient accumulation.

The callback decides and hands the size to the data; the search is in ``search.py``, the trials and
their undo in ``trial.py``, an out-of-memory error later in training in ``recovery.py``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_gpuopt.callbacks.auto_batch import recovery as oom
from lightning_gpuopt.callbacks.auto_batch.trial import batch_len, trial_steps
from lightning_gpuopt.internals import drop_train_loader, is_last_batch, require_internals
from lightning_gpuopt.callbacks.auto_batch import search
from lightning_gpuopt.callbacks.auto_batch.search import SEARCH_MODES, SearchMode, Trial
from lightning_gpuopt.option_checks import check_choice, check_int, check_number, option
from lightning_gpuopt.perf.parallel import data_parallel_size
from lightning_gpuopt.perf.oom import is_oom_error
from lightning_gpuopt.protocols import TakesMicroBatch

__all__ = ["AutoBatchSize"]


def current_micro_batch(trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str) -> int:
    """The micro-batch the training data uses now (``TakesMicroBatch.batch_size``, else ``attr``)."""
    data = trainer.datamodule
    return int(data.batch_size if isinstance(data, TakesMicroBatch) else lightning_getattr(pl_module, attr))


def hand_over(trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str, size: int) -> None:
    """Give the training data micro-batch ``size``: by ``use_micro_batch`` where the datamodule takes it
    (:class:`~lightning_gpuopt.protocols.TakesMicroBatch`), else by setting ``attr`` (the fallback, said at ``setup``).
    """
    data = trainer.datamodule
    if isinstance(data, TakesMicroBatch):
        data.use_micro_batch(size)
    else:
        lightning_setattr(pl_module, attr, size)


def keep_validation_cadence(trainer: pl.Trainer, old: int, new: int) -> None:
    """Rescale an integer ``val_check_interval`` from micro-batch ``old`` to ``new`` (same samples between
    validations), or warn why it cannot be."""
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
    """The batch size a DataLoader says it uses (its own or its batch sampler's), else ``None``."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def check_batch(trainer: pl.Trainer, batch: Any, expected: int, attr: str, replicas: int) -> bool:
    """Raise, with the fix, if the training loader ignores micro-batch ``expected`` (it was built once, in
    ``__init__`` or ``setup()``). ``False``: a short last batch cannot tell, check the next one."""
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
        if held < expected and is_last_batch(trainer):
            return False
    if held != expected:
        accumulate = trainer.accumulate_grad_batches
        data = trainer.datamodule
        by_call = isinstance(data, TakesMicroBatch)
        how, source = (f"{type(data).__name__}.use_micro_batch", "batch_size") if by_call else (f"`{attr}`", attr)
        raise ValueError(
            f"AutoBatchSize set the micro-batch to {expected} through {how}, but {what} {held}, so each optimizer "
            f"step would train {held} x {accumulate} x {replicas} = {held * accumulate * replicas} samples instead of "
            f"the global batch {expected * accumulate * replicas}. The training DataLoader ignores `{source}`: build "
            f"it inside train_dataloader() from self.{source} (not once in __init__ or setup()), or remove "
            "AutoBatchSize and set the batch size yourself."
        )
    return True


def late_checkpoint_choice(saved: int, searched: int, same_batch: bool) -> tuple[bool, str, bool]:
    """``(use_saved, message, warn)`` for a checkpoint's micro-batch that arrives after this run's search
    (FSDP/FSDP2/DeepSpeed restore callbacks after ``on_fit_start``): it is used when smaller than the searched
    one and the per-device batch is the same."""
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
    """Raise, with the fix, if ``AutoBatchSize`` cannot set this fit's micro-batch (at ``setup``)."""
    if trainer.strategy.root_device.type == "cpu" and max_micro is None:
        raise ValueError(
            "AutoBatchSize on CPU needs max_micro_batch_size: running out of host memory kills the process "
            "instead of raising an error, so the search must be bounded. Set "
            f"{option('AutoBatchSize', 'max_micro_batch_size')}."
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "AutoBatchSize needs automatic optimization (it sets trainer.accumulate_grad_batches); "
            f"{type(pl_module).__name__} sets automatic_optimization=False."
        )
    data = trainer.datamodule
    if isinstance(data, TakesMicroBatch):
        return
    if callable(getattr(data, "use_micro_batch", None)):  # meant to take it by a call, but AutoBatchSize cannot read it
        raise ValueError(
            f"{type(data).__name__} has use_micro_batch() but no `batch_size`, the micro-batch it uses now, which "
            "AutoBatchSize reads before its search (lightning_gpuopt.protocols.TakesMicroBatch has both): set "
            "self.batch_size in __init__ and in use_micro_batch(), and build train_dataloader()'s loader from it."
        )
    if not lightning_hasattr(pl_module, attr):
        raise ValueError(
            f"AutoBatchSize sets the micro-batch through a `{attr}` attribute of the datamodule or the module, and "
            f"neither {type(pl_module).__name__} nor the datamodule has one: add it (and use it in "
            f"train_dataloader()), or name yours with {option('AutoBatchSize', 'batch_size_attr')}."
        )
    data_name = type(data).__name__ if data is not None else "the training data (no datamodule)"
    rank_zero_info(
        f"AutoBatchSize: {data_name} does not take the micro-batch by a call (lightning_gpuopt.protocols."
        f"TakesMicroBatch), so it is set through the `{attr}` attribute: train_dataloader() must build its "
        "loader from it."
    )


class AutoBatchSize(Callback):
    """Finds the largest micro-batch that fits, and keeps the global batch with gradient accumulation.

    At the start of ``fit`` it runs ``steps_per_trial`` real training steps (the run's own precision,
    compile setting, strategy and model) at each candidate micro-batch that divides the per-device
    batch, so ``global_batch_size = micro_batch_size * accumulate_grad_batches * data-parallel ranks``
    holds exactly. The search leaves no trace, all ranks agree on the size, and a later out-of-memory
    error redoes the step with a smaller micro-batch (or saves and stops). Details and the logged
    ``auto_batch_size/*`` keys: ``docs/callbacks.md``.

    Example::

        trainer = Trainer(max_steps=5000, plugins=[BF16Precision()], callbacks=[AutoBatchSize(global_batch_size=512)])
        trainer.fit(GPTModule(preset="124m"), datamodule=TextDataModule(block_size=1024))

    Args:
        global_batch_size: Samples per optimizer step over all devices. ``None`` keeps the batch
            you configured: ``batch_size * accumulate_grad_batches * world_size``.
        max_micro_batch_size: Largest micro-batch to try. Required on CPU, where running out of
            memory kills the process instead of raising an error.
        mode: ``"binsearch"`` doubles until a size fails, then bisects; ``"power"`` only doubles.
        memory_margin: Fraction of the device's memory to leave free (CUDA only).
        steps_per_trial: Training steps per tried size; the second step runs with the optimizer state
            the first created, as training does (1 measures less memory than training needs).
        batch_size_attr: The attribute set on the datamodule or module when the datamodule does not
            take the micro-batch by a call (:class:`~lightning_gpuopt.protocols.TakesMicroBatch`).
        recover_oom: Recover from out-of-memory errors later in training.

    Note:
        Data order after a recovery is the same if the training loader's order does not depend on
        when it is created (no global-RNG ``shuffle``), or its datamodule implements
        :class:`~lightning_gpuopt.protocols.ResumableData`. A ``max_epochs``-based LR schedule is
        rebuilt when the search changes the global batch.
    """

    def __init__(
        self,
        global_batch_size: Optional[int] = None,
        max_micro_batch_size: Optional[int] = None,
        mode: SearchMode = "binsearch",
        memory_margin: float = 0.1,
        steps_per_trial: int = 2,
        batch_size_attr: str = "batch_size",
        recover_oom: bool = True,
    ) -> None:
        own = "AutoBatchSize"
        check_int(own, "global_batch_size", global_batch_size, minimum=1, optional=True)
        check_int(own, "max_micro_batch_size", max_micro_batch_size, minimum=1, optional=True)
        check_choice(own, "mode", mode, SEARCH_MODES)
        check_number(
            own,
            "memory_margin",
            memory_margin,
            low=0,
            high=1,
            high_open=True,
            hint=" (the fraction of memory to keep free)",
        )
        check_int(own, "steps_per_trial", steps_per_trial, minimum=1)
        self.global_batch_size = global_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.mode = mode
        self.memory_margin = memory_margin
        self.steps_per_trial = steps_per_trial
        self.batch_size_attr = batch_size_attr
        self.recover_oom = recover_oom
        self.micro_batch_size: Optional[int] = None
        self.accumulate_grad_batches: Optional[int] = None
        self.trials: list[Trial] = []
        self.recoveries: list[dict[str, int]] = []  # the decisions above are saved in checkpoints
        self._per_device: Optional[int] = None  # samples per optimizer step on one device, set at setup
        self._candidates: list[int] = []  # the micro-batches that keep it, smallest first
        self._global_changed = False  # the global batch differs from the one the Trainer was configured with
        self._restored: Optional[dict[str, Any]] = None
        self._undo_retry: Optional[Callable[[], None]] = None
        self._stopped = False  # this callback already stopped the run (and said why)
        self._searched_in_this_fit = False
        self._fit: Optional[tuple[pl.Trainer, pl.LightningModule]] = None  # the fit that searched, until teardown
        self._check_batch: Optional[int] = None  # the micro-batch the next training batch must hold

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._searched_in_this_fit = False  # before any checkpoint is restored (also after a failed fit)
        self._fit = None
        check_can_set_micro_batch(trainer, pl_module, self.batch_size_attr, self.max_micro_batch_size)
        replicas = data_parallel_size(trainer)
        micro = current_micro_batch(trainer, pl_module, self.batch_size_attr)
        configured = micro * trainer.accumulate_grad_batches * replicas  # the global batch the Trainer would train
        self._per_device = search.per_device_batch(self.global_batch_size or configured, replicas)  # fails now
        self._global_changed = self._per_device * replicas != configured
        self._candidates = search.micro_batch_candidates(self._per_device, self.max_micro_batch_size)
        require_internals(trainer, "AutoBatchSize")

    def largest_micro_batch(self) -> Optional[int]:
        """The largest micro-batch the search can choose, from ``setup`` on (``protocols.SearchesMicroBatch``):
        ``Float8Precision`` times its layers at it."""
        return self._candidates[-1] if self._candidates else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._check_batch is not None:  # the first training batch after a decision
            expected, self._check_batch = self._check_batch, None
            if not check_batch(trainer, batch, expected, self.batch_size_attr, data_parallel_size(trainer)):
                self._check_batch = expected  # a short last batch: the next epoch's first is checked

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restored is not None and self._apply_restored(trainer, pl_module):
            return
        with trial_steps(trainer, pl_module, self.steps_per_trial, self.memory_margin) as trial:
            best, self.trials = search.largest_fitting(self._candidates, trial, self.mode)
        if best is None:
            raise search.nothing_fits_error(self.memory_margin)
        self._apply(trainer, pl_module, best, self._global_changed)
        self._report(trainer)
        self._searched_in_this_fit = True
        self._fit = (trainer, pl_module)

    def _apply(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: int, global_batch_changed: bool
    ) -> None:
        self._set_micro_batch(trainer, pl_module, micro)
        # `estimated_stepping_batches` (read by configure_optimizers) may have built the train loader
        # with the old batch size: drop it so the fit loop builds it with the new one.
        drop_train_loader(trainer)
        if global_batch_changed and trainer.max_steps == -1:
            # An epoch-based LR schedule was sized for the old number of optimizer steps per epoch.
            trainer.strategy.setup_optimizers(trainer)

    def _set_micro_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: int) -> None:
        old = current_micro_batch(trainer, pl_module, self.batch_size_attr)
        self.micro_batch_size = micro
        self.accumulate_grad_batches = self._per_device // micro
        hand_over(trainer, pl_module, self.batch_size_attr, micro)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        keep_validation_cadence(trainer, old, micro)
        self._check_batch = micro

    def _apply_restored(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Use the checkpoint's decision, unless the per-device batch changed."""
        restored, self._restored = self._restored, None
        if restored.get("per_device_batch") != self._per_device:
            rank_zero_info("AutoBatchSize: the per-device batch changed since the checkpoint: searching again.")
            return False
        micro = min(restored["micro_batch_size"], self._candidates[-1])  # the largest below max_micro_batch_size
        self._apply(trainer, pl_module, micro, global_batch_changed=False)
        rank_zero_info(
            f"AutoBatchSize: micro-batch {micro} x {self.accumulate_grad_batches} accumulation, from the checkpoint."
        )
        return True

    def _report(self, trainer: pl.Trainer) -> None:
        table, trace = search.describe_search(self.trials)
        replicas = data_parallel_size(trainer)
        metrics = search.search_metrics(self.trials, self.micro_batch_size, self.accumulate_grad_batches, replicas)
        rank_zero_info(
            f"AutoBatchSize: micro-batch {self.micro_batch_size} x {self.accumulate_grad_batches} accumulation x "
            f"{replicas} data-parallel devices = global batch {metrics['auto_batch_size/global_batch_size']}\n{table}"
        )
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
                logger.log_hyperparams({"auto_batch_size/search": trace})

    # ------------------------------------------------------------------ OOM later in training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recover_oom and trainer.world_size == 1 and self._undo_retry is None:
            self._undo_retry = oom.retry_on_oom(trainer, lambda *args: self._recover(trainer, pl_module, *args))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._undo_retry is not None:
            self._undo_retry()
            self._undo_retry = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
        if (
            self._stopped
            or trainer.state.fn != TrainerFn.FITTING
            or not is_oom_error(exception)
            or self.micro_batch_size is None
        ):
            return
        # Multi-process runs (no in-process recovery): keep the last completed step where we can.
        smaller = search.fallback_micro_batch(self.micro_batch_size, self._per_device or self.micro_batch_size)
        path = oom.emergency_checkpoint(trainer) if not oom.is_sharded(trainer) else None
        message = oom.stop_message(trainer, self.micro_batch_size, smaller, path)
        if trainer.world_size > 1:  # the rank that ran out of memory may not be rank 0
            warnings.warn(rank_prefixed_message(message, trainer.global_rank))
        else:
            rank_zero_warn(message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit = None  # no reference to the Trainer outlives its fit

    def _recover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, data_fetcher: Any, message: str) -> None:
        old = self.micro_batch_size or current_micro_batch(trainer, pl_module, self.batch_size_attr)
        self._per_device = self._per_device or old * trainer.accumulate_grad_batches
        new = search.fallback_micro_batch(old, self._per_device)
        if new is None:
            self._stopped = True
            path = None if oom.is_sharded(trainer) else oom.emergency_checkpoint(trainer)
            raise RuntimeError(oom.stop_message(trainer, old, None, path) + f" (error: {message})")
        oom.redo_step(trainer, data_fetcher, old, new, lambda size: self._set_micro_batch(trainer, pl_module, size))
        self.recoveries.append({"step": trainer.global_step, "from": old, "to": new})
        rank_zero_warn(
            f"AutoBatchSize: out of memory at step {trainer.global_step} with micro-batch {old} ({message}). "
            f"Redoing the step with micro-batch {new} x {self.accumulate_grad_batches} accumulation: "
            "the global batch and the data order are unchanged."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._restored is not None:  # loaded, to be applied at the next fit start: it is still the state
            return dict(self._restored)
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "per_device_batch": self._per_device,
            "trials": [[t.micro_batch_size, t.fits, t.peak_memory, t.reason] for t in self.trials],
            "recoveries": [dict(r) for r in self.recoveries],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("micro_batch_size") is None:
            return
        if self._searched_in_this_fit:  # FSDP/FSDP2/DeepSpeed restore callbacks after on_fit_start
            self._load_after_search(state_dict)
            return
        self._restored = dict(state_dict)
        self.trials = [Trial(*t) for t in state_dict.get("trials", [])]
        self.recoveries = [dict(r) for r in state_dict.get("recoveries", [])]

    def _load_after_search(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["micro_batch_size"]
        same_batch = state_dict.get("per_device_batch") == self._per_device
        use_saved, message, warn = late_checkpoint_choice(
            saved, self.micro_batch_size, same_batch and self._fit is not None
        )
        if use_saved:
            # The train loader is not built yet: the checkpoint's micro-batch applies from the first batch.
            self._apply(*self._fit, saved, global_batch_changed=False)
            self.recoveries = [dict(r) for r in state_dict.get("recoveries", [])]
        (rank_zero_warn if warn else rank_zero_info)(
            message + (f" ({saved} x {self.accumulate_grad_batches} accumulation)" if use_saved else "")
        )
