"""The scheduler-policy interface and the policy registry.

An instance (``kvsched.envs.sim.instance``) runs a vLLM-V1-like step loop; a policy makes its
two decisions, reading only a :class:`~kvsched.envs.sim.features.FeatureTable`:

1. ``order_waiting(table)``: the order in which waiting requests are offered cache residency
   (admission order). Return ``None`` to keep queue order (FCFS), or row indices.
2. ``choose_victim(table)``: which running request to preempt when KV allocation fails.

``order_is_static`` declares that the admission order cannot change while the batch is
unchanged (no arrival, completion or transfer); the simulator only fast-forwards stretches
of steps past a blocked waiting queue when it is ``True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvsched.envs.sim.errors import UnknownPresetError
from kvsched.envs.sim.features import FeatureTable


@dataclass(frozen=True)
class PolicyParams:
    """Base of every policy's frozen parameter dataclass."""


class SchedulerPolicy:
    """Base class: FCFS admission and vLLM's default preemption victim."""

    name = "base"
    order_is_static = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params if params is not None else PolicyParams()

    def order_waiting(self, table: FeatureTable) -> np.ndarray | None:
        """Admission order over ``table`` rows, or ``None`` for queue order."""
        return None

    def choose_victim(self, table: FeatureTable) -> int:
        """Row of ``table`` (running requests in admission order) to preempt.

        Default: the last row, i.e. the most recently admitted request, as vLLM V1 under
        ``--scheduling-policy fcfs`` (``self.running.pop()``, REFERENCE.md §4.1).
        """
        return len(table) - 1


_REGISTRY: dict[str, Callable[..., SchedulerPolicy]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator adding a policy to the registry under ``name``."""

    def deco(cls: type) -> type:
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def make_policy(name: str, params: PolicyParams | None = None) -> SchedulerPolicy:
    """Instantiate the registered policy ``name``.

    Raises:
        UnknownPresetError: if ``name`` is not registered (the message lists known names).
    """
    from kvsched import policies as _p  # noqa: F401  (registers the built-in policies)

    if name not in _REGISTRY:
        raise UnknownPresetError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](params)


def policy_names() -> list[str]:
    """Names of the registered policies."""
    from kvsched import policies as _p  # noqa: F401

    return sorted(_REGISTRY)
