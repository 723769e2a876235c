"""`GPTConfig`: the architecture of a GPT model, with validation and named presets."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Optional

from lightning_gpuopt.option_checks import option
from lightning_gpuopt.model.loss import LOSS_IMPLS, LossImpl
from lightning_gpuopt.perf.device import DeviceFacts

__all__ = ["GPTConfig", "PRESETS", "check_attention_runs", "check_data_fits"]

Attention = Literal["sdpa", "flash-attn"]

# Named architectures. The GPT-2 family sizes (124m ... 1.5b) follow Radford et al. (2019); 175m is
# the GPT-3 "small-wide" shape used by many recipes (d1024 with 12 layers). `tiny` is for tests and
# CPU runs: every dimension is a multiple of 16 so float8 conversion really happens on it.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512),
    "124m": dict(n_layer=12, n_head=12, n_embd=768),
    "175m": dict(n_layer=12, n_head=16, n_embd=1024),
    "355m": dict(n_layer=24, n_head=16, n_embd=1024),
    "774m": dict(n_layer=36, n_head=20, n_embd=1280),
    "1.5b": dict(n_layer=48, n_head=25, n_embd=1600),
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class GPTConfig:
    """Architecture of a GPT-2 style decoder-only transformer.

    Example::

        config = GPTConfig.from_name("124m", vocab_size=8192, block_size=512)
        tiny = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256)

    Args:
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Model width (``d_model``).
        block_size: Longest sequence (context length) the model accepts.
        vocab_size: Tokenizer vocabulary size. The embedding is padded up to
            ``padded_vocab_size`` (a multiple of ``padding_multiple``) because matmuls whose
            dimensions are multiples of 64 run on the fastest tensor-core kernels.
        dropout: Dropout probability for attention and residual paths (0 for pre-training).
        bias: Whether Linear and LayerNorm layers have biases (GPT-2 has them).
        attention: ``"sdpa"`` uses ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch
            picks its Flash / cuDNN / memory-efficient kernel); ``"flash-attn"`` calls the
            ``flash-attn`` package (compute capability 8.0 or newer, fp16/bf16 only: checked at
            ``GPTModule.setup`` by :func:`check_attention_runs`).
        activation_checkpointing: Recompute each block's activations in the backward pass,
            trading about a third more compute for far less activation memory.
        padding_multiple: The multiple ``vocab_size`` is rounded up to.
        loss_impl: How the training/evaluation loss is computed from the hidden states:
            ``"chunked"`` (the head matmul and cross-entropy together, ``loss_chunk_size`` tokens at a
            time, no full logits; any device), ``"liger"`` (Liger-Kernel's fused linear
            cross-entropy, CUDA, the ``liger`` extra), ``"plain"`` (full float32 logits, the
            reference) or ``"auto"`` (``"chunked"``).
        loss_chunk_size: Tokens per chunk of the chunked loss; ``None`` (default): as many as fit one
            chunk's logits in 512 MiB (``model.loss.chunk_tokens``: 2656 in float32, 1776 in bf16 at
            a vocabulary of 50304).

    Note:
        ``padded_vocab_size`` and ``head_size`` are derived in ``__post_init__``; don't pass them.
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    dropout: float = 0.0
    bias: bool = True
    attention: Attention = "sdpa"
    activation_checkpointing: bool = False
    padding_multiple: int = 64
    loss_impl: LossImpl = "auto"
    loss_chunk_size: Optional[int] = None
    # Derived in __post_init__.
    padded_vocab_size: int = dataclasses.field(init=False)
    head_size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "padding_multiple", "loss_chunk_size"):
            value = getattr(self, name)
            if name == "loss_chunk_size" and value is None:  # from the byte budget
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"choose n_head from {divisors} or change n_embd to a multiple of {self.n_head}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if self.attention not in ("sdpa", "flash-attn"):
            raise ValueError(
                f"GPTConfig.attention={self.attention!r} is not supported: use 'sdpa' (default) or 'flash-attn'."
            )
        if self.attention == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
            # Checked here, when the config is built, not when the model is (after data preparation).
            raise ImportError(
                "GPTConfig(attention='flash-attn') needs the flash-attn package: "
                f'pip install "lightning-gpuopt[flash]" (CUDA only), or use {option("GPTModule", "attention", "sdpa")}.'
            )
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(
                f"GPTConfig.loss_impl={self.loss_impl!r} is not supported: use 'auto' (default), 'chunked', "
                "'liger' or 'plain'."
            )
        if self.loss_impl == "liger" and importlib.util.find_spec("liger_kernel") is None:
            raise ImportError(
                "GPTConfig(loss_impl='liger') needs Liger-Kernel: pip install \"lightning-gpuopt[liger]\" "
                f"(CUDA only), or use {option('GPTModule', 'loss_impl', 'chunked')}."
            )
        self.head_size = self.n_embd // self.n_head
        self.padded_vocab_size = _round_up(self.vocab_size, self.padding_multiple)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build a config from a preset name (see ``PRESETS``), with optional field overrides.

        Example::

            GPTConfig.from_name("774m", block_size=2048, activation_checkpointing=True)

        Args:
            name: One of ``tiny``, ``124m``, ``175m``, ``355m``, ``774m``, ``1.5b``.
            **overrides: Any ``GPTConfig`` field, replacing the preset's value.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}: choose one of {sorted(PRESETS)}.")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls) if f.init}
        if unknown:
            raise ValueError(f"Unknown GPTConfig field(s) {sorted(unknown)} passed to GPTConfig.from_name({name!r}).")
        return cls(**{**PRESETS[name], **overrides})


def check_data_fits(config: GPTConfig, data_vocab_size: Any = None, data_block_size: Any = None) -> None:
    """Raise ``ValueError`` naming the settings to change when the data's tokens or sequences do not fit the model.

    Example::

        check_data_fits(GPTConfig.from_name("tiny", vocab_size=300), data_vocab_size=260)   # fine
        check_data_fits(GPTConfig.from_name("tiny", vocab_size=260), data_vocab_size=300)   # ValueError

    Args:
        config: The model's configuration.
        data_vocab_size: The data's tokenizer size (``None``: not known).
        data_block_size: The data's sequence length (``None``: not known).
    """
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
    """Raise ``ValueError`` naming the fix when ``attention="flash-attn"`` cannot run on this device and precision.

    flash-attn runs on CUDA GPUs of compute capability 8.0 or newer, in fp16 or bf16 only; otherwise
    its first call fails, after data preparation and model setup.

    Example::

        check_attention_runs(config, REFERENCE_DEVICES["A100"], "bf16")   # fine
        check_attention_runs(config, REFERENCE_DEVICES["A100"], "fp32")   # ValueError: use bf16 precision

    Args:
        config: The model's configuration (only ``attention="flash-attn"`` is checked).
        facts: The training device (:func:`~lightning_gpuopt.perf.device.read_device`).
        dtype: The precision plugin's compute dtype name
            (:func:`~lightning_gpuopt.precision.dtype.compute_dtype_name`); ``None`` when unknown.
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
