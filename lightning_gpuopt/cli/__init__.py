"""The ``gpuopt`` command: LightningCLI with the package's stack by default."""

from lightning_gpuopt.cli.main import GPTCLI, main, make_cli

__all__ = ["GPTCLI", "main", "make_cli"]
