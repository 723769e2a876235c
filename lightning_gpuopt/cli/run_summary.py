"""What ``gpuopt fit`` says about its run: one line on the model before training; at the end, where the checkpoint
and the logs went and the commands that continue and sample."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl

__all__ = ["command_with_checkpoint", "model_line", "where_things_went"]


def command_with_checkpoint(argv: list[str], subcommand: str, ckpt: str, extra: tuple[str, ...] = ()) -> str:
    """``gpuopt <subcommand> <argv without its subcommand and --ckpt_path> --ckpt_path CKPT <extra>``, quoted for a shell.

    Example::

        >>> command_with_checkpoint(["fit", "--config", "q.yaml", "--ckpt_path", "last"], "predict", "c/last.ckpt")
        'gpuopt predict --config q.yaml --ckpt_path c/last.ckpt'

    Args:
        argv: The command line the run was started with (without the program name).
        subcommand: The subcommand of the printed command.
        ckpt: The checkpoint it reads.
        extra: Arguments added at the end.
    """
    replaced = {"--ckpt_path", *(a for a in extra if a.startswith("--"))}  # options the printed command sets itself
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif i == 0 and not arg.startswith("-"):
            continue  # the run's own subcommand
        elif arg in replaced:
            skip = True
        elif arg.split("=", 1)[0] not in replaced:
            kept.append(arg)
    return shlex.join(["gpuopt", subcommand, *kept, "--ckpt_path", ckpt, *extra])


def model_line(model: pl.LightningModule) -> str:
    """One line on the model, said before training (Lightning's summary table is off in the default stack).

    Example::

        model_line(GPTModule(preset="tiny"))  # "GPTModule: 0.2M parameters (2 layers, width 64, 4 heads, ...)"
    """
    params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    shape = ""
    if config is not None and hasattr(config, "n_layer"):
        shape = (f" ({config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, context {config.block_size}, "
                 f"vocabulary {config.vocab_size})")
    return f"{type(model).__name__}: {params / 1e6:.3g}M parameters{shape}"


def _shown(path: str) -> str:
    """A path relative to the working directory when it is below it, else absolute."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(absolute)


def _checkpoint(trainer: pl.Trainer) -> Optional[str]:
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    return path if path and os.path.exists(path) else None


def where_things_went(trainer: pl.Trainer, argv: list[str]) -> list[str]:
    """The lines ``gpuopt fit`` ends with: the checkpoint to resume from, the logs, the commands to continue and to sample.

    Example::

        where_things_went(cli.trainer, ["fit", "--config", "q.yaml"])
        # ["gpuopt fit: finished at step 300.", "  checkpoint: runs/q/checkpoints/last.ckpt", ...]

    Args:
        trainer: The Trainer after ``fit``.
        argv: The command line the run was started with (without the program name).
    """
    max_steps = trainer.max_steps
    lines = [f"gpuopt fit: finished at step {trainer.global_step}."]
    ckpt = _checkpoint(trainer)
    if ckpt is None:
        lines.append("  checkpoint: none written (no ModelCheckpoint, or trainer.enable_checkpointing=false)")
    else:
        lines.append(f"  checkpoint: {_shown(ckpt)}")
    if trainer.logger is not None and trainer.log_dir is not None:
        lines.append(f"  logs:       {_shown(trainer.log_dir)}")
    if ckpt is not None:
        shown = _shown(ckpt)
        if max_steps is not None and max_steps > 0 and trainer.global_step >= max_steps:
            further = 2 * max_steps
            lines.append(f"  train on to step {further:,}: "
                         + command_with_checkpoint(argv, "fit", shown, ("--trainer.max_steps", str(further))))
        else:
            lines.append(f"  continue:   {command_with_checkpoint(argv, 'fit', shown)}")
        lines.append(f"  sample:     {command_with_checkpoint(argv, 'predict', shown)}")
    return lines
