"""The chunked linear cross-entropy (lightning_gpuopt/model/loss.py) against F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.model import loss as loss_module
from lightning_gpuopt.model.loss import chunk_tokens, linear_cross_entropy, resolve_loss_impl


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


def _errors_against_float64(fn, h, w, y, dtype, loss_scale=1.0):
    """Relative errors of the loss and of both gradients of ``fn`` (under autocast to ``dtype``, a
    GradScaler-like ``loss_scale`` on the loss) against the float64 ``F.cross_entropy``."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), y, ignore_index=-1)
    ref_grads = torch.autograd.grad(ref, [h64, w64])
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = fn(hh, ww, y)
    grads = torch.autograd.grad(loss * loss_scale, [hh, ww])
    errors = [float((loss.detach().double() - ref.detach()).abs() / ref.detach().abs())]
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32  # gradients in the parameters' dtype, as autocast gives
        errors.append(float(((g / loss_scale).double() - r).norm() / r.norm()))
    return errors


def _plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_as_exact_as_the_plain_loss_in_each_precision(dtype):
    """Loss and gradients against float64, no further from it than F.cross_entropy in the same precision."""
    h, w, y = _inputs(n=48, c=32, v=160)
    h, y = h.detach().reshape(-1, 32), y.reshape(-1)
    w = w.detach()
    plain = _errors_against_float64(_plain, h, w, y, dtype)
    ours = _errors_against_float64(lambda a, b, t: linear_cross_entropy(a, b, t, chunk_size=20), h, w, y, dtype)
    for name, o, p in zip(("loss", "d hidden", "d weight"), ours, plain):
        assert o <= max(1.5 * p, 1e-6), f"{name}: relative error {o:.2e}, plain {p:.2e}"
    assert plain[2] > (1e-4 if dtype != torch.float32 else 0)  # the low precisions do differ from float64


@pytest.mark.parametrize("branch", ["cpu", "cuda"])
def test_fp16_gradients_keep_the_small_softmax_entries(branch, monkeypatch):
    """Under fp16 the gradient of most logits is tiny (softmax / tokens, at 8192 tokens): none may
    round to zero before the loss scale arrives, so the gradients stay as exact as the plain loss's.
    ``cuda`` runs CUDA's branch here: an fp16 gradient lifted by 2**14 into float32-accumulating matmuls."""
    if branch == "cuda":
        real = loss_module._grad_dtype
        monkeypatch.setattr(loss_module, "_grad_dtype", lambda compute_dtype, device_type: real(compute_dtype, "cuda"))
    n, c, v = 8192, 32, 2048
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, c, generator=g), torch.randn(v, c, generator=g) * 0.3
    y = torch.randint(0, v, (n,), generator=g)

    class LogitGrads(TorchDispatchMode):  # the (tokens, V) gradient the matmuls receive
        nonzero: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                for a in args:
                    if isinstance(a, torch.Tensor) and a.numel() == n * v:
                        LogitGrads.nonzero.append(float((a != 0).float().mean()))
            return func(*args, **(kwargs or {}))

    scale = 65536.0  # GradScaler's initial scale
    plain = _errors_against_float64(_plain, h, w, y, torch.float16, scale)
    with LogitGrads():
        ours = _errors_against_float64(
            lambda a, b, t: linear_cross_entropy(a, b, t, chunk_size=n), h, w, y, torch.float16, scale
        )
    assert LogitGrads.nonzero and min(LogitGrads.nonzero) > 0.99  # was 34%: the rest rounded to 0
    assert ours[1] <= 1.5 * plain[1] and ours[2] <= 1.5 * plain[2], (ours, plain)  # was 20x plain's


def test_cuda_branch_lifts_fp16_gradients_above_fp16s_smallest(monkeypatch):
    """CUDA's branch hands the matmuls an fp16 gradient: softmax entries below fp16's smallest (6e-8) survive
    only through the 2**14 lift, taken off again in float32."""
    real = loss_module._grad_dtype
    monkeypatch.setattr(loss_module, "_grad_dtype", lambda compute_dtype, device_type: real(compute_dtype, "cuda"))
    n, c, v = 1024, 32, 2048
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, c, generator=g), torch.randn(v, c, generator=g) * 0.6  # logits spread: many tiny softmax entries
    y = torch.randint(0, v, (n,), generator=g)
    seen = []

    class LogitGrads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy and args[0].dtype == torch.float16 and args[0].numel() == n * v:
                seen.append(float((args[0] != 0).float().mean()))  # the fp16 gradient, widened for the matmul
            return func(*args, **(kwargs or {}))

    h16, w16 = h.half().requires_grad_(), w.half().requires_grad_()
    with LogitGrads():
        linear_cross_entropy(h16, w16, y, chunk_size=n).backward()
    assert seen and min(seen) > 0.99, seen  # without the lift about a tenth of the entries are 0 in fp16


def test_cuda_branch_casts_the_float32_weight_once(monkeypatch):
    """On CUDA the logits' matmul and the gradient matmuls take the same bf16 operands: one cast of the float32
    weight per micro-batch, not one for each (a weight-sized copy and a pass over it)."""
    real = loss_module._grad_dtype
    monkeypatch.setattr(loss_module, "_grad_dtype", lambda compute_dtype, device_type: real(compute_dtype, "cuda"))
    h, w, y = _inputs(c=32, v=96)
    casts = []

    class WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy and args[0] is w:
                casts.append((kwargs or {}).get("dtype"))
            return func(*args, **(kwargs or {}))

    with WeightCasts(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, chunk_size=16)
    assert casts == [torch.bfloat16]
    loss.backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


@pytest.mark.parametrize(
    ("compute", "device", "expected"),
    [(torch.float16, "cuda", torch.float16), (torch.bfloat16, "cuda", torch.bfloat16), (torch.float32, "cuda", torch.float32),
     (torch.float16, "cpu", torch.float32), (torch.bfloat16, "cpu", torch.float32), (torch.float64, "cpu", torch.float64)],
)
def test_the_gradient_dtype_of_each_device(compute, device, expected):
    assert loss_module._grad_dtype(compute, device) == expected


def _live_chunk_bytes(fn, v, c):
    """The most bytes held at once by (tokens, V) tensors while ``fn`` runs, and the largest token count."""
    live, peak, rows = {}, [0], [0]

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == v and t.shape[0] != c:
                    live.setdefault(t.untyped_storage()._cdata, (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
                    rows[0] = max(rows[0], t.shape[0])
            for key in [k for k, (ref, _) in live.items() if ref.expired()]:
                del live[key]
            peak[0] = max(peak[0], sum(nbytes for _, nbytes in live.values()))
            return out

    with Live():
        fn()
    return peak[0], rows[0]


@pytest.mark.parametrize(("dtype", "per_logit"), [(torch.float32, 4), (torch.bfloat16, 6)])
def test_the_chunk_follows_the_byte_budget(dtype, per_logit):
    """A chunk is the largest power of two of tokens that fits the budget at this vocabulary, and a bf16 chunk
    (logits + one float32 copy) holds no more bytes than a float32 one."""
    v, c, budget = 256, 16, 4 * 256 * 64
    h, w, y = _inputs(n=100, c=c, v=v)
    tokens = chunk_tokens(v, dtype, budget)
    fits = budget // (v * per_logit)  # 64 in float32, 42 in bf16
    assert tokens <= fits < 2 * tokens and tokens == (64 if dtype == torch.float32 else 32)
    assert chunk_tokens(4 * v, dtype, budget) < tokens  # a larger vocabulary: fewer tokens

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = linear_cross_entropy(h, w, y, chunk_bytes=budget)
        loss.backward()

    peak, rows = _live_chunk_bytes(step, v, c)
    assert rows == tokens
    assert peak == tokens * v * per_logit <= budget  # one chunk's logits and its float32 copy, nothing more


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


def _record_inductor_graphs(graphs):
    """A post-grad pass of Inductor's that keeps, per compiled graph, its input shapes, its operators and whether
    the reduction may be split, as Inductor compiles it."""
    import torch._inductor.config as inductor_config

    def record(graph):
        graphs.append(dict(
            shapes=[tuple(n.meta["val"].shape) for n in graph.nodes if n.op == "placeholder"],
            ops=[str(n.target) for n in graph.nodes if n.op == "call_function"],
            split_reductions=inductor_config.split_reductions,
        ))

    return inductor_config.patch(post_grad_custom_post_pass=record)


def test_the_compiled_chunk_is_one_static_shape_without_a_scatter_and_matches_eager():
    """The compiled loss: one graph for every chunk (the tail padded to the chunk's rows), the one-hot built
    pointwise (no scatter, which would make Inductor realise the float32 softmax and run a second kernel), no
    split reduction (it turns Inductor's online softmax off), and the loss and gradients of the eager path."""
    torch.compiler.reset()
    loss_module._compiled.cache_clear()
    h, w, y = _inputs(n=40)  # 80 tokens: chunks of 24, 24, 24 and a tail of 8
    eager = linear_cross_entropy(h, w, y, chunk_size=24)
    ge = torch.autograd.grad(eager, [h, w])
    graphs = []
    with _record_inductor_graphs(graphs):
        compiled = linear_cross_entropy(h, w, y, chunk_size=24, impl="chunked", compile_chunk=True)
        gc = torch.autograd.grad(compiled, [h, w])
    assert len(graphs) == 1, [g["shapes"] for g in graphs]  # the tail compiled nothing of its own
    (graph,) = graphs
    assert graph["shapes"] == [(96, 16), (24, 16), (24,)]  # weight, hidden chunk, targets: static
    assert not [op for op in graph["ops"] if "scatter" in op or "index_put" in op], graph["ops"]
    assert "aten.eq.Tensor" in graph["ops"]  # the one-hot, from a comparison with the column index
    assert graph["split_reductions"] is False
    import torch._inductor.config as inductor_config

    assert inductor_config.split_reductions is True  # only for the loss: the global setting is untouched
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled, _reference(h, w, y), rtol=1e-5, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_auto_on_a_cpu_keeps_the_chunk_eager_as_measured():
    """The CPU's measured default (benchmarks/results/cpu/loss-bench/): the eager chunk, also when asked to compile."""
    torch.compiler.reset()
    loss_module._compiled.cache_clear()
    h, w, y = _inputs(n=40)
    graphs = []
    with _record_inductor_graphs(graphs):
        loss = linear_cross_entropy(h, w, y, chunk_size=24, compile_chunk=True)
    assert graphs == [] and loss_module._compiled.cache_info().currsize == 0
    torch.testing.assert_close(loss, _reference(h, w, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("tokens", "chunk", "rows"), [(80, 24, 24), (72, 24, 24), (5, 24, 8), (17, 24, 24), (1, 4, 2)])
def test_the_compiled_chunk_rows(tokens, chunk, rows):
    """Every compiled chunk has the chunk's rows; fewer tokens than a chunk take the next power of two."""
    assert loss_module._chunk_rows(tokens, chunk) == rows


def test_the_run_budget_follows_the_free_memory_within_its_bounds():
    budget, GB = loss_module.chunk_budget, 10**9
    assert budget(None) == loss_module.CHUNK_BYTES  # not known: a bare call's default
    assert budget(1 * GB) == budget(0) == loss_module.CHUNK_BYTES  # at least 512 MiB
    assert budget(16 * GB) == 1 * GB  # a sixteenth
    assert budget(79 * GB) == budget(141 * GB) == loss_module.MAX_CHUNK_BYTES  # an H100, an H200: 4 GiB
    # At the 124m benchmark's vocabulary on an H100: 8 chunks in a 65,536-token micro-batch, not 37.
    chunk = loss_module.run_chunk_tokens(50304, torch.bfloat16, 79 * GB)
    assert chunk == 8192 and 65536 // chunk == 8
    assert loss_module.run_chunk_tokens(50304, torch.bfloat16, None) == 1024
    with pytest.raises(ValueError, match="chunk_budget.free_bytes must be an integer >= 0"):
        budget(-1)


def test_a_resume_keeps_the_chunk_of_its_run_when_the_free_memory_changed(tmp_path, monkeypatch):
    """The chunk is chosen once, at setup, from the free memory, saved with the checkpoint, and a resume takes
    the checkpoint's (the head's gradient is summed in the same order), not what the free memory gives now."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpuopt.model import module as module_module
    from tests.precision._helpers import tiny_gpt_module, token_loader

    def fit(free_bytes, max_steps, ckpt_path=None):
        monkeypatch.setattr(module_module, "device_free_bytes", lambda device: free_bytes)
        model = tiny_gpt_module()
        trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        trainer.fit(model, train_dataloaders=token_loader(n_seq=4, batch_size=4), ckpt_path=ckpt_path)
        return model

    big, small = 64 * 2**30, 2**30  # budgets of 4 GiB and 512 MiB
    first = fit(big, max_steps=1)
    chunk = loss_module.run_chunk_tokens(256, torch.float32, big)  # the tiny preset's padded vocabulary: 256
    assert first.config.loss_chunk_size == first.model.config.loss_chunk_size == chunk
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["loss_chunk_size"] == chunk
    assert fit(small, max_steps=1).config.loss_chunk_size == chunk // 8  # a fresh run follows the free memory
    resumed = fit(small, max_steps=2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.config.loss_chunk_size == chunk  # the resumed run keeps its own


def test_a_chunk_given_against_the_checkpoints_says_the_resume_is_not_bit_exact():
    from tests.precision._helpers import tiny_gpt_module

    model = tiny_gpt_module(loss_chunk_size=64)
    with pytest.warns(UserWarning, match="differs from the 128 tokens per chunk of the checkpoint's run"):
        model.on_load_checkpoint({"loss_chunk_size": 128})
    assert model.config.loss_chunk_size == 64  # the user's, as given
    unset = tiny_gpt_module()
    unset.on_load_checkpoint({"loss_chunk_size": 128})
    assert unset.config.loss_chunk_size == 128


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(chunk_size=0), ValueError, "linear_cross_entropy.chunk_size must be an integer >= 1 or None, got 0"),
        (dict(impl="fused"), ValueError,
         "linear_cross_entropy.impl must be 'auto', 'chunked', 'liger' or 'plain', got 'fused'"),
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
    with pytest.raises(ValueError, match="GPTConfig.loss_impl must be 'auto', 'chunked', 'liger' or 'plain', got"):
        GPTConfig(loss_impl="fused")
    with pytest.raises(ValueError, match="GPTConfig.loss_chunk_size must be an integer >= 1 or None"):
        GPTConfig(loss_chunk_size=0)


_LIGER_SCRIPT = """
import torch, torch.nn.functional as F
from lightning_gpuopt.model.loss import _liger
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    h, w = torch.randn(64, 32, dtype=torch.float64), torch.randn(128, 32, dtype=torch.float64) * 0.3
    y = torch.randint(0, 128, (64,))
    y[:5] = -1
    h1, w1 = h.float().requires_grad_(), w.float().requires_grad_()
    loss = _liger(h1, w1, y, -1, dtype)
    loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.t(), y, ignore_index=-1)
    ref.backward()
    assert abs(float(loss) - float(ref)) < tol * float(ref), (dtype, float(loss), float(ref))
    for got, want in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < tol, (dtype, error)
print("ok")
"""


@pytest.mark.triton
def test_liger_loss_matches_cross_entropy_under_tritons_interpreter():
    """loss_impl='liger' (Liger-Kernel's Triton kernels, CUDA only in training) run by Triton's CPU interpreter."""
    import importlib.util
    import os
    import subprocess
    import sys

    from tests._paths import REPO

    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("needs triton and liger-kernel (pip install triton liger-kernel): Triton's interpreter runs them on a CPU")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", _LIGER_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch's own linear_cross_entropy needs torch >= 2.13")
def test_the_reasons_torchs_own_linear_cross_entropy_is_not_used_still_hold():
    """docs/model.md ("The loss") keeps the chunked loss because torch's own is not exact in bf16 and fp16.

    If this test fails, torch has fixed what the note names: measure again and reconsider."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(512, 64, generator=g) * 0.5, torch.randn(16384, 64, generator=g) * 0.05
    y = torch.randint(0, 16384, (512,), generator=g)
    exact = F.cross_entropy(h.bfloat16().double() @ w.bfloat16().double().T, y).item()
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=256)
    native = F.linear_cross_entropy(h.bfloat16(), w.bfloat16(), y, options=options)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, y)
    assert native.dtype == torch.bfloat16 and abs(native.item() - exact) / exact > 1e-4
    assert ours.dtype == torch.float32 and abs(ours.item() - exact) / exact < 1e-5

    scale = 65536.0  # GradScaler's first scale
    hn, wn = h.half().requires_grad_(), w.half().requires_grad_()
    (F.linear_cross_entropy(hn, wn, y, options=options) * scale).backward()
    ho, wo = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        ours = linear_cross_entropy(ho, wo, y)
    (ours * scale).backward()
    assert not (torch.isfinite(hn.grad).all() and torch.isfinite(wn.grad).all())
    assert torch.isfinite(ho.grad).all() and torch.isfinite(wo.grad).all()
