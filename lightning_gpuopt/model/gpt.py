"""The GPT model: a plain ``nn.Module`` (no Lightning), read top to bottom.

``CausalSelfAttention -> MLP -> Block -> GPT`` (the decoding cache is ``kv_cache.KVCache``). Features such as float8 training or
compilation are applied to this model from outside; it stays plain PyTorch.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.generation import generate
from lightning_gpuopt.model.kv_cache import KVCache, padded_causal_mask
from lightning_gpuopt.model.loss import linear_cross_entropy

__all__ = ["GPT", "KVCache"]


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError(
            "GPTConfig(attention='flash-attn') needs the flash-attn package: "
            'pip install "lightning-gpuopt[flash]" (CUDA only), or use attention="sdpa".'
        ) from err
    return flash_attn_func


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_size = config.head_size
        self.dropout = config.dropout
        self.attention = config.attention
        # query, key and value projections for all heads, in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self._flash_attn = _flash_attn_func() if config.attention == "flash-attn" else None

    def forward(
        self, x: Tensor, cache: Optional[KVCache] = None, mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``mask``: boolean (B, 1, T, S), ``True`` where a query may attend (``None``: causal over the cache);
        ``key_padding_mask``: (B, T) bool, ``False`` on padding among the new tokens, recorded in the cache."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        dropout = self.dropout if self.training else 0.0
        if self._flash_attn is not None and cache is None and mask is None:
            # flash-attn wants (B, T, nh, hs)
            shape = (B, T, self.n_head, self.head_size)
            y = self._flash_attn(q.view(shape), k.view(shape), v.view(shape), dropout_p=dropout, causal=True)
            return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))

        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        if mask is not None:
            is_causal = False  # padding, or rows at different lengths: the mask says it all
        elif cache is None or cache.pos == 0:
            is_causal = True
        elif T == 1:
            is_causal = False  # one new token attends to every cached position
        else:
            # T new tokens after `cache.pos` cached ones: token i sees positions <= pos + i
            pos = cache.pos
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(diagonal=pos)
            is_causal = False
        if cache is not None:
            k, v = cache.update(k, v, key_padding_mask)  # (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cache: Optional[KVCache] = None, mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, mask, key_padding_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style language model.

    Token and position embeddings, ``n_layer`` pre-LN blocks, a final LayerNorm and an output head
    tied to the token embedding. Attention runs through ``F.scaled_dot_product_attention`` so
    PyTorch's Flash / cuDNN kernels are used on the GPU.

    Example::

        model = GPT(GPTConfig.from_name("tiny"))
        logits = model(torch.randint(0, 512, (2, 16)))  # (2, 16, padded_vocab_size)
        text_ids = model.generate(prompt_ids, max_new_tokens=50, temperature=0.8, top_k=50)

    Args:
        config: The architecture.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): the output head reuses the token embedding.
        self.lm_head.weight = self.transformer.wte.weight
        # Compile the loss's per-chunk kernel (set by compile_blocks, or by hand).
        self.compile_loss = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, and residual projections scaled
        by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights counted once).

        Args:
            non_embedding: Leave out the token and position embeddings (the usual "model size").
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs (forward + backward) per token: ``6 N + 12 L H Q T``.

        This is the formula of PaLM (Chowdhery et al., 2022, arXiv:2204.02311, Appendix B): ``N``
        parameters taking part in matmuls, each costing 2 FLOPs per token forward and 4 backward,
        plus the attention score and value matmuls, ``12 · n_layer · n_head · head_size · T``.
        ``N`` leaves out the position embedding (a lookup) but keeps the token embedding, which is
        also the output head's matmul weight. Causal masking is not discounted, as in PaLM. MFU is
        computed from this number.

        Args:
            seq_len: Sequence length ``T``; defaults to ``config.block_size``.
        """
        cfg = self.config
        T = cfg.block_size if seq_len is None else seq_len
        N = self.num_params() - self.transformer.wpe.weight.numel()
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * cfg.head_size * T

    def forward(
        self, idx: Tensor, caches: Optional[list[KVCache]] = None, targets: Optional[Tensor] = None,
        input_pos: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Logits of shape (B, T, padded_vocab_size) for token ids ``idx`` of shape (B, T), or, given
        ``targets``, the mean next-token loss (see :meth:`loss_from_hidden`).

        Args:
            idx: Token ids.
            caches: One ``KVCache`` per block, for incremental decoding (see ``generate``).
            targets: Token ids of shape (B, T) to predict; -1 marks a position without a target.
                With targets the full logits are never materialised.
            input_pos: Position of each token, (B, T) or (T,); ``None``: counted from the cache (or 0), skipping
                padding.
            key_padding_mask: (B, T) bool, ``False`` on padding tokens (prompts of different lengths, left-padded),
                which no token attends to. Each real token then gets what its row alone would.
        """
        B, T = idx.shape
        start = caches[0].pos if caches else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"Sequence of length {start + T} is longer than GPTConfig.block_size={self.config.block_size}: "
                "use shorter sequences or a model with a larger block_size."
            )
        mask = None
        if caches:
            mask = caches[0].attention_mask(B, T, key_padding_mask, idx.device)  # (B, 1, T, S) or None: causal
            if input_pos is None:
                input_pos = caches[0].next_positions(B, T, key_padding_mask, idx.device)
        elif key_padding_mask is not None:
            mask = padded_causal_mask(key_padding_mask, torch.arange(T, device=idx.device).expand(B, T))  # (B, 1, T, T)
            if input_pos is None:
                input_pos = (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T): real tokens before
        if input_pos is None:
            input_pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(input_pos))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            cache = caches[i] if caches else None
            if self.config.activation_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, None, mask, use_reentrant=False)
            else:
                x = block(x, cache, mask, key_padding_mask)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        return self.loss_from_hidden(x, targets)

    # A whole-model compile ends its graph at the hidden states: the chunk loop runs eagerly (its length
    # follows the token count) around its own compiled kernel, so a new batch size recompiles nothing here.
    @torch.compiler.disable
    def loss_from_hidden(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy from the final (normed) hidden states; targets of -1 are ignored.

        The head matmul and the loss run together, one chunk of tokens at a time
        (:func:`~lightning_gpuopt.model.loss.linear_cross_entropy`, ``config.loss_impl``,
        ``config.loss_chunk_size``), so no
        (B, T, vocab) float32 tensor is ever alive. A head that is no longer a plain ``nn.Linear``
        (replaced by a user's conversion) is called as it is, on the full logits.

        Args:
            hidden: (B, T, n_embd), the output of ``transformer.ln_f``.
            targets: (B, T) token ids.
        """
        if type(self.lm_head) is not nn.Linear:
            return self.loss(self.lm_head(hidden), targets)
        return linear_cross_entropy(
            hidden, self.lm_head.weight, targets, ignore_index=-1, chunk_size=self.config.loss_chunk_size,
            impl=self.config.loss_impl, compile_chunk=self.compile_loss,
        )

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of full logits; targets equal to -1 are ignored (the reference
        that ``forward(idx, targets=targets)`` matches without materialising the logits)."""
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)

    def compile_blocks(self, mode: Optional[str] = None, backend: Union[str, Callable] = "inductor") -> None:
        """Compile each ``Block`` on its own (in place, so state-dict keys stay plain) and the loss's
        per-chunk kernel: the blocks share one graph, so compile time does not grow with depth.

        Example::

            model = GPT(GPTConfig.from_name("124m"))
            model.compile_blocks()  # or model.compile() for one whole-model graph

        Args:
            mode: ``torch.compile`` mode (``None``: the default).
            backend: ``torch.compile`` backend.
        """
        for block in self.transformer.h:
            block.compile(mode=mode, backend=backend)
        self.compile_loss = True

    def compile_whole(self, mode: Optional[str] = None, backend: Union[str, Callable] = "inductor") -> None:
        """Compile the whole model as one graph, in place (the loss chunk is inside it).

        Args:
            mode: ``torch.compile`` mode (``None``: the default).
            backend: ``torch.compile`` backend.
        """
        self.compile(mode=mode, backend=backend)
        self.compile_loss = True

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        use_cache: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> Tensor:
        """Continue a batch of prompts; see :func:`lightning_gpuopt.model.generation.generate`."""
        return generate(self, idx, max_new_tokens, temperature, top_k, use_cache, generator)
