"""A tiny GPT fit that writes every micro-batch's loss, for the exact-resume tests.

    python resume_fit.py OUT --data-dir D [--ckpt PATH] [--pause-at N | --fail-at N] [--devices 2 --strategy ddp|fsdp]
                         [--accelerator gpu --bf16] [--auto-batch MAX_MICRO_BATCH]
                         [--strategy fsdp-atomic --kill-on-save N]

Each rank appends ``epoch batch_idx global_step loss`` (loss as float.hex) to ``OUT/losses_rank{r}.txt``
after every micro-batch, flushed, so a killed run leaves what it did. With ``--pause-at N`` the run
stops after micro-batch N (counted from the start of this process), writes ``OUT/paused``, and waits
for a signal (SIGTERM: Lightning sets ``trainer.received_sigterm`` and ``OnExceptionCheckpoint``
saves; SIGKILL: nothing is saved). With ``--fail-at N`` the model's forward raises in micro-batch N
(after the dropout draws), and ``OnExceptionCheckpoint`` saves. ModelCheckpoint saves ``OUT/ckpt/last``
every 3 optimizer steps.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt.callbacks import AutoBatchSize, ExactResume, MFUMonitor  # noqa: E402
from lightning_gpuopt.data import TextDataModule  # noqa: E402
from lightning_gpuopt.model import GPTModule  # noqa: E402
from lightning_gpuopt.precision import BF16Precision  # noqa: E402
from tests._process_exit import finish  # noqa: E402


class InjectedFailure(RuntimeError):
    pass


class LossWriter(Callback):
    def __init__(self, out: Path, pause_at: int, fail_at: int = 0) -> None:
        self.out, self.pause_at, self.fail_at, self.seen = out, pause_at, fail_at, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.fail_at and self.seen + 1 == self.fail_at:
            def fail(module, args, output):
                raise InjectedFailure(f"injected failure in micro-batch {batch_idx}")

            pl_module.model.transformer.ln_f.register_forward_hook(fail)  # (training never calls lm_head: the loss uses its weight)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(outputs["loss"].detach())
        with open(self.out / f"losses_rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {trainer.global_step} {loss.hex()}\n")
        self.seen += 1
        if self.seen == self.pause_at:
            (self.out / f"paused{trainer.global_rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.02)


def kill_after_writing(n: int) -> None:
    """A kill in the middle of the n-th distributed checkpoint save: after the shards, before anything else."""
    import signal

    from lightning.pytorch.strategies import model_parallel

    original, calls = model_parallel._distributed_checkpoint_save, []

    def save(state, path):
        original(state, path)  # every rank's shard and the .metadata are on disk when this returns
        calls.append(path)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)

    model_parallel._distributed_checkpoint_save = save


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--pause-at", type=int, default=0)
    p.add_argument("--fail-at", type=int, default=0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--bf16", action="store_true", help="train under BF16Precision")
    p.add_argument("--auto-batch", type=int, default=0, help="add AutoBatchSize(max_micro_batch_size=N)")
    p.add_argument("--kill-on-save", type=int, default=0,
                   help="SIGKILL every rank once its shard of the N-th distributed checkpoint is written")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    strategy = args.strategy
    if strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif strategy == "fsdp-atomic":
        from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy

        strategy = AtomicModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    if args.kill_on_save:
        kill_after_writing(args.kill_on_save)
    data = TextDataModule(
        source=str(Path(args.data_dir) / "texts"), cache_dir=str(Path(args.data_dir) / "cache"), block_size=16,
        batch_size=2, vocab_size=300, num_workers=0, samples_per_epoch=20 * args.devices,
    )
    module = GPTModule(n_layer=2, n_head=2, n_embd=32, vocab_size=320, dropout=0.1, warmup_steps=3, learning_rate=1e-2)
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12, prog_bar=False)
    trainer = Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        plugins=[BF16Precision()] if args.bf16 else None,
        accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
        callbacks=[
            ExactResume(), monitor, LossWriter(args.out, args.pause_at, args.fail_at),
            ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=0),
            OnExceptionCheckpoint(args.out / "ckpt", filename="on_exception"),
            *([AutoBatchSize(max_micro_batch_size=args.auto_batch)] if args.auto_batch else []),
        ],
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt)
    if trainer.is_global_zero:
        (args.out / "mfu.txt").write_text(f"{len(monitor.history)} {monitor.total_tokens}\n")
        (args.out / "micro_batch.txt").write_text(f"{data.batch_size} {trainer.accumulate_grad_batches}\n")


if __name__ == "__main__":
    main()
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
