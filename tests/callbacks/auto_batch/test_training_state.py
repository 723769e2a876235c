"""TrainingState: what a trial step changes (weights, gradients, optimizer, LR schedule, RNG, modes) is put back."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

from lightning_gpuopt.callbacks import AutoBatchSize
from lightning_gpuopt.callbacks.auto_batch.trial import TrainingState
from tests.callbacks.auto_batch._helpers import OOMAbove, TokenData, cpu_trainer
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


class _KeepsOptimizer(OOMAbove):
    """Hands the same optimizer to every fit, as a module that builds it once does: the second fit starts with state."""

    def configure_optimizers(self):
        if not hasattr(self, "_kept"):
            self._kept = super().configure_optimizers()
        return self._kept


def test_optimizer_state_present_at_the_search_is_put_back_exactly():
    # A checkpoint's optimizer state arrives after on_fit_start, so after the search; an optimizer that has
    # already stepped reaches the search when configure_optimizers hands one over (here, a second fit).
    seen = {}

    class Before(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen["before"] = {k: v.clone() for k, v in opt.state[pl_module.model.lm_head.weight].items()}

    class After(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["after"] = {k: v.clone() for k, v in trainer.optimizers[0].state[pl_module.model.lm_head.weight].items()}

    torch.manual_seed(0)
    module, data = _KeepsOptimizer(), TokenData(batch_size=8)
    cpu_trainer([], max_steps=2).fit(module, datamodule=data)
    module.limit = 4  # the search finds 4 of 8 to fit
    search = AutoBatchSize(max_micro_batch_size=8)
    cpu_trainer([Before(), search, After()], max_steps=3).fit(module, datamodule=data)

    assert [t.micro_batch_size for t in search.trials if t.fits] and search.micro_batch_size == 4
    assert set(seen["before"]) == {"step", "exp_avg", "exp_avg_sq"}  # state was there when the trials ran
    for key, value in seen["before"].items():
        assert torch.equal(seen["after"][key], value), key  # the trials' optimizer steps were undone


def test_optimizer_state_is_copied_to_host_memory():
    # Optimizer state on a CUDA device (fake tensors: shapes and devices without memory): the copy the
    # search keeps must not take the device memory it measures.
    module = torch.nn.Linear(16, 16, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to_empty(device="cuda")
        opt = torch.optim.AdamW(module.parameters(), lr=0.1)
        for p in module.parameters():
            opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[], precision_plugin=None)

    state = TrainingState.capture(trainer, torch.nn.Module())  # the optimizer part only: fake weights cannot be put back

    live = opt.state[module.weight]
    assert live["exp_avg"].device.type == "cuda"
    copied = state.optimizers[0]["state"][0]
    assert {k: v.device.type for k, v in copied.items()} == {"step": "cpu", "exp_avg": "cpu", "exp_avg_sq": "cpu"}
    assert copied["exp_avg"].shape == live["exp_avg"].shape


def test_sharded_optimizer_state_round_trips_through_host_memory():
    # FSDP2 (one gloo process): the state of sharded parameters is DTensors; each goes to host memory as its
    # local shard and comes back a DTensor with the same placement and values.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(module.parameters(), lr=0.1)

        def step():
            module(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[], precision_plugin=None)
        weight = next(module.parameters())
        before = {k: v.full_tensor().clone() for k, v in opt.state[weight].items() if isinstance(v, DTensor)}
        assert set(before) == {"exp_avg", "exp_avg_sq"}
        state = TrainingState.capture(trainer, module)
        step()
        state.restore(trainer, module)
        for key, value in before.items():
            restored = opt.state[weight][key]
            assert isinstance(restored, DTensor) and restored.placements == weight.placements, key
            assert torch.equal(restored.full_tensor(), value), key
    finally:
        dist.destroy_process_group()
