"""Prompts file -> generation requests, and the scorer that judges completions (``gpuopt predict
--generate.prompts_file``).

Every sample of every prompt is a :class:`~lightning_gpuopt.generation.batched.Request` of its own, whatever
its length (continuous batching takes them all); a JSONL record's other fields go to the scorer with each
completion (``docs/generation.md``)."""

from __future__ import annotations

import importlib
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Union

from lightning_gpuopt.generation.batched import Request, fit_to_context
from lightning_gpuopt.option_checks import check_int

__all__ = ["Scorer", "check_scorer", "load_scorer", "plan_requests", "read_prompts", "score_of"]

# scorer(record, completion) -> number: the prompt's record (its "prompt" and other JSONL fields) and the
# completion's text; a bool counts as 0 or 1.
Scorer = Callable[[dict, str], Any]


def read_prompts(path: Union[str, Path]) -> list[dict]:
    """The records of ``path``: a ``.jsonl`` file of objects with a ``"prompt"`` string (other fields kept), else one
    prompt per non-empty line, ``\\n`` in it standing for a newline.

    Example::

        read_prompts("prompts.txt")    # [{"prompt": "def main("}, {"prompt": "class Foo:\\n    def"}]
        read_prompts("qa.jsonl")       # [{"prompt": "2+3=", "answer": "5"}, ...]
    """
    path = Path(path).expanduser()
    option = f"generate.prompts_file={str(path)!r}"
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"{option} {what}: give a text or JSONL file of prompts (one a line).")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{option} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {line} cannot be decoded): save it as "
            f"UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}."
        ) from err
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix.lower() == ".jsonl":
            records.append(_json_record(path, number, line))
        else:
            records.append({"prompt": line.replace("\\n", "\n")})
    if not records:
        raise ValueError(f"{option} holds no prompt: write one prompt per line.")
    return records


def _json_record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno}): fix that line; each line of a "
            '.jsonl file is one JSON object such as {"prompt": "2+3=", "answer": "5"}.'
        ) from err
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f"{path}, line {number}: each JSONL line needs a \"prompt\" string, got {line[:80]!r}.")
    return record


def plan_requests(
    records: Sequence[dict], encode: Callable[[str], list[int]], samples_per_prompt: int, max_new_tokens: int,
    block_size: int,
) -> tuple[list[Request], int]:
    """One request per sample of each prompt, keyed ``(prompt index, sample index)``, and how many prompts were cut
    to their last tokens to leave ``max_new_tokens`` room in the context."""
    check_int("generate", "samples_per_prompt", samples_per_prompt, minimum=1)
    requests, cut = [], 0
    for p, record in enumerate(records):
        ids = encode(record["prompt"])
        if not ids:
            raise ValueError(f"Prompt {p + 1} ({record['prompt']!r}) has no tokens: give each prompt some text.")
        keep = fit_to_context(len(ids), max_new_tokens, block_size)
        cut += keep < len(ids)
        requests.extend(Request(ids[-keep:], max_new_tokens, key=(p, s)) for s in range(samples_per_prompt))
    return requests, cut


def load_scorer(spec: str) -> Scorer:
    """The function ``spec`` names, as ``module:function`` (the module importable from ``sys.path``)."""
    option = f"generate.scorer={spec!r}"
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"{option} must name a function as module:function, e.g. my_checks:score.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{option}: cannot import {module_name} ({err}): put {module_name.replace('.', '/')}.py where Python finds "
            "it (e.g. PYTHONPATH=. gpuopt predict ...) or fix the name."
        ) from err
    scorer = getattr(module, name, None)
    if not callable(scorer):
        functions = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:8]
        raise ValueError(f"{option}: {module_name} has no function {name!r} (it has {functions}): name one of them.")
    return scorer


def score_of(scorer: Scorer, spec: str, record: dict, completion: str) -> float:
    """``scorer(record, completion)`` as a finite float; a clear error when it raises or returns something else."""
    try:
        value = scorer(record, completion)
    except Exception as err:
        raise ValueError(
            f"generate.scorer={spec!r} raised {type(err).__name__}: {err} for the prompt {record['prompt'][:60]!r} and "
            f"the completion {completion[:60]!r}: make it return a number (0 for a completion it rejects) for any "
            "completion."
        ) from err
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(
            f"generate.scorer={spec!r} returned {value!r} ({type(value).__name__}) for the prompt "
            f"{record['prompt'][:60]!r}: "
            "it must return a finite number or a bool."
        )
    return float(value)


def check_scorer(scorer: Scorer, spec: str, record: dict) -> None:
    """Call ``scorer`` once with ``record`` and an empty completion, before any generation: a scorer that raises or
    returns no number fails now, not after the completions were generated."""
    score_of(scorer, spec, record, "")
