"""Heuristics as agents with Stable-Baselines3's ``predict`` signature, in every kvsched environment.

A :class:`HeuristicAgent` plays exactly the decisions of a heuristic through an environment, so
that an episode it plays equals the heuristic's direct run in the simulator on the same requests
(tested per environment), or it refuses at construction with a message saying how to make the
environment in which the heuristic can be played:

- ``kvsched/Scheduling-v0`` and ``-v1``: the heuristic must be the environment's reference
  policy; it plays the reference's own decision (action ``(0, 0, 0, 0)``). Another policy
  cannot be expressed exactly through the action (it sets the first admission and the step's
  chunk cap, not a policy's whole order, chunk rule and victims: picking only LARS's first
  admission on top of FCFS is neither policy), so the agent refuses it and says to make the
  environment with ``reference_policy=<name>``.
- ``kvsched/Routing-v0``: a router name (:mod:`kvsched.policies.routing`); each action is the
  router's choice from the state view the cluster would give it. A scheduling policy's name is
  refused, saying the instances run the environment's ``policy``.
- ``kvsched/Knobs-v0``: the environment's heuristic; it keeps its own parameters. Another
  heuristic is refused, saying to make the environment with ``heuristic=<name>``.
- ``kvsched/Residency-v0``: the environment's tier eviction order (``lru``, ``lfu``,
  ``clairvoyant``: action 0; another order is refused, saying to make the environment with
  ``eviction=<name>``) or ``session`` (keep every conversation ``params={"keep_s": s}``, one of
  the keep bins; default 30 s).

The environment is recognised by its class (the ``heuristic_role`` attribute each kvsched
environment class sets), not by its registered id, so an environment made directly
(``SchedulingEnv(...)``), through Gymnasium's ``module:id`` form or wrapped is checked the same
way; anything else is refused. It asks every sub-environment of an SB3 ``VecEnv``
(``env_method("heuristic_action", ...)`` in ``DummyVecEnv`` and ``SubprocVecEnv`` alike).
"""

from __future__ import annotations

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require

#: ``heuristic_role`` of each kvsched environment class -> the ids registered for it
ROLES = {"scheduling": "kvsched/Scheduling-v0, kvsched/Scheduling-v1",
         "routing": "kvsched/Routing-v0, kvsched/PDRouting-v0",
         "knobs": "kvsched/Knobs-v0", "residency": "kvsched/Residency-v0"}


def _environment_role(env) -> str:
    """The ``heuristic_role`` of ``env`` (a kvsched environment, a wrapper of one, or an SB3
    ``VecEnv`` of them).

    Raises:
        ConfigError: anything else (the message names its type and the environments allowed).
    """
    role = None
    if hasattr(env, "env_method"):  # SB3 VecEnv: the attribute through the sub-environment's wrappers
        try:
            role = env.get_attr("heuristic_role", [0])[0]
        except AttributeError:
            role = None
    else:
        role = getattr(getattr(env, "unwrapped", None), "heuristic_role", None)
    if role not in ROLES:
        raise ConfigError(f"env: a {type(env).__name__} is not allowed: expected a kvsched environment "
                          f"({', '.join(ROLES.values())}), a Gymnasium wrapper of one or an SB3 VecEnv of them")
    return role


class HeuristicAgent:
    """A heuristic acting faithfully through a kvsched environment (see the module docstring).

    Args:
        policy: the heuristic: a scheduling policy name (Scheduling-v0/-v1: the environment's
            reference; ``None`` = the reference), a router name (Routing-v0), the environment's
            heuristic (Knobs-v0; ``None`` = it). Names in any case (``"LARS"`` is ``"lars"``).
        env: a kvsched environment, a Gymnasium wrapper of one, or an SB3 ``VecEnv`` of them.
        params: the router's parameters (Routing-v0), or ``{"keep_s": s}`` for ``session``
            (Residency-v0).

    Raises:
        ConfigError: an environment that is not a kvsched one, or a heuristic the environment
            cannot play exactly (the message says how to make the environment that can), or a
            router name missing for Routing-v0.
        UnknownPresetError: an unknown policy or router name (the message lists the known ones).
    """

    def __init__(self, policy: str | None, env, params: dict | None = None) -> None:
        self.policy = policy
        self.env = env
        self.params = params
        role = _environment_role(env)
        vec = hasattr(env, "env_method")

        def attr(name: str):
            """The attribute of the environment; of a VecEnv, the one value every sub-environment has."""
            if not vec:
                return getattr(env.unwrapped, name)
            values = env.get_attr(name)
            require(all(v == values[0] for v in values), "env", type(env).__name__,
                    f"sub-environments that agree on {name} (they have {bounded_repr(sorted(set(map(str, values))))}): "
                    "one heuristic acts exactly in all of them only when it is the same")
            return values[0]

        if role == "routing":
            require(policy is not None, "policy", policy, "a router name for kvsched/Routing-v0")
            from kvsched.policies.base import POLICIES
            from kvsched.policies.routing import ROUTERS, make_router

            if policy not in ROUTERS and policy in POLICIES:
                require(False, "policy", policy,
                        f"a router name for kvsched/Routing-v0 ({', '.join(ROUTERS.names())}): the agent places "
                        f"requests; the instances run the environment's policy {attr('policy')!r} (make the "
                        f"environment with policy={POLICIES.canonical(policy)!r} to serve with it)")
            make_router(policy, dict(params or {}))  # an unknown router or bad parameters: say so now
            self._args: tuple = (policy, params)
            return
        if role == "residency":
            from .evaluate import residency_heuristic

            keep = None
            # kvsched evaluate's names: lru, lfu, clairvoyant, session, session:<s>; any case
            parsed = residency_heuristic(policy.lower()) if isinstance(policy, str) else None
            if parsed is not None:
                policy, keep = parsed
                self.policy = policy
            if params is not None:
                keeper = isinstance(policy, str) and policy.removesuffix("+prefetch") in ("session", "session-hbm")
                require(keeper and keep is None and isinstance(params, dict)
                        and set(params) == {"keep_s"}, "params", params,
                        "None, or {'keep_s': seconds} with policy 'session' or 'session-hbm' (Residency-v0; not "
                        "with 'session:<s>')")
                keep = params["keep_s"]
            self._args = (policy, keep)
            if vec:
                env.env_method("heuristic_action", policy, keep)  # every sub-env refuses what it cannot play
            else:
                env.unwrapped.heuristic_action(policy, keep)
            return
        require(params is None, "params", params, "None outside Routing-v0 and Residency-v0 (the environment's "
                "reference or heuristic brings its own parameters)")
        from kvsched.policies.base import POLICIES

        if policy is not None:  # the registered name: 'LARS' is 'lars', as for simulate
            policy = POLICIES.canonical(policy)
            self.policy = policy
        self._args = (None,)  # checked below to be the environment's own (None: whatever name it was made with)
        if role == "scheduling":
            ref = attr("reference_policy")
            ref = POLICIES.canonical(ref) if isinstance(ref, str) and ref in POLICIES else ref  # 'LARS' is 'lars'
            require(policy is None or policy == ref, "policy", policy,
                    f"the environment's reference policy {ref!r}: a heuristic acts exactly only as the reference "
                    f"(the action picks one admission on top of it, not a whole policy); make the environment "
                    f"with reference_policy={policy!r}")
        else:
            h = attr("heuristic")
            h = POLICIES.canonical(h) if isinstance(h, str) and h in POLICIES else h
            require(policy is None or policy == h, "policy", policy,
                    f"the environment's heuristic {h!r} (Knobs-v0 sets its parameters; make the environment "
                    f"with heuristic={policy!r})")

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        """SB3 signature: ``(actions, state)``; actions batched like ``observation``."""
        env = self.env
        if hasattr(env, "env_method"):  # SB3 VecEnv
            actions = np.stack([np.asarray(a) for a in env.env_method("heuristic_action", *self._args)])
            return actions, state
        return np.asarray(env.unwrapped.heuristic_action(*self._args)), state
