"""`AutoBatchSize`: the largest micro-batch that fits, with the global batch kept through gradient accumulation."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate
from typing_extensions import override

from lightning_gpuopt.callbacks._training_state import TrainingState, forget_unfinished_scaler_step
from lightning_gpuopt.perf.batch_search import (
    Trial,
    fallback_micro_batch,
    largest_fitting,
    micro_batch_candidates,
    per_device_batch,
)
from lightning_gpuopt.perf.oom import free_memory, is_oom_error
from lightning_gpuopt.resume import no_collectives, rollback_fit_loop_state, step_boundary

__all__ = ["AutoBatchSize"]

_GB = 1024**3


def _tuned_compile(pl_module: pl.LightningModule) -> bool:
    """Whether the module says (GPTModule's hparams) it compiles with a tuning mode (max-autotune, reduce-overhead)."""
    hparams = getattr(pl_module, "hparams", None) or {}
    return bool(hparams.get("compile")) and hparams.get("compile_mode") not in (None, "default")


class AutoBatchSize(Callback):
    """Finds the largest micro-batch that fits, and keeps the global batch with gradient accumulation.

    At the start of ``fit``, with the run's own precision plugin, ``torch.compile`` setting,
    strategy and model, it runs ``steps_per_trial`` real training steps (forward, backward and
    optimizer step, on batches of the real shape taken from the training data) at candidate
    micro-batch sizes, and keeps the largest that runs without running out of memory and leaves
    ``memory_margin`` of the device's memory free. Only sizes that divide the per-device batch
    are tried, so that

        ``global_batch_size = micro_batch_size * accumulate_grad_batches * data-parallel ranks``

    holds exactly: the optimisation (global batch, learning-rate schedule) is what you
    configured, whatever the GPU. The datamodule's (or module's) ``batch_size`` is set to the
    micro-batch and ``trainer.accumulate_grad_batches`` to the accumulation.

    The search leaves no trace: weights, optimizer and LR-scheduler state, grad-scaler state,
    RNG states, ``global_step`` and the logged metrics are exactly as before (other callbacks do
    not see the trial steps). Under DDP and FSDP2 all ranks agree on the smallest size that fits
    on every rank.

    If the device runs out of memory later in training (longer sequences, fragmentation), the
    step is redone from its first micro-batch with a smaller micro-batch (the largest divisor of
    the per-device batch at most half of it) and proportionally more accumulation: the global
    batch and the order of the samples stay the same, so no work is lost. Where that is not
    possible (micro-batch already 1) it writes a checkpoint of the last completed step and stops
    with a message naming what to change. In multi-process runs the other ranks cannot join a
    redone step, so there the run stops with the checkpoint (DDP) or the message (FSDP2).

    On CPU a real memory exhaustion kills the process instead of raising an error, so there
    ``max_micro_batch_size`` is required; the search itself is the same on every device.

    Logged once, to every logger and the console:

    =====================================  ==========================================
    Key                                    Meaning
    =====================================  ==========================================
    ``auto_batch_size/micro_batch_size``   Chosen micro-batch per device
    ``auto_batch_size/accumulate_grad``    Gradient-accumulation steps
    ``auto_batch_size/global_batch_size``  Samples per optimizer step, all devices
    ``auto_batch_size/peak_memory_gb``     Peak reserved memory of the chosen size (CUDA)
    ``auto_batch_size/trials``             Number of sizes tried
    ``auto_batch_size/search``             The trace, as a hyperparameter: ``"1 fits; 2 fits; 4 no (out of memory)"``
    =====================================  ==========================================

    Example::

        trainer = Trainer(
            max_steps=5000,
            plugins=[BF16Precision()],
            callbacks=[AutoBatchSize(global_batch_size=512)],
        )
        trainer.fit(GPTModule(preset="124m"), datamodule=TextDataModule(block_size=1024))

    Args:
        global_batch_size: Samples per optimizer step over all devices. ``None`` keeps the batch
            you configured: ``batch_size * accumulate_grad_batches * world_size``.
        max_micro_batch_size: Largest micro-batch to try. Required on CPU.
        mode: ``"binsearch"`` doubles until a size fails, then bisects; ``"power"`` only doubles.
        memory_margin: Fraction of the device's memory to leave free (CUDA only), as headroom
            for fragmentation and longer sequences.
        steps_per_trial: Training steps per tried size. The default 2 runs the second step with
            the optimizer state the first one created, as every training step after the first
            does; 1 measures less memory than training needs.
        batch_size_attr: Name of the batch-size attribute on the datamodule or module.
        recover_oom: Recover from out-of-memory errors later in training.

    Note:
        Data order after a recovery is the same only if the training dataloader's order does not
        depend on when it is created: true for ``TextDataModule`` and for any loader without a
        global-RNG ``shuffle``. A ``max_epochs``-based LR schedule is rebuilt when the search
        changes the global batch.
    """

    def __init__(
        self,
        global_batch_size: Optional[int] = None,
        max_micro_batch_size: Optional[int] = None,
        mode: Literal["binsearch", "power"] = "binsearch",
        memory_margin: float = 0.1,
        steps_per_trial: int = 2,
        batch_size_attr: str = "batch_size",
        recover_oom: bool = True,
    ) -> None:
        if global_batch_size is not None and global_batch_size < 1:
            raise ValueError(f"AutoBatchSize.global_batch_size must be >= 1 (or None), got {global_batch_size}.")
        if max_micro_batch_size is not None and max_micro_batch_size < 1:
            raise ValueError(f"AutoBatchSize.max_micro_batch_size must be >= 1 (or None), got {max_micro_batch_size}.")
        if mode not in ("binsearch", "power"):
            raise ValueError(f"AutoBatchSize.mode must be 'binsearch' or 'power', got {mode!r}.")
        if not 0 <= memory_margin < 1:
            raise ValueError(
                f"AutoBatchSize.memory_margin is the fraction of memory to keep free, in [0, 1): got {memory_margin}."
            )
        if steps_per_trial < 1:
            raise ValueError(f"AutoBatchSize.steps_per_trial must be >= 1, got {steps_per_trial}.")
        self.global_batch_size = global_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.mode = mode
        self.memory_margin = memory_margin
        self.steps_per_trial = steps_per_trial
        self.batch_size_attr = batch_size_attr
        self.recover_oom = recover_oom
        # Decisions (saved in checkpoints, so a resumed run uses them without searching again).
        self.micro_batch_size: Optional[int] = None
        self.accumulate_grad_batches: Optional[int] = None
        self.trials: list[Trial] = []
        self.recoveries: list[dict[str, int]] = []
        self._per_device: Optional[int] = None
        self._restored: Optional[dict[str, Any]] = None
        self._original_advance: Optional[Callable] = None
        self._stopped = False  # this callback already stopped the run (and said why)
        self._searched_in_this_fit = False
        self._fit: Optional[tuple[pl.Trainer, pl.LightningModule]] = None  # the fit that searched, until teardown

    # ------------------------------------------------------------------------------------ checks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._searched_in_this_fit = False  # before any checkpoint is restored (also after a failed fit)
        self._fit = None
        if trainer.strategy.root_device.type == "cpu" and self.max_micro_batch_size is None:
            raise ValueError(
                "AutoBatchSize on CPU needs max_micro_batch_size: running out of host memory kills the process "
                "instead of raising an error, so the search must be bounded. Set "
                "AutoBatchSize(max_micro_batch_size=...)."
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoBatchSize needs automatic optimization (it sets trainer.accumulate_grad_batches); "
                f"{type(pl_module).__name__} sets automatic_optimization=False."
            )
        if not lightning_hasattr(pl_module, self.batch_size_attr):
            raise ValueError(
                f"AutoBatchSize sets the micro-batch through a `{self.batch_size_attr}` attribute of the datamodule "
                f"or the module, and neither {type(pl_module).__name__} nor the datamodule has one: add it (and use it "
                "in train_dataloader()), or name yours with AutoBatchSize(batch_size_attr=...)."
            )
        if self.global_batch_size is not None:
            per_device_batch(self.global_batch_size, _data_parallel_size(trainer))  # fails now, not after the data prep

    # ----------------------------------------------------------------------------------- search
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        configured = int(lightning_getattr(pl_module, self.batch_size_attr))
        replicas = _data_parallel_size(trainer)
        configured_global = configured * trainer.accumulate_grad_batches * replicas
        global_batch = self.global_batch_size or configured_global
        self._per_device = per_device_batch(global_batch, replicas)
        if self._restored is not None and self._apply_restored(trainer, pl_module):
            return
        candidates = micro_batch_candidates(self._per_device, self.max_micro_batch_size)
        state = TrainingState.capture(trainer, pl_module)  # first: building the sample batches may draw from the RNG
        batches = _SampleBatches(trainer, pl_module)
        try:
            with _quiet_trainer(trainer):
                best, self.trials = largest_fitting(
                    candidates, lambda size: self._try(trainer, pl_module, batches(size), size), self.mode
                )
        finally:
            state.restore(trainer, pl_module)
            del batches
            free_memory(trainer.strategy.root_device)
            # Compiled graphs are kept: the trial at micro-batch 1 compiles one (Dynamo specialises size 1),
            # the next size a second with a dynamic batch dimension, which every larger trial and then
            # training reuse. So the search and training compile twice in all, and the trials measured
            # the memory of the very graph that trains. Under a tuning compile mode (max-autotune,
            # reduce-overhead) the trial graphs were tuned or captured for the trial sizes: those are
            # dropped and training compiles its own.
            if _tuned_compile(pl_module):
                torch.compiler.reset()
        if best is None:
            raise RuntimeError(
                "AutoBatchSize: even a micro-batch of 1 runs out of memory"
                + (f" (or leaves less than memory_margin={self.memory_margin} free)" if self.memory_margin else "")
                + ". Make the model fit first: GPTModule(activation_checkpointing=True), a shorter block_size, "
                "FSDP2 (ModelParallelStrategy) across more GPUs, or a lower memory_margin."
            )
        self._apply(trainer, pl_module, best, global_batch != configured_global)
        self._report(trainer)
        self._searched_in_this_fit = True
        self._fit = (trainer, pl_module)

    def _try(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, size: int) -> Trial:
        """Run the trial steps at one size on every rank; fits only if it fits on all of them."""
        device = trainer.strategy.root_device
        free_memory(device)
        fits, reason = True, ""
        sync = _PeerSync(trainer, pl_module)
        try:
            with sync:
                for _ in range(self.steps_per_trial):
                    _training_step(trainer, pl_module, batch, sync)
        except _PeerOutOfMemory:
            fits, reason = False, "out of memory on another rank"
        except Exception as err:
            if not is_oom_error(err):
                raise
            fits, reason = False, "out of memory"
            sync.tell_peers()
        if fits is False:
            pl_module.zero_grad(set_to_none=True)
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
            forget_unfinished_scaler_step(trainer)
        peak = None
        if device.type == "cuda":
            peak = torch.cuda.max_memory_reserved(device)
            total = torch.cuda.get_device_properties(device).total_memory
            if fits and peak > (1 - self.memory_margin) * total:
                fits, reason = False, f"peak {peak / _GB:.1f} GB leaves less than {self.memory_margin:.0%} free"
        free_memory(device)
        agreed = trainer.strategy.reduce_boolean_decision(fits, all=True)
        if fits and not agreed:
            reason = "out of memory on another rank"
        return Trial(size, agreed, peak, reason)

    def _apply(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: int, global_batch_changed: bool
    ) -> None:
        old = int(lightning_getattr(pl_module, self.batch_size_attr))
        self.micro_batch_size = micro
        self.accumulate_grad_batches = self._per_device // micro
        lightning_setattr(pl_module, self.batch_size_attr, micro)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        _keep_validation_cadence(trainer, old, micro)
        # `estimated_stepping_batches` (read by configure_optimizers) may have built the train loader
        # with the old batch size: drop it so the fit loop builds it with the new one.
        trainer.fit_loop._combined_loader = None
        if global_batch_changed and trainer.max_steps == -1:
            # An epoch-based LR schedule was sized for the old number of optimizer steps per epoch.
            trainer.strategy.setup_optimizers(trainer)

    def _apply_restored(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Use the decision saved in the checkpoint, unless the world size or the bounds changed."""
        restored, self._restored = self._restored, None
        if restored.get("per_device_batch") != self._per_device:
            rank_zero_info("AutoBatchSize: the per-device batch changed since the checkpoint: searching again.")
            return False
        micro = restored["micro_batch_size"]
        if self.max_micro_batch_size is not None and micro > self.max_micro_batch_size:
            micro = micro_batch_candidates(self._per_device, self.max_micro_batch_size)[-1]
        self._apply(trainer, pl_module, micro, global_batch_changed=False)
        rank_zero_info(
            f"AutoBatchSize: micro-batch {micro} x {self.accumulate_grad_batches} accumulation, from the checkpoint."
        )
        return True

    def _report(self, trainer: pl.Trainer) -> None:
        lines = [f"  {t.micro_batch_size:>6}  {'fits' if t.fits else 'no':>4}  " + _format_peak(t) for t in self.trials]
        replicas = _data_parallel_size(trainer)
        global_batch = self.micro_batch_size * self.accumulate_grad_batches * replicas
        rank_zero_info(
            f"AutoBatchSize: micro-batch {self.micro_batch_size} x {self.accumulate_grad_batches} accumulation "
            f"x {replicas} data-parallel devices = global batch {global_batch}\n"
            "  micro  fits  peak memory\n" + "\n".join(lines)
        )
        chosen = next(t for t in self.trials if t.micro_batch_size == self.micro_batch_size and t.fits)
        metrics = {
            "auto_batch_size/micro_batch_size": self.micro_batch_size,
            "auto_batch_size/accumulate_grad": self.accumulate_grad_batches,
            "auto_batch_size/global_batch_size": global_batch,
            "auto_batch_size/trials": len(self.trials),
        }
        if chosen.peak_memory is not None:
            metrics["auto_batch_size/peak_memory_gb"] = chosen.peak_memory / _GB
        # The trace as one readable string, e.g. "1 fits; 2 fits; 4 no (out of memory)".
        trace = "; ".join(
            f"{t.micro_batch_size} {'fits' if t.fits else 'no'}" + (f" ({t.reason})" if t.reason else "") for t in self.trials
        )
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
                logger.log_hyperparams({"auto_batch_size/search": trace})

    # ------------------------------------------------------------------ OOM later in training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.recover_oom or trainer.world_size > 1 or self._original_advance is not None:
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        self._original_advance = original = epoch_loop.advance

        def advance(data_fetcher: Any) -> None:
            while True:
                oom_message = None
                try:
                    return original(data_fetcher)
                except Exception as err:
                    if not is_oom_error(err):
                        raise
                    oom_message = str(err).splitlines()[0] if str(err) else type(err).__name__
                # Outside the `except`: the traceback, which holds the failed step's activations, is gone.
                self._recover(trainer, pl_module, data_fetcher, oom_message)

        epoch_loop.advance = advance

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unwrap(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unwrap(trainer)
        if (
            self._stopped
            or trainer.state.fn != TrainerFn.FITTING
            or not is_oom_error(exception)
            or self.micro_batch_size is None
        ):
            return
        # Multi-process runs (no in-process recovery): keep the last completed step where we can.
        smaller = fallback_micro_batch(self.micro_batch_size, self._per_device or self.micro_batch_size)
        path = self._emergency_checkpoint(trainer) if not _is_sharded(trainer) else None
        message = _stop_message(trainer, self.micro_batch_size, smaller, path)
        if trainer.world_size > 1:  # the rank that ran out of memory may not be rank 0
            warnings.warn(rank_prefixed_message(message, trainer.global_rank))
        else:
            rank_zero_warn(message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit = None  # no reference to the Trainer outlives its fit

    def _unwrap(self, trainer: pl.Trainer) -> None:
        if self._original_advance is not None:
            trainer.fit_loop.epoch_loop.advance = self._original_advance
            self._original_advance = None

    def _recover(self, trainer: pl.Trainer, pl_module: pl.LightningModule, data_fetcher: Any, message: str) -> None:
        for opt in trainer.optimizers:  # the partial step's gradients are discarded; the step is redone
            opt.zero_grad(set_to_none=True)
        forget_unfinished_scaler_step(trainer)
        free_memory(trainer.strategy.root_device)
        old = self.micro_batch_size or int(lightning_getattr(pl_module, self.batch_size_attr))
        per_device = self._per_device or old * trainer.accumulate_grad_batches
        new = fallback_micro_batch(old, per_device)
        epoch_loop = trainer.fit_loop.epoch_loop
        if new is None:
            self._stopped = True
            path = None if _is_sharded(trainer) else self._emergency_checkpoint(trainer)
            raise RuntimeError(_stop_message(trainer, old, None, path) + f" (error: {message})")
        # The failed micro-batch was not processed, so the step boundary is where the failed step started.
        done_in_epoch = step_boundary(trainer) * old  # samples of this epoch before the redone step
        batches_before = done_in_epoch // new
        progress = epoch_loop.batch_progress
        progress.is_last_batch = False
        # A datamodule that positions its own loaders (TextDataModule: `train_position()`, saved in
        # its state) is asked where the step started before anything changes; other loaders restart
        # the epoch and are fast-forwarded below.
        datamodule = trainer.datamodule
        positions_itself = datamodule is not None and callable(getattr(datamodule, "train_position", None))
        data_state = datamodule.state_dict() if positions_itself else None
        self.micro_batch_size, self.accumulate_grad_batches = new, per_device // new
        lightning_setattr(pl_module, self.batch_size_attr, new)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        _keep_validation_cadence(trainer, old, new)
        for name in ("ready", "started", "processed", "completed"):  # the same position, in new micro-batches
            setattr(progress.total, name, getattr(progress.total, name) - getattr(progress.current, name) + batches_before)
            setattr(progress.current, name, batches_before)
        if data_state is not None:
            datamodule.load_state_dict(data_state)
        # Rebuild the train loader with the new batch size and move the running fetcher onto it.
        fit_loop = trainer.fit_loop
        fit_loop._combined_loader = None
        fit_loop.setup_data()
        for loader in fit_loop._combined_loader.flattened:  # same epoch, so the same sample order
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        data_fetcher.setup(fit_loop._combined_loader)
        iter(data_fetcher)
        fit_loop._data_fetcher = data_fetcher
        for _ in range(0 if positions_itself else batches_before):
            next(data_fetcher)
        self.recoveries.append({"step": trainer.global_step, "from": old, "to": new})
        rank_zero_warn(
            f"AutoBatchSize: out of memory at step {trainer.global_step} with micro-batch {old} ({message}). "
            f"Redoing the step with micro-batch {new} x {self.accumulate_grad_batches} accumulation: "
            "the global batch and the data order are unchanged."
        )

    def _emergency_checkpoint(self, trainer: pl.Trainer) -> Optional[str]:
        """Save the last completed step from this rank alone (no collectives: the others may be stuck).

        Weights, optimizer and scheduler are as of the last optimizer step; the loop counters and the
        data position are rolled back to it, so a resume redoes the step that ran out of memory.
        """
        ckpt_cb = trainer.checkpoint_callback
        directory = getattr(ckpt_cb, "dirpath", None) or trainer.default_root_dir
        path = os.path.join(directory, f"oom-step={trainer.global_step}-rank={trainer.global_rank}.ckpt")
        try:
            os.makedirs(directory, exist_ok=True)
            with no_collectives():
                checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            rollback_fit_loop_state(checkpoint["loops"]["fit_loop"], step_boundary(trainer))
            trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, path)
        except Exception as err:  # never hide the OOM behind a failed save
            rank_zero_warn(f"AutoBatchSize: could not save the emergency checkpoint {path}: {err}")
            return None
        return path

    # ------------------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
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
        if self._searched_in_this_fit:
            # FSDP/FSDP2/DeepSpeed restore callbacks after on_fit_start: this run has searched already.
            saved = state_dict["micro_batch_size"]
            searched = self.micro_batch_size
            if (
                saved < searched
                and state_dict.get("per_device_batch") == self._per_device
                and self._fit is not None
            ):
                # Smaller than what the search found to fit, so it fits: continue as the checkpoint's run did
                # (Lightning's loop counters count its micro-batches). The train loader is not built yet.
                self._apply(*self._fit, saved, global_batch_changed=False)
                self.recoveries = [dict(r) for r in state_dict.get("recoveries", [])]
                rank_zero_info(
                    f"AutoBatchSize: continuing with the checkpoint's micro-batch {saved} x "
                    f"{self.accumulate_grad_batches} accumulation, which arrived after this run's search (the "
                    f"strategy restores callbacks after fit start; the search found {searched} to fit)."
                )
                return
            message = (
                f"AutoBatchSize: the checkpoint's micro-batch ({saved}) arrived after this run's search (the strategy "
                f"restores callbacks after fit start); keeping the search's micro-batch {searched}."
            )
            if saved == searched:
                rank_zero_info(message)
            else:
                why = (
                    "the per-device batch changed since the checkpoint (another global batch or number of devices)"
                    if state_dict.get("per_device_batch") != self._per_device
                    else f"{saved} is larger than what fits here"
                )
                rank_zero_warn(
                    f"{message} Not the checkpoint's, because {why}. Its loop counters count micro-batches of "
                    f"{saved}, so Lightning's batch count in this epoch is off (the data position, kept in samples, "
                    "is not)."
                )
            return
        self._restored = dict(state_dict)
        self.trials = [Trial(*t) for t in state_dict.get("trials", [])]
        self.recoveries = [dict(r) for r in state_dict.get("recoveries", [])]


# ---------------------------------------------------------------------------------- helpers
def _format_peak(trial: Trial) -> str:
    peak = f"{trial.peak_memory / _GB:.2f} GB" if trial.peak_memory is not None else "-"
    return peak + (f"  ({trial.reason})" if trial.reason else "")


def _stop_message(trainer: pl.Trainer, micro: int, smaller: Optional[int], path: Optional[str]) -> str:
    where = f"Saved the last completed step (global step {trainer.global_step}) to {path}. " if path else ""
    resume = f", resuming with ckpt_path={path!r}" if path else ""
    if smaller is None:
        fix = (
            "Even micro-batch 1 does not fit: make the model smaller in memory (GPTModule(activation_checkpointing=True), "
            f"a shorter block_size, or FSDP2 across more GPUs){resume}"
        )
    else:
        fix = f"Run again with AutoBatchSize(max_micro_batch_size={smaller}){resume}"
    return f"AutoBatchSize: out of memory during training with micro-batch {micro}. {where}{fix}."


def _keep_validation_cadence(trainer: pl.Trainer, old: int, new: int) -> None:
    """An integer ``val_check_interval`` counts micro-batches: rescale it from micro-batch ``old`` to
    ``new`` so validation still runs every as many samples, or say why it cannot be."""
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


def _data_parallel_size(trainer: pl.Trainer) -> int:
    """Ranks that read different samples: the world size, less any tensor-parallel dimension."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def _is_sharded(trainer: pl.Trainer) -> bool:
    """Whether the weights are sharded across ranks (one rank alone cannot save them)."""
    return isinstance(trainer.strategy, (ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy))


@contextlib.contextmanager
def _quiet_trainer(trainer: pl.Trainer) -> Iterator[None]:
    """Trial steps: no other callback sees them, and what they log goes to a throwaway collection."""
    callbacks, stage = trainer.callbacks, trainer.state.stage
    epoch_loop = trainer.fit_loop.epoch_loop
    results = epoch_loop._results
    trainer.callbacks = []
    trainer.state.stage = RunningStage.TRAINING
    epoch_loop._results = _ResultCollection(training=True)
    try:
        yield
    finally:
        trainer.callbacks, trainer.state.stage = callbacks, stage
        epoch_loop._results = results


def _no_sync(trainer: pl.Trainer) -> contextlib.AbstractContextManager:
    """DDP without the gradient all-reduce: each rank's trial is free of collectives, so an OOM cannot hang the others."""
    model = trainer.strategy.model
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


class _PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this trial step."""


class _PeerSync:
    """Keeps ranks in step when a trial runs out of memory on some of them, under FSDP2.

    FSDP2's forward all-gathers parameters, so a rank that fails in the middle of a forward would
    leave the others waiting in a collective. Here every rank all-reduces an "out of memory" flag
    before each FSDP module's forward (before its all-gather) and once after the loss; a rank that
    runs out of memory sends the flag once, which meets the others at their next check, and they
    stop too. Under DDP (trials run in ``no_sync``) and on one device it does nothing. Not covered:
    an OOM on only some ranks inside the backward pass, whose reduce-scatters cannot be matched.
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device = trainer.strategy.root_device
        self.active = (
            trainer.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and not hasattr(trainer.strategy.model, "no_sync")
        )
        self.modules = []
        if self.active:
            from torch.distributed.fsdp import FSDPModule

            self.modules = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self._handles: list[Any] = []

    def __enter__(self) -> "_PeerSync":
        self._handles = [m.register_forward_pre_hook(lambda *_: self.check(), prepend=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _all_reduce(self, value: float) -> float:
        flag = torch.tensor([value], device=self.device)
        torch.distributed.all_reduce(flag)
        return float(flag.item())

    def check(self) -> None:
        if self.active and self._all_reduce(0.0) > 0:
            raise _PeerOutOfMemory("out of memory on another rank")

    def tell_peers(self) -> None:
        if self.active:
            self._all_reduce(1.0)


def _training_step(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, sync: Optional[_PeerSync] = None) -> None:
    """One real training step through the run's strategy and precision plugin."""
    pl_module.train()
    optimizer = trainer.optimizers[0]
    precision = trainer.precision_plugin
    previous_fx = pl_module._current_fx_name
    try:
        with _no_sync(trainer):
            output = call._call_strategy_hook(trainer, "training_step", batch, 0)
            loss = output["loss"] if isinstance(output, dict) else output
            if loss is None:
                raise ValueError("AutoBatchSize needs training_step to return the loss; it returned None.")
            if sync is not None:
                sync.check()  # the logits and loss, after the last block, are where memory peaks
            scaler = getattr(precision, "scaler", None)
            precision.backward(scaler.scale(loss) if scaler is not None else loss, pl_module, optimizer)
        precision.optimizer_step(optimizer, model=pl_module, closure=lambda: loss)
    finally:
        pl_module._current_fx_name = previous_fx
    optimizer.zero_grad(set_to_none=True)


class _SampleBatches:
    """Batches of any size with the real shape, dtype and device, built from the training data."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        loader = trainer.fit_loop._data_source.dataloader()
        if not isinstance(loader, DataLoader):
            raise ValueError(
                f"AutoBatchSize needs train_dataloader() to return a torch DataLoader, got {type(loader).__name__}."
            )
        self.collate = loader.collate_fn or default_collate
        self.dataset = loader.dataset
        if isinstance(self.dataset, IterableDataset):
            # Enough samples for the largest candidate, read once; trial batches repeat them.
            batch = next(iter(loader))
            self.samples = [_index(batch, i) for i in range(_batch_len(batch))]
        else:
            if len(self.dataset) == 0:
                raise ValueError("AutoBatchSize: the training dataset is empty.")
            self.samples = None

    def __call__(self, size: int) -> Any:
        if self.samples is not None:
            items = [self.samples[i % len(self.samples)] for i in range(size)]
        else:
            items = [self.dataset[i % len(self.dataset)] for i in range(size)]
        batch = self.collate(items)
        trainer = self.trainer
        batch = trainer.precision_plugin.convert_input(batch)
        batch = self.module._on_before_batch_transfer(batch, dataloader_idx=0)
        return call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.size(0)
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    return _batch_len(batch[0])


def _index(batch: Any, i: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _index(v, i) for k, v in batch.items()}
    return type(batch)(_index(v, i) for v in batch) if isinstance(batch, (list, tuple)) else batch
