"""The bad-input catalogue (docs/errors.md): one case per row, each checking the error type and that the
message names the fix. Cases that run data preparation also check nothing was written before the error."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from lightning_gpuopt import GPT, GPTConfig, GPTModule, TextDataModule
from lightning_gpuopt.callbacks import AutoBatchSize, CUDASettings, MFUMonitor, NonFiniteGuard
from lightning_gpuopt.cli import main
from lightning_gpuopt.model.checkpoint import CheckpointError, load_gpt
from lightning_gpuopt.perf.batch_search import per_device_batch
from lightning_gpuopt.plugins import Float8Precision
from lightning_gpuopt.plugins.float8 import check_float8_device, check_float8_strategy

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


class _NoBatchSizeModule(GPTModule):
    """A module that builds its own loader with a hard-coded batch size: nothing for AutoBatchSize to set."""

    def __init__(self):
        super().__init__(vocab_size=64, block_size=16)

    def train_dataloader(self):
        tokens = torch.zeros(8, 17, dtype=torch.long)
        return torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=4)


def _prepare_leaves_nothing(ctx: Ctx, source: Path) -> None:
    data = ctx.data(source)
    try:
        data.prepare_data()
    finally:
        assert not data.data_dir.exists(), "an error after writing part of the cache"


def _tokenizer_without_eot(ctx: Ctx) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["some text here"], trainers.BpeTrainer(vocab_size=280, show_progress=False))
    tok.save(str(ctx.tmp / "tok.json"))
    return str(ctx.tmp / "tok.json")


def _ckpt(ctx: Ctx, content: Optional[dict] = None, truncate: bool = False) -> Path:
    path = ctx.tmp / "x.ckpt"
    state = {f"model.{k}": v for k, v in GPT(GPTConfig.from_name("tiny")).state_dict().items()}
    torch.save(content if content is not None else {"hyper_parameters": {"preset": "tiny"}, "state_dict": state}, path)
    if truncate:
        path.write_bytes(path.read_bytes()[:5000])
    return path


def _requires_missing(module: str) -> Optional[str]:
    return f"{module} is installed" if importlib.util.find_spec(module) is not None else None


@dataclass
class Case:
    id: str
    raise_it: Callable[[Ctx], Any]
    error: type
    match: str  # a fragment of the message that names the fix
    skip: Optional[str] = None



def _fsdp_fp16_strategy():
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    return FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))


CASES = [
    # ---------------------------------------------------------------- model configuration
    Case("n-head-not-dividing", lambda c: GPTConfig(n_embd=64, n_head=5), ValueError, r"choose n_head from \[1, 2, 4, 8, 16, 32, 64\]"),
    Case("unknown-preset", lambda c: GPTModule(preset="125m"), ValueError, r"choose one of \['1.5b', '124m'"),
    Case("unknown-config-field", lambda c: GPTConfig.from_name("tiny", n_layers=4), ValueError, r"Unknown GPTConfig field\(s\) \['n_layers'\]"),
    Case("non-positive-size", lambda c: GPTConfig(n_layer=0), ValueError, "n_layer must be a positive integer"),
    Case("dropout-out-of-range", lambda c: GPTConfig(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
    Case("learning-rate-not-positive", lambda c: GPTModule(learning_rate=0.0), ValueError, "learning_rate must be > 0"),
    Case("compile-mode-without-compile", lambda c: GPTModule(compile_mode="max-autotune"), ValueError, "also set compile=True"),
    Case("flash-attn-missing", lambda c: GPTModule(attention="flash-attn"), ImportError,
         r'pip install "lightning-gpuopt\[flash\]".*or use attention="sdpa"', skip=_requires_missing("flash_attn")),
    Case("no-run-length", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(), max_steps=-1, max_epochs=-1),
         ValueError, r"set trainer.max_steps \(or max_epochs\)"),
    Case("data-longer-than-model-context", lambda c: c.fit(GPTModule(vocab_size=300, block_size=16), c.data()), ValueError,
         "set model.block_size >= 32 or data.block_size <= 16"),
    Case("generate-top-k", lambda c: GPT(GPTConfig.from_name("tiny")).generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0),
         ValueError, "top_k must be >= 1 or None"),
    # ---------------------------------------------------------------- data
    Case("empty-source", lambda c: c.data(source=" "), ValueError, "use 'stdlib', a folder, a file, a glob, or 'hf:NAME'"),
    Case("missing-path", lambda c: c.data(source=str(c.tmp / "nope")), ValueError, "does not exist: use 'stdlib'"),
    Case("folder-without-text", lambda c: c.data(source=c.folder("j", {"a.json": b"{}"})), ValueError, "no .txt, .md, .raw or .py files"),
    Case("glob-matches-nothing", lambda c: c.data(source=str(c.tmp / "*.nothing")), ValueError, "matches no files: check the pattern"),
    Case("empty-corpus", lambda c: _prepare_leaves_nothing(c, c.folder("e", {"a.txt": b"", "b.txt": b"  \n"})), ValueError,
         "is empty: data.source holds no text"),
    Case("unreadable-file", lambda c: _prepare_leaves_nothing(c, c.folder("u", {"a.txt": b"\xff\xfe\xfa bad"})), ValueError,
         "Fix its permissions or encoding"),
    Case("corpus-too-short", lambda c: c.data(source=c.folder("s", {"a.txt": b"short text " * 20}), block_size=256).setup("fit"),
         ValueError, "use a larger corpus, a smaller data.block_size"),
    Case("tokenizer-missing", lambda c: c.data(tokenizer=str(c.tmp / "tok.json")), ValueError, "give the path of a tokenizer.json"),
    Case("tokenizer-not-a-tokenizer", lambda c: c.data(tokenizer=str(c.folder("t", {"tok.json": b"{}"}) / "tok.json")), ValueError,
         "is not a valid tokenizer.json"),
    Case("tokenizer-without-eot", lambda c: c.data(tokenizer=_tokenizer_without_eot(c)), ValueError,
         "add it as a special token, or leave data.tokenizer unset"),
    Case("tokenizer-larger-than-model", lambda c: c.fit(GPTModule(vocab_size=260, block_size=32), c.data()), ValueError,
         "set model.vocab_size >= 300"),
    Case("vocab-too-small", lambda c: c.data(vocab_size=100), ValueError, r"vocab_size must be at least 257"),
    Case("val-fraction-out-of-range", lambda c: c.data(val_fraction=0.6), ValueError, r"val_fraction must be in \(0, 0.5\)"),
    Case("batch-size-zero", lambda c: c.data(batch_size=0), ValueError, "batch_size must be an integer >= 1"),
    Case("empty-prompt", lambda c: c.data(prompts=[""]).predict_dataloader(), ValueError, "give each prompt some text"),
    Case("hf-without-datasets", lambda c: c.data(source="hf:wikitext:wikitext-2-raw-v1"), ImportError,
         "pip install datasets", skip=_requires_missing("datasets")),
    # ---------------------------------------------------------------- plugins, strategies, hardware
    Case("fp8-on-old-gpu", lambda c: check_float8_device(torch.device("cuda", 0), emulate=False, capability=(8, 0)), RuntimeError,
         r"compute capability >= 8.9.*Float8Precision\(emulate=True\).*BF16Precision\(\)"),
    Case("fp8-with-fp16-strategy", lambda c: check_float8_strategy(_fsdp_fp16_strategy()), ValueError,
         "param_dtype=torch.float16, reduce_dtype=torch.float16. Use torch.bfloat16"),
    Case("fp8-and-precision-flag", lambda c: pl.Trainer(plugins=[Float8Precision(emulate=True)], precision="16-mixed", logger=False),
         ValueError, r"Received both `precision=16-mixed` and `plugins=.*Choose one"),
    Case("fp8-unknown-recipe", lambda c: Float8Precision(recipe="columnwise"), ValueError, r"choose one of \['tensorwise'"),
    Case("fp8-bad-module-filter", lambda c: Float8Precision(module_filter="lm_head"), ValueError, r"a list of layer-name patterns to skip \(e.g. \['lm_head'\]\)"),
    # ---------------------------------------------------------------- callback arguments
    Case("sdpa-unknown-backend", lambda c: CUDASettings(sdpa_backends=["flash", "fast"]), ValueError,
         r"distinct names from \['cudnn', 'flash', 'efficient', 'math'\]"),
    Case("tf32-vs-highest-precision", lambda c: CUDASettings(tf32=True, matmul_precision="highest"), ValueError, "contradict each other: drop one"),
    Case("no-tf32-vs-tf32-precision", lambda c: CUDASettings(tf32=False, matmul_precision="high"), ValueError, "turns TF32 matmuls on. Drop one"),
    Case("mfu-peak-in-tflops", lambda c: MFUMonitor(peak_flops=-1.0), ValueError, r"must be > 0 FLOP/s \(e.g. 989.4e12\)"),
    Case("mfu-log-every-zero", lambda c: MFUMonitor(log_every_n_steps=0), ValueError, "must be a positive integer or None"),
    Case("guard-unknown-policy", lambda c: NonFiniteGuard(policy="ignore"), ValueError, "policy must be 'skip' or 'stop'"),
    Case("guard-max-skips-zero", lambda c: NonFiniteGuard(max_consecutive_skips=0), ValueError, "use policy='stop' to stop at the first bad step"),
    # ---------------------------------------------------------------- CLI and YAML
    Case("global-batch-not-divisible", lambda c: per_device_batch(100, 8), ValueError,
         r"use a multiple of 8, e\.g\. global_batch_size=96 or 104"),
    Case("negative-memory-margin", lambda c: AutoBatchSize(memory_margin=-0.1), ValueError,
         r"memory_margin is the fraction of memory to keep free, in \[0, 1\)"),
    Case("auto-batch-cpu-unbounded", lambda c: c.fit(GPTModule(vocab_size=300, block_size=32), c.data(), callbacks=[AutoBatchSize(global_batch_size=8)]),
         ValueError, r"Set AutoBatchSize\(max_micro_batch_size=\.\.\.\)"),
    Case("auto-batch-no-batch-size", lambda c: c.fit(_NoBatchSizeModule(), None, callbacks=[AutoBatchSize(max_micro_batch_size=4)]),
         ValueError, r"AutoBatchSize\(batch_size_attr=\.\.\.\)"),
    Case("yaml-typo-in-key", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_step: 10\n")]), SystemExit,
         r"does not accept option 'trainer.max_step': did you mean 'trainer.max_steps'"),
    Case("yaml-typo-in-model-key", lambda c: main(["fit", "--config", c.yaml("model:\n  presett: tiny\n")]), SystemExit,
         r"did you mean 'model.preset' \(--model.preset on the command line\)"),
    Case("yaml-wrong-type", lambda c: main(["fit", "--config", c.yaml("trainer:\n  max_steps: ten\n")]), SystemExit,
         r'Parser key "trainer.max_steps":\s+Expected a <class \'int\'>. Got value: ten'),
    Case("cli-unknown-option", lambda c: main(["fit", "--model.n_layers", "4"]), SystemExit, r"unrecognized arguments: --model.n_layers 4; for --model.n_layers did you mean --model.n_layer\?"),
    Case("cli-fit-without-run-length", lambda c: main(["fit", "--model.preset", "tiny"]), SystemExit,
         r"gpuopt fit needs a run length: set trainer.max_steps \(e\.g\. --trainer.max_steps 3000\)"),
    Case("predict-prompts-file-missing", lambda c: main(["predict", "--generate.prompts_file", str(c.tmp / "none.txt")]),
         FileNotFoundError, r"generate.prompts_file=.*none.txt' does not exist: give a text or JSONL file of prompts"),
    Case("predict-batch-size-zero", lambda c: main(["predict", "--generate.prompts_file", c.yaml("a prompt\n"), "--generate.batch_size", "0"]),
         SystemExit, r"generate.batch_size must be >= 1, got 0"),
    Case("prompts-file-outside-predict", lambda c: main(["fit", "--trainer.max_steps", "1", "--generate.prompts_file", "p.txt"]),
         SystemExit, r"generate.prompts_file is read by `gpuopt predict` only, not `gpuopt fit`"),
    Case("cli-unknown-preset", lambda c: main(["fit", "--model.preset", "125m", "--data.source", str(c.text_dir), "--data.vocab_size", "300",
                                               "--trainer.max_steps", "10"]),
         ValueError, r"Unknown GPT preset '125m': choose one of"),
    # ---------------------------------------------------------------- checkpoints
    Case("checkpoint-truncated", lambda c: load_gpt(_ckpt(c, truncate=True)), CheckpointError, "Use an earlier checkpoint; save with AtomicCheckpointIO"),
    Case("checkpoint-foreign-file", lambda c: load_gpt(c.yaml("model: {}\n")), CheckpointError, "is not a PyTorch checkpoint"),
    Case("checkpoint-not-a-gptmodule", lambda c: load_gpt(_ckpt(c, {"state_dict": {}})), CheckpointError, "is not a GPTModule checkpoint"),
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
