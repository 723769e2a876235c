"""Prompts file -> batches of equal-length prompts -> JSONL completions (``gpuopt predict --generate.prompts_file``).

Design note: ``GPT.generate`` continues a (B, T) batch of prompts that all have T tokens (no
padding, so no attention mask is needed and every row gets exactly the tokens it would get alone).
Prompts are therefore grouped by token count: all samples of a prompt, and prompts that tokenise
to the same length, share a batch of up to ``batch_size`` rows. The typical data-generation job,
many samples of each prompt, fills whole batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Callable, Union

import torch
from torch import Tensor

__all__ = ["PromptBatches", "read_prompts", "write_completions"]


def read_prompts(path: Union[str, Path]) -> list[str]:
    """The prompts in ``path``: a ``.jsonl`` file with a ``"prompt"`` per line, else one prompt per line.

    In a text file ``\\n`` inside a line stands for a newline. Empty lines are skipped.

    Example::

        read_prompts("prompts.txt")    # ["def main(", "class Foo:\\n    def"]

    Args:
        path: The prompts file.

    Raises:
        ValueError: The file does not exist, holds no prompt, or has a JSONL line without a ``"prompt"`` string.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"generate.prompts_file={str(path)!r} {what}: give a text or JSONL file of prompts (one a line).")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each JSONL line needs a \"prompt\" string, got {line[:80]!r}.")
            prompts.append(record["prompt"])
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"generate.prompts_file={str(path)!r} holds no prompt: write one prompt per line.")
    return prompts


@dataclass
class PromptBatches:
    """Rows of (prompt index, sample index, token ids), grouped into batches of equal-length rows.

    Example::

        batches = PromptBatches.build(["a b", "c"], encode, samples_per_prompt=2, batch_size=8)
        outputs = [model.generate(ids, 16) for ids in batches.tensors()]
        records = batches.completions(outputs, decode)

    Attributes:
        prompts: The prompt texts.
        batches: For each batch, the rows it holds as ``(prompt index, sample index, ids)``.
    """

    prompts: list[str]
    batches: list[list[tuple[int, int, list[int]]]] = field(default_factory=list)

    @classmethod
    def build(
        cls, prompts: Sequence[str], encode: Callable[[str], list[int]], samples_per_prompt: int, batch_size: int
    ) -> "PromptBatches":
        """Tokenise ``prompts`` and group ``samples_per_prompt`` rows of each into batches of at most ``batch_size``."""
        if batch_size < 1 or samples_per_prompt < 1:
            raise ValueError(
                f"generate.batch_size and generate.samples_per_prompt must be >= 1, got {batch_size} and {samples_per_prompt}."
            )
        rows = []
        for p, prompt in enumerate(prompts):
            ids = encode(prompt)
            if not ids:
                raise ValueError(f"Prompt {p + 1} ({prompt!r}) has no tokens: give each prompt some text.")
            rows.extend((p, s, ids) for s in range(samples_per_prompt))
        rows.sort(key=lambda row: len(row[2]))  # stable: a prompt's samples stay together
        batches = []
        for _, same_length in groupby(rows, key=lambda row: len(row[2])):
            group = list(same_length)
            batches.extend(group[i : i + batch_size] for i in range(0, len(group), batch_size))
        return cls(list(prompts), batches)

    def tensors(self) -> list[Tensor]:
        """One (B, T) tensor of token ids per batch."""
        return [torch.tensor([ids for _, _, ids in batch], dtype=torch.long) for batch in self.batches]

    def completions(self, outputs: Sequence[Tensor], decode: Callable[[list[int]], str]) -> list[dict]:
        """``{"prompt", "sample", "completion", "tokens"}`` per row, in prompt order, from each batch's output ids."""
        if len(outputs) != len(self.batches):
            raise ValueError(f"Expected {len(self.batches)} generated batches, got {len(outputs)}.")
        keyed = []
        for batch, out in zip(self.batches, outputs):
            for (p, s, ids), row in zip(batch, out.tolist()):
                new = row[len(ids) :]
                keyed.append(((p, s), {"prompt": self.prompts[p], "sample": s, "completion": decode(new), "tokens": new}))
        keyed.sort(key=lambda item: item[0])
        return [record for _, record in keyed]


def write_completions(records: Sequence[dict], path: Union[str, Path]) -> Path:
    """Write ``records`` as JSONL to ``path`` (through a temporary file and a rename), return the path.

    Example::

        write_completions([{"prompt": "a", "completion": " b", "tokens": [7]}], "out.jsonl")
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"generate.output={str(path)!r} is a folder: give a file path, e.g. {str(path / 'generations.jsonl')!r}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed write or rename: no partial file left beside the output
    return path
