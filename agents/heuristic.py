"""Heuristics as agents with Stable-Baselines3's ``predict`` signature, in every kvsched environment.

A :class:`HeuristicAgent` plays exactly the decisions of a heuristic through an environment, so
that an episode it plays equals the heuristic's direct run in the simulator (tested per
environment):

- ``kvsched/Scheduling-v0``: the heuristic must be the environment's reference policy; it plays
  action ``(0, 0, 0, 0)``, the reference's own decision. Another policy cannot be expressed
  exactly through the action (it sets the first admission and the step's chunk cap, not a
  policy's whole order, chunk rule and victims), so the agent refuses it and says to make the
  environment with ``reference_policy=<name>``.
- ``kvsched/Routing-v0``: a router name (:mod:`kvsched.policies.routing`); each action is the
  router's choice from the state view the cluster would give it.
- ``kvsched/Knobs-v0``: the environment's heuristic; it keeps its own parameters.

It asks every sub-environment (``VecEnv.env_method("heuristic_action", ...)`` in ``DummyVecEnv``
and ``SubprocVecEnv`` alike).
"""

from __future__ import annotations

import numpy as np

from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.sim.errors import require


class HeuristicAgent:
    """A heuristic acting faithfully through a kvsched environment (see the module docstring).

    Args:
        policy: the heuristic: a policy name (Scheduling-v0: the reference; ``None`` = the
            reference), a router name (Routing-v0), the environment's heuristic (Knobs-v0;
            ``None`` = it).
        env: a kvsched environment, a Gymnasium wrapper of one, or an SB3 ``VecEnv`` of them.
        params: the router's parameters (Routing-v0 only).

    Raises:
        ConfigError: a heuristic the environment cannot play exactly (the message says how), or
            a router name missing for Routing-v0.
    """

    def __init__(self, policy: str | None, env, params: dict | None = None) -> None:
        self.policy = policy
        self.env = env
        self.params = params
        vec = hasattr(env, "env_method")
        spec = env.get_attr("spec", [0])[0] if vec else env.unwrapped.spec
        env_id = getattr(spec, "id", "")

        def attr(name: str):
            return env.get_attr(name, [0])[0] if vec else getattr(env.unwrapped, name)

        if env_id.endswith("Routing-v0"):
            require(policy is not None, "policy", policy, "a router name for kvsched/Routing-v0")
            from kvsched.policies.routing import make_router

            make_router(policy, dict(params or {}))  # an unknown router or bad parameters: say so now
            self._args: tuple = (policy, params)
            return
        require(params is None, "params", params, "None outside Routing-v0 (the environment's reference or "
                "heuristic brings its own parameters)")
        if policy is not None:  # the registered name: 'LARS' is 'lars', as for simulate
            from kvsched.policies.base import POLICIES

            policy = POLICIES.canonical(policy)
            self.policy = policy
        self._args = (policy,)
        if env_id in SCHEDULING_IDS:
            ref = attr("reference_policy")
            require(policy is None or policy == ref, "policy", policy,
                    f"the environment's reference policy {ref!r}: a heuristic acts exactly only as the reference; "
                    f"make the environment with reference_policy={policy!r}")
        elif env_id.endswith("Knobs-v0"):
            h = attr("heuristic")
            require(policy is None or policy == h, "policy", policy,
                    f"the environment's heuristic {h!r} (make the environment with heuristic={policy!r})")

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        """SB3 signature: ``(actions, state)``; actions batched like ``observation``."""
        env = self.env
        if hasattr(env, "env_method"):  # SB3 VecEnv
            actions = np.stack([np.asarray(a) for a in env.env_method("heuristic_action", *self._args)])
            return actions, state
        return np.asarray(env.unwrapped.heuristic_action(*self._args)), state
