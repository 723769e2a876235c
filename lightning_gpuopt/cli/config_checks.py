"""Checks of a parsed ``gpuopt`` configuration, before the model, data or Trainer is built.

Each raises ``ValueError`` naming the option and the fix (``gpuopt`` prints it and exits with 2), for mistakes
that would otherwise end in a traceback from deep inside Lightning or a file error after the work was done."""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_gpuopt.option_checks import check_int, check_number

__all__ = [
    "check_environment_options",
    "check_callbacks_once",
    "check_config_files",
    "check_monitored_metrics",
    "check_output_file",
    "check_run_folder_writable",
    "check_trainer_options",
    "check_stage_data",
    "check_writable",
]


def check_trainer_options(trainer: Mapping[str, Any]) -> None:
    """Raise for ``trainer`` options (the parsed group) Lightning would accept and then fail on, or silently misuse."""
    check_number("trainer", "gradient_clip_val", trainer.get("gradient_clip_val"), low=0, optional=True,
                 hint=": a negative value turns clipping off without a word. Use e.g. 1.0, or leave it unset")
    check_int("trainer", "accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1,
              hint=" (the batches per optimizer step): use 1 for a step per batch")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool):
        check_int("trainer", "val_check_interval", interval, minimum=1, optional=True,
                  hint=" (validate every N training batches): use e.g. 500, a fraction of the epoch such as 0.25, or "
                       "leave it unset")
    else:
        check_number("trainer", "val_check_interval", interval, low=0, low_open=True, high=1, optional=True,
                     hint=" (a fraction of the epoch; an integer N validates every N batches): use e.g. 0.25, or leave "
                          "it unset")
    for stage in ("train", "val", "test", "predict"):
        name = f"limit_{stage}_batches"
        limit = trainer.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            check_int("trainer", name, limit, minimum=0, optional=True,
                      hint=" (batches per epoch; 0 skips them): use e.g. 20, a fraction of the epoch such as 0.25, or "
                           "leave it unset")
        else:
            check_number("trainer", name, limit, low=0, high=1, optional=True,
                         hint=" (a fraction of the epoch's batches; an integer N runs N batches): use e.g. 0.25, or "
                              "leave it unset")
    root = trainer.get("default_root_dir")
    if root is not None and Path(root).expanduser().exists() and not Path(root).expanduser().is_dir():
        raise ValueError(f"trainer.default_root_dir={str(root)!r} is a file, not a folder: give a folder for the run's "
                         "checkpoints and logs (it is created if missing).")


def check_writable(option: str, path: Union[str, Path], is_file: bool = False, fix: str = "") -> None:
    """Raise, naming ``option`` and ``fix`` (default: another ``--<option>``), unless this process can write ``path``
    (a folder, or with ``is_file`` a file in a writable folder).

    Written for real, not asked of ``os.access``: a probe file (or folder, in the nearest existing parent) is
    created and removed at once, so a read-only mount, ``/sys``, a full quota or another user's folder are caught,
    also for root.

    Example::

        check_writable("trainer.default_root_dir", "/mnt/ro/run")
        # ValueError: trainer.default_root_dir='/mnt/ro/run' cannot be written (Read-only file system at /mnt/ro): ...
    """
    path = Path(path).expanduser()
    fix = fix or f"give a path you can write, --{option} PATH (or {option} in the --config file)"
    if is_file and path.is_dir():
        raise ValueError(f"{option}={str(path)!r} is a folder, not a file: {fix}.")
    if not is_file and path.exists() and not path.is_dir():
        raise ValueError(f"{option}={str(path)!r} is a file, not a folder: {fix}.")
    folder = path.parent if is_file else path
    probe = folder.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if probe == folder.absolute():
            handle, name = tempfile.mkstemp(dir=probe, prefix=".gpuopt-write-test-")
            os.close(handle)
            os.unlink(name)
        else:  # the folder is created later: its nearest existing parent must take a new folder
            os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".gpuopt-write-test-"))
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ValueError(f"{option}={str(path)!r} cannot be written ({why} at {probe}): {fix}.") from None


def check_run_folder_writable(subcommand: Optional[str], trainer: Mapping[str, Any]) -> None:
    """Raise if ``trainer.default_root_dir`` (unset: the working folder) cannot be written by a subcommand that writes
    there (``fit``; ``validate``/``test`` with a logger), before the data is prepared."""
    if subcommand == "fit" or (subcommand in ("validate", "test") and trainer.get("logger") is not False):
        check_writable("trainer.default_root_dir", trainer.get("default_root_dir") or os.getcwd(), fix=(
            "the run's checkpoints and logs go there. Give a folder you can write, --trainer.default_root_dir "
            "runs/NAME (or trainer.default_root_dir in the --config file)"))


def check_callbacks_once(callbacks: Sequence[Callback]) -> None:
    """Raise if two callbacks would save their state under one key (the same callback listed twice), naming the class
    and where the second copy comes from (Lightning refuses it with a traceback)."""
    seen: set[Any] = set()
    for callback in callbacks:
        if not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        if callback.state_key in seen:
            name = type(callback).__name__
            # Callback.state_key is the class name unless the class folds its settings into it (ModelCheckpoint
            # does: two checkpoints that monitor different metrics may coexist).
            why = ("its state is saved under the class name alone, so any two copies share one key"
                   if callback.state_key == type(callback).__qualname__
                   else f"with the same settings, so both would save their state under one key ({callback.state_key})")
            raise ValueError(
                f"trainer.callbacks lists {name} twice: {why}. Keep one: the default stack and most configs "
                f"already hold it, so drop the extra --trainer.callbacks+={name} or the repeated entry in the "
                f"--config file."
            )
        seen.add(callback.state_key)


def check_monitored_metrics(callbacks: Sequence[Callback], logged: Sequence[str], module: str) -> None:
    """Raise if a callback monitors a metric one typo away from one the ``module`` logs (``val_loss`` for
    ``val/loss``), which Lightning finds out only when the callback first reads it; a name close to none is left
    alone (another callback or logger may log it).

    Example::

        check_monitored_metrics([EarlyStopping(monitor="val_loss")], ["val/loss"], "GPTModule")
        # ValueError: EarlyStopping(monitor='val_loss'): GPTModule logs no 'val_loss' ... did you mean 'val/loss'?
    """
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if not isinstance(monitor, str) or monitor in logged:
            continue
        close = difflib.get_close_matches(monitor, logged, n=1, cutoff=0.6)
        if close:
            raise ValueError(
                f"{type(callback).__name__}(monitor={monitor!r}): {module} logs no {monitor!r}, so the run would fail "
                f"when the callback first reads it, after training up to there. Did you mean {close[0]!r}? "
                f"{module} logs {', '.join(logged)}."
            )


def check_output_file(option: str, path: Union[str, Path], overwrite: bool = False, overwrite_option: str = "") -> None:
    """Raise if ``path``, a file the command will write, is an existing folder, an existing file not to overwrite, or
    in a folder this process cannot write (or create), before any work is done.

    Args:
        overwrite_option: The option that sets ``overwrite`` (named in the message); ``""``: existing files are
        replaced.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{option}={str(path)!r} is a folder: give a file path, e.g. "
                         f"{str(path / 'generations.jsonl')!r}.")
    if overwrite_option and not overwrite and path.exists():
        raise ValueError(
            f"{option}={str(path)!r} exists (written by an earlier run, or a file of yours) and would be replaced: "
            f"give another --{option}, or --{overwrite_option} true to replace it."
        )
    check_writable(option, path, is_file=True, fix=f"give a --{option} in a folder you can write")


def check_config_files(argv: Sequence[str]) -> None:
    """Raise, naming the file, line, column and fix (the parser names none: a tab used to indent, most often), if a
    ``--config`` file of ``argv`` is not valid YAML."""
    for path in _config_paths(argv):
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            config = yaml.load(text, Loader=_NoDuplicateKeysLoader)
        except _DuplicateKey as err:
            raise ValueError(f"--config {path} is not valid: {err}") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
            line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
            if "\t" in line:
                fix = "a tab indents the line; YAML indents with spaces only. Replace the tab with spaces."
            else:
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                fix = f"{problem}. Fix the line (check the indentation, a missing ':' or an unclosed quote or bracket)."
            raise ValueError(f"--config {path} is not valid YAML: {where}: {fix}") from None
        for group in ("trainer", "model", "data"):
            if isinstance(config, dict) and isinstance(config.get(group), list):
                raise ValueError(
                    f"--config {path}: {group}: holds a list (its lines start with '- '), so gpuopt would drop every "
                    f"{group} option in it. Give the options as a mapping, without the dashes, e.g. "
                    f"'{group}:\\n  {_EXAMPLE_KEY[group]}'."
                )


_EXAMPLE_KEY = {"trainer": "max_steps: 300", "model": "n_layer: 4", "data": "block_size: 128"}


class _DuplicateKey(yaml.YAMLError):
    pass


class _NoDuplicateKeysLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key written twice in one mapping is an error (YAML keeps the last silently);
    merge keys (``<<: *anchor``) stay overridable, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _DuplicateKey(
                    f"line {key_node.start_mark.line + 1}: {key!r} is given twice in one mapping (also on line "
                    f"{seen[key]}), and YAML would keep the last silently. Keep one."
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _config_paths(argv: Sequence[str]) -> list[Path]:
    paths = []
    for i, arg in enumerate(argv):
        value = None
        if arg in ("--config", "-c") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        if value is not None and Path(value).expanduser().is_file():
            paths.append(Path(value).expanduser())
    return paths


_LOADER = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def check_stage_data(subcommand: str, model: Any, datamodule: Any) -> None:
    """Raise before a subcommand when neither ``datamodule`` (``None``: no ``--data``) nor ``model`` has the loader it
    runs on (``train_dataloader`` for ``fit``, ...), naming the two ways to give the batches."""
    loader = _LOADER.get(subcommand)
    if loader is None or is_overridden(loader, model) or (datamodule is not None and is_overridden(loader, datamodule)):
        return
    name = type(model).__name__
    given = "no data module is given (--data)" if datamodule is None else f"{type(datamodule).__name__} has none"
    raise ValueError(
        f"gpuopt {subcommand} has no data: {name} has no {loader} and {given}. Name a LightningDataModule that has one "
        f"with --data my_pkg.MyData (data: {{class_path: my_pkg.MyData}} in the --config file), or give {name} a "
        f"{loader} method."
    )


def check_environment_options(
    environ: Mapping[str, str], options: Mapping[str, Sequence[str]], prefix: str = "GPUOPT"
) -> None:
    """Raise for an environment variable ``<PREFIX>_<SUBCOMMAND>__<GROUP>__<OPTION>`` that names no option of that
    subcommand (``options``: each subcommand's option names, ``trainer.max_steps``), as the parser does for a flag:
    a mistyped one was ignored without a word."""
    for name in sorted(environ):
        for subcommand, known in options.items():
            head = f"{prefix}_{subcommand.upper()}__"
            if not name.startswith(head):
                continue
            option = name[len(head):].lower().replace("__", ".")
            group, _, rest = option.partition(".")
            if option in known or not option or (group in known and rest.split(".")[0] in ("class_path", "init_args")):
                continue  # an option, or a part of one naming a class (GPUOPT_FIT__MODEL__CLASS_PATH)
            close = difflib.get_close_matches(option, list(known), n=1, cutoff=0.75)
            hint = (f" (did you mean {head}{close[0].upper().replace('.', '__')}, for --{close[0]}?)" if close else "")
            raise ValueError(f"The environment variable {name} names no option of gpuopt {subcommand}{hint}: "
                             f"unset it, or name an option (gpuopt {subcommand} --help lists them).")
