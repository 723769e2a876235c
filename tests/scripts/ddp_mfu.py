"""2-process DDP run on CPU (gloo) with MFUMonitor; each rank writes what it measured to OUT/rank{r}.json."""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from tests.callbacks._mfu_helpers import ClockedGPTModule, FakeClock, TokenBatches, loader  # noqa: E402
from lightning_gpuopt.callbacks import MFUMonitor  # noqa: E402
from tests._process_exit import finish  # noqa: E402


def main(out: Path) -> None:
    torch.manual_seed(0)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=out,
        callbacks=[monitor], use_distributed_sampler=False,
    )
    module = ClockedGPTModule(FakeClock(), 0.0, preset="tiny")
    trainer.fit(module, loader(TokenBatches(8, 2, 32)))
    result = {
        "world_size": trainer.world_size,
        "history": monitor.history,
        "flops_per_token": module.model.flops_per_token(32),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
