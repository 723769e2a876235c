"""How much of each training step MFUMonitor's own hooks take (target: under 1%).

Times the monitor's ``on_train_batch_start``/``on_train_batch_end`` with ``time.perf_counter`` around
the real hooks and compares with the mean step time of the same run.

    PYTHONPATH=. python benchmarks/monitor_overhead.py --steps 60 --batch-size 8 --seq-len 128

Measured on CPU (2 shared cores, tiny preset, B=8, T=128): step 54.4 ms, hooks 0.042 ms: 0.08 %.
"""

from __future__ import annotations

import argparse
import time

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks import MFUMonitor
from lightning_gpuopt.model import GPTModule


class TimedMFUMonitor(MFUMonitor):
    """MFUMonitor that adds up the time spent in its per-batch hooks."""

    hook_s = 0.0

    def on_train_batch_start(self, *args, **kwargs):
        t = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)
        self.hook_s += time.perf_counter() - t

    def on_train_batch_end(self, *args, **kwargs):
        t = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.hook_s += time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    data = torch.randint(0, 512, (args.steps, args.batch_size, args.seq_len + 1))
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    monitor = TimedMFUMonitor(log_every_n_steps=10, warmup_steps=3, peak_flops=1e12, report=False)
    trainer = Trainer(
        accelerator=accelerator, devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[monitor],
    )
    module = GPTModule(preset=args.preset, block_size=args.seq_len, warmup_steps=1)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(batches, batch_size=None))
    total = time.perf_counter() - start
    step_ms = 1000 * total / args.steps
    hook_ms = 1000 * monitor.hook_s / args.steps
    print(f"device={accelerator} preset={args.preset} B={args.batch_size} T={args.seq_len} steps={args.steps}")
    print(f"mean step time      {step_ms:8.3f} ms (whole fit / steps)")
    print(f"MFUMonitor hooks    {hook_ms:8.3f} ms per step")
    print(f"overhead            {100 * hook_ms / step_ms:8.3f} %")


if __name__ == "__main__":
    main()
