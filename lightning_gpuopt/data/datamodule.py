"""`TextDataModule`: text -> BPE tokens -> memory-mapped token files -> fast DataLoaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from tokenizers import Tokenizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_gpuopt.data.cache import FORMAT_VERSION, check_cache, default_cache_dir, token_cache_dir
from lightning_gpuopt.data.prepare import prepare_token_cache
from lightning_gpuopt.data.sampler import ResumableSampler
from lightning_gpuopt.data.sources import Corpus, resolve_source
from lightning_gpuopt.data.tokenizer import MIN_VOCAB_SIZE as _MIN_VOCAB
from lightning_gpuopt.data.tokenizer import (
    carried_tokenizer,
    check_same_tokenizer,
    end_of_text_id,
    load_tokenizer,
    plain_text,
    tokenizer_fingerprint,
)
from lightning_gpuopt.data.tokens import RandomWindows, SequentialWindows
from lightning_gpuopt.option_checks import check_choice, check_int, check_number, from_command_line, option
from lightning_gpuopt.perf.device import cuda_device_count
from lightning_gpuopt.perf.parallel import data_parallel_rank, data_parallel_size
from lightning_gpuopt.resume import step_boundary

__all__ = ["TextDataModule", "check_train_batches", "vocab_shortfall"]

# A trained BPE a little short of the size asked for is normal (the last merges are rare); a vocabulary
# under this fraction of it means the corpus cannot fill the embedding the model is built with.
_VOCAB_FILLED = 0.9


def vocab_shortfall(requested: int, trained: int) -> Optional[str]:
    """A warning when a BPE trained for ``requested`` tokens got far fewer (``None`` when it is close): the model,
    built for ``data.vocab_size`` before, has rows no token reads."""
    if trained >= _VOCAB_FILLED * requested:
        return None
    return (
        f"data.vocab_size={requested}, but the corpus filled only {trained} tokens when the tokenizer was trained: the "
        f"model's embedding and output layer get {requested} rows, {requested - trained} of which no token uses. "
        f"Set data.vocab_size {trained} (or use a larger corpus)."
    )


def check_train_batches(windows: int, batch_size: int, replicas: int, block_size: int, description: str) -> None:
    """Raise if the training split cannot fill one batch per data-parallel rank: the loader drops an incomplete
    batch, so ``fit`` would end without a step or a checkpoint."""
    per_rank = windows // replicas
    if per_rank >= batch_size:
        return
    ranks = f" per rank ({replicas} data-parallel ranks)" if replicas > 1 else ""
    raise ValueError(
        f"data.batch_size={batch_size} is larger than the training split of {description}: it holds {per_rank} windows "
        f"of {block_size} tokens{ranks} per epoch, so no full batch and no training step. Set data.batch_size <= "
        f"{per_rank} (or use a larger corpus, a smaller data.block_size, or data.samples_per_epoch)."
    )



class TextDataModule(pl.LightningDataModule):
    """Language-model data from raw text, tokenised once and read from memory-mapped files.

    ``prepare_data`` tokenises the corpus with a byte-level BPE (trained on it, or ``tokenizer``) into a token
    cache keyed by the corpus, the tokenizer and the split, rebuilt with a warning when damaged (``docs/data.md``).
    Training batches are random windows of ``block_size + 1`` tokens in an order that is a pure function of
    ``(seed, epoch, position)``; validation and test cover their split in order. Checkpoints carry the training
    position and the tokenizer (:class:`~lightning_gpuopt.protocols.ResumableData`; it also
    :class:`~lightning_gpuopt.protocols.TakesMicroBatch`).

    Example::

        data = TextDataModule(source="data/wikitext-103-raw", block_size=1024, batch_size=32)
        trainer.fit(GPTModule(preset="124m", vocab_size=data.vocab_size, block_size=1024), datamodule=data)

    Args:
        source: ``"stdlib"`` (offline default), a folder, a file, a glob, or ``"hf:NAME[:CONFIG]"``.
        block_size: Tokens per training sequence.
        batch_size: Micro-batch size per device (``AutoBatchSize`` may change it).
        vocab_size: Size of the BPE vocabulary to train; set from the file when ``tokenizer`` is given.
        tokenizer: Path of a ``tokenizer.json`` to use instead of training one.
        val_fraction: For sources without their own splits, the fraction of tokens held out for validation, and
            again for test (from the end of the token stream).
        samples_per_epoch: Random training windows per epoch; ``None``: ``train_tokens // block_size``.
        cache_dir: Where token files are kept; ``None``: :func:`default_cache_dir`.
        num_workers: DataLoader worker processes.
        pin_memory: Pin host memory for faster copies to the GPU; ``None`` pins when CUDA is available.
        prefetch_factor: Batches each worker loads ahead.
        seed: Seed of the training windows' offsets.
        prompts: Prompts continued by ``predict`` (one batch per prompt).
        samples_per_prompt: Continuations generated per prompt.
        loss_on: ``"all"`` tokens, or only the completions (``"completion"``) of a ``.jsonl`` source of
            ``"prompt"``/``"completion"`` records (each completion's end-of-text included).
    """

    def __init__(
        self,
        source: str = "stdlib",
        block_size: int = 256,
        batch_size: int = 16,
        vocab_size: int = 4096,
        tokenizer: Optional[str] = None,
        val_fraction: float = 0.05,
        samples_per_epoch: Optional[int] = None,
        cache_dir: Optional[str] = None,
        num_workers: int = 2,
        pin_memory: Optional[bool] = None,
        prefetch_factor: int = 4,
        seed: int = 1337,
        prompts: Optional[list[str]] = None,
        samples_per_prompt: int = 4,
        loss_on: Literal["all", "completion"] = "all",
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("prefetch_factor", prefetch_factor, 1),
            ("samples_per_prompt", samples_per_prompt, 1),
        ):
            check_int("TextDataModule", name, value, minimum=low)
        check_number("TextDataModule", "val_fraction", val_fraction, low=0, high=0.5, low_open=True, high_open=True)
        check_int("TextDataModule", "samples_per_epoch", samples_per_epoch, minimum=1, optional=True)
        self.save_hyperparameters()
        self.source = source
        self.block_size = block_size
        self.batch_size = batch_size
        self.tokenizer_path = tokenizer
        self.val_fraction = val_fraction
        self.samples_per_epoch = samples_per_epoch
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.seed = seed
        self.prompts = ["\n"] if prompts is None else list(prompts)
        if not self.prompts or "" in self.prompts:  # predict would sample nothing (and exit 0), or an empty prompt
            example = ("""--data.prompts '["Once upon a time"]'""" if from_command_line()
                       else "TextDataModule(prompts=['Once upon a time'])")
            what = (
                "is empty, so predict would sample nothing" if not self.prompts else "holds an empty prompt (no tokens)"
            )
            raise ValueError(f"{option('TextDataModule', 'prompts')} {what}: give each prompt some text, e.g. "
                             f"{example}, or leave it out to sample from the start of a text.")
        self.samples_per_prompt = samples_per_prompt
        # Fail on a bad tokenizer or source now, not after the Trainer has started.
        self.tokenizer: Optional[Tokenizer] = load_tokenizer(tokenizer) if tokenizer else None
        self._encode_with = self.tokenizer  # what prepare_data tokenises with (None: a BPE trained on the corpus)
        self._checkpoint_note: Optional[str] = None  # said when prepare_data uses a checkpoint's tokenizer
        self.vocab_size = self.tokenizer.get_vocab_size() if self.tokenizer else vocab_size
        if self.tokenizer is None:
            check_int("TextDataModule", "vocab_size", vocab_size, minimum=_MIN_VOCAB,
                      hint=" (256 bytes + <|endoftext|>)")
        self._corpus: Corpus = resolve_source(source)
        check_choice("TextDataModule", "loss_on", loss_on, ("all", "completion"))
        if loss_on == "completion" and not self._corpus.answers:
            raise ValueError(
                f"data.loss_on='completion' needs prompt/completion records, and data.source={source!r} is plain text: "
                'give a .jsonl file of {"prompt": ..., "completion": ...} lines (gpuopt predict --generate.scorer '
                "keeps one), or data.loss_on='all'."
            )
        self.loss_on = loss_on
        self._meta: Optional[dict] = None
        self.datasets: dict[str, torch.utils.data.Dataset] = {}
        self._from_checkpoint = False  # the model (block_size) and tokenizer come from a checkpoint (resume, init_from)
        self._sampler: Optional[ResumableSampler] = None
        self._origin = (0, 0, 0, batch_size)  # (epoch, start, loop batches, batch size) of the current loader
        self._resume_position: Optional[tuple[int, int]] = None
        given = Path(tokenizer).expanduser().read_text() if tokenizer else None
        self.data_dir = token_cache_dir(self.cache_dir, self._corpus, given, vocab_size, val_fraction)  # the cache

    # ------------------------------------------------------------------------------ preparation
    def _expected_meta(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "inputs": self._corpus.fingerprint}

    def _predicting(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.state.fn == "predict"

    def use_checkpoint_tokenizer(self, state_dict: Optional[dict[str, Any]]) -> None:
        """Give the data the tokenizer a checkpoint carries (its ``state_dict`` there), before preparation, so that
        token ids keep their meaning: a corpus changed since the run is tokenised with it (``docs/data.md``).

        Example::

            data.use_checkpoint_tokenizer(torch.load(path, weights_only=True, mmap=True)["TextDataModule"])
            trainer.fit(model, datamodule=data, ckpt_path=path)
        """
        carried = carried_tokenizer(state_dict or {})
        self._from_checkpoint = state_dict is not None
        if carried is None:
            return
        if self.tokenizer_path:
            check_same_tokenizer(state_dict, self.tokenizer, f"data.tokenizer={self.tokenizer_path!r}",
                                 fix="Leave data.tokenizer unset: the checkpoint's own tokenizer is then used")
            return
        self.tokenizer = carried
        meta, _ = check_cache(self.data_dir, self._expected_meta())
        if meta is not None and tokenizer_fingerprint(Tokenizer.from_file(str(self.data_dir / "tokenizer.json"))) \
                == state_dict["tokenizer_sha256"]:
            return  # the BPE trained on this very text is the checkpoint's: its tokens are reused
        self._encode_with = carried
        self.data_dir = token_cache_dir(
            self.cache_dir, self._corpus, state_dict["tokenizer_json"], self.vocab_size, self.val_fraction
        )
        self._checkpoint_note = (
            f"The data uses the checkpoint's tokenizer (sha256 {state_dict['tokenizer_sha256'][:12]}), not a BPE "
            f"trained on {self._corpus.description}: the model's token ids mean its tokens, and the cache holds no BPE "
            "of this text that is the same (the text changed since the checkpoint's run or is another one, or its "
            "token cache was removed)."
        )

    @override
    def prepare_data(self) -> None:
        """Tokenise the corpus into ``data_dir`` unless it holds a complete, current copy (one process prepares under
        a file lock, the others wait); ``predict`` with a known tokenizer prepares nothing."""
        if self.tokenizer is not None and self._predicting():
            return
        if self._checkpoint_note:
            rank_zero_info(self._checkpoint_note)
            self._checkpoint_note = None
        prepare_token_cache(
            self._corpus, self.data_dir, self._expected_meta(), self._encode_with, self.vocab_size, self.val_fraction,
            self.source, info=rank_zero_info, warn=rank_zero_warn,
        )

    @override
    def setup(self, stage: str) -> None:
        """Check the cache folder and open the token files, before any step; ``predict`` with a known tokenizer opens
        none."""
        if stage == "predict" and self._meta is None and self.tokenizer is not None:
            self.vocab_size = self.tokenizer.get_vocab_size()
            return
        if self._meta is None:
            trainer = self.trainer
            if trainer is None or trainer.world_size == 1:
                self.prepare_data()  # a check when already done; covers use without a Trainer
            meta, reason = check_cache(self.data_dir, self._expected_meta())
            if meta is None:  # under a multi-process Trainer, prepare_data ran on local rank 0 only
                rank = trainer.global_rank if trainer is not None else 0
                raise ValueError(
                    f"The token cache {self.data_dir} is not usable on global rank {rank}: {reason}. Only local rank 0 "
                    "of each node prepares it (global rank 0 with prepare_data_per_node=False): keep "
                    "TextDataModule.prepare_data_per_node=True or point data.cache_dir at a folder all nodes share, "
                    "and let the nodes that share it read the same corpus files."
                )
            self._meta = meta
            self.tokenizer = plain_text(Tokenizer.from_file(str(self.data_dir / "tokenizer.json")))
            if self._encode_with is None and self.vocab_size != self._meta["vocab_size"]:  # a BPE trained here
                note = vocab_shortfall(self.vocab_size, self._meta["vocab_size"])
                if note:
                    rank_zero_warn(note)
            self.vocab_size = self._meta["vocab_size"]
        meta, out = self._meta, self.data_dir
        for split, span in meta["splits"].items():
            if split in self.datasets:
                continue
            answers = out / span["answers"] if self.loss_on == "completion" else None
            args = (out / span["file"], meta["dtype"], span["start"], span["end"], self.block_size)
            try:
                if split == "train":
                    self.datasets[split] = RandomWindows(
                        *args, length=self.samples_per_epoch, seed=self.seed, answers=answers
                    )
                else:
                    self.datasets[split] = SequentialWindows(*args, answers=answers)
            except ValueError as err:
                why = str(err)
                if self._from_checkpoint:  # its block_size is the checkpoint's: a smaller one is refused
                    why = why.replace(
                        " or a smaller data.block_size.", f" (block_size={self.block_size} is the checkpoint's)."
                    )
                raise ValueError(f"The {split} split of {self._corpus.description} is too short: "
                                 f"{why}{self._split_hint(split)}") from err
        if stage == "fit":
            check_train_batches(len(self.datasets["train"]), self.batch_size, data_parallel_size(self.trainer),
                                self.block_size, self._corpus.description)

    def _split_hint(self, split: str) -> str:
        """What ``val_fraction`` does for a split too short (nothing for a corpus with splits of its own)."""
        if len(self._corpus.splits) > 1:
            return ""
        if split == "train":
            return (f" (data.val_fraction={self.val_fraction} of the text went to each of validation and test: a "
                    "smaller one leaves training more)")
        return f" (it is data.val_fraction={self.val_fraction} of the text: a larger one gives it more)"

    # ------------------------------------------------------------------------------ dataloaders
    def _loader(self, split: str, train: bool) -> DataLoader:
        workers = self.num_workers
        # pinned pages only speed up copies to a GPU
        pin = cuda_device_count() > 0 if self.pin_memory is None else self.pin_memory
        return DataLoader(
            self.datasets[split],
            batch_size=self.batch_size,
            sampler=self._train_sampler() if train else None,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            drop_last=train,  # equal-sized training batches: steady step times, no recompiles
            # Worker seeds come from this generator, not the global RNG: resumed runs draw the same dropout.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _train_sampler(self) -> ResumableSampler:
        trainer = self.trainer
        if self._resume_position is not None:  # restored from a checkpoint
            (epoch, start), self._resume_position = self._resume_position, None
        else:  # a new loader mid-run (another batch size) continues where the last one stopped
            epoch, start = self.train_position()
        self._sampler = ResumableSampler(
            self.datasets["train"], data_parallel_size(trainer), data_parallel_rank(trainer), epoch, start
        )
        self._origin = (epoch, start, self._loop_batches(), self.batch_size)
        return self._sampler

    def _loop_batches(self) -> int:
        """Training batches of this epoch run up to the last optimizer step, by the Trainer's count."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return 0
        return step_boundary(trainer)

    def train_position(self) -> tuple[int, int]:
        """``(epoch, position)``: the samples all ranks together consumed in ``epoch`` up to the last optimizer step,
        where a new training loader of any batch size starts."""
        if self._sampler is None:
            return self._resume_position or (0, 0)
        epoch, start, batches0, batch_size = self._origin
        if self._sampler.epoch != epoch:  # Lightning moved the sampler to a new epoch
            epoch, start, batches0 = self._sampler.epoch, 0, 0
        done = max(0, self._loop_batches() - batches0)
        return epoch, start + done * batch_size * self._sampler.num_replicas

    def use_micro_batch(self, size: int) -> None:
        """Train in micro-batches of ``size`` from the next training loader on, from the position reached
        (:class:`~lightning_gpuopt.protocols.TakesMicroBatch`: ``AutoBatchSize`` calls it)."""
        check_int("TextDataModule", "micro-batch size", size, minimum=1)
        self.batch_size = size

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training position (saved in checkpoints by Lightning)."""
        epoch, position = self.train_position()
        state = {"train_epoch": epoch, "train_position": position}
        if self.tokenizer is not None:  # the run's tokenizer travels with it (~100 KB of JSON at 4096 tokens)
            state["tokenizer_json"] = self.tokenizer.to_str()
            state["tokenizer_sha256"] = tokenizer_fingerprint(self.tokenizer)
            state["tokenizer_file"] = str((self.data_dir / "tokenizer.json").resolve())
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a checkpoint's training position; refuse a tokenizer other than the checkpoint's."""
        if self.tokenizer is not None:
            fix = None
            if state_dict.get("tokenizer_json"):  # the checkpoint carries it: the data can use it
                fix = ("The checkpoint carries its tokenizer: call data.use_checkpoint_tokenizer(checkpoint"
                       f"[{type(self).__qualname__!r}]) before trainer.fit/predict"
                       + (", with tokenizer unset" if self.tokenizer_path else "")
                       + " (gpuopt --ckpt_path does this)")
            check_same_tokenizer(state_dict, self.tokenizer, f"data.source={self.source!r}", fix)
        if "train_epoch" in state_dict:
            self._resume_position = (int(state_dict["train_epoch"]), int(state_dict["train_position"]))
            self._sampler = None

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        """One batch per prompt: the prompt's tokens repeated ``samples_per_prompt`` times."""
        batches = []
        for prompt in self.prompts:
            ids = self.encode(prompt)
            if not ids:
                raise ValueError("TextDataModule.prompts holds an empty prompt: give each prompt some text.")
            batches.append(torch.tensor([ids] * self.samples_per_prompt, dtype=torch.long))
        return DataLoader(batches, batch_size=None)

    # ------------------------------------------------------------------------------- tokenizer
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            self.setup("predict")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with this data's tokenizer."""
        return self._require_tokenizer().encode(text).ids

    @property
    def eot_id(self) -> int:
        """The id of the end-of-text token (``<|endoftext|>``, or a loaded tokenizer's own, e.g. Llama 3's
        ``<|end_of_text|>``), which ends every document and a generated answer."""
        return end_of_text_id(self._require_tokenizer())

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of token ids (a list or a 1-D tensor)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._require_tokenizer().decode(ids)
