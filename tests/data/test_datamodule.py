"""TextDataModule: tokenises once, caches by settings, splits, checks its tokenizer and the model, builds its loaders."""

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.data import (
    EOT_TOKEN,
    SequentialWindows,
    load_tokenizer,
    train_bpe_tokenizer,
)


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


def _same_size_same_mtime_edit(path: Path) -> None:
    st = path.stat()
    path.write_text(path.read_text().replace("model", "mode1", 1))  # same length
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time put back


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_cache_key_changes_with_settings_and_an_edit_gets_a_new_folder(text_dir, cache_dir):
    first = _module(text_dir, cache_dir)
    base = first.data_dir
    assert _module(text_dir, cache_dir, vocab_size=320).data_dir != base
    assert _module(text_dir, cache_dir, val_fraction=0.1).data_dir != base
    first.prepare_data()
    written = _files(base)
    before = json.loads((base / "meta.json").read_text())["splits"]["test"]["end"]
    _same_size_same_mtime_edit(text_dir / "doc2.txt")
    assert _module(text_dir, cache_dir).data_dir != base  # seen by the inode change time
    with open(text_dir / "doc1.txt", "a") as f:
        f.write("an edit\n")
    edited = _module(text_dir, cache_dir)
    assert edited.data_dir != base  # a new folder: the one a run (and its checkpoints) used is never rewritten
    edited.prepare_data()
    assert json.loads((edited.data_dir / "meta.json").read_text())["splits"]["test"]["end"] > before
    assert _files(base) == written


def test_the_checkpoints_tokenizer_is_kept_for_a_changed_corpus(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir)
    dm.setup("fit")
    state = dm.state_dict()  # what a checkpoint holds
    assert Tokenizer.from_str(state["tokenizer_json"]).encode("the model").ids == dm.encode("the model")
    same = _module(text_dir, cache_dir)
    same.use_checkpoint_tokenizer(state)
    assert same.data_dir == dm.data_dir  # the corpus is unchanged: its tokens are reused, not rewritten

    with open(text_dir / "doc3.txt", "a") as f:
        f.write("zebras quartz jumping over lazy foxes " * 400 + "\n")
    grown = _module(text_dir, cache_dir)
    grown.setup("fit")  # a BPE trained on the grown text: its ids mean other text
    with pytest.raises(ValueError, match=r"call data.use_checkpoint_tokenizer\(checkpoint\['TextDataModule'\]\) before"):
        grown.load_state_dict(state)
    follow = _module(text_dir, cache_dir)  # the advice, followed
    follow.use_checkpoint_tokenizer(state)
    follow.setup("fit")
    follow.load_state_dict(state)
    assert follow.data_dir not in (dm.data_dir, grown.data_dir)
    assert follow.tokenizer.to_str() == state["tokenizer_json"]
    tokens = np.fromfile(follow.data_dir / "train.bin", dtype=np.uint16)
    assert "zebras quartz" in dm.decode(tokens.astype(np.int64).tolist())  # the grown text, in the checkpoint's ids


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


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def test_bad_tokenizer_files(tmp_path, text_dir, cache_dir):
    with pytest.raises(ValueError, match="does not exist: give the path of a tokenizer.json"):
        _module(text_dir, cache_dir, tokenizer=str(tmp_path / "nope.json"))
    _write(tmp_path / "broken.json", "{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        _module(text_dir, cache_dir, tokenizer=str(tmp_path / "broken.json"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "no_eot.json"))
    with pytest.raises(ValueError, match=r"has none of the end-of-text tokens \['<\|endoftext\|>', "
                       r"'<\|end_of_text\|>'"):
        load_tokenizer(tmp_path / "no_eot.json")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=100), "vocab_size must be an integer >= 257, got 100"),
        (dict(block_size=0), "block_size must be an integer >= 1"),
        (dict(batch_size=2.5), "batch_size must be an integer >= 1"),
        (dict(val_fraction=0.6), r"val_fraction must be in \(0, 0.5\)"),
        (dict(samples_per_epoch=0), "samples_per_epoch must be an integer >= 1 or None, got 0"),
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


def test_datamodule_loader_does_not_touch_the_global_rng(text_dir, cache_dir):
    dm = TextDataModule(source=str(text_dir), block_size=16, batch_size=2, vocab_size=300, num_workers=0)
    dm.setup("fit")
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    first = next(iter(dm.train_dataloader()))[0]
    next(iter(dm.val_dataloader()))
    assert torch.equal(torch.rand(1), expected)
    dm.load_state_dict({"train_epoch": 0, "train_position": 2})
    assert torch.equal(next(iter(dm.train_dataloader()))[0][0], dm.datasets["train"][2][0])
    assert torch.equal(first[0], dm.datasets["train"][0][0])


def test_a_vocabulary_the_corpus_cannot_fill_warns_with_the_size_it_got(text_dir, cache_dir):
    dm = _module(text_dir, cache_dir, vocab_size=70000)
    with pytest.warns(UserWarning, match=r"data.vocab_size=70000, but the corpus filled only (\d+) tokens") as record:
        dm.setup("fit")
    assert dm.vocab_size < 1000
    assert f"Set data.vocab_size {dm.vocab_size} " in str(record[0].message)


def test_a_vocabulary_the_corpus_fills_does_not_warn(text_dir, cache_dir, recwarn):
    dm = _module(text_dir, cache_dir, vocab_size=300)
    dm.setup("fit")
    assert dm.vocab_size >= 270
    assert not [w for w in recwarn if "vocab_size" in str(w.message)]


def _records(tmp_path, n: int = 60) -> Path:
    """A .jsonl corpus of prompt/completion records, as gpuopt predict --generate.scorer keeps them."""
    words = "the model reads text and learns to predict the next token".split()
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(n):
        pick = lambda k: " ".join(words[j] for j in torch.randint(0, len(words), (k,), generator=g).tolist())  # noqa: E731
        lines.append(json.dumps({"prompt": f"Q{i}: {pick(3)}?\nA:", "completion": f" {pick(4)}."}))
    path = tmp_path / "kept.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_records_learn_the_completions_only_when_asked(tmp_path, cache_dir):
    """loss_on='completion': prompt tokens are inputs but never targets; each completion and its end-of-text are."""
    source = _records(tmp_path)
    dm = _module(source, cache_dir, block_size=16, val_fraction=0.1, loss_on="completion")
    dm.setup("fit")
    first = json.loads(source.read_text().splitlines()[0])
    prompt, completion = dm.encode(first["prompt"]), dm.encode(first["completion"])
    stream = prompt + completion + [dm.eot_id]
    x, y = dm.datasets["train"]._window(0)
    assert x.tolist() == stream[:16]
    learnt = [0] * (len(prompt) - 1) + [1] * (len(completion) + 1)  # targets: the next token, learnt when an answer's
    assert (y[: len(learnt)] != -1).long().tolist() == learnt
    assert y[len(prompt) - 1 : len(learnt)].tolist() == completion + [dm.eot_id]
    for i in range(8):  # every training window holds an answer token
        assert (dm.datasets["train"][i][1] != -1).any()
    every = _module(source, cache_dir, block_size=16, val_fraction=0.1)  # loss_on='all': the same tokens, every one learnt
    every.setup("fit")
    x_all, y_all = every.datasets["train"]._window(0)
    assert torch.equal(x_all, x) and (y_all != -1).all()


def test_completion_loss_needs_records_and_a_broken_record_is_named(tmp_path, text_dir, cache_dir):
    with pytest.raises(ValueError, match=r"data.loss_on='completion' needs prompt/completion records, and data.source=.* is plain text"):
        _module(text_dir, cache_dir, loss_on="completion")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl, line 2: a JSONL corpus line needs "prompt" and "completion" strings'):
        _module(bad, cache_dir).prepare_data()
