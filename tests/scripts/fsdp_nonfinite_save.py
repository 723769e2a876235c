"""A diverging FSDP2 fit (learning rate 1000) on 2 gloo CPU processes with AtomicModelParallelStrategy.

Every rank writes ``OUT/outcome_rank{r}.txt``: the error type and message that ended ``fit``, and the
global step. ModelCheckpoint saves ``OUT/ckpt/last.ckpt`` (a distributed checkpoint folder) every step.
Usage: python fsdp_nonfinite_save.py OUT TEXT_DIR
"""

import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt.data import TextDataModule  # noqa: E402
from lightning_gpuopt.model import GPTModule  # noqa: E402
from lightning_gpuopt.checkpoint import AtomicModelParallelStrategy  # noqa: E402
from tests._process_exit import finish  # noqa: E402

out, texts = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
data = TextDataModule(source=str(texts), cache_dir=str(out / "cache"), block_size=16, batch_size=2, vocab_size=300,
                      num_workers=0)
module = GPTModule(n_layer=2, n_head=2, n_embd=32, vocab_size=320, block_size=16, warmup_steps=0, learning_rate=1000.0)
trainer = Trainer(
    accelerator="cpu", devices=2, strategy=AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    max_steps=20, limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
    default_root_dir=out, callbacks=[ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_last=True)],
)
try:
    trainer.fit(module, datamodule=data)
    outcome = "finished"
except Exception as err:  # noqa: BLE001 - the test judges what ended the run
    outcome = f"{type(err).__name__}: {err}"
(out / f"outcome_rank{trainer.global_rank}.txt").write_text(f"{trainer.global_step}\n{outcome}\n")
finish()
