"""The GPT model, built from the capabilities its config names (GPT-2, Llama, Qwen2 style): a plain ``nn.Module``,
read top to bottom.

``CausalSelfAttention -> MLP -> SwiGLU -> Block -> GPT``. Float8 training, sharding and compilation are applied
from outside, so it stays plain PyTorch. The families share module names (``docs/model.md``)."""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.generation.sampling import generate
from lightning_gpuopt.generation.kv_cache import KVCache, padded_causal_mask
from lightning_gpuopt.model.loss import linear_cross_entropy
from lightning_gpuopt.model.rope import apply_rope, rope_cos_sin

__all__ = ["GPT", "KVCache", "grouped_heads_run_fused"]


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError(
            "GPTConfig(attention='flash-attn') needs the flash-attn package: "
            'pip install "lightning-gpuopt[flash]" (CUDA only), or use attention="sdpa".'
        ) from err
    return flash_attn_func


# cos and sin of the rotary angles of each position, from rope.rope_cos_sin: (T, hs/2) or (B, T, hs/2) each
Rope = tuple[Tensor, Tensor]


def grouped_heads_run_fused(dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA takes the grouped key/value heads as they are (``enable_gqa=True``), else repeated per query head.

    Only the Flash kernel takes grouped heads, and it runs fp16/bf16 without a mask; elsewhere ``enable_gqa`` would
    fall to the math kernel and its (T, T) scores (``docs/model.md``)."""
    return not masked and dtype in (torch.float16, torch.bfloat16)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_size = config.head_size
        self.dropout = config.dropout
        self.attention = config.attention
        self.fused_qkv = config.fused_qkv
        if config.fused_qkv:
            # query, key and value projections for all heads, in one matmul (as many key/value heads as queries)
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.qkv_bias)
        else:
            # one projection each (a tensor-parallel plan splits each by heads); keys and values have
            # n_kv_head heads, each shared by n_head / n_kv_head query heads (grouped-query attention)
            self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.qkv_bias)
            self.k_proj = nn.Linear(config.n_embd, config.kv_size, bias=config.qkv_bias)
            self.v_proj = nn.Linear(config.n_embd, config.kv_size, bias=config.qkv_bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.attn_out_bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self._flash_attn = _flash_attn_func() if config.attention == "flash-attn" else None

    def _qkv(self, x: Tensor, rope: Optional[Rope]) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, T, nh, hs), keys and values (B, T, n_kv_head, hs); queries and keys rotated by ``rope`` (rotary
        positions), after their biases are added (as Qwen2 does)."""
        B, T, C = x.shape
        if self.fused_qkv:
            q, k, v = self.c_attn(x).split(C, dim=2)
            shape = (B, T, self.n_head, self.head_size)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
        else:
            # heads counted from the projections' outputs (-1), so a tensor-parallel plan may split them by heads
            q = self.q_proj(x).view(B, T, -1, self.head_size)
            k = self.k_proj(x).view(B, T, -1, self.head_size)
            v = self.v_proj(x).view(B, T, -1, self.head_size)
        if rope is None:  # learned positions: added to the embeddings already
            return q, k, v
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def forward(
        self, x: Tensor, cache: Optional[KVCache] = None, rope: Optional[Rope] = None, mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``mask``: (B, 1, T, S) bool, ``True`` where a query may attend (``None``: causal over the cache);
        ``key_padding_mask``: (B, T) bool, ``False`` on padding among the new tokens."""
        B, T, C = x.shape
        q, k, v = self._qkv(x, rope)  # (B, T, nh or n_kv_head, hs)
        dropout = self.dropout if self.training else 0.0
        if self._flash_attn is not None and cache is None and mask is None:
            # flash-attn wants (B, T, nh, hs), and takes fewer key/value heads as they are
            y = self._flash_attn(q, k, v, dropout_p=dropout, causal=True)
            return self.resid_dropout(self.c_proj(y.reshape(B, T, -1)))

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
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
            k, v = cache.update(k, v, key_padding_mask)  # (B, n_kv_head, S, hs): grouped heads cached, not repeated
        gqa = {}
        if k.size(1) != q.size(1):  # grouped-query attention: n_head / n_kv_head query heads per key/value head
            if grouped_heads_run_fused(q.dtype, mask is not None):
                gqa = {"enable_gqa": True}  # each key/value head serves its group of query heads, no copies
            else:
                k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))  # (B, nh, ., hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, **gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_size, bias=config.mlp_bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.ffn_size, config.n_embd, bias=config.mlp_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020, arXiv:2002.05202): ``c_proj(silu(gate_proj(x)) * up_proj(x))``, ``ffn_size`` wide."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.ffn_size, config.n_embd, bias=config.mlp_bias)  # "down_proj" in Llama
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.norm_bias)
    return nn.RMSNorm(config.n_embd, eps=config.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` (LayerNorm or RMSNorm)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else MLP(config)

    def forward(
        self, x: Tensor, cache: Optional[KVCache] = None, rope: Optional[Rope] = None, mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, rope, mask, key_padding_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2, Llama or Qwen2 style language model (``config``'s capabilities): embeddings, ``n_layer`` pre-norm
    blocks, a final norm and an output head (tied to the token embedding unless ``config.tie_embeddings=False``).

    Example::

        model = GPT(GPTConfig.from_name("tiny"))      # or "llama-tiny", "qwen2-tiny"
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
                # learned positions (GPT-2); rotary ones turn queries and keys instead (model/rope.py)
                **({"wpe": nn.Embedding(config.block_size, config.n_embd)} if config.positions == "learned" else {}),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=_norm(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            # Weight tying (Press & Wolf, 2017): the output head reuses the token embedding.
            self.lm_head.weight = self.transformer.wte.weight
        # Compile the loss's per-chunk kernel (set by compile_blocks, or by hand).
        self.compile_loss = False
        # The full logits and F.cross_entropy inside the forward (a whole-model graph holds the loss; set by
        # model.compiling.compile_gpt); False: the loss from the hidden states, outside any graph (loss_from_hidden).
        self.loss_in_graph = False
        # Under autocast in this dtype (bf16), the residual stream between blocks is carried in it from the
        # embeddings on, as nanochat and modded-nanogpt do (half the bytes of every norm and residual add);
        # None: float32, as the embeddings' weights are (GPTModule.residual_dtype).
        self.residual_dtype: Optional[torch.dtype] = None
        # The chunked loss runs the head's GEMMs in float8 (linear_cross_entropy's head_float8): set by
        # Float8Precision where its timing says the head pays, through GPTModule.
        self.head_float8 = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (every family): N(0, 0.02) weights, zero biases, norm gains 1, and the residual
        projections ``c_proj`` scaled by 1/sqrt(2 * n_layer), so the residual stream's variance stays flat in depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights once); ``non_embedding`` leaves out the vocabulary-sized matrices and the
        position embedding (the usual "model size")."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            vocab = {id(p): p for p in (self.transformer.wte.weight, self.lm_head.weight)}  # one when tied
            n -= sum(p.numel() for p in vocab.values())
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len`` (``None``: ``block_size``):
        :meth:`GPTConfig.flops_per_token` (PaLM's ``6 N + 12 L H Q T``). MFU is computed from it."""
        return self.config.flops_per_token(seq_len)

    def forward(
        self, idx: Tensor, caches: Optional[list[KVCache]] = None, targets: Optional[Tensor] = None,
        input_pos: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Logits (B, T, padded_vocab_size) for token ids ``idx`` (B, T), or given ``targets`` the mean next-token loss
        without the full logits (:meth:`loss_from_hidden`).

        Args:
            idx: Token ids.
            caches: One ``KVCache`` per block, for incremental decoding.
            targets: Token ids (B, T) to predict; -1 marks a position without a target.
            input_pos: Position of each token, (B, T) or (T,); ``None``: counted from the cache (or 0), past padding.
            key_padding_mask: (B, T) bool, ``False`` on (left) padding, which no token attends to.
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
        if self.config.positions == "learned":
            x, rope = self.transformer.wte(idx) + self.transformer.wpe(input_pos), None
        else:  # the rotation angles of these positions, shared by every block
            x, rope = self.transformer.wte(idx), rope_cos_sin(
                input_pos, self.config.head_size, self.config.rope_theta, self.config.rope_scaling)
        x = self.transformer.drop(x)  # (B, T, C)
        if self.residual_dtype is not None and torch.is_autocast_enabled(x.device.type) \
                and torch.get_autocast_dtype(x.device.type) == self.residual_dtype:
            x = x.to(self.residual_dtype)  # each block's residual adds then stay in it (bf16 + bf16 outputs)
        for i, block in enumerate(self.transformer.h):
            cache = caches[i] if caches else None
            if self.config.checkpoints_block(i) and self.training and cache is None:
                x = checkpoint(block, x, None, rope, mask, use_reentrant=False)
            else:
                x = block(x, cache, rope, mask, key_padding_mask)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        if self.loss_in_graph:  # (B, T, V) logits: Inductor fuses the softmax into one pass in the same graph
            return self.loss(self.lm_head(x), targets)
        return self.loss_from_hidden(x, targets)

    # A whole-model compile ends its graph at the hidden states: the chunk loop runs eagerly (its length
    # follows the token count) around its own compiled kernel, so a new batch size recompiles nothing here.
    @torch.compiler.disable
    def loss_from_hidden(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy from the final hidden states (B, T, n_embd), one chunk of tokens at a time
        (:func:`~lightning_gpuopt.model.loss.linear_cross_entropy`); targets of -1 are ignored."""
        if type(self.lm_head) is not nn.Linear:  # a head a user's conversion replaced: called on the full logits
            return self.loss(self.lm_head(hidden), targets)
        return linear_cross_entropy(
            hidden, self.lm_head.weight, targets, ignore_index=-1, chunk_size=self.config.loss_chunk_size,
            impl=self.config.loss_impl, compile_chunk=self.compile_loss, head_float8=self.head_float8,
        )

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of full logits; targets equal to -1 are ignored (the reference
        that ``forward(idx, targets=targets)`` matches without materialising the logits)."""
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)

    def compile_blocks(self, mode: Optional[str] = None, backend: Union[str, Callable] = "inductor") -> None:
        """Compile each ``Block`` in place (state-dict keys stay plain) and the loss's per-chunk kernel: the blocks
        share one graph, so compile time does not grow with depth."""
        for block in self.transformer.h:
            block.compile(mode=mode, backend=backend)
        self.compile_loss = True

    def compile_whole(self, mode: Optional[str] = None, backend: Union[str, Callable] = "inductor") -> None:
        """Compile the whole model as one graph, in place, and the loss's per-chunk kernel."""
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
        """Continue a batch of prompts; see :func:`lightning_gpuopt.generation.sampling.generate`."""
        return generate(self, idx, max_new_tokens, temperature, top_k, use_cache, generator)
