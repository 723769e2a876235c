"""What `Float8Precision` tells about its conversion: the table of layers, and the warning when none converted."""

from __future__ import annotations

from typing import Optional

__all__ = ["CONV1D_REASON", "format_conversion_table", "nothing_converted_message"]

CONV1D_REASON = "Conv1D-style layer (weight stored in x out): not convertible, only nn.Linear converts"
"""The skip reason of a Hugging Face GPT-2-style ``Conv1D`` projection (see ``float8_conversion``)."""


def format_conversion_table(report: list[tuple[str, str, Optional[str]]], recipe: str) -> str:
    """A short text table of converted and skipped layers, e.g. for the log.

    Example::

        rows = [("h.0.mlp.fc", "64x256", None), ("lm_head", "64x256", "output layer")]
        print(format_conversion_table(rows, "tensorwise"))

    Args:
        report: Rows ``(name, "in x out", skip reason or None)`` of ``convert_linears_to_float8``.
        recipe: The float8 recipe, for the title.
    """
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
    """The warning for a conversion that converted no layer (naming the largest skipped one and why); ``None`` otherwise.

    Example::

        nothing_converted_message([("lm_head", "64x256", "output layer")], "tensorwise", "GPTModule")

    Args:
        report: Rows of :func:`convert_linears_to_float8`.
        recipe: The float8 recipe.
        module_name: The model's class name, for the message.
    """
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
            "slower there: pass module_filter=['lm_head'] (or []) to convert them anyway"
        )
    fix.append("or use BF16Precision")
    return (
        f"Float8Precision ({recipe}) converted none of the {len(report)} projection layers of {module_name}, so "
        f"it trains in bf16 without float8 matmuls. The largest, {name} ({shape}), was skipped: {reason}. "
        + "; ".join(fix) + "."
    )
