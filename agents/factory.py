"""Environments for training and evaluation: seeded, vectorised (SB3 ``DummyVecEnv`` or
``SubprocVecEnv``), each sub-environment ``i`` seeded with ``seed + i``."""

from __future__ import annotations

from typing import Any


def make_env_fn(env_id: str, env_kwargs: dict[str, Any], rank: int, seed: int, monitor_dir: str | None = None):
    """A picklable thunk building sub-environment ``rank`` (wrapped in SB3's ``Monitor``)."""

    def _init():
        import gymnasium as gym
        from stable_baselines3.common.monitor import Monitor

        import kvsched.envs  # noqa: F401  (registers the ids)

        env = gym.make(env_id, **env_kwargs)
        env = Monitor(env, None if monitor_dir is None else f"{monitor_dir}/{rank}",
                      info_keywords=())
        env.reset(seed=seed + rank)
        env.action_space.seed(seed + rank)
        return env

    return _init


class _FreshInfos(list):
    """The ``DummyVecEnv`` info buffer, copied shallowly where SB3 deep-copies it every step.

    SB3 deep-copies the list of info dicts so the caller's copy cannot alias a dict the vector
    environment reuses. Gymnasium environments (kvsched's and the ones this module builds)
    return a new info dict at every step and reset, and ``DummyVecEnv`` only adds keys to that
    new dict, so a new list of the same dicts is already unaliased. The deep copy was ~5 % of
    training CPU on Scheduling-v0 (27 objects per step: mask, window, reward components)."""

    def __deepcopy__(self, memo) -> list:
        return list(self)


def make_vec_env(env_id: str, env_kwargs: dict[str, Any] | None = None, n_envs: int = 1, seed: int = 0,
                 subprocess: bool = False, monitor_dir: str | None = None):
    """``n_envs`` copies of ``env_id`` in a ``DummyVecEnv`` (or ``SubprocVecEnv``)."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    fns = [make_env_fn(env_id, dict(env_kwargs or {}), i, seed, monitor_dir) for i in range(n_envs)]
    if subprocess and n_envs > 1:
        vec = SubprocVecEnv(fns, start_method="spawn")
    else:
        vec = DummyVecEnv(fns)
        vec.buf_infos = _FreshInfos(vec.buf_infos)
    vec.seed(seed)
    return vec
