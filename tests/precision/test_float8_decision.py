"""Float8Precision's timed decision: from injected timings (convert, skip, decline the whole model), the timing
cache, the static fallback against torchao's own rule, honest ``fp8``, the MFU weighting, a restored decision."""

from __future__ import annotations

import copy
import os
import socket
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpuopt.model import GPT
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.perf.mfu import fp8_weighted_peak
from lightning_gpuopt.precision import Float8Precision
from lightning_gpuopt.precision.base import LayerContext
from lightning_gpuopt.precision.float8_decision import (
    Float8Decision,
    ShapeTiming,
    TimingCache,
    decided_on_rank_zero,
    decide,
    format_decision_table,
    static_decision,
    timing_cache_file,
)
from lightning_gpuopt.precision.float8_layers import auto_skip_reason, candidate_shapes
from lightning_gpuopt.precision.float8_measure import measure_on_device
from lightning_gpuopt.precision.float8_timing import cast_bytes, gemm_timing
from tests.precision._helpers import plugin_trainer, tiny_gpt_module, token_loader

H100 = REFERENCE_DEVICES["H100 SXM"]
SMALL, WIDE = (256, 64, 64, True), (256, 64, 256, True)  # (tokens, in, out, bias)


def test_decide_converts_where_float8_is_5_percent_faster_and_declines_a_small_saving():
    counts = {SMALL: 4, WIDE: 2}
    timings = {SMALL: ShapeTiming(1.0, 0.96), WIDE: ShapeTiming(2.0, 1.5)}  # 4% and 25% faster
    d = decide(timings, counts, "tensorwise", step_ms=20.0, method="gemm")
    assert [(r.out_features, r.convert) for r in d.shapes] == [(64, False), (256, True)]
    assert d.declined is None and d.converted_shapes() == {(64, 256, True)}
    # 2 x 0.5 ms saved is 2.5% of a 40 ms step: the whole model stays in bf16
    declined = decide(timings, counts, "tensorwise", step_ms=40.0, method="gemm")
    assert declined.converted_shapes() == set() and "2.5% < 3%" in declined.declined
    assert "whole model stays in bf16" in format_decision_table(declined)
    assert Float8Decision.from_dict(declined.to_dict()) == declined


class _Timer:
    """Injected timings: float8 wins on out_features >= 256 only; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def shape(self, shape):
        self.calls += 1
        return ShapeTiming(1.0, 0.5 if shape[2] >= 256 else 1.2)

    def ceiling(self) -> float:
        return 1e12


def test_cache_hit_then_a_miss_after_a_torch_or_gpu_change(tmp_path, monkeypatch):
    timer, counts = _Timer(), {SMALL: 1, WIDE: 1}
    measure = partial(measure_on_device, counts, "tensorwise", "gemm", None, 1e9, torch.device("cpu"), timer=timer,
                      cache_root=tmp_path)
    first = measure(H100)
    assert timer.calls == 2 and first.converted_shapes() == {(64, 256, True)}
    assert measure(H100) == first and timer.calls == 2  # a hit: nothing timed again
    measure(REFERENCE_DEVICES["H200"])  # another GPU
    assert timer.calls == 4
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch
    measure(H100)
    assert timer.calls == 6
    assert not list(timing_cache_file(tmp_path).parent.glob("*.tmp"))  # written through a temporary, replaced
    cache = TimingCache(timing_cache_file(tmp_path), {"gpu": "x"})
    assert cache.entries and all("torch=" in key for key in cache.entries)


def _linears(preset: str) -> list[tuple[str, nn.Linear]]:
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(preset))
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


@pytest.mark.parametrize("preset", ["124m", "774m", "llama-1b"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_static_fallback_is_torchaos_own_rule(preset, recipe):
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    torchao_keeps = _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])
    layers = _linears(preset)
    ours = {name: auto_skip_reason(m, name, recipe) is None for name, m in layers}
    assert ours == {name: torchao_keeps(m, name) for name, m in layers}
    counts = candidate_shapes(nn.ModuleDict({"m": layers[0][1]}), 8192)
    static = static_decision(counts, recipe, "emulated")
    assert static.method == "static (emulated)" and static.shapes[0].convert == ours[layers[0][0]]


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 256), nn.Linear(256, 64))


def _plugin(timer=None, tmp_path=None) -> Float8Precision:
    plugin = Float8Precision()
    plugin.bind(torch.device("cpu"), H100)  # a GPU's facts on the CPU: nothing here runs a float8 matmul
    plugin.timer, plugin.timing_cache_root = timer, tmp_path
    plugin.layer_context = LayerContext(tokens=256, flops_per_token=6 * 3 * 64 * 256)
    return plugin


def _float8_names(root: nn.Module) -> list[str]:
    return [n for n, m in root.named_modules() if type(m).__name__ == "Float8Linear"]


def test_plugin_converts_by_the_injected_timings_and_fp8_says_so(tmp_path):
    root = _tiny()
    plugin = _plugin(_Timer(), tmp_path)
    assert plugin.fp8 is False  # nothing converted yet
    plugin.convert(root, "model")
    assert _float8_names(root) == ["2"] and plugin.decision.method == "gemm"
    assert plugin.fp8 and plugin.float8_layers == [("model.2", "64x256")]
    assert plugin.float8_flop_share() == pytest.approx(1 / 3)  # 64x256 of the 3 x 64x256 FLOPs per token


def test_fp8_is_false_when_nothing_converted(tmp_path):
    plugin = _plugin(_Loses(), tmp_path)
    root = _tiny()
    plugin.convert(root, "model")
    assert _float8_names(root) == [] and plugin.fp8 is False
    assert all(reason.startswith("timed: float8 0.67x") for _, _, reason in plugin.conversion_report)


class _Loses(_Timer):
    def shape(self, shape):
        return ShapeTiming(1.0, 1.5)


def test_a_restored_decision_converts_the_saved_layers(tmp_path):
    root = _tiny()
    plugin = _plugin(_Timer(), tmp_path / "gpu-a")
    with pytest.warns(UserWarning, match="not compiled"):
        plugin.convert_module(root)
    saved = plugin.state_dict()
    resumed, fresh = _plugin(_Loses(), tmp_path / "gpu-b"), _tiny()  # this run's timing converts nothing
    with pytest.warns(UserWarning, match="converted none"):
        resumed.convert_module(fresh)
    assert _float8_names(fresh) == [] and not resumed.fp8
    weight = fresh[2].weight
    resumed.load_state_dict(saved)
    assert _float8_names(fresh) == ["2"] and resumed.decision.method == "checkpoint"
    assert fresh[2].weight is weight and resumed.fp8  # the same parameter: the optimizer's stays valid
    resumed.load_state_dict({})  # a checkpoint without a decision changes nothing
    assert _float8_names(fresh) == ["2"]
    loser = _plugin(_Loses(), tmp_path / "gpu-c")
    loser.convert(_tiny(), "")
    resumed.load_state_dict(loser.state_dict())  # one that converted nothing: back to nn.Linear, same weight
    assert _float8_names(fresh) == [] and type(fresh[2]) is nn.Linear and fresh[2].weight is weight
    assert not resumed.fp8


class _Halved(nn.Linear):
    """A Linear of a user's own class, whose forward is not nn.Linear's."""

    def forward(self, x):
        return super().forward(x) / 2


def test_a_restored_decision_that_keeps_a_layer_in_bf16_puts_back_the_layer_itself(tmp_path):
    # This run's timing converts layer 2, the checkpoint's run kept it in bf16: after the restore it must compute as
    # there, with its own class and hooks, not as a new nn.Linear (the resumed run would not be bit-exact).
    root = _tiny()
    root[2] = _Halved(64, 256)
    root[2].register_forward_hook(lambda module, args, out: out + 1)
    twin, layer = copy.deepcopy(root), root[2]
    saved = _plugin(_Loses(), tmp_path / "gpu-a")
    saved.convert(copy.deepcopy(root), "")
    resumed = _plugin(_Timer(), tmp_path / "gpu-b")
    with pytest.warns(UserWarning, match="not compiled"):
        resumed.convert_module(root)
    assert _float8_names(root) == ["2"] and list(root.state_dict()) == list(twin.state_dict())  # no key added
    assert layer.weight is None and layer.bias is None  # the float8 layer alone holds them (FSDP2 shards them)
    resumed.load_state_dict(saved.state_dict())
    assert _float8_names(root) == [] and root[2] is layer and root[2].weight is layer.weight
    x = torch.randn(4, 64)
    assert torch.equal(root(x), twin(x))  # the class's halving and the hook, as in the run that never converted it


def test_mfu_peak_weighted_by_the_float8_share():
    assert fp8_weighted_peak(1e15, 2e15, 0.0) == pytest.approx(1e15)
    assert fp8_weighted_peak(1e15, 2e15, 1.0) == pytest.approx(2e15)
    assert fp8_weighted_peak(1e15, 2e15, 0.5) == pytest.approx(4e15 / 3)
    assert fp8_weighted_peak(1e15, None, 0.5) is None
    with pytest.raises(ValueError, match="fp8_share must be in"):
        fp8_weighted_peak(1e15, 2e15, 1.5)


def test_local_shard_shapes_under_tensor_parallelism():
    from lightning_gpuopt.model.tensor_parallel import local_linear_shape

    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("llama-tiny"))
    counts = candidate_shapes(model, 128, "model.", partial(local_linear_shape, size=2))
    d = model.config.n_embd
    assert (128, model.config.ffn_size // 2, d, False) in counts  # mlp.c_proj: input split
    assert (128, d, model.config.ffn_size // 2, False) in counts  # gate/up: output split


def _cpu_scaled_mm_takes_rowwise_scales() -> bool:
    a, b = torch.ones(16, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:  # torch 2.13's CPU kernel takes (rows, 1) and (1, cols) scales; torch 2.11's takes one scale each
        torch._scaled_mm(a, b.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def test_gemm_timing_runs_each_recipe_on_the_cpu():
    rowwise = _cpu_scaled_mm_takes_rowwise_scales()
    for recipe in ("tensorwise", *(("rowwise", "rowwise_with_gw_hp") if rowwise else ())):
        t = gemm_timing(32, 64, 48, recipe, torch.device("cpu"), bandwidth=1e10)
        assert t.bf16_ms > 0 and t.float8_ms > 1000 * cast_bytes(32, 64, 48, recipe) / 1e10
    assert cast_bytes(1, 1, 1, "tensorwise") == 6 + 2 + 6 + 6  # activation: 6 B per element, weight: 8 B


def test_linear_timing_runs_a_linear_with_its_bias_and_its_float8_twin(monkeypatch):
    from lightning_gpuopt.precision.float8_layers import float8_config
    from lightning_gpuopt.precision.float8_timing import linear_timing

    seen = []
    monkeypatch.setattr(torch, "compile", lambda module: seen.append(module) or module)  # a CPU compile takes 10+ s
    t = linear_timing(32, 64, 48, True, float8_config("tensorwise", emulate=True), torch.device("cpu"))
    assert t.bf16_ms > 0 and t.float8_ms > 0
    assert [type(m).__name__ for m in seen] == ["Linear", "Float8Linear"] and all(m.bias is not None for m in seen)


def _broadcast(rank: int, port: int, out: str, fail: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    ran = []

    def decide():
        ran.append(rank)
        if fail:
            raise OSError("the timing cache's disk is full")
        return {"rank": rank}

    try:
        got = decided_on_rank_zero(decide)
    except (OSError, RuntimeError) as err:
        got = f"{type(err).__name__}: {err}"
    finally:
        torch.distributed.destroy_process_group()
    torch.save({"got": got, "ran": ran}, f"{out}/{rank}.pt")


@pytest.mark.parametrize("fail", [False, True], ids=["decides", "fails"])
def test_rank_zero_decides_for_every_rank_and_its_failure_stops_them_all(tmp_path, fail):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children inherit the imports (spawn would import torch and the package again, ~20 s each)
    torch.multiprocessing.start_processes(_broadcast, args=(port, str(tmp_path), fail), nprocs=2, start_method="fork")
    zero, one = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert zero["ran"] == [0] and one["ran"] == []  # only rank 0 times
    if not fail:
        assert zero["got"] == one["got"] == {"rank": 0}
    else:  # rank 0 raises its own error; rank 1 is told, instead of waiting in the broadcast
        assert zero["got"] == "OSError: the timing cache's disk is full"
        assert one["got"].startswith("RuntimeError: Float8Precision: rank 0 failed while timing the float8 layers "
                                     "(OSError: the timing cache's disk is full)")


class _Data(pl.LightningDataModule):
    """Says its micro-batch and sequence length, and takes the micro-batch AutoBatchSize chooses."""

    block_size = 32

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2

    def use_micro_batch(self, size: int) -> None:
        self.batch_size = size

    def train_dataloader(self):
        return token_loader(n_seq=16, seq_len=self.block_size, batch_size=self.batch_size)


def test_gptmodule_decides_at_the_largest_micro_batch_autobatchsize_can_choose(tmp_path):
    from lightning_gpuopt.callbacks import AutoBatchSize

    plugin = Float8Precision(emulate=True)
    plugin.timer, plugin.timing_cache_root = _Timer(), tmp_path  # float8 wins on out >= 256: the MLP's c_fc
    module = tiny_gpt_module()
    search = AutoBatchSize(global_batch_size=8, max_micro_batch_size=4, steps_per_trial=1)
    trainer = plugin_trainer(plugin, max_steps=1, callbacks=[search], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="not compiled"):
        trainer.fit(module, datamodule=_Data())
    assert {r.tokens for r in plugin.decision.shapes} == {4 * 32}  # decided before the search, at its largest size
    assert search.micro_batch_size in (1, 2, 4)
    assert [n for n, _ in plugin.float8_layers] == ["model.transformer.h.0.mlp.c_fc", "model.transformer.h.1.mlp.c_fc",
                                                    "model.lm_head"]  # the head inside the loss too (out 256)
    assert module.model.head_float8
    assert plugin.fp8 and plugin.state_dict()["float8_decision"]["method"] == "gemm"


class _Others(_Timer):
    """float8 wins where _Timer's loses: out_features < 256 (attention's projections, the MLP's c_proj)."""

    def shape(self, shape):
        return ShapeTiming(1.0, 0.5 if shape[2] < 256 else 1.2)


def _fit_with(timer, tmp_path, ckpt_path=None):
    """A tiny GPTModule, 4 steps, checkpoints at step 2 (without ``ckpt_path``); its weights and plugin."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpuopt.callbacks import ExactResume

    torch.manual_seed(0)
    plugin = Float8Precision(emulate=True)
    plugin.timer, plugin.timing_cache_root = timer, tmp_path / type(timer).__name__
    module = tiny_gpt_module(dropout=0.1)
    saving = [] if ckpt_path else [ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)]
    trainer = plugin_trainer(plugin, callbacks=[ExactResume(rebuild_loaders=True), *saving],
                             enable_checkpointing=not ckpt_path, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="not compiled"):
        trainer.fit(module, datamodule=_Data(), ckpt_path=ckpt_path)
    return module.state_dict(), plugin


def test_a_resume_whose_timing_decided_other_layers_is_bit_exact(tmp_path):
    # e.g. resumed on another GPU: its own timing converts the other layers, the checkpoint's decision swaps them back
    uninterrupted, plugin = _fit_with(_Timer(), tmp_path)
    converted = plugin.float8_layers
    for timer, method in ((_Others(), "checkpoint"), (_Timer(), "gemm")):  # swapped; the same decision (control)
        resumed, plugin = _fit_with(timer, tmp_path / method, ckpt_path=tmp_path / "step=2.ckpt")
        assert plugin.decision.method == method and plugin.float8_layers == converted
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted), method
