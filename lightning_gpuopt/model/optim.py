"""AdamW with GPT-style weight-decay groups, and a linear-warmup + cosine-decay LR schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from lightning_gpuopt.option_checks import check_int, check_number
from lightning_gpuopt.perf.device import DeviceFacts, read_device

__all__ = ["build_adamw", "schedule_length", "warmup_cosine_schedule"]


def build_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
    device_facts: DeviceFacts | None = None,
) -> AdamW:
    """AdamW with weight decay on matrices and embeddings only (params with >= 2 dims; as in GPT-2/3 training).

    Example::

        optimizer = build_adamw(model, lr=6e-4, fused=True)

    Args:
        lr: Peak learning rate.
        fused: Use the fused kernel; ``None``: where it is the faster one (``DeviceFacts.fused_adamw``: on CUDA).
        device_facts: The facts of the parameters' device (in a fit, ``training_device(trainer)``); ``None`` reads them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("build_adamw() got a model with no trainable parameters.")
    if torch.tensor(eps, dtype=torch.float16).item() == 0 and any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            f"build_adamw() got float16 parameters (trainer.precision='16-true', or a model.half()): AdamW would keep "
            f"its state in float16 too, where eps={eps:g} and the squares of small gradients round to zero, so the "
            "first updates divide by zero and the weights turn Inf/NaN. Train in trainer.precision='bf16-mixed' (or "
            "BF16Precision), or '16-mixed' on a GPU without bf16 (float32 weights, float16 compute, a GradScaler); "
            "'16-true' suits validate, test and predict."
        )
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    if fused is None:
        devices = {p.device for p in params}
        if device_facts is None and len(devices) == 1:
            device_facts = read_device(devices.pop())
        fused = device_facts is not None and device_facts.fused_adamw  # parameters on several devices: not fused
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, fused=fused)


def warmup_cosine_schedule(
    optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> LRScheduler:
    """Linear warm-up from ~0 to the peak LR over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × peak at
    ``total_steps``; step it once per optimizer step.

    Example::

        scheduler = warmup_cosine_schedule(optimizer, warmup_steps=100, total_steps=3000)

    Args:
        optimizer: Optimizer whose groups' ``lr`` is the peak LR.
        warmup_steps: Steps of linear warm-up (0 for none), at most ``total_steps``.
    """
    own = "warmup_cosine_schedule"
    check_int(own, "total_steps", total_steps, minimum=1)
    check_number(own, "warmup_steps", warmup_steps, low=0, high=total_steps, hint=" (at most total_steps)")
    check_number(own, "min_lr_ratio", min_lr_ratio, low=0, high=1)
    peak = optimizer.param_groups[0]["lr"]
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=peak * min_lr_ratio)
    scheduler = cosine
    if warmup_steps > 0:
        # LinearLR needs start_factor > 0: start at 1/(warmup+1) of the peak, reach it at warmup_steps.
        warmup = LinearLR(optimizer, start_factor=1.0 / (warmup_steps + 1), end_factor=1.0, total_iters=warmup_steps)
        scheduler = SequentialLR(optimizer, schedulers=[warmup, cosine], milestones=[warmup_steps])
    # kept in its state_dict: T_max cannot tell a run of warm-up alone from one more step
    scheduler.total_steps = total_steps
    return scheduler


def schedule_length(estimated_steps: float, warmup_steps: int, warn: Any = None) -> tuple[int, int]:
    """``(warmup, total)`` optimizer steps of the LR schedule, from the Trainer's estimate of the run's length; a
    warm-up longer than the run is cut to it, with a warning naming the fix.

    Example::

        >>> schedule_length(1000, 100), schedule_length(50, 100)
        ((100, 1000), (50, 50))

    Args:
        estimated_steps: ``trainer.estimated_stepping_batches`` (infinite without a run length: an error).
        warn: Called with the warning text when warm-up is cut (``None``: no warning).
    """
    if not math.isfinite(estimated_steps):
        raise ValueError("GPTModule's LR schedule needs a finite run length: set trainer.max_steps (or max_epochs).")
    total = max(1, int(estimated_steps))
    if warmup_steps <= total:
        return warmup_steps, total
    if warn is not None:
        warn(
            f"GPTModule.warmup_steps={warmup_steps} is longer than the run ({total} optimizer steps): "
            f"warming up over all {total} steps. Lower warmup_steps or raise trainer.max_steps."
        )
    return total, total
