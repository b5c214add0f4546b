"""Reference schedulers and routers from the literature.

Importing this package registers the built-in policies; build one with
:func:`kvsched.policies.base.make_policy`.
"""

from . import fcfs  # noqa: F401  (registers "fcfs")
from .base import PolicyParams, SchedulerPolicy, make_policy, policy_names

__all__ = ["PolicyParams", "SchedulerPolicy", "make_policy", "policy_names"]
