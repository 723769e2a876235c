"""The ``gpuopt`` command: LightningCLI over ``GPTModule`` and ``TextDataModule``, or any module and data module."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import signal
import sys
import threading
from typing import Any, NoReturn, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_gpuopt.callbacks import ExactResume, SigtermCheckpoint
from lightning_gpuopt.callbacks.progress_bar import default_progress_bar
from lightning_gpuopt.cli.auto_strategy import (
    add_auto_strategy_arguments,
    auto_strategy,
    check_auto_strategy_options,
    plan_without_missing_data,
)
from lightning_gpuopt.cli.defaults import (
    check_run_length,
    default_stack,
    dropped_stack_note,
    float32_note,
    is_stack_callbacks,
    replace_precision_plugins,
    stack_device_type,
)
from lightning_gpuopt.cli.config_checks import (
    check_callbacks_once,
    check_config_files,
    check_environment_options,
    check_monitored_metrics,
    check_stage_data,
    check_run_folder_writable,
    check_trainer_options,
)
from lightning_gpuopt.cli.errors import check_fit_ended_finite, explain_parser_error, run_reporting_errors
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.cli.doctor import main as doctor_main
from lightning_gpuopt.cli.export import main as export_main
from lightning_gpuopt.model import GPTModule
from lightning_gpuopt.perf.parallel import tensor_parallel_size
from lightning_gpuopt.internals import parse_whole_lists, parser_options, subcommand_parsers
from lightning_gpuopt.option_checks import command_line_options
from lightning_gpuopt.cli.option_places import OPTION_GROUPS
from lightning_gpuopt.checkpoint.io import AtomicCheckpointIO
from lightning_gpuopt.cli.named_classes import named_classes
from lightning_gpuopt.cli.completions import defer_stop
from lightning_gpuopt.cli.generate import (
    add_generate_arguments,
    check_generate_options,
    completions_path,
    generate_from_file,
    generate_options_given,
)
from lightning_gpuopt.generation.batched import fit_to_context
from lightning_gpuopt.cli.resume_checks import (
    checkpoint_file,
    merge_checkpoint_settings,
    merge_init_weights,
    resolve_run_folder,
)
from lightning_gpuopt.cli.quiet import quiet_callback_states, quiet_lightning
from lightning_gpuopt.cli.typehints import int_before_float
from lightning_gpuopt.run.callbacks import merge_callbacks, prepare_resumed_fit
from lightning_gpuopt.run.folder import hold_run_folder
from lightning_gpuopt.run.lock import release_held
from lightning_gpuopt.run.resume_checks import OwnCheckpoint, check_steps_left
from lightning_gpuopt.cli.run_summary import has_predict_data, model_line, where_things_went
from lightning_gpuopt.strategies import AUTO_STRATEGY, end_distributed

__all__ = ["GPTCLI", "main", "make_cli"]

_DESCRIPTION = (
    "gpuopt: train and sample a GPT with Lightning, fast on NVIDIA GPUs. Unless a --config or flag says "
    "otherwise, fit runs GPTModule on TextDataModule with the stack for this machine: BF16Precision on a "
    "GPU (float32 on a CPU), CUDASettings, MFUMonitor, NonFiniteGuard, ExactResume, SigtermCheckpoint and a "
    "ModelCheckpoint keeping checkpoints/last.ckpt (resume with --ckpt_path last). "
    "gpuopt fit --print_config shows it all."
)
_DOCTOR_EPILOG = ("gpuopt doctor: what this package will do on this machine (gpuopt doctor --help). "
                  "gpuopt export CKPT OUT_DIR: a checkpoint as a Hugging Face folder (gpuopt export --help).")
_OWN_CLASSES = (  # said at the top of every subcommand's help, under a one-line usage: some 800 lines of options follow
    "The model is GPTModule (--model.* below) on TextDataModule (--data.*) unless you name a class of your own: "
    "--model my_pkg.MyModule trains any LightningModule, --data my_pkg.MyData reads any LightningDataModule (without "
    "one, the module's own loaders), each with its options after it (--model my_pkg.MyModule --model.n_layer 6); same "
    "stack.")
_SUBCOMMANDS = {name: {"usage": f"gpuopt {name} [--config FILE] [--model CLASS] [--data CLASS] "
                                "[--GROUP.OPTION VALUE ...]",
                       "description": f"gpuopt {name}: {what} {_OWN_CLASSES}"} for name, what in (
    ("fit", "train, with the stack for this machine (gpuopt --help); --ckpt_path last continues the last run."),
    ("validate", "the validation loss of a checkpoint (--ckpt_path)."),
    ("test", "the test loss of a checkpoint (--ckpt_path)."),
    ("predict", "sample from a checkpoint (--ckpt_path): --data.prompts, or --generate.prompts_file to JSONL."))}
_UNKNOWN_OPTION = re.compile(r"(?:Subcommand '[^']+'|Group '([^']+)') does not accept option '([^']+)'")


class _SuggestingParser(LightningArgumentParser):
    """Adds "did you mean ...?" to jsonargparse's unknown-option errors (a typo in YAML or on the command line),
    and tries ``int`` before ``float`` in every union option (:mod:`lightning_gpuopt.cli.typehints`)."""

    def _add_signature_parameter(self, container: Any, nested_key: Any, param: Any, *args: Any, **kwargs: Any) -> Any:
        # Every option taken from a signature (the Trainer's, a module's, a callback's init_args) passes here.
        param = dataclasses.replace(param, annotation=int_before_float(param.annotation))
        return super()._add_signature_parameter(container, nested_key, param, *args, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        message = explain_parser_error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        known = parser_options(parser)
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
        if not self.exit_on_error:  # a nested parser: its caller handles the error
            super().error(message, ex)
        # One short message, not the subcommand's usage (some 90 lines) above it.
        self._logger.error(message)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        sys.stderr.write(f"gpuopt: error: {message}\n({prog} --help lists the options)\n")
        self.exit(2)



class GPTCLI(LightningCLI):
    """LightningCLI with the model's sequence length and vocabulary linked to the data's, and the package's stack.

    The default stack (:mod:`~lightning_gpuopt.cli.defaults`), always ``ExactResume`` and ``SigtermCheckpoint`` (a
    SIGTERM ends ``gpuopt`` with 143) and ``AtomicCheckpointIO`` unless another CheckpointIO is named; the resume
    checks of ``--ckpt_path`` (:mod:`~lightning_gpuopt.cli.resume_checks`); ``trainer.strategy: gpuopt-auto``
    (:mod:`~lightning_gpuopt.cli.auto_strategy`); one writer per run folder. A module or data module of your own
    (:func:`make_cli`) gets the same stack; the data-model links, the architecture checks and the decoding of
    ``predict`` are ``GPTModule`` with ``TextDataModule``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        finished = False
        try:
            super().__init__(*args, **kwargs)
            finished = True
        finally:  # a fit holds its run folder (predict its output files) from parse_arguments to here, however it ended
            release_held(tidy=not finished)  # a refused run leaves no lock file in a folder it made

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        if self.parser_class is LightningArgumentParser:
            self.parser_class = _SuggestingParser
        return super().init_parser(**kwargs)

    @property
    def trains_gpt(self) -> bool:
        """Whether the model is ``GPTModule``, parsed flat (not a module of your own, see :mod:`.named_classes`)."""
        return self.model_class is GPTModule and not self.subclass_mode_model

    @property
    def reads_text(self) -> bool:
        """Whether the data is ``TextDataModule``, parsed flat."""
        return self.datamodule_class is TextDataModule and not self.subclass_mode_data

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.trains_gpt and self.reads_text:
            parser.link_arguments("data.block_size", "model.block_size")
            parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ExactResume, OPTION_GROUPS[ExactResume])  # where option() names them
        parser.add_lightning_class_args(SigtermCheckpoint, OPTION_GROUPS[SigtermCheckpoint])
        self.stack_device_type = stack_device_type()
        parser.set_defaults(default_stack(self.stack_device_type))
        # a list of one's own replaces the stack's whole
        parse_whole_lists(parser, "trainer.callbacks", is_stack_callbacks)
        if not self.reads_text:  # a loader of your own resumes exactly when ExactResume may rebuild it
            parser.set_defaults({"exact_resume.rebuild_loaders": True})
        add_generate_arguments(parser)
        add_auto_strategy_arguments(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # for the commands printed at the end
        self.argv = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:]
        check_config_files(self.argv)  # a YAML syntax error names the file and line, not "<unicode string>"
        running = {name: sub for name, sub in subcommand_parsers(self).items() if self.argv[:1] == [name]}
        check_environment_options(os.environ, {name: parser_options(sub) for name, sub in running.items()})
        if isinstance(args, (list, tuple)):
            # main(args): the list replaces the command line, so whatever sys.argv holds (a test runner's own
            # arguments, a script's) is not a mix-up worth LightningCLI's warning about passing both
            self.config = parser.parse_args(list(args))
        else:
            super().parse_arguments(parser, args)
        self._prepare_run()
        # LightningCLI then merges a checkpoint's hyper-parameters over the configuration, without the checks above
        # and over the options asked; it is shown no ckpt_path until the classes are about to be built.
        subcommand = self.config.get("subcommand")
        self._ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if subcommand:
            self.config[subcommand]["ckpt_path"] = None

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        if subcommand:
            self.config[subcommand]["ckpt_path"] = self._ckpt_path

    def before_fit(self) -> None:
        rank_zero_info(model_line(self.model))

    def after_fit(self) -> None:
        can_predict = (self.trains_gpt and self.reads_text) or has_predict_data(self.model, self.datamodule)
        # GPTModule does not generate split (docs/parallel.md)
        if self.trains_gpt and tensor_parallel_size(self.trainer) > 1:
            can_predict = False
        # Classes of one's own are often importable only through PYTHONPATH (PYTHONPATH=examples gpuopt fit ...):
        # the printed commands carry it, so they run as printed in a fresh shell.
        path = os.environ.get("PYTHONPATH")
        env = {"PYTHONPATH": path} if path and not (self.trains_gpt and self.reads_text) else None
        rank_zero_info("\n".join(where_things_went(self.trainer, self.argv, can_predict, env)))

    def _prepare_run(self) -> None:
        # In place of LightningCLI's merge of the checkpoint's hyper-parameters: `last` and `hpc` become the file they
        # name (run/folder.py), so every checkpoint gets the checks of resume_checks before anything is built. A
        # module of your own is built as configured; its checkpoint is read here and compared once it is built.
        self._check_options(self.config.get("subcommand"))  # before the run folder is held or a file read
        fit = self.config.get("fit") if self.config.get("subcommand") == "fit" else None
        if fit is not None and not (fit.get("auto_strategy") or {}).get("print_plan"):  # one writer per run folder
            hold_run_folder(fit.get("trainer"))  # until make_cli returns
        resolve_run_folder(self.config, self.argv)
        if self.trains_gpt:
            data_class = TextDataModule if self.reads_text else None
            self.config, self.checkpoint_settings = merge_checkpoint_settings(self.parser, self.config, GPTModule,
                                                                              data_class)
            self.config, self.init_settings = merge_init_weights(self.parser, self.config, GPTModule, data_class)
        else:
            path = checkpoint_file(self.config)
            self.checkpoint_settings = OwnCheckpoint.read(path, self.config["subcommand"]) if path else None

    def after_instantiate_classes(self) -> None:
        if self.subcommand == "predict" and self.trains_gpt:  # before any work: new tokens the context cannot hold
            fit_to_context(1, self.model.hparams.max_new_tokens, self.model.config.block_size)
        # else that file
        if self.subcommand and not self.config[self.subcommand].get("generate", {}).get("prompts_file"):
            check_stage_data(self.subcommand, self.model, self.datamodule)
        settings = getattr(self, "checkpoint_settings", None)
        if isinstance(settings, OwnCheckpoint):  # the run layer's checks, as prepare_run makes them
            settings.check(self.model, self.config[self.subcommand].get("trainer"))
        elif settings is not None:
            settings.check_model(self.model)
            if self.subcommand == "fit":  # after the architecture checks: the first thing to fix
                check_steps_left(settings.global_step, settings.path, self.config.fit.get("trainer"),
                                 settings.epochs_done)
            settings.report()
            if self.reads_text:  # before data preparation: the run's token ids keep their meaning
                self.datamodule.use_checkpoint_tokenizer(settings.data_state)
        init = getattr(self, "init_settings", None)
        if init is not None:  # weights alone: the architecture checked like a resume's, the run's tokenizer taken
            init.check_model(self.model)
            taken = "".join(f", model.{k}={old!r} (configured {new!r})" for k, (old, new) in init.kept.items())
            rank_zero_info(f"model.init_from: the GPT starts from the weights of {init.path} (step {init.global_step} "
                           "of its run); the optimizer and the learning-rate schedule start fresh"
                           + (f"; from the checkpoint's architecture: {taken[2:]}." if taken else "."))
            if self.reads_text:
                self.datamodule.use_checkpoint_tokenizer(init.data_state)
        if self.subcommand == "fit" and self.config.fit.get("ckpt_path"):
            prepare_resumed_fit(self.trainer)

    def _check_options(self, subcommand: Optional[str]) -> None:
        """Every check of the parsed options that needs nothing built: before a fit holds its run folder, reads a
        checkpoint or prepares data, so a refused command leaves nothing behind."""
        config = self.config[subcommand] if subcommand else self.config
        check_trainer_options(config.get("trainer") or {})
        check_run_folder_writable(subcommand, config.get("trainer") or {})
        _drop_checkpoint_callbacks_if_disabled(config)
        if subcommand == "fit":
            problem = check_run_length(config.get("trainer", {}))
            if problem:
                self.parser.error(problem)
        generate = config.get("generate", {})
        check_auto_strategy_options(config, self.parser.error, subcommand)
        if subcommand == "fit" and self.reads_text:
            plan_without_missing_data(config)  # --auto_strategy.print_plan reads no text
        if subcommand == "predict":
            self.save_config_callback = None  # predict writes its samples, not a log folder with the config
        if subcommand != "predict" and generate.get("prompts_file"):
            self.parser.error(f"generate.prompts_file is read by `gpuopt predict` only, not `gpuopt {subcommand}`.")
        if not generate.get("prompts_file") and subcommand is not None:
            given = generate_options_given(generate)
            if given:
                self.parser.error(
                    f"{', '.join(f'generate.{name}' for name in given)} {'is' if len(given) == 1 else 'are'} read with "
                    "--generate.prompts_file only (`gpuopt predict --generate.prompts_file FILE`): add it, or leave "
                    + ("it out" if len(given) == 1 else "them out")
                    + (" (--data.prompts samples are printed)." if subcommand == "predict" else ".")
                )
        if generate.get("prompts_file") and not (self.trains_gpt and self.reads_text):
            self.parser.error("generate.prompts_file needs GPTModule and TextDataModule (it encodes the prompts with "
                              "the data's tokenizer); for a module of your own, give the prompts as its predict data.")
        if generate.get("prompts_file"):
            self._scorer = check_generate_options(config, generate, self.parser.error)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_cfg = config.get("trainer", {})
        if trainer_cfg.get("strategy") == AUTO_STRATEGY and "strategy" not in kwargs:
            kwargs["strategy"] = self._auto_strategy(config, trainer_cfg)
        if "plugins" not in kwargs:
            kwargs["plugins"] = replace_precision_plugins(trainer_cfg.get("precision"), trainer_cfg.get("plugins"))
        if self.subcommand == "predict" and trainer_cfg.get("logger") in (None, True):
            kwargs["logger"] = False  # predict logs nothing: no empty lightning_logs/version_N
        callbacks = trainer_cfg.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if self.subcommand in (None, "fit"):  # None: run=False, a Trainer built for the caller's fit
            dropped = dropped_stack_note(callbacks, trainer_cfg.get("enable_checkpointing"))
            if dropped is not None:
                rank_zero_info(dropped)
        if (trainer_cfg.get("enable_progress_bar") is not False
                and not any(isinstance(c, ProgressBar) for c in callbacks)):
            # Lightning's bar, counting a resumed epoch right
            trainer_cfg["callbacks"] = [*callbacks, default_progress_bar()]
        note = float32_note(trainer_cfg.get("precision"), kwargs["plugins"], self.stack_device_type)
        if note is not None:
            rank_zero_info(note)
        # ExactResume and SigtermCheckpoint are always added (a copy the config lists itself, with its own
        # arguments, comes first and stays); any other callback listed twice is refused here, not by a traceback.
        listed = trainer_cfg.get("callbacks")
        listed = listed if isinstance(listed, list) else [listed] if listed else []
        check_callbacks_once([c for c in listed if type(c) not in (ExactResume, SigtermCheckpoint)])
        if self.trains_gpt:
            check_monitored_metrics(listed, GPTModule.LOGGED_METRICS, "GPTModule")
        trainer = super().instantiate_trainer(**kwargs)
        merge_callbacks(trainer)  # the stack's ExactResume and SigtermCheckpoint once; checkpoint folders filled in
        if self.subcommand in ("validate", "test", "predict"):  # they save nothing: a ModelCheckpoint restored from the
            for callback in [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]:  # file would only warn
                trainer.callbacks.remove(callback)  # that its folder moved
        if self.subcommand == "predict":
            trainer.callbacks.append(_StopPredictOnSigterm())
        strategy = trainer.strategy
        # Replace only Lightning's default single-file writer; a CheckpointIO the user or the strategy chose stays.
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def _auto_strategy(self, config: Any, trainer_cfg: dict) -> Any:
        strategy, plan = auto_strategy(self.model, self.datamodule, config, trainer_cfg)
        if (config.get("auto_strategy") or {}).get("print_plan"):  # before the Trainer: its devices need not be here
            print(f"trainer.strategy={AUTO_STRATEGY}: {plan}")  # the command's output
            sys.exit(0)
        rank_zero_info(f"trainer.strategy={AUTO_STRATEGY}: {plan}")
        return strategy

    def before_predict(self) -> None:
        if self.config.predict.get("ckpt_path") is None and not self.config.predict.model.get("init_from"):
            rank_zero_warn(
                "gpuopt predict: no --ckpt_path given, so this samples an untrained (randomly initialised) model. "
                "Pass --ckpt_path PATH/last.ckpt of a fit to sample the trained one."
            )

    def predict(self, model: Any, datamodule: Any = None, **kwargs: Any) -> Any:
        """``trainer.predict`` on the data's prompts, or on ``generate.prompts_file`` with continuous batching."""
        options = self.config.predict.get("generate", {})
        self._generated = False
        with quiet_callback_states():
            if not options.get("prompts_file"):
                return self.trainer.predict(model, datamodule=datamodule, **kwargs)
            self._generated = True
            generate_from_file(self.trainer, model, datamodule, options, completions_path(self.config.predict),
                               getattr(self, "_scorer", None), **kwargs)

    def validate(self, model: Any, datamodule: Any = None, **kwargs: Any) -> Any:
        """``trainer.validate``, without Lightning's advice to add the fit's callbacks (nothing restores them here)."""
        with quiet_callback_states():
            return self.trainer.validate(model, datamodule=datamodule, **kwargs)

    def test(self, model: Any, datamodule: Any = None, **kwargs: Any) -> Any:
        """``trainer.test``, without Lightning's advice to add the fit's callbacks (nothing restores them here)."""
        with quiet_callback_states():
            return self.trainer.test(model, datamodule=datamodule, **kwargs)

    def after_predict(self) -> None:
        if self._generated:
            return  # written as they finished, and summed up
        predictions = self.trainer.predict_loop.predictions or []
        if not (self.trains_gpt and self.reads_text):
            rank_zero_info(f"gpuopt predict: {len(predictions)} batches of predictions from "
                           f"{type(self.model).__name__}.predict_step (trainer.predict_loop.predictions).")
            return
        for batch in predictions:
            for sample in batch:
                print(self.datamodule.decode(sample), end="\n" + "-" * 80 + "\n")


class _StopPredictOnSigterm(Callback):
    """Ends ``predict`` at once on SIGTERM, mid-generation (Lightning's predict loop never reads its flag); the
    completions written as they finished are kept."""

    def __init__(self) -> None:
        self._previous: Any = None

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: Any) -> None:
        if threading.current_thread() is threading.main_thread():  # after Lightning registered its own handler
            self._previous = signal.signal(signal.SIGTERM, self._stop)

    @override
    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _stop(self, signum: int, frame: Any) -> None:
        code = 128 + signal.SIGTERM  # the exit status of a SIGTERM, as after a fit's save
        if defer_stop(code):  # a prompts file: after the completions that finished in this step are written
            rank_zero_info("gpuopt predict: received SIGTERM; stopping once the completions finished in this step are "
                           "written.")
            return
        rank_zero_info("gpuopt predict: received SIGTERM; stopping.")
        raise SystemExit(code)


def _drop_checkpoint_callbacks_if_disabled(config: Any) -> None:
    """``trainer.enable_checkpointing: false`` leaves out the stack's (or a recipe's) ``ModelCheckpoint``, which
    Lightning would refuse beside it; said in one line."""
    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks") or []
    if trainer.get("enable_checkpointing") is not False or not isinstance(callbacks, list):
        return
    kept = [c for c in callbacks if not str(getattr(c, "class_path", "")).endswith(".ModelCheckpoint")]
    if len(kept) < len(callbacks):
        trainer["callbacks"] = kept
        rank_zero_info("trainer.enable_checkpointing=false: the ModelCheckpoint callback is left out; no checkpoint is "
                       "written.")


def make_cli(args: Optional[list[str]] = None, **kwargs: Any) -> GPTCLI:
    """The ``gpuopt`` CLI for ``args`` (without the program name; ``None``: ``sys.argv``), run unless ``run=False``:
    over ``GPTModule`` and ``TextDataModule``, or the classes of your own the arguments name (a module of your own
    without a ``data`` class trains on its own loaders).

    Example::

        cli = make_cli(["fit", "--model", "my_pkg.NanoGPT", "--data", "my_pkg.Shakespeare",
                        "--trainer.max_steps", "100"])
    """
    named = named_classes(sys.argv[1:] if args is None else args, os.environ)
    options = dict(
        seed_everything_default=1337,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True, "env_prefix": "GPUOPT", "prog": "gpuopt", "epilog": _DOCTOR_EPILOG,
                       "description": _DESCRIPTION, **_SUBCOMMANDS},
        args=args,  # None: LightningCLI reads sys.argv itself (and does not warn about `args`)
    )
    return GPTCLI(
        None if named.model else GPTModule,  # None: any LightningModule, given by its class path
        None if named.model or named.data else TextDataModule,  # None: any data module, or the module's own loaders
        **{**options, **kwargs},
    )


def main(args: Optional[list[str]] = None) -> None:
    """Run the ``gpuopt`` CLI (``gpuopt doctor`` and ``gpuopt export`` before LightningCLI parses anything). Every
    option can also come from
    ``GPUOPT_<SUBCOMMAND>__<GROUP>__<OPTION>``, under a ``--config`` file or a flag; messages name fixes as this
    command's options (:func:`~lightning_gpuopt.option_checks.option`)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["doctor"]:
        with command_line_options():
            sys.exit(doctor_main(argv[1:]))
    if argv[:1] == ["export"]:
        with command_line_options():
            sys.exit(export_main(argv[1:]))

    def run() -> None:
        with quiet_lightning():
            cli = make_cli(args)
        if cli.subcommand == "fit":
            check_fit_ended_finite(cli.trainer, cli.model)  # a diverged run does not exit 0

    try:
        with command_line_options():
            # a configuration or data error: one message, exit 2 (GPUOPT_TRACEBACK=1: traceback)
            run_reporting_errors(run)
    except SIGTERMException:  # a SystemExit, not an Exception: run_reporting_errors lets it through
        end_distributed()
        sys.exit(128 + signal.SIGTERM)
    end_distributed()  # Lightning does this at exit for NCCL only; gloo groups can abort at shutdown


if __name__ == "__main__":
    main()
