"""Small checks every public class uses on its own options, in its constructor, with one style of message.

Each raises a ``ValueError`` naming the option as ``Owner.name``, what it must be, and what it got,
before any work::

    check_int("AutoBatchSize", "max_micro_batch_size", value, minimum=1, optional=True)

A message that names a fix names it as the user writes it (:func:`option`): the Python argument, or
inside the ``gpuopt`` command (:func:`command_line_options`) its option.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

__all__ = ["check_bool", "check_choice", "check_file_name", "check_int", "check_names", "check_number",
           "command_line_options", "from_command_line", "option", "register_command_line_place"]

# Where the gpuopt command takes each class's options, by class name: filled by the command itself
# (register_command_line_place), so this module names no class of a layer above it.
_GROUPS: dict[str, str] = {}  # a group of its own: "model" -> --model.<name>; "" -> --<name>
_LISTS: dict[str, str] = {}  # an entry of a list option: "trainer.plugins"
_DEFAULT_LIST = "trainer.callbacks"  # a class not registered: a callback of the user's own, say
_command_line = False  # inside command_line_options()


def register_command_line_place(owner: Union[type, str], *, group: Optional[str] = None,
                                listed_in: Optional[str] = None) -> None:
    """Say where the ``gpuopt`` command takes ``owner``'s options, for :func:`option` to name them there.

    Exactly one of ``group`` (its own group: ``"model"`` gives ``--model.<name>``, ``""`` top-level ``--<name>``) or
    ``listed_in`` (an entry of a list option, ``"trainer.plugins"``) is given. A class not registered is named as an
    entry of ``trainer.callbacks``. ``owner`` is the class, or the name :func:`option` is called with
    (``"Trainer.fit"``).
    """
    if (group is None) == (listed_in is None):
        raise ValueError(f"register_command_line_place({owner!r}) takes one of group= or listed_in=, "
                         f"got group={group!r}, listed_in={listed_in!r}.")
    name = owner if isinstance(owner, str) else owner.__name__
    _GROUPS.pop(name, None)
    _LISTS.pop(name, None)
    if group is not None:
        _GROUPS[name] = group
    else:
        _LISTS[name] = listed_in


@contextmanager
def command_line_options() -> Iterator[None]:
    """Within it, :func:`option` names options as the ``gpuopt`` command takes them (its ``main`` runs inside)."""
    global _command_line
    before, _command_line = _command_line, True
    try:
        yield
    finally:
        _command_line = before


def from_command_line() -> bool:
    """Whether this runs inside the ``gpuopt`` command: for the few fixes that are not an option there at all."""
    return _command_line


def option(owner: str, name: str, value: Any = ...) -> str:
    """The option ``name`` of the class ``owner`` (set to ``value``), as the user writes it here.

    Example::

        option("AutoBatchSize", "max_micro_batch_size", 64)
        # Python:  "AutoBatchSize(max_micro_batch_size=64)"
        # gpuopt:  "init_args: {max_micro_batch_size: 64} of AutoBatchSize in trainer.callbacks"
        option("GPTModule", "learning_rate")  # "GPTModule(learning_rate=...)" / "--model.learning_rate"
    """
    if not _command_line:
        return f"{owner}({name}={'...' if value is ... else repr(value)})"
    text = "" if value is ... else _yaml(value)
    group = _GROUPS.get(owner)
    if group is not None:
        return f"--{group}{'.' if group else ''}{name}{' ' + text if text else ''}"
    where = _LISTS.get(owner, _DEFAULT_LIST)
    setting = f"init_args: {{{name}: {text}}}" if text else f"init_args.{name}"
    return f"{setting} of {owner} in {where}"


def _yaml(value: Any) -> str:
    """``value`` as the command line and YAML write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _range(low: Optional[float], high: Optional[float], low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return "a finite number"


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    hint: str = "",
) -> None:
    """Raise unless ``value`` is a finite number in the range (``None`` too when ``optional``).

    Example::

        check_number("GPTModule", "weight_decay", -1.0, low=0, hint=": a negative decay makes the weights grow")
        # ValueError: GPTModule.weight_decay must be >= 0, got -1.0: a negative decay makes the weights grow.

    Args:
        owner, name: The class as users write it, and the option.
        low, high: Bounds (``None``: none); ``low_open``/``high_open`` leave the bound itself out.
        optional: ``None`` is allowed.
        hint: Appended to the message (the fix, or what the option means).
    """
    if optional and value is None:
        return
    where = f"{owner}.{name}"
    if not _number(value) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number{' or None' if optional else ''}, got {value!r}{hint}.")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        bounds = _range(low, high, low_open, high_open)
        raise ValueError(f"{where} must be {bounds}{' or None' if optional else ''}, got {value!r}{hint}.")


def check_int(owner: str, name: str, value: Any, *, minimum: int, optional: bool = False, hint: str = "") -> None:
    """Raise unless ``value`` is an integer >= ``minimum`` (``None`` too when ``optional``):
    ``GPTModule.max_new_tokens must be an integer >= 1, got 0.``"""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{owner}.{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}{hint}."
        )


def check_choice(
    owner: str, name: str, value: Any, choices: Sequence[Any], hint: str = "", optional: bool = False
) -> None:
    """Raise unless ``value`` is one of ``choices`` (``None`` too when ``optional``):
    ``NonFiniteGuard.mode must be 'auto', 'step' or 'deferred', got 'lazy'.``"""
    if (optional and value is None) or value in choices:
        return
    names = [repr(c) for c in choices] + (["None"] if optional else [])
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    raise ValueError(f"{owner}.{name} must be {listed}, got {value!r}{hint}.")


def check_bool(owner: str, name: str, value: Any) -> None:
    """Raise unless ``value`` is ``True`` or ``False`` (not ``1``, not ``"yes"``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}.")


def check_names(owner: str, name: str, value: Any, choices: Sequence[str]) -> None:
    """Raise unless ``value`` is a non-empty list of distinct names from ``choices``."""
    names = list(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    if not names or any(n not in choices for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"{owner}.{name} must be a non-empty list of distinct names from {list(choices)}, got {value!r}."
        )


def check_file_name(owner: str, name: str, value: Any) -> None:
    """Raise unless ``value`` is a plain file name: not empty, no folder in it."""
    if not value or not isinstance(value, str) or os.sep in value:
        raise ValueError(f"{owner}.{name} must be a plain file name, got {value!r}.")
