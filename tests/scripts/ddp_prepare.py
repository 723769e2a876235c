"""2-process DDP run on CPU (gloo) whose data preparation outlasts the process-group timeout.

The process group's timeout is 20 s (rank 1 must start and join within it) and rank 0's ``prepare_data`` takes longer (a sleep stands for
a long tokenisation of a large corpus). Lightning runs ``prepare_data`` on local rank 0 inside a
barrier of its own with no practical timeout; ``TextDataModule.setup`` on the other rank then only
checks the folder. Each rank writes what it saw to OUT/rank{r}.json.
"""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_gpuopt import GPTModule, TextDataModule  # noqa: E402
from tests._process_exit import finish  # noqa: E402

TIMEOUT_S = 20.0


class SlowTextDataModule(TextDataModule):
    prepared = 0

    def prepare_data(self) -> None:
        time.sleep(TIMEOUT_S + 5)  # longer than the process group's timeout
        SlowTextDataModule.prepared += 1
        super().prepare_data()


def main(text_dir: Path, out: Path) -> None:
    data = SlowTextDataModule(source=str(text_dir), cache_dir=str(out / "cache"), block_size=32, batch_size=4,
                              vocab_size=300, num_workers=0)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=TIMEOUT_S)), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=out,
    )
    trainer.fit(GPTModule(preset="tiny", vocab_size=300, block_size=32), datamodule=data)
    result = {
        "global_step": trainer.global_step,
        "prepared": SlowTextDataModule.prepared,
        "data_dir": str(data.data_dir),
        "splits": data._meta["splits"],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
