"""Text in bounded pieces: files read in blocks and cut where byte-level BPE sees no difference.

Design note: a document (a file, or a row of a Hugging Face dataset) may be gigabytes long, and
the ``tokenizers`` library holds a whole input sequence, with per-character offsets, while it
pre-tokenises it (~200 bytes of memory per byte of text). So documents are fed to it in pieces
of about ``_PIECE_CHARS`` characters. A piece ends only where GPT-2's pre-tokenizer regex (used
by ``pre_tokenizers.ByteLevel``)::

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

splits the whole text too, and splits both sides the same way:

- before a space followed by a non-space (`` word`` starts a new pre-token; a whitespace run
  before it ends there in both cases), or
- before a non-space that follows a single newline after a non-space (``\\n`` is a pre-token of
  its own either way).

Since BPE merges never cross pre-tokens, the pieces give the same tokens, and the same BPE
training counts, as the uncut document. Python's ``\\S`` is narrower than the Unicode
``White_Space`` complement the Rust regex uses, so the test only ever errs towards not cutting.
Text with no such boundary in ``_MAX_PIECE_CHARS`` characters (e.g. one enormous whitespace-free
token) is cut there anyway, with a warning that tokens next to that cut may differ.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["cut_pieces", "file_pieces", "text_pieces"]

_PIECE_CHARS = 1 << 16  # ~64 KiB of text per piece: small enough to bound memory, large enough to be fast
_MAX_PIECE_CHARS = 1 << 22  # a piece is cut here even without an exact boundary
_EXACT_CUT = re.compile(r"(?= \S)|(?<=\S\n)(?=\S)")


def cut_pieces(blocks: Iterable[str], target: int = _PIECE_CHARS, limit: int = _MAX_PIECE_CHARS) -> Iterator[str]:
    """Join consecutive text ``blocks`` and cut them again into pieces of about ``target`` characters.

    Each cut is at the first exact boundary (see the module's design note) at or after ``target``
    characters; the pieces joined give back the text exactly. Memory is bounded by ``limit``.

    Example::

        list(cut_pieces(["one two ", "three four"], target=5))  # ['one two', ' three', ' four']

    Args:
        blocks: Consecutive parts of one document, of any sizes.
        target: Characters per piece to aim for.
        limit: Characters after which a piece is cut even at an inexact boundary (with a warning).
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
    """Pieces of one in-memory document (see :func:`cut_pieces`).

    Example::

        "".join(text_pieces(long_text)) == long_text

    Args:
        text: The document.
        target: Characters per piece to aim for.
    """
    return cut_pieces((text[i : i + target] for i in range(0, len(text), target)), target)


def file_pieces(path: Path, target: int = _PIECE_CHARS) -> Iterator[str]:
    """Pieces of a UTF-8 text file, read ``target`` characters at a time (see :func:`cut_pieces`).

    Line endings are read as Python's text mode reads them (``\\r\\n`` becomes ``\\n``).

    Example::

        sum(len(p) for p in file_pieces(Path("wiki.train.raw")))  # characters in the file

    Args:
        path: The file.
        target: Characters per piece to aim for.

    Raises:
        ValueError: The file cannot be opened or is not UTF-8; the message names the file and the fix.
    """

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
