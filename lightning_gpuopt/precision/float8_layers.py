"""Plain functions behind ``Float8Precision``: which Linear layers to convert, converting them, reporting it.

Every skipped layer comes with the reason, for the plugin's table; Hugging Face ``Conv1D`` layers are
listed as not convertible (``docs/precision.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union

import torch
from torch import nn

from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.precision.float8_decision import Float8Decision, Shape, static_too_small

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

from lightning_gpuopt.internals import COMPILED_PREFIX

__all__ = [
    "CONV1D_REASON",
    "FP8_INSTALL_HINT",
    "ORIGINAL_LAYER",
    "Float8Recipe",
    "ModuleFilter",
    "auto_skip_reason",
    "basic_skip_reason",
    "candidate_shapes",
    "convert_linears_to_float8",
    "float8_config",
    "format_conversion_table",
    "is_conv1d_like",
    "nothing_converted_message",
    "require_torchao",
    "skip_reason",
]

# The attribute of a converted Float8Linear holding the layer it replaced (convert_linears_to_float8).
ORIGINAL_LAYER = "_gpuopt_original_layer"
# The skip reason of a Hugging Face GPT-2-style ``Conv1D`` projection (:func:`is_conv1d_like`).
CONV1D_REASON = "Conv1D-style layer (weight stored in x out): not convertible, only nn.Linear converts"


def format_conversion_table(report: list[tuple[str, str, Optional[str]]], recipe: str) -> str:
    """A short text table of converted and skipped layers for the log, from ``(name, "in x out", skip reason
    or None)`` rows of :func:`convert_linears_to_float8`."""
    converted = sum(reason is None for _, _, reason in report)
    lines = [f"Float8Precision ({recipe}): {converted} of {len(report)} projection layers converted to float8"]
    width = max((len(name) for name, _, _ in report), default=4)
    lines.append(f"  {'layer'.ljust(width)}  {'in x out':>12}  float8")
    for name, shape, reason in report:
        lines.append(f"  {name.ljust(width)}  {shape:>12}  {'yes' if reason is None else 'no: ' + reason}")
    return "\n".join(lines)


def _size(shape: str) -> int:
    in_f, out_f = shape.split("x")
    return int(in_f) * int(out_f)


def nothing_converted_message(
    report: list[tuple[str, str, Optional[str]]], recipe: str, module_name: str
) -> Optional[str]:
    """The warning when no layer was converted (naming the largest skipped one and why); else ``None``."""
    if any(reason is None for _, _, reason in report):
        return None
    if not report:
        return (
            f"Float8Precision converted nothing: {module_name} has no nn.Linear layer, so it trains in bf16 "
            "without float8 matmuls. Use BF16Precision, or build the model's projections as nn.Linear."
        )
    name, shape, reason = max(report, key=lambda row: _size(row[1]))
    conv1d = sum(r == CONV1D_REASON for _, _, r in report)
    fix = []
    if conv1d:
        fix.append(
            f"{conv1d} are Conv1D-style layers (Hugging Face GPT-2), which are not convertible: replace them "
            "with nn.Linear (weight = conv.weight.T) before training"
        )
    if any(r and r.startswith("too small") for _, _, r in report):
        fix.append(
            "layers below torchao's size thresholds are skipped by module_filter='auto' because float8 would be "
            f"slower there: set {option('Float8Precision', 'module_filter', ['lm_head'])} (or []) to convert them "
            "anyway"
        )
    fix.append("or use BF16Precision")
    return (
        f"Float8Precision ({recipe}) converted none of the {len(report)} projection layers of {module_name}, so "
        f"it trains in bf16 without float8 matmuls. The largest, {name} ({shape}), was skipped: {reason}. "
        + "; ".join(fix) + "."
    )


Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# "auto", "static", patterns of layer names to skip, or a callable (module, fqn) -> True to convert.
ModuleFilter = Union[str, list[str], Callable[[nn.Module, str], bool]]
FP8_INSTALL_HINT = 'pip install "lightning-gpuopt[fp8]"'
# Names an output/classifier head usually has; the head is kept in high precision (as torchtitan does).
OUTPUT_LAYER_NAMES = frozenset({"lm_head", "output", "head", "classifier", "score", "out_head"})


# torchao logs one line per compiled kernel library (``_C*.so``) that does not load with this torch build
# (MX and CUTLASS kernels); the float8 training recipes here do not use them. Under torch >= 2.13 its import
# also makes torch log that registering its KernelPreference enum is deprecated: torchao's to change, not a user's.
_IMPORT_LINES = {
    "torchao": re.compile(r"Failed to load \S*_C\S*\.so: "),
    "torch.utils._pytree": re.compile(r"<enum 'KernelPreference'> is an Enum subclass"),
}


class _DropLines(logging.Filter):
    def __init__(self, line: re.Pattern) -> None:
        super().__init__()
        self.line = line

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.line.match(record.getMessage())


@contextlib.contextmanager
def _quiet_torchao_kernel_lines() -> Iterator[None]:
    """Leave out the lines of :data:`_IMPORT_LINES` while the block runs; other log lines stay."""
    filters = [(logging.getLogger(name), _DropLines(line)) for name, line in _IMPORT_LINES.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def require_torchao() -> None:
    """Raise an ``ImportError`` naming the ``fp8`` extra if ``torchao.float8`` cannot be imported."""
    try:
        with _quiet_torchao_kernel_lines():
            import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Float8Precision needs torchao: {FP8_INSTALL_HINT} (or pip install torchao).") from err


def float8_config(recipe: str, emulate: bool = False, fsdp_float8_all_gather: bool = False) -> Float8LinearConfig:
    """The torchao ``Float8LinearConfig`` of a recipe name, with ``emulate`` (float8 matmuls in high precision)
    and ``fsdp_float8_all_gather`` (FSDP2 weights all-gathered in float8, tensorwise only)."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in RECIPES:
        raise ValueError(f"Unknown float8 recipe {recipe!r}: choose one of {list(RECIPES)}.")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"Float8 all-gather needs the 'tensorwise' recipe, got {recipe!r}.")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def _is_output_layer(module: nn.Linear, fqn: str, tied_weights: frozenset[int]) -> bool:
    return fqn.rsplit(".", 1)[-1] in OUTPUT_LAYER_NAMES or id(module.weight) in tied_weights


def basic_skip_reason(module: nn.Linear, fqn: str, tied_weights: frozenset[int] = frozenset()) -> Optional[str]:
    """Why ``module`` is no candidate for the ``"auto"`` filter at all: the output layer (by name, or its weight in
    ``tied_weights``, the ``id()`` of embedding weights), or dims not multiples of 16 (``torch._scaled_mm``'s)."""
    if _is_output_layer(module, fqn, tied_weights):
        return "output layer"
    N, K = module.weight.shape
    if N % 16 or K % 16:
        return f"dims {K}x{N} not multiples of 16"
    return None


def auto_skip_reason(
    module: nn.Linear,
    fqn: str,
    recipe: str,
    tied_weights: frozenset[int] = frozenset(),
    decision: Optional[Float8Decision] = None,
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]] = None,
) -> Optional[str]:
    """Why the ``"auto"`` filter keeps ``module`` in high precision, or ``None`` to convert it.

    Skipped: :func:`basic_skip_reason`'s layers, then the shapes ``decision`` (timed on the GPU,
    ``float8_decision.py``) keeps in bf16, looked up by ``local_shape(fqn, in, out)`` (this rank's shard);
    without a decision, shapes below torchao 0.18's thresholds for the recipe (``_auto_filter_for_*``,
    measured on H100: :func:`~.float8_decision.static_too_small`; ``docs/precision.md``).
    """
    basic = basic_skip_reason(module, fqn, tied_weights)
    if basic is not None:
        return basic
    if decision is not None:
        in_f, out_f = module.in_features, module.out_features
        if local_shape is not None:
            in_f, out_f = local_shape(fqn, in_f, out_f)
        row = decision.shape(in_f, out_f, module.bias is not None)
        if row is None:
            return f"shape {in_f}x{out_f} was not timed (built after the decision)"
        if row.bf16_ms is not None:  # timed; an untimed row is torchao's rule, below
            if row.convert:
                return None
            return f"model declined: {decision.declined}" if decision.declined else f"timed: {row.reason}"
    # torchao publishes no thresholds for rowwise_with_gw_hp, which runs rowwise kernels for two of its three
    # matmuls: the rowwise ones apply.
    rule = static_too_small(module.in_features, module.out_features, recipe)
    return f"too small for {recipe} FP8 ({rule})" if rule else None


def skip_reason(
    module: nn.Linear,
    fqn: str,
    module_filter: ModuleFilter,
    recipe: str,
    tied_weights: frozenset[int] = frozenset(),
    decision: Optional[Float8Decision] = None,
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]] = None,
) -> Optional[str]:
    """Why ``module`` is not converted under ``module_filter``, or ``None`` to convert it.

    Args:
        module: A Linear layer (dims not multiples of 16 are skipped whatever the filter).
        fqn: Its name in the LightningModule's state dict (without ``_orig_mod.``).
        module_filter: ``"auto"`` (:func:`auto_skip_reason` with ``decision``), ``"static"`` (the same without
            one: torchao's rule), name patterns to skip (a substring of the name or an ``fnmatch`` glob of it),
            or a callable ``(module, fqn) -> bool``, True to convert.
        tied_weights: ``id()`` of weights shared with an ``nn.Embedding``.
        decision, local_shape: For ``"auto"``: the timed decision, and this rank's shard shape of a layer.
    """
    if isinstance(module_filter, str):
        timed = decision if module_filter == "auto" else None
        return auto_skip_reason(module, fqn, recipe, tied_weights, timed, local_shape)
    N, K = module.weight.shape
    if N % 16 or K % 16:
        return f"dims {K}x{N} not multiples of 16"
    if callable(module_filter):
        return None if module_filter(module, fqn) else "module_filter returned False"
    for pattern in module_filter:
        if pattern in fqn or fnmatch.fnmatchcase(fqn, pattern):
            return f"matches {pattern!r}"
    return None


def _cast_input_to_cpu_autocast_dtype(module: nn.Module, args: tuple) -> Optional[tuple]:
    # torchao's Float8Linear casts its input to the *CUDA* autocast dtype only; do the same for CPU
    # autocast so CPU-emulated float8 sees the same bf16 inputs as on the GPU (and every recipe's
    # high-precision matmuls get operands of one dtype).
    if args and args[0].device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")),) + tuple(args[1:])
    return None


def is_conv1d_like(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face GPT-2-style ``Conv1D`` (``weight`` of shape ``(nx, nf)``, in x out),
    recognised by structure, not class name, so copies of the class in other libraries count too."""
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (
        not isinstance(module, nn.Linear)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and isinstance(nx, int)
        and isinstance(nf, int)
        and tuple(weight.shape) == (nx, nf)
    )


def convert_linears_to_float8(
    root: nn.Module,
    config: Float8LinearConfig,
    module_filter: ModuleFilter,
    recipe: str,
    prefix: str = "",
    cpu_autocast_hook: bool = False,
    decision: Optional[Float8Decision] = None,
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]] = None,
) -> list[tuple[str, str, Optional[str]]]:
    """Swap the ``nn.Linear`` layers of ``root`` (not itself a Linear) that pass ``module_filter``
    (:func:`skip_reason`) for torchao ``Float8Linear``, in place; already converted ones are left alone.

    Args:
        config: From :func:`float8_config`; ``recipe``: the one it was made from (for the ``"auto"`` thresholds).
        prefix: Prepended to names given to the filter and in the report (e.g. ``"model."``).
        cpu_autocast_hook: Make converted layers follow CPU autocast (for CPU training).
        decision, local_shape: As :func:`skip_reason`'s.

    Returns:
        One ``(name, shape, skip reason or None)`` row per Linear layer newly considered.
    """
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    tied = frozenset(id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding))
    # nn.MultiheadAttention reads out_proj.weight directly and never calls out_proj's forward.
    mha_out = {id(m.out_proj) for m in root.modules() if isinstance(m, nn.MultiheadAttention)}
    report: list[tuple[str, str, Optional[str]]] = []
    swapped: dict[str, nn.Module] = {}  # fqn -> the layer a Float8Linear replaces

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
            return False
        name = prefix + fqn.replace(COMPILED_PREFIX, "")
        if id(module) in mha_out:
            reason: Optional[str] = "nn.MultiheadAttention.out_proj (its forward is never called)"
        else:
            reason = skip_reason(module, name, module_filter, recipe, tied, decision, local_shape)
        report.append((name, f"{module.in_features}x{module.out_features}", reason))
        if reason is None:
            swapped[fqn] = module
        return reason is None

    reported = {name for name, _, _ in report}
    for fqn, module in root.named_modules():
        name = prefix + fqn.replace(COMPILED_PREFIX, "")
        if is_conv1d_like(module) and name not in reported:
            report.append((name, f"{module.nx}x{module.nf}", CONV1D_REASON))
    convert_to_float8_training(root, module_filter_fn=keep, config=config)
    for fqn, layer in swapped.items():
        # Kept outside the module tree (no state-dict key, no submodule), for a restored decision that keeps this
        # layer in high precision (float8_measure.match_decision): it is put back with its class, hooks and
        # attributes. Without its parameters, which the float8 layer holds: a second reference would keep alive a
        # full parameter that FSDP2 replaces by its shard.
        layer.weight, layer.bias = None, None
        object.__setattr__(root.get_submodule(fqn), ORIGINAL_LAYER, layer)
    if cpu_autocast_hook:
        for module in root.modules():
            if isinstance(module, Float8Linear) and not getattr(module, "_gpuopt_cpu_hook", False):
                module.register_forward_pre_hook(_cast_input_to_cpu_autocast_dtype)
                module._gpuopt_cpu_hook = True
    return report


def candidate_shapes(
    root: nn.Module,
    tokens: int,
    prefix: str = "",
    local_shape: Optional[Callable[[str, int, int], tuple[int, int]]] = None,
) -> dict[Shape, int]:
    """Layers per distinct ``(tokens, in, out, bias)`` among the ``nn.Linear`` layers of ``root`` the ``"auto"``
    filter may convert (:func:`basic_skip_reason`), with ``local_shape(name, in, out)``: this rank's shard."""
    from torchao.float8.float8_linear import Float8Linear

    tied = frozenset(id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding))
    mha_out = {id(m.out_proj) for m in root.modules() if isinstance(m, nn.MultiheadAttention)}
    counts: dict[Shape, int] = {}
    for fqn, module in root.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear) or id(module) in mha_out:
            continue
        name = prefix + fqn.replace(COMPILED_PREFIX, "")
        if basic_skip_reason(module, name, tied) is not None:
            continue
        in_f, out_f = module.in_features, module.out_features
        if local_shape is not None:
            in_f, out_f = local_shape(name, in_f, out_f)
        shape = (tokens, in_f, out_f, module.bias is not None)
        counts[shape] = counts.get(shape, 0) + 1
    return counts
