"""What ``gpuopt fit`` says about its run: one line on the model before training; at the end, where the checkpoint
and the logs went and the commands that continue and sample."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_gpuopt.model import GPT, GPTConfig

__all__ = [
    "command_line",
    "command_with_checkpoint",
    "count_text",
    "has_predict_data",
    "model_line",
    "where_things_went",
]


def command_with_checkpoint(
    argv: list[str], subcommand: str, ckpt: str, extra: tuple[str, ...] = (), env: Optional[Mapping[str, str]] = None
) -> str:
    """``[ENV=...] gpuopt <subcommand> <argv without its subcommand and --ckpt_path> --ckpt_path CKPT <extra>``,
    quoted for a shell.

    Example::

        >>> command_with_checkpoint(["fit", "--config", "q.yaml", "--ckpt_path", "last"], "predict", "c/last.ckpt")
        'gpuopt predict --config q.yaml --ckpt_path c/last.ckpt'
        >>> command_with_checkpoint(
        ...     ["fit", "--model", "hf_llama.TinyLlama"], "fit", "c/last.ckpt", env={"PYTHONPATH": "examples"}
        ... )
        'PYTHONPATH=examples gpuopt fit --model hf_llama.TinyLlama --ckpt_path c/last.ckpt'

    Args:
        argv: The command line the run was started with (without the program name).
        env: Environment variables the command needs, written before it (``PYTHONPATH`` for classes of one's own).
    """
    return command_line(argv, subcommand, ("--ckpt_path", ckpt, *extra), env)


def command_line(
    argv: list[str], subcommand: str, options: tuple[str, ...] = (), env: Optional[Mapping[str, str]] = None
) -> str:
    """``[ENV=...] gpuopt <subcommand> <argv without its subcommand and the options set> <options>``, quoted for a
    shell (``options``: ``("--flag", "value", ...)``, which replace the same flags of ``argv``)."""
    replaced = {a for a in options if a.startswith("--")}  # options the printed command sets itself
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
    prefix = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    return " ".join([*prefix, shlex.join(["gpuopt", subcommand, *kept, *options])])


def count_text(n: int) -> str:
    """A parameter count as people write it: ``577``, ``2,177``, ``12.3K``, ``3.4M``, ``1.5B``."""
    if n < 10_000:
        return f"{n:,}"
    value, unit = n / 1e3, "K"
    for scale, larger in ((1e6, "M"), (1e9, "B")):
        if round(value, 3 - len(str(int(value)))) >= 1000:  # 999,999 is "1M", not "1e+03K"
            value, unit = n / scale, larger
    return f"{value:.3g}{unit}" if value < 1000 else f"{value:,.0f}{unit}"


def model_line(model: pl.LightningModule) -> str:
    """One line on the model, said before training (Lightning's summary table is off in the default stack)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    config = getattr(model, "config", None)
    if total == 0 and isinstance(config, GPTConfig):  # GPTModule builds its GPT in configure_model: count its config's
        with torch.device("meta"):
            total = sum(p.numel() for p in GPT(config).parameters())
    if total == 0 and is_overridden("configure_model", model):
        count = "parameters built in configure_model, at the start of fit (none before it to count)"
    else:
        count = f"{count_text(total)} parameters"
        if frozen:
            count += f" ({count_text(total - frozen)} trainable, {count_text(frozen)} frozen)"
    shape = ""
    if config is not None and hasattr(config, "n_layer"):
        shape = (f" ({config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, context "
                 f"{config.block_size}, vocabulary {config.vocab_size})")
    return f"{type(model).__name__}: {count}{shape}"


def has_predict_data(model: pl.LightningModule, datamodule: Optional[pl.LightningDataModule]) -> bool:
    """Whether ``gpuopt predict`` has batches for ``model``: its own ``predict_dataloader`` or the data module's."""
    return is_overridden("predict_dataloader", model) or (
        datamodule is not None and is_overridden("predict_dataloader", datamodule)
    )


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


def where_things_went(
    trainer: pl.Trainer, argv: list[str], can_predict: bool = True, env: Optional[Mapping[str, str]] = None
) -> list[str]:
    """The lines ``gpuopt fit`` ends with: the checkpoint, the logs, a command that trains on (``max_steps`` or
    ``max_epochs`` raised above where the run ended) and, when ``can_predict``, one that samples.

    Example::

        where_things_went(cli.trainer, ["fit", "--config", "q.yaml"])
        # ["gpuopt fit: finished at step 300.", "  checkpoint: runs/q/checkpoints/last.ckpt", ...]
    """
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
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
            further = 2 * max(max_steps, trainer.global_step)
            lines.append(f"  train on to step {further:,}: "
                         + command_with_checkpoint(argv, "fit", shown, ("--trainer.max_steps", str(further)), env))
        elif max_epochs is not None and max_epochs > 0 and trainer.current_epoch >= max_epochs:
            further = 2 * max(max_epochs, trainer.current_epoch)
            lines.append(f"  train on to epoch {further:,}: "
                         + command_with_checkpoint(argv, "fit", shown, ("--trainer.max_epochs", str(further)), env))
        else:
            lines.append(f"  continue:   {command_with_checkpoint(argv, 'fit', shown, env=env)}")
        if can_predict:
            lines.append(f"  sample:     {command_with_checkpoint(argv, 'predict', shown, env=env)}")
    return lines
