"""Which linears become float8 (torchao's thresholds, patterns, callables, Conv1D) and how compiled models are
recognised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.perf.compiled import is_compiled
from lightning_gpuopt.precision.float8_layers import (
    auto_skip_reason,
    convert_linears_to_float8,
    float8_config,
    is_conv1d_like,
    skip_reason,
)
from tests.precision._helpers import (
    TINY,
    Conv1D,
)

torchao_float8 = pytest.importorskip("torchao.float8")


from torchao.float8.float8_linear import Float8Linear  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Float8Precision. the model is not compiled",
    "ignore:.*does not have many workers.*",
    "ignore:You defined a `validation_step`",
)


def _meta_linear(in_features: int, out_features: int) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(in_features, out_features)


@pytest.mark.parametrize(
    ("recipe", "in_f", "out_f", "converted"),
    [
        # tensorwise: skip if in <= 4096 and out <= 1024
        ("tensorwise", 4096, 1024, False),
        ("tensorwise", 4096, 2048, True),
        ("tensorwise", 8192, 1024, True),
        # rowwise: skip if out <= 2048, in <= 1024, or (out <= 4096 and in <= 2048)
        ("rowwise", 8192, 2048, False),
        ("rowwise", 1024, 8192, False),
        ("rowwise", 2048, 4096, False),
        ("rowwise", 2048, 8192, True),
        ("rowwise_with_gw_hp", 4096, 8192, True),
        ("rowwise_with_gw_hp", 1024, 8192, False),
    ],
)
def test_auto_filter_uses_torchao_thresholds(recipe, in_f, out_f, converted):
    reason = auto_skip_reason(_meta_linear(in_f, out_f), "blocks.0.mlp.fc", recipe)
    assert (reason is None) == converted
    if not converted:
        assert reason.startswith("too small")


def test_auto_filter_matches_torchao_own_filter():
    from torchao.float8 import _auto_filter_for_recipe

    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for in_f in (512, 1024, 2048, 4096, 8192):
            for out_f in (512, 1024, 2048, 4096, 8192):
                layer = _meta_linear(in_f, out_f)
                assert (auto_skip_reason(layer, "x", recipe) is None) == theirs(layer, "x"), (recipe, in_f, out_f)


def test_skip_reasons_output_layer_tied_weight_and_bad_dims():
    assert auto_skip_reason(_meta_linear(8192, 8192), "model.lm_head", "tensorwise") == "output layer"
    layer = _meta_linear(8192, 8192)
    assert auto_skip_reason(layer, "model.proj", "tensorwise", frozenset({id(layer.weight)})) == "output layer"
    odd = _meta_linear(8200, 8192)
    assert "not multiples of 16" in auto_skip_reason(odd, "a", "tensorwise")
    # Whatever the filter says, FP8 matmuls need dims that are multiples of 16.
    assert "not multiples of 16" in skip_reason(odd, "a", [], "tensorwise")
    assert "not multiples of 16" in skip_reason(odd, "a", lambda m, fqn: True, "tensorwise")


def test_pattern_and_callable_filters_on_gpt():
    model = GPT(GPTConfig(**TINY))
    report = convert_linears_to_float8(model, float8_config("tensorwise", emulate=True), ["lm_head", "*.attn.*"], "tensorwise")
    decisions = {name: reason for name, _, reason in report}
    assert decisions["lm_head"] == "matches 'lm_head'"
    assert decisions["transformer.h.0.attn.c_attn"] == "matches '*.attn.*'"
    assert decisions["transformer.h.1.mlp.c_fc"] is None
    assert isinstance(model.transformer.h[1].mlp.c_fc, Float8Linear)
    assert not isinstance(model.transformer.h[1].attn.c_proj, Float8Linear)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight

    model = GPT(GPTConfig(**TINY))
    only_fc = lambda module, fqn: fqn.endswith("c_fc")  # noqa: E731
    report = convert_linears_to_float8(model, float8_config("rowwise", emulate=True), only_fc, "rowwise")
    assert sorted(n for n, _, r in report if r is None) == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2


def test_auto_filter_skips_every_layer_of_a_tiny_gpt():
    model = GPT(GPTConfig(**TINY))
    report = convert_linears_to_float8(model, float8_config("tensorwise", emulate=True), "auto", "tensorwise")
    assert len(report) == 9  # 4 per block + lm_head
    assert all(reason is not None for _, _, reason in report)
    assert dict((n, r) for n, _, r in report)["lm_head"] == "output layer"
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_is_compiled_detects_wrappers_and_in_place_compile():
    model = GPT(GPTConfig(**TINY))
    assert not is_compiled(model)
    assert is_compiled(torch.compile(model))  # lazy: nothing compiles until called
    holder = nn.ModuleDict({"model": model})
    model.compile()
    assert is_compiled(holder)


def test_conv1d_detection_is_structural():
    assert is_conv1d_like(Conv1D(192, 64))
    assert not is_conv1d_like(nn.Linear(64, 192))
    odd = Conv1D(192, 64)
    odd.nx = 32  # attributes that do not describe the weight
    assert not is_conv1d_like(odd)


def test_importing_torchao_leaves_out_only_its_kernel_library_lines():
    """torchao logs "Failed to load ..._C*.so" for kernel libraries this torch build cannot load; our import
    of it leaves those lines out, and every other line torchao logs stays."""
    import subprocess
    import sys

    script = (
        "import logging\n"
        "seen = []\n"
        "class Seen(logging.Filter):\n"
        "    def filter(self, record):\n"
        "        seen.append(record.getMessage()); return True\n"
        "logging.getLogger('torchao').addFilter(Seen())  # before ours: sees every line torchao logs\n"
        "from lightning_gpuopt.precision.float8_layers import require_torchao\n"
        "require_torchao()\n"
        "logging.getLogger('torchao').warning('another torchao line')\n"
        "print(sum(m.startswith('Failed to load') for m in seen))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Failed to load" not in proc.stderr and "another torchao line" in proc.stderr
    assert "KernelPreference" not in proc.stderr  # torch's deprecation of torchao's enum registration (torch >= 2.13)
    if int(proc.stdout.split()[-1]) == 0:
        pytest.skip("torchao loaded all its kernel libraries here: there was no line to leave out")


LLAMA_PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.c_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.c_proj")


def test_every_projection_of_the_llama_style_gpt_converts_and_the_keys_stay():
    model = GPT(GPTConfig.from_name("llama-tiny", tie_embeddings=False))
    keys = {k: v.shape for k, v in model.state_dict().items()}
    report = convert_linears_to_float8(model, float8_config("tensorwise", emulate=True), ["lm_head"], "tensorwise")
    decisions = {name: reason for name, _, reason in report}
    assert sorted(n for n, r in decisions.items() if r is None) == sorted(
        f"transformer.h.{i}.{p}" for i in range(2) for p in LLAMA_PROJECTIONS)
    assert decisions["lm_head"] == "matches 'lm_head'" and type(model.lm_head) is nn.Linear
    assert isinstance(model.transformer.h[0].attn.k_proj, Float8Linear)  # 64 x 32: grouped heads, dims of 16
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    idx = torch.randint(0, 512, (2, 16))
    loss = model(idx, targets=idx)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_at_the_8b_shape_keeps_the_grouped_key_value_projections_in_bf16(recipe):
    """At Llama 3.1 8B (width 4096, 8 key/value heads of 128: k_proj and v_proj are 4096 x 1024) torchao's
    thresholds leave k_proj and v_proj in high precision and convert the other five projections."""
    from lightning_gpuopt.model.gpt import Block

    with torch.device("meta"):
        block = Block(GPTConfig.from_name("llama-8b"))
    reasons = {name: auto_skip_reason(m, name, recipe) for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert set(reasons) == set(LLAMA_PROJECTIONS)
    assert {name for name, reason in reasons.items() if reason is not None} == {"attn.k_proj", "attn.v_proj"}
    assert reasons["attn.k_proj"].startswith(f"too small for {recipe}")
