"""``gpuopt predict --generate.prompts_file``: its options, their checks before anything is built, and the run.

The run is one ``GenerationJob`` through ``trainer.predict`` (so the Trainer's device, precision and checkpoint
loading apply), each finished row written at once by a ``CompletionWriter``, so a stop keeps what finished."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_gpuopt.cli.completions import CompletionWriter, kept_path
from lightning_gpuopt.cli.config_checks import check_output_file
from lightning_gpuopt.cli.generation_progress import GenerationProgress
from lightning_gpuopt.cli.prompts import Scorer, check_scorer, load_scorer, plan_requests, read_prompts
from lightning_gpuopt.generation.batched import Finished, GenerationJob
from lightning_gpuopt.run.lock import hold_output

__all__ = [
    "add_generate_arguments",
    "check_generate_options",
    "completions_path",
    "generate_from_file",
    "generate_options_given",
]


_DEFAULTS = {"prompts_file": None, "batch_size": None, "samples_per_prompt": 1, "stop": [], "output": None,
             "overwrite": False, "scorer": None, "keep_min_score": 1.0, "kept_output": None}


def generate_options_given(generate: Any) -> list[str]:
    """The ``generate.*`` options (but ``prompts_file``) set to other than their defaults."""
    return [name for name, default in _DEFAULTS.items()
            if name != "prompts_file" and (generate.get(name, default) if generate else default) != default]


def add_generate_arguments(parser: Any) -> None:
    """The ``--generate.*`` options of ``gpuopt predict``."""

    def add(flag: str, **kwargs: Any) -> None:
        parser.add_argument(flag, **kwargs, default=_DEFAULTS[flag.removeprefix("--generate.")])

    add("--generate.prompts_file", type=Optional[str],
        help="predict: a text file (one prompt per line) or JSONL (a \"prompt\" per line; other fields go to the "
             "scorer).")
    add("--generate.batch_size", type=Optional[int],
        help="predict: rows generated at a time (prompts of any lengths share a batch); default: the largest the "
             "device's memory allows (64 rows on a CPU).")
    add("--generate.samples_per_prompt", type=int, help="predict: completions per prompt of the prompts file.")
    add("--generate.stop", type=list[str],
        help="predict: text that ends a completion, besides end-of-text (e.g. '[\"\\n\\n\"]').")
    add("--generate.output", type=Optional[str],
        help="predict: the JSONL file written; default <trainer.default_root_dir>/generations.jsonl.")
    add("--generate.overwrite", type=bool,
        help="predict: replace generate.output (and kept_output) if it exists (otherwise an existing file stops the "
             "run).")
    add("--generate.scorer", type=Optional[str],
        help="predict: module:function called as f(record, completion) -> number for each completion; the score is "
             "written, and completions scoring >= keep_min_score go to kept_output.")
    add("--generate.keep_min_score", type=float,
        help="predict: the least score a kept completion has (a scorer returning True/False keeps True).")
    add("--generate.kept_output", type=Optional[str],
        help="predict: the JSONL of kept completions (prompt, completion, score: a fine-tuning corpus for "
             "TextDataModule); default <output stem>.kept.jsonl beside generate.output.")


def completions_path(config: Any) -> Path:
    """The file ``gpuopt predict --generate.prompts_file`` writes: ``generate.output``, else ``generations.jsonl``
    in ``trainer.default_root_dir`` (the working folder when unset, as Lightning's)."""
    output = (config.get("generate") or {}).get("output")
    if output:
        return Path(output).expanduser()
    return Path((config.get("trainer") or {}).get("default_root_dir") or os.getcwd()) / "generations.jsonl"


def check_generate_options(config: Any, generate: Any, error: Callable[[str], NoReturn]) -> Optional[Scorer]:
    """Check everything about ``generate.*`` that can be checked before the model is built (sizes, stop strings, the
    prompts file, the output files, the scorer called once), reporting through the parser's ``error``; return the
    scorer."""
    for name in ("batch_size", "samples_per_prompt"):
        if generate.get(name) is not None and generate.get(name) < 1:
            error(f"generate.{name} must be >= 1, got {generate.get(name)}.")
    for i, stop in enumerate(generate.get("stop") or []):
        if not stop:
            error(f"generate.stop[{i}] is empty, so it has no tokens and would never match: give each stop sequence "
                  "some text (e.g. '[\"\\n\\n\"]'), or leave it out.")
    records = read_prompts(generate["prompts_file"])
    output = completions_path(config)
    overwrite = generate.get("overwrite", False)
    _hold("generate.output", output, overwrite)
    if not generate.get("scorer"):
        if generate.get("kept_output"):
            error("generate.kept_output is written with a scorer only: add --generate.scorer module:function.")
        return None
    kept = Path(generate.get("kept_output") or kept_path(output)).expanduser()
    if os.path.abspath(kept) == os.path.abspath(output):
        error(f"generate.kept_output and generate.output are the same file ({output}): every completion and the kept "
              "ones go to two files, so name another --generate.kept_output (or leave it out: "
              f"{kept_path(output).name}).")
    _hold("generate.kept_output", kept, overwrite)
    scorer = load_scorer(generate["scorer"])
    check_scorer(scorer, generate["scorer"], records[0])
    return scorer


def _hold(option: str, output: Path, overwrite: bool) -> None:
    """Hold ``output`` for this run (one writer: a live ``gpuopt predict`` writing it is refused, naming its pid,
    whatever ``overwrite`` says), then check it as a file to write and its ``.partial``; held until the command ends."""
    check_output_file(option, output)  # a folder, or a folder this process cannot write: before the lock file
    lock = hold_output(output, "gpuopt predict", f"--{option}", lost="lines", overwrite=True)
    check_output_file(option, output, overwrite, "generate.overwrite")
    _check_no_partial(output, overwrite, lock.previous if lock is not None else "")


def _check_no_partial(output: Path, overwrite: bool, previous: str = "") -> None:
    """A ``.partial`` beside ``output``, with its lock held by this process, was left by a run that ended before it
    could sort its completions in (``kill -9``, an out-of-memory kill; ``previous``: what its lock file said): an
    empty one is removed, one with completions refused unless ``overwrite``, so a new run does not start by emptying
    it."""
    partial = output.with_name(output.name + ".partial")
    if not partial.is_file():
        return
    lines = partial.read_bytes().count(b"\n")
    if lines == 0 or overwrite:
        partial.unlink()  # nothing finished in it, or replacing it was asked: its writer is gone (the lock is ours)
        return
    who = f"{previous}, which" if previous else "a run that"
    kept = output.with_name(f"{output.stem}.killed{output.suffix}")  # beside it: a bare name would land in the cwd
    raise ValueError(
        f"{partial} holds {lines} completions of {who} ended before it wrote {output.name} (killed: its lock is free), "
        f"and this run would start by emptying it: keep them (mv {partial} {kept}; a "
        "JSONL file, one completion a line, unsorted) or give --generate.overwrite true to replace it."
    )


def generate_from_file(
    trainer: Trainer, model: LightningModule, data: LightningDataModule, options: Any, output: Path,
    scorer: Optional[Scorer], **predict_kwargs: Any,
) -> None:
    """Generate every row of the prompts file (``options``: the ``generate`` group) through ``trainer.predict`` on one
    device, each completion written to ``output`` as it finishes; ``predict_kwargs`` go to ``trainer.predict``."""
    if trainer.world_size > 1:
        raise ValueError("generate.prompts_file generates on one device (each process would repeat every prompt): set "
                         "--trainer.devices 1.")
    records = read_prompts(options["prompts_file"])
    stops = list(options.get("stop") or [])
    stop_ids = [data.encode(s) for s in stops]
    for text, ids in zip(stops, stop_ids):
        if not ids:
            raise ValueError(f"generate.stop {text!r} has no tokens: give each stop sequence some text, or leave it "
                             "out.")
    new, block = model.hparams.max_new_tokens, model.config.block_size
    requests, cut = plan_requests(records, data.encode, options.get("samples_per_prompt", 1), new, block)
    if cut:
        rank_zero_info(f"gpuopt predict: {cut} of {len(records)} prompts are longer than the {block - new} tokens that "
                       f"block_size={block} leaves beside model.max_new_tokens={new}: they are generated from their "
                       "last tokens.")
    writer = CompletionWriter(
        records,
        data.decode,
        output,
        options.get("kept_output"),
        scorer,
        options.get("scorer") or "",
        options.get("keep_min_score", 1.0),
        stops,
    )
    bar = GenerationProgress(len(requests))

    def finished(done: Finished) -> None:
        writer.add(done)
        bar.finished()

    def step(tokens: int) -> None:
        writer.check()  # a scorer that failed stops the run once the rows finished with that one are written
        bar.step(tokens)

    job = GenerationJob(requests, finished, options.get("batch_size"), data.eot_id, stop_ids, on_step=step,
                        stop_strings=stops, decode=data.decode)
    if trainer.progress_bar_callback is not None:
        trainer.progress_bar_callback.disable()  # it counts batches, and the job is one
    try:
        with writer:
            trainer.predict(model, dataloaders=DataLoader([job], batch_size=None, collate_fn=_as_is), **predict_kwargs)
            writer.check()
    finally:
        bar.close()
        stopped = "" if writer.done == len(requests) else "stopped early: "
        rank_zero_info(f"gpuopt predict: {stopped}{writer.summary(len(requests), bar.seconds)}")


def _as_is(job: GenerationJob) -> GenerationJob:
    return job
