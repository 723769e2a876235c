"""Hugging Face model folders in and out: :func:`load_hf` reads a ``transformers`` causal-LM folder (``config.json``,
``*.safetensors``) into a :class:`GPT`; :func:`save_hf` writes one that ``AutoModelForCausalLM.from_pretrained``
loads with no custom code. The families, the ``config.json`` fields honoured and the rules: ``docs/huggingface.md``.

Everything that can be refused is refused before a weight is read: the architecture and every field from
``config.json``, then the name and shape of every tensor from the safetensors headers."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_gpuopt.internals import load_distributed_checkpoint
from lightning_gpuopt.model.checkpoint import check_weights, gpt_from_checkpoint, read_checkpoint
from lightning_gpuopt.model.config import GPTConfig
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.hf_families import HF_FAMILIES, HFError, HFFamily, family_of, transposed, weight_names

__all__ = [
    "END_OF_TEXT_TOKENS",
    "hf_architecture",
    "is_hf_folder",
    "load_hf",
    "remove_killed_exports",
    "load_hf_weights",
    "resolve_hf",
    "save_hf",
    "write_hf_folder",
]

# The tokens that end a text, first found first taken: GPT-2's and Qwen2's, Llama 3's, Llama 2's. Kept equal
# to data/tokenizer.py's END_OF_TEXT_TOKENS (tested): model/ does not import data/.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>")

# Tensors of a folder that are not weights (buffers older transformers versions saved): read past.
_NOT_WEIGHTS = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


# ------------------------------------------------------------------------------------------------ the folder
def resolve_hf(path: Union[str, os.PathLike]) -> Path:
    """The local folder of ``path``: a folder as given, or ``hf:NAME`` (a Hub repository) downloaded through
    ``huggingface_hub`` (its config, tokenizer and safetensors only; refused clearly offline)."""
    text = os.fspath(path)
    if not text.startswith("hf:"):
        folder = Path(text).expanduser()
        if not folder.is_dir():
            raise HFError(f"{text!r} is not a folder: give a Hugging Face model folder (config.json and *.safetensors) "
                          "or hf:NAME for a Hub repository.")
        return folder
    name = text[3:]
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:  # pragma: no cover - tokenizers needs it
        raise HFError(f"{text!r}: downloading from the Hub needs huggingface_hub: pip install huggingface_hub") from err
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model"]))
    except Exception as err:  # offline, unknown name, gated model: huggingface_hub raises several kinds
        raise HFError(
            f"{text!r} could not be downloaded from the Hugging Face Hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Without a network (or with HF_HUB_OFFLINE=1) only "
            "models already in the Hub's cache load: download it where there is one (huggingface-cli download "
            "NAME), or give the model's local folder."
        ) from err


def is_hf_folder(path: Any) -> bool:
    """Whether ``path`` names a Hugging Face model (``hf:NAME``, or a folder holding ``config.json``)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    return text.startswith("hf:") or (Path(text).expanduser() / "config.json").is_file()


def _read_config(folder: Path) -> tuple[dict[str, Any], HFFamily]:
    where = str(folder)
    file = folder / "config.json"
    if not file.is_file():
        raise HFError(f"{where!r} has no config.json: give the folder transformers' save_pretrained wrote.")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HFError(f"{str(file)!r} is not valid JSON: {err}") from err
    classes = hf.get("architectures") or []
    known = [c for c in classes if c in HF_FAMILIES]
    if not known:
        shown = classes or f"model_type {hf.get('model_type')!r}, no architectures"
        raise HFError(f"{where!r} holds a {shown} model, which load_hf does not read: supported are "
                      f"{', '.join(HF_FAMILIES)} (docs/huggingface.md).")
    return hf, HF_FAMILIES[known[0]]


def hf_architecture(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The ``GPTConfig`` fields of a Hugging Face folder's ``config.json`` (no weight is read), or an
    :class:`HFError` naming what the GPT does not support."""
    folder = resolve_hf(path)
    hf, family = _read_config(folder)
    fields = family.to_config(hf, str(folder))
    try:
        GPTConfig(**fields)
    except ValueError as err:
        raise HFError(f"{str(folder)!r}: its config.json does not make a valid GPTConfig: {err}") from err
    return fields


def _safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (an index's shards, or every ``*.safetensors``); a pickle-only folder refused."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise HFError(f"{str(folder)!r}: model.safetensors.index.json names shards that are not there: "
                          f"{missing[:3]}.")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for pattern in _PICKLES for p in folder.glob(pattern))
    if pickles:
        raise HFError(
            f"{str(folder)!r} holds its weights only as pickles ({', '.join(pickles[:3])}), which are not read: "
            "unpickling runs whatever code the file holds. Convert them to safetensors where you trust them "
            "(AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out) writes model.safetensors)."
        )
    raise HFError(f"{str(folder)!r} holds no *.safetensors weights: give the folder save_pretrained wrote.")


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # the header only
            for name in f.keys():
                if not _NOT_WEIGHTS.search(name):
                    shapes[name] = (tuple(f.get_slice(name).get_shape()), file)
    return shapes


def _expected_shape(ours: str, shape: tuple[int, ...], config: GPTConfig) -> tuple[int, ...]:
    """The shape the family stores our tensor ``ours`` (of ``shape``) in: the vocabulary unpadded, Conv1D in x out."""
    if ours in ("transformer.wte.weight", "lm_head.weight"):
        shape = (config.vocab_size, *shape[1:])
    if transposed(config, ours):
        shape = shape[::-1]
    return shape


def _plan(folder: Path, model: GPT, family: HFFamily) -> dict[str, tuple[str, Path]]:
    """Our name -> (the folder's name, its file), after checking every name and shape from the headers alone."""
    shapes = _tensor_shapes(_safetensors_files(folder))
    names = weight_names(model)
    if model.config.tie_embeddings:
        shapes.pop("lm_head.weight", None)  # some writers store the tied head too: the embedding is read
    own = model.state_dict()
    missing = [theirs for theirs in names.values() if theirs not in shapes]
    unexpected = sorted(set(shapes) - set(names.values()))
    wanted = {ours: _expected_shape(ours, tuple(own[ours].shape), model.config) for ours in names}
    wrong = [
        f"{theirs} {list(shapes[theirs][0])} in the folder, {list(wanted[ours])} expected"
        for ours, theirs in names.items()
        if theirs in shapes and shapes[theirs][0] != wanted[ours]
    ]
    if missing or unexpected or wrong:
        problems = (
            ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected else [])
            + (["; ".join(wrong[:3])] if wrong else [])
        )
        raise HFError(f"The weights in {str(folder)!r} do not match its config.json ({family.hf_class}): "
                      + "; ".join(problems) + ". Nothing was loaded: is the folder whole, and its config.json its own?")
    return {ours: (theirs, shapes[theirs][1]) for ours, theirs in names.items()}


def _read_weights(folder: Path, model: GPT, family: HFFamily) -> dict[str, Tensor]:
    """Our state dict from the folder: the vocabulary padded with zero rows, Conv1D weights transposed."""
    from safetensors import safe_open

    plan = _plan(folder, model, family)
    own = model.state_dict()
    state: dict[str, Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for ours, (_, file) in plan.items():
        by_file.setdefault(file, []).append(ours)
    for file, ours_names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for ours in ours_names:
                tensor = f.get_tensor(plan[ours][0])
                if transposed(model.config, ours):
                    tensor = tensor.t()
                target = torch.zeros_like(own[ours], device="cpu")  # (padded_vocab, C) for the vocabulary
                target[: tensor.size(0)] = tensor.to(target.dtype)
                state[ours] = target
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_hf_weights(model: GPT, path: Union[str, os.PathLike]) -> None:
    """Copy a Hugging Face folder's weights into ``model``, a GPT built from its architecture
    (:func:`hf_architecture`), checked whole before anything is copied (``GPTModule(init_from=folder)``)."""
    folder = resolve_hf(path)
    hf, family = _read_config(folder)
    want = family.to_config(hf, str(folder))
    have = {k: getattr(model.config, k) for k in want}
    if have != want:
        differ = {k: (want[k], have[k]) for k in want if want[k] != have[k]}
        raise HFError(f"{str(folder)!r} holds another architecture than the GPT's: {differ} (folder, GPT).")
    if any(p.is_meta for p in model.parameters()):
        raise HFError(
            f"model.init_from={str(folder)!r}: the GPT was built on the meta device, so the weights cannot be copied "
            "into it; fine-tune under a strategy that builds the model on a device (DDP, one device)."
        )
    state = _read_weights(folder, model, family)
    # the one check of every door weights enter by (names, shapes, finite), before any is copied into the GPT
    check_weights(state, folder, model.config, f"safetensors.torch.load_file on the files of {str(folder)!r} reads "
                  "their tensors as they are")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[name])


def load_hf(path: Union[str, os.PathLike], map_location: Union[str, torch.device] = "cpu", **overrides: Any) -> GPT:
    """Load a Hugging Face causal-LM folder (or ``hf:NAME``) into a :class:`GPT` in eval mode, in float32.

    The vocabulary is padded to ``GPTConfig.padding_multiple`` with zero rows (never generated: generation reads
    the first ``vocab_size`` logits). The families and the ``config.json`` fields read: ``docs/huggingface.md``.

    Example::

        gpt = load_hf("path/to/gpt2")          # a folder written by save_pretrained, or "hf:openai-community/gpt2"
        out = gpt.generate(torch.tensor([[464]]), max_new_tokens=20, temperature=0)

    Args:
        path: The folder (``config.json`` and ``*.safetensors``; sharded too), or ``hf:NAME``.
        map_location: Where the model is put.
        **overrides: ``GPTConfig`` fields beside the architecture, e.g. ``attention="flash-attn"``.
    """
    folder = resolve_hf(path)
    fields = hf_architecture(folder)
    clash = sorted(set(overrides) & set(fields))
    if clash:
        raise HFError(f"load_hf: {clash} come from {str(folder)!r}'s config.json and cannot be overridden.")
    model = GPT(GPTConfig(**fields, **overrides))
    load_hf_weights(model, folder)
    return model.to(map_location).eval()


# ------------------------------------------------------------------------------------------------ export
def _end_of_text_id(tokenizer_json: Optional[str]) -> Optional[int]:
    if not tokenizer_json:
        return None
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
    return next((added[t] for t in END_OF_TEXT_TOKENS if t in added), None)


def _hf_config(config: GPTConfig, family: HFFamily, eos: Optional[int], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json``: plain JSON, written without transformers (its version recorded where it is installed)."""
    try:
        version = {"transformers_version": importlib.metadata.version("transformers")}
    except importlib.metadata.PackageNotFoundError:
        version = {}
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [family.hf_class], "model_type": family.model_type, **family.to_hf(config),
        "bos_token_id": eos, "eos_token_id": eos, "dtype": name, "torch_dtype": name, **version,
    }  # "dtype" for transformers 5, "torch_dtype" for 4.x and the servers that read it


def _export_tensors(model: GPT, family: HFFamily, dtype: torch.dtype) -> dict[str, Tensor]:
    """The family's tensors: the vocabulary trimmed to ``vocab_size``, Conv1D weights transposed, contiguous."""
    state = model.state_dict()
    out = {}
    for ours, theirs in weight_names(model).items():
        tensor = state[ours].detach().to("cpu")
        if ours in ("transformer.wte.weight", "lm_head.weight"):
            tensor = tensor[: model.config.vocab_size]
        if transposed(model.config, ours):
            tensor = tensor.t()
        out[theirs] = tensor.to(dtype).contiguous().clone()  # clone: no storage shared with the tied head
    return out


def _check_writable(out_dir: Path) -> None:
    """Refuse an output the folder cannot be written to, before any work."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFError(f"save_hf: {str(out_dir)!r} exists and is not an empty folder: give a new folder, or remove it.")
    parent = out_dir.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise HFError(f"save_hf: {str(out_dir)!r} cannot be written: {str(parent)!r} is not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HFError(f"save_hf: {str(out_dir)!r} cannot be written ({str(parent)!r} is not writable): give a folder "
                      "you may write to.")


def _temp_prefix(out_dir: Path) -> str:
    """The name's start of the temporary folder an export of ``out_dir`` writes in, beside it."""
    return f".{out_dir.name}.export-"


def remove_killed_exports(out_dir: Union[str, os.PathLike]) -> list[Path]:
    """Remove the temporary folders that exports of ``out_dir`` killed mid-write (``kill -9``) left beside it, each
    a whole model's weights; return them. Call it only while holding ``out_dir``'s one-writer lock (``gpuopt export``
    does): a live export's temporary folder is then not among them."""
    out_dir = Path(out_dir).expanduser()
    if not out_dir.parent.is_dir():
        return []
    killed = [p for p in out_dir.parent.glob(f"{glob.escape(_temp_prefix(out_dir))}*") if p.is_dir()]
    for folder in killed:
        shutil.rmtree(folder, ignore_errors=True)
    return killed


def _public_modes(folder: Path) -> None:
    """Give ``folder`` and its files the modes the umask gives (as ``save_pretrained`` leaves them): ``mkdtemp`` makes
    it 0700 and safetensors writes 0600, which a server run by another user could not read."""
    umask = os.umask(0)  # the only way to read it; put back at once
    os.umask(umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)
    folder.chmod(0o777 & ~umask)


def write_hf_folder(model: GPT, out_dir: Union[str, os.PathLike], tokenizer_json: Optional[str] = None,
                    dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``model`` as a Hugging Face folder (see :func:`save_hf`; no ``tokenizer.json`` without ``tokenizer_json``),
    built in a temporary folder beside ``out_dir`` and renamed into place, so a folder is there whole or not at all."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir).expanduser()
    _check_writable(out_dir)
    family = family_of(model.config)
    dtype = dtype or next(model.parameters()).dtype
    eos = _end_of_text_id(tokenizer_json)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_dir), dir=out_dir.parent))
    try:
        save_file(_export_tensors(model, family, dtype), str(temp / "model.safetensors"), metadata={"format": "pt"})
        (temp / "config.json").write_text(json.dumps(_hf_config(model.config, family, eos, dtype), indent=2) + "\n")
        generation = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
        (temp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer_json is not None:
            (temp / "tokenizer.json").write_text(tokenizer_json)
        _public_modes(temp)
        if out_dir.exists():
            out_dir.rmdir()  # an empty folder (checked): the rename needs the name free
        temp.rename(out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out_dir


def _checkpoint_of(path: Path) -> dict[str, Any]:
    """A ``GPTModule`` checkpoint file, or an FSDP2 (distributed) checkpoint folder gathered whole on the CPU."""
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise HFError(f"save_hf: {str(path)!r} is a folder but not a distributed checkpoint (no .metadata): give a "
                          ".ckpt file or an FSDP2 checkpoint folder written by a Trainer.")
        return load_distributed_checkpoint(path)
    return read_checkpoint(path)


def _run_tokenizer(checkpoint: dict[str, Any]) -> Optional[str]:
    """The tokenizer JSON a checkpoint's data state carries (``TextDataModule`` saves it), or ``None``."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer_json"), str):
            return value["tokenizer_json"]
    return None


def _tokenizer_text(tokenizer: Any) -> Optional[str]:
    if tokenizer is None or isinstance(tokenizer, str) and tokenizer.lstrip().startswith("{"):
        return tokenizer
    if hasattr(tokenizer, "to_str"):  # a tokenizers.Tokenizer
        return tokenizer.to_str()
    file = Path(os.fspath(tokenizer)).expanduser()
    if not file.is_file():
        raise HFError(f"save_hf: tokenizer={str(file)!r} is not a file: give the run's tokenizer.json.")
    return file.read_text()


def save_hf(source: Any, out_dir: Union[str, os.PathLike], tokenizer: Any = None,
            dtype: Optional[torch.dtype] = None) -> Path:
    """Write a GPT as a Hugging Face folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with no
    custom code: ``config.json``, ``model.safetensors`` (the vocabulary trimmed to ``vocab_size``),
    ``generation_config.json`` and the run's ``tokenizer.json``. Written in a temporary folder and renamed.

    Example::

        save_hf("runs/ft/lightning_logs/version_0/checkpoints/last.ckpt", "exported/")  # or a GPT, or a GPTModule
        AutoModelForCausalLM.from_pretrained("exported/")

    Args:
        source: A :class:`GPT`, a ``GPTModule``, or the path of a ``GPTModule`` checkpoint: a ``.ckpt`` file or an FSDP2
            checkpoint folder (gathered on the CPU).
        out_dir: The folder to write; it must not exist, or be empty.
        tokenizer: A ``tokenizer.json`` path, a ``tokenizers.Tokenizer`` or its JSON; ``None``: the checkpoint's
            (the run's), and for a model without one, no ``tokenizer.json`` (said with a warning).
        dtype: The dtype of the weights written; ``None``: the model's (float32 from a checkpoint).
    """
    _check_writable(Path(out_dir).expanduser())  # before a checkpoint is read
    text = _tokenizer_text(tokenizer)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        checkpoint = _checkpoint_of(path)
        model = gpt_from_checkpoint(checkpoint, path)
        text = text if text is not None else _run_tokenizer(checkpoint)
    else:
        model = source if isinstance(source, GPT) else getattr(source, "model", None)
        if not isinstance(model, GPT):
            raise HFError(f"save_hf: {type(source).__name__} is not a GPT, a GPTModule with its model built, or a "
                          "checkpoint path.")
    if text is None:
        warnings.warn(f"save_hf: no tokenizer was given, so {str(out_dir)!r} gets no tokenizer.json; pass tokenizer= "
                      "(the run's tokenizer.json) for a folder transformers can generate text with.", stacklevel=2)
    return write_hf_folder(model, out_dir, text, dtype)
