"""The ``gpuopt`` command's default stack: what ``gpuopt fit`` runs with when a config says nothing.

Design note: the stack is a set of *parser defaults* (jsonargparse ``set_defaults`` on
``trainer.plugins`` and ``trainer.callbacks``), not callbacks forced on every run. So
``--print_config`` shows it, a YAML file's own ``trainer.callbacks`` / ``trainer.plugins`` list
replaces it, ``--trainer.callbacks+=X`` adds to it, ``--trainer.plugins null`` removes the plugin,
and ``--trainer.plugins Float8Precision`` swaps bf16 for float8 in one flag. Only ``ExactResume``,
``SigtermCheckpoint`` and atomic checkpoint writes are always on (the CLI adds them itself).

The default stack:

========================  ======================================================================
``BF16Precision``         bf16 autocast (fp16 + ``GradScaler`` on GPUs without bf16), on a GPU;
                          on a CPU no precision plugin: float32, about twice as fast there
                          (:func:`stack_precision_plugins`)
``CUDASettings``          TF32, cuDNN benchmark, SDPA backends, expandable segments
``MFUMonitor``            tokens/s and MFU in the progress bar, end-of-fit report
``NonFiniteGuard``        skip a step with a NaN/Inf loss or gradient (stop after 5 in a row)
``ModelCheckpoint``       ``<default_root_dir>/checkpoints/last.ckpt`` every
                          :data:`CHECKPOINT_EVERY_N_STEPS` optimizer steps and at the end of fit,
                          not at every validation
========================  ======================================================================
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.callbacks import CUDASettings, MFUMonitor, NonFiniteGuard
from lightning_gpuopt.perf.device import cuda_device_count

__all__ = [
    "CHECKPOINT_EVERY_N_STEPS",
    "check_run_length",
    "default_stack",
    "dropped_stack_note",
    "fill_checkpoint_dirs",
    "float32_note",
    "is_stack_callbacks",
    "precision_for_estimate",
    "replace_precision_plugins",
    "stack_callbacks",
    "stack_device_type",
    "stack_precision_plugins",
]

CHECKPOINT_EVERY_N_STEPS = 1000
"""Optimizer steps between two saves of ``last.ckpt`` in the default stack."""


def stack_device_type() -> str:
    """``"cuda"`` when a GPU is visible (a Trainer with ``accelerator="auto"`` trains on it), else ``"cpu"``.

    The stack needs the kind of device only, counted without initialising CUDA (``CUDASettings`` sets
    the allocator before that); on a GPU, ``BF16Precision`` decides bf16 or fp16 from the GPU's real
    facts when the run binds it.
    """
    return "cuda" if cuda_device_count() > 0 else "cpu"


def stack_precision_plugins(device_type: str) -> Optional[list[dict[str, Any]]]:
    """The stack's precision plugin for ``device``: ``BF16Precision`` on a GPU, none (float32) on a CPU.

    On a CPU bf16 autocast is the slower choice: the quickstart takes 412 ms per step under it
    against 205 ms in float32 (measured side by side). ``BF16Precision`` itself still trains in bf16
    on a CPU when asked for.

    Example::

        stack_precision_plugins("cuda")  # [{"class_path": "...BF16Precision"}]
        stack_precision_plugins("cpu")   # None

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (:func:`stack_device_type`).
    """
    return [{"class_path": "lightning_gpuopt.precision.BF16Precision"}] if device_type == "cuda" else None


def default_stack(device_type: Optional[str] = None) -> dict[str, Any]:
    """Parser defaults for ``trainer.plugins`` and ``trainer.callbacks`` (see the module docstring).

    Example::

        parser.set_defaults(default_stack())   # in LightningCLI.add_arguments_to_parser

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; ``None``: :func:`stack_device_type`.

    Returns:
        ``{"trainer.plugins": [...] or None, "trainer.callbacks": [...]}`` as ``class_path`` dictionaries.
    """
    return {
        "trainer.plugins": stack_precision_plugins(stack_device_type() if device_type is None else device_type),
        "trainer.enable_model_summary": False,  # one line on the model instead (cli/run_summary.py)
        "trainer.callbacks": stack_callbacks(),
    }


def stack_callbacks() -> list[dict[str, Any]]:
    """The stack's callbacks, as ``class_path`` dictionaries (the default of ``trainer.callbacks``)."""
    return [
        {"class_path": "lightning_gpuopt.callbacks.CUDASettings"},
        {"class_path": "lightning_gpuopt.callbacks.MFUMonitor"},
        {"class_path": "lightning_gpuopt.callbacks.NonFiniteGuard"},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "save_last": True,
                "save_top_k": 0,  # only last.ckpt: one file per run, rewritten atomically
                "every_n_train_steps": CHECKPOINT_EVERY_N_STEPS,
                "enable_version_counter": False,  # always last.ckpt, so --ckpt_path last finds it
            },
        },
    ]


def _as_dict(value: Any) -> Any:
    return value.as_dict() if hasattr(value, "as_dict") else value


def is_stack_callbacks(value: Any) -> bool:
    """Whether a parsed ``trainer.callbacks`` value is the stack's own list (:func:`stack_callbacks`), as the parser
    holds it before a config or flag gives another.

    A list given over it replaces it whole (:func:`~lightning_gpuopt.internals.parse_whole_lists`), never item by
    item: jsonargparse would parse each item of a list as long as the stack's on the stack's item at its position
    (a user's ``ModelCheckpoint`` with the stack's ``save_last`` and ``every_n_train_steps``, or
    ``NonFiniteGuard``'s ``mode`` on a ``ModelCheckpoint``).

    Example::

        is_stack_callbacks(stack_callbacks())  # True

    Args:
        value: The parsed ``trainer.callbacks`` value (class-path dictionaries or namespaces).
    """
    stack = stack_callbacks()
    if not isinstance(value, list) or len(value) != len(stack):
        return False
    for item, ours in zip(map(_as_dict, value), stack):
        if not isinstance(item, dict) or item.get("class_path") != ours["class_path"]:
            return False
        given = _as_dict(item.get("init_args")) or {}
        if any(given.get(k) != v for k, v in ours.get("init_args", {}).items()):
            return False
    return True


def float32_note(precision: Optional[str], plugins: Any, device_type: str) -> Optional[str]:
    """The line said at start when the run is in float32 on a CPU because no precision was asked for, else ``None``.

    Example::

        float32_note(None, None, "cpu")  # "gpuopt: running in float32 on the CPU ..."

    Args:
        precision: The ``trainer.precision`` value (``None`` when not set).
        plugins: The plugins given to the Trainer.
        device_type: The kind of device the stack was chosen for (:func:`stack_device_type`).
    """
    listed = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    if device_type == "cuda" or precision is not None or any(isinstance(p, Precision) for p in listed):
        return None
    return (
        "gpuopt: running in float32 on the CPU (bf16 autocast is 5-10x slower there); pass "
        "--trainer.plugins BF16Precision to use bf16."
    )


def _left_out_checkpoint(callbacks: list[Any]) -> Optional[str]:
    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    if not checkpoints:
        return ("the ModelCheckpoint keeping last.ckpt (Lightning's default one saves at the end of each epoch only; "
                "--ckpt_path last resumes from the newest checkpoint it wrote)")
    if not any(c.save_last for c in checkpoints):
        return ("a ModelCheckpoint keeping last.ckpt (save_last is not set: --ckpt_path last resumes from the newest "
                "checkpoint the run wrote)")
    return None


def dropped_stack_note(callbacks: list[Any], enable_checkpointing: Any = True) -> Optional[str]:
    """The line said at the start of ``fit`` naming the stack's callbacks that ``trainer.callbacks`` leaves out, else ``None``.

    A ``--trainer.callbacks X`` flag, or a config's own list, replaces the stack's list whole (each of its
    pieces is there as listed or not at all): without this line the left-out pieces went without a word: no
    ``last.ckpt``, NaN/Inf steps trained on, no MFU. ``trainer.enable_checkpointing: false`` asks for no
    checkpoint, so then no ``ModelCheckpoint`` is named.

    Example::

        dropped_stack_note([LearningRateMonitor()])  # "gpuopt: trainer.callbacks replaces the stack's list and leaves out ..."

    Args:
        callbacks: The callbacks the Trainer is about to get (the stack's, a config's or a flag's).
        enable_checkpointing: The ``trainer.enable_checkpointing`` value.
    """
    pieces = (
        (CUDASettings, "CUDASettings (no TF32, SDPA order or allocator settings on a GPU)"),
        (MFUMonitor, "MFUMonitor (no tokens/s or MFU)"),
        (NonFiniteGuard, "NonFiniteGuard (NaN/Inf steps are trained on)"),
    )
    missing = [said for cls, said in pieces if not any(isinstance(c, cls) for c in callbacks)]
    checkpoint = _left_out_checkpoint(callbacks) if enable_checkpointing is not False else None
    missing += [checkpoint] if checkpoint else []
    if not missing:
        return None
    listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return (
        f"gpuopt: trainer.callbacks replaces the stack's list and leaves out {listed}. To keep them, add callbacks "
        "with --trainer.callbacks+=X instead, or list them too in the config."
    )


def replace_precision_plugins(precision: Optional[str], plugins: Any) -> Any:
    """``plugins`` without its precision plugins when ``trainer.precision`` is given.

    Lightning refuses ``Trainer(precision=..., plugins=[<a Precision>])``. A ``trainer.precision``
    the user sets is the more specific choice, so it replaces the stack's (or a recipe's)
    precision plugin; one line says so.

    Example::

        replace_precision_plugins("32-true", [BF16Precision()])  # -> []
        replace_precision_plugins(None, [BF16Precision()])       # -> [BF16Precision()]

    Args:
        precision: The ``trainer.precision`` value (``None`` when not set).
        plugins: The ``trainer.plugins`` value: ``None``, one plugin or a list.

    Returns:
        The plugins to give the Trainer.
    """
    if precision is None or plugins is None:
        return plugins
    listed = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    dropped = [p for p in listed if isinstance(p, Precision)]
    if not dropped:
        return plugins
    names = ", ".join(type(p).__name__ for p in dropped)
    rank_zero_info(f"trainer.precision={precision!r} replaces the precision plugin {names} of trainer.plugins.")
    return [p for p in listed if not isinstance(p, Precision)]


def precision_for_estimate(precision: Optional[str], plugins: Any) -> str:
    """The precision string ``choose_strategy``'s memory estimate needs, from ``trainer.precision`` or the plugins.

    A mixed-precision plugin (``BF16Precision``, ``Float8Precision``) keeps activations in 16 bits,
    like ``"bf16-mixed"``; without one or a ``trainer.precision`` the run is ``"32-true"``.

    Example::

        precision_for_estimate(None, [BF16Precision()])  # "bf16-mixed"

    Args:
        precision: The ``trainer.precision`` value (``None`` when not set).
        plugins: The ``trainer.plugins`` value: ``None``, one plugin or a list.
    """
    if precision is not None:
        return str(precision)
    listed = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    return "bf16-mixed" if any(isinstance(p, MixedPrecision) for p in listed) else "32-true"


def fill_checkpoint_dirs(trainer: Trainer) -> None:
    """Give every ``ModelCheckpoint`` without a ``dirpath`` the folder ``<default_root_dir>/checkpoints``.

    Lightning's own default puts checkpoints under the logger's new ``version_N`` folder, which a
    new process does not know, so ``fit(ckpt_path="last")`` found nothing and trained from step 0.
    A fixed folder is where the next ``gpuopt fit ... --ckpt_path last`` looks.

    Example::

        fill_checkpoint_dirs(trainer)   # runs/quickstart/checkpoints for default_root_dir=runs/quickstart

    Args:
        trainer: The Trainer, before ``fit``.
    """
    folder = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = folder


def check_run_length(trainer_config: Any) -> Optional[str]:
    """The error message for a ``fit`` without a run length, or with one of zero, else ``None``.

    Without ``max_steps``, ``max_epochs``, ``max_time`` or ``fast_dev_run`` Lightning trains for
    1000 epochs, and the LR schedule has no end to decay towards. ``max_steps`` or ``max_epochs`` of 0
    (or below -1) trains nothing and exits 0.

    Example::

        check_run_length({"max_steps": -1, "max_epochs": None})  # -> "gpuopt fit needs a run length: ..."

    Args:
        trainer_config: The parsed ``trainer`` group (a mapping).
    """
    get = trainer_config.get
    for name in ("max_steps", "max_epochs"):
        value = get(name)
        if isinstance(value, int) and not isinstance(value, bool) and (value == 0 or value < -1):
            return (f"trainer.{name}={value} trains nothing (Lightning would stop at once and exit as if it had "
                    f"finished): set it to the {'optimizer steps' if name == 'max_steps' else 'epochs'} to train, "
                    f"e.g. --trainer.{name} {3000 if name == 'max_steps' else 1}, or -1 for no limit.")
    if get("fast_dev_run") or get("max_time") or get("max_epochs") not in (None, -1):
        return None
    if get("max_steps") not in (None, -1):
        return None
    return (
        "gpuopt fit needs a run length: set trainer.max_steps (e.g. --trainer.max_steps 3000), or "
        "trainer.max_epochs / trainer.max_time, in the config or on the command line."
    )
