"""The chunked linear cross-entropy (lightning_gpuopt/model/loss.py) against F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.model.loss import linear_cross_entropy, resolve_loss_impl


def _reference(h, w, y):
    return F.cross_entropy((h @ w.t()).reshape(-1, w.size(0)).float(), y.reshape(-1), ignore_index=-1)


def _inputs(n=37, c=16, v=96, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, c, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, c, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, v, (2, n), generator=g)
    y[0, :5] = -1  # positions without a target
    return h, w, y


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_and_gradients_match_cross_entropy(chunk_size, dtype):
    h, w, y = _inputs(dtype=dtype)
    expected = _reference(h, w, y)
    # A scale on the loss, as Lightning's accumulation applies: the backward must pass it through.
    gh, gw = torch.autograd.grad(expected * 0.25, [h, w])
    loss = linear_cross_entropy(h, w, y, chunk_size=chunk_size)
    ah, aw = torch.autograd.grad(loss * 0.25, [h, w])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ah, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(aw, gw, rtol=1e-5, atol=1e-7)
    assert ah.dtype == h.dtype and aw.dtype == w.dtype


def test_without_grad_gives_the_same_loss():
    h, w, y = _inputs()
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(h, w, y, chunk_size=8), _reference(h, w, y), atol=1e-6)
    with torch.inference_mode():
        assert torch.allclose(linear_cross_entropy(h, w, y, chunk_size=8), _reference(h, w, y), atol=1e-6)


def test_only_the_inputs_that_need_it_get_a_gradient():
    h, w, y = _inputs()
    frozen = w.detach()
    loss = linear_cross_entropy(h, frozen, y, chunk_size=8)
    (gh,) = torch.autograd.grad(loss, [h])
    torch.testing.assert_close(gh, torch.autograd.grad(_reference(h, frozen, y), [h])[0])


def test_under_bf16_autocast_matches_the_plain_path_within_bf16_tolerance():
    h, w, y = _inputs(n=64, c=32, v=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(h, w).reshape(-1, 128).float(), y.reshape(-1), ignore_index=-1)
        loss = linear_cross_entropy(h, w, y, chunk_size=16)
    ge = torch.autograd.grad(expected, [h, w])
    gl = torch.autograd.grad(loss, [h, w])
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-3)
    for a, b in zip(gl, ge):
        assert a.dtype == torch.float32  # gradients in the parameters' dtype, as autocast gives
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_every_target_ignored_gives_nan_like_cross_entropy():
    h, w, y = _inputs()
    y.fill_(-1)
    assert torch.isnan(_reference(h, w, y)) and torch.isnan(linear_cross_entropy(h, w, y))


def test_never_allocates_the_full_logits():
    """The largest tensor made while computing loss and gradients is one chunk of logits."""
    n, c, v, chunk = 256, 16, 512, 32
    h, w, y = _inputs(n=n, c=c, v=v)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        linear_cross_entropy(h, w, y, chunk_size=chunk).backward()
    assert Largest.numel == chunk * v  # not 2 * n * v
    with Largest():
        _reference(h, w, y).backward()
    assert Largest.numel == 2 * n * v  # the plain path does materialise them: the check can fail


def test_compiled_chunk_kernel_matches_eager():
    h, w, y = _inputs(n=40)
    eager = linear_cross_entropy(h, w, y, chunk_size=24)
    ge = torch.autograd.grad(eager, [h, w])
    compiled = linear_cross_entropy(h, w, y, chunk_size=24, compile_chunk=True)
    gc = torch.autograd.grad(compiled, [h, w])
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
        (dict(impl="fused"), ValueError, "loss_impl='fused' is not one of"),
        (dict(impl="liger"), ValueError, "CUDA only.*loss_impl='chunked'"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs, error, match):
    h, w, y = _inputs()
    with pytest.raises(error, match=match):
        linear_cross_entropy(h, w, y, **kwargs)


def test_targets_of_the_wrong_shape_are_refused():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=r"targets of shape \(2, 36\) do not match"):
        linear_cross_entropy(h, w, y[:, 1:])


def test_auto_resolves_to_chunked():
    assert resolve_loss_impl("auto", torch.device("cpu")) == "chunked"


# ------------------------------------------------------------------------------------------ in the GPT
def _tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=80, **overrides))


@pytest.mark.parametrize("impl", ["auto", "chunked", "plain"])
def test_gpt_forward_with_targets_is_the_loss_of_its_logits(impl):
    model = _tiny_gpt(loss_impl=impl, loss_chunk_size=10)
    x, y = torch.randint(0, 80, (3, 16)), torch.randint(0, 80, (3, 16))
    y[1, 3:7] = -1
    expected = model.loss(model(x), y)
    ref_grads = torch.autograd.grad(expected, list(model.parameters()))
    loss = model(x, targets=y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_replaced_head_is_called_not_bypassed():
    model = _tiny_gpt()
    calls = []

    class Head(nn.Linear):  # a user's conversion of the head (e.g. to a low-precision layer)
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    head = Head(32, model.config.padded_vocab_size, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    x, y = torch.randint(0, 80, (2, 16)), torch.randint(0, 80, (2, 16))
    loss = model(x, targets=y)
    assert calls == [torch.Size([2, 16, 32])]
    torch.testing.assert_close(loss, model.loss(model(x), y))


def test_config_refuses_an_unknown_loss_impl():
    with pytest.raises(ValueError, match="GPTConfig.loss_impl='fused' is not supported"):
        GPTConfig(loss_impl="fused")
    with pytest.raises(ValueError, match="GPTConfig.loss_chunk_size must be a positive integer"):
        GPTConfig(loss_chunk_size=0)
