"""The bad-input catalogue (docs/errors.md): one case per row, each checking the error type and that the
message names the fix. Cases that run data preparation also check nothing was written before the error."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from lightning_gpuopt import GPT, GPTConfig, GPTModule, TextDataModule
from lightning_gpuopt.callbacks import AutoBatchSize, CUDASettings, ExactResume, MFUMonitor, NonFiniteGuard
from lightning_gpuopt.cli.main import main
from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt
from lightning_gpuopt.model.hf import load_hf
from lightning_gpuopt.model.hf_families import HFError
from lightning_gpuopt.model.config import check_attention_runs
from lightning_gpuopt.perf.device import REFERENCE_DEVICES
from lightning_gpuopt.callbacks.auto_batch.search import per_device_batch
from lightning_gpuopt.data.tokenizer import carried_tokenizer, check_same_tokenizer, tokenizer_fingerprint, train_bpe_tokenizer
from lightning_gpuopt.checkpoint import AtomicCheckpointIO, NonFiniteCheckpointError
from lightning_gpuopt.precision import Float8Precision
from lightning_gpuopt.precision.float8 import check_float8_device, check_float8_strategy
from lightning_gpuopt.model.tensor_parallel import check_tensor_parallel
from lightning_gpuopt.strategies import choose_strategy

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


@dataclass
class Ctx:
    tmp: Path
    text_dir: Path
    cache: Path

    def data(self, source=None, **kw) -> TextDataModule:
        args = dict(source=str(source or self.text_dir), block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(self.cache))
        return TextDataModule(**{**args, **kw})

    def fit(self, model: GPTModule, data: TextDataModule, **trainer_kw) -> None:
        args = dict(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        pl.Trainer(**{**args, **trainer_kw}).fit(model, datamodule=data)

    def folder(self, name: str, files: dict[str, bytes]) -> Path:
        folder = self.tmp / name
        folder.mkdir()
        for fname, content in files.items():
            (folder / fname).write_bytes(content)
        return folder

    def yaml(self, text: str) -> str:
        path = self.tmp / "bad.yaml"
        path.write_text(text)
        return str(path)


class _ForeignLM(pl.LightningModule):
    """Not one of ours: no GPTConfig, optionally built later or taking a dict."""

    def __init__(self, build: bool = True, dict_input: bool = False):
        super().__init__()
        self.dict_input = dict_input
        if build:
            self.emb, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

    def forward(self, batch):
        return self.head(self.emb(batch["input_ids"] if self.dict_input else batch))


class _NoBatchSizeModule(GPTModule):
    """A module that builds its own loader with a hard-coded batch size: nothing for AutoBatchSize to set."""

    def __init__(self):
        super().__init__(vocab_size=64, block_size=16, warmup_steps=1)  # warm-up within Ctx.fit's 2 steps

    def train_dataloader(self):
        tokens = torch.zeros(8, 17, dtype=torch.long)
        return torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=4)


class _CallOnlyData(pl.LightningDataModule):
    """Takes the micro-batch by use_micro_batch(), but keeps it under another name than `batch_size`."""

    def __init__(self):
        super().__init__()
        self.rows = 4

    def use_micro_batch(self, size):
        self.rows = size

    def train_dataloader(self):
        tokens = torch.zeros(8, 17, dtype=torch.long)
        return torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=self.rows)


class _StreamOfBatchesModule(_NoBatchSizeModule):
    """Has a `batch_size`, but its IterableDataset yields whole batches (DataLoader(batch_size=None))."""

    batch_size = 4

    def train_dataloader(self):
        class Batches(torch.utils.data.IterableDataset):
            def __iter__(self):
                tokens = torch.zeros(4, 17, dtype=torch.long)
                return iter([(tokens[:, :-1], tokens[:, 1:])] * 2)

        return torch.utils.data.DataLoader(Batches(), batch_size=None)


class _IgnoresBatchSizeModule(_NoBatchSizeModule):
    """Has a `batch_size`, but its loader is hard-coded to 4: the size AutoBatchSize sets is ignored."""

    batch_size = 4


def _prepare_leaves_nothing(ctx: Ctx, source: Path, **kw) -> None:
    data = ctx.data(source, **kw)
    (ctx.tmp / "a-file").write_text("")  # a file where a cache folder would have to go
    try:
        data.prepare_data()
    finally:
        assert not data.data_dir.exists(), "an error after writing part of the cache"


def _fifo(ctx: Ctx) -> str:
    os.mkfifo(ctx.tmp / "pipe")
    return str(ctx.tmp / "pipe")


def _cache_env_empty(ctx: Ctx) -> None:
    os.environ["GPUOPT_CACHE_DIR"] = ""  # the autouse fixture restores the environment
    TextDataModule(source=str(ctx.text_dir), vocab_size=300)


def _tokenizer_without_eot(ctx: Ctx) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["some text here"], trainers.BpeTrainer(vocab_size=280, show_progress=False))
    tok.save(str(ctx.tmp / "tok.json"))
    return str(ctx.tmp / "tok.json")


def _ckpt(ctx: Ctx, content: Optional[dict] = None, truncate: bool = False, zero_middle: bool = False) -> Path:
    path = ctx.tmp / "x.ckpt"
    state = {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}
    torch.save(content if content is not None else {"hyper_parameters": {"preset": "tiny"}, "state_dict": state}, path)
    if truncate:
        path.write_bytes(path.read_bytes()[:5000])
    if zero_middle:  # 4000 bytes inside the tensors' data zeroed: the archive still opens and unpickles
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4000] = bytes(4000)
        path.write_bytes(bytes(data))
    return path


def _existing_file(ctx: Ctx) -> str:
    """A file of the user's where a command would write its output."""
    path = ctx.tmp / "precious.jsonl"
    path.write_text('{"precious": 1}\n')
    return str(path)


def _cli_before_data(ctx: Ctx, args: list[str]) -> None:
    """``gpuopt fit`` on the test corpus with ``args``; the error must come before data preparation."""
    data = ["--data.source", str(ctx.text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.num_workers", "0",
            "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.default_root_dir", str(ctx.tmp / "run")]
    try:
        main(["fit", *data, *args])
    finally:
        assert not ctx.cache.exists(), "the data was prepared before the error"


class _OpensAFile:
    """Pickled, it creates a file when unpickled: proof that a load ran the file's code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _resume_pickled_objects(ctx: Ctx) -> None:
    """``--ckpt_path`` of a checkpoint whose pickle runs code, with ``--weights_only false``: refused, nothing ran."""
    marker, path = ctx.tmp / "it-ran", ctx.tmp / "objects.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "payload": _OpensAFile(marker)}, path)
    try:
        _cli_before_data(ctx, ["--ckpt_path", str(path), "--weights_only", "false"])
    finally:
        assert not marker.exists(), "the checkpoint's code ran"


def _lightning_ckpt(ctx: Ctx) -> str:
    """A checkpoint as Lightning writes one for GPTModule(preset='tiny', vocab_size=300, block_size=32)."""
    path = ctx.tmp / "run.ckpt"
    model = GPT(GPTConfig.from_name("tiny", vocab_size=300, block_size=32))
    hparams = {**{k: p.default for k, p in inspect.signature(GPTModule.__init__).parameters.items() if k != "self"},
               "vocab_size": 300, "block_size": 32, "betas": (0.9, 0.95)}
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 4, "hyper_parameters": hparams,
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    return str(path)


def _hf_folder(ctx: Ctx, **config_changes: Any) -> Path:
    """A Hugging Face Llama folder (config.json, model.safetensors, no tokenizer.json), config.json edited."""
    import json

    from lightning_gpuopt.model.hf import write_hf_folder

    folder = write_hf_folder(GPT(GPTConfig.from_name("llama-tiny", vocab_size=300, block_size=32)), ctx.tmp / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def _hf_pickles_only(ctx: Ctx) -> None:
    folder = _hf_folder(ctx)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    load_hf(folder)


def _nan_ckpt(ctx: Ctx) -> str:
    """:func:`_lightning_ckpt` with a NaN in one weight (a diverged run's, written with allow_nonfinite=True)."""
    checkpoint = torch.load(_lightning_ckpt(ctx), weights_only=True)
    checkpoint["state_dict"]["model.transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    torch.save(checkpoint, ctx.tmp / "nan.ckpt")
    return str(ctx.tmp / "nan.ckpt")


def _ckpt_carrying_a_tokenizer(ctx: Ctx) -> str:
    """:func:`_lightning_ckpt` whose data state carries a tokenizer trained on other text than the test corpus."""
    path = _lightning_ckpt(ctx)
    checkpoint = torch.load(path, weights_only=True)
    tok = train_bpe_tokenizer([" ".join(f"word{i % 97} and {i % 13} more" for i in range(4000))], 300)
    checkpoint["TextDataModule"] = {"train_epoch": 0, "train_position": 8, "tokenizer_json": tok.to_str(),
                                    "tokenizer_sha256": tokenizer_fingerprint(tok)}
    torch.save(checkpoint, path)
    return path


def _corpus_tokenizer(ctx: Ctx) -> str:
    """A 300-token BPE of the test corpus, as a file (so model.vocab_size, linked from it, is the checkpoint's)."""
    tok = train_bpe_tokenizer([p.read_text() for p in sorted(ctx.text_dir.iterdir())], 300)
    tok.save(str(ctx.tmp / "corpus-tokenizer.json"))
    return str(ctx.tmp / "corpus-tokenizer.json")


def _as_last(ctx: Ctx) -> str:
    """:func:`_lightning_ckpt` as the ``last.ckpt`` of the run folder ``_cli_before_data`` uses."""
    folder = ctx.tmp / "run" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    os.replace(_lightning_ckpt(ctx), folder / "last.ckpt")
    return "last"


def _in_use(ctx: Ctx) -> None:
    """:func:`_cli_before_data` while the run folder is held as a running fit holds it (another open file: flock
    refuses this process as it refuses another)."""
    import fcntl

    from lightning_gpuopt.run.folder import LOCK_FILE

    folder = ctx.tmp / "run"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "w") as held:
        held.write("pid 4242 on gpu-node-7, since 2026-01-01 12:00:00\n")
        held.flush()
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        _cli_before_data(ctx, [])


_OWN = "tests.cli._own_modules"


def _own(ctx: Ctx, subcommand: str, model: str, *args: str) -> None:
    """``gpuopt <subcommand>`` of a module of one's own (tests/cli/_own_modules.py) on the CPU."""
    main([subcommand, "--model", f"{_OWN}.{model}", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
          "--trainer.default_root_dir", str(ctx.tmp / "run"), *args])


def _own_ckpt(ctx: Ctx, **saved: Any) -> str:
    """A checkpoint as Lightning writes one for ``Regressor(d=16)`` after 4 steps (one epoch), with ``saved`` over it."""
    from tests.cli._own_modules import Regressor

    path = ctx.tmp / "own.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 4, "epoch": 1,
                "hyper_parameters": {"d_in": 16, "d": 16, "lr": 0.01}, "state_dict": Regressor().state_dict(), **saved}, path)
    return str(path)


def _nonfinite_ckpt(ctx: Ctx) -> Path:
    AtomicCheckpointIO(allow_nonfinite=True).save_checkpoint({"state_dict": {"w": torch.tensor([float("inf")])}}, ctx.tmp / "inf.ckpt")
    return ctx.tmp / "inf.ckpt"


def _predict(ctx: Ctx, *args: str, prompts: str = "a prompt\n", name: str = "p.txt") -> None:
    """``gpuopt predict`` of a prompts file on the test corpus; the error must come before data preparation."""
    (ctx.tmp / name).write_bytes(prompts.encode("utf-8") if isinstance(prompts, str) else prompts)
    data = ["--data.source", str(ctx.text_dir), "--data.vocab_size", "300", "--data.block_size", "32", "--data.num_workers", "0",
            "--generate.output", str(ctx.tmp / "g.jsonl")]
    try:
        main(["predict", *data, "--generate.prompts_file", str(ctx.tmp / name), *args])
    finally:
        assert not (ctx.cache.exists() and any(ctx.cache.iterdir())), "an error after data preparation"
        assert not list(ctx.tmp.glob("g.jsonl*")), "an error after the output was opened"


def _output_in_use(ctx: Ctx) -> None:
    """:func:`_predict` with ``--generate.overwrite`` while g.jsonl is held as a running predict holds it."""
    from lightning_gpuopt.run import hold_output

    with hold_output(ctx.tmp / "g.jsonl", "gpuopt predict", "--generate.output"):
        _predict(ctx, "--generate.overwrite", "true")


def _partial_left(ctx: Ctx) -> None:
    """:func:`_predict` beside the ``.partial`` of a run that was killed (its lock free); it must stay."""
    partial = ctx.tmp / "g.jsonl.partial"
    partial.write_text('{"index": 0, "sample": 0, "completion": "a"}\n')
    try:
        main(["predict", "--generate.prompts_file", ctx.yaml("a prompt\n"), "--generate.output", str(ctx.tmp / "g.jsonl")])
    finally:
        assert partial.read_text().count("\n") == 1


def _doctor_json_in_use(ctx: Ctx) -> None:
    from lightning_gpuopt.run import hold_output

    with hold_output(ctx.tmp / "d.json", "gpuopt doctor", "--json"):
        main(["doctor", "--json", str(ctx.tmp / "d.json")])


def _bad_records(ctx: Ctx) -> None:
    """A .jsonl fine-tuning corpus whose second record has no text: refused while it is read, before any token file."""
    (ctx.tmp / "records.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"text": 3}\n')
    _prepare_leaves_nothing(ctx, ctx.tmp / "records.jsonl")


def _requires_missing(module: str) -> Optional[str]:
    return f"{module} is installed" if importlib.util.find_spec(module) is not None else None


@dataclass
class Case:
    id: str
    raise_it: Callable[[Ctx], Any]
    error: type
    match: str  # a fragment of the message that names the fix
    skip: Optional[str] = None



def _flash_config() -> GPTConfig:
    config = GPTConfig.from_name("tiny")
    config.attention = "flash-attn"  # as GPTConfig(attention="flash-attn") with the package installed
    return config


def _liger_on_cpu():
    from lightning_gpuopt.model.loss import linear_cross_entropy

    return linear_cross_entropy(torch.zeros(2, 16), torch.zeros(32, 16), torch.zeros(2, dtype=torch.long), impl="liger")


def _split_module() -> GPTModule:
    """A Llama-style GPTModule as ModelParallelStrategy(tensor_parallel_size=2) leaves it before setup: with the mesh."""

    class TensorParallelPair:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return type("Dim", (), {"size": lambda self: 2})()

    module = GPTModule(preset="llama-tiny")
    module._device_mesh = TensorParallelPair()
    return module


def _fsdp_fp16_strategy():
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    return FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))


CASES = [
    # ---------------------------------------------------------------- model configuration
    Case("n-head-not-dividing", lambda c: GPTConfig(n_embd=64, n_head=5), ValueError, r"choose n_head from \[1, 2, 4, 8, 16, 32, 64\]"),
    Case("unknown-preset", lambda c: GPTModule(preset="125m"), ValueError, r"choose one of \['1.5b', '124m'"),
    Case("unknown-config-field", lambda c: GPTConfig.from_name("tiny", n_layers=4), ValueError, r"Unknown GPTConfig field\(s\) \['n_layers'\]"),
    Case("non-positive-size", lambda c: GPTConfig(n_layer=0), ValueError, "GPTConfig.n_layer must be an integer >= 1"),
    Case("dropout-out-of-range", lambda c: GPTConfig(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
    Case("unknown-arch", lambda c: GPTConfig(arch="mistral"), ValueError,
         "GPTConfig.arch must be 'gpt2', 'llama' or 'qwen2', got 'mistral'"),
    Case("llama-option-on-gpt2", lambda c: GPTConfig(n_kv_head=2), ValueError,
         r"GPTConfig.n_kv_head needs fused_qkv=False, which this config \(arch='gpt2'\) does not have.*arch='llama'"),
    Case("norm-bias-on-rmsnorm", lambda c: GPTConfig(arch="qwen2", norm_bias=True), ValueError,
         r"norm_bias=True: RMSNorm has no bias. Use norm='layernorm', or leave norm_bias out"),
    Case("n-kv-head-not-dividing", lambda c: GPTModule(preset="llama-tiny", n_kv_head=3), ValueError,
         r"n_kv_head=3 does not divide n_head=4.*Choose n_kv_head from \[1, 2, 4\]"),
    Case("mlp-width-given-twice", lambda c: GPTConfig(arch="llama", intermediate_size=256, ffn_dim_multiplier=1.3), ValueError,
         r"give intermediate_size alone \(the width\), or ffn_dim_multiplier"),
    Case("odd-head-size-with-rope", lambda c: GPTConfig(arch="llama", n_embd=60, n_head=4), ValueError,
         r"n_embd / n_head = 15 is odd.*an even head size"),
    Case("learning-rate-not-positive", lambda c: GPTModule(learning_rate=0.0), ValueError, "learning_rate must be > 0"),
    Case("learning-rate-not-finite", lambda c: GPTModule(learning_rate=float("nan")), ValueError, "learning_rate must be a finite number"),
    Case("weight-decay-negative", lambda c: GPTModule(weight_decay=-1.0), ValueError, "weight_decay must be >= 0, got -1.0: a negative decay makes the weights grow"),
    Case("betas-out-of-range", lambda c: GPTModule(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be in \[0, 1\), got 1.0"),
    Case("warmup-steps-negative", lambda c: GPTModule(warmup_steps=-1), ValueError, "warmup_steps must be an integer >= 0"),
    Case("min-lr-ratio-out-of-range", lambda c: GPTModule(min_lr_ratio=2.0), ValueError, r"min_lr_ratio must be in \[0, 1\]"),
    Case("max-new-tokens-zero", lambda c: GPTModule(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1"),
    Case("temperature-negative", lambda c: GPTModule(temperature=-0.5), ValueError, r"temperature must be >= 0, got -0.5 \(0 is greedy\)"),
    Case("module-top-k-zero", lambda c: GPTModule(top_k=0), ValueError, r"top_k must be an integer >= 1 or None, got 0 \(None: no limit\)"),
    Case("compile-mode-without-compile", lambda c: GPTModule(compile_mode="max-autotune"), ValueError, "also set compile=True"),
    Case("flash-attn-missing", lambda c: GPTModule(attention="flash-attn"), ImportError,
         r'pip install "lightning-gpuopt\[flash\]".*or use GPTModule\(attention=\'sdpa\'\)', skip=_requires_missing("flash_attn")),
    Case("flash-attn-float32", lambda c: check_attention_runs(_flash_config(), REFERENCE_DEVICES["A100"], "fp32"), ValueError,
         r"runs in fp16 or bf16 only, and this run computes in fp32 .*use bf16 precision .*or GPTModule\(attention='sdpa'\)"),
    Case("flash-attn-old-gpu", lambda c: check_attention_runs(_flash_config(), REFERENCE_DEVICES["V100"], "fp16"), ValueError,
         r"needs a CUDA GPU of compute capability 8.0 or newer .*Tesla V100.*use GPTModule\(attention='sdpa'\)"),
    Case("no-run-length", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(), max_steps=-1, max_epochs=-1),
         ValueError, r"set trainer.max_steps \(or max_epochs\)"),
    Case("data-longer-than-model-context", lambda c: c.fit(GPTModule(vocab_size=300, block_size=16), c.data()), ValueError,
         "set model.block_size >= 32 or data.block_size <= 16"),
    Case("fit-in-16-true", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(), precision="16-true"), ValueError,
         r"float16 parameters \(trainer.precision='16-true', .*round to zero, .*Train in trainer.precision='bf16-mixed' .*'16-mixed'"),
    Case("unknown-loss-impl", lambda c: GPTModule(loss_impl="fused"), ValueError,
         "GPTConfig.loss_impl must be 'auto', 'chunked', 'liger' or 'plain', got 'fused'"),
    Case("liger-on-cpu", lambda c: _liger_on_cpu(), ValueError, "runs on CUDA only, not on cpu: use loss_impl='chunked'"),
    Case("unknown-compile-scope", lambda c: GPTModule(compile=True, compile_scope="layer"), ValueError, "must be 'block' or 'model'"),
    Case("unknown-residual-dtype", lambda c: GPTModule(residual_dtype="float16"), ValueError,
         "GPTModule.residual_dtype must be 'float32' or 'bfloat16'"),
    Case("generate-top-k", lambda c: GPT(GPTConfig.from_name("tiny")).generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0),
         ValueError, r"generate.top_k must be an integer >= 1 or None, got 0 \(None: no limit\)"),
    # ---------------------------------------------------------------- data
    Case("empty-source", lambda c: c.data(source=" "), ValueError, "use 'stdlib', a folder, a file, a glob, or 'hf:NAME'"),
    Case("missing-path", lambda c: c.data(source=str(c.tmp / "nope")), ValueError, "does not exist: use 'stdlib'"),
    Case("folder-without-text", lambda c: c.data(source=c.folder("j", {"a.json": b"{}"})), ValueError, "no .txt, .md, .raw or .py files"),
    Case("glob-matches-nothing", lambda c: c.data(source=str(c.tmp / "*.nothing")), ValueError, "matches no files: check the pattern"),
    Case("empty-corpus", lambda c: _prepare_leaves_nothing(c, c.folder("e", {"a.txt": b"", "b.txt": b"  \n"})), ValueError,
         "is empty: data.source holds no text"),
    Case("unreadable-file", lambda c: _prepare_leaves_nothing(c, c.folder("u", {"a.txt": b"\xff\xfe\xfa bad"})), ValueError,
         "Fix its permissions or encoding"),
    Case("corpus-too-short", lambda c: c.data(source=c.folder("s", {"a.txt": b"short text " * 20}), block_size=256,
                                              vocab_size=260).setup("fit"),  # a vocabulary this text fills
         ValueError, r"use a larger corpus or a smaller data.block_size\. \(data.val_fraction=0.05 of the text went to each of "
                     r"validation and test: a smaller one leaves training more\)"),
    Case("tokenizer-missing", lambda c: c.data(tokenizer=str(c.tmp / "tok.json")), ValueError, "give the path of a tokenizer.json"),
    Case("tokenizer-is-a-folder", lambda c: c.data(tokenizer=str(c.folder("run", {"tokenizer.json": b"{}"}))), ValueError,
         r"is a folder: give the path of a tokenizer.json file \(it holds one: '.*run/tokenizer.json'\)"),
    Case("tokenizer-not-a-tokenizer", lambda c: c.data(tokenizer=str(c.folder("t", {"tok.json": b"{}"}) / "tok.json")), ValueError,
         "is not a valid tokenizer.json"),
    Case("tokenizer-without-eot", lambda c: c.data(tokenizer=_tokenizer_without_eot(c)), ValueError,
         "add one as a special token, or leave data.tokenizer unset"),
    Case("tokenizer-larger-than-model", lambda c: c.fit(GPTModule(vocab_size=260, block_size=32), c.data()), ValueError,
         "set model.vocab_size >= 300"),
    Case("batch-larger-than-split", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(batch_size=2048)), ValueError,
         r"data.batch_size=2048 is larger than the training split of .*no training step\. Set data.batch_size <= \d+"),
    Case("vocab-too-small", lambda c: c.data(vocab_size=100), ValueError,
         "TextDataModule.vocab_size must be an integer >= 257, got 100"),
    Case("val-fraction-out-of-range", lambda c: c.data(val_fraction=0.6), ValueError, r"val_fraction must be in \(0, 0.5\)"),
    Case("batch-size-zero", lambda c: c.data(batch_size=0), ValueError, "batch_size must be an integer >= 1"),
    Case("empty-prompt", lambda c: c.data(prompts=[""]).predict_dataloader(), ValueError, "give each prompt some text"),
    Case("source-is-a-fifo", lambda c: c.data(source=_fifo(c)), ValueError, "is a FIFO \\(named pipe\\), not a regular file or folder: .*copy it into a file"),
    Case("source-is-a-device", lambda c: c.data(source="/dev/null"), ValueError, "is a character device, not a regular file or folder"),
    Case("cache-dir-cannot-be-created", lambda c: _prepare_leaves_nothing(c, c.text_dir, cache_dir=str(c.tmp / "a-file" / "cache")), ValueError,
         r"cannot be created .*set data.cache_dir \(or the GPUOPT_CACHE_DIR environment variable\) to a folder this process can write"),
    Case("cache-dir-env-empty", lambda c: _cache_env_empty(c), ValueError, r"GPUOPT_CACHE_DIR is set but empty: set it \(or data.cache_dir\)"),
    Case("hf-without-datasets", lambda c: c.data(source="hf:wikitext:wikitext-2-raw-v1"), ImportError,
         "pip install datasets", skip=_requires_missing("datasets")),
    # ---------------------------------------------------------------- plugins, strategies, hardware
    Case("fp8-on-old-gpu", lambda c: check_float8_device(REFERENCE_DEVICES["A100"], emulate=False), RuntimeError,
         r"compute capability >= 8.9.*Set Float8Precision\(emulate=True\).*or use BF16Precision to train fast"),
    Case("fp8-with-fp16-strategy", lambda c: check_float8_strategy(_fsdp_fp16_strategy()), ValueError,
         "param_dtype=torch.float16, reduce_dtype=torch.float16. Use torch.bfloat16"),
    Case("fp8-and-precision-flag", lambda c: pl.Trainer(plugins=[Float8Precision(emulate=True)], precision="16-mixed", logger=False),
         ValueError, r"Received both `precision=16-mixed` and `plugins=.*Choose one"),
    Case("fp8-unknown-recipe", lambda c: Float8Precision(recipe="columnwise"), ValueError,
         r"Float8Precision.recipe must be 'tensorwise', 'rowwise' or 'rowwise_with_gw_hp', got 'columnwise'"),
    Case("exact-resume-rebuild-not-bool", lambda c: ExactResume(rebuild_loaders="yes"), ValueError,
         r"ExactResume.rebuild_loaders must be True or False, got 'yes'"),
    Case("choose-strategy-not-a-model", lambda c: choose_strategy("1.5b", devices=2, device_memory=16e9), ValueError,
         r"needs a model: a GPTConfig, or any nn.Module / LightningModule, got str"),
    Case("choose-strategy-devices-per-node",
         lambda c: choose_strategy(GPTConfig.from_name("tiny"), devices=8, devices_per_node=3, device_memory=16e9),
         ValueError, r"devices_per_node=3\) must be a positive integer dividing devices=8"),
    Case("tp-gpt2", lambda c: check_tensor_parallel(GPTConfig.from_name("774m"), 2), ValueError,
         r"cannot split this architecture \(arch='gpt2'\): GPT-2's fused c_attn projection cannot be split into whole "
         r"heads.*Use separate projections and rotary positions \(fused_qkv=False, positions='rotary'"),
    Case("tp-size-not-dividing", lambda c: check_tensor_parallel(GPTConfig.from_name("llama-8b"), 16), ValueError,
         r"tensor_parallel_size=16 does not divide n_kv_head=8: .* Choose tensor_parallel_size from \[1, 2, 4, 8\]"),
    Case("tp-full-logits-loss", lambda c: check_tensor_parallel(GPTConfig.from_name("llama-1b", loss_impl="plain"), 2),
         ValueError, r"loss_impl='plain' needs the whole output head on one rank.* use loss_impl='chunked'"),
    Case("tp-predict", lambda c: _split_module().setup("predict"), ValueError,
         r"does not generate split over 2 tensor-parallel ranks .*: predict with tensor_parallel_size=1"),
    Case("choose-strategy-no-block-size", lambda c: choose_strategy(_ForeignLM(), devices=2, device_memory=16e9), ValueError,
         r"cannot tell the sequence length of _ForeignLM: pass block_size="),
    Case("choose-strategy-no-parameters", lambda c: choose_strategy(_ForeignLM(build=False), devices=2, device_memory=16e9, block_size=32),
         ValueError, r"no parameters yet \(built in configure_model\?\): build them first"),
    Case("choose-strategy-no-activations", lambda c: choose_strategy(_ForeignLM(dict_input=True), devices=2, device_memory=16e9, block_size=32),
         ValueError, r"could not estimate the activations of _ForeignLM .*pass choose_strategy\(batch=\.\.\.\) \(a training batch, measured over training_step\), activation_bytes=\.\.\."),
    Case("fp8-bad-module-filter", lambda c: Float8Precision(module_filter="lm_head"), ValueError, r"a list of layer-name patterns to skip \(e.g. \['lm_head'\]\)"),
    # ---------------------------------------------------------------- callback arguments
    Case("sdpa-unknown-backend", lambda c: CUDASettings(sdpa_backends=["flash", "fast"]), ValueError,
         r"distinct names from \['cudnn', 'flash', 'efficient', 'math'\]"),
    Case("tf32-vs-highest-precision", lambda c: CUDASettings(tf32=True, matmul_precision="highest"), ValueError, "contradict each other: drop one"),
    Case("no-tf32-vs-tf32-precision", lambda c: CUDASettings(tf32=False, matmul_precision="high"), ValueError, "turns TF32 matmuls on. Drop one"),
    Case("mfu-peak-in-tflops", lambda c: MFUMonitor(peak_flops=-1.0), ValueError, r"peak_flops must be > 0 or None, got -1.0 \(in FLOP/s, e.g. 989.4e12\)"),
    Case("mfu-log-every-zero", lambda c: MFUMonitor(log_every_n_steps=0), ValueError, "log_every_n_steps must be an integer >= 1 or None, got 0"),
    Case("guard-unknown-mode", lambda c: NonFiniteGuard(mode="lazy"), ValueError, "mode must be 'auto', 'step' or 'deferred'"),
    Case("guard-deferred-without-fused-optimizer",
         lambda c: c.fit(GPTModule(vocab_size=300, block_size=32, warmup_steps=1), c.data(),
                         callbacks=[NonFiniteGuard(mode="deferred")]),
         ValueError, r"fused torch.optim optimizer \(e.g. AdamW\(fused=True\)\) and no fp16 GradScaler; got AdamW. Use mode='step'"),
    Case("guard-unknown-policy", lambda c: NonFiniteGuard(policy="ignore"), ValueError, "policy must be 'skip' or 'stop'"),
    Case("guard-max-skips-zero", lambda c: NonFiniteGuard(max_consecutive_skips=0), ValueError, r"use NonFiniteGuard\(policy='stop'\) to stop at the first bad step"),
    # ---------------------------------------------------------------- CLI and YAML
    Case("global-batch-not-divisible", lambda c: per_device_batch(100, 8), ValueError,
         r"use a multiple of 8, e\.g\. global_batch_size=96 or 104"),
    Case("negative-memory-margin", lambda c: AutoBatchSize(memory_margin=-0.1), ValueError,
         r"memory_margin must be in \[0, 1\), got .* \(the fraction of memory to keep free\)"),
    Case("auto-batch-cpu-unbounded", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(), callbacks=[AutoBatchSize(global_batch_size=8)]),
         ValueError, r"Set AutoBatchSize\(max_micro_batch_size=\.\.\.\)"),
    Case("auto-batch-no-batch-size", lambda c: c.fit(_NoBatchSizeModule(), None, callbacks=[AutoBatchSize(max_micro_batch_size=4)]),
         ValueError, r"AutoBatchSize\(batch_size_attr=\.\.\.\)"),
    Case("auto-batch-call-without-batch-size", lambda c: c.fit(_NoBatchSizeModule(), _CallOnlyData(), callbacks=[AutoBatchSize(max_micro_batch_size=4)]),
         ValueError, r"_CallOnlyData has use_micro_batch\(\) but no `batch_size`, the micro-batch it uses now, .*set self.batch_size"),
    Case("auto-batch-loader-ignores-size",
         lambda c: c.fit(_IgnoresBatchSizeModule(), None, callbacks=[AutoBatchSize(max_micro_batch_size=2)]),
         ValueError, r"The training DataLoader ignores `batch_size`: build it inside train_dataloader\(\) from self\.batch_size"),
    Case("auto-batch-dataset-yields-batches",
         lambda c: c.fit(_StreamOfBatchesModule(), None, callbacks=[AutoBatchSize(max_micro_batch_size=2)]),
         ValueError, r"batch_size=None: its Batches yields whole batches.*DataLoader\(dataset, batch_size=self\.batch_size, collate_fn=\.\.\.\)"),
    Case("yaml-typo-in-key", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_step: 10\n")]), SystemExit,
         r"does not accept option 'trainer.max_step': did you mean 'trainer.max_steps'"),
    Case("yaml-typo-in-model-key", lambda c: main(["fit", "--config", c.yaml("model:\n  presett: tiny\n")]), SystemExit,
         r"did you mean 'model.preset' \(--model.preset on the command line\)"),
    Case("yaml-wrong-type", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_steps: ten\n")]), SystemExit,
         r'Parser key "trainer.max_steps":\s+Expected a <class \'int\'>. Got value: ten'),
    Case("cli-unknown-option", lambda c: main(["fit", "--model.n_layers", "4"]), SystemExit, r"unrecognized arguments: --model.n_layers 4; for --model.n_layers did you mean --model.n_layer\?"),
    Case("auto-strategy-print-plan-without-auto",
         lambda c: main(["fit", "--trainer.max_steps", "1", "--auto_strategy.print_plan", "true"]), SystemExit,
         r"--auto_strategy.print_plan prints what trainer.strategy=gpuopt-auto picks: add --trainer.strategy gpuopt-auto"),
    Case("auto-strategy-unknown-device",
         lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.strategy", "gpuopt-auto", "--auto_strategy.device", "H100"]),
         SystemExit, r"--auto_strategy.device='H100' is not a GPU the planner knows \(did you mean 'H100 SXM'\?\)"),
    Case("cli-fit-without-run-length", lambda c: main(["fit", "--model.preset", "tiny"]), SystemExit,
         r"gpuopt fit needs a run length: set trainer.max_steps \(e\.g\. --trainer.max_steps 3000\)"),
    Case("predict-prompts-file-missing", lambda c: main(["predict", "--generate.prompts_file", str(c.tmp / "none.txt")]),
         SystemExit, r"gpuopt: error: generate.prompts_file=.*none.txt' does not exist: give a text or JSONL file of prompts"),
    Case("predict-output-is-a-folder",
         lambda c: main(["predict", "--generate.prompts_file", c.yaml("a prompt\n"), "--generate.output", str(c.tmp)]),
         SystemExit, r"gpuopt: error: generate.output=.* is a folder: give a file path, e.g. .*generations.jsonl"),
    Case("predict-output-exists",
         lambda c: main(["predict", "--generate.prompts_file", c.yaml("a prompt\n"), "--generate.output", _existing_file(c)]),
         SystemExit, r"gpuopt: error: generate.output=.* exists .* give another --generate.output, or --generate.overwrite true"),
    Case("predict-output-in-use", _output_in_use, SystemExit,
         r"g.jsonl is being written by another gpuopt predict \(pid \d+ on .*\): two writers would lose each other's lines\. "
         r"Wait for it to end or stop it \(kill \d+\), or give this run another --generate.output; overwriting never "
         r"replaces a file a live run writes"),
    Case("predict-partial-left", _partial_left, SystemExit,
         r"g.jsonl.partial holds 1 completions of a run that ended before it wrote g.jsonl \(killed: its lock is free\), and "
         r"this run would start by emptying it: keep them \(mv .* or give --generate.overwrite true to replace it"),
    Case("doctor-json-in-use", _doctor_json_in_use, SystemExit,
         r"d.json is being written by another gpuopt doctor \(pid \d+ on .*\).* or give this run another --json"),
    Case("accumulate-grad-batches-zero", lambda c: _cli_before_data(c, ["--trainer.accumulate_grad_batches", "0"]), SystemExit,
         r"trainer.accumulate_grad_batches must be an integer >= 1, got 0 .*use 1 for a step per batch"),
    Case("val-check-interval-zero", lambda c: _cli_before_data(c, ["--trainer.val_check_interval", "0"]), SystemExit,
         r"trainer.val_check_interval must be an integer >= 1 or None, got 0 .*use e.g. 500, a fraction of the epoch"),
    Case("val-check-interval-over-one", lambda c: _cli_before_data(c, ["--trainer.val_check_interval", "1.5"]), SystemExit,
         r"trainer.val_check_interval must be in \(0, 1\] or None, got 1.5 .*an integer N validates every N batches"),
    Case("root-dir-is-a-file", lambda c: _cli_before_data(c, ["--trainer.default_root_dir", c.yaml("")]), SystemExit,
         r"trainer.default_root_dir=.*bad.yaml' is a file, not a folder: give a folder"),
    Case("callback-listed-twice", lambda c: _cli_before_data(c, ["--trainer.callbacks+=lightning_gpuopt.callbacks.MFUMonitor"]),
         SystemExit, r"trainer.callbacks lists MFUMonitor twice: its state is saved under the class name alone.*drop the extra --trainer.callbacks\+=MFUMonitor"),
    Case("linked-block-size-given", lambda c: _cli_before_data(c, ["--data.block_size", "64", "--model.block_size", "32"]), SystemExit,
         r"gpuopt: error: model.block_size is set from data.block_size .*drop model.block_size and set data.block_size only"),
    Case("yaml-tab-indent", lambda c: main(["fit", "--config", c.yaml("trainer:\n\tmax_steps: 3\n")]), SystemExit,
         r"--config .*bad.yaml is not valid YAML: line 2, column 1: a tab indents the line; .*Replace the tab with spaces"),
    Case("yaml-syntax-error", lambda c: main(["fit", "--config", c.yaml("trainer: {max_steps: 3\n")]), SystemExit,
         r"--config .*bad.yaml is not valid YAML: line \d+, column \d+: .*Fix the line"),
    Case("yaml-duplicate-key", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_steps: 3\n  max_steps: 5\n")]), SystemExit,
         r"--config .*bad.yaml is not valid: line 3: 'max_steps' is given twice in one mapping \(also on line 2\).* Keep one"),
    Case("yaml-group-is-a-list", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_steps: 3\nmodel:\n  - n_layer: 3\n")]), SystemExit,
         r"--config .*bad.yaml: model: holds a list .*so gpuopt would drop every model option in it\. Give the options as a mapping, without the dashes"),
    Case("yaml-callback-bad-argument",
         lambda c: main(["fit", "--config", c.yaml("trainer:\n  callbacks:\n    - class_path: lightning_gpuopt.callbacks.NonFiniteGuard\n"
                                                   "      init_args:\n        mode: lazy\n")]), SystemExit,
         r"trainer.callbacks: NonFiniteGuard\(mode=...\) must be one of 'auto', 'step', 'deferred', got 'lazy'\. Fix init_args.mode"),
    Case("yaml-callback-out-of-range",
         lambda c: _cli_before_data(c, ["--config", c.yaml("trainer:\n  callbacks:\n    - class_path: lightning_gpuopt.callbacks.NonFiniteGuard\n"
                                                           "      init_args: {max_consecutive_skips: 0}\n")]), SystemExit,
         r"gpuopt: error: trainer.callbacks: NonFiniteGuard.max_consecutive_skips must be an integer >= 1, got 0 .*Fix "
         r"init_args.max_consecutive_skips of NonFiniteGuard in trainer.callbacks \(the --config file, or "
         r"--trainer.callbacks.max_consecutive_skips right after --trainer.callbacks\+=NonFiniteGuard\)\.\n\(set GPUOPT_TRACEBACK"),
    Case("predict-batch-size-zero", lambda c: main(["predict", "--generate.prompts_file", c.yaml("a prompt\n"), "--generate.batch_size", "0"]),
         SystemExit, r"generate.batch_size must be >= 1, got 0"),
    Case("prompts-file-outside-predict", lambda c: main(["fit", "--trainer.max_steps", "1", "--generate.prompts_file", "p.txt"]),
         SystemExit, r"generate.prompts_file is read by `gpuopt predict` only, not `gpuopt fit`"),
    Case("cli-unknown-preset", lambda c: main(["fit", "--model.preset", "125m", "--data.source", str(c.text_dir), "--data.vocab_size", "300",
                                               "--trainer.max_steps", "10"]),
         SystemExit, r"gpuopt: error: Unknown GPT preset '125m': choose one of"),
    Case("cli-gradient-clip-negative", lambda c: _cli_before_data(c, ["--trainer.gradient_clip_val", "-1"]), SystemExit,
         r"trainer.gradient_clip_val must be >= 0 or None, got -1(\.0)?: a negative value turns clipping off"),
    Case("yaml-empty", lambda c: main(["fit", "--config", c.yaml("# nothing yet\n")]), SystemExit,
         r"The --config file is empty \(or holds only comments\): give it the groups to set"),
    Case("doctor-steps-zero", lambda c: main(["doctor", "--steps", "0"]), SystemExit, r"--steps must be at least 1, got 0"),
    Case("doctor-json-folder-missing", lambda c: main(["doctor", "--json", str(c.tmp / "none" / "out.json")]), SystemExit,
         r"--json .*out.json: the folder .*none does not exist; create it or pick another path"),
    Case("doctor-json-under-a-file", lambda c: main(["doctor", "--json", str(c.yaml("x: 1\n")) + "/out.json"]), SystemExit,
         r"--json .*/out.json: the folder .* is a file, not a folder; pick another path"),
    Case("doctor-json-not-writable", lambda c: main(["doctor", "--json", str(c.tmp)]), SystemExit,
         r"--json='.*' is a folder, not a file: the checks are written there at the end\. Give a file in a folder you can "
         r"write, --json PATH"),
    Case("cli-default-class-named", lambda c: main(["fit", "--model", "lightning_gpuopt.GPTModule", "--trainer.max_steps", "1"]),
         SystemExit, r"model: lightning_gpuopt.GPTModule is gpuopt's default model and takes its options directly: drop the class path"),
    Case("predict-prompts-file-own-module",
         lambda c: main(["predict", "--model", "tests._module_shapes.NanoGPTModule", "--generate.prompts_file", c.yaml("a prompt\n")]),
         SystemExit, r"generate.prompts_file needs GPTModule and TextDataModule .*give the prompts as its predict data"),
    Case("auto-strategy-no-batch-size",
         lambda c: main(["fit", "--model", "tests._module_shapes.NanoGPTModule", "--trainer.strategy", "gpuopt-auto",
                         "--auto_strategy.device_memory_gb", "80", "--auto_strategy.print_plan", "true", "--trainer.max_steps", "1",
                         "--trainer.default_root_dir", str(c.tmp)]),
         SystemExit, r"needs the micro-batch size .*the module trains on its own loaders: give the data module an int batch_size, or name the strategy"),
    Case("auto-strategy-no-gpu", lambda c: _cli_before_data(c, ["--trainer.strategy", "gpuopt-auto"]),
         SystemExit, r"trainer.strategy=gpuopt-auto plans for a GPU, and this machine has none \(cpu\): name the GPU to plan for, "
                     r"--auto_strategy.device 'H100 SXM' .*or name a strategy, --trainer.strategy auto\.\n"),
    Case("resume-architecture-change", lambda c: _cli_before_data(c, ["--ckpt_path", _lightning_ckpt(c), "--model.n_layer", "3"]),
         SystemExit, r"model.n_layer=3 but the checkpoint has n_layer=2\. Drop those options"),
    Case("resume-block-size-change", lambda c: _cli_before_data(c, ["--ckpt_path", _lightning_ckpt(c), "--data.block_size", "16"]),
         SystemExit, r"model.block_size=16 \(linked from data.block_size\) but the checkpoint has block_size=32: set data.block_size 32"),
    Case("resume-vocab-change", lambda c: _cli_before_data(c, ["--ckpt_path", _lightning_ckpt(c), "--data.vocab_size", "320"]),
         SystemExit, r"but the checkpoint has vocab_size=300: set data.vocab_size 300 .*or data.tokenizer"),
    Case("resume-other-tokenizer", lambda c: check_same_tokenizer({"tokenizer_sha256": "0" * 64, "tokenizer_file": "/run/tokenizer.json"},
                                                                  Tokenizer.from_file(_tokenizer_without_eot(c)), "data.source='x'"),
         ValueError, r"is not the one the checkpoint was trained with .*set data.tokenizer /run/tokenizer.json"),
    Case("resume-given-tokenizer-differs",
         lambda c: _cli_before_data(c, ["--ckpt_path", _ckpt_carrying_a_tokenizer(c), "--data.tokenizer", _corpus_tokenizer(c),
                                              "--trainer.max_steps", "8"]),
         SystemExit, r"is not the one the checkpoint was trained with .*Leave data.tokenizer unset: the checkpoint's own tokenizer is then used"),
    Case("checkpoint-tokenizer-damaged",
         lambda c: carried_tokenizer({"tokenizer_json": Tokenizer(models.BPE()).to_str(), "tokenizer_sha256": "0" * 64}),
         ValueError, r"does not match its tokenizer_sha256: the checkpoint is damaged\. Use an earlier checkpoint"),
    Case("limit-batches-negative", lambda c: _cli_before_data(c, ["--trainer.limit_val_batches", "-1"]), SystemExit,
         r"trainer.limit_val_batches must be an integer >= 0 or None, got -1 .*use e.g. 20, a fraction of the epoch such as 0.25"),
    Case("cli-float-not-finite", lambda c: main(["fit", "--trainer.max_steps", "1", "--model.learning_rate", "inf"]), SystemExit,
         r"model.learning_rate must be a finite number, got inf: give a finite value for --model.learning_rate"),
    Case("root-dir-not-writable", lambda c: _cli_before_data(c, ["--trainer.default_root_dir", "/sys/gpuopt-test-run"]), SystemExit,
         r"trainer.default_root_dir='/sys/gpuopt-test-run' cannot be written \(.* at /sys\): the run's checkpoints and logs go "
         r"there. Give a folder you can write, --trainer.default_root_dir runs/NAME",
         skip=None if Path("/sys").is_dir() else "no /sys (a folder nobody can write into) on this system"),
    Case("limit-fraction-under-one-batch",
         lambda c: main(["fit", "--data.source", str(c.text_dir), "--data.vocab_size", "300", "--data.block_size", "128",
                         "--data.num_workers", "0", "--model.preset", "tiny", "--model.warmup_steps", "0", "--trainer.max_steps", "1",
                         "--trainer.logger", "false",
                         "--trainer.default_root_dir", str(c.tmp / "run"), "--trainer.limit_val_batches", "0.1"]), SystemExit,
         r"trainer.limit_val_batches=0.1 keeps less than one of the \d+ validation batches \(0.1 x \d+ < 1\), so no validation "
         r"would run: give a fraction of at least [\d.]+, or a number of batches \(--trainer.limit_val_batches \d+ runs all"),
    Case("cli-union-float-not-finite", lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.gradient_clip_val", "inf"]),
         SystemExit, r"gpuopt: error: trainer.gradient_clip_val must be a finite number, got inf: give a finite value for "
         r"--trainer.gradient_clip_val \(or trainer.gradient_clip_val in the --config file\)\.\n\(gpuopt fit --help"),
    Case("cli-list-given-as-text", lambda c: main(["predict", "--data.prompts", "the model"]), SystemExit,
         r"data.prompts takes a list, got the text 'the model': write it in brackets, --data.prompts '\[the model\]'"),
    Case("cli-max-steps-zero", lambda c: _cli_before_data(c, ["--trainer.max_steps", "0"]), SystemExit,
         r"trainer.max_steps=0 trains nothing .*e\.g\. --trainer.max_steps 3000, or -1 for no limit"),
    Case("monitor-typo", lambda c: _cli_before_data(c, ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "val_loss"]),
         SystemExit, r"EarlyStopping\(monitor='val_loss'\): GPTModule logs no 'val_loss', .*Did you mean 'val/loss'\?"),
    Case("callback-class-path-typo", lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.callbacks+=lightning_gpuopt.callbacks.MFUMonitr"]),
         SystemExit, r"trainer.callbacks: lightning_gpuopt.callbacks.MFUMonitr does not exist .*did you mean lightning_gpuopt.callbacks.MFUMonitor\?"),
    Case("callback-name-typo", lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.callbacks+=MFUMonitr"]),
         SystemExit, r"trainer.callbacks: no class named 'MFUMonitr': did you mean MFUMonitor \(lightning_gpuopt"),
    Case("callback-option-typo", lambda c: main(["fit", "--trainer.callbacks+=MFUMonitor", "--trainer.callbacks.log_every_n_stepz", "3"]),
         SystemExit, r"trainer.callbacks: MFUMonitor takes no option 'log_every_n_stepz': did you mean 'log_every_n_steps'\? \(a "
                     r"--trainer.callbacks.log_every_n_stepz flag sets an option of the last class in trainer.callbacks, here MFUMonitor"),
    Case("callback-option-typo-in-config",
         lambda c: main(["fit", "--config", c.yaml("trainer:\n  callbacks:\n    - class_path: lightning_gpuopt.callbacks.NonFiniteGuard\n"
                                                   "      init_args: {patience: 3}\n")]),
         SystemExit, r"gpuopt: error: trainer.callbacks: NonFiniteGuard takes no option 'patience': it takes policy, "
                     r"max_consecutive_skips, check_gradients, mode\. \(fix init_args of NonFiniteGuard in trainer.callbacks in the "
                     r"--config file\.\)\n\(gpuopt fit --help"),
    Case("flat-option-before-own-class",
         lambda c: main(["fit", "--config", c.yaml("model: {preset: tiny}\n"), "--model.class_path", "lightning_gpuopt.GPTModul"]),
         SystemExit, r"model.preset is an option of gpuopt's GPTModule, given flat before any model class, .*under init_args, "
                     r"after its class path .*or drop the class path to train GPTModule"),
    # ---------------------------------------------------------------- checkpoints
    Case("checkpoint-truncated", lambda c: load_gpt(_ckpt(c, truncate=True)), CheckpointError, "Use an earlier checkpoint; save with AtomicCheckpointIO"),
    Case("checkpoint-bytes-changed", lambda c: load_gpt(_ckpt(c, zero_middle=True)), CheckpointError,
         r"is damaged \(Bad CRC-32 for file .*\): its bytes no longer match the checksums .*Use an earlier checkpoint of the run"),
    Case("checkpoint-foreign-file", lambda c: load_gpt(c.yaml("model: {}\n")), CheckpointError, "is not a PyTorch checkpoint"),
    Case("checkpoint-not-a-gptmodule", lambda c: load_gpt(_ckpt(c, {"state_dict": {}})), CheckpointError, "is not a GPTModule checkpoint"),
    Case("cli-foreign-checkpoint", lambda c: _cli_before_data(c, ["--ckpt_path", str(_ckpt(c, {"weights": torch.ones(2)}))]), SystemExit,
         r"gpuopt: error: .* is not a GPTModule checkpoint \(no 'preset' in its hyper_parameters\)"),
    Case("resume-last-architecture-change", lambda c: _cli_before_data(c, ["--ckpt_path", _as_last(c), "--model.n_layer", "3"]),
         SystemExit, r"loading the checkpoint .*last.ckpt.*model.n_layer=3 but the checkpoint has n_layer=2\. Drop those options"),
    Case("fit-over-existing-run", lambda c: (_as_last(c), _cli_before_data(c, [])), SystemExit,
         r"last.ckpt holds a run this fit would overwrite .*To continue it: .*--ckpt_path last.*--trainer.default_root_dir NEW_FOLDER"),
    Case("fit-folder-in-use", _in_use, SystemExit,
         r"run is in use by another gpuopt fit \(pid 4242 on gpu-node-7, since .*\): two runs in one folder write over each "
         r"other's checkpoints\. Wait for it to end \(or stop it\), or give this run another --trainer.default_root_dir"),
    Case("resume-no-steps-left", lambda c: _cli_before_data(c, ["--ckpt_path", _lightning_ckpt(c)]), SystemExit,
         r"run.ckpt' is at step 4 and trainer.max_steps=1, so this fit would train nothing .*raise trainer.max_steps above 4"),
    Case("resume-no-epochs-left", lambda c: _own(c, "fit", "Regressor", "--trainer.max_epochs", "1", "--ckpt_path", _own_ckpt(c)),
         SystemExit, r"own.ckpt' has trained 1 epoch and trainer.max_epochs=1, so this fit would train nothing .*--trainer.max_epochs 2"),
    Case("resume-own-module-shape-change",
         lambda c: _own(c, "fit", "Regressor", "--trainer.max_steps", "8", "--model.d", "32", "--ckpt_path", _own_ckpt(c)), SystemExit,
         r"own.ckpt' does not fit Regressor as configured: 3 of 4 weights differ in shape \(first: net.0.weight \[16, 16\] in the "
         r"checkpoint, \[32, 16\] in the model.*the checkpoint's options \(d=16\), or start a new run"),
    Case("cli-own-module-unknown-option", lambda c: _own(c, "fit", "Regressor", "--model.d_inn", "8", "--trainer.max_steps", "1"),
         SystemExit, r"model.d_inn: tests.cli._own_modules.Regressor takes no option 'd_inn': did you mean 'd_in' \(--model.d_in\)\?"),
    Case("cli-no-train-data", lambda c: _own(c, "fit", "NoLoaderRegressor", "--trainer.max_steps", "1"), SystemExit,
         r"gpuopt fit has no data: NoLoaderRegressor has no train_dataloader and no data module is given \(--data\)\. Name a "
         r"LightningDataModule .* --data my_pkg.MyData .*or give NoLoaderRegressor a train_dataloader method"),
    Case("cli-no-predict-data", lambda c: _own(c, "predict", "Regressor"), SystemExit,
         r"gpuopt predict has no data: Regressor has no predict_dataloader .* give Regressor a predict_dataloader method"),
    Case("ckpt-path-hpc-missing", lambda c: _cli_before_data(c, ["--ckpt_path", "hpc"]), SystemExit,
         r"--ckpt_path hpc: no hpc_ckpt_N.ckpt in .*Pass the checkpoint's path"),
    Case("ckpt-path-registry", lambda c: _cli_before_data(c, ["--ckpt_path", "registry:my-model"]), SystemExit,
         r"needs a local file\. Download it from the model registry first .* and pass its path"),
    Case("predict-scorer-raises", lambda c: _predict(c, "--generate.scorer", "tests.cli.test_prompts:raise_always"), SystemExit,
         r"generate.scorer='tests.cli.test_prompts:raise_always' raised KeyError: 'answer' for the prompt 'a prompt' and the "
         r"completion '': make it return a number \(0 for a completion it rejects\) for any completion"),
    Case("predict-scorer-missing", lambda c: _predict(c, "--generate.scorer", "no_such_checks:score"), SystemExit,
         r"generate.scorer='no_such_checks:score': cannot import no_such_checks .*put no_such_checks.py where Python finds it \(e.g. PYTHONPATH=."),
    Case("predict-scorer-no-function", lambda c: _predict(c, "--generate.scorer", "tests.cli.test_prompts:scorer"), SystemExit,
         r"tests.cli.test_prompts has no function 'scorer' \(it has \[.*\]\): name one of them"),
    Case("predict-scorer-not-a-number", lambda c: _predict(c, "--generate.scorer", "tests.cli.test_prompts:words"), SystemExit,
         r"returned 'many' \(str\) for the prompt 'a prompt': it must return a finite number or a bool"),
    Case("predict-kept-output-without-scorer", lambda c: _predict(c, "--generate.kept_output", str(c.tmp / "k.jsonl")), SystemExit,
         r"generate.kept_output is written with a scorer only: add --generate.scorer module:function"),
    Case("cli-unknown-subcommand", lambda c: main(["fitt", "--model.preset", "tiny"]), SystemExit,
         r"'fitt' is not a gpuopt command \(did you mean 'fit'\?\): choose from fit, validate, test, predict, doctor\."),
    Case("predict-kept-output-is-output",
         lambda c: _predict(c, "--generate.scorer", "tests.cli.test_prompts:accept_long", "--generate.kept_output", str(c.tmp / "g.jsonl")),
         SystemExit, r"generate.kept_output and generate.output are the same file \(.*g.jsonl\): .*name another --generate.kept_output"),
    Case("predict-generate-options-without-prompts-file",
         lambda c: main(["predict", "--model.preset", "tiny", "--data.prompts", "[hi]", "--generate.stop", "[x]", "--generate.output",
                         str(c.tmp / "g.jsonl")]),
         SystemExit, r"generate.stop, generate.output are read with --generate.prompts_file only \(`gpuopt predict "
                     r"--generate.prompts_file FILE`\): add it, or leave them out \(--data.prompts samples are printed\)\."),
    Case("predict-print-plan", lambda c: main(["predict", "--model.preset", "tiny", "--trainer.strategy", "gpuopt-auto",
                                               "--auto_strategy.print_plan", "true"]),
         SystemExit, r"--auto_strategy.print_plan prints the plan of a training run: `gpuopt fit .*`, not `gpuopt predict`"),
    Case("auto-strategy-memory-zero",
         lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.strategy", "gpuopt-auto", "--auto_strategy.print_plan", "true",
                         "--auto_strategy.device_memory_gb", "0"]),
         SystemExit, r"--auto_strategy.device_memory_gb must be > 0, got 0: the memory of one GPU in GB, e.g. 80\."),
    Case("choose-strategy-memory-negative",
         lambda c: choose_strategy(GPTConfig.from_name("llama-8b"), devices=8, device_memory=-5e9), ValueError,
         r"choose_strategy.device_memory must be > 0 or None, got -5000000000.0 \(bytes per device\)"),
    Case("auto-strategy-device-trains-on-cpu",
         lambda c: main(["fit", "--trainer.max_steps", "1", "--trainer.strategy", "gpuopt-auto", "--auto_strategy.device", "H100 SXM"]),
         SystemExit, r"--auto_strategy.device plans trainer.strategy=gpuopt-auto for a GPU, and this machine has none, so the run "
                     r"would train on its CPU: add --auto_strategy.print_plan true",
         skip="a CUDA GPU is here" if torch.cuda.is_available() else None),
    Case("predict-stop-empty", lambda c: _predict(c, "--generate.stop", '["\\n", ""]'), SystemExit,
         r"generate.stop\[1\] is empty, so it has no tokens and would never match: give each stop sequence some text"),
    Case("predict-prompts-not-utf8", lambda c: _predict(c, prompts="caf\u00e9\n".encode("latin-1")), SystemExit,
         r"generate.prompts_file=.*p.txt' is not UTF-8 text \(byte 0xe9 on line 1 cannot be decoded\): save it as UTF-8, e.g. iconv"),
    Case("predict-prompts-broken-json", lambda c: _predict(c, prompts='{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",}\n', name="p.jsonl"),
         SystemExit, r"p.jsonl, line 3: not valid JSON \(.*\): fix that line; each line of a .jsonl file is one JSON object"),
    Case("predict-output-folder-not-writable",
         lambda c: _predict(c, "--generate.output", str(Path(c.yaml("")) / "g.jsonl")), SystemExit,
         r"generate.output=.*bad.yaml/g.jsonl' cannot be written \(Not a directory at .*bad.yaml\): give a --generate.output in a folder you can write"),
    Case("predict-max-new-tokens-over-context", lambda c: _predict(c, "--model.max_new_tokens", "100000000"), SystemExit,
         r"max_new_tokens=100000000 does not fit in the model's context of block_size=32 tokens, prompt included: ask for at most 31"),
    Case("fit-init-from-other-architecture",
         lambda c: _cli_before_data(c, ["--model.init_from", _lightning_ckpt(c), "--model.n_layer", "3"]), SystemExit,
         r"model.init_from=.*run.ckpt' holds weights of another architecture than this run's: it has n_layer=2 and this run "
         r"asks model.n_layer=3\. Drop those options \(the file's architecture is used\)"),
    Case("fit-init-from-nonfinite", lambda c: _cli_before_data(c, ["--model.init_from", _nan_ckpt(c)]), SystemExit,
         r"Weights of '.*nan.ckpt' refused: 'transformer.h.0.mlp.c_fc.weight' holds NaN/Inf \(1 of \d+ weight tensors do\): "
         r"the run that wrote them had diverged\.\nUse an earlier checkpoint of that run, or start from other weights\.\n"
         r"To read the file anyway: torch.load"),
    Case("auto-strategy-plan-does-not-fit",
         lambda c: main(["fit", "--model.preset", "llama-70b", "--trainer.strategy", "gpuopt-auto", "--trainer.devices", "8",
                         "--auto_strategy.device", "H100 SXM", "--auto_strategy.print_plan", "true", "--data.source",
                         "stdlib", "--trainer.max_steps", "1", "--data.block_size", "8192", "--data.batch_size", "1"]),
         SystemExit, r"gpuopt: error: Does not fit on 8 x NVIDIA H100 80GB HBM3 \(85.9 GB\): train on at least 24 devices\."),
    Case("callback-class-not-importable", lambda c: main(["fit", "--trainer.callbacks+=mypkg.CB", "--trainer.max_steps", "1"]),
         SystemExit, r"trainer.callbacks: cannot import mypkg.CB \(no module named 'mypkg'\)\. If mypkg is your own code, run "
                     r"from the folder that holds it with PYTHONPATH=\."),
    Case("predict-prompts-empty-list", lambda c: main(["predict", "--data.prompts", "[]"]), SystemExit,
         r"--data.prompts is empty, so predict would sample nothing: give each prompt some text"),
    Case("fit-init-from-missing", lambda c: _cli_before_data(c, ["--model.init_from", str(c.tmp / "none.ckpt")]), SystemExit,
         r"Checkpoint .*none.ckpt' does not exist: check the path"),
    Case("hf-pickle-only-folder", _hf_pickles_only, HFError,
         r"holds its weights only as pickles \(pytorch_model.bin\), which are not read: unpickling runs whatever code"),
    Case("hf-unsupported-architecture", lambda c: load_hf(_hf_folder(c, architectures=["MixtralForCausalLM"])), HFError,
         r"holds a \['MixtralForCausalLM'\] model, which load_hf does not read: supported are GPT2LMHeadModel, "
         r"LlamaForCausalLM, Qwen2ForCausalLM"),
    Case("hf-rope-scaling",
         lambda c: load_hf(_hf_folder(c, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 32.0})),
         HFError, r"RoPE scaling of type 'yarn', which the GPT's rotary embedding does not have \(it has Llama 3.1's "
         r"'llama3'"),
    Case("hf-shapes-unlike-config", lambda c: load_hf(_hf_folder(c, vocab_size=256)), HFError,
         r"do not match its config.json \(LlamaForCausalLM\): model.embed_tokens.weight \[300, 64\] in the folder, "
         r"\[256, 64\] expected.*Nothing was loaded"),
    Case("hf-init-from-without-tokenizer",
         lambda c: _cli_before_data(c, ["--model.init_from", str(_hf_folder(c))]), SystemExit,
         r"has no tokenizer.json, and the data needs the tokenizer the model was trained with .*give --data.tokenizer"),
    Case("export-output-not-writable", lambda c: main(["export", _lightning_ckpt(c), c.yaml("") + "/out"]), SystemExit,
         r"bad.yaml/out' cannot be written: .*bad.yaml' is not a folder"),
    Case("data-loss-on-completion-plain-text", lambda c: c.data(loss_on="completion"), ValueError,
         r"data.loss_on='completion' needs prompt/completion records, and data.source=.* is plain text: give a .jsonl file"),
    Case("data-jsonl-bad-record", _bad_records, ValueError,
         r"records.jsonl, line 2: a JSONL corpus line needs \"prompt\" and \"completion\" strings \(or a \"text\" string\)"),
    Case("checkpoint-pickled-objects-cli", _resume_pickled_objects, SystemExit,
         r"holds objects other than tensors and primitive types \(the first: .*open\), so it was not loaded: .*gpuopt reads "
         r"checkpoints with weights_only=True only, whatever --weights_only says\. If you trust the file, save what you "
         r"need of it again in Python"),
    Case("checkpoint-nonfinite-optimizer-state",
         lambda c: AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(1)},
                                                         "optimizer_states": [{"state": {0: {"exp_avg_sq": torch.tensor([float("inf")])}}}]},
                                                        c.tmp / "last.ckpt"),
         NonFiniteCheckpointError, r"1 of 1 optimizer-state tensors hold NaN/Inf \(first: 'optimizer_states.0.state.0.exp_avg_sq'\).* "
         r"not necessarily good.*Add lightning_gpuopt.callbacks.NonFiniteGuard"),
    Case("checkpoint-nonfinite-on-load", lambda c: AtomicCheckpointIO().load_checkpoint(_nonfinite_ckpt(c)), CheckpointError,
         r"inf.ckpt' refused: 'w' holds NaN/Inf \(1 of 1 weight tensors do\).*\nUse an earlier checkpoint of that run.*\n"
         r"To read the file anyway: AtomicCheckpointIO\(allow_nonfinite=True\)\."),
    Case("checkpoint-nonfinite-weights", lambda c: AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.tensor([1.0, float("nan")])}}, c.tmp / "last.ckpt"),
         NonFiniteCheckpointError, r"Not writing the checkpoint .*1 of 1 weight tensors hold NaN/Inf \(first: 'w'\), the run has diverged"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_early_and_names_the_fix(case, tmp_path, text_dir, cache_dir, capsys):
    if case.skip:
        pytest.skip(case.skip)
    with pytest.raises(case.error) as info:
        case.raise_it(Ctx(tmp_path, text_dir, cache_dir))
    message = str(info.value) + (capsys.readouterr().err if case.error is SystemExit else "")
    assert re.search(case.match, message, re.S), message


def test_every_case_is_in_the_docs_table_and_back():
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), re.M))
    assert rows == {c.id for c in CASES}
    assert len(rows) >= 25
