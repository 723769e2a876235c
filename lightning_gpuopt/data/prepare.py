"""Tokenise a corpus into a cache folder with bounded memory: BPE training, encoding, token files.

Nothing holds a document whole: the BPE trains on its pieces (``streaming.py``), encoding runs on batches of
pieces on every core, and an EOT follows each document's last piece, so the token files are those of
whole-document encoding (``docs/data.md``)."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
from tokenizers import Tokenizer

from lightning_gpuopt.data.cache import TOKENIZER, cache_lock, check_cache, check_writable, remove_leftovers, write_meta
from lightning_gpuopt.data.sources import AnswerText, Corpus
from lightning_gpuopt.data.tokenizer import end_of_text_id, train_bpe_tokenizer
from lightning_gpuopt.data.tokens import token_dtype, write_tokens
from lightning_gpuopt.option_checks import option
from lightning_gpuopt.perf.units import GB

__all__ = ["encode_batch_size", "encode_documents", "prepare_token_cache", "prepare_tokens"]


def encode_batch_size() -> int:
    """Pieces per ``encode_batch_fast`` call: four per core, so every core has work (~4 MiB of text per core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(8, 4 * cores)


def _pieces(corpus: Corpus, split: str) -> Iterator[str]:
    for document in corpus.splits[split]():
        yield from document


def _empty(corpus: Corpus) -> ValueError:
    return ValueError(f"The corpus ({corpus.description}) is empty: data.source holds no text.")


def encode_documents(
    tokenizer: Tokenizer, documents: Iterator[Iterator[str]], eot: int, stats: Optional[dict[str, int]] = None,
    answers_out: Optional[BinaryIO] = None,
) -> Iterator[np.ndarray]:
    """Token ids of every document (an iterator of text pieces), an ``eot`` after each, encoded in batches of pieces
    on every core.

    Args:
        stats: If given, ``stats["documents"]`` counts the documents read.
        answers_out: If given, one byte per token in step with the ids: 1 for the tokens of ``AnswerText`` pieces
            and every EOT, 0 for the others (prompts).
    """
    stats = {"documents": 0} if stats is None else stats
    batch: list[str] = []
    ends: list[bool] = []  # whether batch[i] is the last piece of its document
    size = encode_batch_size()

    def flush() -> Iterator[np.ndarray]:
        for piece, enc, last in zip(batch, tokenizer.encode_batch_fast(batch), ends):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if answers_out is not None:  # the EOT after an answer is learnt with it: the model learns to stop
                answers_out.write(np.full(len(ids), isinstance(piece, AnswerText), dtype=np.uint8).tobytes())
                answers_out.write(b"\x01" if last else b"")
            yield np.append(ids, eot) if last else ids
        batch.clear()
        ends.clear()

    for document in documents:
        stats["documents"] += 1
        previous: Optional[str] = None
        for piece in document:
            if previous is not None:
                batch.append(previous)
                ends.append(False)
                if len(batch) >= size:
                    yield from flush()
            previous = piece
        batch.append(previous or "")
        ends.append(True)
        if len(batch) >= size:
            yield from flush()
    if batch:
        yield from flush()


def prepare_tokens(
    corpus: Corpus,
    out: Path,
    tokenizer: Optional[Tokenizer],
    vocab_size: int,
    val_fraction: float,
    log: Any = print,
) -> dict[str, Any]:
    """Write ``tokenizer.json`` and one token file per split of ``corpus`` into ``out``; return the metadata
    (``meta.json`` is :func:`~lightning_gpuopt.data.cache.write_meta`'s, last).

    Args:
        out: The cache folder; created once the tokenizer is trained (after a first read of the text).
        tokenizer: A tokenizer to use, or ``None`` to train a byte-level BPE of ``vocab_size`` tokens.
        val_fraction: Fraction of the tokens held out for validation, and again for test, where the corpus has no
            splits of its own.
    """
    # Before any work or any file: an empty corpus (reads up to the first piece with text).
    if not any(piece.strip() for piece in _pieces(corpus, "train")):
        raise _empty(corpus)
    if tokenizer is None:
        log(f"Training a {vocab_size}-token byte-level BPE on {corpus.description} ...")
        tokenizer = train_bpe_tokenizer(_pieces(corpus, "train"), vocab_size)
    out.mkdir(parents=True, exist_ok=True)  # only once the corpus has been read in full
    tmp = out / f"{TOKENIZER}.tmp{os.getpid()}"
    tokenizer.save(str(tmp))
    os.replace(tmp, out / TOKENIZER)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    eot = end_of_text_id(tokenizer)

    log(f"Tokenising {corpus.description} into {out} ...")
    splits: dict[str, dict[str, Any]] = {}
    train_docs = 0
    for split, documents in corpus.splits.items():
        stats = {"documents": 0}
        if corpus.answers:  # one byte per token beside the ids: which tokens are answers
            answers = out / f"{split}.answers.bin"
            tmp = answers.with_name(f"{answers.name}.tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                n = write_tokens(out / f"{split}.bin", encode_documents(tokenizer, documents(), eot, stats, f), dtype)
            os.replace(tmp, answers)
            splits[split] = {"file": f"{split}.bin", "answers": answers.name, "start": 0, "end": n}
        else:
            n = write_tokens(out / f"{split}.bin", encode_documents(tokenizer, documents(), eot, stats), dtype)
            splits[split] = {"file": f"{split}.bin", "start": 0, "end": n}
        if split == "train":
            train_docs = stats["documents"]
    total = splits["train"]["end"]
    if total <= train_docs:  # nothing but the document separators
        raise _empty(corpus)
    # Sources without their own val/test split: hold out the tail of the token stream, test last.
    n_hold = int(total * val_fraction)
    end = total
    for split in ("test", "val"):
        if split not in splits:
            splits[split] = {**splits["train"], "start": end - n_hold, "end": end}
            end -= n_hold
    splits["train"]["end"] = end
    return {"vocab_size": vocab, "dtype": dtype.name, "eot_token_id": eot, "splits": splits}


def prepare_token_cache(
    corpus: Corpus,
    out: Path,
    expected: dict[str, Any],
    tokenizer: Optional[Tokenizer],
    vocab_size: int,
    val_fraction: float,
    source: str = "",
    info: Any = print,
    warn: Any = print,
) -> None:
    """Tokenise ``corpus`` into the cache folder ``out`` unless it holds a complete, current copy: one process prepares
    under a file lock beside ``out``, the others wait; a stale or damaged folder is rebuilt with a warning.

    Args:
        expected: What ``meta.json`` must record for the copy to be current (format, input fingerprint); also
            written into it.
        source: The source as the user gave it, recorded in ``meta.json``.
    """
    if check_cache(out, expected)[0] is not None:
        return  # complete and current: also fine in a read-only cache folder
    check_writable(out.parent)  # before any work
    with cache_lock(out.parent / f"{out.name}.lock"):
        meta, reason = check_cache(out, expected)
        if meta is not None:
            return  # another process prepared it while this one waited
        if out.exists():
            warn(f"Rebuilding the token cache {out}: {reason}.")
            remove_leftovers(out)
            (out / "meta.json").unlink(missing_ok=True)  # a kill from here on leaves an incomplete folder
        try:
            meta = prepare_tokens(corpus, out, tokenizer, vocab_size, val_fraction, info)
            write_meta(out, {**expected, "source": source, **meta})
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise _disk_full(out, err) from err


def _disk_full(out: Path, err: OSError) -> OSError:
    """The error for a token cache that ran out of space (the incomplete folder removed), naming what is free."""
    shutil.rmtree(out, ignore_errors=True)  # no meta.json: nothing could use it, and it holds the space
    try:
        left = shutil.disk_usage(out.parent).free
        free = f" ({left / GB:.2f} GB free there now)" if left >= GB else f" ({left / 1e6:.2f} MB free there now)"
    except OSError:
        free = ""
    return OSError(err.errno, (
        f"{err.strerror or 'No space left on device'} while writing the token cache {out}{free}; the partial folder "
        f"was removed. Free space there, or put the cache on a larger disk: {option('TextDataModule', 'cache_dir')} or "
        "the GPUOPT_CACHE_DIR environment variable."))
