"""Device facts: the reference devices' capabilities, and reading this machine's device."""

import pytest
import torch

from lightning_gpuopt.perf.device import REFERENCE_DEVICES, DeviceFacts, read_device

# name -> (bf16, fp8, flash attention, fused AdamW, bf16 peak TFLOP/s)
EXPECTED = {
    "H100 SXM": (True, True, True, True, 989.4),
    "H200": (True, True, True, True, 989.4),
    "A100": (True, False, True, True, 312.0),
    "L4": (True, True, True, True, 121.0),
    "V100": (False, False, False, True, None),
    "T4": (False, False, False, True, None),
    "cpu": (True, False, False, False, None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_device_facts(name):
    facts = REFERENCE_DEVICES[name]
    got = (facts.bf16, facts.fp8, facts.flash_attention, facts.fused_adamw, facts.peak_tflops("bf16"))
    assert got == EXPECTED[name]


def test_every_reference_device_is_expected():
    assert set(REFERENCE_DEVICES) == set(EXPECTED)


def test_read_cpu_device():
    facts = read_device(torch.device("cpu"))
    assert facts == DeviceFacts("cpu", "cpu")
    assert facts.describe() == "cpu"


def test_read_default_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the default device is a GPU")
    assert read_device().type == "cpu"


def test_describe_names_capability_and_memory():
    assert REFERENCE_DEVICES["V100"].describe() == "cuda:0 Tesla V100-SXM2-16GB (compute capability 7.0, 16.0 GiB)"


def test_unknown_gpu_has_no_peaks_but_capabilities():
    facts = DeviceFacts("cuda", "NVIDIA Future GPU", (12, 0), None, None, 0)
    assert facts.peaks is None and facts.peak_tflops("bf16") is None
    assert facts.bf16 and facts.fp8 and facts.flash_attention


def test_a_fit_reads_its_device_once_and_binds_the_precision_plugin_there(monkeypatch):
    """Every piece that decides from the device (GPTModule, its optimizer, CUDASettings, MFUMonitor, AutoBatchSize's
    trials, the plugin) asks `training_device`: one read per run, and the plugin bound once, before any reads its dtype."""
    import inspect

    import lightning.pytorch as pl

    from lightning_gpuopt.callbacks import AutoBatchSize, CUDASettings, MFUMonitor
    from lightning_gpuopt.perf import device as device_module
    from lightning_gpuopt.precision import BF16Precision
    from tests.callbacks.auto_batch._helpers import OOMAbove, TokenData

    reads, binds, dtypes = [], [], []
    read = device_module.read_device
    monkeypatch.setattr(device_module, "read_device", lambda device=None: reads.append(device) or read(device))
    bind = BF16Precision.bind

    def counted_bind(self, device, facts, strategy=None):
        binds.append(inspect.currentframe().f_back.f_code.co_name)
        bind(self, device, facts, strategy)

    monkeypatch.setattr(BF16Precision, "bind", counted_bind)

    class FactsAtSetup(pl.Callback):  # a reader of the plugin at setup, as Lightning's ThroughputMonitor
        def setup(self, trainer, pl_module, stage):
            dtypes.append(trainer.precision_plugin.device_facts)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[BF16Precision()],
        callbacks=[CUDASettings(), FactsAtSetup(), MFUMonitor(log_every_n_steps=1, warmup_steps=0),
                   AutoBatchSize(max_micro_batch_size=4, steps_per_trial=1)],
    )
    trainer.fit(OOMAbove(limit=2), datamodule=TokenData(batch_size=4))
    assert reads == [torch.device("cpu")]
    assert binds == ["training_device"]
    assert dtypes == [DeviceFacts("cpu", "cpu")]  # bound at CUDASettings' setup, the run's first ask
