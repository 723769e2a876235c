"""BF16Precision on CPU: autocast on the Trainer's device, fp32 state, the fp16 fallback, the compute dtype
Lightning reads."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Union

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.precision import BF16Precision, Float8Precision
from lightning_gpuopt.precision.bf16 import autocast_precision
from lightning_gpuopt.model import GPT, GPTConfig
from tests.precision._helpers import (
    TINY,
    ProbeGPT,
    plugin_trainer,
    token_loader,
)

# Only the tests that build a Float8Precision need torchao's float8; the BF16 ones run without it.
needs_float8 = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None or importlib.util.find_spec("torchao.float8") is None,
    reason="torchao.float8 is not installed: Float8Precision cannot be built (pip install torchao)",
)


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


@needs_float8
def test_plugins_are_built_without_initialising_cuda(monkeypatch):
    # A Trainer with strategy="ddp_fork"/"ddp_notebook" forks after the plugins are built: had they
    # initialised CUDA (current device, bf16 capability), every child would fail to use the GPU.
    def initialises_cuda():
        raise AssertionError("initialised CUDA while building a precision plugin")

    monkeypatch.setattr("lightning_gpuopt.precision.base.cuda_device_count", lambda: 1)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "_lazy_init", initialises_cuda)
    for plugin in (BF16Precision(), Float8Precision()):
        assert (plugin.device, plugin.precision, plugin.scaler, plugin.device_facts) == ("cuda", "bf16-mixed", None, None)
        assert plugin.precision == "bf16-mixed" and plugin.device_facts is None  # reading binds nothing
    # The real device decides at setup (here the CPU a Trainer attaches).
    plugin = BF16Precision()
    monkeypatch.undo()
    trainer = plugin_trainer(plugin, max_steps=1)
    trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=8))
    assert (plugin.device, plugin.precision, plugin.device_facts) == ("cpu", "bf16-mixed", REFERENCE_DEVICES["cpu"])


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_autocast_precision_for_every_reference_device(name):
    expected = "16-mixed" if name in ("V100", "T4") else "bf16-mixed"
    assert autocast_precision(REFERENCE_DEVICES[name]) == expected
    plugin = BF16Precision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.bind(torch.device("cpu"), REFERENCE_DEVICES[name])
    assert plugin.precision == expected and plugin.device == "cpu"
    assert plugin.compute_dtype == (torch.float16 if expected == "16-mixed" else torch.bfloat16)
    fallback = [str(w.message) for w in caught if "float16 autocast with a GradScaler" in str(w.message)]
    if expected == "16-mixed":
        # Built for the device it scales on (a CUDA scaler on a CPU disables itself, with a warning).
        assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler._device == "cpu"
        assert plugin.scaler.is_enabled()
        assert fallback == [f"BF16Precision: {REFERENCE_DEVICES[name].describe()} has no native bfloat16 support, "
                            "so training uses float16 autocast with a GradScaler instead. Use a GPU with compute "
                            "capability >= 8.0 (A100, H100, L4, RTX 30xx or newer) for bfloat16."]
        assert "Tesla" in fallback[0]  # the GPU is named from the facts
    else:
        assert plugin.scaler is None and fallback == []


def test_callbacks_bind_the_plugin_at_setup_and_read_the_device_dtype(monkeypatch):
    # Callbacks' setup runs before convert_module. MFUMonitor asks for the run's device there, which binds the
    # plugin, so it reads the dtype of the training device: fp16 where the device (a V100, as read_device would
    # report it) has no bf16. A callback after it, as Lightning's ThroughputMonitor, reads the same.
    from lightning_gpuopt.callbacks import MFUMonitor

    monkeypatch.setattr("lightning_gpuopt.perf.device.read_device", lambda device: REFERENCE_DEVICES["V100"])
    seen = {}

    class Reader(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            seen["dtype"] = _plugin_to_compute_dtype(trainer.precision_plugin)

    plugin = BF16Precision()
    mfu = MFUMonitor(log_every_n_steps=1, warmup_steps=0, peak_flops=1e12)
    trainer = plugin_trainer(plugin, max_steps=1, callbacks=[mfu, Reader()])
    with pytest.warns(UserWarning, match="Tesla V100.*float16 autocast with a GradScaler"):
        trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=8))
    assert seen["dtype"] == torch.float16 and mfu._dtype == "fp16"
    assert plugin.device_facts == REFERENCE_DEVICES["V100"] and plugin.device == "cpu"


def test_configure_model_reads_the_dtype_of_the_training_device(monkeypatch):
    # configure_model runs before convert_module (GPTModule picks FSDP2's parameter dtype there): with no callback
    # asking for the device earlier, the plugin binds as the first module is assigned to the LightningModule.
    from lightning_gpuopt.precision.dtype import compute_dtype_name

    monkeypatch.setattr("lightning_gpuopt.perf.device.read_device", lambda device: REFERENCE_DEVICES["T4"])

    class BuiltInConfigureModel(ProbeGPT):
        def __init__(self):
            pl.LightningModule.__init__(self)
            self.model, self.seen = None, {}

        def configure_model(self):
            if self.model is None:
                self.model = GPT(GPTConfig(**TINY))
                self.seen["dtype_in_configure_model"] = compute_dtype_name(self.trainer.precision_plugin)

    module = BuiltInConfigureModel()
    with pytest.warns(UserWarning, match="Tesla T4"):
        plugin_trainer(BF16Precision(), max_steps=1).fit(module, train_dataloaders=token_loader(n_seq=8))
    assert module.seen["dtype_in_configure_model"] == "fp16" and module.seen["autocast_dtype"] == torch.float16


def test_bf16_falls_back_to_fp16_with_grad_scaler_where_bf16_is_missing():
    plugin = BF16Precision()
    with pytest.warns(UserWarning, match="Tesla V100.*float16 autocast with a GradScaler"):
        plugin.bind(torch.device("cpu"), REFERENCE_DEVICES["V100"])
    module = ProbeGPT()
    trainer = plugin_trainer(plugin, max_steps=3, gradient_clip_val=0.5)
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


@needs_float8
def test_throughput_monitor_reads_bf16_compute_dtype():
    assert _plugin_to_compute_dtype(BF16Precision()) == torch.bfloat16
    assert _plugin_to_compute_dtype(Float8Precision(emulate=True)) == torch.bfloat16
    assert Float8Precision(emulate=True).compute_dtype == torch.bfloat16


@needs_float8
def test_throughput_monitor_runs_with_both_plugins():
    from lightning.pytorch.callbacks import ThroughputMonitor

    for plugin in (BF16Precision(), Float8Precision(emulate=True, module_filter=["lm_head"])):
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
        trainer = plugin_trainer(plugin, max_steps=2, callbacks=[monitor])
        trainer.fit(ProbeGPT(), train_dataloaders=token_loader(n_seq=16))
        assert _plugin_to_compute_dtype(trainer.precision_plugin) == torch.bfloat16


@needs_float8
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
