"""Reading package checkpoints safely (``weights_only=True``: no code from the pickle), and loading one into a plain
PyTorch ``GPT`` without a Trainer."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from lightning_gpuopt.option_checks import from_command_line
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT

from lightning_gpuopt.internals import COMPILED_PREFIX

__all__ = [
    "CheckpointError", "check_weights", "gpt_config_from_hparams", "gpt_from_checkpoint", "gpt_state_dict",
    "gptmodule_hparams", "init_from_anyway", "load_gpt", "load_gpt_weights", "nonfinite_weights", "read_checkpoint",
    "weights_refusal",
]

MapLocation = Union[str, torch.device, Callable, dict, None]

# GPTModule hyper-parameters that shape the GPT (the others are optimiser / sampling settings).
_CONFIG_HPARAMS = (
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "n_kv_head",
    "dropout",
    "attention",
    "activation_checkpointing",
)


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, not a torch checkpoint, or not a ``GPTModule``'s."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard


def nonfinite_weights(state_dict: Any) -> list[str]:
    """Names of the floating-point tensors in ``state_dict`` that hold a NaN or Inf (this rank's shards)."""
    if not isinstance(state_dict, dict):
        return []
    names, tensors = [], []
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() and not value.is_meta:
            names.append(name)
            tensors.append(_local(value).detach())
    if not tensors:
        return []
    flags = [bool(f) for f in torch.stack([(~torch.isfinite(t)).any().cpu() for t in tensors]).tolist()]
    return [n for n, bad in zip(names, flags) if bad]


def weights_refusal(source: Any, problem: str, fix: str, read_anyway: str) -> str:
    """The one message of every door weights enter by (``--ckpt_path``, ``init_from``, :func:`load_gpt`, ``predict``,
    an import): the file and the tensor, the fix, and how to read the file anyway; three lines."""
    return f"Weights of {str(source)!r} refused: {problem}.\n{fix}.\nTo read the file anyway: {read_anyway}."


def check_weights(
    state_dict: dict[str, Any], source: Any, config: Optional[GPTConfig] = None, read_anyway: Optional[str] = None,
    finite: bool = True,
) -> None:
    """Raise :class:`CheckpointError` (:func:`weights_refusal`'s message) if the weights ``state_dict`` read from
    ``source`` hold NaN/Inf, or, given ``config``, are not a ``GPT(config)``'s: the same tensor names and shapes.

    The check of every door weights enter by: ``--ckpt_path`` and ``predict`` (``GPTModule.on_load_checkpoint`` and
    ``AtomicCheckpointIO``), ``GPTModule(init_from=...)``, :func:`load_gpt`, and an import of other weights.

    Args:
        state_dict: A plain ``GPT``'s state dict (no ``model.`` prefix: :func:`gpt_state_dict` of a checkpoint).
        source: The file (or name) the weights came from, for the message.
        config: The architecture they must fit; ``None``: only finiteness is checked.
        read_anyway: How to read the file anyway, for the message; ``None``: ``torch.load`` of it.
        finite: Check finiteness (``False``: names and shapes only, where another reader checked it already).
    """
    anyway = read_anyway or f"torch.load({str(source)!r}, weights_only=True) reads its tensors as they are"
    if config is not None:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
        given = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        wrong = [k for k in expected if k in given and given[k] != expected[k]]
        missing = [k for k in expected if k not in given]
        unexpected = [k for k in given if k not in expected]
        if wrong or missing or unexpected:
            if wrong:
                first = (
                    f"{wrong[0]!r} is {list(given[wrong[0]])} in the file and {list(expected[wrong[0]])} in the model"
                )
            elif missing:
                first = f"{missing[0]!r} is missing from the file"
            else:
                first = f"{unexpected[0]!r} is in the file and not in the model"
            counts = f"{len(wrong)} of other shape, {len(missing)} missing, {len(unexpected)} unexpected"
            raise CheckpointError(weights_refusal(
                source, f"they do not fit the model's architecture ({_architecture(config)}): {first} ({counts})",
                "Build the model with the file's architecture (its preset, n_layer, n_head, n_embd, n_kv_head, "
                "block_size and vocab_size), or give weights of this one", anyway))
    bad = nonfinite_weights(state_dict) if finite else []
    if bad:
        total = sum(1 for v in state_dict.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
        raise CheckpointError(weights_refusal(
            source, f"{bad[0]!r} holds NaN/Inf ({len(bad)} of {total} weight tensors do): the run that wrote them had "
            "diverged", "Use an earlier checkpoint of that run, or start from other weights", anyway))


def _architecture(config: GPTConfig) -> str:
    return (f"arch={config.arch}, n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
            f"vocab_size={config.vocab_size}, block_size={config.block_size}")


def read_checkpoint(
    path: Union[str, os.PathLike], map_location: MapLocation = "cpu", weights_only: bool = True, mmap: bool = False
) -> Any:
    """``torch.load`` a checkpoint file, turning the ways it can be broken into a :class:`CheckpointError`.

    Args:
        path: The checkpoint file.
        map_location: ``torch.load``'s ``map_location``.
        weights_only: Only tensors and primitive types (safe for untrusted files); ``False`` only for a file you trust.
        mmap: Map the tensors instead of reading them (cheap when only the hyper-parameters are wanted).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"Checkpoint {str(path)!r} is a directory (a sharded distributed checkpoint, as FSDP2 saves?): give a "
            f"single .ckpt file, or consolidate the shards with their hyper-parameters first, `python -m "
            f"lightning.fabric.utilities.consolidate_checkpoint {path}`, and give {str(path) + '.consolidated'!r}."
        )
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist: check the path (e.g. "
                              ".../checkpoints/last.ckpt).")
    if path.stat().st_size == 0:
        raise CheckpointError(f"Checkpoint {str(path)!r} is empty (0 bytes): it was never written; use an earlier "
                              "checkpoint.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # torch.save has written zip archives since PyTorch 1.6
        raise CheckpointError(
            f"{str(path)!r} is not a PyTorch checkpoint (torch.save writes a zip archive; this file starts with "
            f"{magic!r}): give a .ckpt file written by Lightning / lightning_gpuopt."
        )
    if not mmap:
        _check_stored_checksums(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise CheckpointError(_not_weights_only(path, str(err))) from err
        raise CheckpointError(
            f"{str(path)!r} is not a PyTorch checkpoint (cannot unpickle it: {err}): give a .ckpt file written by "
            "Lightning / lightning_gpuopt."
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} is truncated or corrupt ({type(err).__name__}: {str(err).splitlines()[0]}): the "
            "write was probably interrupted. Use an earlier checkpoint; save with AtomicCheckpointIO to prevent this."
        ) from err


def _not_weights_only(path: Path, error: str) -> str:
    """The message for a checkpoint that holds pickled objects: in ``gpuopt`` (always ``weights_only=True``) a file
    of tensors only, in Python ``weights_only=False`` for a file one trusts."""
    found = re.search(r"GLOBAL (\S+)", error)
    what = f" (the first: {found.group(1)})" if found else ""
    text = (f"Checkpoint {str(path)!r} holds objects other than tensors and primitive types{what}, so it was not "
            "loaded: loading them would run whatever code the file holds. ")
    if from_command_line():
        return text + ("gpuopt reads checkpoints with weights_only=True only, whatever --weights_only says. If you "
                       "trust the file, save what you need of it again in Python (torch.load(path, "
                       "weights_only=False), then torch.save of its tensors and numbers) and pass that file; or use a "
                       "checkpoint written by gpuopt or Lightning.")
    return text + "If you trust the file, load it with weights_only=False."


def _check_stored_checksums(path: Path) -> None:
    """Raise if a record of the zip archive does not match the CRC-32 ``torch.save`` stored for it (``torch.load``
    does not compare them, so changed bytes would load as weights); records stored without one (CRC 0) pass."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return  # no readable archive (cut short): torch.load's error says so
    try:
        with archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:  # ZipExtFile compares the CRC-32 at the end of the record
                    while record.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} is damaged ({str(err).splitlines()[0] if str(err) else type(err).__name__}): "
            "its bytes no longer match the checksums written with it (a disk error, an interrupted copy or a write "
            "into the file). Use an earlier checkpoint of the run, or copy the file again from where it was saved."
        ) from err


def gpt_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain ``GPT``'s state dict in a loaded ``GPTModule`` checkpoint (``model.`` and ``_orig_mod.`` removed)."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(
            "The checkpoint has no 'state_dict': it is not a Lightning checkpoint of a GPTModule "
            "(top-level keys: "
            f"{sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__})."
        )
    out = {}
    for key, value in state.items():
        key = key.replace(COMPILED_PREFIX, "")
        if key.startswith("model."):
            out[key[len("model.") :]] = value
    return out


def gptmodule_hparams(checkpoint: Any, path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The ``GPTModule`` hyper-parameters of a checkpoint :func:`read_checkpoint` returned from ``path``, or a
    :class:`CheckpointError` for another file."""
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(hparams, dict) or "preset" not in hparams:
        raise CheckpointError(
            f"{str(path)!r} is not a GPTModule checkpoint (no 'preset' in its hyper_parameters): give a checkpoint "
            "written by a Trainer fitting lightning_gpuopt.GPTModule (e.g. .../checkpoints/last.ckpt)."
        )
    return hparams


def gpt_config_from_hparams(hparams: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The ``GPTConfig`` a ``GPTModule``'s saved hyper-parameters describe: its whole ``architecture`` when saved (a run
    started from a Hugging Face folder), else its preset and overrides."""
    fields = {k: hparams[k] for k in _CONFIG_HPARAMS if hparams.get(k) is not None}
    architecture = hparams.get("architecture")
    if architecture:
        runtime = {k: v for k, v in fields.items() if k in ("dropout", "attention", "activation_checkpointing")}
        return GPTConfig(**{**architecture, **runtime, **overrides})
    return GPTConfig.from_name(hparams["preset"], **{**fields, **overrides})


def gpt_from_checkpoint(checkpoint: Any, path: Union[str, os.PathLike], allow_nonfinite: bool = False,
                        **overrides: Any) -> GPT:
    """The plain :class:`GPT` of a loaded ``GPTModule`` checkpoint (from ``path``, named in errors), on the CPU, its
    weights checked first (:func:`check_weights`)."""
    hparams = gptmodule_hparams(checkpoint, path)
    try:
        config = gpt_config_from_hparams(hparams, **overrides)
    except ValueError as err:
        raise CheckpointError(f"The hyper-parameters saved in {str(path)!r} do not make a valid GPTConfig: "
                              f"{err}") from err
    state = gpt_state_dict(checkpoint)
    check_weights(state, path, config, f"load_gpt({str(path)!r}, allow_nonfinite=True)", finite=not allow_nonfinite)
    model = GPT(config)
    model.load_state_dict(state, strict=True)  # copies into the tied embedding / head as one tensor
    return model


def load_gpt(
    path: Union[str, os.PathLike], map_location: MapLocation = "cpu", allow_nonfinite: bool = False, **overrides: Any
) -> GPT:
    """Load a ``GPTModule`` checkpoint into a plain PyTorch :class:`GPT` in eval mode, for inference without Lightning;
    its ``GPTConfig`` is rebuilt from the saved hyper-parameters (its whole ``architecture`` for a run started from a
    Hugging Face folder).

    Example::

        gpt = load_gpt("runs/quickstart/lightning_logs/version_0/checkpoints/last.ckpt")
        out = gpt.generate(torch.tensor([[0]]), max_new_tokens=20)

    Args:
        path: A ``.ckpt`` file written by a Trainer fitting a ``GPTModule``.
        map_location: Where the weights are loaded (``"cpu"``, ``"cuda"``, ...).
        allow_nonfinite: Load weights that hold NaN/Inf (refused by default: :func:`check_weights`).
        **overrides: ``GPTConfig`` fields to change for inference, e.g. ``attention="sdpa"`` for a model
            trained with flash-attn.
    """
    checkpoint = read_checkpoint(path, map_location=map_location)
    model = gpt_from_checkpoint(checkpoint, path, allow_nonfinite, **overrides)
    if isinstance(map_location, (str, torch.device)):
        model.to(map_location)
    return model.eval()


def init_from_anyway(path: Union[str, os.PathLike]) -> str:
    """How to read an ``init_from`` file that :func:`check_weights` refused."""
    return (f"torch.load({str(path)!r}, weights_only=True) reads its tensors as they are, and "
            "lightning_gpuopt.model.load_gpt(path, allow_nonfinite=True) its GPT")


def load_gpt_weights(model: GPT, path: Union[str, os.PathLike]) -> None:
    """Copy only the weights of a ``GPTModule`` checkpoint into ``model``, a GPT of the same architecture whose
    parameters are on a device (``GPTModule(init_from=...)``: fine-tuning from them), after :func:`check_weights`."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"model.init_from={str(path)!r}: the GPT was built on the meta device (sharded or empty-initialised), so "
            "the weights cannot be copied into it; fine-tune under a strategy that builds the model on a device (DDP, "
            "one device), or load the weights in configure_model after materialising them."
        )
    checkpoint = read_checkpoint(path)
    gptmodule_hparams(checkpoint, path)  # a GPTModule's checkpoint, or a clear error
    state = gpt_state_dict(checkpoint)
    check_weights(state, path, model.config, init_from_anyway(path))
    model.load_state_dict(state, strict=True)
