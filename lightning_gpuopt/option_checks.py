"""Small checks every public class uses on its own options, in its constructor, with one style of message.

Each raises a ``ValueError`` that names the option as ``Owner.name``, the range it must be in, and
the value it got, before any data is prepared or any step runs::

    check_number("GPTModule", "learning_rate", learning_rate, low=0, low_open=True)
    check_int("AutoBatchSize", "max_micro_batch_size", value, minimum=1, optional=True)
    check_choice("NonFiniteGuard", "policy", policy, ("skip", "stop"))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["check_choice", "check_int", "check_number"]


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
