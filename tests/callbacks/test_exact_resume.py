"""Exact resume: a real training process is stopped by a signal and resumed in a new process; the
per-micro-batch losses must equal an uninterrupted run's bit for bit (CPU, deterministic kernels)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.checkpoint.atomic_files import partial_path
from tests._paths import SCRIPTS
from tests.conftest import write_texts

SCRIPT = SCRIPTS / "resume_fit.py"
# CUBLAS_WORKSPACE_CONFIG: deterministic cuBLAS for the GPU variant (the script turns on deterministic algorithms).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# --------------------------------------------------------------------------- real processes + signals
def _prepare(tmp_path: Path, text_dir: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "texts").symlink_to(text_dir)
    TextDataModule(source=str(data / "texts"), cache_dir=str(data / "cache"), block_size=16, vocab_size=300).prepare_data()
    return data


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The prepared corpus and one uninterrupted single-process run over it (the default options), which the
    single-process tests compare against: ``(data folder, run folder)``. Read only; the tests write elsewhere."""
    root = tmp_path_factory.mktemp("reference")
    data = _prepare(root, write_texts(root / "texts"))
    _run(root / "ref", data)
    return data, root / "ref"


def _run(out: Path, data: Path, *args: str, timeout: float = 240) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--data-dir", str(data), *args],
        env=ENV, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _interrupt(out: Path, data: Path, pause_at: int, sig: int, *args: str) -> None:
    """Start a fit that pauses after micro-batch ``pause_at``, send it ``sig``, wait for it to end."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), "--data-dir", str(data), "--pause-at", str(pause_at), *args],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "paused0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:] if proc.stderr else ""
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.communicate(timeout=120)


def _losses(path: Path) -> dict[tuple[int, int], tuple[int, float]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return {(int(e), int(b)): (int(s), float.fromhex(v)) for e, b, s, v in rows}


def _check_resumed(reference: Path, stopped: Path, resumed: Path, first: tuple[int, int], rtol: float = 0.0) -> None:
    """Every micro-batch's (global step, loss) equals the uninterrupted run's: exactly, or within ``rtol``."""
    ref, before, after = _losses(reference), _losses(stopped), _losses(resumed)
    assert min(after) == first  # the resumed run starts at the step boundary
    assert set(before) | set(after) == set(ref)
    for key, (step, loss) in {**before, **after}.items():
        assert step == ref[key][0] and abs(loss - ref[key][1]) <= rtol * abs(ref[key][1]), (
            f"micro-batch {key}: {(step, loss)} != uninterrupted {ref[key]}"
        )


def test_sigterm_mid_accumulation_then_resume_is_exact(tmp_path, reference):
    data, ref = reference
    # Stop after 9 micro-batches with accumulate_grad_batches=2: step 5 is half done.
    _interrupt(tmp_path / "stop", data, 9, signal.SIGTERM)
    ckpt = tmp_path / "stop" / "ckpt" / "on_exception.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 4 and saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 8
    _run(tmp_path / "resume", data, "--ckpt", str(ckpt))
    _check_resumed(ref / "losses_rank0.txt", tmp_path / "stop/losses_rank0.txt",
                   tmp_path / "resume/losses_rank0.txt", first=(0, 8))
    # MFUMonitor's totals continue: the same tokens as the uninterrupted run.
    assert (tmp_path / "resume/mfu.txt").read_text().split()[1] == (ref / "mfu.txt").read_text().split()[1]

    # SIGKILL: nothing is saved at the kill; resume from the last periodic checkpoint (step 9).
    _interrupt(tmp_path / "kill", data, 21, signal.SIGKILL)
    ckpt = tmp_path / "kill" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 9
    _run(tmp_path / "resume2", data, "--ckpt", str(ckpt))
    after = _losses(tmp_path / "resume2/losses_rank0.txt")
    uninterrupted = _losses(ref / "losses_rank0.txt")
    assert min(after) == (1, 8)  # 18 micro-batches = 9 steps; epochs of 10 micro-batches
    assert all(value == uninterrupted[key] for key, value in after.items())
    assert max(after) == max(uninterrupted)


def test_sigterm_in_an_epoch_s_last_micro_batch_resumes_at_the_next_epoch_exactly(tmp_path, reference):
    """Lightning stops a SIGTERM in an epoch's last batch only after the epoch's end has run (its epoch-end hooks,
    epoch-interval schedulers): the resumed run starts the next epoch at its first batch, in its own order."""
    data, ref = reference
    _interrupt(tmp_path / "stop", data, 10, signal.SIGTERM)  # epochs of 10 micro-batches: the last of epoch 0
    ckpt = tmp_path / "stop" / "ckpt" / "on_exception.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 5 and saved["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    _run(tmp_path / "resume", data, "--ckpt", str(ckpt))
    _check_resumed(ref / "losses_rank0.txt", tmp_path / "stop/losses_rank0.txt",
                   tmp_path / "resume/losses_rank0.txt", first=(1, 0))


@pytest.mark.parametrize("fail_at", [9, 10], ids=["first-micro-batch", "last-micro-batch"])
def test_exception_inside_a_batch_then_resume_is_exact(tmp_path, reference, fail_at):
    """An error raised in the forward of micro-batch 9 or 10 (step 5 = micro-batches 9 and 10): the
    on-exception checkpoint is rolled back to the end of step 4, and the resumed run repeats step 5 whole."""
    data, ref = reference
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "stop"), "--data-dir", str(data), "--fail-at", str(fail_at)],
        env=ENV, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0 and "injected failure" in proc.stderr
    ckpt = tmp_path / "stop" / "ckpt" / "on_exception.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert saved["global_step"] == 4 and progress["processed"] == progress["completed"] == 8
    total = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert total == {"ready": 8, "started": 8, "processed": 8, "completed": 8}  # a later resume counts right too
    assert saved["TextDataModule"]["train_position"] == 16
    _run(tmp_path / "resume", data, "--ckpt", str(ckpt))
    _check_resumed(ref / "losses_rank0.txt", tmp_path / "stop/losses_rank0.txt",
                   tmp_path / "resume/losses_rank0.txt", first=(0, 8))


def test_fsdp2_two_processes_sigterm_mid_accumulation_then_resume_is_exact(tmp_path, text_dir):
    """ModelParallelStrategy (FSDP2, per-block fully_shard) on 2 gloo CPU processes, distributed checkpoint.

    With AutoBatchSize: FSDP2 restores callbacks only after the resumed run's search, which here finds a
    larger micro-batch (4, its bound) than the checkpoint's (2); the run continues with the checkpoint's."""
    data = _prepare(tmp_path, text_dir)
    fsdp = ("--strategy", "fsdp", "--devices", "2")
    _run(tmp_path / "ref", data, *fsdp, "--auto-batch", "2")
    _interrupt(tmp_path / "stop", data, 9, signal.SIGTERM, *fsdp, "--auto-batch", "2")
    ckpt = tmp_path / "stop" / "ckpt" / "on_exception.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2  # a DCP folder
    _run(tmp_path / "resume", data, "--ckpt", str(ckpt), *fsdp, "--auto-batch", "4")
    assert (tmp_path / "resume" / "micro_batch.txt").read_text().split() == ["2", "2"]
    for rank in (0, 1):
        _check_resumed(tmp_path / f"ref/losses_rank{rank}.txt", tmp_path / f"stop/losses_rank{rank}.txt",
                       tmp_path / f"resume/losses_rank{rank}.txt", first=(0, 8))
    ref0, ref1 = _losses(tmp_path / "ref/losses_rank0.txt"), _losses(tmp_path / "ref/losses_rank1.txt")
    assert ref0[(0, 0)] != ref1[(0, 0)]  # the ranks read different samples


def test_fsdp2_killed_while_saving_keeps_the_previous_checkpoint_whole(tmp_path, text_dir):
    """AtomicModelParallelStrategy on 2 gloo processes: every rank is SIGKILLed right after writing its shard of
    the second last.ckpt (step 6); last.ckpt is still the complete step-3 checkpoint, and resuming from it
    reproduces the uninterrupted run bit for bit."""
    data = _prepare(tmp_path, text_dir)
    fsdp = ("--strategy", "fsdp-atomic", "--devices", "2")
    _run(tmp_path / "ref", data, *fsdp)
    killed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "kill"), "--data-dir", str(data), "--kill-on-save", "2", *fsdp],
        env=ENV, capture_output=True, text=True, timeout=240,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = tmp_path / "kill" / "ckpt"
    last = ckpt / "last.ckpt"
    partial = partial_path(last)
    assert len(list(partial.glob("*.distcp"))) == 2 and not (partial / "meta.pt").exists()  # the cut-off save
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 3
    stale = partial_path(tmp_path / "resume" / "ckpt" / "last.ckpt")  # as a kill leaves it: the next save clears it
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"cut off")
    _run(tmp_path / "resume", data, "--ckpt", str(last), *fsdp)
    assert not stale.exists() and sorted(p.name for p in stale.parent.iterdir()) == ["last.ckpt"]
    assert torch.load(stale.parent / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 12
    for rank in (0, 1):
        ref, resumed = _losses(tmp_path / f"ref/losses_rank{rank}.txt"), _losses(tmp_path / f"resume/losses_rank{rank}.txt")
        assert min(resumed) == (0, 6)  # step 3 x 2 micro-batches
        assert resumed == {k: v for k, v in ref.items() if k >= (0, 6)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_sigterm_mid_accumulation_then_resume_within_bf16_tolerance(tmp_path, text_dir):
    """The SIGTERM case on one GPU under BF16Precision: losses continue within bf16 tolerance."""
    data = _prepare(tmp_path, text_dir)
    gpu = ("--accelerator", "gpu", "--bf16")
    _run(tmp_path / "ref", data, *gpu)
    _interrupt(tmp_path / "stop", data, 9, signal.SIGTERM, *gpu)
    ckpt = tmp_path / "stop" / "ckpt" / "on_exception.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4
    _run(tmp_path / "resume", data, "--ckpt", str(ckpt), *gpu)
    _check_resumed(tmp_path / "ref/losses_rank0.txt", tmp_path / "stop/losses_rank0.txt",
                   tmp_path / "resume/losses_rank0.txt", first=(0, 8), rtol=2e-2)
