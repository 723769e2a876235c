"""CUDASettings: applies at construction, reports once, restores the global state at teardown."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor

from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor
from lightning_gpuopt.callbacks.cuda_settings import _apply_allocator, _capture, plan_settings
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, cuda_device_count, read_device
from lightning_gpuopt.perf.sdpa import auto_sdpa_order
from lightning_gpuopt.model import GPTModule
from tests.callbacks._mfu_helpers import ClockedGPTModule, FakeClock, TokenBatches, loader


def _known_state(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False


def _applied(**kwargs) -> CUDASettings:
    """A CUDASettings whose settings are set: at construction on a CUDA machine, here by hand on a CPU."""
    cb = CUDASettings(**kwargs)
    if cb._saved is None:
        cb._set()
    return cb


@pytest.mark.skipif(cuda_device_count() > 0, reason="on a CUDA machine the settings are set at construction")
def test_nothing_is_set_without_a_cuda_device(monkeypatch):
    _known_state(monkeypatch)
    before = _capture()
    cb = CUDASettings(tf32=True, cudnn_benchmark=True, sdpa_backends=["efficient", "math"], expandable_segments=True)
    assert _capture() == before and cb._saved is None


def test_sets_and_restores(monkeypatch):
    _known_state(monkeypatch)
    # On a GPU machine an earlier test may have initialised CUDA; this test is about the path before that.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    before = _capture()
    cb = _applied(tf32=True, cudnn_benchmark=True, sdpa_backends=["efficient", "math"], expandable_segments=True)
    now = _capture()
    assert now["tf32"]["fp32_precision"] == {"cuda.matmul": "tf32", "cudnn.conv": "tf32", "cudnn.rnn": "tf32", "mkldnn.matmul": "tf32"}
    assert now["tf32"]["tf32_cudnn"] and now["cudnn_benchmark"]
    assert now["tf32"]["matmul_precision"] == "high"
    assert now["sdpa_enabled"] == {"cudnn": False, "flash": False, "efficient": True, "math": True}
    assert now["sdpa_priority"][:2] == [2, 0]  # SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH first
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    cb._restore()
    assert _capture() == before


def test_fit_on_cpu_says_one_line_and_restores(tmp_path, monkeypatch, caplog):
    _known_state(monkeypatch)
    before = _capture()
    cb = CUDASettings(sdpa_backends=["flash", "math"])
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_steps=2, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[cb, MFUMonitor(peak_flops=1e12, log_every_n_steps=1, warmup_steps=0), LearningRateMonitor()],
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(4, 2, 16)))
    assert _capture() == before  # notebook / test suite state is back
    said = [r.message for r in caplog.records if r.message.startswith("CUDASettings")]
    assert said == [
        "CUDASettings: no CUDA device, nothing to set (on a GPU: expandable_segments=True, tf32=True, "
        "matmul_precision=high, cudnn_benchmark=True, sdpa_backends=flash,math; CUDASettings(verbose=True) shows the table)."
    ]
    assert cb.report == plan_settings(REFERENCE_DEVICES["cpu"], sdpa_backends=["flash", "math"])
    # a second fit logs nothing more, and leaves the state as it was again
    trainer2 = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[cb],
    )
    with caplog.at_level(logging.INFO):
        trainer2.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(2, 2, 16)))
    assert len([r for r in caplog.records if r.message.startswith("CUDASettings")]) == 1
    assert _capture() == before


def test_verbose_logs_the_table_on_cpu(tmp_path, caplog):
    cb = CUDASettings(verbose=True)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[cb])
    with caplog.at_level(logging.INFO):
        trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(2, 2, 16)))
    said = [r.message for r in caplog.records if r.message.startswith("CUDASettings")]
    assert len(said) == 1 and said[0].startswith("CUDASettings on cpu:\nsetting ")
    for name in ("expandable_segments", "tf32", "matmul_precision", "cudnn_benchmark", "sdpa_backends"):
        assert f"{name} " in said[0]
    assert said[0].count("no effect: no CUDA device") == 4  # the fifth, sdpa_backends=auto: "left as PyTorch orders them"


_APPLIED = "applied"
PLANS = {  # reference device -> (tf32 status, sdpa_backends="auto" status, sdpa_backends=[flash, efficient, math] status)
    "H100 SXM": (_APPLIED, "priority cudnn,flash,efficient,math (compute capability 9.0)", _APPLIED),
    "H200": (_APPLIED, "priority cudnn,flash,efficient,math (compute capability 9.0)", _APPLIED),
    "A100": (_APPLIED, "left as PyTorch orders them (compute capability 8.0)", _APPLIED),
    "L4": (_APPLIED, "left as PyTorch orders them (compute capability 8.9)", _APPLIED),
    "V100": ("applied, no effect: TF32 tensor cores need compute capability >= 8.0",
             "left as PyTorch orders them (compute capability 7.0)",
             "applied; flash needs compute capability >= 8.0, so it is skipped on this GPU"),
    "T4": ("applied, no effect: TF32 tensor cores need compute capability >= 8.0",
           "left as PyTorch orders them (compute capability 7.5)",
           "applied; flash needs compute capability >= 8.0, so it is skipped on this GPU"),
    "cpu": ("no effect: no CUDA device", "left as PyTorch orders them: no CUDA device", "no effect: no CUDA device"),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_DEVICES))
def test_plan_on_reference_devices(name):
    tf32, auto, listed = PLANS[name]
    done = "applied" if REFERENCE_DEVICES[name].is_cuda else "no effect: no CUDA device"
    assert plan_settings(REFERENCE_DEVICES[name]) == [
        ("expandable_segments", "True", done), ("tf32", "True", tf32), ("matmul_precision", "high", done),
        ("cudnn_benchmark", "True", done), ("sdpa_backends", "auto", auto),
    ]
    rows = plan_settings(REFERENCE_DEVICES[name], tf32=False, sdpa_backends=["flash", "efficient", "math"])
    assert dict((r[0], r[2]) for r in rows) == {
        "expandable_segments": done, "tf32": done, "matmul_precision": done, "cudnn_benchmark": done, "sdpa_backends": listed,
    }
    assert plan_settings(REFERENCE_DEVICES[name], tf32=None, cudnn_benchmark=None, sdpa_backends=None, expandable_segments=None) == []


def test_none_leaves_settings_alone(monkeypatch):
    _known_state(monkeypatch)
    before = _capture()
    cb = CUDASettings(tf32=None, cudnn_benchmark=None, sdpa_backends=None, expandable_segments=None)
    assert _capture() == before and cb.report == []


def test_setting_does_not_initialise_cuda(monkeypatch):
    # Built before a fork-based launch (strategy="ddp_fork"/"ddp_notebook"), the callback must leave CUDA
    # uninitialised; what depends on the GPU waits for setup, on the training device.
    _known_state(monkeypatch)
    before = _capture()

    def initialises_cuda():
        raise AssertionError("CUDASettings initialised CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", initialises_cuda)
    cb = _applied(sdpa_backends=["flash", "efficient", "math"])
    assert cb._allocator_status == "applied via PYTORCH_CUDA_ALLOC_CONF before CUDA initialisation"
    cb._restore()
    assert _capture() == before


def test_runtime_allocator_update_keeps_the_other_options(monkeypatch):
    # CUDA already initialised: the allocator gets the whole configuration, not just expandable_segments.
    _known_state(monkeypatch)
    sent = []
    monkeypatch.setattr("lightning_gpuopt.callbacks.cuda_settings.set_allocator_settings", sent.append)
    status = _apply_allocator(True, cuda_initialized=True)
    assert status == "applied at runtime (CUDA already initialised): affects new memory segments"
    assert sent == ["max_split_size_mb:128,expandable_segments:True"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # the variable itself is left alone
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cb = _applied(tf32=None, cudnn_benchmark=None, sdpa_backends=None, expandable_segments=True)
    cb._restore()
    assert sent[-1] == "max_split_size_mb:128,expandable_segments:False"

    def refuses(conf):
        raise ValueError("Unrecognized key 'bogus' in Accelerator allocator config.")

    monkeypatch.setattr("lightning_gpuopt.callbacks.cuda_settings.set_allocator_settings", refuses)
    status = _apply_allocator(True, cuda_initialized=True)  # a bad user setting is reported, not raised
    assert status.startswith("not applied") and "Unrecognized key" in status


@pytest.mark.parametrize(
    "kwargs",
    [dict(sdpa_backends=["flash", "fast"]), dict(sdpa_backends=[]), dict(sdpa_backends=["math", "math"]),
     dict(matmul_precision="low"), dict(tf32=True, matmul_precision="highest"),
     dict(tf32=False, matmul_precision="high")],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="CUDASettings"):
        CUDASettings(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_settings_take_effect_on_gpu():
    import subprocess
    import sys

    # A fresh process, so the allocator option lands before CUDA initialises.
    code = r"""
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from lightning_gpuopt.callbacks import CUDASettings
cb = CUDASettings(sdpa_backends=["efficient"], expandable_segments=True)
x = torch.randn(64, 1024, 1024, device="cuda")  # first allocation
snap = torch.cuda.memory._snapshot()
assert any(s.get("is_expandable", False) for s in snap["segments"]), "allocator is not using expandable segments"
assert torch.backends.cuda.matmul.allow_tf32
q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize()
names = " ".join(e.key for e in prof.key_averages())
assert "efficient" in names.lower() or "fmha" in names.lower(), names
assert "flash" not in names.lower(), names
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_auto_attention_order_leaves_the_cpu_as_it_is(tmp_path):
    before = _capture()
    cb = CUDASettings(tf32=None, cudnn_benchmark=None, expandable_segments=None)  # sdpa_backends="auto"
    assert cb.sdpa_backends == "auto" and _capture() == before  # decided at setup, on the training device
    seen = {}

    class Probe(LearningRateMonitor):
        def on_train_start(self, trainer, pl_module):
            seen.update(_capture())

    module = GPTModule(preset="tiny", vocab_size=64, block_size=16, warmup_steps=1)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Probe()],
                      default_root_dir=tmp_path)
    trainer.fit(module, loader(TokenBatches(2, 2, 16, vocab=64)))
    assert seen["sdpa_priority"] == before["sdpa_priority"]
    assert dict((r[0], r[2]) for r in cb.report)["sdpa_backends"] == "left as PyTorch orders them: no CUDA device"
    assert _capture() == before


def test_attention_kernel_names_a_backend():
    from lightning_gpuopt.perf.sdpa import attention_kernel

    assert attention_kernel(torch.device("cpu"), 64, 128, torch.float32) in ("cudnn", "flash", "efficient", "math")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_puts_cudnn_first_on_hopper_and_reports_the_kernel(tmp_path):
    from lightning_gpuopt.perf.sdpa import attention_kernel
    from lightning_gpuopt.precision import BF16Precision

    if auto_sdpa_order(read_device("cuda"))[0] is None:
        pytest.skip("cuDNN attention goes first on compute capability 9.x/10.x with cuDNN >= 9.15 only")
    before = _capture()
    cb = CUDASettings()
    kernels = {}

    class Probe(LearningRateMonitor):
        def on_train_start(self, trainer, pl_module):
            kernels["picked"] = attention_kernel(torch.device("cuda"), 64, 1024, torch.bfloat16, 12)

    module = GPTModule(preset="tiny", vocab_size=64, block_size=16, warmup_steps=1)
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Probe()],
                      plugins=[BF16Precision()], default_root_dir=tmp_path)
    trainer.fit(module, loader(TokenBatches(2, 2, 16, vocab=64)))
    assert kernels["picked"] == "cudnn"
    report = {r[0]: r for r in cb.report}
    assert report["sdpa_backends"][2].startswith("priority cudnn,flash,efficient,math")
    assert report["attention_kernel"][1] == "cudnn"
    assert _capture()["sdpa_priority"] == before["sdpa_priority"]  # restored at teardown


def _fp32_precisions() -> dict[str, str]:
    """torch's per-backend TF32 settings (the new API), as a user of it reads them."""
    b = torch.backends
    nodes = {"all": b, "cuda.matmul": b.cuda.matmul, "cudnn.conv": b.cudnn.conv, "cudnn.rnn": b.cudnn.rnn,
             "mkldnn.matmul": b.mkldnn.matmul}
    return {name: node.fp32_precision for name, node in nodes.items()}


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_after_the_user_set_the_new_api(monkeypatch, tf32):
    # Once anything sets `fp32_precision`, torch refuses to read the legacy `allow_tf32` flags.
    from lightning_gpuopt.precision.dtype import tf32_enabled

    _known_state(monkeypatch)
    user = "ieee" if tf32 else "tf32"  # the opposite of what CUDASettings sets
    torch.backends.fp32_precision = user  # reaches the backends nothing set explicitly (cuDNN here)
    torch.backends.cuda.matmul.fp32_precision = user
    before = _fp32_precisions()
    cb = _applied(tf32=tf32, cudnn_benchmark=None, sdpa_backends=None, expandable_segments=None)
    want = "tf32" if tf32 else "ieee"
    now = _fp32_precisions()
    assert (now["cuda.matmul"], now["cudnn.conv"], now["cudnn.rnn"]) == (want, want, want)
    assert tf32_enabled() is tf32
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")  # Lightning reads this on CUDA
    assert torch.backends.cudnn.allow_tf32 is tf32
    cb._restore()
    assert _fp32_precisions() == before
    assert tf32_enabled() is not tf32


def test_tf32_after_the_user_set_the_legacy_api(monkeypatch):
    _known_state(monkeypatch)
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    before = _fp32_precisions()
    cb = _applied(tf32=True, cudnn_benchmark=None, sdpa_backends=None, expandable_segments=None)
    assert _fp32_precisions()["cudnn.conv"] == "tf32" and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    cb._restore()
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("medium", False)
    assert _fp32_precisions() == before


def test_fit_after_the_user_set_the_new_api(tmp_path, monkeypatch):
    _known_state(monkeypatch)
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = _fp32_precisions()
    mfu = MFUMonitor(peak_flops=1e12, log_every_n_steps=1, warmup_steps=0, report=False)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[CUDASettings(), mfu],
    )
    trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(2, 2, 16)))
    assert mfu._dtype == "tf32"  # fp32 under the user's TF32
    assert _fp32_precisions() == before
