"""The package's cache folder on this machine: token files (``data/``) and float8 timings (``precision/``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["package_cache_dir"]


def package_cache_dir(what: str, setting: Optional[str] = None) -> Path:
    """``$GPUOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_gpuopt``, else ``~/.cache/lightning_gpuopt``.

    ``what`` (``"the token cache"``) and ``setting`` (an option that sets the folder instead) name the fix in
    the errors.
    """
    instead = f" (or {setting})" if setting else ""
    if "GPUOPT_CACHE_DIR" in os.environ:
        if not os.environ["GPUOPT_CACHE_DIR"].strip():
            raise ValueError(f"GPUOPT_CACHE_DIR is set but empty: set it{instead} to {what} folder.")
        return Path(os.environ["GPUOPT_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "lightning_gpuopt"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as err:  # no HOME and no password-database entry
        first = f"{setting}, or " if setting else ""
        raise ValueError(
            f"No home folder for {what} ({err}): set {first}the GPUOPT_CACHE_DIR environment variable, "
            "to a writable folder."
        ) from err
    return home / ".cache" / "lightning_gpuopt"
