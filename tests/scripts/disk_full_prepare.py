"""Prepares a token cache on a tmpfs too small for it (run under ``unshare -rm``); prints the error and what is left.

Usage: unshare -rm python disk_full_prepare.py MOUNT_POINT TEXT_DIR
"""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from lightning_gpuopt import TextDataModule  # noqa: E402

mount, texts = Path(sys.argv[1]), sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)], check=True)
data = TextDataModule(source=texts, block_size=32, batch_size=4, vocab_size=300, num_workers=0, cache_dir=str(mount))
try:
    data.prepare_data()
except OSError as err:
    print(f"ERROR {type(err).__name__} errno={err.errno}: {err}")
print("LEFT", sorted(p.name for p in mount.rglob("*") if p.is_file() and not p.name.endswith(".lock")))
