"""BF16Precision on CPU: autocast on the Trainer's device, fp32 state, the fp16 fallback, the compute dtype
Lightning reads."""

from __future__ import annotations

from typing import Union

import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

from lightning_gpuopt.precision import BF16Precision, Float8Precision
from tests.precision._helpers import (
    ProbeGPT,
    plugin_trainer,
    token_loader,
)

torchao_float8 = pytest.importorskip("torchao.float8")




pytestmark = pytest.mark.filterwarnings(
    "ignore:Float8Precision. the model is not compiled",
    "ignore:.*does not have many workers.*",
    "ignore:You defined a `validation_step`",
)


def test_bf16_autocasts_on_the_trainer_device_and_keeps_fp32_state():
    plugin = BF16Precision()
    module = ProbeGPT()
    trainer = plugin_trainer(plugin, max_steps=2, gradient_clip_val=1.0)
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

    monkeypatch.setattr("lightning_gpuopt.precision.autocast.num_cuda_devices", lambda: 1)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "_lazy_init", initialises_cuda)
    for plugin in (BF16Precision(), Float8Precision()):
        assert (plugin.device, plugin.precision, plugin.scaler) == ("cuda", "bf16-mixed", None)
    # The real device decides at setup (here the CPU a Trainer attaches).
    plugin = BF16Precision()
    monkeypatch.undo()
    trainer = plugin_trainer(plugin, max_steps=1)
    trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=8))
    assert (plugin.device, plugin.precision) == ("cpu", "bf16-mixed")


def test_precision_is_decided_for_the_gpu_once_the_trainer_has_initialised_it(monkeypatch):
    # Callbacks' setup and configure_model (FSDP2's parameter dtype) read the precision before convert_module.
    # Before CUDA is initialised (the process that builds the Trainer) the plugin answers bf16 without
    # asking; once the Trainer has set its GPU, the first read asks that GPU: here a V100-like one.
    monkeypatch.setattr("lightning_gpuopt.precision.bf16.supports_bf16", lambda device: False)
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
    monkeypatch.setattr("lightning_gpuopt.precision.bf16.supports_bf16", lambda device: False)
    plugin = BF16Precision()
    module = ProbeGPT()
    trainer = plugin_trainer(plugin, max_steps=3, gradient_clip_val=0.5)
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
        trainer = plugin_trainer(plugin, max_steps=2, callbacks=[monitor])
        trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=16))
        assert _plugin_to_compute_dtype(trainer.precision_plugin) == torch.bfloat16


def test_plugins_are_configurable_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--plugins", type=list[Union[BF16Precision, Float8Precision]])
    config = parser.parse_string(
        "plugins:\n"
        "  - class_path: lightning_gpuopt.precision.Float8Precision\n"
        "    init_args: {recipe: rowwise, module_filter: [lm_head], emulate: true}\n"
        "  - class_path: lightning_gpuopt.precision.BF16Precision\n"
    )
    fp8, bf16 = parser.instantiate(config).plugins
    assert (fp8.recipe, fp8.module_filter, fp8.emulate) == ("rowwise", ["lm_head"], True)
    assert isinstance(bf16, BF16Precision)
