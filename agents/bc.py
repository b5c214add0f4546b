"""Behaviour cloning from a Minari dataset into a Stable-Baselines3 policy.

:func:`behaviour_clone` fits the policy network of a fresh ``MaskablePPO`` (or ``PPO``) model to
the dataset's (observation, action) pairs by maximum likelihood -- the negative log-probability
of the recorded action under the policy's distribution, with the recorded action mask for
``MaskablePPO`` -- with Adam, and returns the model: a baseline in its own right (kvsched bench's
behaviour clone of the tuned heuristic) and a warm start for fine-tuning with RL
(``model.learn`` continues from it). Deterministic for a seed (torch and the batch order seeded;
one thread).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched import atomic_files


def dataset_arrays(dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(observations, actions, masks)`` of every step of a Minari dataset (the observation each
    action was taken on; masks None when the dataset has none)."""
    obs, acts, masks = [], [], []
    for ep in dataset.iterate_episodes():
        n = len(ep.actions)
        obs.append(np.asarray(ep.observations)[:n])
        acts.append(np.asarray(ep.actions)[:n])
        m = (ep.infos or {}).get("action_mask")
        masks.append(None if m is None else np.asarray(m)[:n])
    if not obs:
        raise ConfigError("the dataset holds no episode")
    mask = None if any(m is None for m in masks) else np.concatenate(masks).astype(bool)
    return np.concatenate(obs).astype(np.float32), np.concatenate(acts), mask


def behaviour_clone(dataset, env, algo: str = "maskable_ppo", epochs: int = 5, batch_size: int = 256,
                    learning_rate: float = 1e-3, seed: int = 0, policy_kwargs: dict | None = None):
    """A model whose policy imitates ``dataset`` (a ``MinariDataset`` or a dataset id) in ``env``.

    Args:
        dataset: the demonstrations.
        env: an environment with the dataset's observation and action spaces (the model is built on it).
        algo: ``"maskable_ppo"`` (uses the recorded masks) or ``"ppo"``.
        epochs, batch_size, learning_rate: the supervised fit.
        seed: seeds torch, the model and the batch order.
        policy_kwargs: the model's ``policy_kwargs`` (network sizes, features extractor).

    Raises:
        ConfigError: an unknown algorithm, counts < 1, or spaces that do not match.
    """
    import torch

    if algo not in ("maskable_ppo", "ppo"):
        raise ConfigError(f"algo={bounded_repr(algo)} is not allowed: expected 'maskable_ppo' or 'ppo'")
    for name, v in (("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={bounded_repr(v)} is not allowed: expected an integer >= 1")
    if isinstance(dataset, str):
        import minari

        dataset = minari.load_dataset(dataset)
    obs, acts, masks = dataset_arrays(dataset)
    if obs.shape[1:] != env.observation_space.shape:
        raise ConfigError(f"dataset observations have shape {obs.shape[1:]}; the environment's are "
                          f"{env.observation_space.shape}")
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    if algo == "maskable_ppo":
        from sb3_contrib import MaskablePPO as Algo
    else:
        from stable_baselines3 import PPO as Algo
    model = Algo("MlpPolicy", env, seed=seed, device="cpu", policy_kwargs=policy_kwargs or None, verbose=0)
    fit_policy(model.policy, (obs, acts, masks if algo == "maskable_ppo" else None), epochs=epochs,
               batch_size=batch_size, learning_rate=learning_rate, seed=seed)
    return model


def fit_policy(policy, arrays: tuple[np.ndarray, np.ndarray, np.ndarray | None], epochs: int = 5,
               batch_size: int = 256, learning_rate: float = 1e-3, seed: int = 0) -> float:
    """Fit an SB3 policy (in place) to ``(observations, actions, masks)`` (:func:`dataset_arrays`;
    masks None: unmasked) by the negative log-likelihood of the recorded actions, with Adam (batch
    order seeded by ``seed``; torch's own seed is the caller's); returns the last epoch's mean loss.
    Used by :func:`behaviour_clone` and by ``kvsched train
    --bc-dataset`` (a warm start before RL).

    Raises:
        ConfigError: observations of another shape than the policy's observation space.
    """
    import torch

    obs, acts, masks = arrays
    if obs.shape[1:] != policy.observation_space.shape:
        raise ConfigError(f"dataset observations have shape {obs.shape[1:]}; the policy's are "
                          f"{policy.observation_space.shape}")
    opt = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    rng = np.random.default_rng(seed)
    obs_t, act_t = torch.as_tensor(obs), torch.as_tensor(acts)
    mask_t = None if masks is None else torch.as_tensor(masks)
    policy.set_training_mode(True)
    last = float("nan")
    for _ in range(epochs):
        order = rng.permutation(len(obs))
        losses = []
        for lo in range(0, len(order), batch_size):
            idx = torch.as_tensor(order[lo:lo + batch_size])
            if mask_t is not None:
                _, logp, _ = policy.evaluate_actions(obs_t[idx], act_t[idx], action_masks=mask_t[idx])
            else:
                _, logp, _ = policy.evaluate_actions(obs_t[idx], act_t[idx])
            loss = -logp.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        last = float(np.mean(losses))
    policy.set_training_mode(False)
    return last


def save_clone(model, path: Path, env_id: str, env_kwargs: dict[str, Any], dataset_id: str, **extra) -> None:
    """Save a cloned model as ``path`` (``.zip``) with ``kvsched train``-style metadata beside it
    (``<stem>.json``: environment, algorithm, arguments), so ``kvsched evaluate`` / ``leaderboard``
    load it like any checkpoint."""
    path = Path(path)
    if path.suffix != ".zip":  # as SB3's save: it appends .zip to any other name
        path = path.with_name(path.name + ".zip")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_files.replacing(path) as tmp:
        model.save(str(tmp))
    from . import trust

    trust.record(path)
    algo = "maskable_ppo" if type(model).__name__ == "MaskablePPO" else "ppo"
    meta = {"env_id": env_id, "algo": algo, "env_kwargs": env_kwargs,
            "behaviour_clone": {"dataset": dataset_id, **extra}}
    atomic_files.write_text(path.with_suffix(".json"), json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
