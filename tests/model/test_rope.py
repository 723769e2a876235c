"""Rotary position embeddings: a rotation whose query-key products depend on the distance only, with
positions given per sequence (T,) or per row (B, T)."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.model.rope import apply_rope, rope_cos_sin


def test_rotary_embedding_depends_on_distance_and_takes_positions_per_row():
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(p_q, p_k):
        cq, sq = rope_cos_sin(torch.tensor([p_q]), 16, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([p_k]), 16, 10000.0)
        return (apply_rope(q, cq.double(), sq.double()) * apply_rope(k, ck.double(), sk.double())).sum().item()

    assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-5) == pytest.approx(score(4, 0), abs=1e-5)  # float32 angles
    assert score(7, 3) != pytest.approx(score(7, 2), abs=1e-3)
    assert score(0, 0) == pytest.approx((q * k).sum().item())  # position 0 is not rotated
    # (B, T) positions: each row gets the angles of its own positions
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    assert cos.shape == (2, 4, 8)
    for row in range(2):
        torch.testing.assert_close((cos[row], sin[row]), rope_cos_sin(pos[row], 16, 10000.0), rtol=0, atol=0)
    x = torch.randn(2, 4, 3, 16)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated[1], apply_rope(x[1:], *rope_cos_sin(pos[1], 16, 10000.0))[0])
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_is_checked():
    import math

    import pytest

    from lightning_gpuopt.model import GPTConfig
    from lightning_gpuopt.model.rope import llama3_inv_freq

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    scaled = llama3_inv_freq(inv_freq, scaling)
    wavelen = 2 * math.pi / inv_freq
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], inv_freq[short]) and torch.allclose(scaled[long], inv_freq[long] / 8)
    between = ~short & ~long  # smoothly between the two
    assert ((scaled[between] < inv_freq[between]) & (scaled[between] > inv_freq[between] / 8)).all()
    assert GPTConfig.from_name("llama-tiny", rope_scaling=scaling).rope_scaling == scaling
    with pytest.raises(ValueError, match=r"rope_scaling needs positions='rotary'"):
        GPTConfig.from_name("tiny", rope_scaling=scaling)
    with pytest.raises(ValueError, match=r"give Llama 3.1's scaling, a dict of the positive numbers"):
        GPTConfig.from_name("llama-tiny", rope_scaling={"factor": 8.0})
