"""Plain functions behind exact resume: RNG snapshots, and rolling a checkpoint back to a step boundary.

A checkpoint written mid-accumulation lacks the gradients of the step's first micro-batches, so the
only exact resume replays that step: its loop counters, data position and RNG states go back to the
step boundary. They take plain values, so they are tested without a Trainer.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_gpuopt.internals import batch_counters, last_batch_ready

__all__ = [
    "capture_rng_state",
    "microbatches_since_step",
    "restart_interrupted_validation",
    "restore_rng_state",
    "rollback_fit_loop_state",
    "start_next_epoch_if_ended",
    "step_boundary",
]


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and every CUDA device), numpy and Python RNG states, as tensors and primitive
    types (a checkpoint holding it loads with ``weights_only=True``)."""
    np_state = np.random.get_state(legacy=False)
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": {"version": version, "state": list(mt), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the RNG of this process's own GPUs, not a decision
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNG states of :func:`capture_rng_state` (possibly after a checkpoint round trip)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    })
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_boundary(trainer: pl.Trainer) -> int:
    """Training batches of this epoch up to the end of the last optimizer step.

    Counted from Lightning's ``processed`` batches, so it is right between batches, in
    ``on_train_batch_end`` and after an exception inside a batch; Lightning aligns accumulation windows
    with the epoch's batch index and always steps on the epoch's last batch.
    """
    progress = batch_counters(trainer)
    done = progress.processed
    last_batch_stepped = (
        done > 0 and done == progress.ready and last_batch_ready(trainer)
        and not trainer.strategy.handles_gradient_accumulation
    )
    return done if last_batch_stepped else done - done % trainer.accumulate_grad_batches


def microbatches_since_step(trainer: pl.Trainer) -> int:
    """Micro-batches of this epoch processed since the last optimizer step (0 at a step boundary)."""
    return batch_counters(trainer).processed - step_boundary(trainer)


def rollback_fit_loop_state(fit_loop_state: dict[str, Any], boundary: int) -> None:
    """Roll the fit loop's saved progress (``checkpoint["loops"]["fit_loop"]``) back, in place, to ``boundary``
    batches of the epoch (:func:`step_boundary`).

    The batch counters all become the boundary's count, which Lightning resumes from as "restarted after
    the last batch", and ``zero_grad`` the optimizer-step count; with nothing processed past the boundary,
    only a started but unprocessed batch (an exception inside it) is undone. Applying it twice changes
    nothing more: ``AutoBatchSize``'s emergency save and ``ExactResume`` may both roll back one checkpoint.
    """
    batches = fit_loop_state["epoch_loop.batch_progress"]
    processed = batches["current"]["processed"]
    if boundary < 0 or boundary > processed:
        raise ValueError(f"Cannot roll back to batch {boundary} from {batches['current']}.")
    if boundary == processed:
        # An exception in the step's first micro-batch: that batch was fetched and started but not
        # processed. Lightning resets only the epoch's counters on restart; the totals must agree too.
        for part in ("total", "current"):
            done = batches[part]["processed"]
            batches[part].update(ready=min(batches[part]["ready"], done), started=min(batches[part]["started"], done))
        return
    epoch_start = batches["total"]["processed"] - processed
    for part, count in (("total", epoch_start + boundary), ("current", boundary)):
        batches[part].update(ready=count, started=count, processed=count, completed=count)
    batches["is_last_batch"] = False
    optim = fit_loop_state.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer")
    if optim is not None:
        for part in ("total", "current"):
            steps = optim["step"][part]["completed"]
            optim["zero_grad"][part].update(ready=steps, started=steps, completed=steps)


def start_next_epoch_if_ended(fit_loop_state: dict[str, Any]) -> bool:
    """If the fit loop's saved progress is that of an epoch whose end has run (its ``epoch_progress`` completed, as
    after a SIGTERM in the epoch's last batch: Lightning stops after the epoch's end), set the epoch's batch counters
    to the next epoch's start, where Lightning would otherwise resume as if at the end of that next epoch; return
    whether it did. Changes ``fit_loop_state`` in place; applying it twice changes nothing more."""
    epochs, batches = fit_loop_state["epoch_progress"]["current"], fit_loop_state["epoch_loop.batch_progress"]
    if epochs["started"] != epochs["completed"] or epochs["completed"] == 0 or not batches.get("is_last_batch"):
        return False  # within an epoch, or ended by max_steps within it (Lightning resumes that as it is)
    batches["current"].update(ready=0, started=0, processed=0, completed=0)
    batches["is_last_batch"] = False
    return True


def restart_interrupted_validation(fit_loop_state: dict[str, Any]) -> None:
    """Mark the in-fit validation a checkpoint was written during as unfinished, so a resume runs it again.

    Its counters go back to its start with one batch fetched but not processed: Lightning's "restarted
    mid-evaluation" state, in which a resumed ``fit`` runs the validation from its first batch before the
    next training batch (:func:`~lightning_gpuopt.internals.settle_validation_counters` then puts the
    epoch's total back). Changes ``fit_loop_state`` in place; applying it twice changes nothing more.
    """
    batches = fit_loop_state["epoch_loop.val_loop.batch_progress"]
    before = batches["total"]["completed"] - batches["current"]["completed"]  # this epoch's earlier validations
    batches["total"].update(ready=before + 1, started=before + 1, processed=before, completed=before)
    batches["current"].update(ready=1, started=1, processed=0, completed=0)
    batches["is_last_batch"] = False
