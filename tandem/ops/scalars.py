"""Checks for scalar hyperparameters, shared by the fused ops and the optimizers."""

from __future__ import annotations

import math
from collections.abc import Callable


def check_number(where: str, name: str, value: object, valid: Callable[[float], bool], rule: str) -> float:
    """``value`` as a float if it is a finite real number (not a bool) satisfying ``valid``.

    Raises TypeError for a non-number and ValueError otherwise, naming ``where``, ``name`` and ``rule``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {name} must be a number ({rule}), got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or not valid(number):
        raise ValueError(f"{where}: {name} must be {rule}, got {value!r}")
    return number


def check_flag(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value
