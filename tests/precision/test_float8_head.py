"""Float8Precision deciding the output head inside GPTModule's chunked loss (``precision.base.LossHead``): timed as
one more shape, run in float8 by the loss where it pays, reported, restored from a checkpoint."""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.precision import Float8Precision
from lightning_gpuopt.precision.base import LayerContext, LossHead
from lightning_gpuopt.precision.float8_decision import ShapeTiming, format_decision_table
from lightning_gpuopt.precision.float8_measure import measure_on_device
from lightning_gpuopt.precision.float8_timing import gemm_timing, loss_head_cast_bytes, loss_head_timing
from tests.precision._helpers import LossRecorder, plugin_trainer, tiny_gpt_module, token_loader

H100 = REFERENCE_DEVICES["H100 SXM"]
HEAD = (64, 512)  # (hidden size, vocabulary rows)


class _Timer:
    """float8 wins on the loss head only (or loses there with ``head_wins=False``); records the head's calls."""

    def __init__(self, head_wins: bool = True) -> None:
        self.head_wins, self.head_calls, self.calls = head_wins, [], 0

    def shape(self, shape):
        self.calls += 1
        return ShapeTiming(1.0, 1.5)

    def loss_head(self, shape, chunks):
        self.head_calls.append((shape, chunks))
        return ShapeTiming(4.0, 2.0 if self.head_wins else 4.0)

    def ceiling(self) -> float:
        return 1e12


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.lm_head = nn.Linear(*HEAD, bias=False)


def _plugin(timer, tmp_path, recipe="tensorwise", facts=H100, module_filter="auto", emulate=False):
    plugin = Float8Precision(recipe=recipe, module_filter=module_filter, emulate=emulate)
    plugin.bind(torch.device("cpu"), facts)  # a GPU's facts on the CPU: nothing here runs a float8 matmul
    plugin.timer, plugin.timing_cache_root = timer, tmp_path
    return plugin


def _convert(plugin, rows=128, tokens=256):
    told = []
    head = LossHead("model.lm_head", *HEAD, rows, told.append)
    plugin.convert_layers(_Model(), "model", LayerContext(tokens=tokens, flops_per_token=6 * 600_000, loss_head=head))
    return told


def _head_row(plugin):
    return next(row for row in plugin.conversion_report if row[0] == "model.lm_head")


def test_the_head_is_timed_per_chunk_and_runs_in_float8_where_it_pays(tmp_path):
    timer = _Timer()
    plugin = _plugin(timer, tmp_path)
    told = _convert(plugin, rows=128, tokens=256)
    assert told == [True] and plugin.fp8
    assert timer.head_calls == [((128, 64, 512, False), 2)]  # 256 tokens: 2 chunks of 128 rows
    row = plugin.decision.loss_head()
    assert row.convert and row.layers == 2 and plugin.decision.converted_shapes() == set()  # no Linear converted
    assert plugin.float8_layers == [("model.lm_head", "64x512")]
    assert plugin.float8_flop_share() == pytest.approx(64 * 512 / 600_000)
    assert "64x512 loss" in format_decision_table(plugin.decision)
    # a second run of this GPU: the head's timing comes from the cache, apart from a Linear of its shape
    again = _Timer()
    assert _convert(_plugin(again, tmp_path)) == [True] and again.head_calls == [] and again.calls == 0


def test_a_head_that_does_not_pay_stays_in_bf16_and_says_why(tmp_path):
    plugin = _plugin(_Timer(head_wins=False), tmp_path)
    told = _convert(plugin)
    assert told == [False] and not plugin.fp8
    assert _head_row(plugin)[2] == "output layer; in the loss: timed: float8 1.00x: not 1.05x faster"


@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(emulate=True, timer=None), "only where a timing says so; static (emulated"),
    (dict(recipe="rowwise"), "only under the tensorwise recipe"),
    (dict(module_filter="static"), "output layer"),  # the filter's own row
    (dict(facts=REFERENCE_DEVICES["A100"], emulate=True), "need float8 matmuls, which cuda:0 NVIDIA A100"),
])
def test_where_the_head_is_not_timed_it_stays_in_bf16_with_the_reason(tmp_path, kwargs, reason):
    timer = kwargs.pop("timer", _Timer())
    plugin = _plugin(timer, tmp_path, **kwargs)
    assert _convert(plugin) == [False] and reason in _head_row(plugin)[2], _head_row(plugin)
    assert timer is None or timer.head_calls == []


@pytest.mark.parametrize(("shape", "rows", "reason"), [
    ((40, 512), 128, "not 40x512 in chunks of 128 tokens"),
    ((64, 500), 128, "not 64x500 in chunks of 128 tokens"),
    ((64, 512), 24, "not 64x512 in chunks of 24 tokens"),
])
def test_a_head_torch_scaled_mm_cannot_multiply_is_not_timed_and_says_why(tmp_path, shape, rows, reason):
    # the loss refuses such a head in float8 (model/loss.py): turned on, it would stop the fit at its first step
    timer, told = _Timer(), []
    plugin = _plugin(timer, tmp_path)
    head = LossHead("model.lm_head", *shape, rows, told.append)
    plugin.convert_layers(_Model(), "model", LayerContext(tokens=256, flops_per_token=6 * 600_000, loss_head=head))
    assert told == [False] and timer.head_calls == [] and plugin.decision.loss_head() is None
    only = "output layer (its GEMMs in the loss run float8 only with dims and chunk multiples of 16, "
    assert _head_row(plugin)[2] == f"{only}{reason})"


def test_where_the_module_s_loss_cannot_run_it_the_head_says_why(tmp_path):
    timer = _Timer()
    plugin = _plugin(timer, tmp_path)
    told = []
    head = LossHead("model.lm_head", *HEAD, 128, told.append, unavailable="its vocabulary is split")
    plugin.convert_layers(_Model(), "model", LayerContext(tokens=256, flops_per_token=6 * 600_000, loss_head=head))
    assert told == [False] and timer.head_calls == []
    why = _head_row(plugin)[2]
    assert why == "output layer (its GEMMs in the loss cannot run float8 in this run: its vocabulary is split)"


@pytest.mark.parametrize(("kwargs", "tensor_parallel", "reason"), [
    (dict(compile=True, compile_scope="model"), 1, "compile_scope='model' computes the loss from the full logits"),
    (dict(), 2, "split over 2 tensor-parallel ranks"),
    (dict(compile=True, compile_scope="model", loss_impl="chunked"), 1, None),  # its chunked loss stays
    (dict(compile=True), 1, None),
])
def test_gptmodule_says_where_its_loss_cannot_run_the_head_in_float8(kwargs, tensor_parallel, reason):
    head = tiny_gpt_module(loss_chunk_size=64, **kwargs)._loss_head(tensor_parallel)
    assert (head.name, head.in_features, head.out_features, head.rows) == ("model.lm_head", 64, 256, 64)
    assert (head.unavailable is None) if reason is None else (reason in head.unavailable), head.unavailable


def test_under_fsdp2_a_whole_model_compile_keeps_the_chunked_loss_and_offers_the_head(mesh):
    module = tiny_gpt_module(loss_chunk_size=64, compile=True, compile_scope="model")
    module._device_mesh = mesh  # as ModelParallelStrategy sets it: compile_gpt then compiles each block
    assert module._loss_head(1).unavailable is None


def test_a_resume_runs_the_head_as_the_saved_run_did(tmp_path):
    saved = _plugin(_Timer(head_wins=True), tmp_path / "gpu-a")
    _convert(saved)
    resumed = _plugin(_Timer(head_wins=False), tmp_path / "gpu-b")
    told = _convert(resumed)
    assert told == [False]
    resumed.load_state_dict(saved.state_dict())
    assert told == [False, True] and resumed.fp8 and resumed.decision.method == "checkpoint"
    assert _head_row(resumed)[2] is None


@pytest.mark.parametrize(("rows", "unavailable", "facts", "reason"), [
    (128, "its vocabulary is split", H100, "cannot run float8 in this run: its vocabulary is split"),
    (24, None, H100, "only with dims and chunk multiples of 16, not 64x512 in chunks of 24 tokens"),
    (128, None, REFERENCE_DEVICES["A100"], "need float8 matmuls, which cuda:0 NVIDIA A100"),
])
def test_a_resume_that_cannot_run_the_saved_float8_head_keeps_it_in_bf16_and_says_so(
    tmp_path, rows, unavailable, facts, reason
):
    # e.g. resumed under tensor parallelism or compile_scope="model", on an A100: the loss would refuse the head
    saved = _plugin(_Timer(), tmp_path / "gpu-a")
    _convert(saved)
    resumed, told = _plugin(_Timer(), tmp_path / "gpu-b", facts=facts, emulate=True), []
    head = LossHead("model.lm_head", *HEAD, rows, told.append, unavailable)
    resumed.convert_layers(_Model(), "model", LayerContext(tokens=256, flops_per_token=6 * 600_000, loss_head=head))
    with pytest.warns(UserWarning, match="output head in float8 inside the loss, but its GEMMs .* bf16 here"):
        resumed.load_state_dict(saved.state_dict())
    assert told == [False, False] and not resumed.fp8 and reason in _head_row(resumed)[2]


class _AllWin(_Timer):
    def shape(self, shape):
        self.calls += 1
        return ShapeTiming(1.0, 0.5)


def test_a_resume_under_fsdp2_keeps_its_layers_but_runs_the_head_as_saved(tmp_path, mesh):
    from torch.distributed.fsdp import fully_shard

    saved = _plugin(_AllWin(), tmp_path / "gpu-a")  # fc and the head in float8
    _convert(saved)
    resumed = _plugin(_Timer(head_wins=False), tmp_path / "gpu-b")  # neither
    told = _convert(resumed)
    with pytest.warns(UserWarning, match="converted none"):
        resumed.convert_module(fully_shard(_Model(), mesh=mesh))  # sharded: its layers cannot change now
    with pytest.warns(UserWarning, match=r"cannot change its layers .* its own \(the output head in the loss runs as"):
        resumed.load_state_dict(saved.state_dict())
    assert told == [False, True] and resumed.decision.converts_loss_head()  # the head is no layer: it follows
    assert resumed.decision.converted_shapes() == set() and resumed.float8_layers == [("model.lm_head", "64x512")]


def test_the_head_s_casts_and_gemms_run_on_the_cpu():
    # per chunk of 128 rows, 2 chunks: the weight's casts halved, one float32 add of the weight gradient
    w, x = 512 * 64, 128 * 64
    assert loss_head_cast_bytes(128, 64, 512, 2) == int(10 * w / 2 + 7 * x + 8 * w / 2)
    assert loss_head_cast_bytes(128, 64, 512, 1) == 10 * w + 7 * x  # one chunk: no add
    t = loss_head_timing(32, 64, 128, 1, torch.device("cpu"), bandwidth=1e12, repeats=1)
    base = gemm_timing(32, 64, 128, "tensorwise", torch.device("cpu"), bandwidth=1e12, repeats=1)
    assert t.bf16_ms > 0 and t.float8_ms > 0 and base.float8_ms > 0


def test_measure_on_device_keeps_the_head_apart_in_the_cache(tmp_path):
    timer = _Timer()
    head = (128, 64, 512, False)
    measure = partial(measure_on_device, {head: 2}, "tensorwise", "gemm", None, 1e9, torch.device("cpu"), H100,
                      timer=timer, cache_root=tmp_path)
    as_head, as_linear = measure(loss_head=head), measure()
    assert as_head.converts_loss_head() and as_head.converted_shapes() == set()
    assert as_linear.loss_head() is None and as_linear.converted_shapes() == set()  # timed as a Linear: loses
    assert len(timer.head_calls) == 1 and timer.calls == 1


class _Data(pl.LightningDataModule):
    """Says its micro-batch and sequence length: the tokens the head's chunks are planned for."""

    block_size, batch_size = 32, 4

    def train_dataloader(self):
        return token_loader(n_seq=16, seq_len=self.block_size, batch_size=self.batch_size)


def test_a_gptmodule_fit_runs_its_loss_head_in_float8_where_the_timing_says(tmp_path):
    plugin = Float8Precision(emulate=True)  # emulated Linear layers; the loss head runs torch._scaled_mm on the CPU
    plugin.timer, plugin.timing_cache_root = _Timer(), tmp_path
    module = tiny_gpt_module(loss_chunk_size=64)
    losses = LossRecorder()
    trainer = plugin_trainer(plugin, max_steps=2, default_root_dir=tmp_path, callbacks=[losses])
    with pytest.warns(UserWarning, match="not compiled"):
        trainer.fit(module, datamodule=_Data())
    assert module.model.head_float8 and plugin.float8_layers == [("model.lm_head", "64x256")]
    assert plugin.decision.loss_head().tokens == 64 and plugin.decision.loss_head().layers == 2  # 4 x 32 tokens
    assert len(losses.losses) == 2 and all(4.0 < loss < 6.5 for loss in losses.losses)  # about ln(256) = 5.5


def test_a_gptmodule_fit_whose_chunk_float8_cannot_multiply_trains_its_head_in_bf16(tmp_path):
    plugin = Float8Precision(emulate=True)
    timer = _Timer()
    plugin.timer, plugin.timing_cache_root = timer, tmp_path
    module = tiny_gpt_module(loss_chunk_size=24)  # not a multiple of 16: the float8 loss would refuse it
    losses = LossRecorder()
    trainer = plugin_trainer(plugin, max_steps=1, default_root_dir=tmp_path, callbacks=[losses])
    with pytest.warns(UserWarning, match="converted none"):
        trainer.fit(module, datamodule=_Data())
    assert not module.model.head_float8 and timer.head_calls == [] and not plugin.fp8
    assert "chunks of 24 tokens" in _head_row(plugin)[2]
    assert len(losses.losses) == 1 and 4.0 < losses.losses[0] < 6.5
