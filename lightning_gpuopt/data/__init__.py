"""Text data: sources, BPE tokenizers, memory-mapped token files and ``TextDataModule``."""

from lightning_gpuopt.data.cache import default_cache_dir
from lightning_gpuopt.data.datamodule import TextDataModule
from lightning_gpuopt.data.sources import Corpus, resolve_source, stdlib_files
from lightning_gpuopt.data.tokenizer import EOT_TOKEN, load_tokenizer, train_bpe_tokenizer
from lightning_gpuopt.data.tokens import RandomWindows, SequentialWindows, token_dtype, write_tokens

__all__ = [
    "EOT_TOKEN",
    "Corpus",
    "RandomWindows",
    "SequentialWindows",
    "TextDataModule",
    "default_cache_dir",
    "load_tokenizer",
    "resolve_source",
    "stdlib_files",
    "token_dtype",
    "train_bpe_tokenizer",
    "write_tokens",
]
