"""Reading package checkpoints safely (``weights_only=True``: no code from the pickle), and loading one into a plain
PyTorch ``GPT`` without a Trainer."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Union

import torch

from lightning_gpuopt.option_checks import from_command_line
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT

from lightning_gpuopt.internals import COMPILED_PREFIX

__all__ = [
    "CheckpointError", "gpt_config_from_hparams", "gpt_from_checkpoint", "gpt_state_dict", "gptmodule_hparams",
    "load_gpt", "load_gpt_weights", "read_checkpoint",
]

MapLocation = Union[str, torch.device, Callable, dict, None]

# GPTModule hyper-parameters that shape the GPT (the others are optimiser / sampling settings).
_CONFIG_HPARAMS = (
    "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "dropout", "attention", "activation_checkpointing"
)


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, not a torch checkpoint, or not a ``GPTModule``'s."""


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
            f"Checkpoint {str(path)!r} is a directory (a sharded distributed checkpoint, as FSDP2 saves?): give a single "
            f".ckpt file, or consolidate the shards with their hyper-parameters first, `python -m "
            f"lightning.fabric.utilities.consolidate_checkpoint {path}`, and give {str(path) + '.consolidated'!r}."
        )
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist: check the path (e.g. .../checkpoints/last.ckpt).")
    if path.stat().st_size == 0:
        raise CheckpointError(f"Checkpoint {str(path)!r} is empty (0 bytes): it was never written; use an earlier checkpoint.")
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
                       "trust the file, save what you need of it again in Python (torch.load(path, weights_only=False), "
                       "then torch.save of its tensors and numbers) and pass that file; or use a checkpoint written by "
                       "gpuopt or Lightning.")
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
            f"Checkpoint {str(path)!r} is damaged ({str(err).splitlines()[0] if str(err) else type(err).__name__}): its "
            "bytes no longer match the checksums written with it (a disk error, an interrupted copy or a write into the "
            "file). Use an earlier checkpoint of the run, or copy the file again from where it was saved."
        ) from err


def gpt_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain ``GPT``'s state dict in a loaded ``GPTModule`` checkpoint (``model.`` and ``_orig_mod.`` removed)."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(
            "The checkpoint has no 'state_dict': it is not a Lightning checkpoint of a GPTModule "
            f"(top-level keys: {sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__})."
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


def gpt_from_checkpoint(checkpoint: Any, path: Union[str, os.PathLike], **overrides: Any) -> GPT:
    """The plain :class:`GPT` of a loaded ``GPTModule`` checkpoint (from ``path``, named in errors), on the CPU."""
    hparams = gptmodule_hparams(checkpoint, path)
    try:
        config = gpt_config_from_hparams(hparams, **overrides)
    except ValueError as err:
        raise CheckpointError(f"The hyper-parameters saved in {str(path)!r} do not make a valid GPTConfig: {err}") from err
    model = GPT(config)
    state = gpt_state_dict(checkpoint)
    missing = sorted(set(model.state_dict()) - set(state))
    unexpected = sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise CheckpointError(
            f"The weights in {str(path)!r} do not match the GPT its hyper-parameters describe: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}. Was the checkpoint written by a modified model, or saved with "
            "ModelCheckpoint(save_weights_only=...) of another module?"
        )
    try:
        model.load_state_dict(state, strict=True)  # copies into the tied embedding / head as one tensor
    except RuntimeError as err:  # shape mismatches
        raise CheckpointError(f"The weights in {str(path)!r} do not fit the GPT its hyper-parameters describe: {err}") from err
    return model


def load_gpt(path: Union[str, os.PathLike], map_location: MapLocation = "cpu", **overrides: Any) -> GPT:
    """Load a ``GPTModule`` checkpoint into a plain PyTorch :class:`GPT` in eval mode, for inference without Lightning;
    its ``GPTConfig`` is rebuilt from the saved hyper-parameters.

    Example::

        gpt = load_gpt("runs/quickstart/lightning_logs/version_0/checkpoints/last.ckpt")
        out = gpt.generate(torch.tensor([[0]]), max_new_tokens=20)

    Args:
        path: A ``.ckpt`` file written by a Trainer fitting a ``GPTModule``.
        map_location: Where the weights are loaded (``"cpu"``, ``"cuda"``, ...).
        **overrides: ``GPTConfig`` fields to change for inference, e.g. ``attention="sdpa"`` for a model
            trained with flash-attn.
    """
    model = gpt_from_checkpoint(read_checkpoint(path, map_location=map_location), path, **overrides)
    if isinstance(map_location, (str, torch.device)):
        model.to(map_location)
    return model.eval()


def load_gpt_weights(model: GPT, path: Union[str, os.PathLike]) -> None:
    """Copy only the weights of a ``GPTModule`` checkpoint into ``model``, a GPT of the same architecture whose
    parameters are on a device (``GPTModule(init_from=...)``: fine-tuning from them)."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"model.init_from={str(path)!r}: the GPT was built on the meta device (sharded or empty-initialised), so the "
            "weights cannot be copied into it; fine-tune under a strategy that builds the model on a device (DDP, "
            "one device), or load the weights in configure_model after materialising them."
        )
    checkpoint = read_checkpoint(path)
    gptmodule_hparams(checkpoint, path)  # a GPTModule's checkpoint, or a clear error
    state = gpt_state_dict(checkpoint)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        shown = "; ".join(f"{k}: {list(a)} in the file, {list(b)} in the model" for k, a, b in wrong[:3])
        raise CheckpointError(
            f"model.init_from={str(path)!r} holds a GPT of another architecture than this run's"
            + (f" ({shown})" if shown else f" (missing {missing[:3]}, unexpected {unexpected[:3]})")
            + ": build the model with the checkpoint's preset, n_layer, n_head, n_embd, block_size and tokenizer "
            "(gpuopt fit --model.init_from takes them from the file: drop the options that differ)."
        )
    model.load_state_dict(state, strict=True)
