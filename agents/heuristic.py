"""Heuristic policies as agents with Stable-Baselines3's ``predict`` signature.

A :class:`HeuristicAgent` acts through a (vectorised) ``kvsched/Scheduling-v0`` environment:
at each decision it asks every sub-environment for the action by which the named policy
decides (``SchedulingEnv.heuristic_action``, through ``VecEnv.env_method`` so it works in
``DummyVecEnv`` and ``SubprocVecEnv`` alike). With the environment's reference policy it is
action ``(0, 0, 0, 0)`` and reproduces the policy's direct run exactly (tested).
"""

from __future__ import annotations

import numpy as np


class HeuristicAgent:
    """A policy of :mod:`kvsched.policies` acting through a scheduling environment.

    Args:
        policy: a registered policy name (``None``: the environment's reference policy).
        env: the environment it acts in: a ``SchedulingEnv``, a Gymnasium wrapper of one, or an
            SB3 ``VecEnv`` of them.
    """

    def __init__(self, policy: str | None, env) -> None:
        self.policy = policy
        self.env = env

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        """SB3 signature: ``(actions, state)``; actions batched like ``observation``."""
        env = self.env
        if hasattr(env, "env_method"):  # SB3 VecEnv
            actions = np.stack([np.asarray(a) for a in env.env_method("heuristic_action", self.policy)])
            return actions, state
        return np.asarray(env.unwrapped.heuristic_action(self.policy)), state
