"""One measured training run of one configuration: through a Lightning ``Trainer``, or a hand-written loop.

Both runners build a fresh model from the same seed, read the same ``TextDataModule`` training
windows, run ``warmup_steps`` optimizer steps unmeasured and then ``steps`` measured ones, and
return a dict of plain numbers (see ``_MeasuredRun.result``). Start-up (model building, float8 conversion,
the ``AutoBatchSize`` search) and warm-up (compilation) are timed separately from the steps.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from benchmarks._configs import BenchSettings, lightning_parts
from benchmarks._profile import StepProfiler
from benchmarks._timing import StepClock
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.model import GPT, GPTConfig, GPTModule
from lightning_gpuopt.precision import Float8Precision

__all__ = ["cleanup", "make_data", "run_config", "run_lightning", "run_torch_loop"]

_GB = 1024**3


def make_data(settings: BenchSettings, batch_size: int) -> TextDataModule:
    """The training data every configuration reads: same source, tokenizer, windows and seed.

    Args:
        settings: The shared settings.
        batch_size: Micro-batch size of the DataLoader.
    """
    # Enough windows per "epoch" that no run crosses an epoch boundary (a new shuffle) while measured.
    samples = (settings.warmup_steps + settings.steps + settings.profile_steps + 4) * settings.global_batch_size
    return TextDataModule(
        source=settings.data,
        block_size=settings.block_size,
        batch_size=batch_size,
        vocab_size=settings.tokenizer_vocab_size,
        cache_dir=settings.cache_dir,
        num_workers=settings.num_workers,
        samples_per_epoch=samples,
        seed=settings.seed,
    )


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gb(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / _GB if device.type == "cuda" else None


def _global_flags() -> tuple[Any, ...]:
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )


def _restore_global_flags(flags: tuple[Any, ...]) -> None:
    torch.set_float32_matmul_precision(flags[3])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags[:3]


def cleanup(device: torch.device) -> None:
    """Free what the previous configuration left: Python objects, compiled graphs, cached CUDA memory."""
    gc.collect()
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclass
class _MeasuredRun:
    """What one run recorded, turned into its result row by ``result``.

    Args:
        name: The configuration, for the error message of a run that stopped early.
        clock: Marks of every optimizer step.
        tokens_per_step: Tokens of each optimizer step.
        begin: ``perf_counter`` when the runner started (start-up is measured from here).
        train_start: When the first training step began (start-up ends, warm-up begins).
        micro_batch_size: Sequences per forward/backward pass.
        accumulate: Micro-batches per optimizer step.
        fit_start: When ``fit`` began; set only where ``AutoBatchSize`` searched (``search_s``).
        first_batch_sum: Sum of the first batch's token ids (checks that runs read the same data).
        first_loss: Loss of the first micro-batch (checks that runs train the same model).
    """

    name: str
    clock: StepClock
    tokens_per_step: list[int]
    begin: float
    train_start: float
    micro_batch_size: int
    accumulate: int
    fit_start: Optional[float] = None
    first_batch_sum: Optional[int] = None
    first_loss: Optional[float] = None

    def result(self, settings: BenchSettings, device: torch.device) -> dict[str, Any]:
        """The measured steps (after ``settings.warmup_steps``) as a dict of plain numbers."""
        warmup, clock = settings.warmup_steps, self.clock
        if len(clock) < warmup + settings.steps:
            raise RuntimeError(
                f"{self.name} stopped after {len(clock)} optimizer steps, expected {warmup + settings.steps}."
            )
        seconds = clock.intervals(start=warmup - 1)[: settings.steps]  # steps warmup+1 ... warmup+steps
        tokens = self.tokens_per_step[warmup : warmup + len(seconds)]
        return {
            "status": "ok",
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate,
            "tokens_per_step": tokens[0] if len(set(tokens)) == 1 else tokens,
            "step_times_s": seconds,
            "tokens_per_s": sum(tokens) / sum(seconds),
            "startup_s": self.train_start - self.begin,
            "search_s": None if self.fit_start is None else self.train_start - self.fit_start,
            "warmup_s": clock.wall(warmup - 1) - self.train_start,
            "peak_memory_gb": _peak_memory_gb(device),
            "first_batch_token_sum": self.first_batch_sum,
            "first_loss": self.first_loss,
        }


class _StepTimer(Callback):
    """Marks every optimizer step and counts its tokens; notes the first batch and loss (checks that runs match)."""

    def __init__(self, device: torch.device, profiler: StepProfiler) -> None:
        self.clock = StepClock(device)
        self.profiler = profiler
        self.tokens_per_step: list[int] = []
        self.fit_start: Optional[float] = None
        self.train_start: Optional[float] = None
        self.first_batch_sum: Optional[int] = None
        self.first_loss: Optional[float] = None
        self._tokens = 0
        self._last_step: Optional[int] = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_start = time.perf_counter()  # first in the callback list: before AutoBatchSize's search

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_start = time.perf_counter()
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.first_batch_sum is None:
            self.first_batch_sum = int(batch[0].sum())  # one sync, in the warm-up

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.first_loss is None:  # the loss of the first micro-batch: Lightning hands it divided by the accumulation
            self.first_loss = float(outputs["loss"]) * trainer.accumulate_grad_batches
        self._tokens += batch[0].numel()
        if trainer.global_step != self._last_step:  # this batch ended an optimizer step
            self._last_step = trainer.global_step
            self.clock.mark()
            self.tokens_per_step.append(self._tokens)
            self._tokens = 0
            self.profiler.tick(len(self.clock))


def _accelerator(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else "cpu"


def run_lightning(name: str, settings: BenchSettings, device: torch.device, accumulate: int = 1,
                  callbacks: tuple[Callback, ...] = (), residual_dtype: Optional[str] = None) -> dict[str, Any]:
    """Train configuration ``name`` with a Lightning ``Trainer`` and measure it.

    Example::

        run_lightning("gpuopt-bf16", BenchSettings(preset="124m"), torch.device("cuda"))["tokens_per_s"]

    Args:
        name: A Lightning configuration (a key of ``CONFIGS`` other than ``torch-loop``).
        settings: The shared settings.
        device: The training device.
        accumulate: Micro-batches per optimizer step of a fixed-batch configuration (``AutoBatchSize`` sets its own).
        callbacks: More callbacks for the Trainer (after the configuration's own), e.g. one that records the loss.
        residual_dtype: ``GPTModule.residual_dtype`` in place of the configuration's (``None``: the configuration's).
    """
    begin = time.perf_counter()
    pl.seed_everything(settings.seed, verbose=False)
    parts = lightning_parts(name, settings)
    measured = settings.warmup_steps + settings.steps
    profiler = StepProfiler(device, first_step=measured, steps=settings.profile_steps)
    timer = _StepTimer(device, profiler)
    data = make_data(settings, settings.micro_batch_size)
    module = GPTModule(
        preset=settings.preset,
        vocab_size=settings.vocab_size,
        block_size=settings.block_size,
        learning_rate=settings.learning_rate,
        warmup_steps=settings.warmup_steps,
        compile=parts.compile,
        compile_mode=(parts.compile_mode or settings.compile_mode) if parts.compile else None,
        compile_scope=parts.compile_scope,
        residual_dtype=residual_dtype or parts.residual_dtype,
    )
    trainer = pl.Trainer(
        accelerator=_accelerator(device),
        devices=1,
        precision=parts.precision,
        plugins=parts.plugins or None,
        callbacks=[timer, *parts.callbacks, *callbacks],
        max_steps=measured + settings.profile_steps,
        accumulate_grad_batches=1 if parts.auto_batch is not None else accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    _reset_memory(device)
    try:
        trainer.fit(module, datamodule=data)
    finally:
        profiler.close()
    auto = parts.auto_batch
    result = _MeasuredRun(
        name=name,
        clock=timer.clock,
        tokens_per_step=timer.tokens_per_step,
        begin=begin,
        train_start=timer.train_start,
        micro_batch_size=data.batch_size,
        accumulate=trainer.accumulate_grad_batches,
        fit_start=timer.fit_start if auto is not None else None,
        first_batch_sum=timer.first_batch_sum,
        first_loss=timer.first_loss,
    ).result(settings, device)
    if profiler.summary is not None:
        result["profile"] = profiler.summary
    plugin = trainer.precision_plugin
    if isinstance(plugin, Float8Precision):
        result["float8"] = {"layers": [name for name, _ in plugin.float8_layers],
                            "flop_share": plugin.float8_flop_share(),
                            "decision": plugin.decision.to_dict() if plugin.decision is not None else None}
    if auto is not None:
        trials = list(getattr(auto, "trials", []) or [])
        chosen = [t.peak_memory for t in trials if t.fits and t.micro_batch_size == auto.micro_batch_size]
        result["auto_batch"] = {
            "micro_batch_size": auto.micro_batch_size,
            "accumulate_grad_batches": auto.accumulate_grad_batches,
            "trials": len(trials),
            # The search resets CUDA's peak statistics, so peak_memory_gb is training only; this is the
            # reserved memory of the trial steps at the chosen micro-batch (what the margin was checked on).
            "chosen_trial_reserved_gb": chosen[0] / _GB if chosen and chosen[0] is not None else None,
        }
    return result


def _hand_settings(device: torch.device) -> tuple[str, contextlib.AbstractContextManager]:
    """What a hand-written loop sets itself so that it runs the kernels the gpuopt configurations run: TF32 matmuls
    and the SDPA kernel order ``CUDASettings(sdpa_backends="auto")`` picks for this device (cuDNN first on an H100),
    through torch's own ``sdpa_kernel(..., set_priority=True)``. Returns what it set, for the report, and the
    context that keeps the order (the caller restores TF32 with the other global flags)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_gpuopt.perf.device import read_device
    from lightning_gpuopt.perf.sdpa import SDPA_BACKENDS, auto_sdpa_order

    if device.type != "cuda":
        return "no CUDA settings (CPU)", contextlib.nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    order, why = auto_sdpa_order(read_device(device))
    if order is None:
        return f"TF32; SDPA kernels in PyTorch's order ({why})", contextlib.nullcontext()
    rest = [b for b in SDPA_BACKENDS if b not in order]
    backends = [getattr(SDPBackend, SDPA_BACKENDS[b]) for b in (*order, *rest)]
    return f"TF32; SDPA {why}, set with sdpa_kernel", sdpa_kernel(backends, set_priority=True)


def _nanogpt_adamw(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: decay on >= 2-D parameters, betas (0.9, 0.95), fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def run_torch_loop(
    settings: BenchSettings, device: torch.device, micro_batch_size: int, accumulate: int
) -> dict[str, Any]:
    """Train with a hand-written nanoGPT-style loop and measure it: the same ``GPT`` and training windows as the
    Lightning configurations, but none of the package's training code (no ``GPTModule``, loss, compile helper,
    optimizer builder or callback).

    Whole-model ``torch.compile``, full logits into ``F.cross_entropy`` (float32), bf16 autocast, fused AdamW,
    warm-up then cosine learning rate; TF32 and the SDPA kernel order set by hand (:func:`_hand_settings`). It
    starts at ``micro_batch_size`` (the gpuopt configuration's) and halves it, doubling the accumulation, while a
    step runs out of memory (the full logits need more than the chunked loss), so its global batch is the same.

    Example::

        run_torch_loop(BenchSettings(preset="124m"), torch.device("cuda"), micro_batch_size=16, accumulate=4)

    Args:
        settings: The shared settings.
        device: The training device.
        micro_batch_size: Sequences per forward/backward pass to try first.
        accumulate: Micro-batches per optimizer step at that micro-batch.
    """
    tried: list[int] = []  # micro-batches that ran out of memory
    while True:
        try:
            result = _torch_loop(settings, device, micro_batch_size, accumulate)
        except torch.cuda.OutOfMemoryError:
            if micro_batch_size % 2:  # 1, or odd: no half keeps the global batch
                raise
            tried.append(micro_batch_size)
        else:
            result["micro_batch_tried"] = tried
            return result
        cleanup(device)  # outside the except block: its traceback no longer holds the failed try's tensors
        micro_batch_size, accumulate = micro_batch_size // 2, accumulate * 2


def _torch_loop(settings: BenchSettings, device: torch.device, micro_batch_size: int, accumulate: int
                ) -> dict[str, Any]:
    """One try of :func:`run_torch_loop` at one micro-batch."""
    begin = time.perf_counter()
    measured = settings.warmup_steps + settings.steps
    total = measured + settings.profile_steps
    profiler = StepProfiler(device, first_step=measured, steps=settings.profile_steps)
    set_by_hand, sdpa_order = _hand_settings(device)
    try:
        with sdpa_order:
            pl.seed_everything(settings.seed, verbose=False)
            data = make_data(settings, micro_batch_size)
            config = GPTConfig.from_name(settings.preset, vocab_size=settings.vocab_size,
                                         block_size=settings.block_size)
            _reset_memory(device)
            with torch.device(device):  # built on the device, as the Trainer does (same RNG stream)
                model = GPT(config)
            compiled = torch.compile(model, mode=settings.compile_mode)
            optimizer = _nanogpt_adamw(model, settings.learning_rate, device)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(settings.warmup_steps, total))
            data.prepare_data()
            data.setup("fit")
            loader = data.train_dataloader()
            batches = iter(loader)
            clock = StepClock(device)
            tokens_per_step: list[int] = []
            first_batch_sum = first_loss = None
            train_start = time.perf_counter()
            model.train()
            for _ in range(total):
                tokens = 0
                for _ in range(accumulate):
                    try:
                        x, y = next(batches)
                    except StopIteration:
                        batches = iter(loader)
                        x, y = next(batches)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, T) each
                    if first_batch_sum is None:
                        first_batch_sum = int(x.sum())
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        logits = compiled(x)  # (B, T, V): the full logits, as nanoGPT
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1), ignore_index=-1)
                    (loss / accumulate).backward()
                    if first_loss is None:
                        first_loss = float(loss.detach())
                    tokens += x.numel()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                clock.mark()
                tokens_per_step.append(tokens)
                profiler.tick(len(clock))
        result = _MeasuredRun(
            name="torch-loop",
            clock=clock,
            tokens_per_step=tokens_per_step,
            begin=begin,
            train_start=train_start,
            micro_batch_size=micro_batch_size,
            accumulate=accumulate,
            first_batch_sum=first_batch_sum,
            first_loss=first_loss,
        ).result(settings, device)
        if profiler.summary is not None:
            result["profile"] = profiler.summary
        result["settings_by_hand"] = set_by_hand
        return result
    finally:
        profiler.close()


def _lr_factor(warmup: int, total: int) -> Any:
    """nanoGPT's schedule as a ``LambdaLR`` factor: linear warm-up, then cosine decay to 10% at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def run_config(
    name: str, settings: BenchSettings, device: torch.device, batch: tuple[int, int]
) -> dict[str, Any]:
    """Run one configuration; a failure (out of memory, a compile error) is recorded, not raised.

    Args:
        name: A key of ``CONFIGS``.
        settings: The shared settings.
        device: The training device.
        batch: ``(micro_batch_size, accumulate)``: of a fixed-batch configuration, and the one ``torch-loop``
            starts from (an ``AutoBatchSize`` configuration chooses its own).
    """
    flags = _global_flags()
    try:
        if name == "torch-loop":
            return run_torch_loop(settings, device, *batch)
        return run_lightning(name, settings, device, accumulate=batch[1])
    except Exception as err:  # recorded in the results with its message; the other configurations still run
        return {"status": "failed", "reason": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()}
    finally:
        _restore_global_flags(flags)  # e.g. TF32 left on by a run that failed before CUDASettings' teardown
        cleanup(device)
