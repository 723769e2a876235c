"""`--ckpt_path last` / `hpc` get the checks an explicit path gets; a fit never overwrites a run by accident
(real Trainers through `gpuopt`'s `main`)."""

from __future__ import annotations

import os
import shlex
import socket
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpuopt.cli.main import main
from lightning_gpuopt.run.folder import LOCK_FILE, checkpoint_dirs, resolve_ckpt_path
from lightning_gpuopt.run.lock import PathInUse, holds_locks
from lightning_gpuopt.model.checkpoint import read_checkpoint
from tests._paths import REPO

REPO = Path(__file__).resolve().parents[2]


def _args(text_dir: Path, root: Path, *extra: str) -> list[str]:
    return [
        "--data.source", str(text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.batch_size", "4",
        "--data.num_workers", "0", "--trainer.default_root_dir", str(root), "--model.preset", "tiny",
        "--model.warmup_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0", *extra,
    ]


def _exit_code(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code


@pytest.fixture
def run_root(tmp_path, cache_dir, text_dir, monkeypatch):
    """A 2-step fit whose default stack left <root>/checkpoints/last.ckpt."""
    monkeypatch.chdir(tmp_path)  # the CLI writes config.yaml into the working folder
    root = tmp_path / "run"
    main(["fit", *_args(text_dir, root, "--trainer.max_steps", "2")])
    assert read_checkpoint(root / "checkpoints" / "last.ckpt")["global_step"] == 2
    return root


def test_last_refuses_an_architecture_change_like_an_explicit_path(run_root, text_dir, capsys):
    for ckpt in ("last", str(run_root / "checkpoints" / "last.ckpt")):
        code = _exit_code(["fit", *_args(text_dir, run_root, "--trainer.max_steps", "4", "--model.n_head", "2"),
                           "--ckpt_path", ckpt])
        err = capsys.readouterr().err
        assert code == 2 and "architecture cannot change" in err and "model.n_head=2" in err and "n_head=4" in err
        assert "Traceback" not in err
    assert read_checkpoint(run_root / "checkpoints" / "last.ckpt")["global_step"] == 2  # untouched


def test_last_refuses_another_vocabulary_before_training(run_root, text_dir, cache_dir, capsys):
    caches = sorted(p.name for p in cache_dir.iterdir())
    code = _exit_code(["fit", *_args(text_dir, run_root, "--trainer.max_steps", "4"), "--data.vocab_size", "320",
                       "--data.tokenizer", "null", "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert code == 2 and "linked from data.vocab_size" in err and "size mismatch" not in err and "Traceback" not in err
    assert sorted(p.name for p in cache_dir.iterdir()) == caches  # refused before a tokenizer was trained


def test_last_refuses_a_foreign_checkpoint_in_a_short_error(tmp_path, cache_dir, text_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    (root / "checkpoints").mkdir(parents=True)
    trainer.save_checkpoint(root / "checkpoints" / "last.ckpt")
    code = _exit_code(["fit", *_args(text_dir, root, "--trainer.max_steps", "2"), "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert code == 2 and "last.ckpt" in err and "Missing key" not in err and "Traceback" not in err
    assert not cache_dir.exists()  # refused before the data was prepared


def test_last_continues_the_run_and_applies_other_settings(run_root, text_dir, capsys):
    main(["fit", *_args(text_dir, run_root, "--trainer.max_steps", "3"), "--ckpt_path", "last",
          "--model.learning_rate", "0.002"])
    saved = read_checkpoint(run_root / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 3 and saved["hyper_parameters"]["learning_rate"] == 0.002


def test_fit_into_a_run_without_ckpt_path_stops_with_both_commands(run_root, text_dir, capsys):
    before = (run_root / "checkpoints" / "last.ckpt").read_bytes()
    code = _exit_code(["fit", *_args(text_dir, run_root, "--trainer.max_steps", "1")])
    err = capsys.readouterr().err
    assert code == 2 and "--ckpt_path last" in err and "--trainer.default_root_dir NEW_FOLDER" in err
    assert (run_root / "checkpoints" / "last.ckpt").read_bytes() == before  # step 2 kept, not replaced by step 1


def test_hpc_names_the_highest_numbered_file_and_registry_is_refused(tmp_path):
    trainer = {"default_root_dir": str(tmp_path), "callbacks": []}
    for n in (1, 3, 2):
        torch.save({}, tmp_path / f"hpc_ckpt_{n}.ckpt")
    assert resolve_ckpt_path("hpc", "fit", trainer) == str(tmp_path / "hpc_ckpt_3.ckpt")
    with pytest.raises(ValueError, match="no hpc_ckpt_N.ckpt"):
        resolve_ckpt_path("hpc", "fit", {"default_root_dir": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="Download it from the model registry"):
        resolve_ckpt_path("registry:my-model", "predict", trainer)
    with pytest.raises(ValueError, match="no checkpoint in"):
        resolve_ckpt_path("last", "predict", trainer)
    assert resolve_ckpt_path("last", "fit", trainer) is None  # a first run: starts from step 0, said once


def test_checkpoint_dirs_follow_dirpath_and_the_default_root(tmp_path):
    trainer = {"default_root_dir": str(tmp_path / "r"), "callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(tmp_path / "a")}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {}},
        {"class_path": "lightning_gpuopt.callbacks.NonFiniteGuard"},
    ]}
    assert checkpoint_dirs(trainer) == [tmp_path / "a", tmp_path / "r" / "checkpoints"]
    assert checkpoint_dirs({**trainer, "enable_checkpointing": False}) == []


def _own(root: Path, *extra: str) -> list[str]:
    """A fit of a module of one's own whose `--trainer.callbacks` replaced the stack: no ModelCheckpoint listed, so
    Lightning's own writes `checkpoints/epoch=E-step=S.ckpt` at the end of each epoch, and no last.ckpt."""
    return ["fit", "--model", "tests.cli._own_modules.Regressor", "--trainer.default_root_dir", str(root),
            "--trainer.callbacks", "tests.cli._own_modules.EveryNSteps", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *extra]


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:MFUMonitor found no tokens:UserWarning")
def test_last_without_a_last_ckpt_resumes_from_the_runs_newest_checkpoint(tmp_path, monkeypatch, caplog, capsys):
    import logging

    from lightning_gpuopt.cli.main import make_cli

    monkeypatch.chdir(tmp_path)
    main(_own(tmp_path, "--trainer.max_steps", "4"))  # one epoch of 4 steps
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt"]
    with caplog.at_level(logging.INFO):
        cli = make_cli([*_own(tmp_path, "--trainer.max_steps", "6"), "--ckpt_path", "last"])
    assert cli.trainer.ckpt_path == str(folder / "epoch=0-step=4.ckpt")  # not from step 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fit --ckpt_path last")]
    assert said == [f"fit --ckpt_path last: no last.ckpt in {folder}, so the run's newest checkpoint, "
                    f"{folder / 'epoch=0-step=4.ckpt'}. Pass --ckpt_path PATH to resume from another."]
    assert read_checkpoint(folder / "epoch=1-step=6.ckpt")["global_step"] == 6
    assert not [p for p in folder.iterdir() if "-v1" in p.name]
    # A new fit into the same folder would mix its checkpoints with the run's: refused with both commands.
    assert _exit_code(_own(tmp_path, "--trainer.max_steps", "2")) == 2
    err = capsys.readouterr().err
    assert "epoch=1-step=6.ckpt holds a run this fit would overwrite" in err
    # The commands are the one typed, each with its option: they run as pasted.
    go_on, new = re.findall(r"`(gpuopt fit [^`]*)`", err.replace("\n", " "))
    assert shlex.split(go_on) == ["gpuopt", *_own(tmp_path, "--trainer.max_steps", "2"), "--ckpt_path", "last"]
    assert shlex.split(new)[-2:] == ["--trainer.default_root_dir", "NEW_FOLDER"] and "..." not in new


def test_a_fit_refused_for_its_model_or_data_leaves_no_folder_behind(tmp_path, text_dir, cache_dir, capsys):
    """The run folder is held from the start; a model or data error found when they are built leaves neither the lock
    file nor the folders taking it made (an existing folder, and one a run wrote into, keep theirs)."""
    root = tmp_path / "new" / "run"
    data = ["--data.source", str(text_dir), "--data.vocab_size", "300", "--data.num_workers", "0", "--trainer.max_steps", "1"]
    assert _exit_code(["fit", *data, "--model.preset", "tiny", "--model.n_head", "5", "--trainer.default_root_dir", str(root)]) == 2
    assert "n_head" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert _exit_code(["fit", *data, "--data.batch_size", "0", "--trainer.default_root_dir", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_last_with_no_checkpoint_says_where_it_looked(tmp_path):
    trainer = {"default_root_dir": str(tmp_path), "callbacks": [{"class_path": "tests.cli._own_modules.EveryNSteps"}]}
    with pytest.raises(ValueError, match=rf"no checkpoint in {tmp_path / 'checkpoints'}\. Pass the checkpoint's path"):
        resolve_ckpt_path("last", "predict", trainer)
    assert checkpoint_dirs(trainer) == [tmp_path / "checkpoints"]  # Lightning's own ModelCheckpoint writes there
    (tmp_path / "checkpoints").mkdir()
    torch.save({}, tmp_path / "checkpoints" / ".gpuopt-partial-0123456789abcdef.ckpt")  # a killed save's leftover
    assert resolve_ckpt_path("last", "fit", {**trainer, "enable_checkpointing": False}) is None
    torch.save({}, tmp_path / "checkpoints" / "epoch=0-step=3.ckpt")
    assert resolve_ckpt_path("last", "fit", {**trainer, "enable_checkpointing": False}).endswith("epoch=0-step=3.ckpt")


def test_one_holder_per_launch_whatever_launched_it():
    assert holds_locks({}) and holds_locks({"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "0"})
    assert not holds_locks({"LOCAL_RANK": "1"})  # a rank Lightning's DDP launcher started
    assert not holds_locks({"RANK": "3", "LOCAL_RANK": "1"})  # torchrun
    assert not holds_locks({"NODE_RANK": "1", "LOCAL_RANK": "0"})  # rank 0 of the second node
    assert not holds_locks({"SLURM_PROCID": "2"})


def test_a_lock_is_this_process_s_only_with_its_pid_on_this_very_host(tmp_path):
    # Containers number their processes from 1: a node sharing the folder can hold it under this pid, and its
    # name can start with this host's ("trainer-1" and "trainer-10").
    host, pid = socket.gethostname(), os.getpid()
    assert PathInUse(tmp_path, f"fit (pid {pid} on {host}, since 2026-11-27 10:00:00)").ours
    assert not PathInUse(tmp_path, f"fit (pid {pid} on {host}0, since 2026-11-27 10:00:00)").ours
    assert not PathInUse(tmp_path, f"fit (pid {pid} on x{host}, since 2026-11-27 10:00:00)").ours
    assert not PathInUse(tmp_path, f"fit (pid {pid + 1} on {host}, since 2026-11-27 10:00:00)").ours


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:MFUMonitor found no tokens:UserWarning")
def test_a_second_fit_on_a_folder_in_use_is_refused_and_a_killed_run_leaves_no_lock(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    args = ["fit", "--model", "tests.cli._own_modules.Regressor", "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-m", "lightning_gpuopt", *args, "--trainer.callbacks+=tests.cli._own_modules.WaitAtStart"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (root / "started").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-4000:]
            time.sleep(0.1)
        assert _exit_code(args) == 2  # this process: refused at its start, the first run untouched
        err = capsys.readouterr().err
        assert f"{root} is in use by another gpuopt fit (pid {first.pid} on " in err
        assert "another --trainer.default_root_dir" in err and "Traceback" not in err
    finally:
        first.kill()  # kill -9: the kernel drops its lock
        first.communicate(timeout=60)
    main(args)  # the folder is free again: nothing left to clean up
    assert read_checkpoint(root / "checkpoints" / "last.ckpt")["global_step"] == 2


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_checkpoint_folder_outside_the_run_folder_has_one_writer_too(tmp_path):
    """Two runs with their own roots and one ModelCheckpoint dirpath would write over each other's last.ckpt."""
    from lightning_gpuopt.run.folder import hold_run_folder
    from lightning_gpuopt.run.lock import release_held

    shared = tmp_path / "ckpts"
    def config(root):
        return {"default_root_dir": str(tmp_path / root), "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(shared)}}]}

    hold_run_folder(config("a"), env={})
    try:
        with pytest.raises(ValueError, match=r"the checkpoint folder .*ckpts \(the dirpath of a ModelCheckpoint in "
                                             r"Trainer\(callbacks=...\)\) is in use by another fit.*another dirpath"):
            hold_run_folder(config("b"), env={})  # a lock on another open file description: refused in one process too
        assert os.listdir(shared) == []  # nothing written into the checkpoint folder
        assert _lock_free(tmp_path / "b") and not _lock_free(tmp_path / "a")  # the refused run let go of its root only
    finally:
        release_held()
    hold_run_folder(config("b"), env={})  # free again
    release_held()


def _lock_free(folder):
    import fcntl

    with open(folder / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_ddp_fit_holds_its_folder_once(tmp_path):
    """Lightning's launcher starts rank 1 running the same command: it must not take the lock rank 0 holds."""
    root = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_gpuopt", "fit", "--model", "tests.cli._own_modules.Regressor",
         "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
         "--trainer.strategy", "ddp", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.max_steps", "2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert read_checkpoint(root / "checkpoints" / "last.ckpt")["global_step"] == 2
    assert (root / ".gpuopt-fit.lock").read_text().startswith(f"pid {proc.pid} on ")  # rank 0, the launching process


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_the_lock_file_and_the_runs_folder_are_never_part_of_the_repository():
    """A fit started in the checkout (the tests' own, or the README's quickstart) writes its lock file and runs/ there:
    neither may be tracked, or every run leaves the checkout changed."""
    tracked = subprocess.run(["git", "ls-files", "--", LOCK_FILE, "runs"], cwd=REPO, capture_output=True, text=True, check=True)
    assert tracked.stdout == ""
    ignored = subprocess.run(["git", "check-ignore", "--no-index", LOCK_FILE, "runs/quickstart/checkpoints/last.ckpt"], cwd=REPO,
                             capture_output=True, text=True, check=True)
    assert ignored.stdout.split() == [LOCK_FILE, "runs/quickstart/checkpoints/last.ckpt"]
