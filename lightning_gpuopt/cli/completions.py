"""Completions written as they finish: a JSONL of every completion and, with a scorer, a JSONL of the accepted ones,
which ``TextDataModule`` reads as a fine-tuning corpus (``gpuopt predict --generate.prompts_file``).

Each finished row is decoded, cut at its first stop string (one the model produced inside a longer token, too),
scored and appended to ``<output>.partial`` with a flush, so a stop loses no finished completion; at the end the
lines are sorted into prompt order and written whole (``docs/generation.md``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

from lightning_gpuopt.cli.prompts import Scorer, score_of
from lightning_gpuopt.generation.batched import Finished

__all__ = ["CompletionWriter", "defer_stop", "kept_path", "write_jsonl"]

_running: list["CompletionWriter"] = []  # the writer of the generation running now


def defer_stop(code: int) -> bool:
    """Hand a stop (the exit status of a SIGTERM) to the generation running now, which ends after the rows that
    finished in its current step are written and scored (:meth:`CompletionWriter.check`); ``False`` when none runs."""
    if not _running:
        return False
    _running[-1].stop_code = code
    return True

_REASONS = {"eot": "at end-of-text", "stop": "at a stop sequence", "length": "at max_new_tokens"}


def write_jsonl(records: Sequence[dict], path: Union[str, Path]) -> Path:
    """Write ``records`` as JSONL to ``path`` (through a temporary file and a rename), return the path."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"generate.output={str(path)!r} is a folder: give a file path, e.g. "
                         f"{str(path / 'generations.jsonl')!r}.")
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


def kept_path(output: Union[str, Path]) -> Path:
    """The accepted completions' file beside ``output``: ``generations.jsonl`` -> ``generations.kept.jsonl``."""
    output = Path(output)
    return output.with_name(f"{output.stem}.kept{output.suffix or '.jsonl'}")


class CompletionWriter:
    """Decodes, scores and writes each finished row as it comes.

    Example::

        writer = CompletionWriter(records, data.decode, "gen.jsonl", scorer=score, scorer_spec="checks:score")
        with writer:
            for done in generate_batched(...):
                writer.add(done)
        print(writer.summary())

    Args:
        records: The prompts' records, by prompt index (the keys of the finished rows are ``(prompt, sample)``).
        output: The JSONL of every completion.
        kept_output: The JSONL of the accepted ones, with a ``scorer`` only (``None``: :func:`kept_path`).
        scorer: ``scorer(record, completion) -> number`` (``None``: nothing is scored or kept).
        keep_min_score: The least score a kept completion has.
        stop_strings: Text that ends a completion (cut at its first occurrence).
    """

    def __init__(
        self, records: Sequence[dict], decode: Callable[[list[int]], str], output: Union[str, Path],
        kept_output: Union[str, Path, None] = None, scorer: Optional[Scorer] = None, scorer_spec: str = "",
        keep_min_score: float = 1.0, stop_strings: Sequence[str] = (),
    ) -> None:
        self.records = list(records)
        self.decode = decode
        self.output = Path(output).expanduser()
        self.kept_output = Path(kept_output).expanduser() if kept_output else kept_path(self.output)
        self.scorer, self.scorer_spec, self.keep_min_score = scorer, scorer_spec, keep_min_score
        self.failure: Optional[ValueError] = None  # the scorer's first failure, raised by :meth:`check`
        self.stop_code: Optional[int] = None  # a stop asked for (:func:`defer_stop`), carried out by :meth:`check`
        self.stop_strings = [s for s in stop_strings if s]
        self.done = 0
        self.tokens = 0
        self.kept = 0
        self.reasons: Counter = Counter()
        self._files: list[IO[str]] = []

    def partial(self, path: Path) -> Path:
        return path.with_name(path.name + ".partial")

    def __enter__(self) -> "CompletionWriter":
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._files = [open(self.partial(self.output), "w", encoding="utf-8")]
        if self.scorer is not None:
            self.kept_output.parent.mkdir(parents=True, exist_ok=True)
            self._files.append(open(self.partial(self.kept_output), "w", encoding="utf-8"))
        _running.append(self)
        return self

    def add(self, finished: Finished) -> None:
        """Decode, cut, score and append one finished row."""
        p, s = finished.key
        record = self.records[p]
        text = self.decode(finished.tokens)
        for stop in self.stop_strings:
            if stop in text:
                text = text[: text.index(stop)]
        line: dict[str, Any] = {**record, "index": p, "sample": s, "completion": text, "tokens": finished.tokens,
                                "finish": finished.reason}
        try:
            if self.scorer is not None:
                line["score"] = score_of(self.scorer, self.scorer_spec, record, text)
        # written without a score; :meth:`check` raises it once this step's rows are written
        except ValueError as error:
            self.failure = self.failure or error
            self._count(finished, line)
            return
        self._count(finished, line)
        if self.scorer is not None and line["score"] >= self.keep_min_score:
            self.kept += 1
            self._write(1, {k: v for k, v in line.items() if k not in ("tokens", "finish")})

    def check(self) -> None:
        """Raise the scorer's first failure, or end the run a stop asked for: called between decode steps and at the
        end, so every row that finished in the step where the scorer failed (or the SIGTERM came) is written first."""
        if self.failure is not None:
            raise self.failure
        if self.stop_code is not None:
            raise SystemExit(self.stop_code)

    def _count(self, finished: Finished, line: dict) -> None:
        self._write(0, line)
        self.done += 1
        self.tokens += len(finished.tokens)
        self.reasons[finished.reason] += 1

    def _write(self, which: int, line: dict) -> None:
        f = self._files[which]
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()

    def __exit__(self, *exc: Any) -> None:
        """Sort the lines into prompt order and put them in place whole; remove the partial files."""
        if self in _running:
            _running.remove(self)
        for f in self._files:
            f.close()
        pairs = [(self.output, self.partial(self.output))]
        if self.scorer is not None:
            pairs.append((self.kept_output, self.partial(self.kept_output)))
        for final, partial in pairs:
            if self.done == 0 and exc[0] is not None:  # stopped before any row finished: nothing to keep
                partial.unlink()
                continue
            lines = [json.loads(line) for line in partial.read_text(encoding="utf-8").splitlines()]
            lines.sort(key=lambda r: (r["index"], r["sample"]))
            write_jsonl(lines, final)
            partial.unlink()

    def summary(self, total: int, seconds: float) -> str:
        """One line: completions, tokens, how they ended, the rate, where they went, what was kept."""
        ends = ", ".join(f"{n} {_REASONS[r]}" for r, n in sorted(self.reasons.items()))
        rate = f"{self.tokens / seconds:,.0f} tokens/s" if seconds > 0 else "no time"
        head = f"{self.done} completions" if self.done == total else f"{self.done} of {total} completions"
        where = f"written to {self.output}" if self.done else "nothing written"
        line = f"{head} ({self.tokens:,} tokens{': ' + ends if ends else ''}) in {seconds:.1f} s, {rate}; {where}"
        if self.scorer is not None and self.done:
            line += f"; kept {self.kept} with score >= {self.keep_min_score:g} in {self.kept_output}"
        return line
