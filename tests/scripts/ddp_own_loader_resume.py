"""2-process DDP on CPU (gloo): a module's own shuffled DataLoader under ExactResume(rebuild_loaders=True).

    python ddp_own_loader_resume.py OUT

Runs 8 optimizer steps (5 per epoch, so into a second epoch) with a checkpoint every 3, then resumes
from the step-3 checkpoint (mid-epoch) in the same processes. Each rank writes OUT/rank{r}.json:
per (epoch, batch index), the loss and the first token of each sample, for both runs.
"""

import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt.callbacks import ExactResume  # noqa: E402
from tests._module_shapes import NanoGPTModule, shape_loader  # noqa: E402
from tests._process_exit import finish  # noqa: E402


class Rows(Callback):
    def __init__(self) -> None:
        self.rows = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        key = f"{trainer.current_epoch},{batch_idx}"
        self.rows[key] = [float(outputs["loss"].detach()), batch[0][:, 0].tolist()]


def fit(out: Path, ckpt=None) -> dict:
    torch.manual_seed(0)
    module = NanoGPTModule()
    torch.manual_seed(1234)
    rows = Rows()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=8, accumulate_grad_batches=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[ExactResume(rebuild_loaders=True), rows,
                   ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, save_top_k=-1)],
    )
    # Seeded per rank, as a careless script might: rank 0's seed must give every rank the same order to shard.
    generator = torch.Generator().manual_seed(42 + int(os.environ.get("LOCAL_RANK", 0)))
    loader = DataLoader(shape_loader("nanogpt", n=40).dataset, batch_size=2, shuffle=True, generator=generator)
    trainer.fit(module, loader, ckpt_path=ckpt)
    return rows.rows, trainer.global_rank


def main(out: Path) -> None:
    reference, rank = fit(out / "ref")
    step3 = next((out / "ref" / "ckpt").glob("*step=3.ckpt"))
    resumed, _ = fit(out / "resumed", ckpt=str(step3))
    (out / f"rank{rank}.json").write_text(json.dumps({"reference": reference, "resumed": resumed}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
