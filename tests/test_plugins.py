"""Tests of BF16Precision and Float8Precision on CPU (float8 through torchao's emulation)."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace
from typing import Union

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from torch import nn

from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.plugins import BF16Precision, Float8Precision
from lightning_gpuopt.plugins.float8 import check_float8_device
from lightning_gpuopt.plugins.float8_conversion import (
    CONV1D_REASON,
    auto_skip_reason,
    convert_linears_to_float8,
    float8_config,
    format_conversion_table,
    is_compiled,
    is_conv1d_like,
    skip_reason,
)
from tests._plugins_helpers import LossRecorder, token_loader, tiny_gpt_module

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Float8Precision. the model is not compiled",
    "ignore:.*does not have many workers.*",
    "ignore:You defined a `validation_step`",
)
TINY = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)


def _trainer(plugin, max_steps=4, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(max_steps=max_steps, plugins=[plugin], **{**defaults, **kwargs})


class ProbeGPT(pl.LightningModule):
    """A GPT LightningModule that records what the precision plugin did inside the training step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(**TINY))
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        self.seen.update(
            autocast=torch.is_autocast_enabled("cpu"),
            autocast_dtype=torch.get_autocast_dtype("cpu"),
            logits_dtype=logits.dtype,
        )
        return self.model.loss(logits, targets)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for p in self.parameters() if p.grad is not None]
        self.seen["norm_before_clip"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.seen["norm_after_clip"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def on_before_optimizer_step(self, optimizer):
        self.seen["param_dtypes"] = {p.dtype for p in self.parameters()}
        self.seen["grad_dtypes"] = {p.grad.dtype for p in self.parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# ----------------------------------------------------------------------------------------------------
# BF16Precision
# ----------------------------------------------------------------------------------------------------


def test_bf16_autocasts_on_the_trainer_device_and_keeps_fp32_state():
    plugin = BF16Precision()
    module = ProbeGPT()
    trainer = _trainer(plugin, max_steps=2, gradient_clip_val=1.0)
    trainer.fit(module, train_dataloaders=token_loader(n_seq=16))
    assert plugin.device == "cpu" and plugin.precision == "bf16-mixed" and plugin.scaler is None
    assert plugin.compute_dtype == torch.bfloat16
    assert module.seen["autocast"] and module.seen["autocast_dtype"] == torch.bfloat16
    assert module.seen["logits_dtype"] == torch.bfloat16
    assert module.seen["param_dtypes"] == {torch.float32} and module.seen["grad_dtypes"] == {torch.float32}
    state = trainer.optimizers[0].state
    assert {v.dtype for s in state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert module.seen["norm_after_clip"] <= 1.0 + 1e-4


def test_plugins_are_built_without_initialising_cuda(monkeypatch):
    # A Trainer with strategy="ddp_fork"/"ddp_notebook" forks after the plugins are built: had they
    # initialised CUDA (current device, bf16 capability), every child would fail to use the GPU.
    def initialises_cuda():
        raise AssertionError("initialised CUDA while building a precision plugin")

    monkeypatch.setattr("lightning_gpuopt.plugins._autocast.num_cuda_devices", lambda: 1)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "_lazy_init", initialises_cuda)
    for plugin in (BF16Precision(), Float8Precision()):
        assert (plugin.device, plugin.precision, plugin.scaler) == ("cuda", "bf16-mixed", None)
    # The real device decides at setup (here the CPU a Trainer attaches).
    plugin = BF16Precision()
    monkeypatch.undo()
    trainer = _trainer(plugin, max_steps=1)
    trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=8))
    assert (plugin.device, plugin.precision) == ("cpu", "bf16-mixed")


def test_precision_is_decided_for_the_gpu_once_the_trainer_has_initialised_it(monkeypatch):
    # Callbacks' setup and configure_model (FSDP2's parameter dtype) read the precision before convert_module.
    # Before CUDA is initialised (the process that builds the Trainer) the plugin answers bf16 without
    # asking; once the Trainer has set its GPU, the first read asks that GPU: here a V100-like one.
    monkeypatch.setattr("lightning_gpuopt.plugins.bf16.supports_bf16", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plugin = BF16Precision()
    assert plugin.precision == "bf16-mixed" and plugin._bound_device is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="float16 autocast with a GradScaler"):
        assert plugin.precision == "16-mixed"
    assert plugin.device == "cuda" and plugin.compute_dtype == torch.float16 and plugin.scaler is not None
    # Built after CUDA was initialised (a notebook that used the GPU first): the same answer, scaler included.
    with pytest.warns(UserWarning, match="float16 autocast with a GradScaler"):
        late = BF16Precision()
        assert late.precision == "16-mixed" and isinstance(late.scaler, torch.amp.GradScaler)


def test_bf16_falls_back_to_fp16_with_grad_scaler_where_bf16_is_missing(monkeypatch):
    # Simulates a T4/V100 on CPU: the capability check says "no bf16".
    monkeypatch.setattr("lightning_gpuopt.plugins.bf16.supports_bf16", lambda device: False)
    plugin = BF16Precision()
    module = ProbeGPT()
    trainer = _trainer(plugin, max_steps=3, gradient_clip_val=0.5)
    with pytest.warns(UserWarning, match="float16 autocast with a GradScaler"):
        trainer.fit(module, train_dataloaders=token_loader(n_seq=24))
    assert plugin.precision == "16-mixed" and plugin.compute_dtype == torch.float16
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and trainer.scaler is plugin.scaler
    assert module.seen["autocast_dtype"] == torch.float16 and module.seen["logits_dtype"] == torch.float16
    assert module.seen["param_dtypes"] == {torch.float32} and module.seen["grad_dtypes"] == {torch.float32}
    # Clipping sees unscaled gradients: the norm is O(1), not O(scale = 65536).
    scale = plugin.scaler.get_scale()
    assert scale >= 1024
    assert 0 < module.seen["norm_before_clip"] < 100
    assert module.seen["norm_after_clip"] <= 0.5 + 1e-4
    assert "scale" in plugin.state_dict()


def test_throughput_monitor_reads_bf16_compute_dtype():
    assert _plugin_to_compute_dtype(BF16Precision()) == torch.bfloat16
    assert _plugin_to_compute_dtype(Float8Precision(emulate=True)) == torch.bfloat16
    assert Float8Precision(emulate=True).compute_dtype == torch.bfloat16


def test_throughput_monitor_runs_with_both_plugins():
    from lightning.pytorch.callbacks import ThroughputMonitor

    for plugin in (BF16Precision(), Float8Precision(emulate=True, module_filter=["lm_head"])):
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
        trainer = _trainer(plugin, max_steps=2, callbacks=[monitor])
        trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=16))
        assert _plugin_to_compute_dtype(trainer.precision_plugin) == torch.bfloat16


# ----------------------------------------------------------------------------------------------------
# Float8 filter and conversion (plain functions)
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# Float8Precision in a Trainer
# ----------------------------------------------------------------------------------------------------


def test_float8_converts_gptmodule_in_configure_model_and_trains():
    plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
    module = tiny_gpt_module()
    rec = LossRecorder()
    trainer = _trainer(plugin, max_steps=6, callbacks=[rec])
    with pytest.warns(UserWarning, match="not compiled.*GPTModule\\(compile=True\\)"):
        trainer.fit(module, train_dataloaders=token_loader(n_seq=64))
    converted = [n for n, _, r in plugin.conversion_report if r is None]
    assert len(converted) == 8 and all(n.startswith("model.transformer.h.") for n in converted)
    assert dict((n, r) for n, _, r in plugin.conversion_report)["model.lm_head"] == "matches 'lm_head'"
    assert len(plugin.conversion_report) == 9  # no layer reported twice
    assert isinstance(module.model.transformer.h[0].attn.c_attn, Float8Linear)
    assert module.model.transformer.h[0].attn.c_attn.config.emulate
    assert all(math.isfinite(x) for x in rec.losses) and rec.losses[-1] < rec.losses[0]
    # Parameters stay fp32 and the tied head still shares the embedding.
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.model.lm_head.weight is module.model.transformer.wte.weight


def test_float8_warns_about_compile_once_and_not_for_compiled_models(recwarn):
    plugin = Float8Precision(emulate=True, module_filter=[])
    module = tiny_gpt_module()
    module.configure_model()
    plugin.convert_module(module)
    plugin.convert_module(module)
    assert sum("not compiled" in str(w.message) for w in recwarn.list) == 1

    compiled = tiny_gpt_module(compile=True)
    compiled.configure_model()  # compiles in place (lazily)
    recwarn.clear()
    Float8Precision(emulate=True, module_filter=[]).convert_module(compiled)
    assert not any("not compiled" in str(w.message) for w in recwarn.list)
    assert isinstance(compiled.model.transformer.h[0].mlp.c_fc, Float8Linear)


class EncoderClassifier(pl.LightningModule):
    """A module this package did not write: nn.TransformerEncoderLayer blocks built in __init__."""

    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.head(self.encoder(self.embed(idx), is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(idx.size(1))))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("plugin_name", ["bf16", "fp8"])
def test_plugins_work_with_a_foreign_lightning_module(plugin_name):
    plugin = BF16Precision() if plugin_name == "bf16" else Float8Precision(recipe="rowwise", emulate=True, module_filter=[])
    module = EncoderClassifier()
    rec = LossRecorder()
    _trainer(plugin, max_steps=12, callbacks=[rec]).fit(module, train_dataloaders=token_loader(n_seq=96))
    assert rec.losses[-1] < rec.losses[0] - 0.3
    if plugin_name == "fp8":
        decisions = {n: r for n, _, r in plugin.conversion_report}
        assert decisions["encoder.layers.0.linear1"] is None and decisions["head"] is None
        assert "MultiheadAttention" in decisions["encoder.layers.0.self_attn.out_proj"]
        assert isinstance(module.encoder.layers[1].linear2, Float8Linear) and isinstance(module.head, Float8Linear)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_every_recipe_trains_on_cpu(recipe):
    plugin = Float8Precision(recipe=recipe, emulate=True, module_filter=["lm_head"])
    rec = LossRecorder()
    _trainer(plugin, max_steps=3, callbacks=[rec]).fit(tiny_gpt_module(), train_dataloaders=token_loader(n_seq=24))
    assert len(rec.losses) == 3 and all(math.isfinite(x) for x in rec.losses)


@pytest.mark.slow
def test_float8_loss_matches_bf16_after_200_steps():
    """Same data, seed and model: emulated float8 ends within 0.1 nats of bf16 (measured: 2.5614 vs 2.5627)."""
    final = {}
    for name, plugin in [("bf16", BF16Precision()), ("fp8", Float8Precision(emulate=True, module_filter=["lm_head"]))]:
        torch.manual_seed(0)
        rec = LossRecorder()
        module = tiny_gpt_module(n_head=2, n_embd=32, block_size=16, warmup_steps=20)
        loader = token_loader(seq_len=16, batch_size=4)
        _trainer(plugin, max_steps=200, callbacks=[rec]).fit(module, train_dataloaders=loader)
        final[name] = sum(rec.losses[-20:]) / 20
    print(f"final loss bf16={final['bf16']:.4f} fp8={final['fp8']:.4f} gap={final['fp8'] - final['bf16']:+.4f}")
    assert final["bf16"] < 3.0  # learned much of the Markov chain (ln 256 = 5.55 at the start)
    assert abs(final["fp8"] - final["bf16"]) < 0.1


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------


def test_float8_checkpoint_loads_into_plain_gpt_and_resumes(tmp_path):
    plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
    module = tiny_gpt_module()
    trainer = _trainer(plugin, max_steps=3)
    trainer.fit(module, train_dataloaders=token_loader(n_seq=32))
    path = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(path)

    checkpoint = torch.load(path, weights_only=True)  # plain tensors only: loads without torchao's globals
    state = checkpoint["state_dict"]
    reference = tiny_gpt_module()
    reference.configure_model()
    expected = reference.state_dict()
    assert list(state) == list(expected)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in expected.items()}
    assert all(type(v) is torch.Tensor for v in state.values())

    # 1) Inference in a plain GPT, fp32 and bf16.
    plain = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256))
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    for name, param in plain.state_dict().items():
        torch.testing.assert_close(param, module.model.state_dict()[name], rtol=0, atol=0)
    idx = torch.randint(0, 256, (2, 16))
    module.model.eval()
    with torch.no_grad():
        logits_plain = plain(idx)
        logits_bf16 = plain.to(torch.bfloat16)(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_fp8 = module.model(idx)
    assert logits_bf16.dtype == torch.bfloat16 and torch.isfinite(logits_bf16).all()
    # float8 rounding vs full precision: close, not equal
    assert (logits_plain - logits_fp8.float()).abs().mean() < 0.05 * logits_plain.abs().mean()

    # 2) Resume the float8 run.
    restored = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            restored.update({k: v.clone() for k, v in pl_module.state_dict().items()})

    plugin2 = Float8Precision(emulate=True, module_filter=["lm_head"])
    module2 = tiny_gpt_module()
    trainer2 = _trainer(plugin2, max_steps=5, callbacks=[Capture()])
    trainer2.fit(module2, train_dataloaders=token_loader(n_seq=32), ckpt_path=path)
    assert trainer2.global_step == 5
    assert isinstance(module2.model.transformer.h[0].mlp.c_fc, Float8Linear)
    for k, v in state.items():
        torch.testing.assert_close(restored[k], v, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------


def test_float8_argument_errors():
    with pytest.raises(ValueError, match="recipe='delayed'.*tensorwise"):
        Float8Precision(recipe="delayed")
    with pytest.raises(ValueError, match="module_filter='lm_head'.*list of layer-name patterns"):
        Float8Precision(module_filter="lm_head")
    with pytest.raises(ValueError, match="expected 'auto', a list of strings, or a callable"):
        Float8Precision(module_filter=[1, 2])
    with pytest.raises(ValueError, match="needs the 'tensorwise' recipe"):
        float8_config("rowwise", fsdp_float8_all_gather=True)


def test_float8_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes `import torchao.float8` fail
    with pytest.raises(ImportError, match=r'pip install "lightning-gpuopt\[fp8\]"'):
        Float8Precision()


def test_float8_on_pre_sm89_gpu_names_emulate_and_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"8\.0.*emulate=True.*BF16Precision"):
        check_float8_device(torch.device("cuda", 0), emulate=False)
    check_float8_device(torch.device("cuda", 0), emulate=True)  # emulation is allowed anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_float8_device(torch.device("cuda", 0), emulate=False)
    check_float8_device(torch.device("cpu"), emulate=False)

    # The plugin runs the check when it learns the Trainer's device, before converting anything.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    on_gpu = SimpleNamespace(_trainer=SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0))))
    with pytest.raises(RuntimeError, match="emulate=True"):
        Float8Precision()._setup_for(on_gpu)


def test_plugins_are_configurable_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--plugins", type=list[Union[BF16Precision, Float8Precision]])
    config = parser.parse_string(
        "plugins:\n"
        "  - class_path: lightning_gpuopt.plugins.Float8Precision\n"
        "    init_args: {recipe: rowwise, module_filter: [lm_head], emulate: true}\n"
        "  - class_path: lightning_gpuopt.plugins.BF16Precision\n"
    )
    fp8, bf16 = parser.instantiate(config).plugins
    assert (fp8.recipe, fp8.module_filter, fp8.emulate) == ("rowwise", ["lm_head"], True)
    assert isinstance(bf16, BF16Precision)


def test_float8_with_per_block_compile_trains_like_uncompiled():
    """GPTModule(compile=True)'s default (each block compiled on its own) over Float8Linear layers."""
    losses = {}
    for compile_ in (False, True):
        torch.manual_seed(0)
        plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
        module = tiny_gpt_module(compile=compile_)
        rec = LossRecorder()
        trainer = _trainer(plugin, max_steps=3, callbacks=[rec])
        trainer.fit(module, train_dataloaders=token_loader(n_seq=32))
        losses[compile_] = rec.losses
        assert isinstance(module.model.transformer.h[0].attn.c_attn, Float8Linear)
    blocks = module.model.transformer.h
    assert all(b._compiled_call_impl is not None for b in blocks) and module.model.compile_loss
    assert list(module.model.state_dict()) == [k.removeprefix("model.") for k in module.state_dict() if k.startswith("model.")]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-3, atol=1e-3)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D, written out: weight stored in x out, ``x @ weight + bias``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


class GPT2Like(pl.LightningModule):
    """GPT-2 projections as Conv1D, an nn.Linear head tied to the embedding (as in GPT2LMHeadModel)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(256, 64)
        self.c_fc, self.c_proj = Conv1D(8 * 64, 64), Conv1D(64, 8 * 64)
        self.lm_head = nn.Linear(64, 256, bias=False)
        self.lm_head.weight = self.wte.weight

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.lm_head(self.c_proj(self.c_fc(self.wte(idx))))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_float8_names_conv1d_layers_as_not_convertible_and_warns_once():
    plugin = Float8Precision(emulate=True)
    with pytest.warns(UserWarning, match="converted none") as record:
        trainer = _trainer(plugin, max_steps=2)
        trainer.fit(GPT2Like(), train_dataloaders=token_loader(n_seq=8))
        trainer = _trainer(plugin, max_steps=4)
        trainer.fit(GPT2Like(), train_dataloaders=token_loader(n_seq=8))
    messages = [str(w.message) for w in record if "converted none" in str(w.message)]
    assert len(messages) == 1
    # the largest layer is a Conv1D, named with its shape and the reason; the fix is named
    assert "c_fc (64x512), was skipped: Conv1D-style" in messages[0]
    assert "replace them with nn.Linear" in messages[0] and "BF16Precision" in messages[0]
    decisions = {n: (shape, r) for n, shape, r in plugin.conversion_report}
    assert decisions["c_fc"] == ("64x512", CONV1D_REASON) and decisions["c_proj"] == ("512x64", CONV1D_REASON)
    assert decisions["lm_head"][1] == "output layer"
    table = format_conversion_table(plugin.conversion_report, "tensorwise")
    assert "0 of 3 projection layers converted" in table and "c_fc" in table


def test_float8_auto_filter_on_a_tiny_model_warns_with_the_largest_layer_and_the_fix():
    plugin = Float8Precision(emulate=True)  # module_filter="auto": every layer of a tiny GPT is too small
    with pytest.warns(UserWarning, match=r"converted none of the 9 projection layers of GPTModule") as record:
        _trainer(plugin, max_steps=1).fit(tiny_gpt_module(), train_dataloaders=token_loader(n_seq=8))
    (message,) = [str(w.message) for w in record if "converted none" in str(w.message)]
    assert "too small for tensorwise FP8" in message and "module_filter=['lm_head']" in message
    # the largest layer: lm_head (64 x 256, padded vocab) or an MLP projection (64 x 256), both 16384 weights
    assert "(64x256)" in message


def test_conv1d_detection_is_structural():
    assert is_conv1d_like(Conv1D(192, 64))
    assert not is_conv1d_like(nn.Linear(64, 192))
    odd = Conv1D(192, 64)
    odd.nx = 32  # attributes that do not describe the weight
    assert not is_conv1d_like(odd)
