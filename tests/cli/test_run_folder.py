"""`--ckpt_path last` / `hpc` get the checks an explicit path gets; a fit never overwrites a run by accident
(real Trainers through `gpuopt`'s `main`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_gpuopt.cli.main import main
from lightning_gpuopt.cli.run_folder import checkpoint_dirs, resolve_ckpt_path
from lightning_gpuopt.model.checkpoint import read_checkpoint


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
    with pytest.raises(ValueError, match="no last.ckpt in"):
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
