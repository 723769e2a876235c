"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv:2104.09864), as the Llama-style GPT uses them.

Pairs entry ``i`` with ``i + head_size / 2`` ("rotate half", as Hugging Face and litgpt); cos and sin are
computed from the positions at each forward in float32, so nothing is stored (``docs/model.md``). Llama 3.1's
scaling of the frequencies (``"llama3"``, also Llama 3.2's) is :func:`llama3_inv_freq`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["LLAMA3_SCALING_KEYS", "apply_rope", "check_rope_scaling", "llama3_inv_freq", "rope_cos_sin"]

# The keys of a "llama3" rope_scaling (Hugging Face's rope_parameters, Meta's apply_scaling): 8, 1, 4, 8192 in Llama 3.1
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: Optional[dict]) -> None:
    """Raise ``ValueError`` naming the fix unless ``scaling`` is ``None`` or a ``"llama3"`` scaling: its four
    positive numbers (:data:`LLAMA3_SCALING_KEYS`), ``high_freq_factor > low_freq_factor``."""
    if scaling is None:
        return
    keys = sorted(scaling) if isinstance(scaling, dict) else None
    if keys != sorted(LLAMA3_SCALING_KEYS) or not all(
            isinstance(scaling[k], (int, float)) and not isinstance(scaling[k], bool) and scaling[k] > 0 for k in keys):
        raise ValueError(f"GPTConfig.rope_scaling={scaling!r}: give Llama 3.1's scaling, a dict of the positive "
                         f"numbers {list(LLAMA3_SCALING_KEYS)} (8, 1, 4, 8192 in Llama 3.1), or None for none.")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"GPTConfig.rope_scaling: high_freq_factor={scaling['high_freq_factor']} must be larger than "
                         f"low_freq_factor={scaling['low_freq_factor']} (Llama 3.1: 4 and 1).")


def llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1's scaled frequencies (Meta's ``apply_scaling``, Hugging Face's ``"llama3"`` rope type): wavelengths
    shorter than ``original / high_freq_factor`` positions kept, longer than ``original / low_freq_factor`` divided by
    ``factor``, those between interpolated smoothly. ``inv_freq`` (hs/2,) float32; returns the same shape."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: Tensor, head_size: int, theta: float, scaling: Optional[dict] = None
) -> tuple[Tensor, Tensor]:
    """cos and sin of each position's rotation angles, in float32, each ``positions.shape + (head_size // 2,)``.

    Example::

        cos, sin = rope_cos_sin(torch.arange(16), head_size=64, theta=500000.0)   # (16, 32) each

    Args:
        positions: Integer positions, (T,) or (B, T).
        theta: The base of the angles (``GPTConfig.rope_theta``; 10,000 in the paper, 500,000 in Llama 3).
        scaling: Llama 3.1's scaling of the frequencies (``GPTConfig.rope_scaling``, :func:`llama3_inv_freq`), or
            ``None``.
    """
    exponents = torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size
    inv_freq = 1.0 / (theta**exponents)  # (hs/2,)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (T, hs/2) or (B, T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the queries or keys ``x`` (B, T, nh, hs) by ``cos``, ``sin`` of :func:`rope_cos_sin`, in ``x``'s dtype
    (as Hugging Face and litgpt)."""
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, hs/2) or (B, T, 1, hs/2): the same angles for every head
    sin = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)  # the two halves of each pair, (B, T, nh, hs/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
