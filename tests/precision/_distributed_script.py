"""Trains a tiny GPTModule with one of our precision plugins on 2 CPU processes (gloo).

Run by tests/precision/test_distributed.py as ``python _distributed_script.py PLUGIN STRATEGY OUT``
with PLUGIN in {bf16, fp8} and STRATEGY in {ddp, fsdp2}; rank 0 writes a JSON summary to OUT.
bf16 under FSDP2 also turns on activation checkpointing, and the summary counts how often the first
block's forward runs (twice per step when the backward recomputes it).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, not an installed copy

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402

from lightning_gpuopt.model import GPTModule  # noqa: E402
from lightning_gpuopt.precision import BF16Precision, Float8Precision  # noqa: E402
from tests._process_exit import finish  # noqa: E402
from tests.precision._helpers import LossRecorder, token_loader  # noqa: E402


class BlockCalls(pl.Callback):
    """Counts the first block's forward calls (the model exists from configure_model on)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_fit_start(self, trainer, pl_module):
        pl_module.model.transformer.h[0].register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def main(plugin_name: str, strategy_name: str, out: str) -> None:
    torch.manual_seed(0)
    if plugin_name == "bf16":
        plugin = BF16Precision()
    else:
        plugin = Float8Precision(emulate=True, module_filter=["lm_head"])
    if strategy_name == "ddp":
        strategy, cls = DDPStrategy(process_group_backend="gloo"), GPTModule
    else:
        # GPTModule.configure_model shards per block with FSDP2 itself under ModelParallelStrategy.
        strategy, cls = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), GPTModule
    precomputed = []
    if plugin_name == "fp8":
        import torchao.float8

        original = torchao.float8.precompute_float8_dynamic_scale_for_fsdp

        def counting(module):
            precomputed.append(1)
            return original(module)

        torchao.float8.precompute_float8_dynamic_scale_for_fsdp = counting

    recompute = plugin_name == "bf16" and strategy_name == "fsdp2"
    module = cls(preset="tiny", vocab_size=256, block_size=32, warmup_steps=2, learning_rate=3e-3,
                 activation_checkpointing=recompute)
    block_calls = BlockCalls()
    rec = LossRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], max_steps=8, callbacks=[rec, block_calls],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=token_loader(n_seq=128, batch_size=4))

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    summary = {
        "world_size": trainer.world_size,
        "losses": rec.losses,
        "compute_dtype": str(plugin.compute_dtype),
        "autocast_device": plugin.device,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "sharded": all(isinstance(p, DTensor) for p in module.model.transformer.h.parameters()),
        "precompute_calls": len(precomputed),
        "fsdp_modules": [isinstance(m, FSDPModule) for m in (module.model, *module.model.transformer.h)],
        "activation_checkpointing": recompute,
        "block_forward_calls": block_calls.calls,
    }
    if plugin_name == "fp8":
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        fp8 = [m for m in module.modules() if isinstance(m, Float8Linear)]
        local = [m.weight._local_tensor if isinstance(m.weight, DTensor) else m.weight for m in fp8]
        summary.update(
            float8_layers=len(fp8),
            float8_all_gather=plugin._fsdp_float8_all_gather,
            float8_weights=sum(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in local),
            precomputed_scales=sum(getattr(w, "_precomputed_scale", None) is not None for w in local),
            state_dict_keys=len(module.state_dict()),
        )
    # Every rank must agree on the final weights (DDP) or hold its own shard of them (FSDP2).
    checksum = torch.tensor([sum(float(p.detach().float().sum()) for p in module.model.transformer.h[0].parameters()
                                 if not isinstance(p, DTensor))], dtype=torch.float32)
    gathered = [torch.zeros(1) for _ in range(2)]
    torch.distributed.all_gather(gathered, checksum)
    summary["ranks_agree"] = bool(torch.allclose(gathered[0], gathered[1]))
    if trainer.global_rank == 0:
        Path(out).write_text(json.dumps(summary))
    if not all(math.isfinite(x) for x in rec.losses):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main(*sys.argv[1:4])
    finish()  # process group destroyed, no interpreter teardown (tests/_process_exit.py)
