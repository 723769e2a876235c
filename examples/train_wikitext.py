"""Train a GPT on WikiText (or any text) from Python, with the flags people already use.

The same job as ``gpuopt fit``, written out as a script to read and adapt::

    python examples/train_wikitext.py --data_dir data/wikitext-103-raw --max_steps 3000 \\
        --d_model 768 --num_layers 12 --num_heads 12 --batch_size 32 --gradient_accumulation_steps 1 \\
        --mixed_precision bf16 --checkpoint_dir checkpoints/gpt-124m

    # CPU smoke run on the offline default corpus:
    python examples/train_wikitext.py --data_dir stdlib --max_steps 50 --d_model 64 --num_layers 2 \\
        --num_heads 4 --block_size 64 --batch_size 8

It runs the package's stack, as ``gpuopt fit`` does: the precision for the device (``--mixed_precision``
alone or left out: ``BF16Precision`` on a GPU, float32 on a CPU, where bf16 autocast is slower; ``fp8`` for
``Float8Precision``), ``CUDASettings``, ``MFUMonitor``, ``NonFiniteGuard``, ``ExactResume``, atomic
checkpoint writes, and with ``--checkpoint_dir`` a ``last.ckpt`` every 500 optimizer steps that
``--resume`` continues from (also after a SIGTERM or a first Ctrl-C, which save one). Without
``--data_dir`` it reads WikiText-103 from ``data/wikitext-103-raw`` (README, "Getting WikiText-103"), and
says what to pass when that folder is not there.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from lightning_gpuopt import GPTModule, TextDataModule
from lightning_gpuopt.callbacks import CUDASettings, ExactResume, MFUMonitor, NonFiniteGuard, SigtermCheckpoint
from lightning_gpuopt.callbacks.progress_bar import default_progress_bar
from lightning_gpuopt.checkpoint import AtomicCheckpointIO
from lightning_gpuopt.cli.defaults import stack_device_type, stack_precision_plugins
from lightning_gpuopt.cli.quiet import quiet_lightning
from lightning_gpuopt.cli.run_summary import model_line
from lightning_gpuopt.precision import BF16Precision, Float8Precision

PRECISIONS = ("auto", "bf16", "fp8", "fp16", "no")
WIKITEXT_103 = Path("data/wikitext-103-raw")
CPU_COMMAND = ("python examples/train_wikitext.py --data_dir stdlib --max_steps 50 --d_model 64 --num_layers 2 "
               "--num_heads 4 --block_size 64 --batch_size 8")


def auto_precision() -> str:
    """What ``--mixed_precision auto`` trains in: the ``gpuopt`` stack's choice for this device (bf16 on a GPU,
    no autocast on a CPU), said in one line."""
    if stack_precision_plugins(stack_device_type()):
        return "bf16"
    print("train_wikitext.py: float32 on the CPU (bf16 autocast is 5-10x slower there); --mixed_precision bf16 uses it anyway.")
    return "no"


def data_dir(given: Optional[str]) -> str:
    """``--data_dir``, or WikiText-103's folder; when that is missing, stop with one line saying what to pass."""
    if given is not None:
        return given
    if WIKITEXT_103.is_dir():
        return str(WIKITEXT_103)
    raise SystemExit(
        f"train_wikitext.py: no --data_dir, and WikiText-103 is not in {WIKITEXT_103}/ (README, \"Getting WikiText-103\"): "
        f"pass --data_dir DIR for your text, or --data_dir stdlib for the offline corpus; a CPU run: {CPU_COMMAND}"
    )


def precision_setting(name: str) -> dict:
    """Trainer keyword arguments for a ``--mixed_precision`` value: our plugins for bf16/fp8, Lightning's strings else."""
    if name == "auto":
        name = auto_precision()
    if name == "bf16":
        return {"plugins": [BF16Precision()]}  # bf16 autocast; fp16 + GradScaler on GPUs without bf16
    if name == "fp8":
        return {"plugins": [Float8Precision()]}  # torchao float8 (H100/L4/B200); use with --compile
    return {"precision": {"fp16": "16-mixed", "no": "32-true"}[name]}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default=None,
                   help=f"folder with wiki.{{train,valid,test}}.raw, any text folder/file/glob, or 'stdlib' (default: {WIKITEXT_103})")
    p.add_argument("--max_steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--d_model", type=int, default=768, help="model width (n_embd)")
    p.add_argument("--num_layers", type=int, default=12, help="transformer blocks")
    p.add_argument("--num_heads", type=int, default=12, help="attention heads (must divide d_model)")
    p.add_argument("--block_size", type=int, default=1024, help="sequence length")
    p.add_argument("--vocab_size", type=int, default=32768, help="BPE vocabulary trained on the text")
    p.add_argument("--batch_size", type=int, default=32, help="micro-batch per device")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--learning_rate", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--mixed_precision", choices=PRECISIONS, nargs="?", const="auto", default="auto",
                   help="auto (alone or left out): bf16 on a GPU, float32 on a CPU; bf16 / fp8: our plugins; fp16, no: Lightning's")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint_dir", default=None, help="where last.ckpt is kept (no checkpoints if unset)")
    p.add_argument("--checkpoint_every", type=int, default=500, help="optimizer steps between saves of last.ckpt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint_dir/last.ckpt")
    p.add_argument("--val_every", type=int, default=500, help="optimizer steps between validation runs")
    p.add_argument("--num_workers", type=int, default=2, help="DataLoader workers (TextDataModule's default)")
    p.add_argument("--seed", type=int, default=1337, help="random seed")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> pl.Trainer:
    args = parse_args(argv)
    source = data_dir(args.data_dir)
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("--resume continues from --checkpoint_dir/last.ckpt: also give --checkpoint_dir.")
    pl.seed_everything(args.seed, verbose=False)
    data = TextDataModule(
        source=source,
        block_size=args.block_size,
        batch_size=args.batch_size,
        vocab_size=args.vocab_size,
        num_workers=args.num_workers,
    )
    model = GPTModule(
        preset="124m",
        n_embd=args.d_model,
        n_layer=args.num_layers,
        n_head=args.num_heads,
        block_size=args.block_size,
        vocab_size=data.vocab_size,
        learning_rate=args.learning_rate,
        warmup_steps=min(args.warmup_steps, args.max_steps),
        compile=args.compile,
    )
    callbacks: list[pl.Callback] = [
        CUDASettings(),  # TF32, cuDNN benchmark, SDPA backends, expandable segments
        MFUMonitor(),  # tokens/s and MFU in the progress bar, end-of-fit report
        NonFiniteGuard(),  # skip a step with a NaN/Inf loss or gradient
        ExactResume(),  # a resumed run continues exactly
        LearningRateMonitor(logging_interval="step"),
        default_progress_bar(),  # Lightning's bar, without "Epoch 0/-2" and "v_num: 0.000", counting a resume right
    ]
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0,
                                         every_n_train_steps=args.checkpoint_every, enable_version_counter=False))
        callbacks.append(SigtermCheckpoint())  # SIGTERM or a first Ctrl-C writes last.ckpt there
    setting = precision_setting(args.mixed_precision)
    print(model_line(model))
    with quiet_lightning():  # Lightning's tensorboardX notice and service tips, as gpuopt leaves them out
        trainer = pl.Trainer(
            max_steps=args.max_steps,
            accumulate_grad_batches=args.gradient_accumulation_steps,
            **{**setting, "plugins": [*setting.get("plugins", []), AtomicCheckpointIO()]},
            gradient_clip_val=1.0,
            callbacks=callbacks,
            enable_checkpointing=bool(args.checkpoint_dir),
            # val_check_interval counts micro-batches; counted across epochs, so it may exceed one epoch's batches.
            val_check_interval=min(args.val_every, args.max_steps) * args.gradient_accumulation_steps,
            check_val_every_n_epoch=None,
            limit_val_batches=50,
            log_every_n_steps=10,
            enable_model_summary=False,  # one line on the model instead (the table counts no parameters before fit)
        )
        trainer.fit(model, datamodule=data, ckpt_path="last" if args.resume else None)
    return trainer


if __name__ == "__main__":
    main()
