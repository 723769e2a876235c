"""Where training text comes from: files, WikiText raw folders, Hugging Face datasets, or the
offline default (the Python standard library's own source code, present on every machine)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from lightning_gpuopt.data.streaming import file_pieces, text_pieces

__all__ = ["AnswerText", "Corpus", "resolve_source", "stdlib_files"]

# File names of the split files a folder may hold: WikiText's raw release, and the layout of
# PyTorch's word_language_model example.
_SPLIT_FILES = {
    "train": ("wiki.train.raw", "train.txt"),
    "val": ("wiki.valid.raw", "valid.txt"),
    "test": ("wiki.test.raw", "test.txt"),
}
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class AnswerText(str):
    """A piece of a document that is an answer (a completion): in a corpus of prompt/completion records, the text
    the loss may be limited to (``TextDataModule(loss_on="completion")``)."""

    __slots__ = ()


@dataclass
class Corpus:
    """A text corpus: a reader of documents per split, its identity, and a fingerprint of its content."""

    description: str  # what the corpus is, for logs and errors
    # split name (train, and optionally val and test) -> its documents, each an iterator of bounded text pieces
    splits: dict[str, Callable[[], Iterator[Iterator[str]]]]
    identity: str  # names the inputs (resolved paths per split, or the dataset's name): part of the cache's name
    fingerprint: str  # changes whenever the text may have changed (docs/data.md, "unchanged corpus")
    answers: bool = False  # its documents mark their answers (AnswerText pieces): prompt/completion records


def stdlib_files() -> list[Path]:
    """The Python standard library's own ``.py`` files (tests and installed packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _file_fingerprints(files: dict[str, list[Path]]) -> tuple[str, str]:
    """(identity, fingerprint): a hash of the resolved paths, and one of the paths with their stat."""
    names, stats = hashlib.sha256(), hashlib.sha256()
    for split, paths in sorted(files.items()):
        for path in paths:
            try:
                st = path.stat()
            except OSError as err:
                raise ValueError(f"Cannot read training text from {path}: {err}.") from err
            line = f"{split}\0{path.resolve()}\0"
            names.update(line.encode())
            # st_ctime_ns (inode change time) moves on every write, also when the modification time is
            # put back afterwards (touch -r, cp -p, rsync -t): an in-place edit of the same size is seen.
            stats.update(f"{line}{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    return names.hexdigest(), stats.hexdigest()


def _file_corpus(description: str, files: dict[str, list[Path]]) -> Corpus:
    def reader(paths: list[Path]) -> Callable[[], Iterator[Iterator[str]]]:
        return lambda: (file_pieces(p) for p in paths)

    identity, fingerprint = _file_fingerprints(files)
    return Corpus(
        description=description,
        splits={split: reader(paths) for split, paths in files.items()},
        identity=identity,
        fingerprint=fingerprint,
    )


def _record_pieces(path: Path, number: int, line: str) -> Iterator[str]:
    """A JSONL line's document: ``prompt`` then ``completion`` (an answer), or ``text`` (all of it an answer)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno}): fix that "
                         "line.") from err
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        yield from text_pieces(record["prompt"])
        yield from (AnswerText(p) for p in text_pieces(record["completion"]))
    elif isinstance(record, dict) and isinstance(record.get("text"), str):
        yield from (AnswerText(p) for p in text_pieces(record["text"]))
    else:
        raise ValueError(
            f"{path}, line {number}: a JSONL corpus line needs \"prompt\" and \"completion\" strings (or a \"text\" "
            f"string), got {line[:80]!r}: fix the line, or train on plain text files."
        )


def _jsonl_corpus(description: str, files: list[Path]) -> Corpus:
    """Prompt/completion records, one JSON object a line (what ``gpuopt predict --generate.scorer`` keeps)."""

    def documents() -> Iterator[Iterator[str]]:
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:  # a line at a time: memory bounded by the longest record
                    for number, line in enumerate(f, start=1):
                        if line.strip():
                            yield _record_pieces(path, number, line)
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"Cannot read training records from {path}: {err}. Fix its permissions or save it as "
                                 "UTF-8.") from err

    identity, fingerprint = _file_fingerprints({"train": files})
    identity = hashlib.sha256(f"jsonl-records\0{identity}".encode()).hexdigest()  # not the same files read as text
    return Corpus(
        description=description, splits={"train": documents}, identity=identity, fingerprint=fingerprint, answers=True
    )


def _special_kind(path: Path) -> Optional[str]:
    """What ``path`` is when it exists but is neither a regular file nor a folder (a FIFO, a device...)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None


def _split_folder(folder: Path) -> Optional[dict[str, list[Path]]]:
    found = {}
    for split, names in _SPLIT_FILES.items():
        for name in names:
            if (folder / name).is_file():
                found[split] = [folder / name]
                break
    return found if "train" in found else None


def _hf_corpus(spec: str) -> Corpus:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"data.source={spec!r} needs the Hugging Face `datasets` package: pip install \"lightning-gpuopt[hf]\" "
            "(or pip install datasets) and network access to the Hub, or point data.source at local text files."
        ) from err
    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None)
    except Exception as err:  # the Hub raises many types: report the source and the fix once
        raise ValueError(
            f"Could not load Hugging Face dataset {name!r} (config {config or None!r}): {err}. Check the name "
            "and your network, or download the text and point data.source at the files."
        ) from err
    names = {"train": "train", "val": "validation", "test": "test"}
    splits = {}
    for split, hf_split in names.items():
        if hf_split in ds:
            if "text" not in ds[hf_split].column_names:
                raise ValueError(
                    f"Hugging Face dataset {name!r} has no 'text' column (columns: {ds[hf_split].column_names})."
                )
            splits[split] = (lambda d=ds[hf_split]: (text_pieces(row["text"]) for row in d))
    if "train" not in splits:
        raise ValueError(f"Hugging Face dataset {name!r} has no 'train' split (splits: {list(ds)}).")
    # The Hub's datasets are versioned by name: the name is both the identity and the fingerprint.
    fingerprint = hashlib.sha256(json.dumps(["hf", name, config]).encode()).hexdigest()
    return Corpus(
        description=f"Hugging Face dataset {spec}", splits=splits, identity=fingerprint, fingerprint=fingerprint
    )


def resolve_source(source: str) -> Corpus:
    """Turn a ``data.source`` string into a :class:`Corpus`.

    Example::

        resolve_source("stdlib")                      # the offline default
        resolve_source("data/wikitext-103-raw")       # folder with wiki.{train,valid,test}.raw
        resolve_source("notes/**/*.md")               # a glob
        resolve_source("hf:wikitext:wikitext-103-raw-v1")

    Args:
        source: ``"stdlib"`` (offline, on every machine); a folder of split files (``wiki.{train,valid,test}.raw``
            or ``{train,valid,test}.txt``); any other folder (its ``*.txt``, ``*.md``, ``*.raw``, ``*.py``); a file or
            a glob (``**`` allowed; ``.jsonl``: prompt/completion or text records); ``"hf:NAME[:CONFIG]"`` (a
            dataset with a ``text`` column; the ``datasets`` package and network).
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError("data.source is empty: use 'stdlib', a folder, a file, a glob, or 'hf:NAME'.")
    if source == "stdlib":
        return _file_corpus("the Python standard library's source files", {"train": stdlib_files()})
    if source.startswith("hf:"):
        return _hf_corpus(source[3:])
    path = Path(source).expanduser()
    if path.is_dir():
        split_files = _split_folder(path)
        if split_files is not None:
            return _file_corpus(f"split files in {path}", split_files)
        files = sorted(p for ext in ("txt", "md", "raw", "py") for p in path.rglob(f"*.{ext}") if p.is_file())
        if not files:
            raise ValueError(
                f"data.source={source!r} is a folder with no .txt, .md, .raw or .py files: point it at your "
                "text files, or use a glob such as 'folder/**/*.json'."
            )
        return _file_corpus(f"{len(files)} files under {path}", {"train": files})
    if path.is_file():
        return (
            _jsonl_corpus(f"records in {path}", [path])
            if path.suffix.lower() == ".jsonl"
            else _file_corpus(str(path), {"train": [path]})
        )
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"data.source={source!r} matches no files: check the pattern.")
        if all(f.suffix.lower() == ".jsonl" for f in files):
            return _jsonl_corpus(f"records in {len(files)} files matching {source}", files)
        return _file_corpus(f"{len(files)} files matching {source}", {"train": files})
    kind = _special_kind(path)
    if kind is not None:
        raise ValueError(
            f"data.source={source!r} is {kind}, not a regular file or folder: training text is read more than "
            "once (tokenizer training, then encoding), so copy it into a file and point data.source there."
        )
    raise ValueError(
        f"data.source={source!r} does not exist: use 'stdlib' (offline default), an existing folder, file or glob, "
        "or 'hf:NAME[:CONFIG]' for a Hugging Face dataset."
    )
