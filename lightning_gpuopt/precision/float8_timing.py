"""Timing one Linear shape in bf16 against a float8 recipe, on a given device: the measurements behind
``Float8Precision``'s default filter (``docs/precision.md``, "Which layers convert").

Two ways, both plain functions of ``(tokens, in, out)`` and a device (and the output head inside the chunked
loss, :func:`loss_head_timing`: its GEMMs as :func:`gemm_timing`'s, its casts those of ``model/loss.py``'s float8 head):

* :func:`gemm_timing`: the three GEMMs of a Linear's forward and backward (output, input gradient, weight
  gradient) in bf16 ``mm`` against ``torch._scaled_mm`` with the recipe's operand layouts and scales, plus
  the recipe's casts modelled as bytes (:func:`cast_bytes`) over a copy bandwidth timed once; no compile.
* :func:`linear_timing`: a compiled ``Linear`` (with its bias, when it has one) forward and backward under
  bf16 autocast, against torchao's ``Float8Linear`` of the recipe, casts and bias passes included.
  Two compiles per shape.

On a CUDA device the time is CUDA events'; elsewhere the wall clock's (which only exercises the code: a
CPU has no float8 tensor cores, so its figures decide nothing).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = [
    "MAX_TIMED_TOKENS",
    "ShapeTiming",
    "cast_bytes",
    "copy_bandwidth",
    "gemm_timing",
    "linear_timing",
    "loss_head_cast_bytes",
    "loss_head_timing",
    "time_ms",
]

# The tokens (M) a shape is timed at, at most: a larger micro-batch is timed at this many. The timing's tensors
# (M x max(in, out) in bf16 and float8, several of them) and seconds grow with M; at 65,536 tokens every GEMM of
# the presets is compute-bound, so the float8/bf16 ratio is that of a larger M (an assumption: docs/precision.md).
MAX_TIMED_TOKENS = 65536
_BF16, _FP8 = 2, 1  # bytes per element


@dataclass(frozen=True)
class ShapeTiming:
    """Milliseconds of one Linear's forward and backward at one shape: bf16 against float8 (casts included)."""

    bf16_ms: float
    float8_ms: float

    @property
    def speedup(self) -> float:
        """bf16 time over float8 time: above 1 where float8 is faster."""
        return self.bf16_ms / max(self.float8_ms, 1e-12)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Mean milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - began) / repeats


def cast_bytes(tokens: int, in_features: int, out_features: int, recipe: str) -> int:
    """Bytes the recipe's dynamic casts read and write in one forward and backward of a Linear, unfused.

    The model of torchao's ``get_tensor_memory_traffic_ovhd_s`` (``torchao/testing/training/roofline_utils.py``,
    0.18) with no fusion into the previous op: per tensor (input M x in, weight out x in, output gradient
    M x out), tensorwise reads it once for its amax and once to write float8 in both layouts; rowwise casts
    per row and per column, with a bf16 transpose between; ``rowwise_with_gw_hp`` casts only what the output and
    input-gradient GEMMs read.
    """
    x, w, g = tokens * in_features, out_features * in_features, tokens * out_features
    if recipe == "tensorwise":
        per_activation = 2 * _BF16 + 2 * _FP8  # amax read, then one read writing both layouts
        weight = _BF16 * w + 2 * (_BF16 * w + _FP8 * w)  # amax, then a cast per layout (forward, backward)
        return per_activation * (x + g) + weight
    if recipe == "rowwise":
        per_activation = (2 * _BF16 + _FP8) + (_BF16 + _FP8)  # rows cast and a bf16 transpose, then the columns
        weight = (_BF16 + _FP8) * w + 2 * _BF16 * w + (_BF16 + _FP8) * w
        return per_activation * (x + g) + weight
    if recipe == "rowwise_with_gw_hp":
        return (_BF16 + _FP8) * (x + w + g)
    raise ValueError(f"Unknown float8 recipe {recipe!r}: choose tensorwise, rowwise or rowwise_with_gw_hp.")


def loss_head_cast_bytes(tokens: int, in_features: int, out_features: int, chunks: int) -> int:
    """Bytes the chunked loss's float8 head (``model/loss.py``, ``head_float8``) moves per chunk of ``tokens`` rows
    beyond what its bf16 form moves, with ``chunks`` chunks per micro-batch.

    The float32 weight is read for its amax and again to write e4m3 in both layouts once per micro-batch (a
    ``1 / chunks`` share here), counted whole: the bf16 form's own cast of the float32 weight is not taken off, a
    margin against float8; the chunk's bf16 hidden states are read for their amax, cast, and copied into the column
    layout; the logits' gradient needs no amax (a fixed scale), and its two e5m2 layouts (a byte an entry each) are
    counted as the bf16 gradient's two bytes; each chunk after the first adds its float32 weight gradient to the sum
    in a pass of its own, where the bf16 form accumulates in the GEMM.
    """
    x, w = tokens * in_features, out_features * in_features
    weight = (4 + 4 + 2 * _FP8) * w / chunks
    hidden = (2 * _BF16 + _FP8 + 2 * _FP8) * x
    weight_grad_adds = 8 * w * (chunks - 1) / chunks  # write the chunk's float32 result, read it back
    return int(weight + hidden + weight_grad_adds)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write) on ``device``: the casts' bandwidth."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=2, repeats=5)
    return 2 * src.numel() / (ms / 1000)


def _scales(rows: int, cols: int, rowwise: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if rowwise:  # (rows, 1) for the left operand, (1, cols) for the right one, as torch._scaled_mm takes them
        return torch.ones(rows, 1, device=device), torch.ones(1, cols, device=device)
    one = torch.ones((), device=device)
    return one, one


def _float8_gemms(tokens: int, k: int, n: int, recipe: str, device: torch.device) -> Callable[[], None]:
    # The operands torchao's Float8Linear hands torch._scaled_mm: the left one row-major, the right one column-major.
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    rowwise = recipe != "tensorwise"
    grad_dtype = e5m2 if recipe == "tensorwise" else e4m3
    x = torch.randn(tokens, k, device=device).to(e4m3)  # (M, K)
    w = torch.randn(n, k, device=device).to(e4m3)  # (N, K)
    g = torch.randn(tokens, n, device=device).to(grad_dtype)  # (M, N)
    w_cols = w.t().contiguous().t()  # (N, K) column-major: the right operand of g @ w
    g_t, x_cols = g.t().contiguous(), x.t().contiguous().t()  # (N, M) row-major, (M, K) column-major
    # rowwise_with_gw_hp computes the weight gradient in bf16: its operands, only for that recipe
    x_hp, g_hp = (x.to(torch.bfloat16), g.to(torch.bfloat16)) if recipe == "rowwise_with_gw_hp" else (None, None)
    out_scales, gi_scales = _scales(tokens, n, rowwise, device), _scales(tokens, k, rowwise, device)
    gw_scales = _scales(n, k, rowwise, device)
    fast = recipe == "tensorwise"  # torchao's tensorwise accumulates the output GEMM fast

    def run() -> None:
        torch._scaled_mm(x, w.t(), *out_scales, out_dtype=torch.bfloat16, use_fast_accum=fast)  # (M, N)
        torch._scaled_mm(g, w_cols, *gi_scales, out_dtype=torch.bfloat16)  # (M, K)
        if recipe == "rowwise_with_gw_hp":
            g_hp.t() @ x_hp  # (N, K), in bf16 as that recipe computes it
        else:
            torch._scaled_mm(g_t, x_cols, *gw_scales, out_dtype=torch.bfloat16)  # (N, K)

    return run


def _bf16_gemms(tokens: int, k: int, n: int, device: torch.device) -> Callable[[], None]:
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)  # (M, K)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)  # (N, K)
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)  # (M, N)

    def run() -> None:
        x @ w.t()  # (M, N)
        g @ w  # (M, K)
        g.t() @ x  # (N, K)

    return run


def gemm_timing(
    tokens: int, in_features: int, out_features: int, recipe: str, device: torch.device, bandwidth: float,
    repeats: int = 10, casts: Optional[int] = None,
) -> ShapeTiming:
    """bf16 against float8 milliseconds of a Linear's three GEMMs at ``tokens`` x ``in_features`` ->
    ``out_features``, the float8 side with its casts modelled: ``casts`` bytes (default :func:`cast_bytes`) over
    ``bandwidth`` (bytes/s, :func:`copy_bandwidth`); each the mean of ``repeats`` runs after 3 warm-ups (1: none)."""
    warmup = 3 if repeats > 1 else 0
    bf16 = time_ms(_bf16_gemms(tokens, in_features, out_features, device), device, warmup, repeats)
    float8 = time_ms(_float8_gemms(tokens, in_features, out_features, recipe, device), device, warmup, repeats)
    if casts is None:
        casts = cast_bytes(tokens, in_features, out_features, recipe)
    return ShapeTiming(bf16_ms=bf16, float8_ms=float8 + 1000 * casts / bandwidth)


def loss_head_timing(
    tokens: int, in_features: int, out_features: int, chunks: int, device: torch.device, bandwidth: float,
    repeats: int = 10,
) -> ShapeTiming:
    """bf16 against float8 milliseconds of one chunk of the chunked loss's head (``tokens`` rows, ``chunks`` per
    micro-batch): the three GEMMs with tensorwise scales (the head's), the casts :func:`loss_head_cast_bytes`."""
    casts = loss_head_cast_bytes(tokens, in_features, out_features, chunks)
    return gemm_timing(tokens, in_features, out_features, "tensorwise", device, bandwidth, repeats, casts)


def _linear_step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, device: torch.device) -> Callable[[], None]:
    compiled = torch.compile(layer)

    def run() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = compiled(x)  # (M, out)
        y.backward(g)

    return run


def linear_timing(
    tokens: int, in_features: int, out_features: int, bias: bool, config: Any, device: torch.device
) -> ShapeTiming:
    """bf16 against float8 milliseconds of a compiled ``Linear(in_features, out_features, bias)`` forward and
    backward under bf16 autocast at ``tokens`` rows, float32 weights as in training; the float8 side is
    torchao's ``Float8Linear`` with ``config`` (``float8_layers.float8_config(recipe, emulate)``)."""
    from torchao.float8.float8_linear import Float8Linear

    linear = nn.Linear(in_features, out_features, bias=bias, device=device)
    float8 = Float8Linear.from_float(copy.deepcopy(linear), config=config)
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)  # (M, in)
    g = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)  # (M, out)
    bf16_ms = time_ms(_linear_step(linear, x, g, device), device, repeats=5)
    float8_ms = time_ms(_linear_step(float8, x, g, device), device, repeats=5)
    return ShapeTiming(bf16_ms=bf16_ms, float8_ms=float8_ms)
