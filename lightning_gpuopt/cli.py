"""The ``gpuopt`` command: LightningCLI over ``GPTModule`` and ``TextDataModule``.

Example::

    gpuopt fit --config examples/configs/quickstart.yaml
    gpuopt fit --model.preset 124m --data.source data/wikitext-103-raw --trainer.max_steps 3000
    GPUOPT_FIT__TRAINER__MAX_STEPS=100 gpuopt fit   # a --config file or a flag takes precedence over the environment
    gpuopt predict --config examples/configs/quickstart.yaml --ckpt_path last.ckpt
"""

from __future__ import annotations

import difflib
import re
from typing import Any, NoReturn, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt.callbacks import ExactResume
from lightning_gpuopt.cli_errors import check_fit_ended_finite, explain_parser_error, run_reporting_errors
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.option_checks import check_trainer_options
from lightning_gpuopt.plugins.checkpoint_io import AtomicCheckpointIO
from lightning_gpuopt.resume_settings import merge_checkpoint_settings, prepare_resumed_fit
from lightning_gpuopt.strategies import AUTO_STRATEGY, choose_strategy, end_distributed

__all__ = ["GPTCLI", "main"]

_UNKNOWN_OPTION = re.compile(r"(?:Subcommand '[^']+'|Group '([^']+)') does not accept option '([^']+)'")


class _SuggestingParser(LightningArgumentParser):
    """Adds "did you mean ...?" to jsonargparse's unknown-option errors (a typo in YAML or on the command line)."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        message = explain_parser_error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        known = [a.dest for a in parser._actions if a.dest and a.dest != "help"]
        match = _UNKNOWN_OPTION.search(message)
        if match:
            key = f"{match.group(1)}.{match.group(2)}" if match.group(1) else match.group(2)
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            if close:
                message += f": did you mean '{close[0]}' (--{close[0]} on the command line)?"
        elif message.lower().startswith("unrecognized arguments:"):
            for arg in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(arg.lstrip("-").split("=")[0], known, n=1, cutoff=0.75)
                if arg.startswith("--") and close:
                    message += f"; for {arg.split('=')[0]} did you mean --{close[0]}?"
        super().error(message, ex)



class GPTCLI(LightningCLI):
    """LightningCLI with the model's sequence length and vocabulary linked to the data's.

    ``data.block_size`` sets ``model.block_size``, and the data's tokenizer vocabulary size sets
    ``model.vocab_size``, so the two can never disagree. After ``predict`` the generated samples
    are decoded and printed. Checkpoints are written with
    :class:`~lightning_gpuopt.plugins.AtomicCheckpointIO` (atomic writes, ``weights_only=True``
    reads) unless the config names another CheckpointIO plugin or the strategy brings its own.

    With ``--ckpt_path``, the checkpoint's hyper-parameters are merged with what the command line
    and config ask for by :mod:`lightning_gpuopt.resume_settings` (architecture changes refused,
    other settings applied and reported). ``ExactResume`` is always added (a resumed ``fit
    --ckpt_path`` continues exactly). With
    ``trainer.strategy: gpuopt-auto`` the strategy is chosen for the model by
    :func:`~lightning_gpuopt.strategies.choose_strategy` (DDP or FSDP2), and the reason is logged;
    ``--auto_strategy.device_memory_gb`` overrides the memory read from GPU 0.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        if self.parser_class is LightningArgumentParser:
            self.parser_class = _SuggestingParser
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ExactResume, "exact_resume")
        parser.add_argument(
            "--auto_strategy.device_memory_gb", type=Optional[float], default=None,
            help="Memory per device (GB) for trainer.strategy=gpuopt-auto; default: read from GPU 0.",
        )

    def _parse_ckpt_path(self) -> None:
        # Replaces LightningCLI's merge of the checkpoint's hyper-parameters: see resume_settings.
        self.config, self.checkpoint_settings = merge_checkpoint_settings(self.parser, self.config, GPTModule)

    def before_instantiate_classes(self) -> None:
        check_trainer_options((self.config[self.subcommand] if self.subcommand else self.config).get("trainer") or {})

    def after_instantiate_classes(self) -> None:
        if getattr(self, "checkpoint_settings", None) is not None:
            self.checkpoint_settings.check_model(self.model)
            self.checkpoint_settings.report()
        if self.subcommand == "fit" and self.config.fit.get("ckpt_path"):
            prepare_resumed_fit(self.trainer)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_cfg = config.get("trainer", {})
        if trainer_cfg.get("strategy") == AUTO_STRATEGY and "strategy" not in kwargs:
            kwargs["strategy"] = self._auto_strategy(config, trainer_cfg)
        trainer = super().instantiate_trainer(**kwargs)
        strategy = trainer.strategy
        # Replace only Lightning's default single-file writer; a CheckpointIO the user or the strategy chose stays.
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def _auto_strategy(self, config: Any, trainer_cfg: dict) -> Any:
        devices = trainer_cfg.get("devices", "auto")
        if devices in ("auto", -1, "-1"):
            import torch

            devices = max(1, torch.cuda.device_count())
        elif isinstance(devices, str):
            devices = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
        elif isinstance(devices, (list, tuple)):
            devices = len(devices)
        devices *= int(trainer_cfg.get("num_nodes", 1) or 1)
        memory_gb = config.get("auto_strategy", {}).get("device_memory_gb")
        strategy, reason = choose_strategy(
            self.model,
            devices=devices,
            device_memory=None if memory_gb is None else memory_gb * 1e9,
            precision=str(trainer_cfg.get("precision") or "32-true"),
            micro_batch=self.datamodule.batch_size,
            block_size=self.datamodule.block_size,
        )
        rank_zero_info(f"trainer.strategy={AUTO_STRATEGY}: {reason}")
        return strategy

    def after_predict(self) -> None:
        predictions = self.trainer.predict_loop.predictions or []
        for batch in predictions:
            for sample in batch:
                print(self.datamodule.decode(sample), end="\n" + "-" * 80 + "\n")


def main(args: Optional[list[str]] = None) -> None:
    """Run the ``gpuopt`` CLI. Every option can also come from an environment variable,
    ``GPUOPT_<SUBCOMMAND>__<GROUP>__<OPTION>`` (e.g. ``GPUOPT_FIT__TRAINER__MAX_STEPS=100``); a value in a
    ``--config`` file or a command-line flag takes precedence over it."""
    def run() -> None:
        cli = GPTCLI(
            GPTModule,
            TextDataModule,
            seed_everything_default=1337,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"default_env": True, "env_prefix": "GPUOPT", "prog": "gpuopt"},
            args=args,  # None: sys.argv[1:]
        )
        if cli.subcommand == "fit":
            check_fit_ended_finite(cli.trainer, cli.model)  # a diverged run does not exit 0

    run_reporting_errors(run)  # a configuration or data error: one message, exit 2 (GPUOPT_TRACEBACK=1: traceback)
    end_distributed()  # Lightning does this at exit for NCCL only; gloo groups can abort at shutdown


if __name__ == "__main__":
    main()
