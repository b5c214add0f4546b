"""Validation helpers shared by the spec dataclasses and their YAML/dict readers.

Each helper raises :class:`~kvsched.envs.sim.errors.ConfigError` naming ``owner.name``, the
(bounded) value and what is allowed (:func:`~kvsched.envs.sim.errors.require`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, TypeGuard

import numpy as np

from .errors import ConfigError, bounded_repr, require

__all__ = ["as_float", "int_at_least", "int_in", "is_int", "is_real", "non_negative", "positive", "real_in", "string"]


def is_int(v: object) -> TypeGuard[int | np.integer]:
    """True for a Python or NumPy integer (not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """True for a finite Python or NumPy real number (not a bool). An integer too large for a
    float (YAML reads ``1000...0`` with 400 digits as one) is not finite, so not real."""
    if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def int_at_least(owner: str, name: str, value: object, minimum: int) -> None:
    """Require an integer ``value >= minimum``."""
    require(is_int(value) and int(value) >= minimum, f"{owner}.{name}", value, f"an integer >= {minimum}")


def int_in(owner: str, name: str, value: object, minimum: int, maximum: int, why: str = "") -> None:
    """Require an integer ``minimum <= value <= maximum``; ``why`` (optional) says where the
    upper bound comes from."""
    require(is_int(value) and minimum <= int(value) <= maximum, f"{owner}.{name}", value,
            f"an integer in [{minimum}, {maximum}]" + (f" ({why})" if why else ""))


def real_in(owner: str, name: str, value: object, ok: Callable[[float], bool], allowed: str) -> None:
    """Require a finite real ``value`` with ``ok(value)`` true; ``allowed`` describes the range."""
    require(is_real(value) and ok(float(value)), f"{owner}.{name}", value, allowed)


def positive(owner: str, name: str, value: object) -> None:
    """Require a finite number > 0."""
    real_in(owner, name, value, lambda x: x > 0, "a finite number > 0")


def non_negative(owner: str, name: str, value: object) -> None:
    """Require a finite number >= 0."""
    real_in(owner, name, value, lambda x: x >= 0, "a finite number >= 0")


def string(owner: str, name: str, value: object) -> None:
    """Require a string."""
    require(isinstance(value, str), f"{owner}.{name}", value, "a string")


def as_float(value: Any, where: str) -> float:
    """A real number; numeric strings are accepted because YAML 1.1 reads ``1e9`` as a string."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if not is_real(value):
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a finite number")
    return value  # type: ignore[return-value]  # the real number as given (an int stays an int)


def known_keys(value: Any, allowed, where: str, what: str) -> None:
    """``value`` is a mapping whose keys are all in ``allowed`` (a dataclass's field names).

    Raises:
        ConfigError: not a mapping (``"<where> must be a mapping of <what> fields"``), or the first
            unknown key, named with the allowed ones.
    """
    from collections.abc import Mapping

    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping of {what} fields, got {type(value).__name__}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(allowed)}")
