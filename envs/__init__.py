"""Simulator core and workloads, and the Gymnasium environments over them.

The core (``kvsched.envs.sim``) never imports gymnasium. When gymnasium is installed (the
``rl`` extra), importing this package registers the environments by entry-point string (their
modules load only on ``gymnasium.make``):

- ``kvsched/Scheduling-v0`` (:class:`kvsched.envs.scheduling_env.SchedulingEnv`)
- ``kvsched/Routing-v0`` (:class:`kvsched.envs.routing_env.RoutingEnv`)
- ``kvsched/Knobs-v0`` (:class:`kvsched.envs.knob_env.KnobEnv`)
"""

ENV_IDS = ("kvsched/Scheduling-v0", "kvsched/Routing-v0", "kvsched/Knobs-v0")


def _register() -> None:
    try:
        import gymnasium
    except ImportError:  # the simulator works without the rl extra
        return
    entry = {"kvsched/Scheduling-v0": "kvsched.envs.scheduling_env:SchedulingEnv",
             "kvsched/Routing-v0": "kvsched.envs.routing_env:RoutingEnv",
             "kvsched/Knobs-v0": "kvsched.envs.knob_env:KnobEnv"}
    for env_id, ep in entry.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=ep)


_register()
