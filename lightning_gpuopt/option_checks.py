"""Range checks for numeric options, run when an object is built (before data preparation or any step).

``GPTModule`` calls :func:`check_module_options` in its constructor; the ``gpuopt`` CLI calls
:func:`check_trainer_options` on the parsed ``trainer`` group before anything is instantiated,
for the Trainer arguments Lightning accepts without a check (a negative ``gradient_clip_val``
turns clipping off without a word).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

__all__ = ["check_auto_batch_options", "check_module_options", "check_trainer_options"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(owner: str, name: str, value: Any) -> None:
    if not _number(value) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}.")


def check_module_options(
    learning_rate: float,
    weight_decay: float,
    betas: Sequence[float],
    warmup_steps: int,
    min_lr_ratio: float,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
) -> None:
    """Raise a ``ValueError`` naming the option and its range for the first ``GPTModule`` option out of range.

    Example::

        check_module_options(6e-4, 0.1, (0.9, 0.95), 100, 0.1, 64, 0.8, 50)   # passes
        check_module_options(6e-4, -1.0, (0.9, 0.95), 100, 0.1, 64, 0.8, 50)  # ValueError: weight_decay must be >= 0

    Args:
        learning_rate: Peak learning rate, > 0.
        weight_decay: AdamW weight decay, >= 0 (a negative one makes weights grow).
        betas: Two AdamW betas, each in [0, 1).
        warmup_steps: Warm-up steps, an integer >= 0.
        min_lr_ratio: Final learning rate as a fraction of the peak, in [0, 1].
        max_new_tokens: Tokens generated per prompt, an integer >= 1.
        temperature: Sampling temperature, >= 0 (0 is greedy).
        top_k: Top-k sampling, an integer >= 1, or ``None`` for no limit.
    """
    owner = "GPTModule"
    _finite(owner, "learning_rate", learning_rate)
    if learning_rate <= 0:
        raise ValueError(f"GPTModule.learning_rate must be > 0, got {learning_rate}.")
    _finite(owner, "weight_decay", weight_decay)
    if weight_decay < 0:
        raise ValueError(
            f"GPTModule.weight_decay must be >= 0, got {weight_decay}: a negative decay makes the weights grow "
            "every step. Use 0 for no decay (0.1 is the usual value)."
        )
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"GPTModule.betas must be two numbers in [0, 1), e.g. (0.9, 0.95), got {betas!r}.")
    for i, beta in enumerate(betas):
        if not _number(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"GPTModule.betas[{i}] must be in [0, 1), got {beta!r} (the usual values: (0.9, 0.95)).")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"GPTModule.warmup_steps must be >= 0, got {warmup_steps!r}.")
    if not _number(min_lr_ratio) or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"GPTModule.min_lr_ratio must be in [0, 1] (the final learning rate as a fraction of learning_rate), "
            f"got {min_lr_ratio!r}."
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"GPTModule.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    _finite(owner, "temperature", temperature)
    if temperature < 0:
        raise ValueError(f"GPTModule.temperature must be >= 0 (0 is greedy), got {temperature}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"GPTModule.top_k must be an integer >= 1 or None (no limit), got {top_k!r}.")


def check_trainer_options(trainer: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` for a Trainer option Lightning would accept but that breaks training silently.

    Example::

        check_trainer_options({"gradient_clip_val": 1.0})   # passes
        check_trainer_options({"gradient_clip_val": -1})    # ValueError: trainer.gradient_clip_val must be >= 0

    Args:
        trainer: The ``trainer`` group of a parsed ``gpuopt`` configuration (or ``Trainer`` keyword arguments).
    """
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (not _number(clip) or not math.isfinite(clip) or clip < 0):
        raise ValueError(
            f"trainer.gradient_clip_val must be >= 0 or null (no clipping), got {clip!r}: a negative value turns "
            "clipping off without a word. Use e.g. 1.0, or leave it unset."
        )


def check_auto_batch_options(
    global_batch_size: Optional[int],
    max_micro_batch_size: Optional[int],
    mode: str,
    memory_margin: float,
    steps_per_trial: int,
) -> None:
    """Raise a ``ValueError`` naming the option and its range for the first ``AutoBatchSize`` option out of range.

    Example::

        check_auto_batch_options(512, None, "binsearch", 0.1, 2)   # passes

    Args:
        global_batch_size: ``None`` or >= 1.
        max_micro_batch_size: ``None`` or >= 1.
        mode: ``"binsearch"`` or ``"power"``.
        memory_margin: In [0, 1).
        steps_per_trial: >= 1.
    """
    if global_batch_size is not None and global_batch_size < 1:
        raise ValueError(f"AutoBatchSize.global_batch_size must be >= 1 (or None), got {global_batch_size}.")
    if max_micro_batch_size is not None and max_micro_batch_size < 1:
        raise ValueError(f"AutoBatchSize.max_micro_batch_size must be >= 1 (or None), got {max_micro_batch_size}.")
    if mode not in ("binsearch", "power"):
        raise ValueError(f"AutoBatchSize.mode must be 'binsearch' or 'power', got {mode!r}.")
    if not 0 <= memory_margin < 1:
        raise ValueError(f"AutoBatchSize.memory_margin is the fraction of memory to keep free, in [0, 1): got {memory_margin}.")
    if steps_per_trial < 1:
        raise ValueError(f"AutoBatchSize.steps_per_trial must be >= 1, got {steps_per_trial}.")
