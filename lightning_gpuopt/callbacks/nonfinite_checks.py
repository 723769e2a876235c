"""What `NonFiniteGuard` does to one optimizer step, as plain functions: find, describe, skip, count.

A gradient is bad when it holds NaN/Inf, or is finite but over :data:`SQUARE_LIMIT` (its square
overflows AdamW's ``exp_avg_sq``): ``docs/reliability.md``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gpuopt.internals import foreach_norm, scaler_unscaled
from lightning_gpuopt.option_checks import option

__all__ = [
    "SQUARE_LIMIT",
    "bad_gradients",
    "count_on_device",
    "describe_bad_step",
    "find_nonfinite",
    "learning_rate_option",
    "recovery_advice",
    "skip_step",
]

SQUARE_LIMIT = math.sqrt(torch.finfo(torch.float32).max)  # ~1.8e19: a larger value's square is Inf in float32


def _local(t: Tensor) -> Tensor:
    # FSDP2 gradients are DTensors: check this rank's shard (ranks agree through an all-reduce).
    return t.to_local() if hasattr(t, "to_local") else t


def find_nonfinite(optimizer: Optimizer) -> tuple[Tensor, list[tuple[int, Tensor]]]:
    """Max-abs of every gradient the optimizer holds, in one device-side reduction (no host sync).

    Returns:
        ``(maxabs, params)``: a 1-D float32 tensor, NaN/Inf exactly where a gradient holds one (the
        infinity norm of finite values cannot overflow), and the ``(param_group_index, parameter)`` of each entry.
    """
    params: list[tuple[int, Tensor]] = []
    grads: list[Tensor] = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            # An FSDP2 shard can be empty on some ranks (a dimension smaller than the world size), and
            # _foreach_norm refuses empty tensors.
            if p.grad is not None and _local(p.grad).numel() > 0:
                params.append((i, p))
                grads.append(_local(p.grad))
    if not grads:
        return torch.zeros(0), params
    norms = foreach_norm(grads, math.inf)
    device = norms[0].device
    return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]), params


def bad_gradients(maxabs: Tensor, limit: float = SQUARE_LIMIT) -> Tensor:
    """Which of :func:`find_nonfinite`'s max-abs are NaN/Inf or over ``limit``, as a device bool tensor.
    Under an fp16 ``GradScaler`` the gradients are still scaled: ``limit=math.inf``."""
    return ~(maxabs <= limit)  # NaN compares False, so it is bad too


def describe_bad_step(
    trainer: Any,
    module: nn.Module,
    optimizer: Optimizer,
    maxabs: Tensor,
    params: list[tuple[int, Tensor]],
    loss_bad: bool,
    checked_gradients: bool = True,
    limit: float = SQUARE_LIMIT,
) -> str:
    """The warning's account of a bad step: what was non-finite, when, and the first bad parameter by name.

    Args:
        maxabs, params: What :func:`find_nonfinite` returned for ``optimizer``.
        loss_bad: Whether the loss was non-finite; ``checked_gradients``: whether the gradients were checked.
        limit: The largest good max-abs (:func:`bad_gradients`).
    """
    values = maxabs.tolist() if maxabs.numel() else []
    infinite = [not math.isfinite(v) for v in values]
    too_large = any(math.isfinite(v) and v > limit for v in values) and not any(infinite)
    what = "non-finite loss" if loss_bad else "gradients too large to square" if too_large else "non-finite gradients"
    text = f"{what} at global step {trainer.global_step} (epoch {trainer.current_epoch})"
    bad = [params[i] for i, v in enumerate(values) if not v <= limit]
    if bad:
        names = {id(p): n for n, p in module.named_parameters()}
        group, param = bad[0]
        groups = sorted({g for g, _ in bad})
        wd = optimizer.param_groups[group].get("weight_decay")
        kind = (f"gradients over {SQUARE_LIMIT:.2g} (max |grad| {max(values):.3g}: their squares overflow, so AdamW's "
                "exp_avg_sq would turn Inf)" if too_large else "NaN/Inf gradients")
        text += (
            f"; {len(bad)} parameter(s) with {kind} in param group(s) {groups}, first "
            f"{names.get(id(param), '<unnamed>')!r} (param group {group}, weight_decay={wd})"
        )
    elif loss_bad and checked_gradients:
        text += "; gradients are finite"
    return text


def skip_step(optimizer: Optimizer, scaler: Any = None) -> None:
    """Make ``optimizer.step()`` leave every parameter and its optimizer state untouched: gradients set to
    ``None``, or, under an fp16 ``GradScaler`` that unscales inside ``step()``, filled with NaN for it to skip."""
    if scaler is not None:
        if not scaler_unscaled(scaler, optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
            return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def count_on_device(pending: Optional[Tensor], bad: Tensor, global_step: int, consecutive_skips: int) -> Tensor:
    """Deferred mode's counters after one more step, on the device: ``[bad steps, in a row now, most in a
    row, first bad step or -1]`` (float32; read with one ``.tolist()`` at a check). ``pending`` is ``None``
    after a read; ``bad`` is this step's 1.0 or 0.0, a device scalar; ``consecutive_skips`` the count at the last read.
    """
    device = bad.device
    if pending is None:  # made on the device (a tensor from host numbers would wait for the stream)
        pending = torch.zeros(4, device=device)
        pending[1].fill_(float(consecutive_skips))
        pending[3].fill_(-1.0)
    count, consecutive, worst, first = pending.unbind()
    consecutive = (consecutive + 1) * bad
    step = torch.full((), float(global_step), device=device)
    first = torch.where((first < 0) & (bad > 0), step, first)
    return torch.stack([count + bad, consecutive, torch.maximum(worst, consecutive), first])


def learning_rate_option(module: Any) -> str:
    """The learning-rate setting a message names: ``GPTModule``'s option, or words for another module."""
    from lightning_gpuopt.model import GPTModule

    return option("GPTModule", "learning_rate") if isinstance(module, GPTModule) else "learning rate"


def recovery_advice(saved: Optional[tuple[int, float]], initial_loss: Optional[float], module: Any) -> str:
    """What to do after a diverged run stopped, told by the train loss its last checkpoint was written at.

    A checkpoint written at a loss above the run's first (the untrained model's) holds diverged weights,
    which give the same bad gradients at any learning rate: the advice is then a new run. ``saved`` is
    ``(global_step, train loss)`` of the last checkpoint and ``initial_loss`` the first batch's (``None``: unknown).
    """
    lr, clip = learning_rate_option(module), option("Trainer", "gradient_clip_val")
    if saved is None:
        return (f"No checkpoint was written since this fit started: start it again with a lower {lr} or gradient "
                f"clipping ({clip}).")
    step, loss = saved
    if initial_loss is None:
        return (f"Resume from the last checkpoint (step {step}, written at train loss {loss:.4g}) with a lower {lr} "
                f"or gradient clipping ({clip}) if that loss is below the one the run started at; otherwise its "
                f"weights had diverged already: start a new run with a lower {lr}.")
    if math.isfinite(loss) and loss <= initial_loss:
        return (f"Resume from the last checkpoint (step {step}, written at train loss {loss:.4g}, below the "
                f"{initial_loss:.4g} the run started at) with a lower {lr} or gradient clipping ({clip}).")
    return (f"The last checkpoint (step {step}) was written at train loss {loss:.4g}, above the {initial_loss:.4g} "
            f"the run started at: its weights had diverged already and give the same bad gradients at any learning "
            f"rate, so resuming it fails again. Start a new run with a lower {lr} (in another "
            f"{option('Trainer', 'default_root_dir')}), or resume an earlier checkpoint written before the loss rose.")
