"""The folder swap behind AtomicModelParallelStrategy: whole checkpoints only, on every path a save can take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.checkpoint import atomic_files as atomic_checkpoint
from lightning_gpuopt.checkpoint.atomic_files import checkpoint_to_load, partial_path, previous_path, swap_in
from tests._paths import REPO, SCRIPTS


def _folder(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
        (path / name).write_text(f"step {step}")
    return path


def _step(path: Path) -> set[str]:
    return {p.read_text() for p in path.iterdir()}


def _can_exchange(tmp_path: Path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir(), b.mkdir()
    try:
        return atomic_checkpoint._exchange(a, b)
    finally:
        a.rmdir(), b.rmdir()


def test_swap_replaces_a_checkpoint_folder_by_exchange(tmp_path, monkeypatch):
    if not _can_exchange(tmp_path):
        pytest.skip("this file system cannot exchange two folders atomically (renameat2 RENAME_EXCHANGE)")
    exchanged = []
    real_exchange = atomic_checkpoint._exchange
    monkeypatch.setattr(atomic_checkpoint, "_exchange", lambda a, b: exchanged.append(real_exchange(a, b)) or exchanged[-1])
    last = _folder(tmp_path / "last.ckpt", 3)
    swap_in(_folder(partial_path(last), 6), last)
    assert exchanged == [True]  # one atomic renameat2(RENAME_EXCHANGE) on this machine's file system
    assert _step(last) == {"step 6"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the old one is gone, nothing hidden left


def test_swap_without_exchange_goes_through_the_previous_name(tmp_path, monkeypatch):
    # A file system without renameat2(RENAME_EXCHANGE) (e.g. NFS): two renames.
    renames = []
    real_replace = atomic_checkpoint.os.replace
    monkeypatch.setattr(atomic_checkpoint, "_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic_checkpoint.os, "replace", lambda a, b: (renames.append((Path(a).name, Path(b).name)),
                                                                       real_replace(a, b)))
    last = _folder(tmp_path / "last.ckpt", 3)
    swap_in(_folder(partial_path(last), 6), last)
    assert renames == [("last.ckpt", previous_path(last).name), (partial_path(last).name, "last.ckpt")]
    assert _step(last) == {"step 6"} and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_swap_creates_a_first_checkpoint(tmp_path):
    last = tmp_path / "last.ckpt"
    swap_in(_folder(partial_path(last), 3), last)
    assert _step(last) == {"step 3"} and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_hidden_names_stay_out_of_lightnings_checkpoint_scans(tmp_path):
    for name in ("last.ckpt", "hpc_ckpt_3.ckpt", "epoch=0-step=6.ckpt"):
        for hidden in (partial_path(tmp_path / name), previous_path(tmp_path / name)):
            assert hidden.parent == tmp_path and hidden.name.startswith(".gpuopt-")
            # ModelCheckpoint looks for "last*.ckpt"; the HPC resume scans names containing "ckpt_".
            assert "ckpt" not in hidden.name and not hidden.name.endswith(".ckpt")
    assert partial_path(tmp_path / "a.ckpt") != partial_path(tmp_path / "b.ckpt")


def test_load_falls_back_to_the_checkpoint_a_cut_swap_left_aside(tmp_path):
    last = tmp_path / "last.ckpt"
    _folder(previous_path(last), 3)  # killed between the two renames: the old one aside, the new one not in place
    with pytest.warns(UserWarning, match="stopped between its two renames"):
        assert checkpoint_to_load(last) == previous_path(last)
    _folder(last, 6)
    assert checkpoint_to_load(last) == last  # normally: what was asked for
    assert checkpoint_to_load(tmp_path / "other.ckpt") == tmp_path / "other.ckpt"  # missing: Lightning says so


def test_exchange_reports_real_errors(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError):
        atomic_checkpoint._exchange(tmp_path / "a", tmp_path / "missing")


def test_a_replaced_checkpoint_that_cannot_be_deleted_does_not_fail_the_save(tmp_path, monkeypatch):
    # The new checkpoint is in place; deleting the old one is housekeeping (NFS can refuse while a file is open).
    real_remove = atomic_checkpoint.remove_tree

    def refuses_old(path):
        if path.exists() and _step(path) == {"step 3"}:
            raise OSError(39, "Directory not empty", str(path))
        real_remove(path)

    monkeypatch.setattr(atomic_checkpoint, "remove_tree", refuses_old)
    last = _folder(tmp_path / "last.ckpt", 3)
    with pytest.warns(UserWarning, match="Could not delete the replaced checkpoint"):
        swap_in(_folder(partial_path(last), 6), last)
    assert _step(last) == {"step 6"}


@pytest.mark.slow
def test_fsdp2_ranks_agree_to_refuse_a_nonfinite_checkpoint(tmp_path, text_dir):
    """2 gloo processes, a diverging run: no rank writes its shard of a NaN checkpoint, every rank stops with
    NonFiniteCheckpointError, and last.ckpt is still the whole checkpoint of the step before."""
    script = SCRIPTS / "fsdp_nonfinite_save.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(text_dir)], env=env,
                          capture_output=True, text=True, timeout=400)
    outcomes = [(tmp_path / f"outcome_rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    refused = [o[1].startswith("NonFiniteCheckpointError: Not writing the checkpoint") for o in outcomes]
    assert refused == [True, True], proc.stderr[-3000:]
    step = int(outcomes[0][0])
    assert int(outcomes[1][0]) == step and 1 <= step < 20
    last = tmp_path / "ckpt" / "last.ckpt"
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["global_step"] == step - 1  # the last good step, whole
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".gpuopt-")) == []


class _GradientsPerMicroBatch(pl.Callback):
    """Records, after each micro-batch's backward, whether the sharded gradients were reduced (FSDP2 sets
    ``param.grad`` only in its reduce-scatter), and the full gradients before the optimizer step."""

    def __init__(self) -> None:
        self.reduced: list[bool] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_after_backward(self, trainer, pl_module) -> None:
        self.reduced.append(all(p.grad is not None for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.full_tensor().clone() for n, p in pl_module.named_parameters()}


def _fit_one_step(fsdp2_trainer, batch_size: int, accumulate: int, **strategy_args):
    from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy
    from tests.precision._helpers import tiny_gpt_module, token_loader

    pl.seed_everything(0)
    recorder = _GradientsPerMicroBatch()
    strategy = AtomicModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, **strategy_args)
    trainer = fsdp2_trainer(strategy, max_steps=1, accumulate_grad_batches=accumulate, callbacks=[recorder])
    trainer.fit(tiny_gpt_module(), token_loader(n_seq=16, batch_size=batch_size))
    return recorder


def test_fsdp2_reduces_gradients_once_per_optimizer_step_and_they_equal_one_big_batch(fsdp2_trainer):
    accumulated = _fit_one_step(fsdp2_trainer, batch_size=2, accumulate=4)
    assert accumulated.reduced == [False, False, False, True]  # one reduce-scatter, after the last micro-batch
    whole = _fit_one_step(fsdp2_trainer, batch_size=8, accumulate=1)  # the same 8 sequences in one micro-batch
    assert whole.reduced == [True]
    assert accumulated.grads.keys() == whole.grads.keys() and len(whole.grads) > 0
    for name, grad in whole.grads.items():
        torch.testing.assert_close(accumulated.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    every = _fit_one_step(fsdp2_trainer, batch_size=2, accumulate=4, sync_every_micro_batch=True)
    assert every.reduced == [True, True, True, True]  # gradients stay sharded between micro-batches
    for name, grad in whole.grads.items():
        torch.testing.assert_close(every.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
