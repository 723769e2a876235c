"""`NonFiniteGuard`: catch a NaN/Inf loss or gradient before the optimizer step, then skip the step or stop.

The checks are plain functions in ``nonfinite_checks.py``; how a step is checked, skipped and
reported (with a host sync per step, or deferred on the device): ``docs/reliability.md``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpuopt.internals import unscales_in_step
from lightning_gpuopt.option_checks import check_choice, check_int, option
from lightning_gpuopt.callbacks.nonfinite_checks import (
    SQUARE_LIMIT,
    bad_gradients,
    count_on_device,
    describe_bad_step,
    find_nonfinite,
    recovery_advice,
    skip_step,
)

__all__ = ["NonFiniteError", "NonFiniteGuard"]

Policy = Literal["skip", "stop"]
Mode = Literal["auto", "step", "deferred"]


class NonFiniteError(RuntimeError):
    """Raised by :class:`NonFiniteGuard` to stop a run whose loss or gradients went NaN/Inf."""


class NonFiniteGuard(Callback):
    """Detects a NaN/Inf loss or gradient within the step, then skips that optimizer step or stops the run.

    Every optimizer step, the loss of each micro-batch and (with ``check_gradients``) every gradient
    are checked before ``optimizer.step()``. A bad step is skipped (parameters and optimizer state stay
    bit-identical) with a warning naming the step and the first bad parameter; the run stops with
    :class:`NonFiniteError` at once (``policy="stop"``) or after ``max_consecutive_skips`` in a row.
    Stopping raises inside the step, so the last checkpoint stays the last good state.

    Example::

        trainer = Trainer(callbacks=[NonFiniteGuard(policy="skip", max_consecutive_skips=5)])

    Args:
        policy: ``"skip"`` the bad step or ``"stop"`` the run at the first one.
        max_consecutive_skips: With ``policy="skip"``, bad steps in a row before the run stops.
        check_gradients: Also check every gradient, not only the loss.
        mode: ``"step"`` (one host sync per optimizer step; names the first bad parameter), ``"deferred"``
            (no sync; needs a fused optimizer and no fp16 scaler) or ``"auto"`` (deferred where it can be).

    Note:
        Skipped steps still count: ``global_step`` and a step-wise LR schedule advance, and the bad
        batch is not seen again. Under fp16, overflowing gradients with a finite loss are the
        ``GradScaler``'s to skip, and are not counted towards ``max_consecutive_skips``.
    """

    def __init__(
        self, policy: Policy = "skip", max_consecutive_skips: int = 5, check_gradients: bool = True, mode: Mode = "auto"
    ) -> None:
        check_choice("NonFiniteGuard", "policy", policy, ("skip", "stop"))
        check_choice("NonFiniteGuard", "mode", mode, ("auto", "step", "deferred"))
        check_int("NonFiniteGuard", "max_consecutive_skips", max_consecutive_skips, minimum=1,
                  hint=f" (use {option('NonFiniteGuard', 'policy', 'stop')} to stop at the first bad step)")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.check_gradients = check_gradients
        self.skipped_steps = 0  # bad batches whose optimizer steps were skipped (a batch counts once)
        self.scaler_skips = 0  # steps the fp16 GradScaler skipped itself (overflowing gradients, finite loss)
        self.consecutive_skips = 0  # bad batches in a row right now
        self.last_report: Optional[str] = None  # the message of the last bad or scaler-skipped step
        self.mode = mode
        self._loss_bad: Optional[Tensor] = None  # device-side flag over the step's micro-batches
        self._deferred: Optional[bool] = None  # decided at the first optimizer step
        self._pending: Optional[Tensor] = None  # deferred: [bad steps, consecutive, worst consecutive, first bad step]
        self._last_step = -1
        # This batch: an optimizer stepped, a bad step was counted, deferred mode's flag over its optimizers.
        self._stepped, self._batch_bad, self._batch_flag = False, False, None
        self.active_mode: Optional[str] = None  # "step" or "deferred": what mode resolved to in the last fit
        # The train loss of the run's first batch and of the latest one (device tensors, read only at a save or a
        # stop), and (global step, train loss) at the last save: what recovery_advice tells a resumable checkpoint by.
        self.initial_loss: Optional[float] = None
        self._first_loss: Optional[Tensor] = None
        self._fresh = False  # this fit starts at step 0: its first loss is the untrained model's
        self._last_loss: Optional[tuple[Tensor, int]] = None
        self.saved_at: Optional[tuple[int, float]] = None

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fresh = trainer.global_step == 0  # a resume from a checkpoint without the guard's state: not known

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._stepped, self._batch_bad = False, False

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def _decide_mode(self, trainer: "pl.Trainer", optimizer: Optimizer) -> bool:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        can = unscales_in_step(optimizer) and scaler is None
        if self.mode == "deferred" and not can:
            raise ValueError(
                "NonFiniteGuard(mode='deferred') skips a step on the device through the optimizer's found_inf, which "
                f"needs a fused torch.optim optimizer (e.g. AdamW(fused=True)) and no fp16 GradScaler; got "
                f"{type(optimizer).__name__}{' with a GradScaler' if scaler is not None else ''}. Use mode='step'."
            )
        deferred = self.mode == "deferred" or (self.mode == "auto" and can)
        rank_zero_info(
            "NonFiniteGuard: checking on the device, read at logging steps and before checkpoint saves (no sync per "
            "step)."
            if deferred else "NonFiniteGuard: checking every optimizer step (one host sync per step)."
        )
        return deferred

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        if self._deferred is None:
            self._deferred = self._decide_mode(trainer, optimizer)
            self.active_mode = "deferred" if self._deferred else "step"
        if self._deferred:
            self._flag_on_device(trainer, pl_module, optimizer)
            return
        loss_bad, self._loss_bad = self._loss_bad, None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        limit = math.inf if scaler is not None else SQUARE_LIMIT  # scaled fp16 gradients: only NaN/Inf is bad
        if self.check_gradients:
            maxabs, params = find_nonfinite(optimizer)
            device = maxabs.device if maxabs.numel() else pl_module.device
            grads_bad = bad_gradients(maxabs, limit).sum(dtype=torch.float32)
        else:
            maxabs, params, device = torch.zeros(0), [], pl_module.device
            grads_bad = torch.zeros((), device=device)
        loss_flag = torch.zeros((), device=device) if loss_bad is None else loss_bad.to(device, torch.float32)
        status = torch.stack([loss_flag, grads_bad.to(device)])
        if trainer.world_size > 1:
            status = trainer.strategy.reduce(status, reduce_op="sum")
        n_loss_bad, n_grads_bad = status.tolist()  # the one host sync per optimizer step
        self._stepped = True
        if not n_loss_bad and not n_grads_bad:
            return  # the batch's count of bad steps in a row is settled at its end (another optimizer may follow)
        where = describe_bad_step(
            trainer, pl_module, optimizer, maxabs, params, bool(n_loss_bad), self.check_gradients, limit
        )
        if scaler is not None and not n_loss_bad:
            # fp16: the GradScaler skips steps with overflowing gradients and lowers its scale; not ours to count.
            self.scaler_skips += 1
            self.last_report = f"GradScaler skips {where} (scale {scaler.get_scale():g} -> lowered); not counted."
            rank_zero_warn(f"NonFiniteGuard: {self.last_report}")
            return
        skip_step(optimizer, scaler)
        if self._batch_bad:
            return  # another optimizer of a batch already counted (manual optimisation): one bad batch, one count
        self._batch_bad = True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.last_report = where
        if self.policy == "stop":
            raise NonFiniteError(
                f"NonFiniteGuard stopped the run: {where}. The step was not applied and no checkpoint was written "
                f"after it. {self.advice(pl_module)} Under fp16, bf16 may help; "
                f"{option('NonFiniteGuard', 'policy', 'skip')} "
                "skips bad steps instead of stopping."
            )
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"NonFiniteGuard stopped the run after {self.consecutive_skips} non-finite steps in a row "
                f"(max_consecutive_skips={self.max_consecutive_skips}); the last: {where}. The model is not "
                f"recovering. {self.advice(pl_module)}"
            )
        rank_zero_warn(
            f"NonFiniteGuard: skipped {where} ({self.consecutive_skips}/{self.max_consecutive_skips} in a row)."
        )

    def _flag_on_device(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer) -> None:
        loss_bad, self._loss_bad = self._loss_bad, None
        maxabs, _ = find_nonfinite(optimizer) if self.check_gradients else (torch.zeros(0), [])
        device = maxabs.device if maxabs.numel() else pl_module.device
        bad = bad_gradients(maxabs).any().to(torch.float32) if maxabs.numel() else torch.zeros((), device=device)
        if loss_bad is not None:
            bad = torch.maximum(bad, loss_bad.to(device, torch.float32))
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # The collective itself (Lightning's strategy.reduce adds a barrier, which waits for the GPU).
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        optimizer.found_inf = bad  # the fused kernel skips the whole update when it is 1
        if self._batch_flag is None:
            self._batch_flag = (bad, trainer.global_step)
        else:  # another optimizer of the same batch (manual optimisation): the batch is bad if either step is
            self._batch_flag = (torch.maximum(self._batch_flag[0], bad), self._batch_flag[1])

    def _count_batch(self) -> None:
        """Deferred mode: add the finished batch's flag (over all its optimizers) to the device counters."""
        if self._batch_flag is not None:
            bad, step = self._batch_flag
            self._batch_flag = None
            self._pending = count_on_device(self._pending, bad, step, self.consecutive_skips)

    def _read_deferred(self, trainer: Optional["pl.Trainer"], when: str) -> None:
        """The host sync of deferred mode: report (or stop on) the bad steps since the last read."""
        self._count_batch()
        if self._pending is None:
            return
        count, consecutive, worst, first = (int(v) for v in self._pending.tolist())
        self._pending = None
        self.consecutive_skips = consecutive
        if not count:
            return
        self.skipped_steps += count
        self.last_report = (
            f"{count} optimizer step(s) with a non-finite loss or gradients skipped since the last check, the first "
            f"at global step {first}; {consecutive} in a row now (read {when})"
        )
        if self.policy == "stop" or worst >= self.max_consecutive_skips:
            why = (
                ""
                if self.policy == "stop"
                else f" ({worst} in a row >= max_consecutive_skips={self.max_consecutive_skips})"
            )
            raise NonFiniteError(
                f"NonFiniteGuard stopped the run{why}: {self.last_report}. The bad steps were not applied and no "
                f"checkpoint was written after them. {self.advice(trainer.lightning_module if trainer else None)} "
                f"{option('NonFiniteGuard', 'mode', 'step')} names the first bad parameter."
            )
        rank_zero_warn(f"NonFiniteGuard: {self.last_report}.")

    def advice(self, pl_module: Any) -> str:
        """What to do after the run diverged (:func:`recovery_advice`); reads the losses it needs."""
        self._read_initial_loss()
        return recovery_advice(self.saved_at, self.initial_loss, pl_module)

    def _read_initial_loss(self) -> None:
        if self.initial_loss is None and self._first_loss is not None:
            self.initial_loss = float(self._first_loss)
        self._first_loss = None

    def _record_loss(self, trainer: "pl.Trainer", outputs: Any) -> None:
        """Keep the batch's train loss on the device (Lightning hands it divided by the accumulation)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            return
        loss = loss.detach() * trainer.accumulate_grad_batches
        if self._fresh and self.initial_loss is None and self._first_loss is None:
            self._first_loss = loss
        self._last_loss = (loss, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._record_loss(trainer, outputs)
        if self._stepped and not self._batch_bad:
            self.consecutive_skips = 0  # a batch whose optimizer steps were all finite
        self._count_batch()
        step = trainer.global_step
        if self._deferred and step != self._last_step and step % max(1, trainer.log_every_n_steps) == 0:
            self._last_step = step
            self._read_deferred(trainer, f"at logging step {step}")

    @override
    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        self._read_deferred(trainer, "before a checkpoint save")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._read_deferred(trainer, "at the end of training")

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf
        self._deferred, self._pending, self._loss_bad, self._batch_flag = None, None, None, None
        self._read_initial_loss()
        self._last_loss = None

    @override
    def state_dict(self) -> dict[str, Any]:
        self._read_deferred(None, "before a checkpoint save")  # Lightning asks for this before on_save_checkpoint
        # Asked for by a save only: the loss this checkpoint is written at (one read, at a save, which waits anyway).
        self._read_initial_loss()
        if self._last_loss is not None:
            self.saved_at = (self._last_loss[1], float(self._last_loss[0]))
        return {
            "skipped_steps": self.skipped_steps,
            "scaler_skips": self.scaler_skips,
            "consecutive_skips": self.consecutive_skips,
            "initial_loss": self.initial_loss,
            "saved_at": None if self.saved_at is None else list(self.saved_at),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.scaler_skips = int(state_dict.get("scaler_skips", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self.initial_loss = state_dict.get("initial_loss")
        saved = state_dict.get("saved_at")
        self.saved_at = (int(saved[0]), float(saved[1])) if saved else None
