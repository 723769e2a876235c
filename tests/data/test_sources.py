"""Corpus sources: folders, files, split folders, the standard library, Hugging Face; bad sources are named."""

from pathlib import Path

import pytest

from lightning_gpuopt import TextDataModule
from lightning_gpuopt.data import (
    resolve_source,
    stdlib_files,
)


def test_sources(tmp_path, text_dir):
    assert len(stdlib_files()) > 300
    assert not any("site-packages" in p.parts or "test" in p.parts for p in stdlib_files())
    assert resolve_source(str(text_dir / "doc0.txt")).description.endswith("doc0.txt")
    assert resolve_source(str(text_dir / "*.txt")).description.startswith("4 files")
    assert resolve_source(str(text_dir)).description.startswith("4 files under")


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize(
    "make_source, match",
    [
        (lambda d: str(d / "missing"), "does not exist: use 'stdlib'"),
        (lambda d: str(d / "nothing-*.txt"), "matches no files"),
        (lambda d: str(_write(d / "imgs" / "a.png", b"\x89PNG").parent), "folder with no .txt"),
        (lambda d: "  ", "data.source is empty"),
    ],
)
def test_bad_sources_are_named(tmp_path, cache_dir, make_source, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule(source=make_source(tmp_path), cache_dir=str(cache_dir))


def test_empty_corpus(tmp_path, cache_dir):
    _write(tmp_path / "c" / "a.txt", "")
    _write(tmp_path / "c" / "b.txt", "")
    dm = TextDataModule(source=str(tmp_path / "c"), vocab_size=300, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match="is empty: data.source holds no text"):
        dm.prepare_data()
    assert not (dm.data_dir / "meta.json").exists()


def test_corpus_shorter_than_a_block(tmp_path, cache_dir):
    _write(tmp_path / "short.txt", "just a few words of text")
    dm = TextDataModule(source=str(tmp_path / "short.txt"), block_size=256, vocab_size=300, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match=r"too short: it holds .* fewer than one training window of block_size \+ 1 = 257: use a larger "
                       r"corpus or a smaller data.block_size\. \(data.val_fraction=0.05 of the text went to each of validation "
                       r"and test: a smaller one leaves training more\)$"):
        dm.setup("fit")  # "a larger data.val_fraction", as it said, shortens the train split further
    # A run whose model comes from a checkpoint (resume, --model.init_from) keeps its block_size: not offered.
    pinned = TextDataModule(source=str(tmp_path / "short.txt"), block_size=256, vocab_size=300, cache_dir=str(cache_dir))
    pinned.use_checkpoint_tokenizer({})
    with pytest.raises(ValueError, match=r"block_size \+ 1 = 257: use a larger corpus \(block_size=256 is the checkpoint's\)\. "):
        pinned.setup("fit")


def test_unreadable_file_is_named(tmp_path, cache_dir):
    bad = _write(tmp_path / "c" / "latin1.txt", "caf\xe9".encode("latin-1"))
    dm = TextDataModule(source=str(bad.parent), vocab_size=300, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match=r"Cannot read training text from .*latin1.txt.*UTF-8"):
        dm.prepare_data()


def test_hf_source_without_datasets_names_the_package():
    try:
        import datasets  # noqa: F401

        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install datasets"):
        resolve_source("hf:wikitext:wikitext-103-raw-v1")
