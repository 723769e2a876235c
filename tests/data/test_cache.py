"""The token cache is never silently wrong: each kind of damage or staleness is detected before
training and the folder rebuilt with a warning naming it; a preparation killed with SIGKILL leaves
nothing that is reused; an unusable cache folder is named before any work."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_gpuopt import TextDataModule
from lightning_gpuopt.data import default_cache_dir
from lightning_gpuopt.data.cache import check_cache, file_fingerprint
from tests._paths import REPO, SCRIPTS


def _module(source, cache_dir, **kw) -> TextDataModule:
    args = dict(source=str(source), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    return TextDataModule(**{**args, **kw})


def _tokens(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.fromfile(p, dtype=np.uint16) for p in sorted(folder.glob("*.bin"))}


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _edit_meta(folder: Path) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta["splits"]["val"]["end"] += 1000  # valid JSON, wrong content
    (folder / "meta.json").write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated-bin": (lambda d, t: os.truncate(d / "train.bin", 1000), "train.bin holds 1000 bytes"),
    "appended-bin": (lambda d, t: _append(d / "train.bin", b"\0\0"), "train.bin holds"),
    "garbled-bin": (lambda d, t: _flip_byte(d / "train.bin", 4321), "train.bin does not match its fingerprint"),
    "deleted-bin": (lambda d, t: (d / "train.bin").unlink(), "train.bin is missing"),
    "edited-meta": (lambda d, t: _edit_meta(d), "meta.json was changed after it was written"),
    "half-written-meta": (lambda d, t: (d / "meta.json").write_text((d / "meta.json").read_text()[:50]), "meta.json cannot be read"),
    "deleted-meta": (lambda d, t: (d / "meta.json").unlink(), "it is incomplete"),
    "garbled-tokenizer": (lambda d, t: (d / "tokenizer.json").write_text("{garbage"), "tokenizer.json differs"),
    "deleted-tokenizer": (lambda d, t: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_corruption_is_detected_and_rebuilt(name, text_dir, cache_dir, tmp_path):
    corrupt, reason = CORRUPTIONS[name]
    dm = _module(text_dir, cache_dir)
    dm.prepare_data()
    corrupt(dm.data_dir, text_dir)
    again = _module(text_dir, cache_dir)
    assert check_cache(again.data_dir, again._expected_meta())[1] is not None
    with pytest.warns(UserWarning, match=f"Rebuilding the token cache {again.data_dir}: {reason}"):
        again.setup("fit")  # before any step; setup prepares when no Trainer ran prepare_data
    fresh = _module(text_dir, tmp_path / "fresh")
    fresh.prepare_data()
    rebuilt, expected = _tokens(again.data_dir), _tokens(fresh.data_dir)
    assert rebuilt.keys() == expected.keys() and all(np.array_equal(rebuilt[k], expected[k]) for k in rebuilt)
    assert check_cache(again.data_dir, again._expected_meta())[1] is None


def test_sampled_fingerprint_covers_large_files(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(bytes(40 << 20))  # 40 MiB: 16 sampled blocks
    before = file_fingerprint(path)
    _flip_byte(path, (40 << 20) - 1)  # the last block is always sampled
    assert file_fingerprint(path) != before


_KILL_SCRIPT = """
import sys
from lightning_gpuopt import TextDataModule
TextDataModule(source=sys.argv[1], cache_dir=sys.argv[2], vocab_size=300, num_workers=0).prepare_data()
"""


def test_sigkill_mid_preparation_leaves_nothing_reused(tmp_path, text_dir):
    corpus = tmp_path / "big.txt"
    corpus.write_text(((text_dir / "doc0.txt").read_text() + (text_dir / "doc1.txt").read_text()) * 40)  # ~1.5 MB
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(corpus), str(cache)], env=env, cwd=tmp_path)
    deadline = time.monotonic() + 120
    try:
        while not list(cache.glob("*/*.bin.tmp*")):  # encoding has started: train.bin is half-written
            assert proc.poll() is None, "the preparation ended before it could be killed: make the corpus larger"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    dm = _module(corpus, cache, vocab_size=300)
    leftovers = [p.name for p in dm.data_dir.iterdir() if ".tmp" in p.name]
    assert leftovers and not (dm.data_dir / "meta.json").exists()
    assert check_cache(dm.data_dir, dm._expected_meta())[1].startswith("it is incomplete")
    with pytest.warns(UserWarning, match="Rebuilding the token cache .*: it is incomplete"):
        dm.prepare_data()
    assert not [p.name for p in dm.data_dir.iterdir() if ".tmp" in p.name]  # the killed run's files are gone
    fresh = _module(corpus, tmp_path / "fresh", vocab_size=300)
    fresh.prepare_data()
    assert np.array_equal(_tokens(dm.data_dir)["train.bin"], _tokens(fresh.data_dir)["train.bin"])


def test_unusable_cache_folder_is_named_before_any_work(tmp_path):
    unreadable = tmp_path / "c"
    unreadable.mkdir()
    (unreadable / "a.txt").write_bytes(b"\xff\xfe not utf-8")  # reading it first would fail differently
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for cache in (blocker / "cache", Path("/proc/gpuopt-no-such-folder/cache")):
        dm = _module(unreadable, cache)
        with pytest.raises(ValueError, match=r"cannot be created .*set data.cache_dir \(or the GPUOPT_CACHE_DIR"):
            dm.prepare_data()


def test_cache_environment_errors_name_the_setting(monkeypatch):
    monkeypatch.setenv("GPUOPT_CACHE_DIR", " ")
    with pytest.raises(ValueError, match="GPUOPT_CACHE_DIR is set but empty: set it \\(or data.cache_dir\\)"):
        default_cache_dir()
    monkeypatch.delenv("GPUOPT_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_cache_dir() == Path("/home/someone/.cache/lightning_gpuopt")


def test_concurrent_preparations_share_one_result(tmp_path, text_dir, caplog):
    """Two preparations of one folder at once (threads: the lock is per open file, as between processes):
    one tokenises under the lock, the other waits and reuses its files."""
    cache = tmp_path / "cache"
    modules = [_module(text_dir, cache) for _ in range(2)]
    errors = []

    def run(dm):
        try:
            dm.prepare_data()
        except Exception as err:  # reported below
            errors.append(err)

    with caplog.at_level(logging.INFO):
        threads = [threading.Thread(target=run, args=(dm,)) for dm in modules]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors
    assert sum("Training a 300-token" in r.getMessage() for r in caplog.records) == 1  # tokenised once
    assert check_cache(modules[0].data_dir, modules[0]._expected_meta())[1] is None


@pytest.mark.extended  # ~60 s: the timeout must leave time for rank 1 to start
def test_ddp_preparation_longer_than_the_process_group_timeout(tmp_path, text_dir):
    """Rank 0 prepares for longer than the process group's timeout; rank 1 waits, prepares nothing, reads the same files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    script = SCRIPTS / "ddp_prepare.py"
    proc = subprocess.run([sys.executable, str(script), str(text_dir), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["prepared"] for r in ranks] == [1, 0]  # only local rank 0 ran prepare_data
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert ranks[0]["data_dir"] == ranks[1]["data_dir"] and ranks[0]["splits"] == ranks[1]["splits"]


def test_a_full_disk_names_the_cache_folder_and_the_settings_that_move_it(tmp_path, text_dir):
    """A real full disk: a 48 KB tmpfs in a private mount namespace, as the cache folder."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a private mount namespace")
    mount = tmp_path / "small"
    mount.mkdir()
    out = subprocess.run(["unshare", "-rm", sys.executable, str(SCRIPTS / "disk_full_prepare.py"), str(mount), str(text_dir)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    assert re.search(rf"ERROR OSError errno=28: \[Errno 28\] No space left on device while writing the token cache "
                     rf"{re.escape(str(mount))}/[0-9a-f]{{16}} \([\d.]+ MB free there now\); the partial folder was removed\. "
                     r"Free space there, or put the cache on a larger disk: TextDataModule\(cache_dir=\.\.\.\) or the "
                     r"GPUOPT_CACHE_DIR environment variable\.", out.stdout), out.stdout
    assert "LEFT []" in out.stdout  # nothing half-written holds the space
