"""MFU arithmetic as plain functions: window metrics, the report and its advice, option checks."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.callbacks import MFUMonitor
from lightning_gpuopt.perf.mfu import WindowTotals, input_ids_of, mfu_peaks, summarise_windows, window_metrics


def test_window_metrics_values():
    m = window_metrics(tokens=8192, flops=8192 * 1e9, elapsed=2.0, steps=4, wait=0.5, replicas=2,
                       peak=1e13, peak_fp8=2e13, measured_peak=8e12)
    assert m == {
        "perf/tokens_per_sec": 8192.0,
        "perf/tokens_per_sec_per_device": 4096.0,
        "perf/step_time_ms": 500.0,
        "perf/dataloader_wait_pct": 25.0,
        "perf/tflops_per_device": 4.096,
        "perf/mfu": 0.4096,
        "perf/mfu_fp8": 0.2048,
        "perf/mfu_measured": 0.512,
    }


def test_tensor_parallel_divides_a_rank_s_tokens_and_flops_over_its_devices():
    """2 data-parallel ranks of 4 tensor-parallel devices: each rank's 8192 tokens are counted once for the
    global rate, and each of its 4 devices does a quarter of their FLOPs."""
    m = window_metrics(tokens=8192, flops=8192 * 1e9, elapsed=2.0, steps=4, wait=0.0, replicas=2, peak=1e13,
                       tensor_parallel=4)
    assert m["perf/tokens_per_sec"] == 8192.0  # 4096 tokens/s per rank x 2 ranks
    assert m["perf/tokens_per_sec_per_device"] == 1024.0 and m["perf/tflops_per_device"] == 1.024
    assert m["perf/mfu"] == pytest.approx(0.1024)
    report = summarise_windows([WindowTotals(8192, 8192 * 1e9, 2.0, 4, 0.0)], window=4, warmup_steps=0, dtype="bf16",
                               fit_tokens=8192, fit_flops=8192 * 1e9, replicas=2, peak=1e13, tensor_parallel=4)
    assert report["metrics"] == m and "8,192 tokens per data-parallel rank (4 tensor-parallel devices)" in report["text"]


def test_unknown_flops_log_throughput_only():
    m = window_metrics(tokens=100, flops=None, elapsed=1.0, steps=1, wait=0.0, replicas=1, peak=1e12)
    assert "perf/mfu" not in m and "perf/tflops_per_device" not in m and m["perf/tokens_per_sec"] == 100.0


def test_report_advice_names_the_fix():
    windows = [WindowTotals(tokens=10, flops=2e12, seconds=1.0, steps=2, wait=0.2)]
    report = summarise_windows(windows, window=2, warmup_steps=1, dtype="fp8", fit_tokens=1000, fit_flops=2e12,
                               peak=8e12, peak_memory_pct=30.0, on_cuda=True, compiled=False)
    assert "MFU 25.0%" in report["text"] and "1,000 tokens per device" in report["text"]
    assert len(report["advice"]) == 3
    assert "AutoBatchSize" in report["advice"][0] and "num_workers" in report["advice"][1]
    assert "compile the model" in report["advice"][2]


def test_report_divides_totals_over_the_same_span():
    # a fast and a slow window: the mean of their rates (1,500 tokens/s) and of their step times would disagree
    windows = [WindowTotals(tokens=2000, flops=2e12, seconds=1.0, steps=1, wait=0.0),
               WindowTotals(tokens=2000, flops=2e12, seconds=3.0, steps=1, wait=0.4)]
    report = summarise_windows(windows, window=1, warmup_steps=0, dtype="bf16", fit_tokens=4000, fit_flops=4e12,
                               replicas=2, peak=1e13, run_tokens=9000, run_flops=9e12)
    m = report["metrics"]
    assert m["perf/tokens_per_sec"] == 2 * 4000 / 4.0 and m["perf/step_time_ms"] == 2000.0
    assert m["perf/mfu"] == pytest.approx(4e12 / 4.0 / 1e13) and m["perf/dataloader_wait_pct"] == pytest.approx(10.0)
    assert "2,000 tokens/s (2000.0 ms/step)" in report["text"] and "MFU 10.0%" in report["text"]
    assert "2 windows of 1 step in this fit" in report["text"]
    assert "the run so far, resumed: 9,000 tokens per device (9 model TFLOP)" in report["text"]


def test_too_short_a_run_says_how_many_steps_it_needs():
    report = summarise_windows([], window=5, warmup_steps=3, dtype="bf16", fit_tokens=0, fit_flops=0.0)
    assert "needs 8 optimizer steps" in report["text"] and report["advice"] == []


def test_peaks_off_cuda_come_from_the_user_only():
    assert mfu_peaks(REFERENCE_DEVICES["cpu"], "bf16") == (None, None, "a cpu device")
    assert mfu_peaks(REFERENCE_DEVICES["cpu"], "bf16", 1e14) == (1e14, None, "a cpu device")


# reference device -> (bf16 peak, fp8 peak under fp8) in TFLOP/s: the fp16 peak where there are no bf16 tensor cores
PEAKS = {"H100 SXM": (989.4, 1978.9), "H200": (989.4, 1978.9), "A100": (312.0, None), "L4": (121.0, 242.5),
         "V100": (125.0, None), "T4": (65.0, None), "cpu": (None, None)}


@pytest.mark.parametrize("name", sorted(PEAKS))
def test_peaks_from_device_facts(name):
    facts = REFERENCE_DEVICES[name]
    peak, peak_fp8, shown = mfu_peaks(facts, "fp8")
    tflops = tuple(None if p is None else round(p / 1e12, 1) for p in (peak, peak_fp8))
    assert tflops == PEAKS[name]
    assert shown == (facts.name if facts.is_cuda else "a cpu device")
    assert mfu_peaks(facts, "bf16")[1] is None  # the fp8 peak only under fp8
    assert mfu_peaks(facts, "bf16", 1e14)[0] == 1e14  # the user's peak wins


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"log_every_n_steps": 0}, "log_every_n_steps"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"peak_flops": 0.0}, "peak_flops"),
    ({"dtype": "int8"}, r"MFUMonitor.dtype must be 'fp32', 'tf32', 'bf16', 'fp16', 'fp8' or None, got 'int8'"),
    ({"flops_per_token": -5.0}, "flops_per_token"),
])
def test_bad_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MFUMonitor(**kwargs)


def test_input_ids_of_each_batch_shape():
    ids = torch.zeros(2, 16, dtype=torch.long)
    assert input_ids_of(ids) is ids and input_ids_of((ids, ids)) is ids and input_ids_of({"input_ids": ids}) is ids
    assert input_ids_of({"tokens": ids}) is None
    features = torch.randn(2, 16)  # an (x, y) regression batch: float features are not tokens
    assert input_ids_of(features) is None and input_ids_of((features, features)) is None
    assert input_ids_of({"input_ids": features}) is None and input_ids_of(ids.bool()) is None
    assert input_ids_of((ids.int(), features)) is not None


def test_a_window_without_tokens_reports_no_rate():
    m = window_metrics(tokens=0, flops=0.0, elapsed=2.0, steps=4, wait=0.5, replicas=1, peak=1e12)
    assert m == {"perf/step_time_ms": 500.0, "perf/dataloader_wait_pct": 25.0}
    report = summarise_windows([WindowTotals(0, None, 2.0, 4, 0.5)], window=4, warmup_steps=0, dtype="fp32",
                               fit_tokens=0, fit_flops=0.0)
    assert "500.0 ms/step (no tokens found in the batches: no tokens/s or MFU)" in report["text"]
    assert "tokens/s (" not in report["text"] and "tokens per device" not in report["text"]


def test_real_tokens_read_the_mask_or_the_labels_without_reading_the_device():
    from lightning_gpuopt.perf.mfu import TokenTally, real_tokens_of

    ids = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    count, key = real_tokens_of({"input_ids": ids, "attention_mask": mask, "labels": torch.full((2, 4), -100)})
    assert isinstance(count, torch.Tensor) and int(count) == 6 and key == "attention_mask"  # the mask comes first
    count, key = real_tokens_of({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100)})
    assert int(count) == 6 and key == "labels"
    assert real_tokens_of((ids, ids)) is None and real_tokens_of({"input_ids": ids}) is None
    assert real_tokens_of({"input_ids": ids, "attention_mask": torch.ones(2, 5)}) is None  # not the ids' shape
    tally = TokenTally()
    tally.add(8, torch.tensor(6), 10.0)
    snapshot = tally.copy()
    tally.add(8, 8, 20.0)
    assert tally.read() == (14, 6 * 10.0 + 8 * 20.0, True) and tally.positions == 16
    assert snapshot.read() == (6, 60.0, True) and snapshot.positions == 8
    tally.add(4, 4, None)  # FLOPs per token unknown for one micro-batch
    assert tally.read() == (18, 220.0, False)


@pytest.mark.parametrize(
    "mask, kept",
    [
        (torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]), 6),  # Hugging Face's 1 = keep, left or right padding
        (torch.tensor([[True, True, False, False], [True] * 4]), 6),
        (torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0] * 4]), 7),  # the same as floats
        (torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")], [0.0] * 4]), 6),  # additive: 0 keeps
        (torch.tensor([[0.0, -1e9, -1e9, -1e9], [0.0, 0.0, 0.0, -1e4]]), 4),  # additive with a large negative
        (torch.tensor([[0.0] * 4, [0.0] * 4], dtype=torch.bfloat16), 8),  # additive, nothing dropped
        (torch.tensor([[1.0] * 4, [1.0] * 4], dtype=torch.float16), 8),
    ],
)
def test_real_tokens_read_every_kind_of_attention_mask(mask, kept):
    from lightning_gpuopt.perf.mfu import real_tokens_of

    count, key = real_tokens_of({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask})
    assert key == "attention_mask" and count.dim() == 0 and int(count) == kept
