"""choose_strategy: the DDP/FSDP2 decision from a stated memory estimate, from Python and the gpuopt CLI."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import ExactResume
from lightning_gpuopt.cli.main import GPTCLI
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.perf.units import GB
from lightning_gpuopt.strategies import (
    choose_strategy,
    estimate_memory,
    estimate_module_memory,
)


def test_memory_estimate_follows_the_stated_formula():
    cfg = GPTConfig.from_name("1.5b")
    est = estimate_memory(cfg, micro_batch=8, block_size=1024)
    assert est["params"] == pytest.approx(1.558e9, rel=1e-3)
    assert est["model_state"] == 16 * est["params"]
    assert est["activations"] == 8 * 1024 * 48 * 34 * 1600  # 34 h bytes per token per layer (bf16)
    assert est["logits"] == 8 * 1024 * 50304 * 10
    fp32 = estimate_memory(cfg, micro_batch=8, block_size=1024, precision="32-true")
    assert fp32["activations"] == 2 * est["activations"]
    ckpt = estimate_memory(GPTConfig.from_name("1.5b", activation_checkpointing=True), 8, 1024)
    assert ckpt["activations"] < est["activations"] / 10


def test_1_5b_on_80gb_is_ddp_and_on_16gb_is_fsdp2():
    cfg = GPTConfig.from_name("1.5b")
    strategy, reason = choose_strategy(cfg, devices=8, device_memory=80e9, micro_batch=8, block_size=1024)
    assert isinstance(strategy, DDPStrategy) and not isinstance(strategy, ModelParallelStrategy)
    assert "24.9 GB weights+grads+AdamW" in reason and "80.0 GB" in reason and reason.startswith("DDP")
    strategy, reason = choose_strategy(cfg, devices=8, device_memory=16e9, micro_batch=1, block_size=1024)
    assert isinstance(strategy, AtomicModelParallelStrategy)  # a ModelParallelStrategy with atomic checkpoints
    assert isinstance(strategy, ModelParallelStrategy) and strategy._data_parallel_size == 8 and strategy._tensor_parallel_size == 1
    assert reason.startswith("FSDP2") and "16.0 GB" in reason and "sharded over 8 devices" in reason and "fits" in reason
    assert "NOT" not in reason  # 24.9/8 GB state + 2.7 GB activations + 0.5 GB logits < 13.6 GB
    _, reason = choose_strategy(cfg, devices=8, device_memory=16e9, micro_batch=8, block_size=1024)
    assert "still does NOT fit" in reason


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="train on more devices"):
        choose_strategy(GPTConfig.from_name("1.5b"), devices=1, device_memory=16e9)
    with pytest.raises(ValueError, match="choose_strategy.devices must be an integer >= 1, got 0"):
        choose_strategy(GPTConfig.from_name("tiny"), devices=0, device_memory=16e9)
    with pytest.raises(ValueError, match="any nn.Module / LightningModule, got str"):
        choose_strategy("1.5b", devices=2, device_memory=16e9)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_memory"):
            choose_strategy(GPTConfig.from_name("tiny"), devices=2)


@pytest.mark.parametrize(("name", "plan"), [("H100 SXM", "DDP"), ("A100", "DDP"), ("V100", "FSDP2"), ("T4", "FSDP2")])
def test_device_memory_from_device_facts(name, plan):
    facts = REFERENCE_DEVICES[name]
    strategy, reason = choose_strategy(GPTConfig.from_name("1.5b"), devices=8, micro_batch=1, block_size=1024, device=facts)
    assert reason.startswith(plan) and f"of {facts.total_memory / GB:.1f} GB)" in reason
    with pytest.raises(ValueError, match=r"on cpu \(no CUDA\): pass device_memory="):
        choose_strategy(GPTConfig.from_name("tiny"), devices=2, device=REFERENCE_DEVICES["cpu"])


def test_a_foreign_module_named_gpt_is_estimated_from_its_parameters_and_measured_activations():
    from tests._module_shapes import SHAPES, NanoGPT

    class GPT(NanoGPT):  # nanoGPT's class name, not ours
        pass

    model = GPT()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    strategy, reason = choose_strategy(model, devices=2, device_memory=1e9, block_size=32, micro_batch=4)
    assert isinstance(strategy, DDPStrategy)
    assert "GPT's parameters (float32" in reason and "activations measured" in reason
    est = estimate_module_memory(model, micro_batch=4, block_size=32)
    assert est["params"] == params and est["model_state"] == 16 * params  # fp32 + AdamW, tied head once
    assert est["logits"] == 4 * 32 * 256 * 10
    # the measured activations of our own GPT agree with the stated formula within 2%
    with torch.device("meta"):
        ours = GPTModule(preset="124m", vocab_size=50304, block_size=1024)
        ours.configure_model()
    formula = estimate_memory(ours.config, micro_batch=8, block_size=1024)
    measured = estimate_module_memory(ours.model, micro_batch=8, block_size=1024)
    assert measured["activations"] == pytest.approx(formula["activations"], rel=0.02)
    assert measured["params"] == formula["params"]
    # bf16-true halves the state; frozen parameters hold weights only
    half = estimate_module_memory(model, 4, 32, precision="bf16-true")
    assert half["model_state"] == 8 * params
    for p in model.parameters():
        p.requires_grad_(False)
    assert estimate_module_memory(model, 4, 32)["model_state"] == 4 * params
    # every module shape of the tests gets a decision, and FSDP2 names what the module must do
    for cls in SHAPES.values():
        strategy, reason = choose_strategy(cls(), devices=4, device_memory=1e6, block_size=32, micro_batch=4)
        assert isinstance(strategy, AtomicModelParallelStrategy) and "configure_model must apply" in reason


def test_a_module_s_own_activation_figure_is_used_and_named():
    from tests._module_shapes import LitGPTModule

    module = LitGPTModule()
    module.activation_bytes = lambda micro_batch, block_size, precision: 7e9
    _, reason = choose_strategy(module, devices=2, device_memory=80e9, block_size=32)
    assert "7.0 GB activations" in reason and "LitGPTModule.activation_bytes()" in reason
    _, reason = choose_strategy(module, devices=2, device_memory=80e9, block_size=32, activation_bytes=3e9)
    assert "3.0 GB activations" in reason and "activation_bytes= as given" in reason


def test_a_foreign_module_without_what_is_needed_gets_the_fix():
    from tests._module_shapes import LitGPTModule

    with pytest.raises(ValueError, match="pass block_size="):
        choose_strategy(LitGPTModule(), devices=2, device_memory=16e9)

    class Later(LitGPTModule):
        def __init__(self):
            super(LitGPTModule, self).__init__()

    with pytest.raises(ValueError, match="no parameters yet"):
        choose_strategy(Later(), devices=2, device_memory=16e9, block_size=32)

    class DictInput(LitGPTModule):
        def forward(self, batch):
            return self.model(batch["input_ids"])

    with pytest.raises(ValueError, match=r"pass choose_strategy\(batch=\.\.\.\) .*, activation_bytes=\.\.\."):
        choose_strategy(DictInput(), devices=2, device_memory=16e9, block_size=32)


def test_a_training_batch_measures_the_step_hf_wrappers_included():
    """With batch=, activations come from training_step(batch) on meta tensors: HF-style wrappers without a
    forward of their own, whose mask check reads a value, get a decision; the others agree with forward(input_ids)."""
    from tests._module_shapes import MORE_SHAPES, SHAPES, shape_loader

    for shape in ("hf-llama-mask", "hf-gpt2-mask"):
        module, batch = MORE_SHAPES[shape](), next(iter(shape_loader(shape, batch_size=2)))
        with pytest.raises(ValueError, match=r"pass choose_strategy\(batch=\.\.\.\)"):
            choose_strategy(module, devices=2, device_memory=1e9, block_size=32, micro_batch=4)
        strategy, reason = choose_strategy(module, devices=2, device_memory=1e9, micro_batch=4, batch=batch)
        assert isinstance(strategy, DDPStrategy) and "x 32 tokens" in reason  # the sequence length read from the batch
        assert "training_step(batch) saves for backward" in reason and "2 sample(s) scaled to 4" in reason
        assert "2 host read(s) answered with 1" in reason  # the mask check and the logged loss.item()
        assert all(p.device.type == "cpu" and p.grad is None for p in module.parameters())  # untouched
    for shape, cls in SHAPES.items():
        batch = next(iter(shape_loader(shape, batch_size=2)))
        step = estimate_module_memory(cls(), 4, 32, precision="32-true", batch=batch)
        forward = estimate_module_memory(cls(), 4, 32, precision="32-true")
        assert step.total == pytest.approx(forward.total, rel=0.05), shape
        assert step["activations"] > forward["activations"]  # the loss's own tensors, which forward never ran


@pytest.mark.parametrize(("memory_gb", "expected"), [(80, DDPStrategy), (0.001, AtomicModelParallelStrategy)])
def test_cli_gpuopt_auto_strategy(text_dir, cache_dir, caplog, memory_gb, expected):
    args = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0",
            "--data.block_size", "16", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "gpuopt-auto",
            "--auto_strategy.device_memory_gb", str(memory_gb)]
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=args)
    assert type(cli.trainer.strategy) is expected
    assert any(isinstance(c, ExactResume) for c in cli.trainer.callbacks)  # always added by the CLI


def test_llama_70b_is_planned_on_the_meta_device():
    """The 70B shape (80 layers, d8192, 8 key/value heads, MLP 28672, untied) is estimated without allocating it."""
    cfg = GPTConfig.from_name("llama-70b", activation_checkpointing=True)
    est = estimate_memory(cfg, micro_batch=1, block_size=8192)
    assert est["params"] == 70_553_706_496 and est["model_state"] == 16 * est["params"]
    per_layer = 2 * (9 * 8192 + 2 * 8 * 128 + 4 * 28672)  # bytes per token of one block (bf16)
    assert est["activations"] == 8192 * (80 * 2 * 8192 + per_layer)  # block inputs + one block recomputed
    assert est["logits"] == 8192 * 128256 * 10 and "block formula (swiglu MLP)" in est.figures
    h100 = REFERENCE_DEVICES["H100 SXM"]
    strategy, reason = choose_strategy(cfg, devices=8, device=h100, micro_batch=1)
    assert isinstance(strategy, AtomicModelParallelStrategy) and "still does NOT fit" in reason  # 141 GB of state per GPU
    assert "70,554M params -> 1128.9 GB weights+grads+AdamW" in reason and "block formula (swiglu MLP)" in reason
    _, reason = choose_strategy(cfg, devices=64, device=h100, micro_batch=1)
    assert "sharded over 64 devices it needs 42.0 GB per device and fits" in reason


def test_llama_activation_formula_agrees_with_the_measured_activations(monkeypatch):
    # measured as bf16 training runs: grouped keys and values go to SDPA as they are (on meta tensors, float32,
    # the model would repeat them per query head)
    monkeypatch.setattr("lightning_gpuopt.model.gpt.grouped_heads_run_fused", lambda dtype, masked: not masked)
    for name in ("llama-1b", "llama-8b"):
        with torch.device("meta"):
            module = GPTModule(preset=name, vocab_size=32768, block_size=1024)
            module.configure_model()
        formula = estimate_memory(module.config, micro_batch=2, block_size=1024)
        measured = estimate_module_memory(module.model, micro_batch=2, block_size=1024)
        assert measured["activations"] == pytest.approx(formula["activations"], rel=0.02)


AC = {"activation_checkpointing": True}


@pytest.mark.parametrize(
    ("preset", "overrides", "gpu", "per_node", "nodes", "micro_batch", "block", "plan", "says"),
    [
        ("1.5b", {}, "H100 SXM", 8, 1, 8, 1024, "DDP", "a full replica fits on each device"),
        ("1.5b", {}, "V100", 8, 4, 1, 1024, (32, 1), "sharded over 32 devices it needs 4.0 GB per device and fits"),
        ("llama-1b", {}, "H100 SXM", 8, 1, 8, 2048, "DDP", "a full replica fits"),
        ("llama-3b", {}, "L4", 4, 1, 1, 4096, (1, 4), "with tensor parallel 4 it needs 18.8 GB per device and fits"),
        ("llama-8b", {}, "H100 SXM", 8, 1, 1, 8192, (4, 2),
         "sharded over 8 devices it needs 77.0 GB per device and does NOT fit; with tensor parallel 2 it needs 48.7 GB"),
        ("llama-8b", AC, "H100 SXM", 8, 1, 1, 8192, (8, 1), "it needs 30.3 GB per device and fits (up to 4 x 8192 tokens"),
        ("llama-8b", {}, "H100 SXM", 8, 8, 1, 8192, (32, 2),
         "hide behind compute from 10,554 tokens per micro-batch on a data-parallel rank (8 B per parameter over 50 GB/s "
         "per GPU, against 40% of 989.4 TFLOP/s); raise the micro-batch to 2 sequences"),
        ("llama-70b", {}, "H100 SXM", 8, 8, 1, 8192, (8, 8),
         "with tensor parallel 8 it needs 68.9 GB per device and fits (up to 1 x 8192 tokens per micro-batch); across 8 "
         "nodes"),
        ("llama-70b", AC, "H100 SXM", 8, 8, 1, 8192, (64, 1), "fits (up to 2 x 8192 tokens per micro-batch); across 8 nodes"),
        ("llama-70b", AC, "H100 SXM", 8, 1, 1, 8192, (8, 1),
         "still does NOT fit: the model state alone needs 141.1 GB per device: train on at least 16 devices"),
        ("llama-70b", {}, "H200", 8, 8, 1, 8192, (8, 8), "with tensor parallel 8 it needs 68.9 GB per device and fits"),
        ("llama-70b", AC, "A100", 8, 16, 1, 8192, (128, 1), "from 3,328 tokens per micro-batch"),
        ("llama-8b", {"n_kv_head": 1}, "H100 SXM", 8, 1, 1, 8192, (8, 1),
         "tensor parallel 2 or more is not considered: it does not divide n_kv_head=1; it still does NOT fit"),
        ("llama-70b", {"n_kv_head": 2}, "H100 SXM", 8, 8, 1, 8192, (32, 2),
         "tensor parallel 4 or more is not considered: it does not divide n_kv_head=2"),
    ],
)
def test_the_tensor_parallel_size_for_each_model_gpu_and_cluster(preset, overrides, gpu, per_node, nodes, micro_batch,
                                                                 block, plan, says):
    """DDP when a replica fits; FSDP2 alone when it fits and its all-gathers hide behind compute (always within a
    node); else the smallest tensor-parallel size within a node that fits (and scales); the reason gives the numbers.
    ``plan``: "DDP", or (data-parallel, tensor-parallel) sizes."""
    config = GPTConfig.from_name(preset, block_size=block, **overrides)
    strategy, reason = choose_strategy(config, devices=per_node * nodes, devices_per_node=per_node,
                                       device=REFERENCE_DEVICES[gpu], micro_batch=micro_batch)
    if plan == "DDP":
        assert isinstance(strategy, DDPStrategy) and reason.startswith("DDP")
    else:
        assert isinstance(strategy, AtomicModelParallelStrategy)
        assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == plan
        name = "FSDP2" if plan[1] == 1 else f"FSDP2 + tensor parallel {plan[1]}"
        assert reason.startswith(f"{name} (ModelParallelStrategy, {plan[0]} data-parallel x {plan[1]} tensor-parallel)")
    assert says in reason, reason


def test_the_llama_8b_recipe_plans_tensor_parallel_on_a_cpu(cache_dir, capsys, caplog, tmp_path, monkeypatch):
    """`gpuopt fit --config examples/configs/llama-8b-tp.yaml --auto_strategy.print_plan true` on a machine without a
    GPU: the plan for 8 H100s and its memory per GPU, printed, and nothing prepared or trained."""
    from lightning_gpuopt.cli.main import main
    from tests._paths import REPO

    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    recipe = str(REPO / "examples" / "configs" / "llama-8b-tp.yaml")
    with pytest.raises(SystemExit) as stopped, caplog.at_level("INFO"):  # as the README says: no WikiText-103 here
        main(["fit", "--config", recipe, "--auto_strategy.device", "H100 SXM", "--auto_strategy.print_plan", "true"])
    assert stopped.value.code == 0
    assert "data.source='data/wikitext-103-raw' is not on this machine; the plan reads no text" in caplog.text
    out = capsys.readouterr().out
    assert out.startswith("trainer.strategy=gpuopt-auto: FSDP2 + tensor parallel 2 (ModelParallelStrategy, 4 data-parallel x "
                          "2 tensor-parallel)")
    assert "7,248M params -> 116.0 GB weights+grads+AdamW" in out and "with tensor parallel 2 it needs 71.9 GB per device" in out
    assert list((tmp_path / "run").iterdir()) == [] and not cache_dir.exists()  # no run folder, no token cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans a named GPU from a machine without one")
def test_a_plan_for_a_named_gpu_counts_the_activations_the_gpu_stack_keeps(cache_dir, capsys, tmp_path, monkeypatch):
    """On a CPU the stack trains in float32; on the GPU planned for it trains under BF16Precision, whose 16-bit
    activations the plan counts (a precision given is kept)."""
    from lightning_gpuopt.cli.main import main

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--model.preset", "llama-70b", "--trainer.strategy", "gpuopt-auto", "--auto_strategy.print_plan", "true",
            "--auto_strategy.device", "H100 SXM", "--trainer.devices", "8", "--trainer.num_nodes", "8", "--data.source", "stdlib",
            "--trainer.max_steps", "10", "--data.block_size", "8192", "--data.batch_size", "1"]
    with pytest.raises(SystemExit):
        main(args)
    out = capsys.readouterr().out
    assert "16-bit activations, precision bf16-mixed" in out and "with tensor parallel 8 it needs 67.2 GB per device and fits" in out
    with pytest.raises(SystemExit):
        main([*args, "--trainer.precision", "32-true"])
    assert "4 x (9 n_embd + 2 kv + 4 ffn) B per token per layer (32-bit activations, precision 32-true)" in capsys.readouterr().out
