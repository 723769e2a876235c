"""The token cache folder: what makes it complete and current, and how it is written safely.

Its name hashes the corpus, the tokenizer and the split, so a changed corpus is a new folder; ``meta.json``,
written last, holds fingerprints of every file and its own checksum; writers hold an ``flock``. ``docs/data.md``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from lightning_gpuopt.data.sources import Corpus
from lightning_gpuopt.perf.cache_root import package_cache_dir

__all__ = [
    "FORMAT_VERSION",
    "cache_lock",
    "check_cache",
    "check_writable",
    "default_cache_dir",
    "file_fingerprint",
    "remove_leftovers",
    "token_cache_dir",
    "write_meta",
]

FORMAT_VERSION = 3  # bump when the on-disk layout or the tokenisation changes (2: meta.json with fingerprints;
# 3: a literal <|endoftext|> in the text is text, not the separator)

META = "meta.json"
TOKENIZER = "tokenizer.json"
_BLOCK = 1 << 20
_SAMPLES = 16
_TMP = re.compile(r"\.tmp\d+$")
_FIX = "set data.cache_dir (or the GPUOPT_CACHE_DIR environment variable) to a folder this process can write"


def default_cache_dir() -> Path:
    """``$GPUOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_gpuopt``, else ``~/.cache/lightning_gpuopt``."""
    return package_cache_dir("the token cache", "data.cache_dir")


def file_fingerprint(path: Path) -> str:
    """BLAKE2b of a file's size and of ``_SAMPLES`` evenly spaced 1 MiB blocks (the whole file up to 16 MiB): a few
    milliseconds at every start whatever the file's size, where a full checksum of GBs would take seconds."""
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= _BLOCK * _SAMPLES:
            while block := f.read(_BLOCK):
                digest.update(block)
        else:
            for i in range(_SAMPLES):  # the first and the last block are always among them
                f.seek(i * (size - _BLOCK) // (_SAMPLES - 1))
                digest.update(f.read(_BLOCK))
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _meta_checksum(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_meta(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Add the token files' and the tokenizer's fingerprints and a checksum to ``meta`` and write ``meta.json`` into
    ``folder`` atomically."""
    names = sorted({name for span in meta["splits"].values() for name in (span["file"], span.get("answers")) if name})
    meta = dict(meta)
    meta["files"] = {
        n: {"bytes": (folder / n).stat().st_size, "fingerprint": file_fingerprint(folder / n)} for n in names
    }
    meta["tokenizer_sha256"] = _sha256(folder / TOKENIZER)
    meta["checksum"] = _meta_checksum(meta)
    tmp = folder / f"{META}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, folder / META)  # written last: its presence means the folder is complete
    return meta


def check_cache(folder: Path, expected: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``(meta, None)`` when ``folder`` is complete and its ``meta.json`` holds the ``expected`` entries, else
    ``(None, reason)``."""
    if not (folder / META).is_file():
        return None, "it is incomplete (no meta.json: never finished, or interrupted)"
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"meta.json cannot be read ({err})"
    if not isinstance(meta, dict) or meta.get("checksum") != _meta_checksum(meta):
        return None, "meta.json was changed after it was written (its checksum does not match)"
    for key, value in expected.items():
        if meta.get(key) != value:
            what = "the corpus changed" if key == "inputs" else f"its {key} is {meta.get(key)!r}, not {value!r}"
            return None, f"{what} since it was written"
    try:
        if _sha256(folder / TOKENIZER) != meta["tokenizer_sha256"]:
            return None, f"{TOKENIZER} differs from the one the tokens were written with"
        for name, want in meta["files"].items():
            path = folder / name
            size = path.stat().st_size
            if size != want["bytes"]:
                return None, f"{name} holds {size} bytes, not the {want['bytes']} written"
            if file_fingerprint(path) != want["fingerprint"]:
                return None, f"{name} does not match its fingerprint (the file was changed or damaged)"
    except FileNotFoundError as err:
        return None, f"{Path(err.filename).name} is missing"
    except OSError as err:
        return None, f"a file cannot be read ({err})"
    return meta, None


def check_writable(cache_dir: Path) -> None:
    """Create the token cache's root ``cache_dir`` if needed and check this process can write there, before any work."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"The token cache folder {cache_dir} cannot be created ({err}): {_FIX}.") from err
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise ValueError(f"The token cache folder {cache_dir} is not writable: {_FIX}.")


@contextlib.contextmanager
def cache_lock(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (never deleted, so waiting processes stay safe); without
    ``fcntl`` (Windows) no lock, with a warning."""
    try:
        import fcntl
    except ImportError:
        warnings.warn("No file locking on this platform: prepare one token cache folder from one process at a time.")
        yield
        return
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_leftovers(folder: Path) -> list[str]:
    """Delete the ``*.tmp<pid>`` files of killed runs in ``folder`` (under :func:`cache_lock`); return their names."""
    removed = []
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if _TMP.search(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path.name)
    return removed


def token_cache_dir(
    cache_dir: Path, corpus: Corpus, tokenizer_json: Optional[str], vocab_size: int, val_fraction: float
) -> Path:
    """The folder of one data configuration in ``cache_dir``: its name changes when the text (its identity and
    fingerprint), the tokenizer (``tokenizer_json``, or ``None``: a BPE of ``vocab_size``) or the split does."""
    tok = hashlib.sha256(tokenizer_json.encode()).hexdigest() if tokenizer_json is not None else f"bpe-{vocab_size}"
    key = json.dumps([FORMAT_VERSION, corpus.identity, corpus.fingerprint, tok, val_fraction])
    return cache_dir / hashlib.sha256(key.encode()).hexdigest()[:16]
