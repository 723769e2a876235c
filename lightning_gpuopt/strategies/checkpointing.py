"""Activation checkpointing in a plan: its modes in the order the planner tries them (before tensor parallelism), the
activations each keeps for the backward, and setting the chosen one on what was planned for.

The modes are ``GPTConfig.activation_checkpointing``'s: none (``False``), every other block (``"selective"``) and
every block (``True`` / ``"full"``). The memory arithmetic is in ``docs/parallel.md``."""

from __future__ import annotations

from typing import Any

from lightning_gpuopt.model.config import GPTConfig

__all__ = [
    "AC_COST",
    "AC_ORDER",
    "AC_WORDS",
    "MODE_VALUE",
    "apply_checkpointing",
    "checkpointing_mode",
    "stored_elements",
]

# The extra compute: one more forward of the recomputed blocks (a forward is ~1/3 of a step).
AC_ORDER = (False, "selective", "full")
AC_WORDS = {False: "no activation checkpointing", "selective": "selective activation checkpointing (every other block)",
            "full": "full activation checkpointing (every block)"}
AC_COST = {False: "no recompute", "selective": "~1/6 more compute", "full": "~1/3 more compute"}
MODE_VALUE = {False: "false", "selective": "selective", "full": "full"}


def checkpointing_mode(value: Any) -> Any:
    """``value`` of ``activation_checkpointing`` as one of :data:`AC_ORDER` (``True`` is ``"full"``)."""
    return "full" if value is True else value


def stored_elements(config: GPTConfig, tp: int, mode: Any, block_elements: float) -> float:
    """Activation elements kept per token for the backward over all blocks, at tensor parallel ``tp`` (each rank's)
    and checkpointing ``mode``, given the elements one whole block keeps per token (``block_elements``): a
    checkpointed block keeps its input, and one block at a time is recomputed whole."""
    split = (block_elements - 2 * config.n_embd) / tp + 2 * config.n_embd  # the two gathered block inputs stay whole
    layers, kept_input = config.n_layer, config.n_embd / tp  # sequence parallel: the input split over the ranks
    recomputed = {False: 0, "selective": layers // 2, "full": layers}[checkpointing_mode(mode)]
    # a recomputed block holds its activations and, in its backward, their gradients at once: twice one block's
    return (layers - recomputed) * split + recomputed * kept_input + (2 * split if recomputed else 0)


def apply_checkpointing(model: Any, config: GPTConfig, mode: Any) -> None:
    """Set the planned checkpointing ``mode`` on ``config``, the config of ``model`` (a ``GPTConfig``, ``GPT`` or
    ``GPTModule``), and on the module's saved hyper-parameters, so a resume recomputes the same blocks."""
    if checkpointing_mode(config.activation_checkpointing) == mode:
        return
    config.activation_checkpointing = mode
    hparams = getattr(model, "hparams", None)
    if isinstance(hparams, dict) and "activation_checkpointing" in hparams:
        hparams["activation_checkpointing"] = mode
