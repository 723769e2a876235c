"""``trainer.strategy: gpuopt-auto`` in the ``gpuopt`` command: its options, their checks, and the strategy it picks.

The choice is :func:`~lightning_gpuopt.strategies.choose_strategy`'s; this reads what it needs from the parsed
configuration (devices, nodes, precision, the data's micro-batch and sequence length, ``--auto_strategy.*``)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable, Optional

from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.cli.defaults import precision_for_estimate
from lightning_gpuopt.data.datamodule import TextDataModule
from lightning_gpuopt.data.sources import resolve_source
from lightning_gpuopt.model.config import PRESETS, GPTConfig
from lightning_gpuopt.perf.device import REFERENCE_DEVICES, cuda_device_count
from lightning_gpuopt.perf.units import GB
from lightning_gpuopt.strategies import AUTO_STRATEGY, PlanDoesNotFit, choose_strategy
from lightning_gpuopt.strategies.checkpointing import apply_checkpointing

__all__ = ["add_auto_strategy_arguments", "auto_strategy", "check_auto_strategy_options", "plan_without_missing_data"]

_GPUS = sorted(name for name in REFERENCE_DEVICES if name != "cpu")


def add_auto_strategy_arguments(parser: LightningArgumentParser) -> None:
    """The ``--auto_strategy.*`` options."""
    parser.add_argument(
        "--auto_strategy.device_memory_gb", type=Optional[float], default=None,
        help="Memory per device (GB) for trainer.strategy=gpuopt-auto; default: read from GPU 0.",
    )
    parser.add_argument(
        "--auto_strategy.device", type=Optional[str], default=None,
        help=f"Plan trainer.strategy=gpuopt-auto for this GPU (its memory and peak FLOP/s), e.g. on a machine without "
             f"it: one of {_GPUS}; default: GPU 0.",
    )
    parser.add_argument(
        "--auto_strategy.print_plan", type=bool, default=False,
        help="fit: print what trainer.strategy=gpuopt-auto picks (DDP, FSDP2, FSDP2 + tensor parallel) with its "
             "memory estimate per GPU, and stop before any data or model is prepared.",
    )


def plan_without_missing_data(config: Any) -> None:
    """With ``--auto_strategy.print_plan``, a ``data.source`` that is not on this machine (a recipe's WikiText-103 on a
    laptop) is replaced by ``stdlib``, said once: the plan reads ``data.batch_size`` and ``data.block_size``, no
    text."""
    data = config.get("data")
    source = data.get("source") if data is not None and (config.get("auto_strategy") or {}).get("print_plan") else None
    if not isinstance(source, str):
        return
    try:
        resolve_source(source)
    except ValueError:
        data.source = "stdlib"
        rank_zero_info(f"--auto_strategy.print_plan: data.source={source!r} is not on this machine; the plan reads no "
                       "text (only data.batch_size and data.block_size), so it is made without it.")


def check_auto_strategy_options(config: Any, error: Callable[[str], Any], subcommand: Optional[str] = "fit") -> None:
    """Call ``error`` (the parser's) for ``--auto_strategy.*`` options that cannot work, before anything is built."""
    plan = config.get("auto_strategy") or {}
    auto = (config.get("trainer") or {}).get("strategy") == AUTO_STRATEGY
    if plan.get("print_plan") and subcommand not in ("fit", None):
        error(f"--auto_strategy.print_plan prints the plan of a training run: `gpuopt fit ... --trainer.strategy "
              f"{AUTO_STRATEGY} --auto_strategy.print_plan true`, not `gpuopt {subcommand}`.")
    if plan.get("print_plan") and not auto:
        error(f"--auto_strategy.print_plan prints what trainer.strategy={AUTO_STRATEGY} picks: add "
              f"--trainer.strategy {AUTO_STRATEGY}.")
    gpu = plan.get("device")
    if gpu is not None and gpu not in _GPUS:
        close = [g for g in _GPUS if g.lower().startswith(gpu.lower())] or difflib.get_close_matches(gpu, _GPUS, n=1)
        error(f"--auto_strategy.device={gpu!r} is not a GPU the planner knows"
              + (f" (did you mean {close[0]!r}?)" if close else "") + f": choose one of {_GPUS}.")
    memory = plan.get("device_memory_gb")
    if memory is not None and not memory > 0:
        error(f"--auto_strategy.device_memory_gb must be > 0, got {memory:g}: the memory of one GPU in GB, e.g. 80.")
    named = plan.get("device") is not None or memory is not None
    on_cpu = str((config.get("trainer") or {}).get("accelerator", "auto")) == "cpu"  # said: a CPU run, e.g. of gloo
    if auto and named and not plan.get("print_plan") and not on_cpu and cuda_device_count() == 0:
        which = "--auto_strategy.device" if plan.get("device") is not None else "--auto_strategy.device_memory_gb"
        error(f"{which} plans trainer.strategy={AUTO_STRATEGY} for a GPU, and this machine has none, so the run would "
              "train on its CPU: add --auto_strategy.print_plan true to see the plan without training, or run the "
              "command on the GPU machine.")


def auto_strategy(model: Any, datamodule: Any, config: Any, trainer_cfg: dict) -> tuple[Any, str]:
    """``(strategy, reason)`` that ``choose_strategy`` gives for the configured run (the data module's ``batch_size``
    is the micro-batch planned for; ``config``: the subcommand's; ``trainer_cfg``: the Trainer's)."""
    devices = trainer_cfg.get("devices", "auto")
    if devices in ("auto", -1, "-1"):
        devices = max(1, cuda_device_count())
    elif isinstance(devices, str):
        devices = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    elif isinstance(devices, (list, tuple)):
        devices = len(devices)
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    planned, vocabulary = _planned_vocabulary(model, datamodule, config)
    try:
        strategy, plan = _choose(planned, datamodule, config, trainer_cfg, devices, nodes)
    except PlanDoesNotFit as err:  # stops the run before the model is built, naming the vocabulary planned for
        raise PlanDoesNotFit(str(err).rstrip(".") + (f"; vocabulary {vocabulary}." if vocabulary else ".")) from None
    if planned is not model:  # the copy planned with the preset's vocabulary: its checkpointing is the run's
        apply_checkpointing(model, model.config, planned.activation_checkpointing)
    return strategy, plan + (f"\nvocabulary: {vocabulary}" if vocabulary else "")


def _choose(model: Any, datamodule: Any, config: Any, trainer_cfg: dict, devices: int, nodes: int) -> tuple[Any, str]:
    plan = config.get("auto_strategy") or {}
    memory_gb, gpu = plan.get("device_memory_gb"), plan.get("device")
    precision = precision_for_estimate(trainer_cfg.get("precision"), trainer_cfg.get("plugins"))
    if (
        (gpu is not None or memory_gb is not None)
        and cuda_device_count() == 0
        and trainer_cfg.get("precision") is None
        and not trainer_cfg.get("plugins")
    ):
        precision = "bf16-mixed"  # the stack's BF16Precision on the GPU planned for (float32 is this CPU's stack)
    return choose_strategy(
        model,
        devices=devices * nodes,
        device_memory=None if memory_gb is None else memory_gb * GB,
        precision=precision,
        micro_batch=_micro_batch(datamodule),
        block_size=getattr(datamodule, "block_size", None),
        device=None if gpu is None else REFERENCE_DEVICES[gpu],
        devices_per_node=devices,
    )


def _planned_vocabulary(model: Any, datamodule: Any, config: Any) -> tuple[Any, Optional[str]]:
    """What to plan for, and where its vocabulary comes from. The CLI links ``data.vocab_size`` into the model, and the
    data's default (4,096) is the size of the tokenizer it trains on the corpus. Under ``print_plan`` no data is read:
    when neither ``data.vocab_size`` nor ``data.tokenizer`` is given, a preset with a vocabulary of its own
    (``llama-*``: Llama 3's 128,256) is planned with it. A run plans the model it builds, and says so when that is the
    data's default."""
    gpt = getattr(model, "config", None)
    hparams = getattr(model, "hparams", None) or {}
    data = getattr(datamodule, "hparams", None) if isinstance(datamodule, TextDataModule) else None
    if not isinstance(gpt, GPTConfig) or data is None:
        return model, None
    own = PRESETS.get(hparams.get("preset"), {}).get("vocab_size")
    default = inspect.signature(TextDataModule.__init__).parameters["vocab_size"].default
    said = data.get("vocab_size") != default or data.get("tokenizer") is not None or own is None
    if said or own == gpt.vocab_size:
        source = "data.tokenizer's" if data.get("tokenizer") is not None else "data.vocab_size"
        return model, f"{gpt.vocab_size:,} ({source}, linked into the model)"
    if (config.get("auto_strategy") or {}).get("print_plan"):
        return dataclasses.replace(gpt, vocab_size=own), (
            f"{own:,} ({hparams['preset']}'s own: no data.vocab_size or data.tokenizer is given; a run would train a "
            f"{default:,}-token tokenizer on its corpus unless one of them says otherwise)")
    return model, (f"{gpt.vocab_size:,} (data.vocab_size's default: the tokenizer trained on the corpus; "
                   f"{hparams['preset']}'s own is {own:,}: give --data.tokenizer or --data.vocab_size for it)")


def _micro_batch(datamodule: Any) -> int:
    """The micro-batch size ``gpuopt-auto`` plans for: the data module's ``batch_size``."""
    batch_size = getattr(datamodule, "batch_size", None)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        got = (
            "the module trains on its own loaders"
            if datamodule is None
            else f"{type(datamodule).__name__} has batch_size={batch_size!r}"
        )
        raise ValueError(
            f"trainer.strategy={AUTO_STRATEGY} needs the micro-batch size to plan memory, read from the data module's "
            f"batch_size attribute, but {got}: give the data module "
            "an int batch_size, or name the strategy (trainer.strategy: ddp or fsdp)."
        )
    return batch_size
