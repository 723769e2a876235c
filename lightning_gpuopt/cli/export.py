"""``gpuopt export CKPT OUT_DIR``: a ``GPTModule`` checkpoint (a ``.ckpt`` file or an FSDP2 checkpoint folder) as a
Hugging Face folder that ``transformers`` loads with no custom code (:func:`~lightning_gpuopt.model.hf.save_hf`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from contextlib import nullcontext
from typing import Optional

from lightning_gpuopt.model.checkpoint import CheckpointError
from lightning_gpuopt.model.hf import remove_killed_exports, save_hf
from lightning_gpuopt.model.hf_families import HFError
from lightning_gpuopt.run.lock import PathInUse, hold_output

__all__ = ["main"]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gpuopt export CKPT OUT_DIR [--dtype D] [--tokenizer PATH]``: write the folder; return the exit status."""
    import torch

    parser = argparse.ArgumentParser(prog="gpuopt export", description=(
        "Write a GPTModule checkpoint as a Hugging Face model folder (config.json, model.safetensors, "
        "generation_config.json and the run's tokenizer.json) that transformers.AutoModelForCausalLM.from_pretrained "
        "loads. An FSDP2 checkpoint folder is gathered on the CPU."))
    parser.add_argument("ckpt", type=Path, metavar="CKPT", help="a .ckpt file, or an FSDP2 checkpoint folder")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the folder to write (new, or empty)")
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None,
                        help="dtype of the weights written (default: the checkpoint's, float32)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                        help="tokenizer.json to write (default: the one the checkpoint's run carries)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    try:  # one writer: a second export into the same folder is refused, naming its pid, before the work
        lock = hold_output(args.out_dir, "gpuopt export", "OUT_DIR")
    except PathInUse as err:
        parser.exit(2, f"gpuopt export: error: {err}\n")
    try:
        with lock or nullcontext():
            if lock is not None:  # held: no live export owns a temporary folder of this output
                remove_killed_exports(args.out_dir)
            out = save_hf(args.ckpt, args.out_dir, tokenizer=args.tokenizer, dtype=dtype)
    except (HFError, CheckpointError) as err:
        parser.exit(2, f"gpuopt export: error: {err}\n")
    print(f"Wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}).")
    return 0
