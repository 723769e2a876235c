"""Parameter counts and FLOPs of the presets, as the README's table shows them.

Regenerate the README table with ``python -m lightning_gpuopt.model.summary``.
"""

from __future__ import annotations

import torch

from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.model.gpt import GPT

__all__ = ["preset_table"]


def preset_table(vocab_size: int = 50257, block_size: int = 1024) -> str:
    """Markdown table of every preset's shape, parameter counts and training FLOPs per token.

    Models are built on the meta device, so nothing is allocated.

    Args:
        vocab_size: Vocabulary the counts assume (GPT-2's by default; padded to a multiple of 64).
        block_size: Context length the counts and FLOPs assume.
    """
    rows = [
        "| preset | n_layer | n_head | n_embd | total params | non-embedding params | training GFLOPs/token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in PRESETS:
        overrides = {} if name == "tiny" else dict(vocab_size=vocab_size, block_size=block_size)
        config = GPTConfig.from_name(name, **overrides)
        with torch.device("meta"):
            model = GPT(config)
        rows.append(
            f"| `{name}` | {config.n_layer} | {config.n_head} | {config.n_embd} | {model.num_params():,} "
            f"| {model.num_params(non_embedding=True):,} | {model.flops_per_token() / 1e9:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(preset_table())
