"""Union type hints that parse an integer as an integer, whatever Python's typing cache hands out.

``typing`` caches ``Union[int, float]`` and ``Union[float, int]`` as one, so the Trainer's ``limit_val_batches`` may
come float-first (as another library spelt it), and jsonargparse, trying members in order, reads ``20`` as 20.0,
a fraction above 1. The parser passes every hint through :func:`int_before_float`."""

from __future__ import annotations

import functools
import operator
import types
from typing import Any, Union, get_args, get_origin

__all__ = ["int_before_float"]

_UNIONS = (Union, types.UnionType)


def int_before_float(hint: Any) -> Any:
    """``hint`` with ``int`` tried before ``float`` in every union it holds (the same object when nothing moves).

    Example::

        int_before_float(Union[float, int, None])  # int | float | None
    """
    if get_origin(hint) not in _UNIONS:
        return hint
    args = tuple(int_before_float(arg) for arg in get_args(hint))
    if int in args and float in args and args.index(float) < args.index(int):
        rest = [arg for arg in args if arg is not int]
        rest.insert(rest.index(float), int)
        args = tuple(rest)
    elif all(new is old for new, old in zip(args, get_args(hint))):
        return hint
    if all(isinstance(arg, type) for arg in args):
        return functools.reduce(operator.or_, args)  # int | float | None: a types.UnionType, never cached
    # Union[...] is cached by the ordered tuple of its (already flat) members, so this order is kept.
    return Union[args]
