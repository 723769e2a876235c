"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``): train on the corpus, or load a file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lightning_gpuopt.option_checks import check_int

__all__ = [
    "END_OF_TEXT_TOKENS",
    "EOT_TOKEN",
    "MIN_VOCAB_SIZE",
    "carried_tokenizer",
    "check_same_tokenizer",
    "end_of_text_id",
    "end_of_text_token",
    "load_tokenizer",
    "plain_text",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
]

EOT_TOKEN = "<|endoftext|>"  # separates documents in the token stream, as in GPT-2 (a BPE trained here has it)
# The end-of-text tokens a loaded tokenizer may use, the first it has taken: GPT-2's and Qwen2's, Llama 3's
# ("<|end_of_text|>"), Llama 2's. The Hugging Face export (model/hf.py) keeps the same tuple.
END_OF_TEXT_TOKENS = (EOT_TOKEN, "<|end_of_text|>", "</s>")
MIN_VOCAB_SIZE = 257  # the 256 byte tokens and <|endoftext|>


def plain_text(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` (returned), set to encode a literal ``<|endoftext|>`` (or any special token) in a text as its
    characters: only the code that joins documents writes the separator's id (``data/prepare.py``).

    ``tokenizers`` does not save this setting, so every tokenizer the package builds or reads passes through here."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE tokenizer on ``texts`` (every byte in the alphabet: no unknown tokens).

    ``vocab_size`` counts the 256 byte tokens and ``<|endoftext|>``; a small corpus may stop merging before it
    (``get_vocab_size()`` is the real size).

    Example::

        tok = train_bpe_tokenizer(["some text", "more text"], vocab_size=512)
        tok.decode(tok.encode("some text").ids) == "some text"
    """
    check_int("TextDataModule", "vocab_size", vocab_size, minimum=MIN_VOCAB_SIZE, hint=" (256 bytes + <|endoftext|>)")
    tokenizer = plain_text(Tokenizer(models.BPE()))  # merges learnt from a quoted <|endoftext|> as from any text
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def end_of_text_token(tokenizer: Tokenizer) -> Optional[str]:
    """The token that ends a text in ``tokenizer``: the first of :data:`END_OF_TEXT_TOKENS` it has (``None``: none)."""
    return next((t for t in END_OF_TEXT_TOKENS if tokenizer.token_to_id(t) is not None), None)


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The id of ``tokenizer``'s end-of-text token (:func:`end_of_text_token`); a ``ValueError`` without one."""
    token = end_of_text_token(tokenizer)
    if token is None:
        raise ValueError(f"The tokenizer has none of the end-of-text tokens {list(END_OF_TEXT_TOKENS)}, which separate "
                         "documents: add one as a special token.")
    return tokenizer.token_to_id(token)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (``Tokenizer.save``'s, e.g. a Hugging Face model's) that defines an end-of-text token
    (one of :data:`END_OF_TEXT_TOKENS`: ``<|endoftext|>``, Llama 3's ``<|end_of_text|>``, ``</s>``)."""
    path = Path(path).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        hint = f" (it holds one: {str(inside)!r})" if inside.is_file() else ""
        raise ValueError(f"data.tokenizer={str(path)!r} is a folder: give the path of a tokenizer.json file{hint}.")
    if not path.is_file():
        raise ValueError(f"data.tokenizer={str(path)!r} does not exist: give the path of a tokenizer.json file.")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"data.tokenizer={str(path)!r} is not a valid tokenizer.json: {err}") from err
    if end_of_text_token(tokenizer) is None:
        raise ValueError(
            f"data.tokenizer={str(path)!r} has none of the end-of-text tokens {list(END_OF_TEXT_TOKENS)}, which "
            "separate documents: add one as a special token, or leave data.tokenizer unset to train one on the corpus."
        )
    return plain_text(tokenizer)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A SHA-256 of the tokenizer's vocabulary and merges: equal exactly when every id means the same text."""
    model = json.loads(tokenizer.to_str()).get("model", {})
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    content = json.dumps([model.get("vocab"), model.get("merges"), vocab], sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()


def carried_tokenizer(saved: dict) -> Optional[Tokenizer]:
    """The tokenizer a checkpoint's data state carries (``tokenizer_json``), or ``None`` for one without it."""
    text = saved.get("tokenizer_json")
    if not text:
        return None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
        raise ValueError(f"The checkpoint's tokenizer (tokenizer_json) is not a valid tokenizer: {err}. Use an "
                         "earlier checkpoint of the run.") from err
    if saved.get("tokenizer_sha256") and tokenizer_fingerprint(tokenizer) != saved["tokenizer_sha256"]:
        raise ValueError("The checkpoint's tokenizer (tokenizer_json) does not match its tokenizer_sha256: the "
                         "checkpoint is damaged. Use an earlier checkpoint of the run.")
    return plain_text(tokenizer)


def check_same_tokenizer(saved: dict, tokenizer: Tokenizer, where: str, fix: Optional[str] = None) -> None:
    """Raise a ``ValueError`` if ``tokenizer`` is not the one a checkpoint's data state records (no check without
    its ``tokenizer_sha256``); ``where`` (what the data is now) and ``fix`` are named in the message."""
    expected = saved.get("tokenizer_sha256")
    if not expected:
        return
    actual = tokenizer_fingerprint(tokenizer)
    if actual != expected:
        file = saved.get("tokenizer_file", "<the training run's tokenizer.json>")
        fix = fix or f"Use the training run's data.source and data.vocab_size, or set data.tokenizer {file}"
        raise ValueError(
            f"The data's tokenizer ({where}, sha256 {actual[:12]}) is not the one the checkpoint was trained with "
            f"(sha256 {expected[:12]}): its token ids would mean other text to the model. {fix}."
        )
