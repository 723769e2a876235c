"""`GPTModule`: the Lightning wrapper that trains, evaluates and samples a `GPT`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_gpuopt.internals import attached_trainer, show_in_progress_bar
from lightning_gpuopt.perf.device import read_device, training_device
from lightning_gpuopt.precision.base import DevicePrecision, LayerContext, LossHead
from lightning_gpuopt.precision.dtype import clip_mixed_precision, compute_dtype_name
from lightning_gpuopt.precision.float8_measure import planned_micro_batch
from lightning_gpuopt.model.config import ActivationCheckpointing, GPTConfig, check_attention_runs, check_data_fits
from lightning_gpuopt.model.compiling import CompileMode, CompileScope, compile_gpt, compile_settings
from lightning_gpuopt.model.loss import LossImpl, device_free_bytes, run_chunk_tokens
from lightning_gpuopt.generation.batched import GenerationJob, fit_to_context, generate_batched
from lightning_gpuopt.model.checkpoint import check_weights, gpt_state_dict, load_gpt_weights
from lightning_gpuopt.model.hf import hf_architecture, is_hf_folder, load_hf_weights
from lightning_gpuopt.generation.memory import generation_batch_size
from lightning_gpuopt.model.gpt import GPT
from lightning_gpuopt.model.optim import build_adamw, schedule_length, warmup_cosine_schedule
from lightning_gpuopt.model.sharding import shard_gpt
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel, local_linear_shape, parallelize_gpt
from lightning_gpuopt.option_checks import check_choice, check_int, check_number, from_command_line

__all__ = ["GPTModule"]

# The dtype of the loss's logits under each compute dtype (compute_dtype_name): float8 keeps the head in bf16.
_LOGIT_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _bf16_autocast(plugin: Any) -> bool:
    """Whether a precision plugin computes in bf16: a bf16 precision, or a float8 one computing the rest in bf16."""
    name = compute_dtype_name(plugin)
    return name == "bf16" or (name == "fp8" and getattr(plugin, "compute_dtype", None) == torch.bfloat16)


def _tensor_parallel_size(mesh: Any) -> int:
    """Ranks of the ``tensor_parallel`` dimension of ``ModelParallelStrategy``'s mesh; 1 without one."""
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["tensor_parallel"].size()


class GPTModule(pl.LightningModule):  # protocols.ConvertsOwnLayers: configure_model converts by name
    """Trains, evaluates and samples a :class:`~lightning_gpuopt.model.GPT` on ``(input_ids, targets)`` batches (B, T).

    Logs ``{stage}/loss`` and ``{stage}/ppl`` for ``train``, ``val`` and ``test`` (val/test perplexity: exp of the
    token-weighted mean loss over the split). Training steps that do not log never wait for the GPU. The GPT is
    built in ``configure_model``; outside a Trainer, call ``module.configure_model()`` before ``module.model``.

    Example::

        module = GPTModule(preset="124m", vocab_size=8192, block_size=1024, compile=True)
        trainer = Trainer(max_steps=3000, precision="bf16-mixed")
        trainer.fit(module, datamodule=TextDataModule(block_size=1024, vocab_size=8192))

    Args:
        preset: A ``GPTConfig`` preset: ``tiny``, ``124m`` ... ``1.5b`` (GPT-2 style), ``llama-tiny``, ``llama-1b``
            ... ``llama-70b`` (Llama 3 shapes), ``qwen2-tiny``, ``qwen2-0.5b`` (Qwen2.5-0.5B's shape).
        vocab_size: Tokenizer vocabulary size (the ``gpuopt`` CLI links it from the data); ``None``: the preset's.
        block_size: Context length; ``None``: the preset's.
        n_layer: Override the preset's number of blocks.
        n_head: Override the preset's number of attention heads.
        n_embd: Override the preset's width.
        n_kv_head: Override the preset's key/value heads (Llama and Qwen2 presets; must divide ``n_head``).
        dropout: Dropout probability.
        attention: ``"sdpa"`` or ``"flash-attn"`` (needs the ``flash`` extra).
        activation_checkpointing: Recompute activations in the backward pass: ``True`` (or ``"full"``) every block,
            ``"selective"`` every other block (about half the memory of none, half the extra compute of full).
        learning_rate: Peak learning rate.
        weight_decay: AdamW weight decay (matrices and embeddings only).
        betas: AdamW betas.
        warmup_steps: Linear warm-up steps; then cosine decay over the rest of training.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate``.
        compile: Compile the model with ``torch.compile`` in ``configure_model``.
        compile_mode: ``torch.compile`` mode, e.g. ``"max-autotune"``; ``None``: the default (under FSDP2 without
            CUDA graphs, with a warning).
        compile_scope: ``"block"``: each transformer block (one shared graph, compile time flat in depth) and the
            loss kernel; ``"model"``: one whole-model graph (under FSDP2 each block instead, with a warning), the
            loss inside it from the full logits for ``loss_impl="auto"`` or ``"plain"``
            (:func:`~lightning_gpuopt.model.compiling.loss_fits_graph`).
        residual_dtype: ``"float32"``: the residual stream is float32 under autocast (the embeddings' dtype);
            ``"bfloat16"``: under bf16 autocast it is bf16 from the embeddings on, so every norm and residual add
            moves half the bytes (nanochat, modded-nanogpt); under another precision it changes nothing (warned).
        loss_impl: ``"auto"``/``"chunked"``, ``"liger"`` or ``"plain"`` (``GPTConfig.loss_impl``).
        loss_chunk_size: Tokens per chunk of the chunked loss; ``None``: chosen at setup from the vocabulary and the
            device's free memory (``model.loss.run_chunk_tokens``), then saved with the checkpoints, so a resumed
            run keeps its chunk (and sums the head's gradient in the same order).
        max_new_tokens: Tokens generated per prompt by ``predict_step``.
        temperature: Sampling temperature for ``predict_step`` (0 is greedy).
        top_k: Top-k sampling for ``predict_step``.
        init_from: A ``GPTModule`` checkpoint whose weights the GPT starts from (fine-tuning: a fresh optimizer and
            schedule); its architecture must be this module's. Or a Hugging Face model folder (``hf:NAME``): its
            architecture is read from its ``config.json`` into ``architecture`` (``docs/huggingface.md``).
        architecture: Every ``GPTConfig`` field of the architecture, in place of ``preset`` and the size overrides
            (``vocab_size`` and ``block_size`` are then the data's, which must fit it); saved by a run started from
            a Hugging Face folder, so that its resume and ``load_gpt`` rebuild that architecture.
    """

    _head_float8 = False  # whether the chunked loss runs its head in float8: the precision plugin's verdict
    LOGGED_METRICS = ("train/loss", "train/ppl", "val/loss", "val/ppl", "test/loss", "test/ppl")  # for a monitor

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: Optional[int] = None,
        block_size: Optional[int] = None,
        n_layer: Optional[int] = None,
        n_head: Optional[int] = None,
        n_embd: Optional[int] = None,
        n_kv_head: Optional[int] = None,
        dropout: float = 0.0,
        attention: Literal["sdpa", "flash-attn"] = "sdpa",
        activation_checkpointing: ActivationCheckpointing = False,
        learning_rate: float = 6e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        compile: bool = False,
        compile_mode: Optional[CompileMode] = None,
        compile_scope: CompileScope = "block",
        residual_dtype: Literal["float32", "bfloat16"] = "float32",
        loss_impl: LossImpl = "auto",
        loss_chunk_size: Optional[int] = None,
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: Optional[int] = 50,
        init_from: Optional[str] = None,
        architecture: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if init_from and architecture is None and is_hf_folder(init_from):  # read before any weight, saved whole
            architecture = hf_architecture(init_from)
        self.save_hyperparameters()
        overrides = dict(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            n_kv_head=n_kv_head,
        )
        runtime = dict(dropout=dropout, attention=attention, activation_checkpointing=activation_checkpointing,
                       loss_impl=loss_impl, loss_chunk_size=loss_chunk_size)
        # Validate now, before any work: a bad shape fails at construction, not after data prep.
        if architecture:  # the data's vocab_size and block_size are checked to fit it at setup (check_data_fits)
            clash = {k: (v, architecture.get(k)) for k, v in overrides.items()
                     if k not in ("vocab_size", "block_size") and v is not None and v != architecture.get(k)}
            if clash:
                asked = ", ".join(f"{k}={v!r}" for k, (v, _) in clash.items())
                theirs = ", ".join(f"{k}={a!r}" for k, (_, a) in clash.items())
                raise ValueError(f"GPTModule.{asked} differ from the architecture given whole ({theirs}, e.g. a "
                                 "Hugging Face folder's): leave them out.")
            self.config = GPTConfig(**{**architecture, **runtime})
        else:
            given = {k: v for k, v in overrides.items() if v is not None}
            self.config = GPTConfig.from_name(preset, **given, **runtime)
        own = "GPTModule"
        check_number(own, "learning_rate", learning_rate, low=0, low_open=True)
        check_number(own, "weight_decay", weight_decay, low=0, hint=": a negative decay makes the weights grow every "
                     "step. Use 0 for no decay (0.1 is the usual value)")
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"GPTModule.betas must be two numbers in [0, 1), e.g. (0.9, 0.95), got {betas!r}.")
        for i, beta in enumerate(betas):
            check_number(
                own, f"betas[{i}]", beta, low=0, high=1, high_open=True, hint=" (the usual values: (0.9, 0.95))"
            )
        check_int(own, "warmup_steps", warmup_steps, minimum=0)
        check_number(
            own,
            "min_lr_ratio",
            min_lr_ratio,
            low=0,
            high=1,
            hint=" (the final learning rate as a fraction of learning_rate)",
        )
        check_int(own, "max_new_tokens", max_new_tokens, minimum=1)
        check_number(own, "temperature", temperature, low=0, hint=" (0 is greedy)")
        check_int(own, "top_k", top_k, minimum=1, optional=True, hint=" (None: no limit)")
        check_choice(own, "compile_scope", compile_scope, ("block", "model"))
        check_choice(own, "residual_dtype", residual_dtype, ("float32", "bfloat16"))
        if compile_mode is not None and not compile:
            raise ValueError(f"GPTModule.compile_mode={compile_mode!r} has no effect: also set compile=True.")
        self.model: Optional[GPT] = None
        self.compile_mode_in_use: Optional[str] = None  # protocols.CompilesItself: set once compiled
        self._last_train_loss: Optional[Tensor] = None
        self._progress_bar_step = 0
        self._flops_per_token: dict[int, int] = {}
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    @property
    def flops_per_batch(self) -> Optional[int]:
        """Training FLOPs of the last training batch (read by Lightning's ``ThroughputMonitor``)."""
        return getattr(self, "_flops_per_batch", None)

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token of the model (PaLM formula); see ``GPT.flops_per_token``."""
        if self.model is not None:
            return self.model.flops_per_token(seq_len)
        with torch.device("meta"):  # count parameters without allocating them
            return GPT(self.config).flops_per_token(seq_len)

    @override
    def configure_model(self) -> None:
        """Build the GPT, split it over the ``tensor_parallel`` mesh and shard it over ``data_parallel`` (under
        ``ModelParallelStrategy``), then compile it if asked."""
        if self.model is not None:  # idempotent: Lightning may call it more than once
            return
        model = GPT(self.config)
        plugin = self.trainer.precision_plugin if attached_trainer(self) is not None else None
        if isinstance(plugin, DevicePrecision):  # e.g. Float8Precision's layers: before sharding and compiling
            model = plugin.convert_layers(model, "model", self.layer_context())
        self.model = model
        self.model.head_float8 = self._head_float8  # the plugin's verdict on the loss head (_use_float8_head)
        if self.hparams.get("residual_dtype") == "bfloat16":
            self.model.residual_dtype = torch.bfloat16
        init_from = self.hparams.get("init_from")
        if init_from and is_hf_folder(init_from):  # before sharding and compiling: the plain GPT takes the weights
            load_hf_weights(self.model, init_from)
        elif init_from:
            load_gpt_weights(self.model, init_from)
        mesh = self.device_mesh  # set by ModelParallelStrategy before this hook
        if mesh is not None:
            if _tensor_parallel_size(mesh) > 1:
                parallelize_gpt(self.model, mesh["tensor_parallel"])
            mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
            shard_gpt(self.model, mesh, param_dtype=self._fsdp_param_dtype())
        if self.hparams.compile:  # after sharding: the compiled graph sees FSDP2's hooks
            _, mode = compile_gpt(self.model, self.hparams.get("compile_scope", "block"), self.hparams.compile_mode)
            self.compile_mode_in_use = mode or "default"


    def layer_context(self) -> LayerContext:
        """What the GPT's layers see in training, for the precision plugin's named conversion
        (:class:`~lightning_gpuopt.protocols.ConvertsOwnLayers`): the tokens of the largest micro-batch the run
        can choose, the FLOPs per token, each layer's shard under tensor parallelism."""
        trainer = attached_trainer(self)
        micro = planned_micro_batch(trainer)
        block = getattr(getattr(trainer, "datamodule", None), "block_size", None)
        block = block if isinstance(block, int) else self.config.block_size
        tensor_parallel = _tensor_parallel_size(self.device_mesh)
        local = functools.partial(local_linear_shape, size=tensor_parallel) if tensor_parallel > 1 else None
        tokens = micro * block if micro else None
        return LayerContext(tokens=tokens, flops_per_token=self.flops_per_token(block), local_shape=local,
                            loss_head=self._loss_head(tensor_parallel))

    def _loss_head(self, tensor_parallel: int) -> Optional[LossHead]:
        """The head the chunked loss multiplies, for a float8 plugin, with why the loss cannot run it in float8."""
        config = self.config
        if config.loss_impl not in ("auto", "chunked") or config.loss_chunk_size is None:
            return None
        scope = compile_settings(self.hparams.get("compile_scope", "block"), None, self.device_mesh is not None)[0]
        unavailable = None
        if tensor_parallel > 1:
            unavailable = f"its vocabulary is split over {tensor_parallel} tensor-parallel ranks"
        elif self.hparams.compile and scope == "model" and config.loss_impl == "auto":  # compiling.loss_fits_graph
            unavailable = ("compile_scope='model' computes the loss from the full logits in the model's graph; "
                           "loss_impl='chunked' keeps the chunked loss")
        return LossHead("model.lm_head", config.n_embd, config.padded_vocab_size, config.loss_chunk_size,
                        self._use_float8_head, unavailable)

    def _use_float8_head(self, on: bool) -> None:
        self._head_float8 = on
        if self.model is not None:
            self.model.head_float8 = on

    def _fsdp_param_dtype(self) -> Optional[torch.dtype]:
        """bf16 under a bf16 precision, or a float8 one computing the rest in bf16; else ``None`` (float32)."""
        if attached_trainer(self) is None:
            return None
        return torch.bfloat16 if _bf16_autocast(self.trainer.precision_plugin) else None

    @override
    def setup(self, stage: str) -> None:
        trainer = attached_trainer(self)
        datamodule = getattr(trainer, "datamodule", None)
        check_data_fits(self.config, getattr(datamodule, "vocab_size", None), getattr(datamodule, "block_size", None))
        if trainer is not None:  # before the model is built: flash-attn would fail at the first step
            facts = training_device(trainer)
            check_attention_runs(self.config, facts, compute_dtype_name(trainer.precision_plugin))
            if self.hparams.get("residual_dtype") == "bfloat16" and not _bf16_autocast(trainer.precision_plugin):
                rank_zero_warn(
                    f"GPTModule.residual_dtype='bfloat16' changes nothing under "
                    f"{compute_dtype_name(trainer.precision_plugin) or 'float32'} precision: the residual stream is "
                    "bf16 only under bf16 autocast (BF16Precision, or Float8Precision computing in bf16). Use such a "
                    "precision, or residual_dtype='float32'.", category=UserWarning,
                )
        tensor_parallel = _tensor_parallel_size(self.device_mesh)
        check_tensor_parallel(self.config, tensor_parallel)  # before the model is built
        if trainer is not None:
            self._choose_loss_chunk(trainer, tensor_parallel)
        if stage == "predict" and tensor_parallel > 1:
            raise ValueError(
                f"GPTModule does not generate split over {tensor_parallel} tensor-parallel ranks (its decoding cache "
                "and sequence shards are planned for training only): predict with tensor_parallel_size=1."
            )

    def _choose_loss_chunk(self, trainer: pl.Trainer, tensor_parallel: int) -> None:
        """The loss's chunk for this run, once (unless given): from the device's free memory now, before the model
        and its activations take theirs. A resume replaces it by the checkpoint's (``on_load_checkpoint``)."""
        if self.config.loss_chunk_size is not None:
            return
        dtype = _LOGIT_DTYPES.get(compute_dtype_name(trainer.precision_plugin) or "", torch.float32)
        free = device_free_bytes(trainer.strategy.root_device)
        chunk = run_chunk_tokens(self.config.padded_vocab_size // tensor_parallel, dtype, free)
        # Rank 0's for every rank: the tensor-parallel loss runs collectives per chunk, so all cut the same chunks.
        self.config.loss_chunk_size = int(trainer.strategy.broadcast(chunk, src=0))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["loss_chunk_size"] = self.config.loss_chunk_size

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """``--ckpt_path`` (fit, validate, test, predict): the weights checked as at every door (``check_weights``),
        before Lightning loads them (a checkpoint IO that allows non-finite weights lets them through here too); a
        resumed run keeps the loss chunk of its checkpoint."""
        trainer = attached_trainer(self)
        source = getattr(trainer, "ckpt_path", None) or "the checkpoint"
        allow = getattr(getattr(getattr(trainer, "strategy", None), "checkpoint_io", None), "allow_nonfinite", False)
        if isinstance(checkpoint.get("state_dict"), dict):
            check_weights(gpt_state_dict(checkpoint), source, self.config, finite=allow is not True)
        saved = checkpoint.get("loss_chunk_size")  # absent in a checkpoint of an older version: the chunk of setup
        if saved is None or saved == self.config.loss_chunk_size:
            return
        if self.hparams.get("loss_chunk_size") is None:
            self.config.loss_chunk_size = saved
            return
        rank_zero_warn(
            f"GPTModule(loss_chunk_size={self.config.loss_chunk_size}) differs from the {saved} tokens per chunk of "
            "the checkpoint's run: the head's weight gradient is summed in another order, so this run is not "
            "bit-exact against one that was not interrupted. Leave loss_chunk_size unset to keep the checkpoint's."
        )

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, targets = batch
        return self.model(idx, targets=targets)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        seq_len = batch[0].size(1)
        if seq_len not in self._flops_per_token:  # counted once per length, not every step
            self._flops_per_token[seq_len] = self.model.flops_per_token(seq_len)
        self._flops_per_batch = self._flops_per_token[seq_len] * batch[0].numel()
        loss = self._loss(batch)
        # Per-batch perplexity is exp of the batch loss; no extra pass over the logits. Not in the
        # progress bar: it would read the tensor every batch (a GPU sync); on_train_batch_end shows it.
        self.log("train/loss", loss)
        self.log("train/ppl", torch.exp(loss.detach()))
        self._last_train_loss = loss.detach()
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        step = trainer.global_step
        # Once per logging optimizer step (after its last micro-batch): the one host sync is there.
        if step == self._progress_bar_step or step % max(1, trainer.log_every_n_steps) != 0:
            return
        self._progress_bar_step = step
        if trainer.progress_bar_callback is not None and trainer.is_global_zero and self._last_train_loss is not None:
            show_in_progress_bar(trainer, {"train/loss": round(self._last_train_loss.float().item(), 4)})

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str, metric: MeanMetric) -> Tensor:
        loss = self._loss(batch)
        # Weight by tokens so the split's perplexity is exp(mean NLL per token), however batches fall.
        # (torchmetrics' Perplexity would allocate a second vocabulary-sized softmax per batch and
        # rejects bf16 logits; the token-weighted mean gives the same number.)
        targets = batch[1].ne(-1).sum()
        # A window without a target (a fine-tuning corpus's prompt alone) has a NaN loss and weighs nothing.
        metric.update(torch.where(targets > 0, loss.detach(), torch.zeros_like(loss)), weight=targets)
        self.log(f"{stage}/loss", metric, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val", self.val_loss)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test", self.test_loss)

    # Reset at the start of each evaluation so the metric's state tensors are created under the
    # grad mode of this loop (a state made under `trainer.validate`'s inference mode cannot be
    # updated later in `fit`, whose validation may run under plain no_grad).
    @override
    def on_validation_epoch_start(self) -> None:
        self.val_loss.reset()

    @override
    def on_test_epoch_start(self) -> None:
        self.test_loss.reset()

    @override
    def on_validation_epoch_end(self) -> None:
        self._check_targets_seen("val", self.val_loss)
        self.log("val/ppl", torch.exp(self.val_loss.compute()))

    @override
    def on_test_epoch_end(self) -> None:
        self._check_targets_seen("test", self.test_loss)
        self.log("test/ppl", torch.exp(self.test_loss.compute()))

    def _check_targets_seen(self, stage: str, metric: MeanMetric) -> None:
        if self.trainer.sanity_checking or float(metric.weight) > 0:  # one read per evaluation
            return
        rank_zero_warn(
            f"{stage}/loss is NaN: no {stage} window holds a target (a fine-tuning corpus's {stage} split of prompts "
            "without their completions, data.loss_on='completion'). Raise data.val_fraction or data.block_size so "
            "its windows reach the completions.",
            category=UserWarning,
        )

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Continue each prompt of ``batch`` (token ids (B, T), or a tuple whose first item is), from its last tokens
        where it is too long (with a warning); or run a :class:`GenerationJob` with continuous batching, handing each
        finished row to it (returns ``{"completions": n, "tokens": t}``)."""
        if isinstance(batch, GenerationJob):
            return self._generate_job(batch)
        idx = batch[0] if isinstance(batch, (tuple, list)) else batch
        hp = self.hparams
        keep = fit_to_context(idx.size(1), hp.max_new_tokens, self.config.block_size)
        if keep < idx.size(1):
            rank_zero_warn(
                f"A prompt of {idx.size(1)} tokens and max_new_tokens={hp.max_new_tokens} do not fit in the model's "
                f"context (block_size={self.config.block_size}): generation sees only its last {keep} tokens. Shorten "
                "the prompt, ask for fewer new tokens, or train with a larger data.block_size.", category=UserWarning
            )
        return self.model.generate(idx[:, -keep:], hp.max_new_tokens, temperature=hp.temperature, top_k=hp.top_k)

    def _generate_job(self, job: GenerationJob) -> dict[str, int]:
        hp = self.hparams
        rows = job.batch_size
        if rows is None:
            trainer = attached_trainer(self)
            name = compute_dtype_name(trainer.precision_plugin) if trainer is not None else None
            facts = training_device(trainer) if trainer is not None else read_device(self.device)
            dtype_bytes = 2 if name in ("bf16", "fp16", "fp8") else next(self.model.parameters()).element_size()
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            memory = generation_batch_size(self.config, facts, weights, dtype_bytes,
                                           context=self.config.block_size, most_rows=len(job.requests))
            rows = memory.rows
            rank_zero_info(f"Generation batch: {memory.reason}. "
                           f"({'--generate.batch_size' if from_command_line() else 'GenerationJob(batch_size=...)'} "
                           "sets another.)")
        counts = {"completions": 0, "tokens": 0}
        for done in generate_batched(
            self.model,
            job.requests,
            rows,
            hp.temperature,
            hp.top_k,
            job.eot_id,
            job.stop_sequences,
            on_step=job.on_step,
            stop_strings=job.stop_strings,
            decode=job.decode,
        ):
            job.on_finished(done)
            counts["completions"] += 1
            counts["tokens"] += len(done.tokens)
        return counts

    @override
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Optional[float] = None, gradient_clip_algorithm: Optional[str] = None
    ) -> None:
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision):
            # Lightning's own "bf16-mixed" and "16-mixed" refuse to clip for the fused AdamW built on CUDA; this
            # clips unscaled gradients, exactly (lightning_gpuopt.precision.dtype.clip_mixed_precision).
            clip_mixed_precision(plugin, optimizer, gradient_clip_val, gradient_clip_algorithm or "norm")
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        facts = training_device(self.trainer)
        optimizer = build_adamw(self.model, hp.learning_rate, hp.weight_decay, tuple(hp.betas), device_facts=facts)
        warn = None if self.trainer.fast_dev_run else rank_zero_warn
        warmup, total = schedule_length(self.trainer.estimated_stepping_batches, hp.warmup_steps, warn)
        scheduler = warmup_cosine_schedule(optimizer, warmup, total, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
