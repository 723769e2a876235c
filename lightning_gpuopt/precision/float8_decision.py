"""Which Linear shapes run in float8: decided from timings on the training GPU, cached, and the same on every rank.

Plain functions behind ``Float8Precision``'s default filter (``docs/precision.md``, "Which layers convert"):
:func:`decide` turns per-shape timings into a :class:`Float8Decision` (a shape converts where float8 is at
least 5% faster; the whole model stays bf16 when all of it saves under 3% of a bf16 step);
:func:`static_decision` is torchao's size rule, the fallback where nothing can be timed;
:func:`measured_decision` times what the cache lacks; :func:`decided_on_rank_zero` runs it on rank 0 and
hands its decision (or its failure) to the others.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_gpuopt.precision.float8_timing import MAX_TIMED_TOKENS, ShapeTiming

__all__ = [
    "MIN_SPEEDUP",
    "MIN_STEP_SAVING",
    "Float8Decision",
    "Shape",
    "ShapeDecision",
    "TimingCache",
    "decided_on_rank_zero",
    "decide",
    "format_decision_table",
    "loss_head_shape",
    "measured_decision",
    "static_too_small",
    "static_decision",
    "timing_cache_file",
]

MIN_SPEEDUP = 0.05  # a shape converts where float8 takes at most 95% of bf16's time
MIN_STEP_SAVING = 0.03  # below this share of the bf16 step, the whole model stays in bf16
_CACHE_VERSION = 1

# (tokens M, in_features, out_features, bias): one distinct Linear shape of a micro-batch's forward and backward.
Shape = tuple[int, int, int, bool]


@dataclass(frozen=True)
class ShapeDecision:
    """One distinct shape: how many layers have it, its timings (``None`` under the static rule), the verdict."""

    tokens: int
    in_features: int
    out_features: int
    bias: bool
    layers: int
    bf16_ms: Optional[float]
    float8_ms: Optional[float]
    convert: bool
    reason: str  # why it converts or not, for the table
    loss_head: bool = False  # the output head inside the module's chunked loss (precision.base.LossHead), no Linear


@dataclass(frozen=True)
class Float8Decision:
    """The shapes that run in float8, how that was decided (``method``), and why the whole model declined, if it did.

    ``method``: ``"gemm"`` or ``"linear"`` (timed, :mod:`~lightning_gpuopt.precision.float8_timing`), ``"static"``
    (torchao's size rule), ``"checkpoint"`` (restored from a resumed run).
    """

    recipe: str
    method: str
    shapes: tuple[ShapeDecision, ...]
    declined: Optional[str] = None
    step_ms: Optional[float] = None  # the bf16 step the saving was judged against

    def shape(self, in_features: int, out_features: int, bias: bool) -> Optional[ShapeDecision]:
        """The row of a Linear layer of this shape, or ``None`` when the decision did not see it."""
        for row in self.shapes:
            if (row.in_features, row.out_features, row.bias) == (in_features, out_features, bias) and not row.loss_head:
                return row
        return None

    def loss_head(self) -> Optional[ShapeDecision]:
        """The row of the output head inside the module's chunked loss, or ``None`` when it was not timed."""
        return next((row for row in self.shapes if row.loss_head), None)

    def converted_shapes(self) -> set[tuple[int, int, bool]]:
        """``(in, out, bias)`` of the Linear shapes that convert (the loss head: :meth:`loss_head`)."""
        return {(r.in_features, r.out_features, r.bias) for r in self.shapes if r.convert and not r.loss_head}

    def converts_loss_head(self) -> bool:
        """Whether the output head inside the module's chunked loss runs in float8."""
        row = self.loss_head()
        return row is not None and row.convert

    def to_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint holding them loads with ``weights_only=True``)."""
        return {**asdict(self), "shapes": [asdict(r) for r in self.shapes]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "Float8Decision":
        return cls(**{**state, "shapes": tuple(ShapeDecision(**r) for r in state["shapes"])})


def loss_head_shape(chunk: int, in_features: int, out_features: int, tokens: int) -> tuple[Shape, int]:
    """The shape an output head inside a chunked loss is timed at, and its count: ``chunk`` rows per chunk (a
    micro-batch of fewer ``tokens`` than that: one chunk of them, padded to a multiple of 16 rows as the eager loss
    pads it; the compiled one pads to a power of two), and the chunks per micro-batch (a shorter tail counted whole).
    """
    return (min(chunk, -(-tokens // 16) * 16), in_features, out_features, False), -(-tokens // chunk)


def static_too_small(in_features: int, out_features: int, recipe: str) -> Optional[str]:
    """torchao 0.18's ``_auto_filter_for_recipe`` size rule (``N, K = weight.shape``: N out, K in): the rule
    that skips a shape, or ``None``; ``rowwise_with_gw_hp`` (no rule in torchao) takes the rowwise one."""
    if recipe == "tensorwise":
        return "in<=4096 and out<=1024" if in_features <= 4096 and out_features <= 1024 else None
    if out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048):
        return "out<=2048, in<=1024 or (out<=4096 and in<=2048)"
    return None


def static_decision(counts: Mapping[Shape, int], recipe: str, why: str) -> Float8Decision:
    """The decision of torchao's size rule (:func:`static_too_small`) for ``counts`` (layers per shape);
    ``why``: why nothing was timed, for the table."""
    rows = []
    for (tokens, k, n, bias), layers in sorted(counts.items()):
        rule = static_too_small(k, n, recipe)
        reason = f"torchao's rule: too small ({rule})" if rule else "torchao's rule: large enough"
        rows.append(ShapeDecision(tokens, k, n, bias, layers, None, None, rule is None, reason))
    return Float8Decision(recipe, f"static ({why})" if why else "static", tuple(rows))


def decide(
    timings: Mapping[Shape, ShapeTiming],
    counts: Mapping[Shape, int],
    recipe: str,
    step_ms: float,
    method: str,
    min_speedup: float = MIN_SPEEDUP,
    min_step_saving: float = MIN_STEP_SAVING,
    loss_head: Optional[Shape] = None,
) -> Float8Decision:
    """Convert a shape where float8 takes at most ``1 - min_speedup`` of bf16's time; keep the whole model in
    bf16 when the converted layers together save under ``min_step_saving`` of ``step_ms`` (the bf16 step).
    ``loss_head``: the shape in ``counts`` that is the output head inside the chunked loss (its count: chunks).

    Example::

        shape = (8192, 2048, 8192, False)
        d = decide({shape: ShapeTiming(1.0, 0.7)}, {shape: 16}, "tensorwise", step_ms=100.0, method="gemm")
        d.shapes[0].convert  # True: 0.7 <= 0.95 ms, and 16 x 0.3 ms is 4.8% of the step
    """
    rows, saving = [], 0.0
    for shape, layers in sorted(counts.items()):
        t = timings[shape]
        convert = t.float8_ms <= (1 - min_speedup) * t.bf16_ms
        if convert:
            saving += layers * (t.bf16_ms - t.float8_ms)
            reason = f"float8 {t.speedup:.2f}x as fast"
        else:
            reason = f"float8 {t.speedup:.2f}x: not {1 + min_speedup:.2f}x faster"
        rows.append(ShapeDecision(*shape, layers, t.bf16_ms, t.float8_ms, convert, reason, shape == loss_head))
    declined = None
    if any(r.convert for r in rows) and saving < min_step_saving * step_ms:
        declined = (
            f"the converted layers would save {saving:.2f} ms of a {step_ms:.1f} ms bf16 step "
            f"({100 * saving / step_ms:.1f}% < {100 * min_step_saving:.0f}%)"
        )
        rows = [replace(r, convert=False, reason=r.reason + "; model declined") if r.convert else r for r in rows]
    return Float8Decision(recipe, method, tuple(rows), declined=declined, step_ms=step_ms)


def timing_cache_file(cache_root: Path) -> Path:
    """Where the timings live under the package's cache folder (``$GPUOPT_CACHE_DIR``, ...)."""
    return cache_root / "float8" / "timings.json"


class TimingCache:
    """Shape timings and device ceilings on disk, keyed by everything they depend on; written atomically.

    A key holds the GPU, torch, CUDA, torchao, the recipe, the method and the shape, so another GPU or
    version is a miss. ``save`` merges with what another process wrote since ``load``.
    """

    def __init__(self, path: Path, versions: Mapping[str, str]) -> None:
        self.path = path
        self.prefix = "|".join(f"{k}={versions[k]}" for k in sorted(versions))
        self.entries: dict[str, Any] = self._read()
        self.new: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: timed again and rewritten
            return {}
        return data.get("entries", {}) if isinstance(data, dict) and data.get("version") == _CACHE_VERSION else {}

    def key(self, *parts: Any) -> str:
        return self.prefix + "|" + "|".join(str(p) for p in parts)

    def get(self, *parts: Any) -> Any:
        return self.entries.get(self.key(*parts))

    def put(self, value: Any, *parts: Any) -> None:
        self.entries[self.key(*parts)] = self.new[self.key(*parts)] = value

    def save(self) -> None:
        """Write the merged entries through a temporary sibling and ``os.replace`` (never half written)."""
        if not self.new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**self._read(), **self.new}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _CACHE_VERSION, "entries": merged}, f, indent=0, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.new = {}


def measured_decision(
    counts: Mapping[Shape, int],
    recipe: str,
    method: str,
    flops_per_micro_batch: float,
    time_shape: Callable[[Shape], ShapeTiming],
    matmul_ceiling: Callable[[], float],
    cache: TimingCache,
    loss_head: Optional[Shape] = None,
    time_loss_head: Optional[Callable[[Shape, int], ShapeTiming]] = None,
) -> Float8Decision:
    """Time the shapes ``cache`` lacks with ``time_shape``, then :func:`decide` against a bf16 step estimated as
    ``flops_per_micro_batch`` at the measured ``matmul_ceiling`` (FLOP/s; cached too). Saves the cache.

    ``loss_head``: the shape in ``counts`` of the output head inside the chunked loss (rows per chunk; its count:
    chunks per micro-batch), timed by ``time_loss_head(shape, chunks)`` (default: ``time_shape``) and cached apart."""
    timings = {}
    for shape in counts:
        timed = (min(shape[0], MAX_TIMED_TOKENS), *shape[1:])
        head = shape == loss_head
        parts = (recipe, method, "loss-head", counts[shape], *timed) if head else (recipe, method, *timed)
        found = cache.get(*parts)
        if found is None:
            t = time_loss_head(timed, counts[shape]) if head and time_loss_head is not None else time_shape(timed)
            found = {"bf16_ms": t.bf16_ms, "float8_ms": t.float8_ms}
            cache.put(found, *parts)
        scale = shape[0] / timed[0]  # a larger micro-batch: the timing at MAX_TIMED_TOKENS, scaled in proportion
        timings[shape] = ShapeTiming(found["bf16_ms"] * scale, found["float8_ms"] * scale)
    ceiling = cache.get("matmul_ceiling")
    if ceiling is None:
        ceiling = matmul_ceiling()
        cache.put(ceiling, "matmul_ceiling")
    cache.save()
    return decide(timings, counts, recipe, step_ms=1000 * flops_per_micro_batch / ceiling, method=method,
                  loss_head=loss_head)


@dataclass(frozen=True)
class _Failed:
    """What rank 0 sends the others when deciding raised there."""

    message: str


def decided_on_rank_zero(decide_fn: Callable[[], Any]) -> Any:
    """``decide_fn()`` run on global rank 0 only and its result given to every rank of the default process group
    (run here without one). Where it raises on rank 0, the other ranks raise too, naming it, instead of waiting in
    the broadcast for a result that never comes."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide_fn()
    if dist.get_rank() == 0:
        try:
            result = decide_fn()
        except BaseException as err:
            dist.broadcast_object_list([_Failed(f"{type(err).__name__}: {err}")], src=0)
            raise
        dist.broadcast_object_list([result], src=0)
        return result
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], _Failed):
        raise RuntimeError(
            f"Float8Precision: rank 0 failed while timing the float8 layers ({box[0].message}); its traceback "
            "says where. Every rank stops with it."
        )
    return box[0]


def format_decision_table(decision: Float8Decision) -> str:
    """The per-shape table: tokens, in x out (+bias), layers, bf16 ms, float8 ms, converted or not and why."""
    lines = [f"Float8Precision ({decision.recipe}) decided by {decision.method}:"]
    if decision.declined:
        lines[0] += f" the whole model stays in bf16: {decision.declined}."
    lines.append(f"  {'tokens':>7}  {'in x out':>14}  {'layers':>6}  {'bf16 ms':>8}  {'float8 ms':>9}  float8")
    for r in decision.shapes:
        shape = f"{r.in_features}x{r.out_features}{'+b' if r.bias else ''}{' loss' if r.loss_head else ''}"
        bf16 = "-" if r.bf16_ms is None else f"{r.bf16_ms:.3f}"
        fp8 = "-" if r.float8_ms is None else f"{r.float8_ms:.3f}"
        lines.append(f"  {r.tokens:>7}  {shape:>14}  {r.layers:>6}  {bf16:>8}  {fp8:>9}  "
                     f"{'yes' if r.convert else 'no'}: {r.reason}")
    return "\n".join(lines)
