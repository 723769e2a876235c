"""MFUMonitor on CPU: arithmetic against a hand computation, FLOPs of what the training step runs, no per-step sync."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_gpuopt.callbacks import MFUMonitor
from lightning_gpuopt.perf.mfu_meter import MFUMeter
from lightning_gpuopt.model import GPTModule
from tests._module_shapes import EncoderLM, encoder_flops_per_token
from tests.callbacks._mfu_helpers import ClockedGPTModule, FakeClock, TokenBatches, loader

B, T = 2, 32


class ListLogger(CSVLogger):
    """CSVLogger that also keeps every logged dict in memory."""

    def __init__(self, save_dir):
        super().__init__(save_dir)
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))
        super().log_metrics(metrics, step)


def _trainer(tmp_path, callbacks, max_steps, accumulate=1, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
        callbacks=callbacks, logger=ListLogger(tmp_path), enable_model_summary=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs,
    )


def test_mfu_arithmetic_with_controlled_clock(tmp_path):
    clock = FakeClock()
    step_s, fetch_s, accumulate = 0.1, 0.02, 2
    module = ClockedGPTModule(clock, step_s, preset="tiny", warmup_steps=1)
    peak = 2e9
    monitor = MFUMonitor(log_every_n_steps=3, warmup_steps=2, peak_flops=peak, clock=clock, prog_bar=True)
    data = TokenBatches(30, B, T, clock=clock, fetch_s=fetch_s)
    trainer = _trainer(tmp_path, [monitor], max_steps=8, accumulate=accumulate)
    trainer.fit(module, loader(data))

    # steps 3..5 and 6..8 are two windows of 3 optimizer steps; warm-up steps 1-2 are left out
    rows = [m for _, m in trainer.logger.rows if "perf/mfu" in m]
    assert len(rows) == 2 and len(monitor.history) == 2
    assert [s for s, m in trainer.logger.rows if "perf/mfu" in m] == [5, 8]
    flops_per_token = module.model.flops_per_token(T)  # 6N + 12LHQT
    step_time = accumulate * (step_s + fetch_s)
    tokens_per_step = accumulate * B * T
    expected = {
        "perf/step_time_ms": 1000 * step_time,
        "perf/tokens_per_sec": tokens_per_step / step_time,
        "perf/tokens_per_sec_per_device": tokens_per_step / step_time,
        "perf/tflops_per_device": flops_per_token * tokens_per_step / step_time / 1e12,
        "perf/mfu": flops_per_token * tokens_per_step / step_time / peak,
        "perf/dataloader_wait_pct": 100 * fetch_s / (step_s + fetch_s),
    }
    for metrics in rows:
        assert set(expected) <= set(metrics)
        assert not any(k.startswith("mem/") for k in metrics)  # CPU: no CUDA memory to report
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-9), key
    # shown in the progress bar, as plain numbers
    assert trainer.progress_bar_metrics["tok/s"] == round(expected["perf/tokens_per_sec"])
    assert trainer.progress_bar_metrics["mfu"] == pytest.approx(expected["perf/mfu"], abs=1e-4)
    # end-of-fit report: data wait is 17% of the time -> advice to add workers
    assert "tokens/s" in monitor.summary["text"]
    assert any("num_workers" in a for a in monitor.summary["advice"])


class _PausingGPTModule(ClockedGPTModule):
    """Each validation batch takes ``val_s`` seconds on the clock."""

    def __init__(self, clock: FakeClock, step_s: float, val_s: float, **kwargs) -> None:
        super().__init__(clock, step_s, **kwargs)
        self._val_s = val_s

    def validation_step(self, batch, batch_idx):
        self._clock.advance(self._val_s)
        return super().validation_step(batch, batch_idx)


class _SlowCheckpointIO(TorchCheckpointIO):
    """Writing a checkpoint takes ``save_s`` seconds on the clock."""

    def __init__(self, clock: FakeClock, save_s: float) -> None:
        self.clock, self.save_s = clock, save_s

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.clock.advance(self.save_s)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.parametrize("validate, save", [(True, False), (False, True), (True, True)])
def test_validation_and_checkpoint_time_is_neither_data_wait_nor_training_time(tmp_path, validate, save):
    # Every 3 steps (one per window of 3) a validation of 2 batches (10 s) and/or a checkpoint save (7 s).
    clock = FakeClock()
    step_s, fetch_s = 0.1, 0.02
    module = _PausingGPTModule(clock, step_s, val_s=5.0, preset="tiny", warmup_steps=1)
    monitor = MFUMonitor(log_every_n_steps=3, warmup_steps=2, peak_flops=2e9, clock=clock, prog_bar=False)
    callbacks = [monitor, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)]
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=11, callbacks=callbacks[: 1 + save],
        plugins=[_SlowCheckpointIO(clock, save_s=7.0)], logger=False, enable_model_summary=False,
        enable_checkpointing=save, enable_progress_bar=False, num_sanity_val_steps=0, val_check_interval=3,
        check_val_every_n_epoch=None, limit_val_batches=2 if validate else 0,
    )
    trainer.fit(module, loader(TokenBatches(30, B, T, clock=clock, fetch_s=fetch_s)), loader(TokenBatches(2, B, T)))

    assert len(monitor.history) == 3
    assert save == (tmp_path / "ckpt").is_dir() and clock.now > 100 + 11 * (step_s + fetch_s) + 20  # they ran
    # A save alone: the batch fetched after it counts with the save (no hook marks the write's end).
    fetches = 2 if save and not validate else 3
    window_s = 3 * step_s + fetches * fetch_s
    for metrics in monitor.history:
        assert metrics["perf/dataloader_wait_pct"] == pytest.approx(100 * fetches * fetch_s / window_s, rel=1e-9)
        assert metrics["perf/step_time_ms"] == pytest.approx(1000 * window_s / 3, rel=1e-9)
        assert metrics["perf/tokens_per_sec"] == pytest.approx(3 * B * T / window_s, rel=1e-9)


def test_no_sync_on_steps_that_do_not_log(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(MFUMeter, "synchronize", lambda meter: calls.append(meter.device))
    monitor = MFUMonitor(log_every_n_steps=4, warmup_steps=2, peak_flops=1e12)
    trainer = _trainer(tmp_path, [monitor], max_steps=11)
    trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(20, B, T)))
    # 11 steps: one sync to open the window after warm-up, one per logged window (steps 6 and 10)
    assert len(calls) == 3
    assert len(monitor.history) == 2


def test_no_history_means_a_clear_report(tmp_path):
    monitor = MFUMonitor(log_every_n_steps=50, warmup_steps=3, peak_flops=1e12)
    trainer = _trainer(tmp_path, [monitor], max_steps=2)
    trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(4, B, T)))
    assert monitor.history == []
    assert "needs 53 optimizer steps" in monitor.summary["text"]


def test_monitor_measures_flops_of_a_module_without_flops_per_token(tmp_path):
    from lightning.pytorch import LightningModule

    class Plain(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = EncoderLM()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    trainer = _trainer(tmp_path, [monitor, LearningRateMonitor(), ModelCheckpoint(dirpath=tmp_path)], max_steps=3, enable_checkpointing=True)
    trainer.fit(Plain(), loader(TokenBatches(6, B, T, vocab=128)))
    (metrics,) = monitor.history
    assert metrics["perf/tflops_per_device"] * 1e12 == pytest.approx(encoder_flops_per_token() * metrics["perf/tokens_per_sec"])


class _Regressor(pl.LightningModule):
    """An (x, y) regression batch: float features, no token ids."""

    def __init__(self, flops_per_token=False):
        super().__init__()
        self.net = nn.Linear(16, 16)
        if flops_per_token:
            self.flops_per_token = lambda seq_len: 1e6  # a module count: no FLOPs counting, which used to warn

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("flops_per_token", [False, True])
def test_float_features_are_not_counted_as_tokens_and_it_says_so_once(tmp_path, flops_per_token):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g))
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    with pytest.warns(UserWarning, match=r"MFUMonitor found no tokens in the batch of _Regressor") as record:
        _trainer(tmp_path, [monitor], max_steps=5).fit(_Regressor(flops_per_token), torch.utils.data.DataLoader(data, batch_size=8))
    assert sum("found no tokens" in str(w.message) for w in record) == 1
    assert monitor.total_tokens == 0 and len(monitor.history) == 2
    assert all("perf/tokens_per_sec" not in m and "perf/mfu" not in m for m in monitor.history)
    assert "no tokens found in the batches" in monitor.summary["text"] and "tokens/s (" not in monitor.summary["text"]


def test_fp8_plugin_is_detected_and_custom_plugin_warns(tmp_path):
    class OurFloat8(Precision):
        compute_dtype = torch.bfloat16
        fp8 = True

    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    trainer = _trainer(tmp_path, [monitor], max_steps=3, plugins=[OurFloat8()])
    trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(6, B, T)))
    assert monitor._dtype == "fp8"
    assert any("FP8 without torch.compile" in a for a in monitor.summary["advice"])

    class Custom(Precision):
        pass

    with pytest.warns(UserWarning, match=r"MFUMonitor\(dtype=...\)"):
        _trainer(tmp_path, [MFUMonitor(peak_flops=1e12)], max_steps=1, plugins=[Custom()]).fit(
            ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(2, B, T))
        )


def test_unknown_peak_is_said_once_naming_the_argument(tmp_path, caplog):
    # On a CPU there is no peak to know: one info line (a GPU missing from the table warns instead).
    monitor = MFUMonitor(log_every_n_steps=1, warmup_steps=1)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [monitor], max_steps=3).fit(
            ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(4, B, T))
        )
    assert sum("MFUMonitor(peak_flops=...)" in r.getMessage() for r in caplog.records) == 1
    assert monitor.history and all("perf/mfu" not in m and "perf/tflops_per_device" in m for m in monitor.history)


@pytest.mark.parametrize(
    "kwargs", [dict(log_every_n_steps=0), dict(warmup_steps=-1), dict(peak_flops=0.0), dict(dtype="int8"),
               dict(flops_per_token=-1.0)]
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="MFUMonitor"):
        MFUMonitor(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_bf16_mfu_is_plausible_and_memory_is_reported(tmp_path):
    from lightning_gpuopt.perf.peaks import find_gpu

    if find_gpu(torch.cuda.get_device_name()) is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in the peak table")
    monitor = MFUMonitor(log_every_n_steps=5, warmup_steps=3, measure_peak=True)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="gpu", devices=1, max_steps=13, precision="bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[monitor],
    )
    module = GPTModule(preset="124m", vocab_size=8192, block_size=512, warmup_steps=1)
    trainer.fit(module, loader(TokenBatches(13, 8, 512, vocab=8192)))
    assert len(monitor.history) == 2
    for m in monitor.history:
        assert 0.01 < m["perf/mfu"] < 1.0
        assert m["perf/mfu_measured"] > m["perf/mfu"]  # the measured ceiling is below the datasheet peak
        assert 0 < m["mem/peak_gb"] and 0 < m["mem/peak_pct"] < 100


@pytest.mark.parametrize("shape", ["nanogpt", "llama", "litgpt", "hf-llama-mask", "hf-gpt2-mask", "two-optimizers"])
def test_monitor_counts_what_the_training_step_runs(tmp_path, shape):
    from tests._module_shapes import MORE_SHAPES, SHAPES, hand_flops_per_token, shape_loader

    module = {**SHAPES, **MORE_SHAPES}[shape]()
    steps = getattr(module, "steps_per_batch", 1)  # two manual optimizers: two global steps per batch
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    _trainer(tmp_path, [monitor], max_steps=3 * steps).fit(module, shape_loader(shape.replace("two-optimizers", "litgpt"), batch_size=2))
    assert monitor.flops_source == f"{type(module).__name__}.training_step, counted over a real step"
    per_token = monitor.history[-1]["perf/tflops_per_device"] * 1e12 / monitor.history[-1]["perf/tokens_per_sec_per_device"]
    assert per_token == pytest.approx(hand_flops_per_token(module), rel=0.03)


def test_monitor_counts_a_step_that_reads_a_value_whole_and_once(tmp_path):
    from tests._module_shapes import NanoGPTModule, hand_flops_per_token, shape_loader

    class Reads(NanoGPTModule):  # nanoGPT's forward without targets covers one position; the step reads the loss
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.last_loss = float(loss.detach())
            return loss

    counted = []

    class Counts(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counted.append(monitor.meter.flops.running)

    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "counts low" warning
        warnings.filterwarnings("ignore", message=".*(does not have many workers|has no bf16 peak|self.log|logging interval).*")
        _trainer(tmp_path, [Counts(), monitor], max_steps=3).fit(Reads(), shape_loader("nanogpt", batch_size=2))
    assert monitor.flops_source == "Reads.training_step, counted over a real step"
    per_token = monitor.history[-1]["perf/tflops_per_device"] * 1e12 / monitor.history[-1]["perf/tokens_per_sec_per_device"]
    assert per_token == pytest.approx(hand_flops_per_token(Reads()), rel=1e-6)
    assert counted == [True, False, False]  # one counted step: the first; nothing left counting after fit
    assert not monitor.meter.flops.running
    # and the module's own count is the first choice
    class Counted(Reads):
        def flops_per_token(self, seq_len):
            return hand_flops_per_token(self, seq_len)

    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    _trainer(tmp_path, [monitor], max_steps=3).fit(Counted(), shape_loader("nanogpt", batch_size=2))
    assert monitor.flops_source == "Counted.flops_per_token"


class _UnevenGPTModule(ClockedGPTModule):
    """Step ``i`` takes ``step_s[i]`` seconds on the clock: windows of very different speeds."""

    def __init__(self, clock: FakeClock, step_s: list, **kwargs) -> None:
        super().__init__(clock, 0.0, **kwargs)
        self._uneven_s = step_s

    def training_step(self, batch, batch_idx):
        self._clock.advance(self._uneven_s[batch_idx])
        return super().training_step(batch, batch_idx)


def _report_figures(text):
    import re

    tokens_per_s, ms = re.search(r"([\d,]+) tokens/s \(([\d.]+) ms/step\)", text).groups()
    return float(tokens_per_s.replace(",", "")), float(ms)


def test_report_is_tokens_over_time_of_uneven_windows(tmp_path):
    # windows of 1 s and 9 s (a rate of 64 and of 7.1 tokens/s): the report is 128 tokens / 10 s, not the mean of rates
    clock = FakeClock()
    step_s = [0.5] * 4 + [4.5] * 2
    module = _UnevenGPTModule(clock, step_s, preset="tiny", warmup_steps=1)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=2, peak_flops=1e9, clock=clock, prog_bar=False)
    _trainer(tmp_path, [monitor], max_steps=6).fit(module, loader(TokenBatches(6, B, T)))

    assert [round(m["perf/step_time_ms"]) for m in monitor.history] == [500, 4500]
    tokens_per_s, ms_per_step = _report_figures(monitor.summary["text"])
    assert tokens_per_s == pytest.approx(4 * B * T / 10.0, abs=0.5)
    assert ms_per_step == pytest.approx(10_000 / 4)
    assert tokens_per_s == pytest.approx(B * T / (ms_per_step / 1000), rel=0.02)  # the two figures agree
    mfu = module.model.flops_per_token(T) * 4 * B * T / 10.0 / 1e9
    assert f"MFU {100 * mfu:.1f}%" in monitor.summary["text"]
    assert "2 windows of 2 steps in this fit" in monitor.summary["text"]
    assert "the run so far" not in monitor.summary["text"]


def test_a_resumed_report_gives_this_fits_figures_and_the_runs_totals(tmp_path):
    clock = FakeClock()
    module = ClockedGPTModule(clock, 1.0, preset="tiny", warmup_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock, prog_bar=False)
    _trainer(tmp_path, [monitor, ckpt], max_steps=4, enable_checkpointing=True).fit(module, loader(TokenBatches(12, B, T)))
    assert len(monitor.history) == 2

    clock2 = FakeClock()
    resumed = MFUMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock2, prog_bar=False)
    module2 = ClockedGPTModule(clock2, 3.0, preset="tiny", warmup_steps=1)
    _trainer(tmp_path, [resumed], max_steps=6).fit(
        module2, loader(TokenBatches(12, B, T)), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"),
        weights_only=False,  # the test module keeps its clock in its hyperparameters
    )
    text = resumed.summary["text"]
    assert len(resumed.history) == 3 and "1 window of 2 steps in this fit" in text
    assert _report_figures(text) == (pytest.approx(B * T / 3.0, abs=0.5), pytest.approx(3000.0))
    assert f"{2 * B * T:,} tokens per device in this fit" in text
    assert f"the run so far, resumed: {6 * B * T:,} tokens per device" in text


def test_monitor_counts_a_hugging_face_llama_with_attention_masks(tmp_path):
    """transformers' own LlamaForCausalLM in a LightningModule whose step logs loss.item(), on padded batches."""
    from tests.perf.test_flops import _hf_models, hf_batch

    class HFLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _hf_models()["llama"]

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = HFLlama()
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    _trainer(tmp_path, [monitor], max_steps=3).fit(module, torch.utils.data.DataLoader([hf_batch(2)] * 3, batch_size=None))
    weights = {id(m.weight): m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)}
    per_token = monitor.history[-1]["perf/tflops_per_device"] * 1e12 / monitor.history[-1]["perf/tokens_per_sec_per_device"]
    assert per_token == pytest.approx(6 * sum(weights.values()) + 12 * 2 * 64 * 32, rel=0.03)
    assert monitor.flops_source == "HFLlama.training_step, counted over a real step"


class _MaskedLM(pl.LightningModule):
    """A tiny LM on Hugging Face-style dict batches; each step takes ``step_s`` on the clock; FLOPs per token given."""

    def __init__(self, clock: FakeClock, step_s: float) -> None:
        super().__init__()
        self.clock, self.step_s = clock, step_s
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

    def flops_per_token(self, seq_len: int) -> float:
        return 1e6

    def training_step(self, batch, batch_idx):
        self.clock.advance(self.step_s)
        logits = self.head(self.emb(batch["input_ids"]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("key", ["attention_mask", "labels"])
def test_padding_is_not_counted_as_tokens_and_the_padded_rate_is_beside(tmp_path, caplog, key):
    clock, step_s, peak = FakeClock(), 0.5, 1e9
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -8:] = 0  # the second row ends in 8 padding positions: 56 real tokens of 64
    batch = {"input_ids": ids * mask, key: mask if key == "attention_mask" else ids.masked_fill(mask == 0, -100)}
    monitor = MFUMonitor(log_every_n_steps=3, warmup_steps=1, peak_flops=peak, clock=clock)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [monitor], max_steps=4).fit(_MaskedLM(clock, step_s), loader([batch] * 4))
    (metrics,) = monitor.history
    real, positions = B * T - 8, B * T
    assert metrics["perf/tokens_per_sec"] == pytest.approx(real / step_s)  # was 64 / step_s: padding as tokens
    assert metrics["perf/tokens_per_sec_padded"] == pytest.approx(positions / step_s)
    assert metrics["perf/tflops_per_device"] == pytest.approx(1e6 * real / step_s / 1e12)
    assert metrics["perf/mfu"] == pytest.approx(1e6 * real / step_s / peak)  # the model FLOPs of the real tokens
    assert monitor.total_tokens == 4 * real and monitor.total_flops == pytest.approx(4 * real * 1e6)
    said = [r.getMessage() for r in caplog.records if "padding left out" in r.getMessage()]
    assert len(said) == 1 and f"from the batch's {key}" in said[0]  # once, naming where it read them
    assert f"{real / step_s:,.0f} tokens/s, {positions / step_s:,.0f} with padding" in monitor.summary["text"]


def test_a_mask_of_another_shape_says_once_that_padding_is_counted(tmp_path):
    """A 4-D attention mask (as a model's own collator may build) cannot say which input positions are padding: every
    position counts, said once, where it was counted without a word."""
    clock, step_s = FakeClock(), 0.5
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, 1, T, T, dtype=torch.bool)}
    monitor = MFUMonitor(log_every_n_steps=3, warmup_steps=1, peak_flops=1e9, clock=clock)
    with pytest.warns(UserWarning, match=rf"attention_mask has shape \({B}, 1, {T}, {T}\), not that of its input ids \({B}, {T}\), "
                      r"so which positions .* count every position, padding included\. MFUMonitor\(tokens_fn=\.\.\.\)") as said:
        _trainer(tmp_path, [monitor], max_steps=4).fit(_MaskedLM(clock, step_s), loader([batch] * 4))
    assert len([w for w in said if "has shape" in str(w.message)]) == 1
    (metrics,) = monitor.history
    assert metrics["perf/tokens_per_sec"] == pytest.approx(B * T / step_s) and "perf/tokens_per_sec_padded" not in metrics


def test_a_resumed_run_keeps_the_counts_and_counts_no_length_again(tmp_path, caplog):
    """The FLOPs per token counted before a checkpoint come back with it: a resumed run counts a step at the same
    sequence lengths as the run that was not stopped (a compiled module's counted step runs eagerly)."""
    from tests._module_shapes import HFLlamaModule, shape_loader

    torch.manual_seed(0)
    monitor = MFUMonitor(warmup_steps=0, prog_bar=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, [monitor, ckpt], max_steps=2, enable_checkpointing=True).fit(HFLlamaModule(), shape_loader("hf-llama-mask", B))
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("MFUMonitor")]
    assert [seq_len for seq_len, _ in state["counted_flops_per_token"]] == [T]
    resumed = MFUMonitor(warmup_steps=0, prog_bar=False)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [resumed], max_steps=4).fit(HFLlamaModule(), shape_loader("hf-llama-mask", B),
                                                         ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert not [r for r in caplog.records if "counted over a real training step" in r.getMessage()]  # not counted again
    assert resumed.flops_source == monitor.flops_source == "HFLlamaModule.training_step, counted over a real step"
    assert resumed.total_flops / resumed.total_tokens == pytest.approx(monitor.total_flops / monitor.total_tokens)


def test_the_monitor_stays_thin_its_state_in_the_meter(tmp_path):
    # The callback keeps its options and hands what a fit measures to one MFUMeter (perf/mfu_meter.py), as
    # Lightning's ThroughputMonitor hands its window to Throughput: its own attributes stay few.
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    trainer = _trainer(tmp_path, [monitor], max_steps=3)
    trainer.fit(ClockedGPTModule(FakeClock(), 0.0, preset="tiny"), loader(TokenBatches(3, B, T)))
    options = {"log_every_n_steps", "warmup_steps", "peak_flops", "dtype", "flops_per_token", "tokens_fn",
               "measure_peak", "prog_bar", "report", "_clock"}
    own = set(vars(monitor)) - {"log", "log_dict"}  # the Trainer hands every callback the module's log methods
    assert own == options | {"summary", "_dtype", "_meter"}
    assert len(own) <= 15
    assert isinstance(monitor.meter, MFUMeter) and monitor.meter.steps == 3 and len(monitor.history) == 1
    assert monitor.history is monitor.meter.history and monitor.total_tokens == 3 * B * T
