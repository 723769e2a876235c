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
    PlanDoesNotFit,
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
    # every block's input, and one recomputed block's activations with their gradients
    assert ckpt["activations"] == 8 * 1024 * 2 * (48 * 1600 + 2 * 17 * 1600)
    selective = estimate_memory(GPTConfig.from_name("1.5b", activation_checkpointing="selective"), 8, 1024)
    assert selective["activations"] == 8 * 1024 * 2 * (24 * 17 * 1600 + 24 * 1600 + 2 * 17 * 1600)


def test_1_5b_on_80gb_is_ddp_and_on_16gb_is_fsdp2():
    cfg = GPTConfig.from_name("1.5b")
    strategy, reason = choose_strategy(cfg, devices=8, device_memory=80e9, micro_batch=8, block_size=1024)
    assert isinstance(strategy, DDPStrategy) and not isinstance(strategy, ModelParallelStrategy)
    assert "24.9 GB weights+grads+AdamW" in reason and "80.0 GB" in reason and reason.startswith("DDP")
    strategy, reason = choose_strategy(cfg, devices=8, device_memory=16e9, micro_batch=1, block_size=1024)
    assert isinstance(strategy, AtomicModelParallelStrategy)  # a ModelParallelStrategy with atomic checkpoints
    assert isinstance(strategy, ModelParallelStrategy) and strategy._data_parallel_size == 8 and strategy._tensor_parallel_size == 1
    assert reason.startswith("FSDP2 (ModelParallelStrategy, 8 data-parallel x 1 tensor-parallel) with no activation "
                             "checkpointing: 6.3 GB per device.\n")  # 24.9/8 GB state + 2.7 GB activations + 0.5 GB logits
    assert "budget: 13.6 GB per device (85% of GPU (16.0 GB))" in reason
    # at micro-batch 8 the activations do not fit: checkpointing every block does, and the plan sets it
    cfg = GPTConfig.from_name("1.5b")
    _, reason = choose_strategy(cfg, devices=8, device_memory=16e9, micro_batch=8, block_size=1024)
    assert reason.splitlines()[0] == ("FSDP2 (ModelParallelStrategy, 8 data-parallel x 1 tensor-parallel) with full activation "
                                      "checkpointing (every block): 9.4 GB per device; sets model.activation_checkpointing=full.")
    assert reason.splitlines()[1].startswith("why: over the budget: FSDP2 without checkpointing 28.6 GB, FSDP2 with selective "
                                             "checkpointing 19.5 GB; FSDP2 with full checkpointing fits")
    assert cfg.activation_checkpointing == "full"


def test_bad_input_names_the_fix():
    with pytest.raises(PlanDoesNotFit, match=r"^Does not fit on 1 x GPU \(16.0 GB\): train on at least 4 devices\.\n"):
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
    assert reason.startswith(plan) and f"({facts.total_memory / GB:.1f} GB))" in reason
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
        est = estimate_module_memory(cls(), micro_batch=4, block_size=32)
        sharded = est["model_state"] / 4 + est["activations"] + est["logits"]  # fits sharded over 4, a replica does not
        memory = (sharded + est.total) / 2 / 0.85
        strategy, reason = choose_strategy(cls(), devices=4, device_memory=memory, block_size=32, micro_batch=4)
        assert isinstance(strategy, AtomicModelParallelStrategy) and "configure_model must apply" in reason
        assert reason.startswith(f"FSDP2 over 4 devices (ModelParallelStrategy): {sharded / GB:.1f} GB per device.\n")
        with pytest.raises(PlanDoesNotFit, match=rf"^Does not fit: {cls.__name__} needs .* GB per device on 4 devices, over "
                                                 r"the .* GB budget: .*lower the micro-batch or add activation checkpointing"):
            choose_strategy(cls(), devices=4, device_memory=sharded / 2 / 0.85, block_size=32, micro_batch=4)


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


@pytest.mark.parametrize(("memory_gb", "expected"), [(80, DDPStrategy), (0.0016, AtomicModelParallelStrategy)])
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
    assert est["activations"] == 8192 * (80 * 2 * 8192 + 2 * per_layer)  # block inputs + one block recomputed, and grads
    assert est["logits"] == 8192 * 128256 * 10 and "block formula (swiglu MLP)" in est.figures
    h100 = REFERENCE_DEVICES["H100 SXM"]
    with pytest.raises(PlanDoesNotFit, match=r"^Does not fit on 8 x NVIDIA H100 80GB HBM3 \(85.9 GB\): train on at least "
                                             r"24 devices\.\nwhy: the model state alone needs 141.1 GB per device") as info:
        choose_strategy(cfg, devices=8, device=h100, micro_batch=1)
    assert "model: 70,554M params, vocabulary 128,256, micro-batch 1 x 8,192 tokens; 1128.9 GB weights+grads+AdamW" in str(info.value)
    _, reason = choose_strategy(cfg, devices=64, device=h100, micro_batch=1)
    assert reason.splitlines()[0].endswith("with full activation checkpointing (every block): 45.1 GB per device.")


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
        ("1.5b", {}, "H100 SXM", 8, 1, 8, 1024, "DDP", "DDP over 8 devices: a full replica fits on each (50.4 GB)."),
        ("1.5b", {}, "V100", 8, 4, 1, 1024, (32, 1, False),
         "why: FSDP2 without checkpointing fits (no recompute, up to 4 x 1,024 tokens per micro-batch), so no more "
         "checkpointing and no tensor parallelism.\nnetwork: across 4 nodes"),
        ("llama-1b", {}, "H100 SXM", 8, 1, 8, 2048, "DDP", "a full replica fits"),
        ("llama-3b", {}, "L4", 4, 1, 1, 4096, (4, 1, "full"),
         "over the budget: FSDP2 without checkpointing 32.4 GB, FSDP2 with selective checkpointing 26.6 GB; FSDP2 with full "
         "checkpointing fits"),
        # torchtitan's Llama 3 8B layout: FSDP over every GPU, no tensor parallelism, selective checkpointing, 1 x 8192
        ("llama-8b", {}, "H100 SXM", 8, 1, 1, 8192, (8, 1, "selective"),
         "over the budget: FSDP2 without checkpointing 77.0 GB; FSDP2 with selective checkpointing fits"),
        ("llama-8b", AC, "H100 SXM", 8, 1, 1, 8192, (8, 1, True), "FSDP2 with full checkpointing fits (~1/3 more compute, up "
         "to 3 x 8,192 tokens per micro-batch)"),
        ("llama-8b", {}, "H100 SXM", 8, 8, 1, 8192, (64, 1, "full"),
         "hide behind compute from 10,554 tokens per micro-batch on a data-parallel rank (8 B per parameter over 50 GB/s "
         "per GPU, against 40% of 989.4 TFLOP/s): raise the micro-batch to 2 sequences"),
        ("llama-8b", {}, "H100 SXM", 8, 1, 4, 8192, (4, 2, "full"),
         "over the budget: FSDP2 with full checkpointing 79.3 GB, tensor parallel 2 without checkpointing 146.6 GB, tensor "
         "parallel 2 with selective checkpointing 100.8 GB; tensor parallel 2 with full checkpointing fits"),
        # torchtitan's Llama 3 70B layout on 64 A100s of 80 GB: tensor parallel 8 x FSDP2 over 8, full checkpointing, 8 x 8192
        ("llama-70b", {}, "A100", 8, 8, 8, 8192, (8, 8, "full"),
         "tensor parallel 4 with full checkpointing 75.8 GB, tensor parallel 8 without checkpointing"),
        ("llama-70b", {}, "H100 SXM", 8, 8, 1, 8192, (64, 1, "full"), "FSDP2 with full checkpointing fits"),
        ("llama-70b", {}, "H200", 8, 8, 1, 8192, (64, 1, "full"), "FSDP2 with full checkpointing fits"),
        ("llama-70b", AC, "A100", 8, 16, 1, 8192, (128, 1, True), "from 3,328 tokens per micro-batch"),
        ("llama-8b", {"n_kv_head": 1}, "H100 SXM", 8, 1, 4, 8192, None,
         "tensor parallel 2 or more is not considered: it does not divide n_kv_head=1"),
        ("llama-70b", {"n_kv_head": 2}, "H100 SXM", 8, 8, 3, 8192, (32, 2, "full"),
         "tensor parallel 4 or more is not considered: it does not divide n_kv_head=2"),
        ("llama-70b", {}, "H100 SXM", 8, 1, 1, 8192, None,
         "Does not fit on 8 x NVIDIA H100 80GB HBM3 (85.9 GB): train on at least 24 devices.\nwhy: the model state alone "
         "needs 141.1 GB per device over 8, over the 73.0 GB budget."),
    ],
)
def test_the_layout_for_each_model_gpu_and_cluster(preset, overrides, gpu, per_node, nodes, micro_batch, block, plan, says):
    """DDP when a replica fits; else FSDP2, trying activation checkpointing (none, selective, full) before each larger
    tensor-parallel size within a node, the first layout that fits (and whose all-gathers hide behind compute across
    nodes); a plan that fits no layout is refused, naming the device count that fits. ``plan``: "DDP", ``None``
    (refused), or (data-parallel size, tensor-parallel size, the checkpointing set on the config)."""
    config = GPTConfig.from_name(preset, block_size=block, **overrides)
    plan_it = lambda: choose_strategy(config, devices=per_node * nodes, devices_per_node=per_node,  # noqa: E731
                                      device=REFERENCE_DEVICES[gpu], micro_batch=micro_batch)
    if plan is None:
        with pytest.raises(PlanDoesNotFit) as info:
            plan_it()
        reason = str(info.value)
        assert reason.startswith("Does not fit on ") and len(reason.splitlines()) == 3  # what and the fix, why, the model
    else:
        strategy, reason = plan_it()
    if plan == "DDP":
        assert isinstance(strategy, DDPStrategy) and reason.startswith("DDP")
    elif plan is not None:
        assert isinstance(strategy, AtomicModelParallelStrategy)
        assert (strategy._data_parallel_size, strategy._tensor_parallel_size, config.activation_checkpointing) == plan
        name = "FSDP2" if plan[1] == 1 else f"FSDP2 + tensor parallel {plan[1]}"
        assert reason.startswith(f"{name} (ModelParallelStrategy, {plan[0]} data-parallel x {plan[1]} tensor-parallel) "
                                 f"with ")
    assert says in reason, reason
    assert all(len(line) <= 400 for line in reason.splitlines()) and len(reason.splitlines()) <= 6


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
    assert out.splitlines()[0] == ("trainer.strategy=gpuopt-auto: FSDP2 + tensor parallel 2 (ModelParallelStrategy, 4 "
                                   "data-parallel x 2 tensor-parallel) with full activation checkpointing (every block): "
                                   "47.5 GB per device; sets model.activation_checkpointing=full.")
    assert "why: over the budget: FSDP2 with full checkpointing 78.4 GB, tensor parallel 2 without checkpointing" in out
    assert "model: 7,248M params, vocabulary 32,768, micro-batch 8 x 8,192 tokens; 116.0 GB weights+grads+AdamW" in out
    assert "vocabulary: 32,768 (data.vocab_size, linked into the model)" in out
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
    assert "16-bit activations, precision bf16-mixed" in out and "with full activation checkpointing (every block): 45.1 GB" in out
    with pytest.raises(SystemExit):
        main([*args, "--trainer.precision", "32-true"])
    assert "4 x (9 n_embd + 2 kv + 4 ffn) B per token per layer (32-bit activations, precision 32-true)" in capsys.readouterr().out


@pytest.mark.parametrize("print_plan", [True, False])
def test_a_plan_that_does_not_fit_stops_fit_before_anything_is_built(print_plan, cache_dir, capsys, tmp_path, monkeypatch):
    """llama-70b on one node of 8 H100s: refused, with or without print_plan (exit 2), its first words saying so and the
    device count that fits; no model built, no data prepared, no run folder."""
    from lightning_gpuopt.cli.main import main

    monkeypatch.chdir(tmp_path)
    built = []
    monkeypatch.setattr(GPTModule, "configure_model", lambda self: built.append(self))
    monkeypatch.setattr("lightning_gpuopt.cli.auto_strategy.cuda_device_count", lambda: 8)  # as on the GPU machine
    args = ["fit", "--model.preset", "llama-70b", "--trainer.strategy", "gpuopt-auto", "--trainer.devices", "8",
            "--auto_strategy.device", "H100 SXM", "--data.source", "stdlib", "--trainer.max_steps", "10",
            "--data.block_size", "8192", "--data.batch_size", "1", "--auto_strategy.print_plan", str(print_plan).lower()]
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "gpuopt: error: Does not fit on 8 x NVIDIA H100 80GB HBM3 (85.9 GB): train on at least 24 devices."
    # print_plan plans llama-70b's own vocabulary; the run, the model it builds (the data's default tokenizer size)
    state = "141.1" if print_plan else "137.0"
    assert lines[1] == f"why: the model state alone needs {state} GB per device over 8, over the 73.0 GB budget."
    assert len(lines) == 4 and lines[3] == "(set GPUOPT_TRACEBACK=1 to see the traceback)"  # a three-line message
    assert lines[2].startswith("model: 70,554M params, vocabulary 128,256," if print_plan else "model: 68,519M params, "
                               "vocabulary 4,096,")
    assert ("; vocabulary 128,256 (llama-70b's own: no data.vocab_size or data.tokenizer is given" if print_plan else
            "; vocabulary 4,096 (data.vocab_size's default: the tokenizer trained on the corpus; llama-70b's own is 128,256: "
            "give --data.tokenizer or --data.vocab_size for it).") in lines[2]
    assert built == [] and not cache_dir.exists()
    assert not any(tmp_path.rglob("*.ckpt")) and not (tmp_path / "lightning_logs").exists()


def test_a_plan_names_its_vocabulary_the_preset_s_when_no_data_says_otherwise(cache_dir, capsys, tmp_path, monkeypatch):
    """The CLI links data.vocab_size into the model, and its default (4,096) is the tokenizer the data module would train:
    print_plan of a llama-* preset with neither data.vocab_size nor data.tokenizer plans Llama 3's 128,256, and says so;
    a data.vocab_size given is planned as given."""
    from lightning_gpuopt.cli.main import main

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--model.preset", "llama-8b", "--trainer.strategy", "gpuopt-auto", "--trainer.devices", "8",
            "--auto_strategy.device", "H100 SXM", "--data.source", "stdlib", "--trainer.max_steps", "10",
            "--data.block_size", "8192", "--data.batch_size", "1", "--auto_strategy.print_plan", "true"]
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    # torchtitan's Llama 3 8B layout on one node of 8 H100s
    assert out.splitlines()[0] == ("trainer.strategy=gpuopt-auto: FSDP2 (ModelParallelStrategy, 8 data-parallel x 1 "
                                   "tensor-parallel) with selective activation checkpointing (every other block): 56.0 GB "
                                   "per device; sets model.activation_checkpointing=selective.")
    assert "model: 8,030M params, vocabulary 128,256, micro-batch 1 x 8,192 tokens" in out
    assert out.splitlines()[-1] == ("vocabulary: 128,256 (llama-8b's own: no data.vocab_size or data.tokenizer is given; a "
                                    "run would train a 4,096-token tokenizer on its corpus unless one of them says otherwise)")
    with pytest.raises(SystemExit):
        main([*args, "--data.vocab_size", "32768"])
    out = capsys.readouterr().out
    assert "vocabulary 32,768," in out and out.splitlines()[-1] == "vocabulary: 32,768 (data.vocab_size, linked into the model)"
