"""Serving one episode of a task: with a heuristic in the simulator, or with an agent acting
through the task's environment.

A heuristic runs directly in the simulator on the episode's requests, with the cluster the
environment builds (its router, delay, shared tier): for a scheduling task the heuristic is every
instance's policy; for a routing task it is the router (the instances keep the scenario's
policy). That equals acting through the environment with the heuristic as its reference and the
reference action (tested). A residency heuristic is a tier order and a constant retention action,
played through the environment (:mod:`.residency`). Agents (a constant action, the random agent, a learned checkpoint)
act through the environment, with ``horizon_s = inf`` so every request is judged.

Every function returns the run's metrics summary (``summarize``'s dict); :func:`score` reads the
task's metric from it (SLO attainment of all requests).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from .episodes import Episode, task_source
from .tasks import BenchTask

#: act(obs, info, env) -> action
Actor = Callable[[np.ndarray, dict, Any], Any]


def score(summary: Mapping[str, Any]) -> float | None:
    """The task metric of a run: SLO attainment of all requests (None for an empty episode)."""
    return summary["classes"]["all"]["slo"]["attainment"]


def heuristic_cluster(task: BenchTask, heuristic: str, params: Mapping[str, Any] | None = None,
                      policy_wrap: Callable[[Any], Any] | None = None, router: Any = None):
    """The cluster an episode of ``task`` runs on with ``heuristic`` (a policy for a scheduling
    task, a router for a routing task) and its ``params``. ``policy_wrap`` wraps each instance's
    policy (the hindsight search's overrides); ``router`` replaces the router object."""
    from kvsched.envs.common import build_cluster, reference
    from kvsched.envs.sim.cluster import Cluster
    from kvsched.policies.routing import make_router

    src = task_source(task)
    wrap = policy_wrap or (lambda p: p)
    if task.env_id == "kvsched/Scheduling-v0":
        cluster = build_cluster(src, lambda i: wrap(reference(heuristic, dict(params or {}), src)))
        if router is not None:
            raise ValueError("a scheduling task keeps the scenario's router")
        return cluster
    sc = src.scenario
    from kvsched.envs.sim.instance import InstanceOptions

    rt = router if router is not None else make_router(heuristic, dict(params or {}))
    return Cluster([sc.instance_spec()] * task.instances, lambda: wrap(reference(sc.policy, None, src)),
                   metrics=sc.metrics_config(), router=rt, router_delay_s=sc.router_delay_s,
                   shared_kv=sc.shared_kv_spec(), seed=sc.seed,
                   options=InstanceOptions(oracle_lengths=sc.oracle_lengths))


def run_heuristic(task: BenchTask, episode: Episode, heuristic: str, params: Mapping[str, Any] | None = None):
    """Serve ``episode`` with ``heuristic`` in the simulator; returns the :class:`SimulationResult`.
    A residency heuristic is a tier order and a constant action, played through the environment
    (:func:`.residency.run`)."""
    if task.env_id == "kvsched/Residency-v0":
        from .residency import run

        return run(task, episode, heuristic, params)
    w = task_source(task).workload(episode.workload_seed, episode.window_index)
    return heuristic_cluster(task, heuristic, params).run(w)


def make_env(task: BenchTask, reference: str | None = None, reference_params: Mapping[str, Any] | None = None,
             split: str = "heldout", **overrides):
    """The task's environment (Gymnasium) for ``split`` with the given reference heuristic."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)

    kw = task.env_kwargs_for(split, reference, reference_params)
    kw.update(overrides)
    return gym.make(task.env_id, **kw)


def run_env(env, episode: Episode, act: Actor, seed: int = 0) -> dict:
    """One episode of ``env`` (the held-out split) with actions from ``act``; returns its summary."""
    obs, info = env.reset(seed=seed, options=episode.as_options())
    while True:
        obs, _, terminated, truncated, info = env.step(act(obs, info, env))
        if terminated or truncated:
            break
    if "summary" not in info:  # truncated (a finite horizon): judge what has been recorded
        return env.unwrapped.cluster.result().summary
    return info["summary"]


def constant_actor(action) -> Actor:
    """The same action at every decision (masked parts fall back to the reference's)."""
    a = np.asarray(action)
    return lambda obs, info, env: a


def random_actor(seed: int) -> Actor:
    """Uniform over the allowed actions of each part (the action mask), seeded."""
    rng = np.random.default_rng(seed)

    def act(obs, info, env):
        space = env.action_space
        m = info["action_mask"]
        if hasattr(space, "nvec"):
            out, i = [], 0
            for n in space.nvec:
                out.append(int(rng.choice(np.flatnonzero(m[i:i + n]))))
                i += n
            return np.array(out)
        return int(rng.choice(np.flatnonzero(m)))

    return act


def model_actor(model, masked: bool, deterministic: bool = True) -> Actor:
    """A Stable-Baselines3 (or sb3-contrib) model's ``predict``, with the action mask when masked."""
    if masked:
        return lambda obs, info, env: model.predict(obs, deterministic=deterministic,
                                                    action_masks=info["action_mask"])[0]
    return lambda obs, info, env: model.predict(obs, deterministic=deterministic)[0]


def constant_actions(task: BenchTask, env) -> list[tuple[str, Any]]:
    """The constant-action baselines of a task: ``(label, action)`` pairs.

    Scheduling-v0 (``MultiDiscrete([K, 7, 5, 4])``, 2,240 actions for K = 16): the documented
    sample is every value of one part with the other parts at the reference's (0): slots 0-3,
    the 7 chunk bins, the 5 victim rules, the 4 preemption modes (17 distinct actions; a slot
    beyond the candidates or a masked mode falls back to the reference's decision). Routing-v0:
    every instance index. Residency-v0: every allowed retention decision
    (:func:`.residency.constant_actions`).
    """
    if task.env_id == "kvsched/Residency-v0":
        from .residency import constant_actions as residency_actions

        return [(label, np.int64(a)) for label, a in residency_actions(env)]
    space = env.action_space
    if not hasattr(space, "nvec"):
        return [(f"instance={i}", np.int64(i)) for i in range(int(space.n))]
    parts = ("slot", "chunk", "victim", "mode")
    seen, out = set(), []
    for p, n in enumerate(space.nvec):
        for v in range(min(int(n), 4) if parts[p] == "slot" else int(n)):
            a = np.zeros(len(space.nvec), dtype=np.int64)
            a[p] = v
            if tuple(a) in seen:
                continue
            seen.add(tuple(a))
            out.append((f"{parts[p]}={v}" if v else "reference", a))
    return out


def episode_seed(stratum_index: int) -> int:
    """The seed of a stochastic agent on the ``stratum_index``-th episode of a stratum."""
    return 1_000 + stratum_index


def finite(x: float | None) -> float:
    """A score as a float (NaN for None)."""
    return math.nan if x is None else float(x)
