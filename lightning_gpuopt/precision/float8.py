"""`Float8Precision`: torchao float8 training of Linear layers, under bfloat16 autocast.

By default a layer converts where a timing on the training GPU says float8 pays (``float8_decision.py``).
Layers convert by the named call ``convert_layers`` of a module that converts its own (``GPTModule``);
any other module's as ``configure_model`` assigns them (before FSDP2 or a compile), else in
``convert_module`` (before DDP wraps the model). ``docs/precision.md``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn import Module
from typing_extensions import override

from lightning_gpuopt.option_checks import check_choice, option
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.perf.device import DeviceFacts
from lightning_gpuopt.precision.base import DevicePrecision, LayerContext, LossHead
from lightning_gpuopt.precision.float8_decision import (
    Float8Decision,
    decided_on_rank_zero,
    format_decision_table,
    loss_head_shape,
    static_decision,
)
from lightning_gpuopt.precision.float8_layers import (
    RECIPES,
    Float8Recipe,
    candidate_shapes,
    convert_linears_to_float8,
    float8_config,
    format_conversion_table,
    nothing_converted_message,
    require_torchao,
    skip_reason,
)
from lightning_gpuopt.precision.float8_measure import (
    TIMINGS,
    ShapeTimer,
    match_decision,
    measure_on_device,
    planned_tokens,
    static_reason,
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
            "high precision (emulated: the float8 numerics, slowly, no speed-up). Set "
            f"{option('Float8Precision', 'emulate', True)} "
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
        module_filter: Which Linear layers to convert: ``"auto"`` (skips the output layer and dims not
            multiples of 16, then converts the shapes where float8 is at least 5% faster on this GPU,
            timed once and cached, and nothing when all of them save under 3% of a step; with nothing
            to time, torchao's size rule), ``"static"`` (torchao's size rule always:
            :func:`~.float8_layers.auto_skip_reason`), a list of layer-name patterns to skip
            (``["lm_head", "*.attn.*"]``), or a callable ``(module, fqn) -> bool``, True to convert.
        emulate: Emulate float8 matmuls in high precision, for CPU runs and GPUs older than SM 8.9
            (tests and debugging; slow; the ``"auto"`` filter then takes torchao's rule).
        timing: How ``"auto"`` times a shape: ``"gemm"`` (the three GEMMs, casts modelled; no compile)
            or ``"linear"`` (a compiled Linear forward and backward; two compiles per shape).

    Note:
        With ``ModelParallelStrategy``, build the model in ``configure_model`` and assign it to an
        attribute of the LightningModule (``self.model = ...``) before calling ``fully_shard``.
    """

    def __init__(
        self,
        recipe: Float8Recipe = "tensorwise",
        module_filter: Union[str, list[str], Callable[[nn.Module, str], bool]] = "auto",
        emulate: bool = False,
        timing: Literal["gemm", "linear"] = "gemm",
    ) -> None:
        require_torchao()
        check_choice("Float8Precision", "recipe", recipe, RECIPES)
        check_choice("Float8Precision", "timing", timing, TIMINGS)
        if isinstance(module_filter, str) and module_filter not in ("auto", "static"):
            raise ValueError(
                f"Float8Precision(module_filter={module_filter!r}): use 'auto', 'static', a list of layer-name "
                f"patterns to skip (e.g. [{module_filter!r}]), or a callable (module, fqn) -> bool."
            )
        if not (isinstance(module_filter, str) or callable(module_filter)):
            if not isinstance(module_filter, (list, tuple)) or not all(isinstance(p, str) for p in module_filter):
                raise ValueError(
                    f"Float8Precision(module_filter={module_filter!r}): expected 'auto', 'static', a list of "
                    "strings, or a callable."
                )
            module_filter = list(module_filter)
        super().__init__()
        self.recipe = recipe
        self.module_filter = module_filter
        self.emulate = emulate
        self.timing = timing
        self.conversion_report: list[tuple[str, str, Optional[str]]] = []
        self.decision: Optional[Float8Decision] = None  # the "auto" filter's, once made (saved in checkpoints)
        # Times shapes in place of the GPU (tests, or a harness of one's own): float8_measure.ShapeTimer.
        self.timer: Optional[ShapeTimer] = None
        self.timing_cache_root: Optional[Path] = None  # None: the package's cache folder ($GPUOPT_CACHE_DIR, ...)
        self._converted_root: Optional[Module] = None  # convert_module's module: a restored decision applies to it
        self._fsdp_float8_all_gather = False
        self._warned_not_compiled = False
        self._warned_nothing_converted = False

    @property
    def fp8(self) -> bool:
        """Whether a layer was converted (then it runs float8 matmuls; the rest runs in :attr:`compute_dtype`, bf16).
        ``False`` until the model is converted, and when no layer was."""
        return bool(self.float8_layers)

    @property
    def float8_layers(self) -> list[tuple[str, str]]:
        """``(name, "in x out")`` of the layers that run in float8."""
        return [(name, shape) for name, shape, reason in self.conversion_report if reason is None]

    def float8_flop_share(self, flops_per_token: Optional[float] = None) -> float:
        """The share of the model's training FLOPs that runs in float8: ``6 in out`` per token of each converted
        layer over ``flops_per_token`` (the whole model's; default: what the module's ``layer_context`` said),
        else over all its Linear layers'."""
        if flops_per_token is None and self.layer_context is not None:
            flops_per_token = self.layer_context.flops_per_token
        converted = sum(_matmul_size(shape) for _, shape in self.float8_layers)
        every = sum(_matmul_size(shape) for _, shape, _ in self.conversion_report)
        total = flops_per_token / 6 if flops_per_token else every
        return min(1.0, converted / total) if total else 0.0

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
        local_shape = self.layer_context.local_shape if self.layer_context is not None else None
        if self.module_filter == "auto":
            self.decision = self._decide(root, prefix, self.decision)
        report = convert_linears_to_float8(
            root, config, self.module_filter, self.recipe, prefix, cpu_autocast_hook=on_cpu, decision=self.decision,
            local_shape=local_shape,
        )
        seen = {fqn for fqn, _, _ in self.conversion_report}  # skipped layers are seen again in setup
        self.conversion_report.extend(row for row in report if row[0] not in seen)
        self._apply_loss_head()
        return root[name or "linear"] if root is not module else module

    def _loss_head_shape(self, context: Optional[LayerContext], tokens: Optional[int]) -> Optional[tuple]:
        """``((rows, in, out, False), chunks)`` of the output head inside the module's chunked loss, when it may
        run in float8 (the ``"auto"`` filter under the tensorwise recipe, whose scales the loss's float8 head
        uses), else ``None``."""
        head = context.loss_head if context is not None else None
        if head is None or not tokens or self.module_filter != "auto" or self.recipe != "tensorwise":
            return None
        if self._loss_head_blocked(head) is not None:
            return None
        return loss_head_shape(head.rows, head.in_features, head.out_features, tokens)

    def _loss_head_blocked(self, head: LossHead) -> Optional[str]:
        """Why this run's loss cannot run ``head`` in float8 at all, whatever a timing or a checkpoint says; ``None``:
        it can."""
        if head.unavailable is not None:
            return f"its GEMMs in the loss cannot run float8 in this run: {head.unavailable}"
        dims = _loss_head_dims(head)  # the loss would refuse them (model/loss.py's _check_float8_head)
        if dims is not None:
            return f"its GEMMs in the loss run float8 only with {dims}"
        facts = self.device_facts
        if facts is not None and facts.is_cuda and not facts.fp8:  # emulated: the loss calls torch._scaled_mm itself
            return f"its GEMMs in the loss need float8 matmuls, which {facts.describe()} has not"
        return None

    def _apply_loss_head(self) -> None:
        """Tell the module whether its loss head runs in float8 (the decision's row), and put it in the report."""
        head = self.layer_context.loss_head if self.layer_context is not None else None
        if head is None:
            return
        on = self.decision is not None and self.decision.converts_loss_head() and self._loss_head_blocked(head) is None
        head.use_float8(on)
        if self.module_filter != "auto":  # a filter of the user's: its own row for the head stays
            return
        row = (head.name, f"{head.in_features}x{head.out_features}", None if on else self._loss_head_reason())
        rows = [i for i, (fqn, _, _) in enumerate(self.conversion_report) if fqn == head.name]
        if rows:
            self.conversion_report[rows[0]] = row
        else:
            self.conversion_report.append(row)

    def _loss_head_reason(self) -> str:
        """Why the head inside the module's chunked loss stays in the compute dtype."""
        blocked = self._loss_head_blocked(self.layer_context.loss_head)
        if blocked is not None:
            return f"output layer ({blocked})"
        if self.recipe != "tensorwise":
            return "output layer (its GEMMs in the loss run float8 only under the tensorwise recipe)"
        row = self.decision.loss_head() if self.decision is not None else None
        if row is None:
            why = self.decision.method if self.decision is not None else "not decided"
            return f"output layer (its GEMMs in the loss run float8 only where a timing says so; {why})"
        if self.decision.declined:
            return f"output layer; in the loss: model declined: {self.decision.declined}"
        return f"output layer; in the loss: timed: {row.reason}"

    def _decide(self, root: Module, prefix: str, before: Optional[Float8Decision]) -> Optional[Float8Decision]:
        """The ``"auto"`` filter's decision for the Linear layers of ``root``: rank 0 times them (or takes torchao's
        rule where nothing can be timed) and every rank gets its decision. Shapes ``before`` decided are kept
        (a module that assigns its parts one by one is decided part by part)."""
        context = self.layer_context
        tokens = context.tokens if context is not None and context.tokens else planned_tokens(self.run_trainer())
        counts = candidate_shapes(root, tokens or 0, prefix, context.local_shape if context is not None else None)
        head = self._loss_head_shape(context, tokens)
        if before is not None:
            counts = {s: n for s, n in counts.items() if before.shape(s[1], s[2], s[3]) is None}
            if before.loss_head() is not None:
                head = None
        if head is not None and head[0] in counts:  # a Linear of the very same rows and shape: not told apart
            head = None
        if head is not None:
            counts[head[0]] = head[1]
        if before is not None and not counts:
            return before
        decision = self._decide_shapes(root, counts, tokens, context, head[0] if head is not None else None)
        return decision if before is None else replace(before, shapes=before.shapes + decision.shapes)

    def _decide_shapes(
        self, root: Module, counts: dict, tokens: Optional[int], context: Optional[LayerContext],
        loss_head: Optional[tuple] = None,
    ) -> Float8Decision:
        why = static_reason(self.device_facts, self.emulate, tokens, counts, self.timer is not None)
        if why is not None:
            if not tokens and counts and self.device_facts is not None and self.device_facts.fp8 and not self.emulate:
                rank_zero_warn(f"Float8Precision cannot time its layers on this GPU: {why}. It takes torchao's size "
                               "rule.")
            # torchao's rule is for Linear layers: the loss head runs float8 only by a timing
            return static_decision({s: n for s, n in counts.items() if s != loss_head}, self.recipe, why)
        flops_per_token = context.flops_per_token if context is not None and context.flops_per_token else None
        if flops_per_token is None:  # 6 FLOPs per parameter per token: the weights' matmuls, forward and backward
            flops_per_token = 6 * sum(p.numel() for p in root.parameters())
        config = float8_config(self.recipe, self.emulate)
        return decided_on_rank_zero(lambda: measure_on_device(
            counts, self.recipe, self.timing, config, flops_per_token * tokens, self.bound_device,
            self.device_facts, self.timer, self.timing_cache_root, loss_head,
        ))

    @override
    def state_dict(self) -> dict[str, Any]:
        """The ``"auto"`` filter's decision, so a resumed run converts the same layers (``load_state_dict``)."""
        state = super().state_dict()  # a GradScaler's, which a bf16 plugin has none of
        return {**state, "float8_decision": self.decision.to_dict()} if self.decision is not None else state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Convert the layers the saved decision converted, where this run decided otherwise (e.g. another GPU)."""
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "float8_decision"})
        saved = state_dict.get("float8_decision")
        if saved is None or self.module_filter != "auto":
            return
        restored = Float8Decision.from_dict(saved)
        head = self.layer_context.loss_head if self.layer_context is not None else None
        blocked = self._loss_head_blocked(head) if head is not None and restored.converts_loss_head() else None
        if blocked is not None:
            rank_zero_warn(f"Float8Precision: the checkpoint's run multiplied its output head in float8 inside the "
                           f"loss, but {blocked}; it runs in bf16 here, so the numerics differ from the saved run's.")
        if self.decision is not None and restored.converted_shapes() == self.decision.converted_shapes():
            if restored.converts_loss_head() != self.decision.converts_loss_head():
                self.decision = replace(restored, method="checkpoint")  # the same layers; the loss head as saved
                self._apply_loss_head()
                rank_zero_info(format_decision_table(self.decision))
            return
        root = self._converted_root
        if root is None or _is_fully_sharded(root):
            here = sorted(self.decision.converted_shapes()) if self.decision else "none"
            as_saved = " (the output head in the loss runs as saved)" if head is not None and blocked is None else ""
            rank_zero_warn(
                f"Float8Precision: the checkpoint converted the shapes {sorted(restored.converted_shapes())}, but "
                f"this run converted {here} and cannot change its layers now (FSDP2 has sharded them), so it keeps "
                f"its own{as_saved}: the float8 numerics differ from the saved run's."
            )
            if self.decision is not None and restored.converts_loss_head() != self.decision.converts_loss_head():
                # the head is the loss's flag, no layer to swap: its saved row replaces this run's
                rows = [r for r in self.decision.shapes if not r.loss_head]
                self.decision = replace(self.decision, shapes=(*rows, *(r for r in restored.shapes if r.loss_head)))
                self._apply_loss_head()
            return
        config = float8_config(self.recipe, self.emulate, self._fsdp_float8_all_gather)
        on_cpu = self.bound_device is not None and self.bound_device.type == "cpu"
        local_shape = self.layer_context.local_shape if self.layer_context is not None else None
        self.conversion_report = match_decision(root, restored, config, self.recipe, local_shape, on_cpu)
        self.decision = replace(restored, method="checkpoint")
        self._apply_loss_head()
        rank_zero_info(format_decision_table(self.decision))

    @override
    def convert_module(self, module: Module) -> Module:
        module = super().convert_module(module)
        self._converted_root = module
        converted = sum(reason is None for _, _, reason in self.conversion_report)
        if self.decision is not None:
            rank_zero_info(format_decision_table(self.decision))
        rank_zero_info(format_conversion_table(self.conversion_report, self.recipe))
        if converted:
            names = ", ".join(name for name, _ in self.float8_layers[:4]) + (", ..." if converted > 4 else "")
            rank_zero_info(f"Float8Precision: {converted} layers run in float8 ({names}): "
                           f"{100 * self.float8_flop_share():.1f}% of the model's training FLOPs.")
        message = nothing_converted_message(self.conversion_report, self.recipe, type(module).__name__)
        if message is not None and not self._warned_nothing_converted:
            self._warned_nothing_converted = True
            rank_zero_warn(message)
        if converted and not is_compiled(module) and not self._warned_not_compiled:
            self._warned_not_compiled = True
            rank_zero_warn(
                "Float8Precision: the model is not compiled, and float8 without torch.compile is several times "
                f"slower than bf16. Compile it: {option('GPTModule', 'compile', True)}, `self.model.compile()` in "
                "configure_model, or trainer.fit(torch.compile(module))."
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


def _loss_head_dims(head: LossHead) -> Optional[str]:
    """What keeps the head's GEMMs in the loss from ``torch._scaled_mm``, which multiplies dims that are multiples of
    16 only (its hidden size, vocabulary rows and rows per chunk), or ``None`` where nothing does."""
    if head.in_features % 16 or head.out_features % 16 or head.rows % 16:
        return (f"dims and chunk multiples of 16, not {head.in_features}x{head.out_features} in chunks of {head.rows} "
                "tokens")
    return None


def _matmul_size(shape: str) -> int:
    in_f, out_f = shape.split("x")
    return int(in_f) * int(out_f)


def _is_fully_sharded(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())
