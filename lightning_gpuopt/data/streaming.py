"""Text in bounded pieces: files read in blocks and cut where byte-level BPE sees no difference.

``tokenizers`` holds a whole input sequence with per-character offsets while it pre-tokenises it (~200 bytes of
memory per byte of text), so documents go to it in pieces of about ``_PIECE_CHARS`` characters, cut only where
GPT-2's pre-tokenizer splits the whole text too: the same tokens as the uncut document (``docs/data.md``)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["cut_pieces", "file_pieces", "text_pieces"]

_PIECE_CHARS = 1 << 16  # ~64 KiB of text per piece: small enough to bound memory, large enough to be fast
_MAX_PIECE_CHARS = 1 << 22  # a piece is cut here even without an exact boundary
# Before a space followed by a non-space, or before a non-space after a single newline after a non-space: GPT-2's
# pre-tokenizer splits there in the whole text too, both sides alike. Python's \S is narrower than the Rust regex's
# Unicode White_Space complement, so this only ever errs towards not cutting.
_EXACT_CUT = re.compile(r"(?= \S)|(?<=\S\n)(?=\S)")


def cut_pieces(blocks: Iterable[str], target: int = _PIECE_CHARS, limit: int = _MAX_PIECE_CHARS) -> Iterator[str]:
    """Join consecutive text ``blocks`` of one document and cut them again at the first exact boundary at or after
    ``target`` characters; the pieces joined give back the text.

    Example::

        list(cut_pieces(["one two ", "three four"], target=5))  # ['one two', ' three', ' four']

    Args:
        limit: Characters after which a piece is cut even at an inexact boundary (with a warning): the memory bound.
    """
    buffer = ""
    warned = False
    for block in blocks:
        buffer += block
        while len(buffer) > target:
            match = _EXACT_CUT.search(buffer, target)
            if match is None:
                if len(buffer) < limit:
                    break  # read on: the boundary may be in the next block
                cut = limit
                if not warned:
                    warnings.warn(
                        f"A document has no space or line break in {limit:,} characters: it is cut there for "
                        "tokenisation, and the tokens next to the cut may differ from those of the uncut text.",
                        stacklevel=2,
                    )
                    warned = True
            else:
                cut = match.start()
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def text_pieces(text: str, target: int = _PIECE_CHARS) -> Iterator[str]:
    """Pieces of one in-memory document (:func:`cut_pieces`): ``"".join(text_pieces(text)) == text``."""
    return cut_pieces((text[i : i + target] for i in range(0, len(text), target)), target)


def file_pieces(path: Path, target: int = _PIECE_CHARS) -> Iterator[str]:
    """Pieces of a UTF-8 text file, read ``target`` characters at a time in text mode (``\\r\\n`` becomes ``\\n``)."""

    def blocks() -> Iterator[str]:
        try:
            with open(path, encoding="utf-8") as f:
                while block := f.read(target):
                    yield block
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(
                f"Cannot read training text from {path}: {err}. Fix its permissions or encoding (UTF-8 is "
                "expected), or leave it out of data.source."
            ) from err

    return cut_pieces(blocks(), target)
