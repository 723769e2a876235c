"""A Hugging Face ``LlamaForCausalLM`` in a LightningModule of its own: what ``gpuopt`` trains with its stack.

The model is built from a ``LlamaConfig`` written here (no download), sized small enough for a CPU.
It is an example of a module this package did not write: ``gpuopt`` is told its class path.

Run (from the checkout, which puts this folder on the path)::

    PYTHONPATH=examples gpuopt fit --config examples/configs/hf-llama.yaml

Needs ``pip install transformers``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

__all__ = ["TinyLlama"]


class TinyLlama(pl.LightningModule):
    """``LlamaForCausalLM`` from a small ``LlamaConfig``, trained on ``(x, y)`` token batches (``TextDataModule``'s).

    Args:
        vocab_size: Tokens in the vocabulary: the data's ``vocab_size`` (TextDataModule's BPE size).
        block_size: Tokens per sequence (the rotary embeddings' ``max_position_embeddings``).
        hidden_size: Width (a multiple of 16 and of ``num_attention_heads``).
        num_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention when fewer than the query heads).
        learning_rate: AdamW's learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        block_size: int = 128,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        learning_rate: float = 2e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, max_position_embeddings=block_size,
            attn_implementation="sdpa",  # torch's fused attention kernels
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits  # (B, T, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T) inputs and (B, T) next tokens
        logits = self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits
        self.log("val/loss", F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=0.1)
