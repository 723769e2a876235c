"""The checks of parsed options that run before anything is built (``cli/config_checks.py``)."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.callbacks import MFUMonitor
from lightning_gpuopt.cli.config_checks import check_callbacks_once


def test_a_callback_keyed_by_its_class_is_refused_twice_whatever_its_settings():
    # MFUMonitor's state key is its class name, so two differently set copies still collide; the message
    # must not claim they have the same settings.
    with pytest.raises(ValueError, match=r"lists MFUMonitor twice: its state is saved under the class name alone") as info:
        check_callbacks_once([MFUMonitor(log_every_n_steps=10), MFUMonitor(log_every_n_steps=50)])
    assert "same settings" not in str(info.value)


def test_a_callback_keyed_by_its_settings_is_refused_only_with_the_same_settings():
    # ModelCheckpoint folds monitor/mode/interval into its key: two that watch different metrics may coexist.
    check_callbacks_once([ModelCheckpoint(monitor="val/loss"), ModelCheckpoint(monitor="train/loss")])
    with pytest.raises(ValueError, match=r"lists ModelCheckpoint twice: with the same settings, .*'monitor': 'val/loss'"):
        check_callbacks_once([ModelCheckpoint(monitor="val/loss"), ModelCheckpoint(monitor="val/loss")])


def test_an_integer_limit_read_as_a_float_is_a_batch_count_as_lightning_runs_it():
    from lightning_gpuopt.cli.config_checks import check_trainer_options

    # The parser reads the quickstart's `limit_val_batches: 20` as 20.0 (Lightning's type lists float first).
    check_trainer_options({"limit_val_batches": 20.0})
    with pytest.raises(ValueError, match=r"limit_val_batches must be in \[0, 1\]"):
        check_trainer_options({"limit_val_batches": 1.5})


def test_a_path_is_checked_writable_by_writing_and_nothing_is_left(tmp_path):
    from lightning_gpuopt.cli.config_checks import check_writable

    check_writable("trainer.default_root_dir", tmp_path / "new" / "run")  # its nearest existing parent takes a folder
    check_writable("generate.output", tmp_path / "out.jsonl", is_file=True)
    assert list(tmp_path.iterdir()) == []  # the probes are gone, and nothing was created
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"x='.*file' is a file, not a folder: give a path you can write, --x PATH"):
        check_writable("x", tmp_path / "file")
    with pytest.raises(ValueError, match=r"x='.*' is a folder, not a file"):
        check_writable("x", tmp_path, is_file=True)
    # Places root cannot write either (permission bits do not stop root, so a chmod-ed folder would not do).
    with pytest.raises(ValueError, match=r"x='/proc/self/run' cannot be written \(.* at /proc/self\)"):
        check_writable("x", "/proc/self/run")
