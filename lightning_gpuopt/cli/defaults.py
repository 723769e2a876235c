"""The ``gpuopt`` command's default stack: what ``gpuopt fit`` runs with when a config says nothing.

``BF16Precision`` on a GPU (float32 on a CPU, where bf16 autocast is 5-10x slower: :func:`stack_precision_plugins`),
``CUDASettings``, ``MFUMonitor``, ``NonFiniteGuard`` and a ``ModelCheckpoint`` keeping ``last.ckpt``. They are
parser defaults, not forced callbacks, so ``--print_config`` shows them and a config's own list replaces them
(README, "The gpuopt command"); only ``ExactResume``, ``SigtermCheckpoint`` and atomic writes are always on."""

from __future__ import annotations

from typing import Any, Optional

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
    
    "float32_note",
    "is_stack_callbacks",
    "precision_for_estimate",
    "replace_precision_plugins",
    "stack_callbacks",
    "stack_device_type",
    "stack_precision_plugins",
]

CHECKPOINT_EVERY_N_STEPS = 1000  # optimizer steps between two saves of last.ckpt in the default stack


def stack_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``: counted without initialising CUDA (``CUDASettings`` sets the
    allocator before that); ``BF16Precision`` reads the GPU's real facts when the run binds it."""
    return "cuda" if cuda_device_count() > 0 else "cpu"


def stack_precision_plugins(device_type: str) -> Optional[list[dict[str, Any]]]:
    """The stack's precision plugin for ``device_type``: ``BF16Precision`` on a GPU, none (float32) on a CPU.

    On a CPU without bf16 units bf16 autocast is 5-10x slower than float32: a training step takes 62 s against
    5.9 s with the plain loss, 9.5 s against 2.0 s with the chunked one (``benchmarks/README.md``, "Training-step
    memory and time": ``benchmarks/results/cpu/step-memory.json``). ``BF16Precision`` still trains in bf16 on a CPU
    when asked for."""
    return [{"class_path": "lightning_gpuopt.precision.BF16Precision"}] if device_type == "cuda" else None


def default_stack(device_type: Optional[str] = None) -> dict[str, Any]:
    """Parser defaults for ``trainer.plugins`` and ``trainer.callbacks`` (``class_path`` dictionaries) on
    ``device_type`` (``None``: :func:`stack_device_type`)."""
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
    """Whether a parsed ``trainer.callbacks`` value (class-path dictionaries or namespaces) is the stack's own list,
    as the parser holds it before a config or flag gives another, which then replaces it whole
    (:func:`~lightning_gpuopt.internals.parse_whole_lists`: jsonargparse would parse it item by item on the stack's)."""
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
    """The line said at start when the run is in float32 on a CPU because no ``trainer.precision`` or precision plugin
    was asked for, else ``None``."""
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
    """The line said at the start of ``fit`` naming the stack's callbacks that ``callbacks`` (the Trainer's) leaves out
    and what is lost, else ``None``; with ``enable_checkpointing`` false no ``ModelCheckpoint`` is named."""
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
    """The ``trainer.plugins`` to give the Trainer: without its precision plugins when ``trainer.precision`` is given
    (Lightning refuses both; the user's ``trainer.precision`` is the more specific choice), said in one line.

    Example::

        replace_precision_plugins("32-true", [BF16Precision()])  # -> []
        replace_precision_plugins(None, [BF16Precision()])       # -> [BF16Precision()]
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
    """The precision string ``choose_strategy``'s memory estimate needs, from ``trainer.precision`` or the plugins (a
    mixed-precision plugin keeps activations in 16 bits, like ``"bf16-mixed"``; none: ``"32-true"``)."""
    if precision is not None:
        return str(precision)
    listed = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    return "bf16-mixed" if any(isinstance(p, MixedPrecision) for p in listed) else "32-true"


def check_run_length(trainer_config: Any) -> Optional[str]:
    """The error message for a ``fit`` (``trainer_config``: the parsed ``trainer`` group) without a run length
    (Lightning would train 1000 epochs, and the LR schedule has no end), or with one of 0 or below -1 (nothing
    trains), else ``None``."""
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
