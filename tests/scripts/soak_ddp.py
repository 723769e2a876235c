"""Soak run: 2-process DDP on CPU (gloo), thousands of tiny steps, a checkpoint every N steps.

    python soak_ddp.py OUT DATA_DIR STEPS EVERY

Each rank writes OUT/rss_rank{r}.json: its resident set size (VmRSS, bytes) after the warm-up and at the end.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt.callbacks import ExactResume  # noqa: E402
from lightning_gpuopt.data import TextDataModule  # noqa: E402
from lightning_gpuopt.model import GPTModule  # noqa: E402
from tests._process_exit import finish  # noqa: E402

WARMUP = 200  # steps before the first measurement: allocator pools, first checkpoints, caches


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RSSProbe(Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.samples = out, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARMUP and "warm" not in self.samples:
            self.samples["warm"] = rss()

    def on_train_end(self, trainer, pl_module):
        self.samples["end"] = rss()
        self.samples["steps"] = trainer.global_step
        (self.out / f"rss_rank{trainer.global_rank}.json").write_text(json.dumps(self.samples))


def main(out: Path, data_dir: Path, steps: int, every: int) -> None:
    torch.manual_seed(0)
    data = TextDataModule(source=str(data_dir / "texts"), cache_dir=str(data_dir / "cache"), block_size=16,
                          batch_size=2, vocab_size=300, num_workers=0, samples_per_epoch=400)
    module = GPTModule(n_layer=1, n_head=2, n_embd=32, vocab_size=320, dropout=0.1, warmup_steps=10)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[ExactResume(), RSSProbe(out),
                   ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1)],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
