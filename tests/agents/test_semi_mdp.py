"""The semi-MDP discount (kvsched.agents.semi_mdp): GAE discounted by simulated time, the
environments' ``elapsed_s``, and the ``kvsched train --discount-time-s`` wiring."""

from __future__ import annotations

import json
import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from installed import lazy_module, needs

pytestmark = needs("torch", "sb3_contrib")
# imported by the tests, not while pytest collects (torch and SB3 take seconds)
th = lazy_module("torch")
buffers = lazy_module("stable_baselines3.common.buffers")
semi_mdp = lazy_module("kvsched.agents.semi_mdp")

import kvsched.envs  # noqa: E402,F401  (registers the environments)
from kvsched.agents.train import train  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

OBS = spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT = spaces.Discrete(2)


def _fill(buffer, rewards, values, starts, elapsed=None):
    """Add steps of given rewards / values / episode starts (``(steps, n_envs)``) to ``buffer``."""
    n_envs = rewards.shape[1]
    for t in range(rewards.shape[0]):
        if elapsed is not None:
            buffer.record_elapsed(elapsed[t])
        buffer.add(np.zeros((n_envs, 3), np.float32), np.zeros((n_envs, 1)), rewards[t], starts[t],
                   th.tensor(values[t]), th.zeros(n_envs))


def test_steps_lasting_one_time_unit_give_sb3s_per_step_gae():
    """With every step lasting exactly ``discount_time_s``, the semi-MDP advantages and returns are
    SB3's own (the mechanism reduces to the per-decision discount)."""
    rng = np.random.default_rng(0)
    steps, n_envs = 16, 3
    rewards, values = rng.normal(size=(steps, n_envs)), rng.normal(size=(steps, n_envs))
    starts = (rng.random((steps, n_envs)) < 0.2).astype(np.float32)
    last, dones = th.tensor(rng.normal(size=n_envs)), np.array([False, True, False])
    plain = buffers.RolloutBuffer(steps, OBS, ACT, gamma=0.9, gae_lambda=0.8, n_envs=n_envs)
    timed = semi_mdp.TimeDiscountRolloutBuffer(steps, OBS, ACT, gamma=0.9, gae_lambda=0.8, n_envs=n_envs,
                                               discount_time_s=0.25)
    _fill(plain, rewards, values, starts)
    _fill(timed, rewards, values, starts, elapsed=np.full((steps, n_envs), 0.25))
    plain.compute_returns_and_advantage(last, dones)
    timed.compute_returns_and_advantage(last, dones)
    np.testing.assert_allclose(timed.advantages, plain.advantages, rtol=1e-5, atol=1e-6)  # float32 storage
    np.testing.assert_allclose(timed.returns, plain.returns, rtol=1e-5, atol=1e-6)  # float32 storage


def test_returns_discount_each_reward_by_the_simulated_time_before_it():
    """Monte-Carlo case (lambda 1, zero values): the return of step 0 is
    r0 + g^(e0/T) r1 + g^((e0+e1)/T) r2 + g^((e0+e1+e2)/T) V(last), by hand."""
    gamma, T = 0.5, 2.0
    elapsed = np.array([[1.0], [4.0], [0.0]])
    rewards = np.array([[1.0], [2.0], [3.0]])
    buf = semi_mdp.MaskableTimeDiscountRolloutBuffer(3, OBS, ACT, gamma=gamma, gae_lambda=1.0, n_envs=1,
                                                     discount_time_s=T)
    for t in range(3):
        buf.record_elapsed(elapsed[t])
        buf.add(np.zeros((1, 3), np.float32), np.zeros((1, 1)), rewards[t], np.zeros(1), th.zeros(1), th.zeros(1),
                action_masks=np.ones((1, 2), bool))
    buf.compute_returns_and_advantage(th.tensor([10.0]), np.array([False]))
    expected0 = 1.0 + gamma ** 0.5 * 2.0 + gamma ** 2.5 * 3.0 + gamma ** 2.5 * 10.0
    expected1 = 2.0 + gamma ** 2.0 * 3.0 + gamma ** 2.0 * 10.0
    assert buf.returns[0, 0] == pytest.approx(expected0) and buf.returns[1, 0] == pytest.approx(expected1)
    assert buf.returns[2, 0] == pytest.approx(3.0 + 10.0)  # a step of 0 s does not discount


def test_a_step_without_its_elapsed_time_is_refused_not_discounted_by_default():
    buf = semi_mdp.TimeDiscountRolloutBuffer(2, OBS, ACT, n_envs=1, discount_time_s=1.0)
    _fill(buf, np.ones((2, 1)), np.zeros((2, 1)), np.zeros((2, 1)))
    with pytest.raises(RuntimeError, match="has no elapsed_s"):
        buf.compute_returns_and_advantage(th.zeros(1), np.array([False]))
    with pytest.raises(ValueError, match="elapsed_s"):
        buf.record_elapsed(np.array([-1.0]))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1"])
def test_discount_time_must_be_a_positive_number_of_seconds(bad):
    with pytest.raises(ConfigError, match="discount_time_s"):
        semi_mdp.TimeDiscountRolloutBuffer(2, OBS, ACT, n_envs=1, discount_time_s=bad)


@pytest.mark.parametrize("env_id, kwargs", [("kvsched/Scheduling-v0", {}), ("kvsched/Routing-v0", {}),
                                            ("kvsched/Knobs-v0", {"interval_s": 2.0})])
def test_environments_report_the_simulated_seconds_each_step_lasted(env_id, kwargs):
    """``info["elapsed_s"]`` >= 0 on every step and, summed over an episode, the simulated time
    from the first decision to the end."""
    env = gym.make(env_id, window_s=10.0, **kwargs)
    _, info = env.reset(seed=3)
    start, total, done = info["time_s"], 0.0, False
    while not done:
        _, _, terminated, truncated, info = env.step(env.action_space.sample() * 0)
        assert info["elapsed_s"] >= 0.0
        total += info["elapsed_s"]
        done = terminated or truncated
    assert total == pytest.approx(info["time_s"] - start)
    env.close()


def test_train_with_discount_time_fills_the_elapsed_times_and_records_the_setting(tmp_path):
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 32, tmp_path, window_s=10.0, n_envs=2,
                 hyperparameters={"n_steps": 16, "batch_size": 16, "n_epochs": 1}, eval_episodes=1,
                 progress_bar=False, discount_time_s=0.5)
    assert meta["status"] == "finished" and meta["discount_time_s"] == 0.5
    assert json.loads((tmp_path / "train.json").read_text())["discount_time_s"] == 0.5
    from sb3_contrib import MaskablePPO

    model = MaskablePPO.load(str(tmp_path / "final.zip"), device="cpu")
    assert model.rollout_buffer_class is semi_mdp.MaskableTimeDiscountRolloutBuffer  # a resume keeps it
    assert model.rollout_buffer_kwargs == {"discount_time_s": 0.5}


@pytest.mark.parametrize("algo, env_kwargs, match", [
    ("dqn", {}, "ppo or maskable_ppo"),
    ("maskable_ppo", {"reward": {"shaping": 1.0}}, "shaping"),
])
def test_discount_time_is_refused_where_it_has_no_meaning(tmp_path, algo, env_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        train("kvsched/Scheduling-v0", algo, 32, tmp_path, window_s=10.0, env_kwargs=env_kwargs,
              progress_bar=False, discount_time_s=1.0)


def test_a_resume_keeps_its_reward_and_refuses_shaping_with_the_kept_discount(tmp_path):
    """The checkpoint keeps the discount; SB3 checkpoints do not keep the environment's reward, so
    a resume naming another reward than the run's train.json is refused, and so is shaping under
    a discount the checkpoint brought back."""
    hp = {"n_steps": 16, "batch_size": 16, "n_epochs": 1}
    first = tmp_path / "first"
    train("kvsched/Scheduling-v0", "maskable_ppo", 16, first, window_s=10.0, n_envs=1, hyperparameters=hp,
          eval_episodes=1, progress_bar=False, discount_time_s=0.5, env_kwargs={"reward": {"graded": True}})
    with pytest.raises(ConfigError, match="trained with reward"):
        train("kvsched/Scheduling-v0", "maskable_ppo", 16, tmp_path / "second", window_s=10.0, n_envs=1,
              eval_episodes=1, progress_bar=False, resume=first / "final.zip")
    with pytest.raises(ConfigError, match="shaping"):
        train("kvsched/Scheduling-v0", "maskable_ppo", 16, tmp_path / "third", window_s=10.0, n_envs=1,
              eval_episodes=1, progress_bar=False, resume=first / "final.zip",
              env_kwargs={"reward": {"graded": True, "shaping": 1.0}})
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 16, tmp_path / "fourth", window_s=10.0, n_envs=1,
                 eval_episodes=1, progress_bar=False, resume=first / "final.zip",
                 env_kwargs={"reward": {"graded": True}})
    assert meta["discount_time_s"] == 0.5


@pytest.mark.parametrize("env_id", ["kvsched/Routing-v0", "kvsched/Knobs-v0"])
def test_shaping_is_refused_where_it_is_not_implemented(env_id):
    with pytest.raises(ConfigError, match="shaping"):
        gym.make(env_id, window_s=10.0, reward={"shaping": 1.0})
