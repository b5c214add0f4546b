"""Registers kvsched's environments with Gymnasium when imported (the core never imports this).

``gymnasium.make("kvsched.envs.registration:kvsched/Scheduling-v0")`` works without any other
import (Gymnasium's ``module:id`` form); ``import kvsched.envs`` registers too, once Gymnasium is
imported (:func:`kvsched.envs.register_environments`). Registration is by entry-point string: an
environment's module loads on ``make``.
"""

from __future__ import annotations

import gymnasium  # noqa: F401  (this module is the Gymnasium-facing one)

from . import ENTRY_POINTS, register_environments

__all__ = ["ENTRY_POINTS", "register", "register_environments"]

#: the registration function (kept under the name earlier releases exported)
register = register_environments

register_environments()
