"""Tensor parallelism with FSDP2 through Lightning's ModelParallelStrategy: the plan's checks and styles in this
process, and 2 (data) x 2 (tensor) meshes of real gloo processes, one launch or two "nodes", against one process."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.model import GPT, GPTConfig, GPTModule
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel, parallelize_gpt
from tests._paths import SCRIPTS
from tests.conftest import write_texts

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

SCRIPT = SCRIPTS / "tp_fit.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# --------------------------------------------------------------------------- the plan, in this process
@pytest.mark.parametrize(
    ("config", "size", "match"),
    [
        (dict(preset="tiny"), 2, r"cannot split this architecture \(arch='gpt2'\): GPT-2's fused c_attn .*fused_qkv=False"),
        (dict(preset="llama-8b"), 16, r"does not divide n_kv_head=8.*Choose tensor_parallel_size from \[1, 2, 4, 8\]"),
        (dict(preset="llama-tiny", vocab_size=301, padding_multiple=1), 2, "padded_vocab_size=301.*padding_multiple"),
        (dict(preset="llama-tiny", loss_impl="plain"), 2, "loss_impl='plain' needs the whole output head on one rank"),
    ],
    ids=["gpt2", "kv-heads", "vocabulary", "plain-loss"],
)
def test_what_cannot_be_split_is_refused_with_the_fix(config, size, match):
    preset = config.pop("preset")
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(GPTConfig.from_name(preset, **config), size)
    check_tensor_parallel(GPTConfig.from_name(preset, **config), 1)  # FSDP2 alone takes any model


def test_the_float8_styles_compute_what_the_whole_model_does(mesh, monkeypatch):
    """torchao's float8 styles (chosen where the backend moves float8: NCCL) on a one-rank mesh, where their
    all-gathers move nothing: the float8 casts before the gathers and the plan's layouts give the same loss and
    gradients as the unsplit float8 model."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    from lightning_gpuopt.precision.float8_layers import convert_linears_to_float8, float8_config

    prepared = []
    original = Float8ColwiseParallel._prepare_input_fn

    def counted(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        prepared.append(mod)
        return original(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    monkeypatch.setattr(Float8ColwiseParallel, "_prepare_input_fn", staticmethod(counted))
    whole = GPT(GPTConfig.from_name("llama-tiny", block_size=16, vocab_size=256))
    convert_linears_to_float8(whole, float8_config("tensorwise", emulate=True), ["lm_head"], "tensorwise")
    split = parallelize_gpt(copy.deepcopy(whole), mesh, float8_collectives=True)
    idx = torch.randint(0, 256, (2, 16))
    loss, expected = split(idx, targets=idx), whole(idx, targets=idx)
    assert len(prepared) == 2 * 5  # each block's q/k/v and gate/up projections took their input through it
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    for (name, a), b in zip(split.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=name)


def test_activation_checkpointing_recomputes_the_split_blocks(mesh):
    """A one-rank mesh: the plan's hooks run again in the recomputation, and the gradients are the whole model's."""
    whole = GPT(GPTConfig.from_name("llama-tiny", block_size=16, vocab_size=256, tie_embeddings=False))
    split = parallelize_gpt(copy.deepcopy(whole), mesh)
    split.config = GPTConfig.from_name("llama-tiny", block_size=16, vocab_size=256, tie_embeddings=False,
                                       activation_checkpointing=True)
    idx = torch.randint(0, 256, (2, 16))
    split(idx, targets=idx).backward()
    whole(idx, targets=idx).backward()
    for (name, a), b in zip(split.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=name)


def test_the_loss_refuses_full_logits_of_a_split_head(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_gpuopt.model.loss import linear_cross_entropy

    weight = distribute_tensor(torch.randn(64, 16), mesh, [Shard(0)])
    hidden, targets = torch.randn(2, 4, 16), torch.randint(0, 64, (2, 4))
    with pytest.raises(ValueError, match="loss_impl='plain' needs the whole output head .* use loss_impl='chunked'"):
        linear_cross_entropy(hidden, weight, targets, impl="plain")
    reference = torch.nn.functional.cross_entropy(hidden.reshape(-1, 16) @ weight.full_tensor().T, targets.reshape(-1))
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_size=3), reference)


# --------------------------------------------------------------------------- 2 x 2 meshes of real processes
def _script():
    spec = importlib.util.spec_from_file_location("tp_fit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(folder: Path, rank: int) -> dict[int, float]:
    rows = [line.split() for line in (folder / f"losses_rank{rank}.txt").read_text().splitlines()]
    return {int(b): float.fromhex(v) for _, b, _, v in rows}


def _one_process(data: Path, float8: bool) -> list[float]:
    """The script's module and data in this process, on one device: the 2 data-parallel ranks' micro-batches of 2
    sequences are one micro-batch of 4 here (the sampler shards one order), the step the same."""
    from lightning_gpuopt.precision import Float8Precision

    fit = _script()
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=fit.MAX_STEPS, accumulate_grad_batches=fit.ACCUMULATE,
        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[Record()],
        plugins=[Float8Precision(emulate=True, module_filter=["lm_head"])] if float8 else None,
    )
    data_module = TextDataModule(source=str(data / "texts"), cache_dir=str(data / "cache"), batch_size=4, **fit.DATA)
    with torch.random.fork_rng():
        if float8:
            with pytest.warns(UserWarning, match="not compiled"):
                trainer.fit(GPTModule(**fit.MODULE), datamodule=data_module)
        else:
            trainer.fit(GPTModule(**fit.MODULE), datamodule=data_module)
    return losses


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> tuple[Path, Path]:
    """The prepared corpus, and one launch of 4 gloo processes as a 2 x 2 mesh running the float32 fit (with the
    split-model check) and the float8 fit: ``(data folder, run folder)``."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    data = root / "data"
    write_texts(data / "texts")
    TextDataModule(source=str(data / "texts"), cache_dir=str(data / "cache"), block_size=16, vocab_size=300).prepare_data()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(root / "run"), "--data-dir", str(data), "--runs", "fp32,fp8", "--check-split"],
        env=ENV, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return data, root / "run"


@pytest.mark.slow
def test_a_2x2_mesh_trains_the_llama_style_gpt_as_one_process_does(two_by_two):
    data, run = two_by_two
    for rank in range(4):  # split over the tensor-parallel pair, the loss and gradients are the whole model's
        split = json.loads((run / "fp32" / f"split_rank{rank}.json").read_text())
        for name in ("plain", "float8"):
            assert split[name]["grads"] == 20 and split[name]["loss"] < 1e-6 and split[name]["grad"] < 1e-6, (name, split)
    ranks = [_losses(run / "fp32", r) for r in range(4)]
    assert len(ranks[0]) == 12 and ranks[0] == ranks[1] and ranks[2] == ranks[3]  # a tensor-parallel pair: one loss
    assert ranks[0][0] != ranks[2][0]  # the data-parallel ranks read different samples
    alone = _one_process(data, float8=False)
    mean = [(ranks[0][i] + ranks[2][i]) / 2 for i in range(12)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(alone), rtol=1e-6, atol=1e-6)
    assert alone[-1] < alone[0] - 0.5  # it learns
    report = json.loads((run / "fp32" / "report.json").read_text())
    assert report["skipped_steps"] == 0 and report["micro_batch"] == 2 and report["global_step"] == 6
    # MFUMonitor: a rank's tokens counted once (6 steps x 2 micro-batches x 2 x 16), its FLOPs split over its 2 devices
    assert report["total_tokens"] == 384 and report["total_flops"] == 384 * report["flops_per_token"]
    window = report["windows"][0]
    assert window["perf/tokens_per_sec"] == pytest.approx(4 * window["perf/tokens_per_sec_per_device"])
    assert window["perf/tflops_per_device"] * 1e12 == pytest.approx(
        window["perf/tokens_per_sec_per_device"] * report["flops_per_token"])
    assert window["perf/mfu"] == pytest.approx(window["perf/tflops_per_device"])  # peak_flops=1e12


@pytest.mark.slow
def test_a_2x2_mesh_with_float8_trains_as_one_process_does(two_by_two):
    """Float8Precision computes everything but its float8 matmuls in bf16: the row-wise layers' partial sums are
    reduced in bf16 (as on GPUs), and the tensorwise scales of the activations see 2 sequences, not 4, so the
    losses agree to bf16's precision. The split itself is exact in float32 (the first test's float8 check)."""
    data, run = two_by_two
    ranks = [_losses(run / "fp8", r) for r in range(4)]
    assert len(ranks[0]) == 12 and ranks[0] == ranks[1] and ranks[2] == ranks[3]
    alone = _one_process(data, float8=True)
    mean = [(ranks[0][i] + ranks[2][i]) / 2 for i in range(12)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(alone), rtol=5e-3, atol=0)  # measured: 1.4e-3
    fp32 = [(a + b) / 2 for a, b in zip(_losses(run / "fp32", 0).values(), _losses(run / "fp32", 2).values())]
    assert mean != fp32  # the float8 layers ran
    assert json.loads((run / "fp8" / "report.json").read_text())["skipped_steps"] == 0


def _launch_node(out: Path, data: Path, node: int, port: int, *args: str) -> subprocess.Popen:
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), "--data-dir", str(data), "--nodes", "2", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _free_port() -> int:
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    return find_free_network_port()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_two_nodes_one_sigtermed_mid_step_resume_bit_exactly(tmp_path, two_by_two):
    """Two launches of 2 processes, "nodes" on 127.0.0.1 (MASTER_ADDR/PORT, NODE_RANK): the 2 x 2 mesh keeps each
    tensor-parallel pair on one node. SIGTERM reaches node 1 only, mid-step: every rank stops after the same
    micro-batch and saves (SigtermCheckpoint agrees on it across ranks); resumed as two nodes, every micro-batch's
    loss equals the one-launch uninterrupted run's, bit for bit."""
    data, reference = two_by_two
    stop, port = tmp_path / "stop", _free_port()
    nodes = [_launch_node(stop, data, n, port, "--pause-at", "5") for n in (0, 1)]
    deadline = time.monotonic() + 300
    while not all((stop / "fp32" / f"paused{r}").exists() for r in range(4)):
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, nodes[0].stderr.read()[-3000:]
        time.sleep(0.1)
    nodes[1].send_signal(signal.SIGTERM)  # node 1's launcher; it passes the signal to its other process
    time.sleep(0.5)
    (stop / "go").write_text("")
    for proc in nodes:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    meta = torch.load(stop / "fp32" / "ckpt" / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == 2  # stopped after micro-batch 5 (step 3 half done), rolled back to step 2
    assert len(list((stop / "fp32" / "ckpt" / "last.ckpt").glob("*.distcp"))) == 4

    resumed, port = tmp_path / "resume", _free_port()
    last = str(stop / "fp32" / "ckpt" / "last.ckpt")
    nodes = [_launch_node(resumed, data, n, port, "--ckpt", last) for n in (0, 1)]
    for proc in nodes:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    for rank in range(4):
        before, after = _losses(stop / "fp32", rank), _losses(resumed / "fp32", rank)
        uninterrupted = _losses(reference / "fp32", rank)
        assert min(after) == 4 and set(before) | set(after) == set(uninterrupted)  # step 3 replayed from its start
        assert {**before, **after} == uninterrupted, rank
