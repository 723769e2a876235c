"""`choose_strategy`: DDP when the model trains on one GPU, FSDP2 (``ModelParallelStrategy``) otherwise.

Design note, the memory estimate (bytes on one device; stated so it can be checked and changed):

* **Model state**: 16 bytes per parameter: fp32 weights (4), fp32 gradients (4) and AdamW's two
  fp32 moments (8). Mixed precision keeps fp32 master weights, so this holds for ``32-true``,
  ``bf16-mixed`` and ``16-mixed`` alike. DDP keeps all of it on every device; FSDP2 divides it by the
  number of devices.
* **Activations**: per token and per layer, ``34 * n_embd`` bytes for 16-bit activations with a
  fused (Flash / SDPA) attention kernel, after Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198, Sec. 4.1, the ``5 a s / h``
  attention-score term dropped because SDPA does not store the scores); twice that for fp32.
  With activation checkpointing, only each block's input (``2 * n_embd`` bytes, 16-bit) is kept,
  plus one block's activations during its recomputation.
* **Logits**: ``10 * padded_vocab_size`` bytes per token (16-bit logits, their fp32 copy for the
  loss, and its gradient).
* **Headroom**: the sum must fit in ``headroom`` (default 85%) of the device's memory; the rest is
  the CUDA context, the allocator's fragmentation and communication buffers.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.strategies.atomic_checkpoint import AtomicModelParallelStrategy

__all__ = ["AUTO_STRATEGY", "MemoryEstimate", "choose_strategy", "estimate_memory"]

AUTO_STRATEGY = "gpuopt-auto"
"""The ``trainer.strategy`` value the ``gpuopt`` CLI resolves with :func:`choose_strategy`."""

_GB = 1e9
_STATE_BYTES_PER_PARAM = 16


class MemoryEstimate(dict):
    """Bytes on one device: ``params``, ``model_state``, ``activations``, ``logits`` (a dict)."""

    @property
    def total(self) -> float:
        return self["model_state"] + self["activations"] + self["logits"]


def estimate_memory(config: GPTConfig, micro_batch: int, block_size: int, precision: str = "bf16-mixed") -> MemoryEstimate:
    """Training memory of ``config`` on one device without sharding (see the module's design note).

    Example::

        est = estimate_memory(GPTConfig.from_name("1.5b"), micro_batch=8, block_size=1024)
        est["model_state"] / 1e9  # ~25 GB

    Args:
        config: The GPT architecture.
        micro_batch: Sequences per device per micro-batch.
        block_size: Tokens per sequence.
        precision: The Trainer's precision string; ``32``/``64`` activations count double.
    """
    with torch.device("meta"):
        params = GPT(config).num_params()
    tokens = micro_batch * block_size
    act_bytes = 4 if str(precision).startswith(("32", "64")) else 2
    h, layers = config.n_embd, config.n_layer
    if config.activation_checkpointing:
        activations = tokens * (layers * act_bytes * h + 17 * act_bytes * h)
    else:
        activations = tokens * layers * 17 * act_bytes * h
    return MemoryEstimate(
        params=params,
        model_state=_STATE_BYTES_PER_PARAM * params,
        activations=activations,
        logits=tokens * config.padded_vocab_size * 10,
    )


def _config_of(model) -> GPTConfig:
    if isinstance(model, GPTConfig):
        return model
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):
        return config
    raise ValueError(f"choose_strategy needs a GPTConfig, a GPT or a GPTModule, got {type(model).__name__}.")


def choose_strategy(
    model,
    devices: int,
    device_memory: Optional[float] = None,
    precision: str = "bf16-mixed",
    micro_batch: int = 8,
    block_size: Optional[int] = None,
    headroom: float = 0.85,
) -> tuple[Union[Strategy, str], str]:
    """Pick DDP when the whole training state plus activations fits on one device, FSDP2 otherwise.

    Example::

        strategy, reason = choose_strategy(GPTConfig.from_name("1.5b"), devices=8, device_memory=16e9)
        trainer = Trainer(devices=8, strategy=strategy)   # AtomicModelParallelStrategy; reason says why

        # YAML / CLI: trainer.strategy: gpuopt-auto   (gpuopt fit --trainer.strategy gpuopt-auto)

    Args:
        model: A ``GPTConfig``, ``GPT`` or ``GPTModule``.
        devices: Data-parallel devices (all nodes).
        device_memory: Bytes of memory per device; ``None`` reads CUDA device 0's.
        precision: The Trainer's precision string.
        micro_batch: Sequences per device per micro-batch.
        block_size: Tokens per sequence; ``None`` uses the model's.
        headroom: Fraction of ``device_memory`` the estimate may use.

    Returns:
        ``(strategy, reason)``: ``"auto"`` (one device), a ``DDPStrategy`` or an
        ``AtomicModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)`` (FSDP2,
        which ``GPTModule.configure_model`` shards per block; Lightning's ``ModelParallelStrategy``
        with checkpoints replaced atomically), and one line with the numbers behind it.
    """
    config = _config_of(model)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"choose_strategy(devices=...) must be a positive integer, got {devices!r}.")
    if not 0 < headroom <= 1:
        raise ValueError(f"choose_strategy(headroom=...) must be in (0, 1], got {headroom!r}.")
    if device_memory is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "choose_strategy cannot read a GPU's memory without CUDA: pass device_memory= (bytes), "
                "or --auto_strategy.device_memory_gb in the gpuopt CLI."
            )
        device_memory = float(torch.cuda.get_device_properties(0).total_memory)
    est = estimate_memory(config, micro_batch, block_size or config.block_size, precision)
    budget = headroom * device_memory
    numbers = (
        f"{est['params'] / 1e6:,.0f}M params -> {est['model_state'] / _GB:.1f} GB weights+grads+AdamW (fp32), "
        f"{est['activations'] / _GB:.1f} GB activations + {est['logits'] / _GB:.1f} GB logits at micro-batch "
        f"{micro_batch} x {block_size or config.block_size} tokens; budget {budget / _GB:.1f} GB "
        f"({headroom:.0%} of {device_memory / _GB:.1f} GB)"
    )
    if est.total <= budget:
        if devices == 1:
            return "auto", f"one device and the model fits: {numbers}."
        return DDPStrategy(), f"DDP: a full replica fits on each device: {numbers}."
    if devices == 1:
        raise ValueError(
            f"The model does not fit on one device ({est.total / _GB:.1f} GB > {numbers}) and FSDP2 needs several: "
            "train on more devices, lower data.batch_size, or set model.activation_checkpointing=true."
        )
    sharded = est["model_state"] / devices + est["activations"] + est["logits"]
    fits = "fits" if sharded <= budget else "still does NOT fit: lower the micro-batch or enable activation checkpointing"
    reason = (
        f"FSDP2 (ModelParallelStrategy): a full replica needs {est.total / _GB:.1f} GB, over the budget: {numbers}; "
        f"sharded over {devices} devices it needs {sharded / _GB:.1f} GB per device and {fits}."
    )
    return AtomicModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1), reason
