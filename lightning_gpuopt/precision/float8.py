"""`Float8Precision`: torchao float8 training of Linear layers, under bfloat16 autocast.

Layers convert where the Trainer builds them: as ``configure_model`` assigns them (before FSDP2 or a
compile), else in ``convert_module`` (before DDP wraps the model).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn import Module
from typing_extensions import override

from lightning_gpuopt.option_checks import check_choice, option
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.precision.base import DevicePrecision
from lightning_gpuopt.precision.float8_layers import (
    RECIPES,
    Float8Recipe,
    convert_linears_to_float8,
    float8_config,
    format_conversion_table,
    nothing_converted_message,
    require_torchao,
    skip_reason,
)

__all__ = ["Float8Precision", "check_float8_device", "check_float8_strategy"]


def check_float8_device(facts: DeviceFacts, emulate: bool) -> None:
    """Raise a ``RuntimeError`` on a CUDA GPU without FP8 tensor cores (compute capability < 8.9: an A100)
    unless ``emulate``; say once that a device without CUDA emulates float8."""
    if emulate or facts.fp8:
        return
    if not facts.is_cuda:
        rank_zero_warn(
            f"Float8Precision on {facts.describe()}: no float8 tensor cores, so the float8 layers compute in "
            f"high precision (emulated: the float8 numerics, slowly, no speed-up). Set {option('Float8Precision', 'emulate', True)} "
            "to say so, or use BF16Precision for speed."
        )
        return
    major, minor = facts.capability or (0, 0)
    raise RuntimeError(
        f"Float8Precision needs a GPU with compute capability >= 8.9 (L4, L40, H100, ...) for float8 "
        f"matmuls, but {facts.describe()} has {major}.{minor}. Set {option('Float8Precision', 'emulate', True)} to "
        "test the float8 numerics (slowly) on this GPU, or use BF16Precision to train fast on it."
    )


def check_float8_strategy(strategy: Any) -> None:
    """Raise a ``ValueError`` if ``strategy`` casts parameters or gradients to float16.

    Float8 training keeps float32 master weights and runs the rest under bf16 autocast: float16 weights
    would reach the float8 layers, and gradients reduced in float16 overflow.
    """
    policy = getattr(strategy, "mixed_precision", None)
    if policy is None:
        return
    bad = [f for f in ("param_dtype", "reduce_dtype", "buffer_dtype") if getattr(policy, f, None) == torch.float16]
    if bad:
        raise ValueError(
            f"Float8Precision trains with bfloat16 autocast and float32 master weights, but the strategy's "
            f"mixed_precision sets {', '.join(f'{f}=torch.float16' for f in bad)}. Use torch.bfloat16 there (or leave "
            f"{type(strategy).__name__}(mixed_precision=None) and let the plugin set the precision)."
        )


class Float8Precision(DevicePrecision):
    """Float8 training with torchao: Linear layers run FP8 matmuls, everything else bf16 autocast.

    Parameters, gradients and optimizer state stay float32, and checkpoints have the keys and dtypes of
    the unconverted model. A table of converted and skipped layers (with the reasons) is logged and kept
    in ``conversion_report``. FP8 pays off for wide, compiled models: ``docs/precision.md``.

    Example::

        trainer = Trainer(plugins=[Float8Precision(recipe="rowwise")])

    Args:
        recipe: torchao recipe: ``"tensorwise"`` (fastest), ``"rowwise"`` (more accurate scales),
            ``"rowwise_with_gw_hp"`` (most accurate: weight gradients in high precision).
        module_filter: Which Linear layers to convert: ``"auto"`` (skips the output layer, dims not
            multiples of 16 and shapes too small to pay off: :func:`~.float8_layers.auto_skip_reason`),
            a list of layer-name patterns to skip (``["lm_head", "*.attn.*"]``), or a callable
            ``(module, fqn) -> bool``, True to convert.
        emulate: Emulate float8 matmuls in high precision, for CPU runs and GPUs older than SM 8.9
            (tests and debugging; slow).

    Note:
        With ``ModelParallelStrategy``, build the model in ``configure_model`` and assign it to an
        attribute of the LightningModule (``self.model = ...``) before calling ``fully_shard``.
    """

    def __init__(
        self,
        recipe: Float8Recipe = "tensorwise",
        module_filter: Union[str, list[str], Callable[[nn.Module, str], bool]] = "auto",
        emulate: bool = False,
    ) -> None:
        require_torchao()
        check_choice("Float8Precision", "recipe", recipe, RECIPES)
        if isinstance(module_filter, str) and module_filter != "auto":
            raise ValueError(
                f"Float8Precision(module_filter={module_filter!r}): use 'auto', a list of layer-name patterns "
                f"to skip (e.g. [{module_filter!r}]), or a callable (module, fqn) -> bool."
            )
        if not (isinstance(module_filter, str) or callable(module_filter)):
            if not isinstance(module_filter, (list, tuple)) or not all(isinstance(p, str) for p in module_filter):
                raise ValueError(
                    f"Float8Precision(module_filter={module_filter!r}): expected 'auto', a list of strings, or a callable."
                )
            module_filter = list(module_filter)
        super().__init__()
        self.recipe = recipe
        self.module_filter = module_filter
        self.emulate = emulate
        self.conversion_report: list[tuple[str, str, Optional[str]]] = []
        self._fsdp_float8_all_gather = False
        self._warned_not_compiled = False
        self._warned_nothing_converted = False

    @property
    def fp8(self) -> bool:
        """``True``: the converted layers run float8 matmuls; the rest runs in :attr:`compute_dtype` (bf16)."""
        return True

    @override
    def bind(self, device: Union[torch.device, str], facts: DeviceFacts, strategy: Any = None) -> None:
        before = self.device_facts
        super().bind(device, facts, strategy)
        if self.device_facts is not before:  # checked once per device: before any layer converts
            check_float8_device(self.device_facts, self.emulate)
        if strategy is not None:
            from lightning.pytorch.strategies import ModelParallelStrategy

            check_float8_strategy(strategy)
            self._fsdp_float8_all_gather = isinstance(strategy, ModelParallelStrategy) and self.recipe == "tensorwise"

    @override
    def convert(self, module: Module, name: str) -> Module:
        if not name and _is_fully_sharded(module):
            self._check_nothing_left_after_sharding(module)
            return module
        config = float8_config(self.recipe, self.emulate, self._fsdp_float8_all_gather)
        on_cpu = self.bound_device is not None and self.bound_device.type == "cpu"
        root, prefix = module, (f"{name}." if name else "")
        if isinstance(module, nn.Linear):  # torchao converts a root Linear by returning a new module
            root, prefix = nn.ModuleDict({name or "linear": module}), ""
        report = convert_linears_to_float8(root, config, self.module_filter, self.recipe, prefix, cpu_autocast_hook=on_cpu)
        seen = {fqn for fqn, _, _ in self.conversion_report}  # skipped layers are seen again in setup
        self.conversion_report.extend(row for row in report if row[0] not in seen)
        return root[name or "linear"] if root is not module else module

    @override
    def convert_module(self, module: Module) -> Module:
        module = super().convert_module(module)
        converted = sum(reason is None for _, _, reason in self.conversion_report)
        rank_zero_info(format_conversion_table(self.conversion_report, self.recipe))
        message = nothing_converted_message(self.conversion_report, self.recipe, type(module).__name__)
        if message is not None and not self._warned_nothing_converted:
            self._warned_nothing_converted = True
            rank_zero_warn(message)
        if converted and not is_compiled(module) and not self._warned_not_compiled:
            self._warned_not_compiled = True
            rank_zero_warn(
                "Float8Precision: the model is not compiled, and float8 without torch.compile is several times "
                f"slower than bf16. Compile it: {option('GPTModule', 'compile', True)}, `self.model.compile()` in configure_model, "
                "or trainer.fit(torch.compile(module))."
            )
        return module

    def _check_nothing_left_after_sharding(self, module: Module) -> None:
        # FSDP2 has already sharded the model (in configure_model): a Linear converted now would keep
        # FSDP's hooks on the old layer. Report layers the filter would have converted, with the fix.
        from torchao.float8.float8_linear import Float8Linear

        seen = {name for name, _, _ in self.conversion_report}
        tied = frozenset(id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding))
        missed = [
            fqn
            for fqn, m in module.named_modules()
            if isinstance(m, nn.Linear)
            and not isinstance(m, Float8Linear)
            and fqn not in seen
            and skip_reason(m, fqn, self.module_filter, self.recipe, tied) is None
        ]
        if missed:
            raise RuntimeError(
                f"Float8Precision could not convert {missed[:3]}{'...' if len(missed) > 3 else ''} to float8: they "
                "were built outside configure_model and have been sharded by FSDP2 already. Build the model in "
                "configure_model (assign it with `self.model = ...` before calling fully_shard) so Float8Precision "
                "converts it first."
            )

    @override
    def optimizer_step(
        self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if self._fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # One all-reduce for the amax of every float8 weight, instead of one per layer per forward.
            precompute_float8_dynamic_scale_for_fsdp(model)
        return output


def _is_fully_sharded(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())
