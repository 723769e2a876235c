"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv:2104.09864), as the Llama-style GPT uses them.

Pairs entry ``i`` with ``i + head_size / 2`` ("rotate half", as Hugging Face and litgpt); cos and sin are
computed from the positions at each forward in float32, so nothing is stored (``docs/model.md``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(positions: Tensor, head_size: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of each position's rotation angles, in float32, each ``positions.shape + (head_size // 2,)``.

    Example::

        cos, sin = rope_cos_sin(torch.arange(16), head_size=64, theta=500000.0)   # (16, 32) each

    Args:
        positions: Integer positions, (T,) or (B, T).
        theta: The base of the angles (``GPTConfig.rope_theta``; 10,000 in the paper, 500,000 in Llama 3).
    """
    exponents = torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size
    inv_freq = 1.0 / (theta**exponents)  # (hs/2,)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (T, hs/2) or (B, T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the queries or keys ``x`` (B, T, nh, hs) by ``cos``, ``sin`` of :func:`rope_cos_sin`, in ``x``'s dtype
    (as Hugging Face and litgpt)."""
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, hs/2) or (B, T, 1, hs/2): the same angles for every head
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)  # the two halves of each pair, (B, T, nh, hs/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
