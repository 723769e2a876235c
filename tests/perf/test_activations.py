"""Activation bytes of a training step, measured on meta tensors, against a hand count."""

from __future__ import annotations

import torch
from torch import nn

from lightning_gpuopt.perf.activations import measure_activation_bytes

B, T, D, V = 4, 32, 64, 128


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, idx):
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(idx)))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, 4, D // 4).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_saved_tensors_match_a_hand_count():
    ids = torch.zeros(B, T, dtype=torch.long)
    # saved: the indices (int64), fc1's input, relu's output (also fc2's input: counted once), fc2's output
    # (the head's input); weights are model state, not activations. Logits: 10 bytes per logit.
    est = measure_activation_bytes(Tiny(), ids, precision="32-true")
    assert est.saved == B * T * (8 + 3 * D * 4)
    assert est.logits == B * T * V * 10
    mixed = measure_activation_bytes(Tiny(), ids, precision="bf16-mixed")
    assert mixed.saved == B * T * (8 + 3 * D * 2) and mixed.total == mixed.saved + mixed.logits


def test_attention_counts_what_the_fused_kernels_keep_not_the_scores():
    x = torch.zeros(B, T, D)
    est = measure_activation_bytes(Attention(), x, precision="32-true")
    # qkv's input; q, k, v are views of one projection (counted once); the output; a float32 log-sum-exp
    # per row. Not the (B, nh, T, T) scores.
    assert est.saved == B * T * D * 4 + B * T * 3 * D * 4 + B * T * D * 4 + B * 4 * T * 4
    assert est.logits == 0  # the output is not (B, T, vocab) logits
