"""How the ``gpuopt`` command ends on an error: one clear message and an exit status, the traceback on request.

A configuration or data error (``ValueError``, an ``ImportError`` naming an extra, a Lightning error
:func:`explain_lightning_error` knows) exits with 2; a diverged run or a full disk with 1; ``GPUOPT_TRACEBACK=1``
re-raises. ``docs/reliability.md`` ("How gpuopt ends on an error")."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable, Optional, TypeVar

from lightning_gpuopt.callbacks.nonfinite_checks import learning_rate_option
from lightning_gpuopt.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard
from lightning_gpuopt.option_checks import option
from lightning_gpuopt.checkpoint.safety import NonFiniteCheckpointError, is_disk_full, nonfinite_weights

__all__ = [
    "TRACEBACK_ENV",
    "check_fit_ended_finite",
    "explain_instantiation_error",
    "explain_lightning_error",
    "explain_parser_error",
    "run_reporting_errors",
]

TRACEBACK_ENV = "GPUOPT_TRACEBACK"
_INVALID_SUBCOMMAND = re.compile(r"argument subcommand: invalid choice: '([^']*)' \(choose from (.*)\)")
_LINK = re.compile(r"argument (\S+) --> (\S+): ")
_NESTED = re.compile(r'Parser key "([^"]+)":.*?Problem with given class_path \'([^\']+)\':\s*Parser key '
                     r'"([^"]+)":\s*([^\n]+)', re.S)
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.+)\]\. Got value: (.+)")
_NOT_FINITE = re.compile(r'Parser key "([^"]+)":\s*Expected a <class \'float\'>\. Got value: '
                         r'([-+]?(?:inf|infinity|nan))\s*$', re.I)
_NOT_FINITE_UNION = re.compile(  # an Optional[Union[float, int]] option such as trainer.gradient_clip_val
    r'Parser key "([^"]+)":\s*Does not validate against any of the Union subtypes\s*Subtypes: \[[^\n]*<class \'float\'>'
    r".*?Given value: ([-+]?(?:inf|infinity|nan))\s*$", re.I | re.S
)
_UNION = "Does not validate against any of the Union subtypes"
_LIST_OF = {
    "callbacks.callback.Callback": "trainer.callbacks",
    "Precision": "trainer.plugins",
    "CheckpointIO": "trainer.plugins",
}
_OWNER_OPTION = re.compile(r"^([A-Z]\w*)\.(\w+) must ")
_LIMIT_UNDER_ONE = re.compile(r"You requested to check ([\d.e-]+) of the `(\w+)_dataloader` but [\d.e-]+ \* (\d+) < 1")
_NO_SHORT_NAME = re.compile(r'Parser key "(trainer\.(?:callbacks|plugins))":.*?Expected a dot import path string: '
                            r'(\S+)', re.S)
_LIST_AS_TEXT = re.compile(
    r'Parser key "([^"]+)":\s*Does not validate against any of the Union subtypes\s*Subtypes: \[list\[[^\n]*'
    r"\n.*?Given value type: <class 'str'>\s*Given value: ([^\n]*)", re.S
)
# list[str]
_LIST_AS_TEXT_PLAIN = re.compile(r'Parser key "([^"]+)":\s*Expected a <class \'(?:list|tuple)\'>\. Got value: ([^\n]*)')
_OPTION_BEFORE_CLASS = re.compile(
    r'Parser key "(model|data)":.*?Problem with given class_path \'lightning\.(?:pytorch\.)?Lightning(?:Data)?Module\':'
    r"\s*Option '([^']+)' is not accepted", re.S
)
_UNKNOWN_INIT_ARG = re.compile(
    r'Parser key "(model|data)":.*?Problem with given class_path \'([^\']+)\':\s*Option \'([^\']+)\' is not '
    r'accepted', re.S
)
_UNKNOWN_LIST_INIT_ARG = re.compile(  # an option a class in trainer.callbacks / trainer.plugins does not take
    r'Parser key "(trainer\.(?:callbacks|plugins))":.*?Problem with given class_path \'([^\']+)\':\s*Option '
    r'\'([^\']+)\' is not accepted',
    re.S,
)
_NO_MODULE = re.compile(
    r'Parser key "([^"]+)":.*?Problem with given class_path \'([^\']+)\':\s*No module named \'([^\']+)\'', re.S
)
_CLASS_PROBLEM = re.compile(r'Parser key "([^"]+)":.*?Problem with given class_path \'([^\']+)\':\s*([^\n]+)', re.S)
_NO_CLASS = re.compile(r'Parser key "([^"]+)":.*?Problem with given class_path \'([^\']+)\':\s*module \'([^\']+)\' has '
                       r'no attribute \'([^\']+)\'', re.S)
T = TypeVar("T")


def _unknown_subcommand(given: str, choices: str) -> str:
    listed = [*re.findall(r"'([^']+)'", choices), "doctor"]  # doctor runs before the parser, which does not list it
    close = difflib.get_close_matches(given, listed, n=1)
    return (f"'{given}' is not a gpuopt command" + (f" (did you mean '{close[0]}'?)" if close else "")
            + f": choose from {', '.join(listed)}.")


def explain_parser_error(message: str) -> str:
    """A clear message with the fix for some of jsonargparse's (an empty config, a linked option given, ``inf``/``nan``
    for a float, text for a list, an unknown class or option, ours given flat before a class of one's own, a bad
    argument of a class in a list); others unchanged."""
    subcommand = _INVALID_SUBCOMMAND.search(message)
    if subcommand:
        return _unknown_subcommand(*subcommand.groups())
    link = _LINK.search(message)
    if link:
        source, target = link.groups()
        return (f"{target} is set from {source} (gpuopt links them, so the two always agree): drop {target} and "
                f"set {source} only (--{source} on the command line, or {source} in the --config file).")
    not_finite = _NOT_FINITE.search(message) or _NOT_FINITE_UNION.search(message)
    if not_finite:
        key, value = not_finite.groups()
        return (
            f"{key} must be a finite number, got {value}: give a finite value for --{key} "
            f"(or {key} in the --config file)."
        )
    list_as_text = _LIST_AS_TEXT.search(message) or _LIST_AS_TEXT_PLAIN.search(message)
    if list_as_text:
        key, value = list_as_text.groups()
        return (f"{key} takes a list, got the text {value.strip()!r}: write it in brackets, --{key} "
                f"'[{value.strip()}]' "
                f"(items separated by commas), or as a YAML list under {key} in the --config file.")
    option_before_class = _OPTION_BEFORE_CLASS.search(message)
    if option_before_class:
        group, key = option_before_class.groups()
        ours = {"model": "GPTModule", "data": "TextDataModule"}[group]
        return (f"{group}.{key} is an option of gpuopt's {ours}, given flat before any {group} class, but the command "
                f"names a {group} class of its own (--{group} / {group}.class_path): give that class's options under "
                f"init_args, after its class path ('{group}: {{class_path: ..., init_args: {{{key}: ...}}}}' in the "
                f"--config file, --{group}.init_args.{key} after --{group} on the command line), or drop the class "
                f"path to train {ours}.")
    class_path = _explain_class_path(message)
    if class_path is not None:
        return class_path
    nested = _NESTED.search(message)
    if nested:
        group, class_path, key, detail = nested.groups()
        literal = _LITERAL.match(detail.strip())
        if literal:
            detail = f"must be one of {literal.group(1)}, got {literal.group(2)!r}"
        return (f"{group}: {class_path.rsplit('.', 1)[-1]}({key}=...) {detail.strip()}. "
                f"Fix init_args.{key} of {class_path} in the --config file (or on the command line).")
    class_problem = _CLASS_PROBLEM.search(message)
    if class_problem:  # any other class the parser could not use: its cause in one line, not the Union's page
        group, class_path, detail = class_problem.groups()
        return (f"{group}: {class_path} cannot be used: {detail.strip().rstrip('.')}. Fix its class path or init_args "
                "in the --config file (or on the command line).")
    prefix = "Unexpected config:"
    if not message.startswith(prefix):
        return message
    text = message[len(prefix):].strip()
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        return (
            "The --config file is empty (or holds only comments): give it the groups to set, e.g. "
            "'trainer: {max_steps: 100}', or leave --config out to use the defaults."
        )
    return (
        f"The --config file must be a YAML mapping of groups (trainer:, model:, data:, ...), got: {text[:200]!r}. "
        "See examples/configs/quickstart.yaml."
    )


def _explain_class_path(message: str) -> Optional[str]:
    """The one line for a class path the parser could not use (an option it does not take, a module that cannot be
    imported, a class its module lacks, a short name of no class), else ``None``."""
    unknown_init_arg = _UNKNOWN_INIT_ARG.search(message)
    if unknown_init_arg:
        return _unknown_init_arg(*unknown_init_arg.groups())
    unknown_list_arg = _UNKNOWN_LIST_INIT_ARG.search(message)
    if unknown_list_arg:
        return _unknown_list_init_arg(*unknown_list_arg.groups(), flag="NestedArg(" in message)
    no_module = _NO_MODULE.search(message)
    if no_module:
        return _unimportable_class(*no_module.groups())
    no_class = _NO_CLASS.search(message)
    if no_class:
        return _unknown_class(*no_class.groups())
    no_short_name = _NO_SHORT_NAME.search(message)
    if no_short_name:
        return _unknown_short_name(*no_short_name.groups())
    return None


def explain_instantiation_error(err: BaseException) -> Optional[str]:
    """One line (out of the parser's page of "Does not validate against any of the Union subtypes") for a class in
    ``trainer.callbacks`` or ``trainer.plugins`` whose constructor refused an argument, naming where to fix it; else
    ``None``.

    Example::

        explain_instantiation_error(err)
        # "trainer.callbacks: MFUMonitor.log_every_n_steps must be an integer >= 1 or None, got 0. Fix
        #  init_args.log_every_n_steps of MFUMonitor in trainer.callbacks (the --config file, or
        #  --trainer.callbacks.log_every_n_steps right after --trainer.callbacks+=MFUMonitor)."
    """
    cause = err.__cause__
    if not isinstance(err, ValueError) or not str(err).startswith(_UNION) or cause is None:
        return None
    subtypes = str(err).split("\n", 2)[1] if "\n" in str(err) else ""
    where = next((group for name, group in _LIST_OF.items() if name in subtypes), "trainer.callbacks")
    detail = str(cause).strip().rstrip(".")
    owned = _OWNER_OPTION.match(detail)
    if owned is None:
        return f"{where}: {detail}. Fix the init_args of that class in {where} (the --config file or the command line)."
    owner, name = owned.groups()
    flag = f"--{where}.{name} right after --{where}+={owner}"
    return f"{where}: {detail}. Fix {option(owner, name)} (the --config file, or {flag})."


def _unknown_init_arg(group: str, class_path: str, key: str) -> str:
    """An option a class of one's own does not take: the closest of its ``__init__`` arguments."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except Exception:  # the parser imported it a moment ago; say what is known
        names: list[str] = []
    else:
        names = _init_args(cls)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r} (--{group}.{close[0]})?" if close
            else f"it takes {', '.join(names)}." if names else "see its __init__ for the options it takes.")
    return f"{group}.{key}: {class_path} takes no option {key!r}: {hint}"


def _unknown_list_init_arg(group: str, class_path: str, key: str, flag: bool) -> str:
    """An option a class in ``trainer.callbacks`` or ``trainer.plugins`` does not take: the closest it takes, and where
    a flag puts an option (on the list's last class)."""
    module_name, _, name = class_path.rpartition(".")
    try:
        init = inspect.signature(getattr(importlib.import_module(module_name), name).__init__).parameters.values()
        names = [p.name for p in init if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except Exception:  # the parser imported it a moment ago; say what is known
        names = None
    close = difflib.get_close_matches(key, names or [], n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(names)}." if names
            else "it takes no options." if names == [] else "see its __init__.")
    where = (f"a --{group}.{key} flag sets an option of the last class in {group}, here {name}: give it right after "
             f"the --{group}+=CLASS it belongs to" if flag
             else f"fix init_args of {name} in {group} in the --config file")
    return f"{group}: {name} takes no option {key!r}: {hint} ({where}.)"


def _init_args(cls: type) -> list[str]:
    """The named ``__init__`` arguments of ``cls``, with its parents' while an ``__init__`` passes ``**kwargs`` on."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass.__module__.split(".")[0] in ("lightning", "torch", "builtins"):
            break
        params = list(inspect.signature(init).parameters.values())
        names += [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def _unimportable_class(group: str, class_path: str, missing: str) -> str:
    """A class path whose module cannot be imported: one line with the cause, and the PYTHONPATH that finds a module of
    one's own (``PYTHONPATH=. gpuopt fit ...`` from the folder that holds it)."""
    top = missing.split(".")[0]
    return (f"{group}: cannot import {class_path} (no module named {missing!r}). If {top} is your own code, run from "
            "the folder that holds it with PYTHONPATH=. (e.g. PYTHONPATH=. gpuopt fit ...), or install it; else fix "
            "the class path.")


def _unknown_class(group: str, class_path: str, module_name: str, name: str) -> str:
    """A class path whose module exists but holds no such class: the closest names the module has."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # the parser imported it a moment ago; say what is known
        names: list[str] = []
    else:
        names = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = (
        f"did you mean {module_name}.{close[0]}?"
        if close
        else f"{module_name} has {', '.join(sorted(names)) or 'no classes'}."
    )
    return f"{group}: {class_path} does not exist ({module_name} has no {name!r}): {hint}"


def _unknown_short_name(group: str, name: str) -> str:
    """A class name without its module that names no callback (or plugin) imported so far: the closest that does."""
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import Precision

    def subclasses(cls: type) -> set[type]:
        found = set(cls.__subclasses__())
        return found.union(*(subclasses(c) for c in found)) if found else found

    bases = (Callback,) if group == "trainer.callbacks" else (Precision, CheckpointIO)
    known = {c.__name__: f"{c.__module__}.{c.__qualname__}" for base in bases for c in subclasses(base)
             if not c.__name__.startswith("_") and "." not in c.__qualname__}
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = (
        f"did you mean {close[0]} ({known[close[0]]})?"
        if close
        else "give the class's full import path, e.g. my_pkg.MyCallback."
    )
    return f"{group}: no class named {name!r}: {hint}"


def check_fit_ended_finite(trainer: Any, module: Any) -> None:
    """Raise :class:`NonFiniteError` if a finished ``fit`` left weights that hold NaN/Inf (this rank's shards); the
    weights, not the last loss: a step ``NonFiniteGuard`` skipped logs a NaN loss and leaves the weights as they were.
    """
    params = dict(module.named_parameters())
    bad = nonfinite_weights(params)
    if bad:
        loss = trainer.callback_metrics.get("train/loss")
        loss_text = f"train/loss={float(loss)}, " if loss is not None else ""
        guard = next((c for c in trainer.callbacks if isinstance(c, NonFiniteGuard)), None)
        advice = (guard.advice(module) if guard is not None else
                  f"Start a new run with a lower {learning_rate_option(module)} or gradient clipping "
                  f"({option('Trainer', 'gradient_clip_val')}), and add lightning_gpuopt.callbacks.NonFiniteGuard "
                  "to the callbacks: it stops at the first bad step and says whether the last checkpoint is worth "
                  "resuming.")
        raise NonFiniteError(
            f"Training ended with non-finite weights ({len(bad)} of {len(params)} parameters hold NaN/Inf, first "
            f"{bad[0]!r}; {loss_text}step {trainer.global_step}): the model diverged. {advice}"
        )


def explain_lightning_error(err: BaseException) -> Optional[str]:
    """One line with the fix for a Lightning error that is a configuration error, else ``None``; so far a fractional
    ``trainer.limit_<stage>_batches`` that leaves less than one batch ("0.1 * 5 < 1", deep in the data connector)."""
    under_one = _LIMIT_UNDER_ONE.search(str(err))
    if under_one is None:
        return None
    fraction, prefix, length = under_one.groups()
    stage = {"train": "training", "val": "validation"}.get(prefix, prefix)
    key = f"trainer.limit_{prefix}_batches"
    least = -(-1000 // int(length)) / 1000  # 1 / length, rounded up to 3 decimals
    return (f"{key}={fraction} keeps less than one of the {length} {stage} batches ({fraction} x {length} < 1), so "
            f"no {stage} would run: give a fraction of at least {least:g}, or a number of batches (--{key} "
            f"{length} runs all {length}); a smaller batch size or sequence length also makes more batches.")


def _exit_status(err: BaseException) -> Optional[int]:
    if isinstance(err, (NonFiniteError, NonFiniteCheckpointError)):
        return 1
    if isinstance(err, Exception) and is_disk_full(err):
        return 1
    if isinstance(err, (ValueError, ImportError)) or explain_lightning_error(err) is not None:
        return 2
    return None


def run_reporting_errors(run: Callable[[], T]) -> T:
    """Call ``run``; end the process with a short message and an exit status for the errors of the module docstring."""
    try:
        return run()
    except Exception as err:
        status = _exit_status(err)
        if status is None or os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
            raise
        label = "training stopped" if status == 1 else "error"
        message = explain_instantiation_error(err) or explain_lightning_error(err) or err
        sys.stderr.write(f"gpuopt: {label}: {message}\n(set {TRACEBACK_ENV}=1 to see the traceback)\n")
        sys.stderr.flush()
        raise SystemExit(status) from None
