"""The Llama-style GPT (``GPTConfig(arch="llama")``): its names and shapes against a functional reference, the
Llama 3 presets, and the model's own pieces run on it (chunked loss, KV cache, FLOPs, activation checkpointing,
per-block compile). float8, FSDP2, load_gpt, GPTModule, choose_strategy and ``gpuopt fit`` on it are tested with
those pieces (``llama`` in the test names)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpuopt.model import GPT, GPTConfig, KVCache
from lightning_gpuopt.model.config import llama_ffn_size
from lightning_gpuopt.model.gpt import grouped_heads_run_fused
from lightning_gpuopt.model.rope import rope_cos_sin

LLAMA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=100, multiple_of=16)


def llama(**overrides) -> GPTConfig:
    return GPTConfig(**{**LLAMA, **overrides})


def _llama_reference(sd: dict, c: GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """Llama's forward written out with functional ops on a state dict: RMSNorm, rotary embeddings in the
    rotate-half layout, keys and values repeated for each query head of their group, SwiGLU, math attention."""
    B, T = idx.shape
    hs = c.n_embd // c.n_head

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * sd[f"{name}.weight"]

    def rotate(x):  # (B, nh, T, hs)
        inv_freq = c.rope_theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
        angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq).float()
        cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
        x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    x = F.embedding(idx, sd["transformer.wte.weight"])
    for i in range(c.n_layer):
        h = f"transformer.h.{i}"
        a = rms(x, f"{h}.ln_1")
        q = F.linear(a, sd[f"{h}.attn.q_proj.weight"]).view(B, T, c.n_head, hs).transpose(1, 2)
        k = F.linear(a, sd[f"{h}.attn.k_proj.weight"]).view(B, T, c.n_kv_head, hs).transpose(1, 2)
        v = F.linear(a, sd[f"{h}.attn.v_proj.weight"]).view(B, T, c.n_kv_head, hs).transpose(1, 2)
        group = c.n_head // c.n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(hs)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, c.n_embd)
        x = x + F.linear(y, sd[f"{h}.attn.c_proj.weight"])
        m = rms(x, f"{h}.ln_2")
        gate, up = F.linear(m, sd[f"{h}.mlp.gate_proj.weight"]), F.linear(m, sd[f"{h}.mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, sd[f"{h}.mlp.c_proj.weight"])
    return F.linear(rms(x, "transformer.ln_f"), sd["lm_head.weight"])


BLOCK_KEYS = ["ln_1.weight", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.c_proj.weight",
              "ln_2.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.c_proj.weight"]


@pytest.mark.parametrize("tied", [True, False])
def test_names_shapes_and_outputs_match_the_functional_reference(tied):
    config = llama(tie_embeddings=tied, rope_theta=500000.0)
    model = GPT(config).eval()
    sd = model.state_dict()
    assert list(sd) == [
        "transformer.wte.weight", *(f"transformer.h.{i}.{k}" for i in range(2) for k in BLOCK_KEYS),
        "transformer.ln_f.weight", "lm_head.weight",
    ]
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    h = "transformer.h.0."
    assert sd[h + "attn.q_proj.weight"].shape == (64, 64) and sd[h + "attn.k_proj.weight"].shape == (32, 64)
    assert sd[h + "mlp.gate_proj.weight"].shape == (176, 64) and sd[h + "mlp.c_proj.weight"].shape == (64, 176)
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == 5 and not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))  # no biases
    idx = torch.randint(0, 100, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), _llama_reference(sd, config, idx), atol=2e-5, rtol=1e-4)


def test_initialisation_scales_the_residual_projections_and_starts_norms_at_one():
    model = GPT(llama(n_layer=8, n_embd=256, n_head=8))
    blocks = model.transformer.h
    down = torch.cat([p.flatten() for b in blocks for p in (b.attn.c_proj.weight, b.mlp.c_proj.weight)])
    up = torch.cat([b.mlp.up_proj.weight.flatten() for b in blocks])
    assert up.std().item() == pytest.approx(0.02, rel=0.05)
    assert down.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)  # 1/sqrt(2 * 8 layers)
    assert all(torch.equal(b.ln_1.weight, torch.ones(256)) for b in blocks)


# (n_layer, n_embd, n_head, n_kv_head, intermediate_size, tied head, parameters) of Meta's models, from the
# Hugging Face config.json files (hidden_size, num_hidden_layers, ...; not from PRESETS).
LLAMA3 = {
    "llama-1b": (16, 2048, 32, 8, 8192, True, 1_235_814_400),  # Llama 3.2 1B
    "llama-3b": (28, 3072, 24, 8, 8192, True, 3_212_749_824),  # Llama 3.2 3B
    "llama-8b": (32, 4096, 32, 8, 14336, False, 8_030_261_248),  # Llama 3.1 8B
    "llama-70b": (80, 8192, 64, 8, 28672, False, 70_553_706_496),  # Llama 3.1 70B
}


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_presets_have_llama3_shapes_and_parameter_counts(name):
    L, d, nh, nkv, ffn, tied, params = LLAMA3[name]
    c = GPTConfig.from_name(name)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.ffn_size, c.tie_embeddings) == (L, d, nh, nkv, ffn, tied)
    assert (c.vocab_size, c.padded_vocab_size, c.rope_theta, c.norm_eps, c.bias) == (128256, 128256, 500000.0, 1e-5, False)
    with torch.device("meta"):
        assert GPT(c).num_params() == params


def test_mlp_width_rule_and_its_overrides():
    assert [llama_ffn_size(d, m, k) for d, m, k in [(2048, 1.5, 256), (3072, 1.0, 256), (4096, 1.3, 1024), (8192, 1.3, 4096)]] == [
        8192, 8192, 14336, 28672]
    assert llama().ffn_size == 176 and llama(intermediate_size=128).ffn_size == 128
    assert GPTConfig.from_name("llama-8b", n_embd=2048, n_head=16).ffn_size == llama_ffn_size(2048, 1.3, 1024) == 7168
    assert llama(n_kv_head=None).n_kv_head == 4  # no grouping unless asked


def test_future_tokens_do_not_change_past_logits():
    model = GPT(llama()).eval()
    x = torch.randint(0, 100, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 100, (2, 6))
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_kv_cache_holds_the_grouped_heads_and_generates_what_recomputing_does():
    model = GPT(llama(block_size=12)).eval()
    prompt = torch.randint(0, 100, (3, 5))
    caches = [KVCache(12) for _ in range(2)]
    with torch.no_grad():
        full = model(prompt)
        torch.testing.assert_close(model(prompt[:, :3], caches), full[:, :3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(prompt[:, 3:], caches), full[:, 3:], atol=1e-5, rtol=1e-5)  # T > 1 after a prefix
    assert caches[0].k.shape == (3, 2, 12, 16) and caches[0].pos == 5  # n_kv_head heads, not repeated
    # greedy and sampled continuations past block_size (the window refills): the same tokens either way
    for temperature in (0.0, 1.0):
        cached = model.generate(prompt, 9, temperature=temperature, generator=torch.Generator().manual_seed(0))
        plain = model.generate(prompt, 9, temperature=temperature, use_cache=False, generator=torch.Generator().manual_seed(0))
        assert cached.shape == (3, 14) and torch.equal(cached, plain)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_is_what_the_flop_counter_counts(tied):
    """PaLM's 6N + 12·L·H·Q·T with N = the Linear weights: exactly the counted matmuls (math SDPA, so the
    counter sees the attention matmuls over the full T x T, with grouped keys and values). Counted on the
    logits: FlopCounterMode does not see the chunked loss's in-place ``addmm_`` of the head's weight gradient."""
    model = GPT(llama(tie_embeddings=tied))
    x = torch.randint(0, 100, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() == model.flops_per_token(32) * x.numel()
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 176 * 3) + 128 * 64  # per block: q, c_proj, k, v, gate, up, down
    assert model.flops_per_token(32) == 6 * linear + 12 * 2 * 64 * 32
    if not tied:  # the token embedding is a lookup: counted in the parameters, not in N
        assert model.num_params() == linear + 128 * 64 + 5 * 64


def test_loss_activation_checkpointing_and_dropout_paths():
    torch.manual_seed(0)
    plain = GPT(llama(tie_embeddings=False))
    ckpt = GPT(llama(tie_embeddings=False, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 100, (2, 32))
    reference = plain.loss(plain(x[:, :-1]), x[:, 1:])  # full float32 logits
    reference.backward()
    loss = ckpt(x[:, :-1], targets=x[:, 1:])  # chunked, recomputed blocks
    loss.backward()
    torch.testing.assert_close(loss, reference)
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert plain.lm_head.weight.grad.abs().sum() > 0 and plain.transformer.wte.weight.grad.abs().sum() > 0


def test_blocks_compile_and_give_the_eager_logits():
    from tests.model.test_compiling import CountingBackend

    model = GPT(llama()).eval()
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        eager = model(x)
        backend = CountingBackend()
        model.compile_blocks(backend=backend)
        torch.testing.assert_close(model(x), eager)
    assert backend.graphs >= 1 and list(model.state_dict()) == list(GPT(llama()).state_dict())
    torch._dynamo.reset()


def test_grouped_heads_go_to_sdpa_as_they_are_only_where_flash_takes_them():
    """enable_gqa (torch >= 2.5) where the Flash kernel runs (16-bit, no mask), repeated keys and values elsewhere;
    both give what repeating gives, and the model computes the same either way (bf16 autocast against float32)."""
    assert grouped_heads_run_fused(torch.bfloat16, masked=False) and grouped_heads_run_fused(torch.float16, masked=False)
    assert not grouped_heads_run_fused(torch.float32, masked=False) and not grouped_heads_run_fused(torch.bfloat16, masked=True)
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeated = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(grouped, repeated)
    model = GPT(llama()).eval()
    idx = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        fp32 = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(idx)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, atol=0.05, rtol=0.05)


def test_attention_split_by_heads_sums_to_the_whole():
    """What a tensor-parallel plan does (q/k/v_proj split by output rows = heads, c_proj by input columns):
    each shard's attention runs on its own heads and the shards' outputs add up to the whole layer's."""
    import copy

    from lightning_gpuopt.model.gpt import CausalSelfAttention

    config = llama()  # 4 query heads, 2 key/value heads of 16
    whole = CausalSelfAttention(config).eval()
    x = torch.randn(2, 8, 64)
    rope = rope_cos_sin(torch.arange(8), 16, config.rope_theta)
    total = torch.zeros(2, 8, 64)
    for rank in range(2):  # 2 query heads and their 1 key/value head per shard
        shard = copy.deepcopy(whole)
        for name, rows in (("q_proj", slice(32 * rank, 32 * rank + 32)), ("k_proj", slice(16 * rank, 16 * rank + 16)),
                           ("v_proj", slice(16 * rank, 16 * rank + 16))):
            layer = getattr(shard, name)
            layer.weight = nn.Parameter(layer.weight[rows].clone())
        shard.c_proj.weight = nn.Parameter(shard.c_proj.weight[:, 32 * rank : 32 * rank + 32].clone())
        with torch.no_grad():
            total += shard(x, None, rope)
    with torch.no_grad():
        torch.testing.assert_close(total, whole(x, None, rope), atol=1e-5, rtol=1e-5)


def test_llama_option_checks_name_the_fix():
    """More in tests/test_bad_inputs.py (unknown-arch, llama-option-on-gpt2, n-kv-head-not-dividing, ...)."""
    needs = r"n_kv_head needs fused_qkv=False and rope_theta needs positions='rotary'.*leave n_kv_head, rope_theta"
    with pytest.raises(ValueError, match=needs):
        GPTConfig(n_kv_head=2, rope_theta=1e4)
    with pytest.raises(ValueError, match="rope_theta must be > 0 or None, got 0"):
        llama(rope_theta=0)
    with pytest.raises(ValueError, match="n_kv_head must be an integer >= 1 or None, got 0"):
        llama(n_kv_head=0)
    assert GPTConfig(n_kv_head=12).n_kv_head == 12  # GPT-2's own head count is accepted


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_attn_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn", reason="flash-attn not installed")
    sdpa = GPT(llama(n_embd=128, n_head=4, n_kv_head=2)).cuda()
    fa = GPT(llama(n_embd=128, n_head=4, n_kv_head=2, attention="flash-attn")).cuda()
    fa.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 100, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(fa(x).float(), sdpa(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_heads_given_to_sdpa_as_they_are_match_repeated_heads_on_gpu():
    """In bf16 without a mask the model hands SDPA the grouped key/value heads (enable_gqa); the result must be
    what the repeated heads give (the path a mask or float32 takes)."""
    from lightning_gpuopt.model.gpt import grouped_heads_run_fused

    assert grouped_heads_run_fused(torch.bfloat16, masked=False) and not grouped_heads_run_fused(torch.float32, masked=False)
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(fused.float(), repeated.float(), atol=2e-2, rtol=2e-2)
    model = GPT(llama(n_embd=128, n_head=4, n_kv_head=2)).cuda()
    x = torch.randint(0, 100, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = model(x).float()
    torch.testing.assert_close(bf16, model(x).float(), atol=5e-2, rtol=5e-2)  # bf16 fused path vs float32 repeated path
