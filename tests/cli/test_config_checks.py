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


def test_an_output_in_a_folder_this_process_cannot_write_is_refused(tmp_path):
    """The folder is checked before any work (predict generated everything, then lost it in two chained OSErrors),
    by writing there: root passes permission bits, not /proc or a read-only mount."""
    from lightning_gpuopt.cli.config_checks import check_output_file

    check_output_file("generate.output", tmp_path / "new" / "deeper" / "g.jsonl")  # created later: its parent is writable
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"generate.output='/proc/self/new/g.jsonl' cannot be written \(.* at /proc/self\): "
                                         r"give a --generate.output in a folder you can write"):
        check_output_file("generate.output", "/proc/self/new/g.jsonl")


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


def test_a_read_only_mount_is_refused_for_root_too(tmp_path):
    """A real read-only filesystem: a tmpfs mounted read-only in a private mount namespace, where this process
    is root (the test suite's user, whom permission bits do not stop)."""
    import shutil
    import subprocess
    import sys

    from tests._paths import REPO

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a read-only tmpfs in a private mount namespace")
    mount = tmp_path / "ro"
    mount.mkdir()
    script = (
        "import subprocess, sys\n"
        f"subprocess.run(['mount', '-t', 'tmpfs', '-o', 'ro,size=64k', 'tmpfs', {str(mount)!r}], check=True)\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from lightning_gpuopt.cli.config_checks import check_writable\n"
        "try:\n"
        f"    check_writable('trainer.default_root_dir', {str(mount / 'run')!r})\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(["unshare", "-rm", sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip().splitlines()[-1]}")
    assert out.stdout.startswith(f"trainer.default_root_dir='{mount / 'run'}' cannot be written (Read-only file system "
                                 f"at {mount})"), out.stdout + out.stderr


def test_a_yaml_merge_key_is_read_as_yaml_reads_it(tmp_path, capsys):
    from lightning_gpuopt.cli.config_checks import check_config_files
    from lightning_gpuopt.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n"
        "  max_steps: 20\n"
        "  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: &every {every_n_train_steps: 5, save_top_k: 0}\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {<<: *every, save_top_k: 2, monitor: val/loss}\n"  # its own save_top_k wins, as in YAML
    )
    check_config_files(["fit", "--config", str(config)])  # refused before: "could not determine a constructor"
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    assert printed.count("every_n_train_steps: 5") == 2 and "save_top_k: 2" in printed and "monitor: val/loss" in printed
    config.write_text("trainer:\n  <<: {max_steps: 3}\n  max_steps: 4\n  max_steps: 5\n")  # a key written twice still is
    with pytest.raises(ValueError, match=r"line 4: 'max_steps' is given twice in one mapping \(also on line 3\)"):
        check_config_files(["fit", "--config", str(config)])
