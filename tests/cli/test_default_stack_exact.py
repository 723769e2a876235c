"""The default stack (`gpuopt fit` with no callbacks named) is bit-exact: `MFUMonitor` changes no loss, and a run
stopped by a real SIGTERM and resumed with `--ckpt_path last` gives every per-micro-batch loss of the run that was
never stopped. A Hugging Face-style module with dynamic padding: a new sequence length, and a counted step, in most
batches."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from lightning_gpuopt.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
STEPS, ACCUMULATE = 8, 2  # 16 micro-batches of an 8-batch epoch: two epochs
WITHOUT_MFU_MONITOR = """\
trainer:
  callbacks:  # the default stack without MFUMonitor
    - class_path: lightning_gpuopt.callbacks.CUDASettings
    - class_path: lightning_gpuopt.callbacks.NonFiniteGuard
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 1000, enable_version_counter: false}
"""


def _fit(root: Path, *extra: str) -> None:
    main(["fit", "--model", "tests.cli._own_modules.PaddedHFLlama", "--model.losses", str(root / "losses.txt"),
          "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", str(STEPS),
          "--trainer.accumulate_grad_batches", str(ACCUMULATE), *extra])


def _losses(root: Path) -> list[tuple[str, str]]:
    """``((epoch, batch_idx), loss)`` of every micro-batch the runs in ``root`` trained, replays included."""
    return [((e, b), loss) for e, b, _, loss in (line.split() for line in (root / "losses.txt").read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run with the default stack: every micro-batch's loss."""
    root = tmp_path_factory.mktemp("reference")
    cwd = os.getcwd()
    os.chdir(root)  # config.yaml lands here
    try:
        _fit(root)
    finally:
        os.chdir(cwd)
    losses = dict(_losses(root))
    assert len(losses) == STEPS * ACCUMULATE
    saved = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    monitor = next(v for k, v in saved["callbacks"].items() if k.startswith("MFUMonitor"))
    assert monitor["total_flops"] > 0  # MFUMonitor counted FLOPs over real steps, at several sequence lengths
    return losses


def test_mfu_monitor_changes_no_loss(reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "without.yaml").write_text(WITHOUT_MFU_MONITOR)
    _fit(tmp_path, "--config", str(tmp_path / "without.yaml"))
    assert dict(_losses(tmp_path)) == reference


def test_sigterm_and_resume_with_the_default_stack_give_every_loss_bit_for_bit(reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            _fit(tmp_path, "--model.sigterm_at", "9")  # the first micro-batch of step 5, the first of the second epoch
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    _fit(tmp_path, "--ckpt_path", "last")
    losses = _losses(tmp_path)
    assert len(losses) == STEPS * ACCUMULATE + 1  # micro-batch 9 again: the step it began is replayed whole
    assert {key for key, _ in losses} == set(reference)
    assert [loss for key, loss in losses] == [reference[key] for key, _ in losses]
