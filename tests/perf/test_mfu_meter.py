"""MFUMeter and its parts alone: a fake clock, plain batches, no Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpuopt.perf.mfu_meter import FlopsPerToken, MFUMeter, TimingWindow, seq_len_of


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_window_leaves_out_pauses_and_counts_the_wait_between_batches():
    window = TimingWindow()
    window.restart(0.0)
    window.batch_starts(0.0)
    window.last_batch_end = 1.0  # a batch of 1 s
    assert window.can_pause()
    window.begin_pause(1.5)  # validation after 0.5 s of waiting...
    assert not window.can_pause()  # ...pauses once
    window.batch_starts(4.0)  # ...ends with the next batch, which waited 0.5 s in all
    assert window.paused == pytest.approx(2.5) and window.wait == pytest.approx(0.5)
    assert window.seconds(5.0) == pytest.approx(2.5)  # 5 s, 2.5 of them paused
    window.restart(5.0)
    assert (window.wait, window.paused, window.tally.positions) == (0.0, 0.0, 0)


def _step(meter: MFUMeter, clock: Clock, global_step: int, tokens: int = 64, fpt: float = 1e6, seconds: float = 0.5):
    meter.batch_starts()
    clock.now += seconds
    meter.add(tokens, tokens, fpt)
    closed = meter.end_window(replicas=2) if meter.step_ends(global_step) else None
    meter.batch_ends()
    return closed


def test_warm_up_then_windows_of_n_steps_with_their_metrics():
    clock = Clock()
    meter = MFUMeter(window=2, warmup_steps=1, peak=1e9, clock=clock)
    meter.start(global_step=0)
    assert meter.timing.start is None  # warming up
    closed = [_step(meter, clock, step) for step in range(1, 6)]
    assert [c is not None for c in closed] == [False, False, True, False, True]  # steps 3 and 5
    metrics = closed[2]
    assert metrics["perf/step_time_ms"] == pytest.approx(500.0)
    assert metrics["perf/tokens_per_sec"] == pytest.approx(2 * 64 / 0.5)  # two data-parallel replicas
    assert metrics["perf/mfu"] == pytest.approx(64 * 1e6 / 0.5 / 1e9)
    assert meter.history == [closed[2], closed[4]] and [w.steps for w in meter.windows] == [2, 2]
    assert meter.total_tokens == 5 * 64 and meter.total_flops == pytest.approx(5 * 64 * 1e6)
    report = meter.summarise(dtype="bf16", replicas=2)
    assert report["metrics"]["perf/tokens_per_sec"] == pytest.approx(256.0) and "2 windows of 2 steps" in report["text"]


def test_micro_batches_of_one_optimizer_step_close_one_window():
    clock = Clock()
    meter = MFUMeter(window=1, warmup_steps=0, clock=clock)
    meter.start(global_step=0)
    assert _step(meter, clock, global_step=0) is None  # a micro-batch that accumulates: no step yet
    assert _step(meter, clock, global_step=1)["perf/tokens_per_sec"] == pytest.approx(2 * 128 / 1.0)


def test_a_pause_is_not_the_windows_time():
    clock = Clock()
    meter = MFUMeter(window=1, warmup_steps=0, clock=clock)
    meter.start(global_step=0)
    meter.batch_starts()
    clock.now += 1.0
    meter.add(64, 64, None)
    meter.batch_ends()
    meter.pause()  # validation
    clock.now += 5.0
    meter.resume()
    clock.now += 0.5  # the wait for the next batch
    meter.batch_starts()
    clock.now += 1.0
    meter.add(64, 64, None)
    assert meter.step_ends(1)
    metrics = meter.end_window()
    assert metrics["perf/step_time_ms"] == pytest.approx(2500.0)  # 7.5 s less the 5 s paused
    assert metrics["perf/dataloader_wait_pct"] == pytest.approx(100 * 0.5 / 2.5)
    assert "perf/tflops_per_device" not in metrics  # FLOPs per token unknown


def test_the_saved_state_is_the_last_optimizer_steps_and_resumes_the_totals():
    clock = Clock()
    meter = MFUMeter(window=1, warmup_steps=0, clock=clock)
    meter.start(global_step=0)
    _step(meter, clock, global_step=1)
    meter.batch_starts()
    meter.add(64, 64, 1e6)  # a micro-batch after the step: not in the checkpoint
    state = meter.state_dict()
    assert (state["total_tokens"], state["total_flops"], len(state["history"])) == (64, 64e6, 1)

    resumed = MFUMeter(window=1, warmup_steps=0, clock=clock)
    resumed.load_state_dict(state)
    resumed.start(global_step=1)
    _step(resumed, clock, global_step=2)
    assert resumed.total_tokens == 128 and len(resumed.history) == 2
    assert "the run so far, resumed: 128 tokens" in resumed.summarise(dtype="fp32")["text"]


def test_real_tokens_leave_padding_out_and_the_padded_rate_is_kept():
    clock = Clock()
    meter = MFUMeter(window=1, warmup_steps=0, clock=clock)
    meter.start(global_step=0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :6] = 0  # row 1: 6 padding positions
    batch = {"input_ids": ids, "attention_mask": mask}
    meter.batch_starts()
    clock.now += 1.0
    meter.add(16, meter.real_tokens(batch), None)
    assert meter.step_ends(1)
    metrics = meter.end_window()
    assert metrics["perf/tokens_per_sec"] == pytest.approx(10.0) and metrics["perf/tokens_per_sec_padded"] == pytest.approx(16.0)
    assert meter.real_tokens((ids,)) is None  # no mask: every position is a token


class _Counted(nn.Module):
    """One matmul of known FLOPs per batch: (16 tokens, 16) @ (16, 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)

    def step(self) -> None:
        with torch.no_grad():
            self.proj(torch.ones(16, 16))


def test_flops_per_token_given_asked_or_counted_once_per_length_and_restored():
    batch = (torch.zeros(2, 8, dtype=torch.long),)  # 16 tokens at length 8
    assert seq_len_of(batch) == 8 and seq_len_of((torch.zeros(2, 8),)) is None  # float features are not tokens
    assert FlopsPerToken(given=5.0).for_batch(_Counted(), batch, 16) == 5.0

    asked = nn.Module()
    asked.flops_per_token = lambda seq_len: 100.0 * seq_len
    finder = FlopsPerToken()
    finder.start_count(asked, batch)
    assert not finder.running  # the module says its own: nothing counted
    assert finder.for_batch(asked, batch, 16) == 800.0 and finder.source == "Module.flops_per_token"

    module, counted = _Counted(), FlopsPerToken()
    counted.start_count(module, batch)
    assert counted.running
    module.step()
    assert counted.for_batch(module, batch, 16) == 2 * 16 * 32  # 2 * 16 * 16 * 32 FLOPs over 16 tokens
    assert not counted.running and counted.source == "_Counted.training_step, counted over a real step"
    counted.start_count(module, batch)
    assert not counted.running  # this length is known: not counted again
    assert counted.saved() == []  # no optimizer step yet
    counted.step_done()
    assert counted.saved() == [[8, 1024.0]]

    restored = FlopsPerToken()
    restored.restore(counted.saved(), counted.source)
    restored.start_count(module, batch)
    assert not restored.running and restored.for_batch(module, batch, 16) == 1024.0 and restored.source == counted.source


def test_a_count_abandoned_mid_step_leaves_no_counting_mode():
    finder = FlopsPerToken()
    finder.start_count(_Counted(), (torch.zeros(1, 4, dtype=torch.long),))
    assert finder.running
    finder.abandon()
    assert not finder.running
    finder.abandon()  # twice: nothing to end
