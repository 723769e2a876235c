"""Tokens on disk and the windows read from them; the BPE tokenizer round trip."""


import numpy as np
import pytest
import torch

from lightning_gpuopt.data import (
    EOT_TOKEN,
    RandomWindows,
    SequentialWindows,
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
