"""Simulator core and workloads, and the Gymnasium environments over them.

Importing this package (or any module of the core, ``kvsched.envs.sim``) imports neither
Gymnasium nor any policy. The environments are registered with Gymnasium as entry-point strings
(their modules load only on ``gymnasium.make``) by :mod:`kvsched.envs.registration`:

- ``kvsched/Scheduling-v0`` (:class:`kvsched.envs.scheduling_env.SchedulingEnv`)
- ``kvsched/Scheduling-v1`` (the same class, observation version 1:
  :mod:`kvsched.envs.observation_v1`)
- ``kvsched/Routing-v0`` (:class:`kvsched.envs.routing_env.RoutingEnv`)
- ``kvsched/PDRouting-v0`` (:class:`kvsched.envs.routing_env.PDRoutingEnv`): decode instance and
  prefill placement with prefill/decode roles
- ``kvsched/Knobs-v0`` (:class:`kvsched.envs.knob_env.KnobEnv`)
- ``kvsched/Residency-v0`` (:class:`kvsched.envs.residency_env.ResidencyEnv`)

Either way works::

    import gymnasium as gym
    import kvsched.envs                      # registers the ids once Gymnasium is imported
    env = gym.make("kvsched/Scheduling-v0")

    env = gym.make("kvsched.envs.registration:kvsched/Scheduling-v0")   # Gymnasium's module:id form

``import kvsched.envs`` registers at once when Gymnasium is already imported; otherwise it asks
to be told when Gymnasium is imported later (a one-shot import hook, removed once it fired), so
the order of the two imports does not matter and a process that never imports Gymnasium (a
bench subprocess, a Ray worker running simulations) never pays its ~0.3 s import.
"""

from __future__ import annotations

import sys

ENV_IDS = ("kvsched/Scheduling-v0", "kvsched/Scheduling-v1", "kvsched/Routing-v0", "kvsched/Knobs-v0",
           "kvsched/Residency-v0", "kvsched/PDRouting-v0")

#: the ids of the scheduling environment (one class; the observation version differs)
SCHEDULING_IDS = ("kvsched/Scheduling-v0", "kvsched/Scheduling-v1")

#: keyword arguments an id fixes (Scheduling-v1 is Scheduling-v0 with observation version 1)
ID_KWARGS: dict[str, dict] = {"kvsched/Scheduling-v1": {"observation_version": 1}}

#: environment id -> Gymnasium entry point (module:class; the module loads on ``gymnasium.make``)
ENTRY_POINTS: dict[str, str] = {
    "kvsched/Scheduling-v0": "kvsched.envs.scheduling_env:SchedulingEnv",
    "kvsched/Scheduling-v1": "kvsched.envs.scheduling_env:SchedulingEnvV1",
    "kvsched/Routing-v0": "kvsched.envs.routing_env:RoutingEnv",
    "kvsched/Knobs-v0": "kvsched.envs.knob_env:KnobEnv",
    "kvsched/Residency-v0": "kvsched.envs.residency_env:ResidencyEnv",
    "kvsched/PDRouting-v0": "kvsched.envs.routing_env:PDRoutingEnv",
}

#: environment id -> the bundled scenario (``experiments/scenarios/``) it serves when given none;
#: ``kvsched evaluate`` without ``--scenario`` or a checkpoint draws its held-out windows from it
DEFAULT_SCENARIOS: dict[str, str] = {
    "kvsched/Scheduling-v0": "mixed-long-short.yaml",
    "kvsched/Scheduling-v1": "mixed-long-short.yaml",
    "kvsched/Routing-v0": "mixed-long-short.yaml",
    "kvsched/Knobs-v0": "mixed-long-short.yaml",
    "kvsched/Residency-v0": "residency-mooncake.yaml",  # caches prefixes below HBM (the default one does not)
    "kvsched/PDRouting-v0": "mixed-long-short-pd.yaml",  # prefill/decode roles
}


def default_scenario(env_id: str) -> str:
    """The path of the bundled scenario environment ``env_id`` serves when given none
    (:data:`DEFAULT_SCENARIOS`; installed with the package).

    Raises:
        KeyError: an id not in :data:`ENV_IDS` (callers validate ids first).
    """
    from importlib.resources import files

    return str(files("kvsched.experiments") / "scenarios" / DEFAULT_SCENARIOS[env_id])


def register_environments() -> None:
    """Register every id of :data:`ENTRY_POINTS` not yet in Gymnasium's registry (idempotent;
    imports Gymnasium)."""
    import warnings

    import gymnasium

    # Gymnasium calls an id "out of date" once a higher version of its name is registered;
    # Scheduling-v0 is not: it is a supported observation version (kvsched bench v1's tasks use it)
    warnings.filterwarnings("ignore", message=r".*The environment kvsched/Scheduling-v0 is out of date",
                            category=DeprecationWarning)
    for env_id, entry_point in ENTRY_POINTS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point, kwargs=dict(ID_KWARGS.get(env_id, {})))


class _RegisterAfterGymnasium:
    """A ``sys.meta_path`` finder that registers the environments right after ``gymnasium`` is
    imported, then removes itself (it only wraps the loader of that one module)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib protocol
        if fullname != "gymnasium":
            return None
        import importlib.machinery

        try:
            sys.meta_path.remove(self)
        except ValueError:  # pragma: no cover - removed by a concurrent import
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module  # the bound method of gymnasium's own loader

        def exec_module(module):
            run_module(module)
            register_environments()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _register_when_gymnasium_loads() -> None:
    if "gymnasium" in sys.modules:
        register_environments()
        return
    if not any(isinstance(f, _RegisterAfterGymnasium) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterGymnasium())


_register_when_gymnasium_loads()
