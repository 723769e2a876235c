"""The chunked loss's float8 head (``linear_cross_entropy(head_float8=True)``): its arithmetic on a CPU, whose
``torch._scaled_mm`` runs float8 operands, against float32 cross-entropy and against the same float8 numbers
written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.model import loss as loss_module
from lightning_gpuopt.model.loss import linear_cross_entropy


def _inputs(n=37, c=32, v=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, c, generator=g).requires_grad_()
    w = (torch.randn(v, c, generator=g) * 0.2).requires_grad_()
    y = torch.randint(0, v, (2, n), generator=g)
    y[0, :5] = -1  # positions without a target
    return h, w, y


def _reference(h, w, y):
    return F.cross_entropy((h @ w.t()).reshape(-1, w.size(0)), y.reshape(-1), ignore_index=-1)


def _e4m3(x):
    """x as the head rounds it: e4m3 scaled by its amax, back in float32."""
    scale = 448.0 / x.abs().amax()
    return (x * scale).to(torch.float8_e4m3fn).float() / scale


def _cosine(a, b):
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


# Compiled once (Inductor's CPU compile takes seconds): 74 tokens in chunks of 48, the tail padded to 48 rows.
@pytest.mark.parametrize(("compiled", "chunk_size"), [(False, 16), (False, 48), (False, 4096), (True, 48)])
def test_loss_and_gradients_within_float8_error_of_cross_entropy(compiled, chunk_size):
    h, w, y = _inputs()
    expected = _reference(h, w, y)
    gh, gw = torch.autograd.grad(expected * 0.25, [h, w])  # a loss scale, as accumulation applies, passes through
    loss = linear_cross_entropy(h, w, y, chunk_size=chunk_size, compile_chunk=compiled, impl="chunked",
                                head_float8=True)
    ah, aw = torch.autograd.grad(loss * 0.25, [h, w])
    assert loss.dtype == torch.float32 and ah.dtype == h.dtype and aw.dtype == w.dtype
    assert 0 < abs(loss.item() - expected.item()) < 5e-3 * expected.item()  # float8 logits: close, not equal
    assert _cosine(ah, gh) > 0.999 and _cosine(aw, gw) > 0.999
    assert ah.norm() / gh.norm() == pytest.approx(1, rel=0.02) and aw.norm() / gw.norm() == pytest.approx(1, rel=0.02)
    assert torch.all(ah[0, :5] == 0)  # ignored positions get no gradient (the padded tail rows neither)


def test_the_loss_is_that_of_the_float8_operands():
    # Per chunk the hidden states are scaled by their own amax; one chunk here, so the whole tensor's.
    h, w, y = _inputs()
    loss = linear_cross_entropy(h, w, y, chunk_size=4096, impl="chunked", head_float8=True)
    logits = (_e4m3(h.detach().reshape(-1, 32)) @ _e4m3(w.detach()).t()).to(torch.bfloat16).float()
    by_hand = F.cross_entropy(logits, y.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(loss, by_hand, rtol=1e-5, atol=1e-5)


def test_the_gradient_keeps_softmax_entries_far_below_e5m2s_smallest():
    # One target logit 20 above the others: each other softmax entry is ~2e-9 x 1 / (1 + V e^-20), far below
    # e5m2's smallest 1.5e-5; the fixed 2**15 scale keeps them in the weight gradient.
    v, c = 64, 16
    w = torch.zeros(v, c)
    w[0, 0] = 1.0
    h = torch.zeros(16, c)
    h[:, 0] = 20.0
    w, h = w.requires_grad_(), h.requires_grad_()
    y = torch.zeros(16, dtype=torch.long)
    _, expected = torch.autograd.grad(_reference(h, w, y), [h, w])
    _, got = torch.autograd.grad(linear_cross_entropy(h, w, y, impl="chunked", head_float8=True), [h, w])
    others = expected[1:, 0]  # ~2e-8: each non-target row's gradient, h_0 x softmax entry
    assert torch.all(others > 0) and others.max() < 1e-7
    torch.testing.assert_close(got[1:, 0], others, rtol=0.15, atol=0)  # e5m2 keeps 2 mantissa bits


class _PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the operators made while it was on."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: (ref, n) for ptr, (ref, n) in self.live.items() if not ref.expired()}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_a_chunk_holds_its_logits_and_their_float32_copy_at_most():
    # 6 bytes a logit, as the bf16 chunk's budget (loss.chunk_tokens); a weight and hidden states 16 wide add 0.9
    n, c, v, chunk = 1024, 16, 2048, 256
    h, w, y = _inputs(n=n // 2, c=c, v=v)
    with _PeakBytes() as peak:
        linear_cross_entropy(h, w, y, chunk_size=chunk, impl="chunked", head_float8=True).backward()
    assert 6 * chunk * v < peak.peak < 7 * chunk * v


def test_without_grad_gives_the_training_loss():
    h, w, y = _inputs()
    trained = linear_cross_entropy(h, w, y, chunk_size=16, impl="chunked", head_float8=True)
    with torch.no_grad():
        evaluated = linear_cross_entropy(h, w, y, chunk_size=16, impl="chunked", head_float8=True)
    torch.testing.assert_close(evaluated, trained.detach(), rtol=0, atol=0)


def test_only_the_inputs_that_need_it_get_a_gradient():
    h, w, y = _inputs()
    w.requires_grad_(False)
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, y, impl="chunked", head_float8=True), [h])
    h2, w2, _ = _inputs()
    h2.requires_grad_(False)
    (gw,) = torch.autograd.grad(linear_cross_entropy(h2, w2, y, impl="chunked", head_float8=True), [w2])
    assert gh.shape == h.shape and gw.shape == w2.shape and gh.abs().sum() > 0 and gw.abs().sum() > 0


def test_every_target_ignored_gives_nan_like_cross_entropy():
    h, w, y = _inputs()
    assert torch.isnan(linear_cross_entropy(h, w, torch.full_like(y, -1), impl="chunked", head_float8=True))


@pytest.mark.parametrize(("c", "v", "chunk", "impl", "match"), [
    (32, 96, 16, "plain", "runs in the chunked loss"),
    (24, 96, 16, "chunked", r"hidden size \(24\).*multiples of 16"),
    (32, 90, 16, "chunked", r"vocabulary rows \(90\).*multiples of 16"),
    (32, 96, 24, "chunked", r"chunk \(24 tokens\).*multiples of 16"),
])
def test_shapes_float8_cannot_multiply_are_refused_with_the_fix(c, v, chunk, impl, match):
    h, w, y = _inputs(c=c, v=v)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, y, chunk_size=chunk, impl=impl, head_float8=True)


def test_a_gpt_with_the_float8_head_learns_as_the_bf16_one_does():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, loss_chunk_size=64)
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    data[:, 1::2] = data[:, :-1:2]  # every other token repeats the one before: learnable
    final = {}
    for float8 in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        model.head_float8 = float8
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(25):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(data[:, :-1], targets=data[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        final[float8] = loss.item()
    assert final[False] < 3.7  # ln(64) = 4.16 at the start
    assert final[True] == pytest.approx(final[False], abs=0.1)


def test_the_gpt_calls_the_float8_head(monkeypatch):
    calls = []
    real = loss_module._float8_loop
    monkeypatch.setattr(loss_module, "_float8_loop", lambda *a: calls.append(1) or real(*a))
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, loss_chunk_size=16))
    idx = torch.randint(0, 64, (2, 16))
    model(idx, targets=idx)
    assert calls == []
    model.head_float8 = True
    model(idx, targets=idx)
    assert calls == [1]
