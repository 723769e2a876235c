"""resume.py: RNG state through a weights-only checkpoint, and the fit-loop rollback to the last optimizer step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_gpuopt.resume import capture_rng_state, restore_rng_state, rollback_fit_loop_state


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    state = capture_rng_state()
    torch.save({"rng": state}, tmp_path / "r.pt")
    expected = (torch.rand(2), np.random.rand(), random.random())
    restore_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    assert torch.equal(torch.rand(2), expected[0]) and np.random.rand() == expected[1] and random.random() == expected[2]


def test_rollback_to_the_step_boundary():
    counts = lambda n: {"ready": n, "started": n, "processed": n, "completed": n}  # noqa: E731
    state = {
        "epoch_loop.batch_progress": {"total": counts(25), "current": counts(5), "is_last_batch": False},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": {"total": {"ready": 12, "completed": 12}, "current": {"ready": 2, "completed": 2}},
            "zero_grad": {"total": {"ready": 13, "started": 13, "completed": 13},
                          "current": {"ready": 3, "started": 3, "completed": 3}},
        }},
    }
    rollback_fit_loop_state(state, 4)
    assert state["epoch_loop.batch_progress"]["total"] == counts(24)
    assert state["epoch_loop.batch_progress"]["current"] == counts(4)
    zero_grad = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["zero_grad"]
    assert zero_grad["total"]["completed"] == 12 and zero_grad["current"]["started"] == 2
    rollback_fit_loop_state(state, 4)  # a second application changes nothing
    assert state["epoch_loop.batch_progress"]["total"] == counts(24)
    with pytest.raises(ValueError, match="Cannot roll back to batch 5"):
        rollback_fit_loop_state(state, 5)
    # An exception inside the first micro-batch of a step: batch 4 started, not processed.
    state["epoch_loop.batch_progress"]["total"].update(ready=25, started=25)
    state["epoch_loop.batch_progress"]["current"].update(ready=5, started=5)
    rollback_fit_loop_state(state, 4)
    assert state["epoch_loop.batch_progress"]["total"] == counts(24)
    assert state["epoch_loop.batch_progress"]["current"] == counts(4)
