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
