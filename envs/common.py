"""Shared pieces of the Gymnasium adapters: the bundled default scenario, building a cluster
for an episode, the reference policy."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvsched.envs.episodes import EpisodeConfig, EpisodeSource
from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import require
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.policies.base import make_policy

DEFAULT_SCENARIO = "experiments/scenarios/mixed-long-short.yaml"


def default_scenario_path() -> str:
    """The bundled mixed long/short scenario (installed with the package)."""
    from importlib.resources import files

    return str(files("kvsched.experiments") / "scenarios" / "mixed-long-short.yaml")


def build_cluster(source: EpisodeSource, policy_for: Callable[[int], object], n_instances: int | None = None,
                  seed: int | None = None) -> Cluster:
    """A cluster for one episode of ``source``'s scenario (its router, router parameters and
    delay, shared KV tier); ``policy_for(i)`` builds instance i's policy."""
    sc = source.scenario
    n = sc.n_instances if n_instances is None else n_instances
    spec = sc.instance_spec()
    counter = iter(range(n))
    from kvsched.policies.routing import make_router

    return Cluster([spec] * n, lambda: policy_for(next(counter)), metrics=sc.metrics_config(),
                   router=make_router(sc.router, dict(sc.router_params)), router_delay_s=sc.router_delay_s,
                   shared_kv=sc.shared_kv_spec(), seed=sc.seed if seed is None else seed,
                   options=InstanceOptions(oracle_lengths=sc.oracle_lengths))


def queued_prefill_tokens(inst) -> int:
    """Prompt tokens ``inst`` still has to compute: its waiting requests' (prompt plus any
    generated tokens a recompute must redo) and its running partial prefills' rest
    (:func:`kvsched.envs.observation.is_partial_prefill`, inlined)."""
    q = 0
    for s in inst.waiting:
        q += s.prompt_tokens + s.generated - s.computed
    for s in inst.running:
        c = s.prompt_tokens + s.generated - s.computed
        if c > (1 if s.generated > 0 else 0):
            q += c
    return q


def check_steppable(env) -> None:
    """Raise ``RuntimeError`` unless ``env`` (any kvsched environment) has an episode to step."""
    if env.cluster is None:
        raise RuntimeError("call reset() before step()")
    if env._over:
        raise RuntimeError("the episode is over: call reset()")


def unfinished(cluster: Cluster) -> list:
    """Every instance's waiting, running and swapped-out requests (in that order, instance by
    instance): the requests a reward may still charge as certain misses."""
    return [st for inst in cluster.instances for q in (inst.waiting, inst.running, inst.swapped) for st in q]


def step_info(env, time_s: float, extra: dict) -> dict:
    """The ``info`` dict every kvsched environment returns: action mask, simulated time (s),
    decisions so far, the episode's window, plus ``extra`` (after a step: ``reward_components``
    and ``elapsed_s``, the simulated seconds from the decision the step acted on to the next one
    or the episode's end, which a semi-MDP learner discounts by: :mod:`kvsched.agents.semi_mdp`)."""
    return {"action_mask": env.action_masks(), "time_s": time_s, "decisions": env.decisions,
            "window": dict(env.episode), **extra}


def reference(name: str, params: dict | None, source: EpisodeSource):
    """The named policy with ``params`` (default: the scenario's parameters when it names the
    same policy)."""
    sc = source.scenario
    if params is None and make_policy(name).name == sc.policy:  # registered names ("LARS" is "lars")
        params = sc.policy_params
    return make_policy(name, dict(params or {}))


def episode_config(scenario: str | None, window_s: float, split: str, heldout_fraction: float,
                   max_requests: int | None) -> EpisodeConfig:
    return EpisodeConfig(scenario=scenario or default_scenario_path(), window_s=window_s, split=split,
                         heldout_fraction=heldout_fraction, max_requests=max_requests)


def integer_action(action, n_parts: int, allowed: str) -> list[int]:
    """The entries of a discrete action as Python ints, for any array-like that holds exactly
    ``n_parts`` whole numbers (integer or bool arrays, Python ints, floats with no fractional
    part; any shape, flattened).

    Raises:
        ConfigError: naming ``action``, its value and ``allowed`` when it is not numeric, has
            another number of entries, or an entry is not a whole number (1.7 is refused, not
            truncated to 1; NaN and infinities too). Range checks are the caller's.
    """
    try:
        a = np.asarray(action)
        ok = a.size == n_parts and a.dtype.kind in "biuf"
    except (TypeError, ValueError):
        ok = False
    if ok and a.dtype.kind == "f":
        ok = bool(np.all(np.isfinite(a)) and np.all(a == np.floor(a)))
    require(ok, "action", action, allowed)
    return a.astype(np.int64).reshape(-1).tolist()
