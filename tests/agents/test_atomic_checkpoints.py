"""kvsched train's checkpoints on a full disk: SB3's callbacks save in place, so ENOSPC part-way
left a truncated ``ppo_<n>_steps.zip`` / ``eval/best_model.zip``; kvsched's save them whole or
not at all, and a checkpoint's sidecar is written only after the checkpoint itself."""

from __future__ import annotations

import errno

import gymnasium as gym
import pytest
from stable_baselines3.common.monitor import Monitor

from kvsched.agents import trust
from kvsched.agents.callbacks import RecordedCheckpointCallback, slo_eval_callback


def _tiny_ppo():
    from stable_baselines3 import PPO

    return PPO("MlpPolicy", gym.make("CartPole-v1"), n_steps=8, batch_size=8, n_epochs=1, seed=0, device="cpu")


def _full_disk_save(model, monkeypatch):
    """``model.save`` writes half a zip to the path it is given, then fails as a full disk does."""
    real = model.save

    def save(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model, "save", save)
    return real


def test_a_periodic_checkpoint_cut_short_by_a_full_disk_leaves_no_file_and_no_sidecar(tmp_path, monkeypatch):
    model = _tiny_ppo()
    cb = RecordedCheckpointCallback(save_freq=4, save_path=str(tmp_path / "checkpoints"), name_prefix="ppo")
    model.learn(total_timesteps=8, callback=cb)  # the disk has room: checkpoints and their sidecars
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "ppo_4_steps.zip" in kept and "ppo_8_steps.zip" in kept
    trust.check(tmp_path / "checkpoints" / "ppo_8_steps.zip")
    _full_disk_save(model, monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        model.learn(total_timesteps=8, callback=cb, reset_num_timesteps=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept  # nothing partial, no temporary


def test_a_new_best_model_cut_short_by_a_full_disk_leaves_no_file_and_no_sidecar(tmp_path, monkeypatch):
    model = _tiny_ppo()
    _full_disk_save(model, monkeypatch)
    cb = slo_eval_callback(False, Monitor(gym.make("CartPole-v1")), n_eval_episodes=1, eval_freq=4,
                           log_path=str(tmp_path / "eval"), best_model_save_path=str(tmp_path / "eval"))
    with pytest.raises(OSError, match="No space left"):  # the first evaluation is a new best
        model.learn(total_timesteps=8, callback=cb)
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["evaluations.npz"]  # whole, no best_model


def test_a_new_best_model_is_saved_whole_with_its_sidecar(tmp_path):
    model = _tiny_ppo()
    cb = slo_eval_callback(False, Monitor(gym.make("CartPole-v1")), n_eval_episodes=1, eval_freq=4,
                           log_path=str(tmp_path / "eval"), best_model_save_path=str(tmp_path / "eval"))
    model.learn(total_timesteps=8, callback=cb)
    names = sorted(p.name for p in (tmp_path / "eval").iterdir())
    side = trust.sidecar(tmp_path / "eval" / "best_model.zip").name
    assert names == sorted(["best_model.zip", side, "evaluations.npz"])  # no temporary left
    trust.check(tmp_path / "eval" / "best_model.zip")
    import numpy as np

    assert len(np.load(tmp_path / "eval" / "evaluations.npz")["timesteps"]) == 2
