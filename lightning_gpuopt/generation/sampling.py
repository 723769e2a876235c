"""Batched autoregressive sampling with a KV cache, for prompts of equal length (``GPT.generate``).

It asks of the model only ``model(idx, caches)`` and ``model.config``, so it does not import ``GPT``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_gpuopt.generation.kv_cache import KVCache
from lightning_gpuopt.option_checks import check_int, check_number

__all__ = ["generate", "sample_next"]


def sample_next(
    logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None, generator: Optional[torch.Generator] = None
) -> Tensor:
    """The next token id (B, 1) for each row of ``logits`` (B, V): ``temperature`` 0 is greedy, ``top_k`` keeps the
    most likely tokens only."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        # Draw among the top_k only: the same distribution as masking the rest to -inf, without a draw over the
        # whole vocabulary (torch.multinomial's cost grows with the number of categories).
        values, ids = torch.topk(logits, top_k)  # (B, k)
        pick = torch.multinomial(torch.softmax(values, dim=-1), num_samples=1, generator=generator)  # (B, 1)
        return ids.gather(-1, pick)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    use_cache: bool = True,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Continue a batch of equal-length prompts by ``max_new_tokens`` tokens.

    Past ``block_size`` the context is cropped to the last ``block_size`` tokens, with or without the cache,
    so both give the same tokens.

    Example::

        prompts = torch.tensor(tokenizer.encode_batch(["def main(", "class Foo"]))  # equal lengths
        out = generate(model, prompts, max_new_tokens=100, temperature=0.8, top_k=50)

    Args:
        model: The ``GPT`` to sample from, in ``eval()`` mode for deterministic outputs.
        idx: Prompt token ids (B, T), T >= 1.
        temperature: Sampling temperature; ``0`` is greedy decoding.
        top_k: Sample among the ``top_k`` most likely tokens only.
        use_cache: Use a KV cache (fast); ``False`` recomputes the full context each step.

    Returns:
        Token ids (B, T + max_new_tokens): the prompts, then the new tokens (never a padding row's id).
    """
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"generate() expects prompt ids of shape (batch, length >= 1), got {tuple(idx.shape)}.")
    check_int("generate", "max_new_tokens", max_new_tokens, minimum=0)
    check_number("generate", "temperature", temperature, low=0, hint=" (0 is greedy)")
    check_int("generate", "top_k", top_k, minimum=1, optional=True, hint=" (None: no limit)")
    block_size = model.config.block_size
    vocab_size = model.config.vocab_size
    caches = [KVCache(block_size) for _ in range(model.config.n_layer)] if use_cache else None
    for _ in range(max_new_tokens):
        if caches is None:
            logits = model(idx[:, -block_size:])
        elif caches[0].pos == 0 or caches[0].pos + 1 > block_size:
            # first step, or the window is full: (re)fill the cache from the last block_size tokens
            for cache in caches:
                cache.reset()
            logits = model(idx[:, -block_size:], caches)
        else:
            logits = model(idx[:, -1:], caches)
        logits = logits[:, -1, :vocab_size]  # drop the padding rows of the vocabulary
        idx = torch.cat((idx, sample_next(logits, temperature, top_k, generator)), dim=1)
    return idx
