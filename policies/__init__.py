"""Reference schedulers and routers from the literature.

Importing this package registers the built-in policies; build one with
:func:`kvsched.policies.base.make_policy`, a cluster router with
:func:`kvsched.policies.routing.make_router`.
"""

from . import ewsjf  # noqa: F401  (registers "ewsjf")
from . import fcfs  # noqa: F401  (registers "fcfs")
from . import lars  # noqa: F401  (registers "lars")
from . import lpm  # noqa: F401  (registers "lpm")
from . import nonpreemptive  # noqa: F401  (registers "nonpreemptive")
from . import pnm  # noqa: F401  (registers "pnm")
from . import prefetch  # noqa: F401  (registers "prefetch")
from . import priority  # noqa: F401  (registers "priority")
from . import routing  # noqa: F401  (registers the cluster routers: make_router)
from . import sarathi  # noqa: F401  (registers "sarathi")
from . import vllm_priority  # noqa: F401  (registers "vllm-priority")
from .base import PolicyParams, SchedulerPolicy, make_policy, policy_names

__all__ = ["PolicyParams", "SchedulerPolicy", "make_policy", "policy_names"]
