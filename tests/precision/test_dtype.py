"""compute_dtype_name / is_fp8: our plugins state their own dtype; Lightning's are read from one table, row by row."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
)

from lightning_gpuopt.precision.dtype import LIGHTNING_PRECISIONS, compute_dtype_name, is_fp8
from lightning_gpuopt.precision import BF16Precision, Float8Precision
from lightning_gpuopt.precision.dtype import LIGHTNING_PRECISIONS, compute_dtype_name, is_fp8, tf32_enabled


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _transformer_engine(precision: str) -> TransformerEnginePrecision:
    # Its constructor needs the transformer_engine package; the row is about Lightning's class and string.
    plugin = TransformerEnginePrecision.__new__(TransformerEnginePrecision)
    plugin.precision = precision
    return plugin


LIGHTNING_ROWS = [
    (Precision, "fp32"),
    (lambda: FSDPPrecision("32-true"), "fp32"),
    (DoublePrecision, "fp64"),
    (lambda: MixedPrecision("16-mixed", "cpu"), "fp16"),
    (lambda: MixedPrecision("bf16-mixed", "cpu"), "bf16"),
    (lambda: FSDPPrecision("bf16-mixed"), "bf16"),
    (lambda: DeepSpeedPrecision("16-mixed"), "fp16"),
    (lambda: HalfPrecision("16-true"), "fp16"),
    (lambda: HalfPrecision("bf16-true"), "bf16"),
    (lambda: FSDPPrecision("bf16-true"), "bf16"),
    (lambda: _transformer_engine("transformer-engine"), "fp8"),
    (lambda: _transformer_engine("transformer-engine-float16"), "fp8"),
]


@pytest.mark.filterwarnings("ignore:.*GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize(("make", "expected"), LIGHTNING_ROWS)
def test_each_lightning_plugin_row(make, expected):
    plugin = make()
    assert LIGHTNING_PRECISIONS[plugin.precision] == expected
    assert compute_dtype_name(plugin) == expected
    assert is_fp8(plugin) is (expected == "fp8")


def test_every_table_row_is_covered_by_a_lightning_plugin():
    covered = {LIGHTNING_PRECISIONS[k] for k in LIGHTNING_PRECISIONS}
    assert covered == {expected for _, expected in LIGHTNING_ROWS}
    assert len(LIGHTNING_PRECISIONS) == 8


def test_fp32_counts_as_tf32_when_allowed():
    torch.set_float32_matmul_precision("high")
    assert compute_dtype_name(Precision()) == "tf32"
    assert compute_dtype_name(BF16Precision()) == "bf16"  # not an fp32 plugin: no TF32 rule


def test_our_plugins_state_their_own_dtype():
    bf16, fp8 = BF16Precision(), Float8Precision(emulate=True, module_filter=[])
    assert (bf16.compute_dtype, bf16.fp8) == (torch.bfloat16, False)
    assert (fp8.compute_dtype, fp8.fp8) == (torch.bfloat16, False)  # float8 only once a layer is converted
    assert (compute_dtype_name(bf16), is_fp8(bf16)) == ("bf16", False)
    assert (compute_dtype_name(fp8), is_fp8(fp8)) == ("bf16", False)
    fp8.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "")
    assert fp8.fp8 and (compute_dtype_name(fp8), is_fp8(fp8)) == ("fp8", True)


def test_a_plugin_is_asked_not_recognised_by_its_name():
    class Float8LookingPlugin(Precision):  # the name says float8, the plugin does not
        compute_dtype = torch.bfloat16

    class Quiet8(Precision):  # no telling name, but it states fp8
        fp8 = True

    assert (compute_dtype_name(Float8LookingPlugin()), is_fp8(Float8LookingPlugin())) == ("bf16", False)
    assert (compute_dtype_name(Quiet8()), is_fp8(Quiet8())) == ("fp8", True)


def test_a_custom_plugin_that_states_nothing_is_unknown():
    class Custom(Precision):
        pass

    assert compute_dtype_name(Custom()) is None and not is_fp8(Custom())


def test_tf32_read_through_the_new_api():
    # Set through `fp32_precision` (torch >= 2.9), the legacy flags can no longer be read.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert tf32_enabled() and compute_dtype_name(Precision()) == "tf32"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert not tf32_enabled() and compute_dtype_name(Precision()) == "fp32"
def test_clip_mixed_precision_unscales_a_fused_optimizer_once():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_gpuopt.precision.dtype import clip_mixed_precision

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
    plugin = MixedPrecision("16-mixed", "cpu")
    scale = plugin.scaler.get_scale()
    clip_mixed_precision(plugin, optimizer, 1.0)  # no gradients yet (a skipped backward): nothing unscaled
    for step in range(2):
        plugin.scaler.scale(layer(torch.randn(8, 16)).square().sum() * 100).backward()
        scaled = float(torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()]))
        clip_mixed_precision(plugin, optimizer, 1.0)
        clipped = float(torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()]))
        assert scaled > scale and clipped == pytest.approx(1.0, rel=1e-4)  # unscaled, then clipped
        grad = layer.weight.grad.clone()
        plugin.scaler.step(optimizer)
        plugin.scaler.update()
        if step == 0:  # the fused step saw the clipped gradients, not them divided by the scale again
            torch.testing.assert_close(optimizer.state[layer.weight]["exp_avg"], 0.1 * grad)
        optimizer.zero_grad()
    assert plugin.scaler.get_scale() == scale  # no step skipped
