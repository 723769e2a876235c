"""The GPT model: shapes, causality, tied and GPT-2-initialised weights, FLOPs per token, attention kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpuopt.model import GPT, GPTConfig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=100), **overrides})


def test_forward_shape_and_padded_vocab():
    model = GPT(tiny())
    logits = model(torch.randint(0, 100, (3, 7)))
    assert logits.shape == (3, 7, 128)


def test_future_tokens_do_not_change_past_logits():
    model = GPT(tiny()).eval()
    x = torch.randint(0, 100, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 100, (2, 6))
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_weights_are_tied_and_initialised_gpt2_style():
    model = GPT(tiny(n_layer=8))
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)
    assert proj.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)  # 1/sqrt(2 * 8 layers)
    assert all(b.attn.c_attn.bias.abs().sum() == 0 for b in model.transformer.h)


def _gpt2_reference(sd: dict, c: GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward written out with functional ops on a state dict (the model before the Llama option set)."""
    B, T = idx.shape
    C, nh = c.n_embd, c.n_head

    def ln(x, name):
        return F.layer_norm(x, (C,), sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-5)

    def lin(x, name):
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    x = F.embedding(idx, sd["transformer.wte.weight"]) + F.embedding(torch.arange(T), sd["transformer.wpe.weight"])
    for i in range(c.n_layer):
        h = f"transformer.h.{i}"
        q, k, v = lin(ln(x, f"{h}.ln_1"), f"{h}.attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + lin(y, f"{h}.attn.c_proj")
        x = x + lin(F.gelu(lin(ln(x, f"{h}.ln_2"), f"{h}.mlp.c_fc"), approximate="tanh"), f"{h}.mlp.c_proj")
    return F.linear(ln(x, "transformer.ln_f"), sd["lm_head.weight"])


def test_gpt2_keeps_its_state_dict_keys_and_outputs_bit_for_bit():
    """The default architecture (arch="gpt2") is GPT-2 as before: the same keys, the same logits to the bit."""
    config = GPTConfig.from_name("tiny")
    model = GPT(config).eval()
    block = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
             "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    assert list(model.state_dict()) == [
        "transformer.wte.weight", "transformer.wpe.weight",
        *(f"transformer.h.{i}.{name}" for i in range(2) for name in block),
        "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight",
    ]
    assert (config.arch, config.n_kv_head, config.bias, config.ffn_size) == ("gpt2", 4, True, 256)
    idx = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        assert torch.equal(model(idx), _gpt2_reference(model.state_dict(), config, idx))


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="longer than GPTConfig.block_size=32"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_flops_per_token_matches_flop_counter():
    """PaLM's 6N + 12·L·H·Q·T against torch's FlopCounterMode (forward + backward).

    The counter sees matmuls only, so the expected gap is the biases and LayerNorm parameters that
    the formula's N includes: 6 · 1,792 FLOPs per token here, 1.54% of the total. The math SDPA
    backend is used so the counter also sees the attention matmuls (full T×T, like the formula).
    """
    model = GPT(tiny())
    x = torch.randint(0, 100, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    formula = model.flops_per_token(32) * x.numel()
    measured = counter.get_total_flops()
    non_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    assert non_matmul == 1792
    assert measured == formula - 6 * non_matmul * x.numel()
    assert 0.98 < measured / formula < 1.0


def test_flops_attention_term_scales_with_sequence_length():
    model = GPT(tiny())
    c = model.config
    assert model.flops_per_token(32) - model.flops_per_token(16) == 12 * c.n_layer * c.n_embd * 16


@pytest.mark.parametrize("mode", [True, "full", "selective"])
def test_activation_checkpointing_gives_same_gradients(mode):
    torch.manual_seed(0)
    plain = GPT(tiny(n_layer=4))
    ckpt = GPT(tiny(n_layer=4, activation_checkpointing=mode))
    recomputed = []  # the blocks whose forward runs again in the backward
    for i, block in enumerate(ckpt.transformer.h):
        block.forward = lambda *a, i=i, f=block.forward, **k: recomputed.append(i) or f(*a, **k)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 100, (2, 32))
    for m in (plain, ckpt):
        m.loss(m(x[:, :-1]), x[:, 1:]).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    twice = sorted(i for i in set(recomputed) if recomputed.count(i) == 2)
    assert twice == ([1, 3] if mode == "selective" else [0, 1, 2, 3])  # selective: the second block of each pair


def test_activation_checkpointing_takes_full_or_selective_only():
    with pytest.raises(ValueError, match=r"activation_checkpointing must be false, true \(every block: 'full'\) or "
                                         r"'selective' \(every other block\), got 'some'"):
        tiny(activation_checkpointing="some")


def test_flash_attn_missing_names_the_extra():
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r'pip install "lightning-gpuopt\[flash\]"'):
        GPT(tiny(attention="flash-attn"))


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@requires_cuda
def test_sdpa_uses_flash_kernel_on_gpu():
    model = GPT(tiny(n_embd=128, n_head=2)).cuda()
    x = torch.randint(0, 100, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.profiler.profile() as prof:
        model(x).sum().backward()
    names = " ".join(e.name for e in prof.events())
    assert "flash" in names.lower() or "cudnn" in names.lower(), "no Flash/cuDNN attention kernel ran"


@pytest.mark.gpu
@requires_cuda
def test_flash_attn_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn", reason="flash-attn not installed")
    torch.manual_seed(0)
    sdpa = GPT(tiny(n_embd=128, n_head=2)).cuda()
    fa = GPT(tiny(n_embd=128, n_head=2, attention="flash-attn")).cuda()
    fa.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 100, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(fa(x).float(), sdpa(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_fused_adamw_on_gpu():
    from lightning_gpuopt.model.optim import build_adamw

    opt = build_adamw(GPT(tiny()).cuda(), lr=1e-3)
    assert opt.defaults["fused"] is True
