"""TrainingState: what a trial step changes (weights, gradients, optimizer, LR schedule, RNG, modes) is put back."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_gpuopt.callbacks.auto_batch.training_state import TrainingState
from tests.precision._helpers import tiny_gpt_module, token_loader


def _fit(module: pl.LightningModule, max_steps: int, callbacks=()) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
    )
    trainer.fit(module, token_loader(n_seq=32, batch_size=4))
    return trainer


def _trial_step(trainer: pl.Trainer, module: pl.LightningModule, lr_step: bool = True) -> None:
    """What a hidden trial step may do: a forward and backward, an optimizer (and LR) step, RNG draws, eval mode."""
    x = torch.randint(0, 256, (4, 32))
    module.model(x).float().logsumexp(-1).mean().backward()
    for opt in trainer.optimizers:
        opt.step()
    for cfg in trainer.lr_scheduler_configs if lr_step else []:
        cfg.scheduler.step()
    torch.rand(5)
    module.eval()


def _snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    opt = trainer.optimizers[0]
    return {
        "weights": [t.detach().clone() for t in list(module.parameters()) + list(module.buffers())],
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in module.parameters() if p in opt.state],
        "lr": [g["lr"] for g in opt.param_groups],
        "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "modes": [m.training for m in module.modules()],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert all(x is None or torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
    assert len(a["exp_avg"]) == len(b["exp_avg"])
    assert all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"]))
    assert a["lr"] == b["lr"] and a["last_epoch"] == b["last_epoch"] and a["modes"] == b["modes"]


def test_a_trial_step_mid_run_leaves_no_trace():
    module = tiny_gpt_module(warmup_steps=2)
    trainer = _fit(module, max_steps=3)  # AdamW state and an LR schedule in progress
    module.train()
    module.zero_grad(set_to_none=True)  # at a step boundary, where AutoBatchSize runs its trials
    before = _snapshot(trainer, module)
    assert before["exp_avg"] and before["last_epoch"] == 3

    state = TrainingState.capture(trainer, module)
    expected_draw = torch.rand(3)  # what the RNG gives next, once put back
    _trial_step(trainer, module)
    changed = _snapshot(trainer, module)
    assert not all(torch.equal(x, y) for x, y in zip(before["weights"], changed["weights"]))  # the step did change them
    assert changed["last_epoch"] == 4 and not any(changed["modes"])

    state.restore(trainer, module)
    _assert_same(_snapshot(trainer, module), before)
    assert torch.equal(torch.rand(3), expected_draw)


def test_at_the_start_of_a_fresh_run_the_optimizer_state_the_trials_create_is_dropped():
    seen = {}

    class Trial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen["empty_before"] = len(opt.state) == 0
            state = TrainingState.capture(trainer, pl_module)
            lr = [g["lr"] for g in opt.param_groups]
            _trial_step(trainer, pl_module)  # an LR step too: put back even with no optimizer state to load
            seen["lr_stepped"] = [g["lr"] for g in opt.param_groups] != lr
            seen["created"] = len(opt.state)
            state.restore(trainer, pl_module)
            seen["lr_back"] = [g["lr"] for g in opt.param_groups] == lr
            for cfg in trainer.lr_scheduler_configs:  # the scheduler's own count, put back by restore too
                seen["scheduler_back"] = cfg.scheduler.last_epoch == 0
            pl_module.train()  # (restore put back the modes the module had here)
            seen["empty_after"] = len(opt.state) == 0
            seen["grads_none"] = all(p.grad is None for p in pl_module.parameters())

    torch.manual_seed(0)
    with_trial = tiny_gpt_module(warmup_steps=1)
    _fit(with_trial, max_steps=2, callbacks=[Trial()])
    n_params = len(list(with_trial.parameters()))
    assert seen == {"empty_before": True, "created": n_params, "empty_after": True, "grads_none": True,
                    "lr_stepped": True, "lr_back": True, "scheduler_back": True}

    torch.manual_seed(0)
    without = tiny_gpt_module(warmup_steps=1)
    _fit(without, max_steps=2)
    # The trial left no trace: the run trains exactly as one without it.
    assert all(torch.equal(a, b) for a, b in zip(with_trial.parameters(), without.parameters(), strict=True))
