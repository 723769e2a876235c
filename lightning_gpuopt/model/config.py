"""`GPTConfig`: the architecture of a GPT model, with validation and named presets."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_gpuopt.option_checks import check_choice, check_int, check_number, option
from lightning_gpuopt.model.loss import LOSS_IMPLS, LossImpl
from lightning_gpuopt.perf.device import DeviceFacts

__all__ = ["ActivationCheckpointing", "GPTConfig", "PRESETS", "check_attention_runs", "check_data_fits", "llama_ffn_size"]

Attention = Literal["sdpa", "flash-attn"]
# Which blocks recompute their activations in the backward: none (False), every block (True or "full": ~1/3 more
# compute), or every other block ("selective": the second of each pair, as torchtitan's layer-selective mode at
# frequency 2; ~1/6 more compute, about half the activation memory).
ActivationCheckpointing = Union[bool, Literal["selective", "full"]]
Arch = Literal["gpt2", "llama"]

# Llama 3's shapes, from the Hugging Face config.json of each model (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, rope_theta, vocab_size, tie_word_embeddings):
# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json, .../Llama-3.2-3B/...,
# .../Meta-Llama-3.1-8B/... and .../Meta-Llama-3.1-70B/... (litgpt/config.py lists the same). The widths of
# the MLP come from Meta's rule (llama_ffn_size) with Meta's ffn_dim_multiplier and multiple_of (their
# params.json; torchtitan's llama3 configs for 8B and 70B), and give those intermediate sizes: 8192, 8192,
# 14336, 28672 (tested). block_size is the 8,192-token context Llama 3 was pre-trained at; the released
# models' 128K comes from a later long-context phase (and its rope_scaling, not applied here: model/rope.py).
_LLAMA3 = dict(arch="llama", vocab_size=128256, block_size=8192, rope_theta=500000.0, norm_eps=1e-5)

# Named architectures. The GPT-2 family sizes (124m ... 1.5b) follow Radford et al. (2019); 175m is
# the GPT-3 "small-wide" shape used by many recipes (d1024 with 12 layers). The llama-* presets are
# Llama 3 shapes (above): llama-1b and llama-3b are Llama 3.2 1B and 3B (output head tied), llama-8b is
# Llama 3.1 8B and llama-70b Llama 3.1 70B (untied), the last for planning and meta-device tests.
# `tiny` and `llama-tiny` are for tests and CPU runs: every dimension is a multiple of 16 so float8
# conversion really happens on them.
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
}

# The options only the Llama-style architecture has, with the value each takes when not given.
_LLAMA_ONLY = dict(intermediate_size=None, ffn_dim_multiplier=None, multiple_of=256, rope_theta=10000.0)


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
    """Architecture of a decoder-only transformer: GPT-2 style (the default) or Llama style (``arch="llama"``).

    The fields and the two architectures: ``docs/model.md``. ``padded_vocab_size``, ``head_size`` and
    ``ffn_size`` are derived, and the Llama options left at ``None`` filled in, in ``__post_init__``.

    Example::

        config = GPTConfig.from_name("124m", vocab_size=8192, block_size=512)
        tiny = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256)
        llama = GPTConfig.from_name("llama-1b", vocab_size=32768, block_size=2048)
        small_llama = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=256)
    """

    n_layer: int = 12
    n_head: int = 12  # must divide n_embd
    n_embd: int = 768
    block_size: int = 1024  # the longest sequence the model takes
    vocab_size: int = 50257  # the tokenizer's; the embedding is padded up to padded_vocab_size
    dropout: float = 0.0  # attention and residual paths; 0 for pre-training
    bias: Optional[bool] = None  # in Linear and LayerNorm layers; None: the arch's own (GPT-2 yes, Llama no)
    # "sdpa": F.scaled_dot_product_attention picks its Flash / cuDNN / memory-efficient kernel; "flash-attn": the
    # flash-attn package (compute capability >= 8.0, fp16/bf16: check_attention_runs at GPTModule.setup)
    attention: Attention = "sdpa"
    activation_checkpointing: ActivationCheckpointing = False  # recompute blocks in the backward (above)
    padding_multiple: int = 64  # matmuls with dimensions multiples of 64 run on the fastest tensor-core kernels
    # "chunked": the head matmul and the loss together, no full logits (any device); "liger": Liger-Kernel (CUDA,
    # the liger extra); "plain": full float32 logits, the reference; "auto": "chunked" (docs/model.md, "The loss")
    loss_impl: LossImpl = "auto"
    loss_chunk_size: Optional[int] = None  # tokens per chunk; None: as many as fit 512 MiB (loss.chunk_tokens)
    # The architecture: GPT-2 or Llama style, and the Llama-style options.
    arch: Arch = "gpt2"
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention), must divide n_head; None: n_head
    tie_embeddings: bool = True  # the head shares the token embedding (GPT-2, Llama 3.2 1B/3B; not 3.1 8B/70B)
    norm_eps: float = 1e-5  # of every LayerNorm / RMSNorm
    intermediate_size: Optional[int] = None  # the SwiGLU width, given outright; None: llama_ffn_size's rule
    ffn_dim_multiplier: Optional[float] = None  # scales the rule's 8/3 * n_embd (1.3 in Llama 3 8B/70B)
    multiple_of: Optional[int] = None  # the rule rounds the width up to this (None: 256)
    rope_theta: Optional[float] = None  # base of the rotary angles (None: 10,000; Llama 3: 500,000)
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
                f"GPTConfig.activation_checkpointing must be false, true (every block: 'full') or 'selective' (every other "
                f"block), got {self.activation_checkpointing!r}."
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
        """Check the ``arch`` and its options; fill in the ones left at ``None`` and derive ``ffn_size``."""
        check_choice("GPTConfig", "arch", self.arch, ("gpt2", "llama"))
        for name in ("n_kv_head", "intermediate_size", "multiple_of"):
            check_int("GPTConfig", name, getattr(self, name), minimum=1, optional=True)
        for name in ("norm_eps", "ffn_dim_multiplier", "rope_theta"):
            check_number("GPTConfig", name, getattr(self, name), low=0, low_open=True, optional=True)
        if self.arch == "gpt2":
            given = [name for name in _LLAMA_ONLY if getattr(self, name) is not None]
            if self.n_kv_head not in (None, self.n_head):
                given.insert(0, "n_kv_head")
            if given:
                raise ValueError(
                    f"GPTConfig.{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of the "
                    "Llama-style architecture, and this config is GPT-2 style: set arch='llama' (or a llama-* preset), "
                    f"or leave {'it' if len(given) == 1 else 'them'} out."
                )
            self.n_kv_head = self.n_head
            self.bias = True if self.bias is None else self.bias
            self.ffn_size = 4 * self.n_embd
            return
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head != 0:
            divisors = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}: each key/value head "
                f"serves an equal group of query heads. Choose n_kv_head from {divisors}."
            )
        if self.head_size % 2 != 0:
            raise ValueError(
                f"GPTConfig.n_embd / n_head = {self.head_size} is odd, and rotary embeddings (arch='llama') turn pairs "
                "of a head's entries: choose n_embd and n_head with an even head size (a multiple of 16 is fastest)."
            )
        if self.intermediate_size is not None and self.ffn_dim_multiplier is not None:
            raise ValueError(
                f"GPTConfig.intermediate_size={self.intermediate_size} and "
                f"ffn_dim_multiplier={self.ffn_dim_multiplier} both set the MLP's width: give intermediate_size "
                "alone (the width), or ffn_dim_multiplier (and multiple_of) for Llama 3's rule."
            )
        for name, default in _LLAMA_ONLY.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.bias = False if self.bias is None else self.bias
        self.ffn_size = self.intermediate_size or llama_ffn_size(self.n_embd, self.ffn_dim_multiplier, self.multiple_of)

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
            f"H100), and this run's device is {facts.describe()}: use {option('GPTModule', 'attention', 'sdpa')}, which "
            "picks a kernel this device has."
        )
    if dtype is None:
        warnings.warn(
            "GPTConfig(attention='flash-attn') runs in fp16 or bf16 only, and the precision plugin does not say "
            "its compute dtype: if it computes in float32 the first step fails. Use bf16 precision "
            f"({option('Trainer', 'precision', 'bf16-mixed')} or BF16Precision), or {option('GPTModule', 'attention', 'sdpa')}.",
            stacklevel=2,
        )
    elif dtype not in _FLASH_ATTN_DTYPES:
        raise ValueError(
            f"GPTConfig(attention='flash-attn') runs in fp16 or bf16 only, and this run computes in {dtype} "
            f"(the precision plugin's compute dtype): use bf16 precision ({option('Trainer', 'precision', 'bf16-mixed')} "
            f"or BF16Precision), or {option('GPTModule', 'attention', 'sdpa')}."
        )
