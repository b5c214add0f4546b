"""Registers kvsched's environments with Gymnasium (imports Gymnasium; the core never imports this).

Importing this module registers them (``gymnasium.make("kvsched.envs.registration:kvsched/Scheduling-v0")``
works without any other import); :mod:`kvsched.envs` calls :func:`register` once Gymnasium is
imported. Registration is by entry-point string: an environment's module loads on ``make``.
"""

from __future__ import annotations

import gymnasium

ENTRY_POINTS: dict[str, str] = {
    "kvsched/Scheduling-v0": "kvsched.envs.scheduling_env:SchedulingEnv",
    "kvsched/Routing-v0": "kvsched.envs.routing_env:RoutingEnv",
    "kvsched/Knobs-v0": "kvsched.envs.knob_env:KnobEnv",
}


def register() -> None:
    """Register every id of :data:`ENTRY_POINTS` not yet in Gymnasium's registry (idempotent)."""
    for env_id, entry_point in ENTRY_POINTS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


register()
