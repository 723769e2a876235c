"""Small checks every public class uses on its own options, in its constructor, with one style of message.

Each raises a ``ValueError`` that names the option as ``Owner.name``, the range it must be in, and
the value it got, before any data is prepared or any step runs::

    check_number("GPTModule", "learning_rate", learning_rate, low=0, low_open=True)
    check_int("AutoBatchSize", "max_micro_batch_size", value, minimum=1, optional=True)
    check_choice("NonFiniteGuard", "policy", policy, ("skip", "stop"))

A message that names a fix names it in the form the user writes it, through :func:`option`: the Python
argument (``AutoBatchSize(max_micro_batch_size=64)``), or inside the ``gpuopt`` command (which runs in
:func:`command_line_options`) its option (``--model.learning_rate``, or the callback's ``init_args`` in
``trainer.callbacks``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

__all__ = ["check_choice", "check_int", "check_number", "command_line_options", "from_command_line", "option"]

# Where the gpuopt command takes each class's options: a group of its own, else a list of trainer.*.
_GROUPS = {"GPTModule": "model", "GPTConfig": "model", "TextDataModule": "data", "Trainer": "trainer",
           "Trainer.fit": "", "ExactResume": "exact_resume", "SigtermCheckpoint": "sigterm_checkpoint"}
_PLUGINS = ("BF16Precision", "Float8Precision", "AtomicCheckpointIO")
_command_line = False  # inside command_line_options()


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
    """Whether this runs inside the ``gpuopt`` command (:func:`command_line_options`): for the few fixes that are not
    an option there at all."""
    return _command_line


def option(owner: str, name: str, value: Any = ...) -> str:
    """The option ``name`` of the class ``owner`` (set to ``value``), as the user writes it here.

    In Python, the constructor argument; in the ``gpuopt`` command (:func:`command_line_options`), the
    flag of the class's group, or for a callback or plugin the ``init_args`` of its entry in the list.

    Example::

        option("AutoBatchSize", "max_micro_batch_size", 64)
        # Python:  "AutoBatchSize(max_micro_batch_size=64)"
        # gpuopt:  "init_args: {max_micro_batch_size: 64} of AutoBatchSize in trainer.callbacks"
        option("GPTModule", "learning_rate")  # "GPTModule(learning_rate=...)" / "--model.learning_rate"

    Args:
        owner: The class, as users write it.
        name: The option.
        value: The value to name (left out: the option alone).
    """
    if not _command_line:
        return f"{owner}({name}={'...' if value is ... else repr(value)})"
    text = "" if value is ... else _yaml(value)
    group = _GROUPS.get(owner)
    if group is not None:
        return f"--{group}{'.' if group else ''}{name}{' ' + text if text else ''}"
    where = "trainer.plugins" if owner in _PLUGINS else "trainer.callbacks"
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
        owner: The class, as users write it.
        name: The option.
        value: What was given.
        low: Lowest allowed value (``None``: no bound); ``low_open`` leaves ``low`` itself out.
        high: Highest allowed value (``None``: no bound); ``high_open`` leaves ``high`` itself out.
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
    """Raise unless ``value`` is an integer >= ``minimum`` (``None`` too when ``optional``).

    Example::

        check_int("GPTModule", "max_new_tokens", 0, minimum=1)
        # ValueError: GPTModule.max_new_tokens must be an integer >= 1, got 0.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{owner}.{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}{hint}."
        )


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    """Raise unless ``value`` is one of ``choices``.

    Example::

        check_choice("NonFiniteGuard", "mode", "lazy", ("auto", "step", "deferred"))
        # ValueError: NonFiniteGuard.mode must be 'auto', 'step' or 'deferred', got 'lazy'.
    """
    if value not in choices:
        names = [repr(c) for c in choices]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ValueError(f"{owner}.{name} must be {listed}, got {value!r}{hint}.")
