"""Training with Ray RLlib (PPO, new API stack) on the kvsched environments, past one machine.

Optional: needs the ``ray`` extra (``pip install -e '.[ray]'`` in the checkout, Ray 2.60 with RLlib); the
default install never imports Ray.

- :func:`env_creator` builds any kvsched environment from one ``env_config`` dict
  (``{"env_id": ..., **environment keyword arguments}``); :func:`register_envs` registers
  every id with ``ray.tune.register_env`` under its Gymnasium id, so RLlib's EnvRunners (on
  any node) build them by name.
- ``kvsched/Scheduling-v0`` trains with its action mask honoured, by RLlib's action-masking
  RLModule pattern: the env is wrapped (:class:`MaskedObservation`) so its observation is
  ``Dict(observations=Box, action_mask=Box{0,1})`` and the policy is RLlib's
  ``ActionMaskingTorchRLModule`` (``ray.rllib.examples.rl_modules.classes.action_masking_rlm``),
  which sets the logits of masked actions to the float minimum before sampling. That module
  takes a ``Discrete`` action space, so the RLlib path uses the env's ``action_mode="slot"``
  (which request gets residency next; chunk size, victim and preemption mode stay the
  reference policy's). ``kvsched/Knobs-v0`` (Box) and ``kvsched/Routing-v0`` (Discrete) use
  the default PPO module.
- :func:`train_rllib` runs PPO for a number of environment steps with ``num_env_runners``
  sampling workers (``address`` joins a running Ray cluster), checkpoints
  (``Algorithm.save_to_path``; ``resume`` restores one), and writes the learning curve and
  ``train.json`` (``backend: "rllib"``) like the Stable-Baselines3 path, so ``kvsched
  evaluate`` loads the result (:class:`RLlibAgent`, SB3's ``predict`` signature) on the same
  held-out windows.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from kvsched import atomic_files

#: environments RLlib trains on, and the keyword arguments the RLlib path forces
RLLIB_ENVS = ("kvsched/Scheduling-v0", "kvsched/Routing-v0", "kvsched/Knobs-v0")
MODULE_PATH = ("learner_group", "learner", "rl_module", "default_policy")


def _ray():
    try:
        import ray  # noqa: F401
        from ray.rllib.algorithms.ppo import PPOConfig  # noqa: F401
    except ImportError:
        raise ConfigError("--backend rllib needs Ray RLlib: pip install -e '.[ray]' in the kvsched checkout (the "
                          "default install is Ray-free)") from None
    import ray

    return ray


def _masked_wrapper_cls():
    import gymnasium as gym
    from gymnasium import spaces

    class MaskedObservation(gym.ObservationWrapper):
        """``Dict(observations=<env obs>, action_mask=<env.action_masks()> as float32 0/1)`` -- the
        observation layout of RLlib's action-masking RLModule."""

        def __init__(self, env) -> None:
            super().__init__(env)
            if not isinstance(env.action_space, spaces.Discrete):
                raise ConfigError(f"the RLlib action-masking module needs a Discrete action space; got "
                                  f"{env.action_space} (use action_mode='slot' on Scheduling-v0)")
            n = int(env.action_space.n)
            self.observation_space = spaces.Dict({
                "observations": env.observation_space,
                "action_mask": spaces.Box(0.0, 1.0, (n,), np.float32),
            })

        def observation(self, observation):
            mask = np.asarray(self.env.unwrapped.action_masks(), dtype=np.float32)
            return {"observations": observation, "action_mask": mask}

    return MaskedObservation


def MaskedObservation(env):
    """Wrap ``env`` (Discrete actions, ``action_masks()``) for RLlib's action-masking module."""
    return _masked_wrapper_cls()(env)


def rllib_env_kwargs(env_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Environment keyword arguments on the RLlib path (Scheduling-v0: ``action_mode="slot"``).

    Raises:
        ConfigError: an unknown env id, or a Scheduling-v0 ``action_mode`` other than slot.
    """
    if env_id not in RLLIB_ENVS:
        raise ConfigError(f"--env {bounded_repr(env_id)}: RLlib trains on {list(RLLIB_ENVS)}")
    kw = dict(kwargs)
    if env_id in SCHEDULING_IDS:
        if kw.get("action_mode", "slot") != "slot":
            raise ConfigError("RLlib's action-masking module needs Discrete actions: Scheduling-v0 runs with "
                              f"action_mode='slot' on the RLlib path, not {bounded_repr(kw['action_mode'])}")
        kw["action_mode"] = "slot"
    return kw


def env_creator(env_config: dict[str, Any]):
    """Build a kvsched environment from ``{"env_id": ID, **keyword arguments}`` (RLlib's
    ``env_config``; an RLlib ``EnvContext`` works too). Scheduling-v0 comes wrapped in
    :class:`MaskedObservation`.

    Raises:
        ConfigError: missing or unknown ``env_id``.
    """
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the Gymnasium ids)

    cfg = dict(env_config)
    env_id = cfg.pop("env_id", None)
    if env_id is None:
        raise ConfigError(f"env_config needs 'env_id' (one of {list(RLLIB_ENVS)}); got keys {sorted(cfg)}")
    kw = rllib_env_kwargs(env_id, cfg)
    env = gym.make(env_id, **kw)
    if env_id in SCHEDULING_IDS:
        env = MaskedObservation(env)
    return env


def register_envs() -> None:
    """``ray.tune.register_env`` for every kvsched id (RLlib builds them by that name)."""
    _ray()
    from ray.tune.registry import register_env

    for env_id in RLLIB_ENVS:
        register_env(env_id, lambda cfg, _id=env_id: env_creator({**dict(cfg), "env_id": _id}))


def ppo_config(env_id: str, env_kwargs: dict[str, Any], seed: int = 0, num_env_runners: int = 0,
               hyperparameters: dict[str, Any] | None = None):
    """The :class:`ray.rllib.algorithms.ppo.PPOConfig` kvsched trains with (new API stack).

    Defaults: 1,024 env steps per training batch, minibatch 256, 5 epochs, lr 3e-4, gamma
    0.99, lambda 0.95, entropy 0.01 -- the same as the Stable-Baselines3 PPO defaults of
    :func:`kvsched.agents.train.default_hyperparameters`; two 64-unit hidden layers.
    """
    _ray()
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    hp = {"train_batch_size_per_learner": 1024, "minibatch_size": 256, "num_epochs": 5, "lr": 3e-4,
          "gamma": 0.99, "lambda_": 0.95, "entropy_coeff": 0.01}
    hp.update(hyperparameters or {})
    cfg = (PPOConfig()
           .environment(env=env_id, env_config=dict(env_kwargs))
           .env_runners(num_env_runners=num_env_runners, num_envs_per_env_runner=1,
                        num_cpus_per_env_runner=1)
           .learners(num_learners=0)
           .training(**hp)
           .debugging(seed=seed)
           .reporting(metrics_num_episodes_for_smoothing=20))
    model_config = {"fcnet_hiddens": [64, 64], "head_fcnet_hiddens": [64, 64]}
    if env_id in SCHEDULING_IDS:
        from ray.rllib.examples.rl_modules.classes.action_masking_rlm import ActionMaskingTorchRLModule

        cfg = cfg.rl_module(rl_module_spec=RLModuleSpec(module_class=ActionMaskingTorchRLModule,
                                                        model_config=model_config))
    else:
        cfg = cfg.rl_module(model_config=model_config)
    return cfg


def train_rllib(env_id: str, timesteps: int, out: str | Path, scenario: str | None = None,
                window_s: float | None = None, env_kwargs: dict | None = None, seed: int = 0,
                num_env_runners: int = 0, address: str | None = None, resume: str | Path | None = None,
                hyperparameters: dict | None = None, progress: Any = None,
                trust_checkpoint: bool = False) -> dict[str, Any]:
    """Train PPO with RLlib until ``timesteps`` environment steps were sampled over the
    algorithm's lifetime (with ``resume``: including the restored run's); returns ``train.json``.

    Writes into ``out``: ``checkpoint/`` (``Algorithm.save_to_path``; the policy module under
    ``checkpoint/learner_group/learner/rl_module/default_policy``), ``learning_curve.csv`` and
    ``.png`` (per training iteration: env steps sampled, mean episode return, wall s) and
    ``train.json``.

    Args:
        num_env_runners: sampling workers (0: sample in the driver).
        address: a running Ray cluster (``HOST:PORT``/``auto``); ``None`` starts a local Ray.
        resume: a ``checkpoint/`` folder to continue from.
        progress: optional ``progress(steps_sampled, timesteps)``.

    Raises:
        ConfigError: Ray missing, an unknown env id, bad counts, an ``address`` at which no Ray
            cluster answers (:func:`kvsched.runner.ray_connect.check_reachable`).
    """
    ray = _ray()
    for name, v in (("timesteps", timesteps),):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name}={bounded_repr(v)} is not allowed: expected an integer >= 1")
    if isinstance(num_env_runners, bool) or not isinstance(num_env_runners, int) or num_env_runners < 0:
        raise ConfigError(f"--num-env-runners={bounded_repr(num_env_runners)} is not allowed: expected an integer >= 0")
    kw = dict(env_kwargs or {})
    if scenario is not None:
        kw["scenario"] = str(scenario)
    if window_s is not None:
        kw["window_s"] = float(window_s)
    kw = rllib_env_kwargs(env_id, kw)
    if resume is not None:  # restoring unpickles: only what kvsched wrote, unless trusted
        from . import trust

        trust.check(resume, trust_checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from kvsched.runner.ray_connect import init_ray

    started_here = init_ray(ray, address)
    try:
        register_envs()
        algo = ppo_config(env_id, {**kw, "split": "train"}, seed, num_env_runners, hyperparameters).build_algo()
        if resume is not None:
            algo.restore_from_path(str(Path(resume).resolve()))
        curve = []
        t0 = time.time()
        steps = 0
        while steps < timesteps:
            r = algo.train()
            steps = int(r.get("num_env_steps_sampled_lifetime", r.get("env_runners", {}).get(
                "num_env_steps_sampled_lifetime", 0)))
            ret = r.get("env_runners", {}).get("episode_return_mean", math.nan)
            curve.append({"iteration": len(curve) + 1, "env_steps": steps,
                          "episode_return_mean": float(ret) if ret is not None else math.nan,
                          "wall_s": time.time() - t0})
            if progress is not None:
                progress(min(steps, timesteps), timesteps)
        wall = time.time() - t0
        ckpt = out / "checkpoint"
        algo.save_to_path(str(ckpt.resolve()))
        from . import trust

        trust.record(ckpt)  # RLlib's checkpoint pickles too: loaded without --trust-checkpoint only with this
        algo.stop()
    finally:
        if started_here:
            ray.shutdown()
    import pandas as pd

    with atomic_files.replacing(out / "learning_curve.csv") as tmp:
        pd.DataFrame(curve).to_csv(tmp, index=False)
    _plot_curve(curve, out / "learning_curve.png", env_id)
    meta = {
        "command": " ".join(["kvsched", *sys.argv[1:]]) if sys.argv and "kvsched" in sys.argv[0] else None,
        "backend": "rllib", "env_id": env_id, "algo": "ppo", "env_kwargs": kw, "seed": seed,
        "num_env_runners": num_env_runners, "address": address,
        "resumed_from": None if resume is None else str(resume), "timesteps": steps,
        "iterations": len(curve), "wall_s": wall, "env_steps_per_s": steps / wall if wall > 0 else None,
        "checkpoint": str(ckpt), "learning_curve": curve,
    }
    atomic_files.write_text(out / "train.json", json.dumps(meta, indent=2, default=str))
    return meta


def _plot_curve(curve: list[dict], path: Path, env_id: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([c["env_steps"] for c in curve], [c["episode_return_mean"] for c in curve], marker=".")
    ax.set_xlabel("environment steps sampled")
    ax.set_ylabel("mean episode return (last 20)")
    ax.set_title(f"RLlib PPO on {env_id}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


class RLlibAgent:
    """An RLlib-trained policy with Stable-Baselines3's ``predict`` signature.

    Args:
        checkpoint: the ``checkpoint/`` folder :func:`train_rllib` wrote (or the module
            folder inside it).
        masked: the policy takes ``Dict(observations, action_mask)`` (Scheduling-v0).
    """

    def __init__(self, checkpoint: str | Path, masked: bool) -> None:
        _ray()
        from ray.rllib.core.rl_module.rl_module import RLModule

        path = Path(checkpoint)
        if path.joinpath(*MODULE_PATH).exists():  # the algorithm checkpoint: its policy module inside
            path = path.joinpath(*MODULE_PATH)
        if not (path / "module_state.pkl").exists() and not (path / "module_state").exists():
            raise ConfigError(f"{bounded_repr(str(checkpoint), MAX_PATH_CHARS)}"
                              f": no RLlib policy module (expected {'/'.join(MODULE_PATH)} inside)")
        self.module = RLModule.from_checkpoint(str(path.resolve()))
        self.masked = masked

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True,
                action_masks: np.ndarray | None = None):
        """``(action, state)`` for one observation (argmax of the masked logits when
        ``deterministic``, else a sample)."""
        import torch

        obs = np.asarray(observation, dtype=np.float32)[None]
        if self.masked:
            if action_masks is None:
                raise ConfigError("this RLlib policy needs action_masks (Scheduling-v0)")
            batch = {"obs": {"observations": torch.from_numpy(obs),
                             "action_mask": torch.from_numpy(np.asarray(action_masks, np.float32)[None])}}
        else:
            batch = {"obs": torch.from_numpy(obs)}
        with torch.no_grad():
            out = self.module.forward_inference(batch)
        logits = out["action_dist_inputs"]
        dist_cls = self.module.get_inference_action_dist_cls()
        dist = dist_cls.from_logits(logits)
        if deterministic:
            dist = dist.to_deterministic()
        action = dist.sample()[0].numpy()
        return action, state
