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


def test_an_output_in_a_folder_this_process_cannot_write_is_refused(tmp_path, monkeypatch):
    """The folder is checked before any work (predict generated everything, then lost it in two chained OSErrors);
    as root every folder is writable, so a read-only mount is stood in for by os.access saying so."""
    import os

    from lightning_gpuopt.cli.config_checks import check_output_file

    check_output_file("generate.output", tmp_path / "new" / "deeper" / "g.jsonl")  # created later: its parent is writable
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    with pytest.raises(ValueError, match=r"generate.output=.*new/g.jsonl': .* \(where .*new would be created\) is not writable "
                                         r"\(read-only, or another user's\): give a --generate.output in a folder you can write"):
        check_output_file("generate.output", tmp_path / "new" / "g.jsonl")
