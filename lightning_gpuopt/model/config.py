"""`GPTConfig`: the architecture of a GPT model, with validation and named presets."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional, Union

from lightning_gpuopt.option_checks import check_bool, check_choice, check_int, check_number, option
from lightning_gpuopt.model.loss import LOSS_IMPLS, LossImpl
from lightning_gpuopt.model.rope import check_rope_scaling
from lightning_gpuopt.perf.device import DeviceFacts

__all__ = [
    "ActivationCheckpointing",
    "GPTConfig",
    "PRESETS",
    "check_attention_runs",
    "check_data_fits",
    "llama_ffn_size",
]

Attention = Literal["sdpa", "flash-attn"]
# Which blocks recompute their activations in the backward: none (False), every block (True or "full": ~1/3 more
# compute), or every other block ("selective": the second of each pair, as torchtitan's layer-selective mode at
# frequency 2; ~1/6 more compute, about half the activation memory).
ActivationCheckpointing = Union[bool, Literal["selective", "full"]]
Arch = Literal["gpt2", "llama", "qwen2"]
Positions = Literal["learned", "rotary"]
Norm = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "swiglu"]

# The one place a family's name becomes the capabilities the code asks (docs/architecture.md, "A model
# architecture"): each family's value of every capability field a GPTConfig leaves at None. `bias` stands for the
# four bias fields not given one by one; "flops" is how flops_per_token counts the weights N. No other module
# tests `arch` (tests/test_architecture.py checks).
_FAMILIES: dict[str, dict[str, Any]] = {
    # GPT-2 (Radford et al., 2019): learned positions, LayerNorm, one fused c_attn, GELU MLP, biases everywhere
    "gpt2": dict(positions="learned", norm="layernorm", mlp="gelu", fused_qkv=True, bias=True, flops="parameters"),
    # Llama (Touvron et al., 2023; Llama 3): rotary positions, RMSNorm, q/k/v_proj (grouped-query), SwiGLU, no bias
    "llama": dict(
        positions="rotary", norm="rmsnorm", mlp="swiglu", fused_qkv=False, bias=False, rope_theta=10000.0,
        multiple_of=256, flops="matmuls",
    ),
    # Qwen2 (Yang et al., 2024, arXiv:2407.10671; transformers' Qwen2ForCausalLM): Llama's, with a bias on the
    # query, key and value projections only (added before the rotation), and rotary base 1,000,000 (Qwen2.5)
    "qwen2": dict(
        positions="rotary", norm="rmsnorm", mlp="swiglu", fused_qkv=False, bias=False, qkv_bias=True,
        rope_theta=1000000.0, multiple_of=256, flops="matmuls",
    ),
}
_BIASES = ("qkv_bias", "attn_out_bias", "mlp_bias", "norm_bias")
# Activation elements a block keeps per token for its backward, (n_embd, kv, ffn) coefficients by MLP: SwiGLU's
# measured within 2% at the llama-1b and llama-8b shapes; GELU's is Korthikanti et al.'s 17 n_embd (34 bytes in
# 16-bit; arXiv:2205.05198) at GPT-2's kv = n_embd and ffn = 4 n_embd (tests/strategies/test_choose.py).
_ACTIVATION_TERMS = {"swiglu": (9, 2, 4), "gelu": (7, 2, 2)}
# Our module names -> transformers' (GPT2LMHeadModel; LlamaForCausalLM and Qwen2ForCausalLM share theirs), for
# hf_names; "{i}" is a block's index. GPT-2's Conv1D layers store their weights transposed (hf_transposed).
_HF_LLAMA = {
    "transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head",
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj", "attn.c_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj",
}
_HF_NAMES = {
    "gpt2": (
        {n: n for n in ("transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head", "ln_1", "ln_2",
                        "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
        "transformer.h.{i}", ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    ),
    "llama": (_HF_LLAMA, "model.layers.{i}", ()),
    "qwen2": (_HF_LLAMA, "model.layers.{i}", ()),
}

# Llama 3's shapes, from the Hugging Face config.json of each model (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, rope_theta, vocab_size, tie_word_embeddings):
# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json, .../Llama-3.2-3B/...,
# .../Meta-Llama-3.1-8B/... and .../Meta-Llama-3.1-70B/... (litgpt/config.py lists the same). The widths of
# the MLP come from Meta's rule (llama_ffn_size) with Meta's ffn_dim_multiplier and multiple_of (their
# params.json; torchtitan's llama3 configs for 8B and 70B), and give those intermediate sizes: 8192, 8192,
# 14336, 28672 (tested). block_size is the 8,192-token context Llama 3 was pre-trained at; the released
# models' 128K comes from a later long-context phase (its rope_scaling, left out of the presets:
# GPTConfig.rope_scaling).
_LLAMA3 = dict(arch="llama", vocab_size=128256, block_size=8192, rope_theta=500000.0, norm_eps=1e-5)

# Named architectures. The GPT-2 family sizes (124m ... 1.5b) follow Radford et al. (2019); 175m is
# the GPT-3 "small-wide" shape used by many recipes (d1024 with 12 layers). The llama-* presets are
# Llama 3 shapes (above): llama-1b and llama-3b are Llama 3.2 1B and 3B (output head tied), llama-8b is
# Llama 3.1 8B and llama-70b Llama 3.1 70B (untied), the last for planning and meta-device tests.
# qwen2-0.5b is Qwen2.5-0.5B (https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json: hidden_size 896,
# 24 layers, 14 query and 2 key/value heads, intermediate_size 4864, rms_norm_eps 1e-6, rope_theta 1e6, tied,
# 32,768 positions; 494,032,768 parameters, tested). `tiny`, `llama-tiny` and `qwen2-tiny` are for tests and CPU
# runs: every dimension is a multiple of 16 so float8 conversion really happens on them.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512),
    "124m": dict(n_layer=12, n_head=12, n_embd=768),
    "175m": dict(n_layer=12, n_head=16, n_embd=1024),
    "355m": dict(n_layer=24, n_head=16, n_embd=1024),
    "774m": dict(n_layer=36, n_head=20, n_embd=1280),
    "1.5b": dict(n_layer=48, n_head=25, n_embd=1600),
    # ffn_size 176 (Llama 3's rule at multiple_of 16), head_size 16, 2 key/value heads for 4 query heads
    "llama-tiny": dict(
        arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=128, vocab_size=512, multiple_of=16
    ),
    "llama-1b": dict(_LLAMA3, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_dim_multiplier=1.5, multiple_of=256),
    "llama-3b": dict(_LLAMA3, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, ffn_dim_multiplier=1.0, multiple_of=256),
    "llama-8b": dict(
        _LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_dim_multiplier=1.3, multiple_of=1024,
        tie_embeddings=False,
    ),
    "llama-70b": dict(
        _LLAMA3, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, ffn_dim_multiplier=1.3, multiple_of=4096,
        tie_embeddings=False,
    ),
    # head_size 16, 2 key/value heads for 4 query heads, SwiGLU 160, biases on q/k/v
    "qwen2-tiny": dict(
        arch="qwen2", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=128, vocab_size=512,
        intermediate_size=160, norm_eps=1e-6,
    ),
    "qwen2-0.5b": dict(
        arch="qwen2", n_layer=24, n_head=14, n_kv_head=2, n_embd=896, block_size=32768, vocab_size=151936,
        intermediate_size=4864, norm_eps=1e-6,
    ),
}

# The options that need a capability, with it (and the value a config with that capability takes when not given).
_NEEDS = {
    "rope_theta": ("positions", "rotary", 10000.0), "rope_scaling": ("positions", "rotary", None),
    "ffn_dim_multiplier": ("mlp", "swiglu", None),
    "multiple_of": ("mlp", "swiglu", 256),
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def llama_ffn_size(n_embd: int, ffn_dim_multiplier: Optional[float], multiple_of: int) -> int:
    """Hidden width of a Llama 3 SwiGLU MLP (Meta's rule): two thirds of ``4 * n_embd`` (three matrices at GPT-2's
    two's cost), times ``ffn_dim_multiplier``, rounded up to a multiple of ``multiple_of``.

    Example::

        >>> llama_ffn_size(4096, 1.3, 1024), llama_ffn_size(2048, 1.5, 256)
        (14336, 8192)
    """
    hidden = int(2 * 4 * n_embd / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return _round_up(hidden, multiple_of)


@dataclass
class GPTConfig:
    """Architecture of a decoder-only transformer: a family (``arch``: GPT-2 style, the default, Llama or Qwen2
    style) and the capabilities the code asks (positions, norm, MLP, biases, fused QKV, key/value heads).

    The fields: ``docs/model.md``. A capability left at ``None`` takes the family's value; ``padded_vocab_size``,
    ``head_size`` and ``ffn_size`` are derived, in ``__post_init__``. Every architecture-dependent fact is a method
    of the config (``flops_per_token``, ``activation_elements``, ``tensor_parallel_plan``, ``hf_names``, ...).

    Example::

        config = GPTConfig.from_name("124m", vocab_size=8192, block_size=512)
        tiny = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256)
        llama = GPTConfig.from_name("llama-1b", vocab_size=32768, block_size=2048)
        small_llama = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=256)
        qwen_like = GPTConfig(arch="llama", qkv_bias=True, rope_theta=1e6)  # what arch="qwen2" is
    """

    n_layer: int = 12
    n_head: int = 12  # must divide n_embd
    n_embd: int = 768
    block_size: int = 1024  # the longest sequence the model takes
    vocab_size: int = 50257  # the tokenizer's; the embedding is padded up to padded_vocab_size
    dropout: float = 0.0  # attention and residual paths; 0 for pre-training
    bias: Optional[bool] = None  # the four bias fields below where not given one by one; None: the family's
    # "sdpa": F.scaled_dot_product_attention picks its Flash / cuDNN / memory-efficient kernel; "flash-attn": the
    # flash-attn package (compute capability >= 8.0, fp16/bf16: check_attention_runs at GPTModule.setup)
    attention: Attention = "sdpa"
    activation_checkpointing: ActivationCheckpointing = False  # recompute blocks in the backward (above)
    padding_multiple: int = 64  # matmuls with dimensions multiples of 64 run on the fastest tensor-core kernels
    # "chunked": the head matmul and the loss together, no full logits (any device); "liger": Liger-Kernel (CUDA,
    # the liger extra); "plain": full float32 logits, the reference; "auto": "chunked" (docs/model.md, "The loss")
    loss_impl: LossImpl = "auto"
    # Tokens per chunk; None: as many as fit 512 MiB (loss.chunk_tokens), or, in a GPTModule, chosen at setup
    # from the free memory and saved with the checkpoints (loss.run_chunk_tokens)
    loss_chunk_size: Optional[int] = None
    # The family, saved with checkpoints by its preset: "gpt2", "llama" or "qwen2" (_FAMILIES: its capabilities).
    arch: Arch = "gpt2"
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention), must divide n_head; None: n_head
    tie_embeddings: bool = True  # the head shares the token embedding (GPT-2, Llama 3.2 1B/3B; not 3.1 8B/70B)
    norm_eps: float = 1e-5  # of every LayerNorm / RMSNorm
    intermediate_size: Optional[int] = None  # the MLP's width, given outright; None: 4 n_embd (GELU), the rule (SwiGLU)
    ffn_dim_multiplier: Optional[float] = None  # scales the SwiGLU rule's 8/3 * n_embd (1.3 in Llama 3 8B/70B)
    multiple_of: Optional[int] = None  # the SwiGLU rule rounds the width up to this (None: 256)
    rope_theta: Optional[float] = None  # base of the rotary angles (None: the family's; Llama 3: 500,000)
    # Llama 3.1/3.2's scaling of the rotary frequencies ("llama3": model/rope.py's LLAMA3_SCALING_KEYS); None: none
    rope_scaling: Optional[dict[str, float]] = None
    # The capabilities; None: the family's.
    positions: Optional[Positions] = None  # "learned" (transformer.wpe) or "rotary" (queries and keys turned)
    norm: Optional[Norm] = None  # "layernorm" or "rmsnorm", before attention, before the MLP and at the end
    mlp: Optional[MLPKind] = None  # "gelu": c_proj(gelu(c_fc(x))); "swiglu": c_proj(silu(gate_proj(x)) * up_proj(x))
    fused_qkv: Optional[bool] = None  # one attn.c_attn (GPT-2), or attn.q_proj, k_proj, v_proj
    qkv_bias: Optional[bool] = None  # bias on the query, key and value projections (Qwen2: on these only)
    attn_out_bias: Optional[bool] = None  # bias on the attention's output projection attn.c_proj
    mlp_bias: Optional[bool] = None  # bias on the MLP's projections
    norm_bias: Optional[bool] = None  # bias of LayerNorm (RMSNorm has none)
    # Derived in __post_init__.
    padded_vocab_size: int = dataclasses.field(init=False)
    head_size: int = dataclasses.field(init=False)
    ffn_size: int = dataclasses.field(init=False)  # the MLP's width: 4 * n_embd for GPT-2

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "padding_multiple", "loss_chunk_size"):
            check_int("GPTConfig", name, getattr(self, name), minimum=1, optional=name == "loss_chunk_size")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"choose n_head from {divisors} or change n_embd to a multiple of {self.n_head}."
            )
        check_number("GPTConfig", "dropout", self.dropout, low=0, high=1, high_open=True)
        check_choice("GPTConfig", "attention", self.attention, ("sdpa", "flash-attn"))
        if self.activation_checkpointing not in (False, True, "selective", "full"):
            raise ValueError(
                "GPTConfig.activation_checkpointing must be false, true (every block: 'full') or 'selective' (every "
                f"other block), got {self.activation_checkpointing!r}."
            )
        if self.attention == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
            # Checked here, when the config is built, not when the model is (after data preparation).
            raise ImportError(
                "GPTConfig(attention='flash-attn') needs the flash-attn package: "
                f'pip install "lightning-gpuopt[flash]" (CUDA only), or use {option("GPTModule", "attention", "sdpa")}.'
            )
        check_choice("GPTConfig", "loss_impl", self.loss_impl, LOSS_IMPLS)
        if self.loss_impl == "liger" and importlib.util.find_spec("liger_kernel") is None:
            raise ImportError(
                "GPTConfig(loss_impl='liger') needs Liger-Kernel: pip install \"lightning-gpuopt[liger]\" "
                f"(CUDA only), or use {option('GPTModule', 'loss_impl', 'chunked')}."
            )
        self.head_size = self.n_embd // self.n_head
        self.padded_vocab_size = _round_up(self.vocab_size, self.padding_multiple)
        self._check_architecture()

    def _check_architecture(self) -> None:
        """Check the family and the capabilities; fill in those left at ``None`` and derive ``ffn_size``."""
        check_choice("GPTConfig", "arch", self.arch, tuple(_FAMILIES))
        family = _FAMILIES[self.arch]
        for name, choices in (("positions", ("learned", "rotary")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu"))):
            check_choice("GPTConfig", name, getattr(self, name), choices, optional=True)
        for name in ("fused_qkv", "bias", *_BIASES):
            if getattr(self, name) is not None:
                check_bool("GPTConfig", name, getattr(self, name))
        for name in ("n_kv_head", "intermediate_size", "multiple_of"):
            check_int("GPTConfig", name, getattr(self, name), minimum=1, optional=True)
        for name in ("norm_eps", "ffn_dim_multiplier", "rope_theta"):
            check_number("GPTConfig", name, getattr(self, name), low=0, low_open=True, optional=True)
        check_rope_scaling(self.rope_scaling)
        for name in ("positions", "norm", "mlp", "fused_qkv"):
            if getattr(self, name) is None:
                setattr(self, name, family[name])
        if self.norm == "rmsnorm" and self.norm_bias:
            raise ValueError(
                "GPTConfig.norm_bias=True: RMSNorm has no bias. Use norm='layernorm', or leave norm_bias out."
            )
        for name in _BIASES:  # given one by one, else `bias`, else the family's own, else the family's `bias`
            if getattr(self, name) is None:
                given = self.bias if self.bias is not None else family.get(name, family["bias"])
                setattr(self, name, given and not (name == "norm_bias" and self.norm == "rmsnorm"))
        self.bias = family["bias"] if self.bias is None else self.bias
        self._refuse_options_without_their_capability()
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head != 0:
            divisors = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: each key/value head "
                f"serves an equal group of query heads. Choose n_kv_head from {divisors}."
            )
        if self.positions == "rotary" and self.head_size % 2 != 0:
            raise ValueError(
                f"GPTConfig.n_embd / n_head = {self.head_size} is odd, and rotary embeddings (positions='rotary') "
                "turn pairs of a head's entries: choose n_embd and n_head with an even head size (a multiple of 16 is "
                "fastest)."
            )
        if self.intermediate_size is not None and self.ffn_dim_multiplier is not None:
            raise ValueError(
                f"GPTConfig.intermediate_size={self.intermediate_size} and "
                f"ffn_dim_multiplier={self.ffn_dim_multiplier} both set the MLP's width: give intermediate_size "
                "alone (the width), or ffn_dim_multiplier (and multiple_of) for Llama 3's rule."
            )
        for name, (capability, value, default) in _NEEDS.items():
            if getattr(self, name) is None and getattr(self, capability) == value:
                setattr(self, name, family.get(name, default))
        if self.intermediate_size is not None:
            self.ffn_size = self.intermediate_size
        elif self.mlp == "swiglu":
            self.ffn_size = llama_ffn_size(self.n_embd, self.ffn_dim_multiplier, self.multiple_of)
        else:
            self.ffn_size = 4 * self.n_embd

    def _refuse_options_without_their_capability(self) -> None:
        """Options given to a config without the capability they need (``rope_theta`` with learned positions, ...)."""
        needs = {name: f"{capability}={value!r}" for name, (capability, value, _) in _NEEDS.items()
                 if getattr(self, name) is not None and getattr(self, capability) != value}
        if self.n_kv_head not in (None, self.n_head) and self.fused_qkv:
            needs = {"n_kv_head": "fused_qkv=False", **needs}  # a fused c_attn has as many key/value heads as queries
        if needs:
            named = " and ".join(f"{name} needs {need}" for name, need in needs.items())
            raise ValueError(
                f"GPTConfig.{named}, which this config (arch={self.arch!r}) does not have: set "
                f"{'it' if len(needs) == 1 else 'them'} (a Llama-style family: arch='llama' or a llama-* / qwen2-* "
                f"preset), or leave {', '.join(needs)} out."
            )

    # ----------------------------------------------------------------------------- what the code asks the architecture
    @property
    def kv_size(self) -> int:
        """Width of the key and of the value projection: ``n_kv_head * head_size``."""
        return self.n_kv_head * self.head_size

    def _block_params(self) -> tuple[int, int]:
        """Matmul weights and other parameters (biases, norm gains) of one block."""
        C, f, kv = self.n_embd, self.ffn_size, self.kv_size
        mlp_in = 2 if self.mlp == "swiglu" else 1  # gate_proj and up_proj, or c_fc
        weights = C * (C + 2 * kv) + C * C + (mlp_in + 1) * C * f
        biases = self.qkv_bias * (C + 2 * kv) + self.attn_out_bias * C + self.mlp_bias * (mlp_in * f + C)
        return weights, biases + 2 * self._norm_params()

    def _norm_params(self) -> int:
        return self.n_embd * (2 if self.norm_bias else 1)

    def num_params(self) -> int:
        """Parameters of ``GPT(config)``, a tied weight once: what ``GPT.num_params()`` counts, without a model."""
        weights, other = self._block_params()
        vocab = self.padded_vocab_size * self.n_embd * (1 if self.tie_embeddings else 2)
        positions = self.block_size * self.n_embd if self.positions == "learned" else 0
        return self.n_layer * (weights + other) + self._norm_params() + vocab + positions

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len`` (``None``: ``block_size``).

        PaLM's ``6 N + 12 L H Q T`` (Chowdhery et al., 2022, arXiv:2204.02311, Appendix B): 2 FLOPs per matmul
        weight forward and 4 backward, plus the attention score and value matmuls of the query heads; causal
        masking is not discounted. MFU is computed from it."""
        T = self.block_size if seq_len is None else seq_len
        if _FAMILIES[self.arch]["flops"] == "parameters":
            # every parameter but the position embedding (a lookup), as nanoGPT counts GPT-2's: biases and LayerNorm
            # gains included (1.5% of the FLOPs at width 64)
            N = self.num_params() - (self.block_size * self.n_embd if self.positions == "learned" else 0)
        else:  # exactly the matmul weights: an untied token embedding (a lookup) and the norm gains left out
            N = self.n_layer * self._block_params()[0] + self.padded_vocab_size * self.n_embd
        return 6 * N + 12 * self.n_layer * self.n_head * self.head_size * T

    def activation_elements(self) -> int:
        """Activation elements one block keeps per token for its backward (16-bit elements; ``docs/parallel.md``)."""
        h, kv, f = _ACTIVATION_TERMS[self.mlp]
        return h * self.n_embd + kv * self.kv_size + f * self.ffn_size

    def activation_formula(self) -> str:
        """``activation_elements`` as the memory estimate prints it, e.g. ``9 n_embd + 2 kv + 4 ffn`` (SwiGLU MLP)."""
        h, kv, f = _ACTIVATION_TERMS[self.mlp]
        return f"{h} n_embd + {kv} kv + {f} ffn"

    def tensor_parallel_refusal(self) -> Optional[str]:
        """Why tensor parallelism cannot split this architecture, naming the fix; ``None``: it can
        (:meth:`tensor_parallel_plan`)."""
        problems = []
        if self.fused_qkv:
            problems.append("GPT-2's fused c_attn projection cannot be split into whole heads (fused_qkv=True)")
        if self.positions == "learned":
            problems.append("the learned position embedding is not in the plan (positions='learned')")
        if not problems:
            return None
        return (f"{' and '.join(problems)}. Use separate projections and rotary positions (fused_qkv=False, "
                "positions='rotary': a llama-* or qwen2-* preset)")

    def tensor_parallel_plan(self) -> dict[str, tuple[tuple[str, ...], str]]:
        """Per block, what tensor parallelism splits: ``{sub-module: (its layers split by output rows, which read
        its gathered input; its layer split by input columns)}`` (``model/tensor_parallel.py`` applies it)."""
        if self.tensor_parallel_refusal():
            raise ValueError(f"Tensor parallelism cannot split this architecture: {self.tensor_parallel_refusal()}.")
        mlp_in = ("gate_proj", "up_proj") if self.mlp == "swiglu" else ("c_fc",)
        return {"attn": (("q_proj", "k_proj", "v_proj"), "c_proj"), "mlp": (mlp_in, "c_proj")}

    def tensor_parallel_splits(self) -> dict[str, int]:
        """The sizes each tensor-parallel rank takes an equal share of: heads, key/value heads, MLP and vocabulary."""
        return {"n_head": self.n_head, "n_kv_head": self.n_kv_head, "ffn_size": self.ffn_size,
                "padded_vocab_size": self.padded_vocab_size}

    def hf_names(self, keys: Iterable[str]) -> dict[str, str]:
        """The Hugging Face ``transformers`` name of each of ``keys`` (``GPT(config).state_dict()``'s), for the
        family's model class (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``); a ``ValueError`` for
        a key that class does not have (capabilities changed from the family's). Weights of ``hf_transposed``
        are stored transposed there (GPT-2's ``Conv1D``)."""
        names, block, _ = _HF_NAMES[self.arch]
        out = {}
        for key in keys:
            module, _, param = key.rpartition(".")
            parts = module.split(".")
            if module.startswith("transformer.h."):  # transformer.h.{i}.<name>
                mapped, prefix = names.get(".".join(parts[3:])), block.format(i=parts[2]) + "."
            else:
                mapped, prefix = names.get(module), ""
            if mapped is None:
                raise ValueError(f"{key!r} has no counterpart in transformers' {self.arch} model: this config's "
                                 f"capabilities differ from the family's (arch={self.arch!r}).")
            out[key] = f"{prefix}{mapped}.{param}"
        return out

    def hf_transposed(self, key: str) -> bool:
        """Whether ``transformers`` stores the weight ``key`` (one of ours) transposed: GPT-2's ``Conv1D`` layers."""
        module, _, param = key.rpartition(".")
        return param == "weight" and module.startswith("transformer.h.") and (
            ".".join(module.split(".")[3:]) in _HF_NAMES[self.arch][2])

    def checkpoints_block(self, index: int) -> bool:
        """Whether block ``index`` recomputes its activations in the backward (``activation_checkpointing``)."""
        mode = self.activation_checkpointing
        return mode in (True, "full") or (mode == "selective" and index % 2 == 1)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build a config from a preset name (one of ``PRESETS``), with any ``GPTConfig`` field overridden.

        Example::

            GPTConfig.from_name("774m", block_size=2048, activation_checkpointing=True)
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}: choose one of {sorted(PRESETS)}.")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls) if f.init}
        if unknown:
            raise ValueError(f"Unknown GPTConfig field(s) {sorted(unknown)} passed to GPTConfig.from_name({name!r}).")
        return cls(**{**PRESETS[name], **overrides})


def check_data_fits(config: GPTConfig, data_vocab_size: Any = None, data_block_size: Any = None) -> None:
    """Raise ``ValueError`` naming the settings to change when the data's tokens or sequences (``None``: not known)
    do not fit the model."""
    if data_vocab_size is not None and data_vocab_size > config.vocab_size:
        raise ValueError(
            f"The data's tokenizer has {data_vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}: set model.vocab_size >= {data_vocab_size} (the gpuopt CLI links it "
            "from data.vocab_size), or use a tokenizer with fewer tokens."
        )
    if data_block_size is not None and data_block_size > config.block_size:
        raise ValueError(
            f"The data's block_size={data_block_size} is longer than the model's block_size={config.block_size}: "
            f"set model.block_size >= {data_block_size} or data.block_size <= {config.block_size}."
        )


# The dtypes flash-attn's kernels take: fp16 and bf16 (under float8 training attention runs in bf16 autocast).
_FLASH_ATTN_DTYPES = ("bf16", "fp16", "fp8")


def check_attention_runs(config: GPTConfig, facts: DeviceFacts, dtype: Optional[str]) -> None:
    """Raise ``ValueError`` naming the fix when ``attention="flash-attn"`` cannot run on this device and precision
    (compute capability >= 8.0, fp16 or bf16), before its first call would fail.

    Args:
        config: The model's configuration (only ``attention="flash-attn"`` is checked).
        facts: The training device (:func:`~lightning_gpuopt.perf.device.training_device`).
        dtype: The precision plugin's compute dtype name (``compute_dtype_name``); ``None`` when unknown.
    """
    if config.attention != "flash-attn":
        return
    if not facts.flash_attention:
        raise ValueError(
            f"GPTConfig(attention='flash-attn') needs a CUDA GPU of compute capability 8.0 or newer (A100, L4, "
            f"H100), and this run's device is {facts.describe()}: use {option('GPTModule', 'attention', 'sdpa')}, "
            "which picks a kernel this device has."
        )
    if dtype is None:
        warnings.warn(
            "GPTConfig(attention='flash-attn') runs in fp16 or bf16 only, and the precision plugin does not say "
            "its compute dtype: if it computes in float32 the first step fails. Use bf16 precision "
            f"({option('Trainer', 'precision', 'bf16-mixed')} or BF16Precision), or "
            f"{option('GPTModule', 'attention', 'sdpa')}.",
            stacklevel=2,
        )
    elif dtype not in _FLASH_ATTN_DTYPES:
        raise ValueError(
            f"GPTConfig(attention='flash-attn') runs in fp16 or bf16 only, and this run computes in {dtype} "
            "(the precision plugin's compute dtype): use bf16 precision "
            f"({option('Trainer', 'precision', 'bf16-mixed')} "
            f"or BF16Precision), or {option('GPTModule', 'attention', 'sdpa')}."
        )
