"""A toy checker for the rejection-sampling recipe (docs/generation.md): does the completed line read as Python?

``gpuopt predict --generate.scorer rft_checker:score`` calls ``score(record, completion)`` for every completion
(``PYTHONPATH=examples`` makes this file importable): ``record`` is the prompt's line of
``examples/rft_prompts.jsonl`` (its ``"prompt"`` and, for some, a reference ``"answer"``), ``completion`` the
generated text, cut at the first stop string. A real checker runs the tests of a coding task, or compares a
math answer with the reference; this one only parses a line.
"""

from __future__ import annotations

import ast


def score(record: dict, completion: str) -> int:
    """1 when the completion adds something (not only spaces) and the prompt and it make one line of valid Python (a
    block opener such as ``def f(x):`` gets a ``pass`` body) that holds the record's ``"answer"`` if it has one, else 0
    (a prompt such as ``return`` is valid alone: an empty completion would teach the model to stop at once)."""
    line = (record["prompt"] + completion).strip()
    if not completion.strip():
        return 0
    if line.endswith(":"):
        line += " pass"
    try:
        ast.parse(line)
    except SyntaxError:
        return 0
    answer = record.get("answer")
    return int(answer is None or answer in completion)
