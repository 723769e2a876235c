"""Train a GPT on WikiText (or any text) from Python, with the flags people already use.

The same job as ``gpuopt fit``, written out as a script to read and adapt::

    python examples/train_wikitext.py --data_dir data/wikitext-103-raw --max_steps 3000 \\
        --d_model 768 --num_layers 12 --num_heads 12 --batch_size 32 --gradient_accumulation_steps 1 \\
        --mixed_precision bf16 --checkpoint_dir checkpoints/gpt-124m

    # CPU smoke run on the offline default corpus:
    python examples/train_wikitext.py --data_dir stdlib --max_steps 50 --d_model 64 --num_layers 2 \\
        --num_heads 4 --block_size 64 --batch_size 8
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from lightning_gpuopt import GPTModule, TextDataModule

# --mixed_precision value -> Lightning Trainer precision
PRECISIONS = {"bf16": "bf16-mixed", "fp16": "16-mixed", "no": "32-true"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default="data/wikitext-103-raw",
                   help="folder with wiki.{train,valid,test}.raw, any text folder/file/glob, or 'stdlib'")
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
    p.add_argument("--mixed_precision", choices=sorted(PRECISIONS), default="bf16", help="autocast dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint_dir", default=None, help="where to save checkpoints (none if unset)")
    p.add_argument("--num_workers", type=int, default=4, help="DataLoader workers")
    p.add_argument("--seed", type=int, default=1337, help="random seed")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> pl.Trainer:
    args = parse_args(argv)
    pl.seed_everything(args.seed)
    data = TextDataModule(
        source=args.data_dir,
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
    callbacks: list[pl.Callback] = [LearningRateMonitor(logging_interval="step")]
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, every_n_train_steps=500))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accumulate_grad_batches=args.gradient_accumulation_steps,
        precision=PRECISIONS[args.mixed_precision],
        gradient_clip_val=1.0,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_dir),
        val_check_interval=min(500, args.max_steps),
        limit_val_batches=50,
        log_every_n_steps=10,
    )
    trainer.fit(model, datamodule=data)
    return trainer


if __name__ == "__main__":
    main()
