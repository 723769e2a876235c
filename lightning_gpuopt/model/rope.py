"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv:2104.09864), as the Llama-style GPT uses them.

Design note: a query or key vector of ``head_size`` numbers is read as ``head_size / 2`` pairs, pair
``i`` made of entries ``i`` and ``i + head_size / 2`` (the "rotate half" layout of Hugging Face and
litgpt; Meta's reference code pairs neighbouring entries instead, the same rotation of permuted
weights), and pair ``i`` at position ``p`` is turned by the angle ``p * theta ** (-2 i / head_size)``.
The dot product of a rotated query and key then depends on their distance only. Nothing is learned and
nothing is stored: cos and sin are computed from the positions at each forward, in float32 (one
``(T, head_size / 2)`` table for every block, negligible next to a block), so there is no buffer to
materialise after a meta-device init, to shard, or to lose precision in a ``.to(bfloat16)``.
Positions are a tensor, ``(T,)`` for every row or ``(B, T)`` for one row each (prompts of different
lengths), so a cache or padding changes only the positions passed in.

Llama 3.1's long-context frequency scaling (``rope_scaling``, "llama3") is not applied: it matters
past the 8,192-token context Llama 3 was pre-trained at, and for Meta's weights, which are not loaded here.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(positions: Tensor, head_size: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of each position's rotation angles, in float32.

    Example::

        cos, sin = rope_cos_sin(torch.arange(16), head_size=64, theta=500000.0)   # (16, 32) each

    Args:
        positions: Integer positions, (T,) or (B, T).
        head_size: Width of one attention head (even).
        theta: The base of the angles (``GPTConfig.rope_theta``; 10,000 in the paper, 500,000 in Llama 3).

    Returns:
        ``(cos, sin)``, each of shape ``positions.shape + (head_size // 2,)``.
    """
    exponents = torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size
    inv_freq = 1.0 / (theta**exponents)  # (hs/2,)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (T, hs/2) or (B, T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the queries or keys ``x`` of shape (B, T, nh, hs) by the angles of their positions.

    Computed in ``x``'s dtype (cos and sin are cast to it), as Hugging Face and litgpt do.

    Args:
        x: Queries or keys, heads in the third dimension.
        cos: From :func:`rope_cos_sin`, (T, hs/2) or (B, T, hs/2).
        sin: Likewise.
    """
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, hs/2) or (B, T, 1, hs/2): the same angles for every head
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)  # the two halves of each pair, (B, T, nh, hs/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
