"""The preemption recipe of docs/reliability.md, in a plain Trainer with a module and loader of its own.

    python preempt_plain.py OUT [--pause-at N] [--resume]

Trains ``NanoGPTModule`` (tests/_module_shapes.py) on its own DataLoader with the recipe's callbacks.
With ``--pause-at N`` it writes ``OUT/paused`` after micro-batch N and waits for SIGTERM. Every run
writes the global step it started at to ``OUT/start_step`` and, when it ends normally, its last step
to ``OUT/end_step``.
"""

import argparse
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from tests._module_shapes import NanoGPTModule, shape_loader  # noqa: E402
from lightning_gpuopt.callbacks import ExactResume  # noqa: E402
from lightning_gpuopt.checkpoint import AtomicCheckpointIO  # noqa: E402


class Pause(Callback):
    def __init__(self, out: Path, pause_at: int) -> None:
        self.out, self.pause_at, self.seen = out, pause_at, 0

    def on_train_start(self, trainer, pl_module):
        (self.out / "start_step").write_text(str(trainer.global_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.pause_at:
            (self.out / "paused").write_text("")
            deadline = time.monotonic() + 60
            while not trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--pause-at", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    ckpt_dir = args.out / "checkpoints"
    # --- the recipe ---
    trainer = Trainer(
        accelerator="cpu", max_steps=8, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out, plugins=[AtomicCheckpointIO()],
        callbacks=[
            ExactResume(),
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=100),
            OnExceptionCheckpoint(ckpt_dir),  # checkpoints/on_exception.ckpt when SIGTERM stops the fit
            Pause(args.out, args.pause_at),
        ],
    )
    try:
        trainer.fit(NanoGPTModule(), shape_loader("nanogpt", batch_size=2, n=64), ckpt_path="last")
    except SIGTERMException:
        sys.exit(128 + signal.SIGTERM)  # 143: stopped, not finished (Lightning's own exit status is 0)
    # --- end of the recipe ---
    (args.out / "end_step").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
