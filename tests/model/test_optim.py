import math

import pytest
import torch

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.model.optim import build_adamw, warmup_cosine_schedule
from lightning_gpuopt.perf.device import REFERENCE_DEVICES


def test_weight_decay_only_on_matrices_and_embeddings():
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=100))
    opt = build_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # every parameter once (the tied head/embedding weight too)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"] is False  # CPU parameters: the CPU's fused kernel is no faster


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_fused_kernel_where_the_device_facts_say_it_is_faster(name):
    model = torch.nn.Linear(16, 16)
    opt = build_adamw(model, lr=1e-3, device_facts=REFERENCE_DEVICES[name])
    assert opt.defaults["fused"] is (name != "cpu")  # every CUDA device; the CPU kernel here is no faster
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # the fused kernel runs on these CPU parameters too
    assert build_adamw(model, lr=1e-3, fused=False, device_facts=REFERENCE_DEVICES[name]).defaults["fused"] is False


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = warmup_cosine_schedule(opt, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1 / 11)
    assert lrs[5] == pytest.approx(6 / 11)
    assert lrs[10] == pytest.approx(1.0)
    # cosine: half-way through decay the LR is midway between peak and floor
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 100)))
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_schedule_without_warmup_starts_at_peak():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    warmup_cosine_schedule(opt, warmup_steps=0, total_steps=10)
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup_steps=5, total_steps=0), "total_steps must be an integer >= 1"),
        (dict(warmup_steps=11, total_steps=10), r"warmup_steps must be in \[0, 10\], got 11 \(at most total_steps\)"),
        (dict(warmup_steps=1, total_steps=10, min_lr_ratio=2.0), r"min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_schedule_errors(kwargs, match):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    with pytest.raises(ValueError, match=match):
        warmup_cosine_schedule(opt, **kwargs)


def test_adamw_rejects_frozen_model():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_adamw(model, lr=1e-3)


def test_adamw_refuses_float16_parameters_whose_eps_rounds_to_zero():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)).half()
    with pytest.raises(ValueError, match=r"float16 parameters .*eps=1e-08 .*trainer.precision='bf16-mixed'.*'16-mixed'"):
        build_adamw(model, lr=1e-3)
    build_adamw(model, lr=1e-3, eps=1e-3)  # an eps float16 holds: the user's choice, allowed
    build_adamw(model.float(), lr=1e-3)  # the float32 weights of 16-mixed / bf16-mixed


def test_the_reason_float16_adamw_is_refused_still_holds():
    # One plain AdamW step on float16 weights: a gradient whose square underflows (|g| < ~2.4e-4) meets
    # eps=1e-8, which float16 also rounds to zero, so the update is 0/0 or g/0. If torch ever keeps
    # AdamW's state in float32 for float16 parameters, this fails and the check in build_adamw can go.
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    weight.grad = torch.tensor([1e-2, 1e-4, 0.0, -1e-5], dtype=torch.float16)
    torch.optim.AdamW([weight], lr=1e-3, eps=1e-8).step()
    assert torch.isfinite(weight[0]) and not torch.isfinite(weight[1:]).any()
