"""Fits of the Llama-style tiny GPT under a 2D (data x tensor) mesh, writing every micro-batch's loss.

    python tp_fit.py OUT --data-dir D [--dp 2 --tp 2] [--nodes 2] [--runs fp32,fp8] [--pause-at N] [--ckpt PATH]

Runs each of ``--runs`` (``fp32``; ``fp8``: ``Float8Precision(emulate=True)``, every projection but the head converted) one
after the other in the same processes, into ``OUT/<run>``. Each rank appends ``epoch batch_idx global_step loss``
(loss as float.hex) to ``OUT/<run>/losses_rank{r}.txt`` after every micro-batch. The stack is the package's:
ExactResume, MFUMonitor, NonFiniteGuard, AutoBatchSize, SigtermCheckpoint and a ModelCheckpoint writing
``OUT/<run>/ckpt/last.ckpt`` every 3 steps, under ``AtomicModelParallelStrategy(dp, tp)``. With ``--pause-at N``
every rank waits after micro-batch N until ``OUT/go`` exists (the test signals a node meanwhile). With
``--nodes 2`` this launch is one of two "nodes" (``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from the
environment, as a cluster sets them); it runs ``dp * tp / nodes`` processes. Rank 0 writes what the callbacks
saw to ``OUT/<run>/report.json``. ``--check-split`` also compares a split GPT with the whole one (SplitMatchesWhole).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt.callbacks import AutoBatchSize, ExactResume, MFUMonitor, NonFiniteGuard, SigtermCheckpoint  # noqa: E402
from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy  # noqa: E402
from lightning_gpuopt.data import TextDataModule  # noqa: E402
from lightning_gpuopt.model import GPTModule  # noqa: E402
from lightning_gpuopt.precision import Float8Precision  # noqa: E402
from tests._process_exit import finish  # noqa: E402

# The one-process reference of tests/strategies/test_tensor_parallel.py builds the same module and data.
MODULE = dict(preset="llama-tiny", vocab_size=320, warmup_steps=2, learning_rate=1e-2)
DATA = dict(block_size=16, vocab_size=300, num_workers=0)
MAX_STEPS, ACCUMULATE = 6, 2


class LossWriter(Callback):
    def __init__(self, out: Path, go: Path, pause_at: int) -> None:
        self.out, self.go, self.pause_at, self.seen = out, go, pause_at, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(outputs["loss"].detach())
        with open(self.out / f"losses_rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {trainer.global_step} {loss.hex()}\n")
        self.seen += 1
        if self.seen == self.pause_at:
            (self.out / f"paused{trainer.global_rank}").write_text("")
            deadline = time.monotonic() + 120
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)


class SplitMatchesWhole(Callback):
    """At the start of the fit, on this launch's tensor-parallel mesh: a llama-tiny GPT split by ``parallelize_gpt``
    against the same GPT whole, plain and with float8 layers (emulated), in float32: the loss (chunked, a few chunks,
    some targets ignored) and every gradient. Writes the largest differences to ``OUT/split_rank{r}.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        errors = {}
        with torch.random.fork_rng():  # the fit's own random state stays as it was
            for name in ("plain", "float8"):
                errors[name] = self._compare(name, pl_module.device_mesh["tensor_parallel"])
        (self.out / f"split_rank{trainer.global_rank}.json").write_text(json.dumps(errors))

    @staticmethod
    def _compare(name: str, mesh) -> dict:
        import copy

        from lightning_gpuopt.model import GPT, GPTConfig
        from lightning_gpuopt.model.tensor_parallel import parallelize_gpt
        from lightning_gpuopt.precision.float8_layers import convert_linears_to_float8, float8_config

        torch.manual_seed(1)
        whole = GPT(GPTConfig.from_name("llama-tiny", vocab_size=320, block_size=16, loss_chunk_size=6))
        if name == "float8":
            convert_linears_to_float8(whole, float8_config("tensorwise", emulate=True), ["lm_head"], "tensorwise")
        split = parallelize_gpt(copy.deepcopy(whole), mesh)
        idx = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
        targets = idx.roll(-1, dims=1)
        targets[0, :5] = -1
        with torch.autocast("cpu", enabled=False):
            loss, expected = split(idx, targets=targets), whole(idx, targets=targets)
            loss.backward()
            expected.backward()
        grads = [(a.grad.full_tensor() - b.grad).abs().max().item() for a, b in zip(split.parameters(), whole.parameters())]
        return {"loss": abs(loss.item() - expected.item()), "grad": max(grads), "grads": len(grads)}


def fit(run: str, args: argparse.Namespace) -> None:
    out = args.out / run
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    data = TextDataModule(source=str(args.data_dir / "texts"), cache_dir=str(args.data_dir / "cache"), batch_size=2,
                          **DATA)
    module = GPTModule(**MODULE)
    plugins = [Float8Precision(recipe="rowwise", emulate=True, module_filter=["lm_head"])] if run == "fp8" else None
    monitor = MFUMonitor(log_every_n_steps=2, warmup_steps=1, peak_flops=1e12, prog_bar=False, report=False)
    guard = NonFiniteGuard()
    batch = AutoBatchSize(max_micro_batch_size=2)
    trainer = Trainer(
        accelerator="cpu", devices=args.dp * args.tp // args.nodes, num_nodes=args.nodes, max_steps=MAX_STEPS,
        strategy=AtomicModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp),
        plugins=plugins, accumulate_grad_batches=ACCUMULATE, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[
            ExactResume(), monitor, guard, batch, LossWriter(out, args.out / "go", args.pause_at), SigtermCheckpoint(),
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=0),
            *([SplitMatchesWhole(out)] if args.check_split and run == "fp32" else []),
        ],
    )
    try:
        trainer.fit(module, datamodule=data, ckpt_path=args.ckpt)
    except SIGTERMException:
        return
    if trainer.is_global_zero:
        report = {
            "windows": [{k: v for k, v in m.items() if k.startswith("perf/")} for m in monitor.history],
            "total_tokens": monitor.total_tokens,
            "total_flops": monitor.total_flops,
            "flops_per_token": module.flops_per_token(DATA["block_size"]),
            "skipped_steps": guard.skipped_steps,
            "micro_batch": data.batch_size,
            "global_step": trainer.global_step,
        }
        (out / "report.json").write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--runs", default="fp32")
    p.add_argument("--pause-at", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--check-split", action="store_true", help="add SplitMatchesWhole to the fp32 run")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    for run in args.runs.split(","):
        fit(run, args)


if __name__ == "__main__":
    main()
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
