"""Shared test fixtures: fixed seeds, restored global torch state, and a tiny corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

WIKITEXT2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's addopts; ``--maxprocesses`` caps it): one per CPU the process may use,
    logical CPUs counted (xdist's own rule counts physical cores where psutil is installed: one on a machine of two
    hyperthreads, while much of the suite's time is subprocesses starting); none on a CUDA machine: the gpu tests
    measure the memory and speed of one GPU, which two workers would share. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 0 if torch.cuda.is_available() else _cpus()


def pytest_configure(config):
    """In an xdist worker, torch's intra-op threads (and those of the processes tests start) share the CPUs with the
    other workers: two workers of 2 threads each on 2 cores would spin against each other. ``OMP_NUM_THREADS`` set
    by the caller wins."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, _cpus() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _fp32_precision_nodes() -> list:
    """torch's per-backend TF32 settings (``fp32_precision``, torch >= 2.9), a parent before its children:
    writing a parent rewrites its children."""
    b = torch.backends
    if not hasattr(b, "fp32_precision"):
        return []
    return [b, b.cudnn, b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]


@pytest.fixture(autouse=True)
def _restore_global_state(monkeypatch):
    """Seed every test and put back the global torch flags it may change."""
    torch.manual_seed(1234)
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
        torch.get_default_dtype(),
        dict(os.environ),
        [node.fp32_precision for node in _fp32_precision_nodes()],
    )
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved[0]
    torch.backends.cudnn.allow_tf32 = saved[1]
    torch.backends.cudnn.benchmark = saved[2]
    torch.set_float32_matmul_precision(saved[3])
    torch.set_default_dtype(saved[4])
    for node, value in zip(_fp32_precision_nodes(), saved[6]):  # after the legacy flags, which write these too
        node.fp32_precision = value
    os.environ.clear()
    os.environ.update(saved[5])


_REPO = Path(__file__).resolve().parents[1]
_LEFT_IN_CHECKOUT = (".gpuopt-fit.lock", "lightning_logs", "checkpoints", "runs", "generations.jsonl")


@pytest.fixture(autouse=True)
def _nothing_written_into_the_checkout():
    """A test that runs a fit, a predict or a logger in the checkout's folder fails, naming what it left there."""
    before = {name for name in _LEFT_IN_CHECKOUT if (_REPO / name).exists()}
    yield
    left = sorted(name for name in _LEFT_IN_CHECKOUT if (_REPO / name).exists() and name not in before)
    assert not left, f"the test wrote {left} into the checkout: give it a tmp_path (default_root_dir, or monkeypatch.chdir)"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A fresh token cache, also used by code that reads ``GPUOPT_CACHE_DIR``."""
    path = tmp_path / "cache"
    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(path))
    return path


def write_texts(folder: Path) -> Path:
    """Writes the small corpus of ``text_dir`` into ``folder`` (created): the same files on every call."""
    words = (
        "the model reads text and learns to predict the next token of every sentence in the corpus "
        "while the optimizer lowers the loss step by step on the training data"
    ).split()
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        idx = torch.randint(0, len(words), (3000,), generator=g).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(words[j] for j in idx) + "\n")
    return folder


@pytest.fixture
def text_dir(tmp_path) -> Path:
    """A small folder of real English-like text files (generated, repeatable)."""
    return write_texts(tmp_path / "texts")


@pytest.fixture
def fsdp2_trainer():
    """Builds one-device CPU Trainers under ``AtomicModelParallelStrategy`` (FSDP2 over a gloo group of one
    process, in this process); the process group they start is destroyed afterwards."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")

    def build(strategy=None, **kwargs) -> pl.Trainer:
        strategy = strategy or AtomicModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, **{**defaults, **kwargs})

    try:
        yield build
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def mesh():
    """A one-rank data-parallel device mesh on the CPU (gloo); the group and Dynamo's caches are reset afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
