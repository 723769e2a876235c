import json
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.data import (
    EOT_TOKEN,
    RandomWindows,
    SequentialWindows,
    load_tokenizer,
    resolve_source,
    stdlib_files,
    token_dtype,
    train_bpe_tokenizer,
    write_tokens,
)


def test_bpe_round_trips_any_text():
    texts = ["def main():\n    return 42\n", "naïve café — 日本語 🙂", "the quick brown fox"] * 20
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    assert 257 <= tok.get_vocab_size() <= 300
    assert tok.token_to_id(EOT_TOKEN) is not None
    for text in texts[:3] + ["unseen words: zebra ⚡"]:
        assert tok.decode(tok.encode(text).ids) == text


def test_token_file_round_trip(tmp_path):
    chunks = [np.arange(0, 1000), np.arange(60000, 65536)]
    n = write_tokens(tmp_path / "t.bin", chunks, token_dtype(65536))
    assert n == 1000 + 5536
    data = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    assert np.array_equal(data, np.concatenate(chunks))
    assert list(tmp_path.iterdir()) == [tmp_path / "t.bin"]  # no temporary file left behind


def test_token_dtype_widens_for_large_vocabularies():
    assert token_dtype(50304) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_write_tokens_refuses_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="does not fit in uint16"):
        write_tokens(tmp_path / "t.bin", [np.array([70000])], np.dtype(np.uint16))
    assert not any(tmp_path.iterdir())


def test_windows_are_shifted_pairs_and_deterministic(tmp_path):
    write_tokens(tmp_path / "t.bin", [np.arange(500)], np.dtype(np.uint16))
    ds = RandomWindows(tmp_path / "t.bin", "uint16", 100, 400, block_size=16, seed=3)
    assert len(ds) == 300 // 16
    x, y = ds[4]
    assert x.dtype == torch.long and x.shape == y.shape == (16,)
    assert torch.equal(y[:-1], x[1:]) and y[-1] == x[-1] + 1
    assert 100 <= x[0] and y[-1] < 400  # inside the span
    assert torch.equal(RandomWindows(tmp_path / "t.bin", "uint16", 100, 400, 16, seed=3)[4][0], x)
    starts = {int(ds[i][0][0]) for i in range(len(ds))}
    assert len(starts) > 10  # random offsets, not one window repeated
    seq = SequentialWindows(tmp_path / "t.bin", "uint16", 0, 500, block_size=16)
    assert len(seq) == 499 // 16
    assert torch.equal(seq[2][0], torch.arange(32, 48))


def _module(text_dir, cache_dir, **kw) -> TextDataModule:
    args = dict(source=str(text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(cache_dir))
    return TextDataModule(**{**args, **kw})


def test_datamodule_tokenises_once_and_round_trips(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir)
    dm.setup("fit")
    meta = json.loads((dm.data_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == dm.vocab_size <= 300
    spans = meta["splits"]
    # no own splits: val and test are the tail of the stream, 5% each, train the rest
    assert spans["train"]["end"] == spans["val"]["start"] and spans["val"]["end"] == spans["test"]["start"]
    total = spans["test"]["end"]
    assert spans["test"]["end"] - spans["test"]["start"] == int(total * 0.05)
    tokens = np.memmap(dm.data_dir / "train.bin", dtype=np.uint16, mode="r")
    first_doc = (text_dir / "doc0.txt").read_text()
    assert dm.decode(tokens[: len(dm.encode(first_doc))].astype(np.int64).tolist()) == first_doc
    assert tokens[len(dm.encode(first_doc))] == dm.tokenizer.token_to_id(EOT_TOKEN)

    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    mtime = (dm.data_dir / "train.bin").stat().st_mtime_ns
    again = _module(text_dir, cache_dir)
    again.setup("fit")
    assert again.data_dir == dm.data_dir
    assert (dm.data_dir / "train.bin").stat().st_mtime_ns == mtime  # reused, not rewritten


def test_cache_key_changes_with_settings_and_an_edit_rebuilds(text_dir, cache_dir):
    first = _module(text_dir, cache_dir)
    base = first.data_dir
    assert _module(text_dir, cache_dir, vocab_size=320).data_dir != base
    assert _module(text_dir, cache_dir, val_fraction=0.1).data_dir != base
    first.prepare_data()
    before = json.loads((base / "meta.json").read_text())["splits"]["test"]["end"]
    with open(text_dir / "doc1.txt", "a") as f:
        f.write("an edit\n")
    edited = _module(text_dir, cache_dir)
    assert edited.data_dir == base  # the same folder, rebuilt: stale copies do not pile up
    with pytest.warns(UserWarning, match=f"Rebuilding the token cache {base}: the corpus changed"):
        edited.prepare_data()
    assert json.loads((base / "meta.json").read_text())["splits"]["test"]["end"] > before


def test_split_folder_uses_its_own_splits(tmp_path, text_dir, cache_dir):
    folder = tmp_path / "wikitext"
    folder.mkdir()
    text = (text_dir / "doc0.txt").read_text()
    for name, part in (("wiki.train.raw", text), ("wiki.valid.raw", text[:4000]), ("wiki.test.raw", text[4000:8000])):
        (folder / name).write_text(part)
    dm = _module(folder, cache_dir)
    dm.setup("fit")
    spans = dm._meta["splits"]
    assert {s: spans[s]["file"] for s in spans} == {"train": "train.bin", "val": "val.bin", "test": "test.bin"}
    assert dm.decode(SequentialWindows(dm.data_dir / "val.bin", "uint16", 0, 40, 8)[0][0]) in text[:4000]


def test_given_tokenizer_sets_vocab_size(tmp_path, text_dir, cache_dir):
    tok = train_bpe_tokenizer([(text_dir / "doc0.txt").read_text()], vocab_size=280)
    tok.save(str(tmp_path / "tokenizer.json"))
    dm = _module(text_dir, cache_dir, tokenizer=str(tmp_path / "tokenizer.json"))
    assert dm.vocab_size == tok.get_vocab_size()
    dm.setup("fit")
    assert dm.tokenizer.get_vocab().keys() == tok.get_vocab().keys()


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
    with pytest.raises(ValueError, match=r"too short: .* fewer than one training window of block_size \+ 1 = 257"):
        dm.setup("fit")


def test_unreadable_file_is_named(tmp_path, cache_dir):
    bad = _write(tmp_path / "c" / "latin1.txt", "caf\xe9".encode("latin-1"))
    dm = TextDataModule(source=str(bad.parent), vocab_size=300, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match=r"Cannot read training text from .*latin1.txt.*UTF-8"):
        dm.prepare_data()


def test_bad_tokenizer_files(tmp_path, text_dir, cache_dir):
    with pytest.raises(ValueError, match="does not exist: give the path of a tokenizer.json"):
        _module(text_dir, cache_dir, tokenizer=str(tmp_path / "nope.json"))
    _write(tmp_path / "broken.json", "{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        _module(text_dir, cache_dir, tokenizer=str(tmp_path / "broken.json"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "no_eot.json"))
    with pytest.raises(ValueError, match="has no '<|endoftext|>' token"):
        load_tokenizer(tmp_path / "no_eot.json")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=100), "vocab_size must be at least 257"),
        (dict(block_size=0), "block_size must be an integer >= 1"),
        (dict(batch_size=2.5), "batch_size must be an integer >= 1"),
        (dict(val_fraction=0.6), r"val_fraction must be in \(0, 0.5\)"),
        (dict(samples_per_epoch=0), "samples_per_epoch must be >= 1"),
    ],
)
def test_bad_arguments(text_dir, cache_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _module(text_dir, cache_dir, **kwargs)


def test_tokenizer_larger_than_model_vocab_fails_before_training(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir)
    model = GPTModule(preset="tiny", vocab_size=257, block_size=32)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model's vocab_size is 257"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0


def test_data_block_longer_than_model_fails(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir, block_size=64)
    model = GPTModule(preset="tiny", vocab_size=300, block_size=32)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="block_size=64 is longer than the model's block_size=32"):
        trainer.fit(model, datamodule=dm)


def test_hf_source_without_datasets_names_the_package():
    try:
        import datasets  # noqa: F401

        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install datasets"):
        resolve_source("hf:wikitext:wikitext-103-raw-v1")


def test_default_cache_dir_honours_environment(monkeypatch, tmp_path):
    from lightning_gpuopt.data import default_cache_dir

    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("GPUOPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lightning_gpuopt"


def test_dataloader_settings(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir, num_workers=1, prefetch_factor=3)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.persistent_workers and loader.prefetch_factor == 3 and loader.drop_last
    assert loader.pin_memory == torch.cuda.is_available()
    dm.batch_size = 2  # a callback may change it; the next loader follows
    assert dm.train_dataloader().batch_size == 2
    assert not dm.val_dataloader().drop_last
