"""LightningModules around models written the way others write them, for tests of pieces that must work with any module.

* ``NanoGPTModule``: karpathy/nanoGPT's shape: ``forward(idx, targets=None)`` returns ``(logits, loss)``,
  and without targets computes the head for the last position only; tied embeddings; ``(x, y)`` batches.
* ``LlamaModule``: a Hugging Face ``LlamaForCausalLM`` shape: ``forward(input_ids, labels=None)``
  returns a dict with ``loss`` and ``logits``; RMSNorm, SwiGLU, untied head; dict batches.
* ``LitGPTModule``: litgpt's shape: ``forward(idx)`` returns logits for every position, grouped-query
  attention with a fused QKV projection, the loss computed in ``training_step``.

* ``HFLlamaModule`` and ``HFGPT2Module``: Hugging Face ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` as
  transformers writes them for a batch of ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on
  padding): the SDPA mask check reads the mask with ``.item()`` (``_ignore_causal_mask_sdpa``), a padded
  batch gets a 4-D boolean mask, GPT-2's ``Conv1D`` (``addmm`` with a ``(in, out)`` weight) and tied head;
  the step logs ``loss.item()``.
* ``TwoOptimizerModule``: manual optimisation with two optimizers (embeddings and head with AdamW, the
  blocks with SGD), one loss and one backward per batch; ``steps_per_batch = 2``.
* ``iterable_loader``: an ``IterableDataset`` of token rows batched by a custom ``collate_fn`` that
  pads and masks, as streaming pipelines write it.

* ``EncoderLM``: a plain ``nn.TransformerEncoder`` language model (no LightningModule), with its
  hand count in ``encoder_flops_per_token``.

All dimensions are multiples of 16. ``hand_flops_per_token`` is the PaLM count (6 FLOPs per matmul
weight per token, plus 12·L·d·T for attention) that the FLOPs tests compare against.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

VOCAB, D, LAYERS, HEADS, T = 256, 64, 2, 4, 32


class _Attention(nn.Module):
    def __init__(self, groups: int = HEADS, fused: bool = True, bias: bool = True):
        super().__init__()
        self.hs, self.groups = D // HEADS, groups
        out = (HEADS + 2 * groups) * self.hs
        self.qkv = nn.Linear(D, out, bias=bias)
        self.proj = nn.Linear(D, D, bias=bias)

    def forward(self, x):
        B, T_, _ = x.shape
        q, k, v = self.qkv(x).split([HEADS * self.hs, self.groups * self.hs, self.groups * self.hs], dim=-1)
        q = q.view(B, T_, HEADS, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T_, self.groups, self.hs).transpose(1, 2).repeat_interleave(HEADS // self.groups, dim=1)
        v = v.view(B, T_, self.groups, self.hs).transpose(1, 2).repeat_interleave(HEADS // self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T_, D))


class _Block(nn.Module):
    def __init__(self, llama: bool = False, groups: int = HEADS):
        super().__init__()
        norm = (lambda: nn.RMSNorm(D)) if llama else (lambda: nn.LayerNorm(D))
        self.ln1, self.ln2 = norm(), norm()
        self.attn = _Attention(groups, bias=not llama)
        self.llama = llama
        if llama:  # SwiGLU
            self.gate, self.up, self.down = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, 3 * D, bias=False), nn.Linear(3 * D, D, bias=False)
        else:
            self.fc, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        h = F.silu(self.gate(h)) * self.up(h) if self.llama else F.gelu(self.fc(h))
        return x + self.down(h)


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as in nanoGPT

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return self.lm_head(x[:, [-1], :]), None  # inference-time optimisation: the last position only


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(_Block(llama=True) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out


class LitGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(_Block(llama=True, groups=2) for _ in range(LAYERS))
        self.ln_f = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Base(pl.LightningModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class NanoGPTModule(_Base):
    def __init__(self):
        super().__init__()
        self.model = NanoGPT()

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss)
        return loss


class LlamaModule(_Base):
    def __init__(self):
        super().__init__()
        self.model = Llama()

    def forward(self, input_ids):
        return self.model(input_ids)

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]


class LitGPTModule(_Base):
    def __init__(self):
        super().__init__()
        self.model = LitGPT()

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        return {"loss": loss}


class NoForwardModule(_Base):
    """litgpt's model in a LightningModule that defines no ``forward`` of its own (the step calls the model)."""

    def __init__(self):
        super().__init__()
        self.model = LitGPT()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


class LoaderData(pl.LightningDataModule):
    """The same loader, given through a datamodule."""

    def __init__(self, shape: str, batch_size: int = 4, n: int = 32):
        super().__init__()
        self.shape, self.batch_size, self.n = shape, batch_size, n

    def train_dataloader(self):
        if self.shape == "iterable-collate":
            return iterable_loader(self.batch_size, self.n)
        return shape_loader(self.shape, self.batch_size, self.n)


class _Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: a linear layer with its weight stored ``(in, out)``, applied with ``addmm``."""

    def __init__(self, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


def _hf_mask(attention_mask, T_: int):
    """transformers' SDPA mask: ``None`` when nothing is padded (a host read, as ``_ignore_causal_mask_sdpa``
    does), else a 4-D boolean causal-and-padding mask ``(B, 1, T, T)``."""
    if attention_mask is None or bool((attention_mask == 1).all().item()):
        return None
    causal = torch.ones(T_, T_, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask[:, None, None, :].bool()


class _HFAttention(nn.Module):
    def __init__(self, gpt2: bool):
        super().__init__()
        self.hs, self.gpt2 = D // HEADS, gpt2
        if gpt2:
            self.c_attn, self.c_proj = _Conv1D(3 * D, D), _Conv1D(D, D)
        else:
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, mask):
        B, T_, _ = x.shape
        q, k, v = self.c_attn(x).split(D, dim=-1) if self.gpt2 else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.view(B, T_, HEADS, self.hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        y = y.transpose(1, 2).reshape(B, T_, D)
        return self.c_proj(y) if self.gpt2 else self.o_proj(y)


class _HFBlock(nn.Module):
    def __init__(self, gpt2: bool):
        super().__init__()
        norm = (lambda: nn.LayerNorm(D)) if gpt2 else (lambda: nn.RMSNorm(D))
        self.ln_1, self.ln_2, self.attn, self.gpt2 = norm(), norm(), _HFAttention(gpt2), gpt2
        if gpt2:
            self.c_fc, self.c_proj = _Conv1D(4 * D, D), _Conv1D(D, 4 * D)
        else:  # SwiGLU
            self.gate_proj, self.up_proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, 3 * D, bias=False)
            self.down_proj = nn.Linear(3 * D, D, bias=False)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        h = self.ln_2(x)
        h = self.c_proj(F.gelu(self.c_fc(h))) if self.gpt2 else self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + h


class HFCausalLM(nn.Module):
    """``LlamaForCausalLM`` (``gpt2=False``) or ``GPT2LMHeadModel`` (``gpt2=True``) as transformers computes them."""

    def __init__(self, gpt2: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T, D) if gpt2 else None
        self.layers = nn.ModuleList(_HFBlock(gpt2) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D) if gpt2 else nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        if gpt2:
            self.lm_head.weight = self.embed_tokens.weight  # tied, as GPT2LMHeadModel

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed_tokens(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        mask = _hf_mask(attention_mask, input_ids.shape[1])
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.lm_head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:  # shifted inside the model; -100 is ignored
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return out


class HFLlamaModule(_Base):
    gpt2 = False

    def __init__(self):
        super().__init__()
        self.model = HFCausalLM(gpt2=self.gpt2)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)["loss"]
        self.log("train_loss", loss.item())  # a host read in the step, as many modules do
        return loss


class HFGPT2Module(HFLlamaModule):
    gpt2 = True


class TwoOptimizerModule(_Base):
    """Manual optimisation with two optimizers over one loss: AdamW for embeddings and head, SGD for the blocks."""

    steps_per_batch = 2  # trainer.global_step counts every optimizer's step

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.model = LitGPT()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        blocks = list(self.model.h.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.model.parameters() if id(p) not in ids]
        return torch.optim.AdamW(rest, lr=1e-3), torch.optim.SGD(blocks, lr=1e-2)


SHAPES = {"nanogpt": NanoGPTModule, "llama": LlamaModule, "litgpt": LitGPTModule}
MORE_SHAPES = {"hf-llama-mask": HFLlamaModule, "hf-gpt2-mask": HFGPT2Module, "two-optimizers": TwoOptimizerModule}
"""Shapes that need a loader of their own (``shape_loader``): a padded, masked batch, or two optimizers."""


def hand_flops_per_token(module: pl.LightningModule, seq_len: int = T) -> int:
    """PaLM's count: 6 FLOPs per matmul weight (each shared one once) per token, plus 12·L·d·T for attention."""
    weights = {id(m.weight): m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, _Conv1D))}
    return 6 * sum(weights.values()) + 12 * LAYERS * D * seq_len


class Tokens(Dataset):
    """``n`` samples of ``seq_len + 1`` random tokens, as ``(x, y)`` or a Hugging Face-style dict."""

    def __init__(self, n: int = 32, seq_len: int = T, as_dict: bool = False):
        self.data = torch.randint(0, VOCAB, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.as_dict = as_dict

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if self.as_dict:
            return {"input_ids": self.data[i, :-1], "labels": self.data[i, :-1]}
        return self.data[i, :-1], self.data[i, 1:]


class _Padded(Dataset):
    """Hugging Face-style samples: ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on padding);
    every other sample ends in ``T // 4`` padding positions."""

    def __init__(self, n: int = 32):
        self.data = Tokens(n).data[:, :-1]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        mask = torch.ones(T, dtype=torch.long)
        if i % 2:
            mask[-T // 4:] = 0
        return {"input_ids": self.data[i] * mask, "attention_mask": mask, "labels": self.data[i].masked_fill(mask == 0, -100)}


def shape_loader(shape: str, batch_size: int = 4, n: int = 32) -> DataLoader:
    if shape.startswith("hf-"):
        return DataLoader(_Padded(n), batch_size=batch_size)
    return DataLoader(Tokens(n, as_dict=shape == "llama"), batch_size=batch_size)


class TokenStream(IterableDataset):
    """``n`` rows of ``T + 1`` tokens, streamed one at a time (no ``__len__``, no index)."""

    def __init__(self, n: int = 32):
        self.data = Tokens(n).data

    def __iter__(self):
        return iter(self.data)


def collate_rows(rows):
    """A streaming pipeline's own collate: a list of token rows -> ``(x, y)`` shifted by one."""
    stacked = torch.stack(list(rows))
    return stacked[:, :-1], stacked[:, 1:]


def iterable_loader(batch_size: int = 4, n: int = 32) -> DataLoader:
    """An ``IterableDataset`` batched by a custom ``collate_fn``: the nanoGPT/litgpt ``(x, y)`` batch."""
    return DataLoader(TokenStream(n), batch_size=batch_size, collate_fn=collate_rows)


class EncoderLM(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` and a linear head: a model written with torch's own layers."""

    def __init__(self, vocab: int = 128, d: int = 64, dff: int = 256, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, dff, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


def encoder_flops_per_token(vocab: int = 128, d: int = 64, dff: int = 256, layers: int = 2, seq: int = T) -> int:
    """Training FLOPs per token of ``EncoderLM`` by hand (biases and LayerNorms not counted)."""
    # per token: 2 FLOPs per matmul weight forward, 4 backward; attention QK^T and AV: 2*2*T*d forward, x3
    return 6 * (layers * (4 * d * d + 2 * d * dff) + d * vocab) + 12 * layers * d * seq
