"""2 processes on CPU (DDP, or FSDP2 with `fsdp2` as the second argument): AutoBatchSize with a different
memory limit on each rank (run by test_auto_batch_size)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_gpuopt.callbacks import AutoBatchSize  # noqa: E402
from tests._process_exit import finish  # noqa: E402
from tests.callbacks.auto_batch._helpers import OOMAbove, StepRecorder, TokenData  # noqa: E402


class RankLimited(OOMAbove):
    def _limit(self):
        return 6 if self.trainer.global_rank == 0 else 3


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def main(out: Path, strategy: str) -> None:
    torch.manual_seed(0)
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    search = AutoBatchSize(global_batch_size=16, max_micro_batch_size=16)
    recorder = StepRecorder()
    data = TokenData(batch_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[search, recorder],
    )
    module = RankLimited()
    trainer.fit(module, datamodule=data)
    result = dict(
        micro=search.micro_batch_size,
        accumulate=search.accumulate_grad_batches,
        batch_size=data.batch_size,
        global_step=trainer.global_step,
        micro_batches=recorder.micro_batches,
        trials=[[t.micro_batch_size, t.fits] for t in search.trials],
        weights_sum=float(sum(_full(p).double().sum() for p in module.parameters())),
    )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ddp")
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
