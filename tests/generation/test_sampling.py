"""Generation: the KV cache gives the uncached result, sampling settings, argument errors."""

import pytest
import torch

from lightning_gpuopt.generation import KVCache
from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.generation.sampling import sample_next


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=100), **overrides})


@pytest.mark.parametrize("prompt_len", [1, 5])
def test_kv_cache_greedy_equals_uncached(prompt_len):
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 100, (3, prompt_len))
    # 60 new tokens: past block_size=32, so the cropped-window path is exercised too
    cached = model.generate(idx, 60, temperature=0)
    uncached = model.generate(idx, 60, temperature=0, use_cache=False)
    assert cached.shape == (3, prompt_len + 60)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :prompt_len], idx)


def test_kv_cache_sampling_equals_uncached_with_same_generator():
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 100, (4, 3))
    a = model.generate(idx, 20, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 20, temperature=1.0, top_k=10, use_cache=False, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_cached_logits_match_full_forward():
    model = GPT(tiny()).eval()
    x = torch.randint(0, 100, (2, 12))
    full = model(x)
    caches = [KVCache(32) for _ in range(2)]
    with torch.no_grad():
        first = model(x[:, :5], caches)  # prefill
        chunk = model(x[:, 5:9], caches)  # several tokens after a filled cache
        step = model(x[:, 9:10], caches)  # one token
    torch.testing.assert_close(torch.cat([first, chunk, step], 1), full[:, :10], atol=1e-5, rtol=1e-5)
    assert caches[0].pos == 10


def test_generate_never_emits_padding_ids():
    model = GPT(tiny(vocab_size=70)).eval()  # padded to 128
    with torch.no_grad():
        model.lm_head.weight[70:] = 10.0  # make the padding rows the most likely ones
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20, temperature=1.0)
    assert out.max() < 70


def test_top_k_restricts_choices():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(200, 1)
    picks = sample_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(picks.flatten().tolist()) == {1, 2}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "generate.max_new_tokens must be an integer >= 0, got -1"),
        (dict(max_new_tokens=1, temperature=-0.5), r"generate.temperature must be >= 0, got -0.5 \(0 is greedy\)"),
        (dict(max_new_tokens=1, top_k=0), "generate.top_k must be an integer >= 1 or None, got 0"),
    ],
)
def test_generate_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPT(tiny()).generate(torch.zeros(1, 2, dtype=torch.long), **kwargs)


def test_generate_rejects_1d_prompt():
    with pytest.raises(ValueError, match=r"shape \(batch, length >= 1\)"):
        GPT(tiny()).generate(torch.zeros(4, dtype=torch.long), 1)
