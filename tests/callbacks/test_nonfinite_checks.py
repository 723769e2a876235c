"""NonFiniteGuard's work as plain functions: find, describe, skip, count on the device."""

from __future__ import annotations

import types

import torch

from lightning_gpuopt.callbacks.nonfinite_checks import count_on_device, describe_bad_step, find_nonfinite, skip_step


def _model_with_grads(bad: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[1].parameters(), "weight_decay": 0.0}]
    )
    model(torch.randn(2, 16)).sum().backward()
    if bad:
        model[1].weight.grad[0, 0] = float("nan")
    return model, optimizer


def test_find_and_describe_name_the_first_bad_parameter():
    model, optimizer = _model_with_grads(bad=True)
    maxabs, params = find_nonfinite(optimizer)
    assert maxabs.shape == (4,) and (~torch.isfinite(maxabs)).tolist() == [False, False, True, False]
    trainer = types.SimpleNamespace(global_step=12, current_epoch=0)
    text = describe_bad_step(trainer, model, optimizer, maxabs, params, loss_bad=False)
    assert text == ("non-finite gradients at global step 12 (epoch 0); 1 parameter(s) with NaN/Inf gradients in "
                    "param group(s) [1], first '1.weight' (param group 1, weight_decay=0.0)")


def test_a_skipped_step_leaves_weights_and_state_identical():
    model, optimizer = _model_with_grads(bad=True)
    before = [p.detach().clone() for p in model.parameters()]
    skip_step(optimizer)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not optimizer.state


def test_counters_on_the_device():
    pending = None
    for step, bad in enumerate([0.0, 1.0, 1.0, 0.0, 1.0], start=10):
        pending = count_on_device(pending, torch.tensor(bad), step, consecutive_skips=0)
    assert pending.tolist() == [3.0, 1.0, 2.0, 11.0]  # 3 bad, 1 in a row now, 2 at most, the first at step 11
