"""Streaming preparation: pieces cut where BPE sees no difference, and memory that does not grow with
the size of a single-file corpus (peak RSS of a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_gpuopt.data import train_bpe_tokenizer
from lightning_gpuopt.data.streaming import cut_pieces, file_pieces, text_pieces
from tests._paths import REPO

TRICKY = [
    "plain words and more words " * 50,
    " = Title = \n \n Some text , with punctuation . \n" * 40,  # WikiText's layout: lines start with a space
    "def f(x):\n    return x  \n\n\n\tindented\r\nline\n" * 40,  # runs of whitespace across line ends
    "it's they're we've I'm you'll he'd 123 4567 naïve café 日本語 🙂 <|endoftext|> " * 30,
]


@pytest.mark.parametrize("target", [7, 64, 1000])
def test_pieces_give_the_same_tokens_and_training_as_whole_text(text_dir, target):
    texts = TRICKY + [(text_dir / "doc0.txt").read_text()[:5000]]
    whole = train_bpe_tokenizer(texts, vocab_size=400)
    pieces = [list(text_pieces(t, target)) for t in texts]
    assert all("".join(p) == t for p, t in zip(pieces, texts))
    assert max(len(piece) for p in pieces for piece in p) < 3 * target + 200  # bounded
    assert train_bpe_tokenizer([x for p in pieces for x in p], vocab_size=400).get_vocab() == whole.get_vocab()
    for text, parts in zip(texts, pieces):
        assert [i for enc in whole.encode_batch(parts) for i in enc.ids] == whole.encode(text).ids


def test_text_without_boundaries_is_cut_at_the_limit_with_a_warning():
    with pytest.warns(UserWarning, match="no space or line break in 100 characters"):
        pieces = list(cut_pieces(["x" * 250], target=10, limit=100))
    assert pieces == ["x" * 100, "x" * 100, "x" * 50]


def test_file_pieces_read_like_text_mode(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"one\r\ntwo three\r\n" * 1000)
    assert "".join(file_pieces(path, target=100)) == path.read_text()
    (tmp_path / "bad.txt").write_bytes(b"ok " * 100 + b"\xff")
    with pytest.raises(ValueError, match=r"Cannot read training text from .*bad.txt.*Fix its permissions or encoding"):
        list(file_pieces(tmp_path / "bad.txt", target=16))


_RSS_SCRIPT = """
import json, sys
from pathlib import Path
from lightning_gpuopt import TextDataModule

def status(field):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

growth = []
for source in sys.argv[2:]:
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = status("VmRSS:")
    TextDataModule(source=source, cache_dir=sys.argv[1], vocab_size=2048, num_workers=0).prepare_data()
    growth.append(status("VmHWM:") - base)
print(json.dumps(growth))
"""


def _corpus(path: Path, mb: float) -> Path:
    """A single-file corpus (one document) of English-like text, not repetitive enough to be trivial."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("etaoinshrdlucmfwyp"), size=int(n))) for n in rng.integers(2, 9, size=3000)]
    lines, size = [], 0
    while size < mb * 1e6:
        line = " " + " ".join(words[i] for i in rng.integers(0, len(words), size=100)) + " . \n"
        lines.append(line)
        size += len(line)
    path.write_text("".join(lines))
    return path


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_memory_does_not_grow_with_a_single_file_corpus(tmp_path):
    small, large = _corpus(tmp_path / "small.txt", 1.0), _corpus(tmp_path / "large.txt", 4.0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The larger corpus first, from a clean process: its growth is not hidden by memory freed earlier.
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "cache"), str(large), str(small)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    growth_large, growth_small = json.loads(out.stdout.strip().splitlines()[-1])
    # Whole-document tokenisation grew ~180 MB per MB of text here (+720 MB for 4 MB). Streaming: ~40 MB, flat.
    assert growth_large < growth_small + 64 * 2**20, (growth_small, growth_large)
    assert growth_large < 256 * 2**20, growth_large


def test_token_files_equal_whole_document_encoding(tmp_path, text_dir):
    """A file several pieces long is tokenised exactly as one document: its ids, then one EOT."""
    import numpy as np

    from lightning_gpuopt import TextDataModule
    from lightning_gpuopt.data import EOT_TOKEN

    text = "".join((text_dir / f"doc{i}.txt").read_text() for i in range(4)) * 3  # ~190 K characters: 3 pieces
    assert len(list(text_pieces(text))) >= 3
    (tmp_path / "one.txt").write_text(text)
    # vocab_size=384: this corpus fills 351 tokens, within 90% of it (no unused-rows warning)
    dm = TextDataModule(source=str(tmp_path / "one.txt"), vocab_size=384, block_size=32, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    tokens = np.fromfile(dm.data_dir / "train.bin", dtype=np.uint16).tolist()
    assert tokens == dm.tokenizer.encode(text).ids + [dm.tokenizer.token_to_id(EOT_TOKEN)]
