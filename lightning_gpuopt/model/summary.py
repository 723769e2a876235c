"""Parameter counts and FLOPs of the presets: ``python -m lightning_gpuopt.model.summary`` prints the README's table."""

from __future__ import annotations

import torch

from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.model.gpt import GPT

__all__ = ["preset_table"]


def preset_table(vocab_size: int = 50257, block_size: int = 1024) -> str:
    """Markdown table of every preset's shape, parameter counts and training FLOPs per token (on the meta device).

    Args:
        vocab_size: Vocabulary the presets without one of their own (GPT-2's) are counted at; the others keep theirs.
        block_size: Context length those presets are counted at.
    """
    rows = [
        "| preset | arch | n_layer | n_head | n_kv_head | n_embd | MLP width | tied head | vocabulary | context "
        "| total params | non-embedding params | training GFLOPs/token |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, preset in PRESETS.items():
        own = "vocab_size" in preset  # a preset with its own vocabulary (Llama 3's, Qwen2's, the tiny ones') keeps it
        config = GPTConfig.from_name(name, **({} if own else dict(vocab_size=vocab_size, block_size=block_size)))
        with torch.device("meta"):
            model = GPT(config)
        rows.append(
            f"| `{name}` | {config.arch} | {config.n_layer} | {config.n_head} | {config.n_kv_head} | {config.n_embd} "
            f"| {config.ffn_size} | {'yes' if config.tie_embeddings else 'no'} | {config.vocab_size:,} "
            f"| {config.block_size:,} | {model.num_params():,} | {model.num_params(non_embedding=True):,} "
            f"| {model.flops_per_token() / 1e9:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(preset_table())
