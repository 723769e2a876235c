"""`ResumedOptimizerSettings`: optimizer and schedule settings asked for on a resumed run, applied after the restore.

Resuming restores the param groups and the LR schedule from the checkpoint, which would drop new
settings without a word (``docs/reliability.md``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpuopt.internals import sequential_parts
from lightning_gpuopt.model.optim import warmup_cosine_schedule

__all__ = ["ResumedOptimizerSettings", "apply_optimizer_settings", "restored_settings"]


def apply_optimizer_settings(
    optimizer: Optimizer,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    min_lr_ratio: float,
    total_steps: int,
    steps_done: int,
) -> Any:
    """Set the settings on ``optimizer`` (``weight_decay`` on group 0, the decayed one ``build_adamw`` makes;
    ``betas`` on every group) and return a new warm-up + cosine schedule over ``total_steps``, stepped ``steps_done``
    times (the restored scheduler's count); ``warmup_steps`` is clamped to ``total_steps``."""
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = learning_rate
        group.pop("initial_lr", None)  # the new schedule takes its peak from "lr"
        if "betas" in group:
            group["betas"] = tuple(betas)
        if i == 0:
            group["weight_decay"] = weight_decay
    total_steps = max(1, total_steps)
    scheduler = warmup_cosine_schedule(optimizer, min(warmup_steps, total_steps), total_steps, min_lr_ratio)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": replaying, not training
        warnings.simplefilter("ignore")
        for _ in range(steps_done):
            scheduler.step()
    return scheduler


def restored_settings(optimizer: Optimizer, scheduler: Any) -> dict[str, Any]:
    """The settings (``learning_rate``, ``weight_decay``, ``betas``, ``warmup_steps``, ``min_lr_ratio``,
    ``decay_steps``) a restored ``build_adamw`` optimizer and warm-up + cosine schedule hold; ``{}`` for others."""
    cosine, warmup, total = scheduler, 0, getattr(scheduler, "total_steps", None)
    parts = sequential_parts(scheduler)
    if parts is not None:
        cosine, warmup = parts[0][-1], parts[1][-1]
    if not hasattr(cosine, "T_max") or not hasattr(cosine, "eta_min"):
        return {}
    group = optimizer.param_groups[0]
    peak = group.get("initial_lr", group["lr"])
    return {
        "learning_rate": peak,
        "weight_decay": group.get("weight_decay"),
        "betas": tuple(group.get("betas", ())),
        "warmup_steps": warmup,
        "min_lr_ratio": cosine.eta_min / peak if peak else 0.0,
        "decay_steps": int(cosine.T_max),
        "total_steps": int(total) if total is not None else warmup + int(cosine.T_max),  # the run's optimizer steps
    }


def _warmup_change(restored: dict[str, Any], asked: int, now: int) -> str:
    before = restored["warmup_steps"]
    if asked > before == restored["total_steps"]:  # the earlier run was shorter than its warm-up, which it cut
        return (f"warm-up {before} -> {now} steps (model.warmup_steps={asked}, which the earlier run's {before} steps "
                "cut short)")
    return f"warmup_steps {before} -> {now}"


def _length_change(restored: dict[str, Any], total: int, warmup: int) -> str:
    """The schedule's new length in the run's terms (``decay_steps`` has no option of its own)."""
    before = restored["total_steps"]
    if total <= warmup:
        return (f"the run's length {before} -> {total} optimizer steps (warm-up now lasts the whole run: the learning "
                "rate does not decay)")
    was = before - restored["warmup_steps"]
    return (f"the run's length {before} -> {total} optimizer steps (the cosine decays over the {total - warmup} after "
            f"warm-up, " + (f"was {was})" if was > 0 else "where it did not decay)"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


class ResumedOptimizerSettings(Callback):
    """Applies a ``GPTModule``'s optimizer and schedule settings over those restored from a checkpoint.

    At ``on_train_start`` the restored settings are compared with the module's and the run's length;
    where any differs, they are written into the param groups, the schedule is rebuilt at the restored
    step, and the differences are reported (and kept in ``applied``). Where none differs nothing is touched.

    Example::

        trainer = Trainer(max_steps=2000, callbacks=[ResumedOptimizerSettings()])
        trainer.fit(GPTModule(learning_rate=3e-4), datamodule=data, ckpt_path="last.ckpt")

    Note:
        Expects one optimizer built by ``GPTModule.configure_optimizers`` and its step-wise schedule;
        with anything else it does nothing.
    """

    def __init__(self) -> None:
        self.applied: dict[str, tuple[Any, Any]] = {}  # the differences applied at the last resume: (restored, now)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        hp = pl_module.hparams
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) != 1 or "learning_rate" not in hp:
            return
        config = trainer.lr_scheduler_configs[0]
        restored = restored_settings(trainer.optimizers[0], config.scheduler)
        if not restored:
            return
        steps_done = max(0, int(config.scheduler.last_epoch))
        total = trainer.estimated_stepping_batches
        total = max(1, int(total)) if math.isfinite(total) else restored["warmup_steps"] + restored["decay_steps"]
        warmup = min(hp.warmup_steps, total)
        wanted = {
            "learning_rate": hp.learning_rate,
            "weight_decay": hp.weight_decay,
            "betas": tuple(hp.betas),
            "warmup_steps": warmup,
            "min_lr_ratio": hp.min_lr_ratio,
            "decay_steps": max(1, total - warmup),  # as warmup_cosine_schedule sets T_max
        }
        self.applied = {k: (restored[k], v) for k, v in wanted.items() if not _same(restored[k], v)}
        if "decay_steps" not in self.applied and restored["total_steps"] != total:  # a run of warm-up alone, longer
            self.applied["decay_steps"] = (restored["decay_steps"], wanted["decay_steps"])
        if not self.applied:
            return
        config.scheduler = apply_optimizer_settings(
            trainer.optimizers[0], hp.learning_rate, hp.weight_decay, tuple(hp.betas), hp.warmup_steps,
            hp.min_lr_ratio, total, steps_done,
        )
        changes = ", ".join(
            _length_change(restored, total, warmup) if k == "decay_steps"
            else _warmup_change(restored, hp.warmup_steps, new) if k == "warmup_steps"
            else f"{k} {old} -> {new}"
            for k, (old, new) in self.applied.items()
        )
        rank_zero_info(
            f"Resumed at step {steps_done} with settings other than the checkpoint's: {changes}. The learning rate "
            f"is now {trainer.optimizers[0].param_groups[0]['lr']:.4g} (the new schedule at step {steps_done})."
        )
