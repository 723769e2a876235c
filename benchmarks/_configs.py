"""The configurations the throughput benchmark compares, and the settings they share.

Each configuration is a recipe for one training run of the same model on the same tokens:
which precision, which callbacks, whether the model is compiled, and who picks the micro-batch.
``lightning_parts`` turns a name into the Trainer's plugins and callbacks; ``skip_reason`` says
why a configuration cannot run here (an optional component missing, a GPU without FP8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["CONFIGS", "BASELINE", "BF16_CONFIGS", "DEFAULT_CONFIGS", "FP8_CONFIGS", "TORCH_LOOP", "VARIANTS",
           "BenchSettings", "LightningParts", "lightning_parts", "skip_reason"]

BASELINE = "baseline"
TORCH_LOOP = "torch-loop"
AUTO_BF16 = "gpuopt-bf16-compile-auto"
FP8_FIXED = "gpuopt-fp8-compile"
FP8_AUTO = "gpuopt-fp8-compile-auto"

# name -> what it measures (printed in the results table). Order is the run order of one repeat.
CONFIGS: dict[str, str] = {
    BASELINE: "plain Lightning Trainer, fp32, micro-batch as configured (what users run before)",
    "lightning-bf16": "Lightning's precision='bf16-mixed' + ThroughputMonitor (the peer)",
    "gpuopt-bf16": "BF16Precision + CUDASettings + MFUMonitor",
    "gpuopt-bf16-compile": "gpuopt-bf16 with torch.compile",
    FP8_FIXED: "gpuopt-bf16-compile with Float8Precision in place of BF16Precision (SM >= 8.9), fixed micro-batch",
    AUTO_BF16: "gpuopt-bf16-compile with AutoBatchSize (bigger micro-batch, same global batch)",
    FP8_AUTO: "the same with Float8Precision in place of BF16Precision (SM >= 8.9)",
    TORCH_LOOP: "hand-written nanoGPT-style loop: the same GPT, bf16 autocast, whole-model torch.compile, full "
    "logits into F.cross_entropy, fused AdamW, TF32 and the SDPA kernel order of CUDASettings set by hand; its own "
    "micro-batch (halved until it fits) with accumulation to the same global batch",
    # The elementwise options (GPTModule.compile_scope, residual_dtype): not in the default list, run by name.
    "gpuopt-bf16-compile-model": "gpuopt-bf16-compile as one whole-model graph, the loss inside it "
    "(compile_scope='model')",
    "gpuopt-bf16-compile-bf16res": "gpuopt-bf16-compile with a bf16 residual stream (residual_dtype='bfloat16')",
    "gpuopt-bf16-compile-model-bf16res": "both: one whole-model graph with the loss, and a bf16 residual stream",
    "gpuopt-bf16-compile-autotune": "gpuopt-bf16-compile in compile_mode='max-autotune-no-cudagraphs' (Triton GEMM "
    "templates: bias, GELU and residual epilogues fused; minutes of compile)",
    "gpuopt-bf16-compile-cudagraphs": "gpuopt-bf16-compile in compile_mode='reduce-overhead' (CUDA graphs: for "
    "launch-bound small micro-batches)",
}
# A variant's torch.compile mode; the other compiled configurations take --compile-mode.
VARIANT_MODES = {"gpuopt-bf16-compile-autotune": "max-autotune-no-cudagraphs",
                 "gpuopt-bf16-compile-cudagraphs": "reduce-overhead"}
VARIANTS = ("gpuopt-bf16-compile-model", "gpuopt-bf16-compile-bf16res", "gpuopt-bf16-compile-model-bf16res",
            *VARIANT_MODES)
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in VARIANTS)  # what --configs runs when not given

# Configurations that compile the model (slow to start on CPU).
COMPILED = frozenset({"gpuopt-bf16-compile", FP8_FIXED, AUTO_BF16, FP8_AUTO, TORCH_LOOP, *VARIANTS})
# The gpuopt configurations in bf16: the report's MFU targets take the best of them.
BF16_CONFIGS = ("gpuopt-bf16", "gpuopt-bf16-compile", AUTO_BF16, *VARIANTS)
AUTO = frozenset({AUTO_BF16, FP8_AUTO})
FP8_CONFIGS = frozenset({FP8_FIXED, FP8_AUTO})  # trained with Float8Precision (--fp8-recipe)


@dataclass
class BenchSettings:
    """What every configuration shares: model, data, run length, batch sizes.

    Args:
        preset: ``GPTConfig`` preset (``tiny``, ``124m``, ``175m``, ``355m``, ``774m``, ``1.5b``).
        block_size: Sequence length of every batch (and the model's context length).
        vocab_size: The model's vocabulary (GPT-2's 50,257 for the GPT-2 presets, so FLOPs match
            the README's table); at least the tokenizer's.
        data: ``TextDataModule`` source: a file, folder, glob or ``stdlib``.
        tokenizer_vocab_size: Size of the BPE trained on ``data``.
        cache_dir: Token cache folder (``None``: the package default).
        micro_batch_size: Sequences per micro-batch of the fixed-batch configurations.
        global_batch_size: Sequences per optimizer step that ``AutoBatchSize`` keeps.
        max_micro_batch_size: Largest micro-batch ``AutoBatchSize`` tries (required on CPU).
        steps: Measured optimizer steps per configuration and repeat.
        warmup_steps: Optimizer steps run before the measurement (compilation, autotuning).
        num_workers: DataLoader worker processes.
        seed: Seed of the model initialisation and the data order (the same for every configuration).
        fp8_recipe: torchao float8 recipe.
        fp8_emulate: Run the FP8 configuration with emulated float8 matmuls (CPU, GPUs below SM 8.9):
            tests the path, measures nothing useful.
        compile_mode: ``torch.compile`` mode of the compiled configurations (``None``: default).
        learning_rate: Peak learning rate (warm-up over ``warmup_steps``).
        profile_steps: Optimizer steps run under ``torch.profiler`` after the measured ones (0: none).
    """

    preset: str = "124m"
    block_size: int = 1024
    vocab_size: int = 50257
    data: str = "stdlib"
    tokenizer_vocab_size: int = 4096
    cache_dir: Optional[str] = None
    micro_batch_size: int = 8
    global_batch_size: int = 64
    max_micro_batch_size: Optional[int] = None
    steps: int = 20
    warmup_steps: int = 5
    num_workers: int = 2
    seed: int = 1337
    fp8_recipe: str = "tensorwise"
    fp8_emulate: bool = False
    compile_mode: Optional[str] = None
    learning_rate: float = 6e-4
    profile_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "micro_batch_size", "global_batch_size", "steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if isinstance(self.profile_steps, bool) or not isinstance(self.profile_steps, int) or self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be an integer >= 0, got {self.profile_steps!r}.")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"--global-batch-size={self.global_batch_size} must be a multiple of --micro-batch-size="
                f"{self.micro_batch_size}, so the fixed-batch configurations can reach it too."
            )
        if self.vocab_size < self.tokenizer_vocab_size:
            raise ValueError(
                f"--vocab-size={self.vocab_size} is smaller than --tokenizer-vocab-size={self.tokenizer_vocab_size}: "
                "raise --vocab-size or lower --tokenizer-vocab-size."
            )


@dataclass
class LightningParts:
    """What a Lightning configuration adds to the shared Trainer and module."""

    precision: Optional[str]
    plugins: list[Any]
    callbacks: list[Any]
    compile: bool
    auto_batch: Optional[Any]  # the AutoBatchSize callback, also in ``callbacks``
    compile_scope: str = "block"  # GPTModule.compile_scope
    residual_dtype: str = "float32"  # GPTModule.residual_dtype
    compile_mode: Optional[str] = None  # GPTModule.compile_mode (None: BenchSettings.compile_mode)


def _import_auto_batch_size() -> Any:
    try:
        from lightning_gpuopt.callbacks import AutoBatchSize
    except ImportError as err:
        raise ImportError(f"lightning_gpuopt.callbacks has no AutoBatchSize in this checkout ({err})") from err
    return AutoBatchSize


def skip_reason(name: str, settings: BenchSettings, device: torch.device) -> Optional[str]:
    """Why configuration ``name`` cannot run on ``device`` with these settings; ``None`` if it can.

    Example::

        skip_reason("gpuopt-fp8-compile-auto", settings, torch.device("cpu"))  # "float8 matmuls need ..."

    Args:
        name: A key of ``CONFIGS``.
        settings: The shared settings.
        device: Where the benchmark runs.
    """
    if name not in CONFIGS:
        raise ValueError(f"Unknown configuration {name!r}: choose from {list(CONFIGS)}.")
    if name in FP8_CONFIGS:
        try:
            from lightning_gpuopt.precision.float8_layers import require_torchao

            require_torchao()
        except ImportError as err:
            return str(err)
        if not settings.fp8_emulate:
            if device.type != "cuda":
                return (
                    f"float8 matmuls need a CUDA GPU with compute capability >= 8.9, this is {device.type} "
                    "(--fp8-emulate runs the numerics emulated)"
                )
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):
                return (
                    f"float8 matmuls need compute capability >= 8.9, {torch.cuda.get_device_name(device)} has "
                    f"{capability[0]}.{capability[1]} (--fp8-emulate runs the numerics emulated)"
                )
    if name in AUTO:
        try:
            _import_auto_batch_size()
        except ImportError as err:
            return f"{err}; update lightning_gpuopt to a version with the AutoBatchSize callback"
        if device.type == "cpu" and settings.max_micro_batch_size is None:
            return "AutoBatchSize on CPU needs a bound: pass --max-micro-batch-size"
    return None


def lightning_parts(name: str, settings: BenchSettings) -> LightningParts:
    """The Trainer precision, plugins and callbacks, and the module's compile flag, of a Lightning configuration.

    Example::

        parts = lightning_parts("gpuopt-bf16", settings)
        Trainer(plugins=parts.plugins, callbacks=parts.callbacks)

    Args:
        name: A key of ``CONFIGS`` other than ``torch-loop``.
        settings: The shared settings.
    """
    from lightning.pytorch.callbacks import ThroughputMonitor

    from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor
    from lightning_gpuopt.precision import BF16Precision

    if name == BASELINE:
        return LightningParts("32-true", [], [], compile=False, auto_batch=None)
    if name == "lightning-bf16":
        monitor = ThroughputMonitor(
            batch_size_fn=lambda batch: batch[0].size(0), length_fn=lambda batch: batch[0].numel()
        )
        return LightningParts("bf16-mixed", [], [monitor], compile=False, auto_batch=None)
    if name not in CONFIGS or name == TORCH_LOOP:
        choices = [c for c in CONFIGS if c != TORCH_LOOP]
        raise ValueError(f"{name!r} is not a Lightning configuration: choose from {choices}.")
    callbacks: list[Any] = [CUDASettings(), MFUMonitor(log_every_n_steps=10, report=False)]
    if name in FP8_CONFIGS:
        from lightning_gpuopt.precision import Float8Precision

        plugin: Any = Float8Precision(recipe=settings.fp8_recipe, emulate=settings.fp8_emulate)
    else:
        plugin = BF16Precision()
    auto_batch = None
    if name in AUTO:
        auto_batch = _import_auto_batch_size()(
            global_batch_size=settings.global_batch_size, max_micro_batch_size=settings.max_micro_batch_size
        )
        callbacks.append(auto_batch)
    scope = "model" if "-model" in name else "block"
    residual = "bfloat16" if name.endswith("-bf16res") else "float32"
    return LightningParts(None, [plugin], callbacks, compile=name in COMPILED, auto_batch=auto_batch,
                          compile_scope=scope, residual_dtype=residual, compile_mode=VARIANT_MODES.get(name))
