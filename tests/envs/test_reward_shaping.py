"""Potential-based reward shaping on Scheduling-v0 (envs/reward.py): over an episode its
discounted sum is -Phi(s_0), the same for every policy, so it changes no policy's ranking; it is
off by default, and the reward config can be given as a mapping (--env-kwargs JSON)."""

from __future__ import annotations

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

import kvsched.envs  # noqa: E402,F401
from kvsched.envs.reward import RewardConfig  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

OPTIONS = {"workload_seed": 2**20, "window_index": 0}


def returns(action, reward, gamma: float) -> tuple[float, float, float, float]:
    """(discounted return, discounted shaping sum, -Phi(s_0), undiscounted shaping sum) of a
    constant action on one window."""
    env = gym.make("kvsched/Scheduling-v0", scenario="mixed-long-short", window_s=20.0, split="heldout",
                   horizon_s=float("inf"), reward=reward)
    env.reset(options=OPTIONS)
    phi0 = env.unwrapped._potential
    total = shaped = plain = 0.0
    t = 0
    while True:
        _, r, terminated, truncated, info = env.step(np.asarray(action))
        s = info["reward_components"].get("shaping", 0.0)
        total += gamma ** t * r
        shaped += gamma ** t * s
        plain += s
        t += 1
        if terminated or truncated:
            return total, shaped, -phi0, plain


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_the_shaping_terms_sum_to_minus_the_initial_potential_for_every_policy(gamma):
    reward = RewardConfig(shaping=1.0, shaping_gamma=gamma)
    sums = []
    for action in ([0, 0, 0, 0], [0, 6, 0, 0], [0, 1, 3, 0]):  # the reference, no chunk cap, another cap
        _, shaped, minus_phi0, plain = returns(action, reward, gamma)
        assert shaped == pytest.approx(minus_phi0, abs=1e-9)
        assert plain != 0.0 or minus_phi0 == 0.0
        sums.append(shaped)
    assert sums[0] == pytest.approx(sums[1], abs=1e-9) == pytest.approx(sums[2], abs=1e-9)


def test_shaping_is_off_by_default_and_leaves_the_reward_unchanged():
    plain, _, _, _ = returns([0, 0, 0, 0], RewardConfig(), 1.0)
    shaped_off, _, _, _ = returns([0, 0, 0, 0], {"shaping": 0.0}, 1.0)
    assert plain == shaped_off


def test_the_shaping_potential_is_nonzero_somewhere_so_the_test_above_can_fail():
    env = gym.make("kvsched/Scheduling-v0", scenario="mixed-long-short", window_s=20.0, split="heldout",
                   horizon_s=float("inf"), reward={"shaping": 1.0})
    env.reset(options=OPTIONS)
    seen = []
    while True:
        _, _, terminated, truncated, info = env.step(np.asarray([0, 0, 0, 0]))
        seen.append(info["reward_components"]["shaping"])
        if terminated or truncated:
            break
    assert any(abs(x) > 1e-6 for x in seen)


@pytest.mark.parametrize("reward, says", [
    ({"shapng": 1.0}, "reward: \\['shapng'\\] not allowed: expected keys of"),
    ({"shaping": -1.0}, "RewardConfig.shaping=-1.0 is not allowed"),
    ({"shaping_gamma": 0.0}, "RewardConfig.shaping_gamma=0.0 is not allowed"),
    ("shaping", "reward='shaping' is not allowed: expected a RewardConfig or a mapping"),
])
def test_bad_reward_configs_are_refused_naming_the_field(reward, says):
    with pytest.raises(ConfigError, match=says):
        gym.make("kvsched/Scheduling-v0", window_s=10.0, reward=reward)


def _missed_curve(tmp_path, early: bool) -> list[float]:
    sc = tmp_path / "tight-tpot.yaml"
    sc.write_text("name: tight-tpot\nsynthetic: {rate_per_s: 6.0, duration_s: 40, prompt_median_tokens: 512, "
                  "output_median_tokens: 200, output_max_tokens: 400}\ninstance: {model: Llama-3.1-8B, gpu: H100-SXM}\n"
                  "metrics: {slos: {short: {ttft_s: 5.0, tpot_s: 0.005}, long: {ttft_s: 10.0, tpot_s: 0.005}}}\n"
                  "seed: 0\n")
    env = gym.make("kvsched/Scheduling-v0", scenario=str(sc), window_s=20.0, split="train",
                   horizon_s=float("inf"), reward={"early_miss": early})
    env.reset(seed=0)
    curve, total = [], 0.0
    while True:
        _, _, terminated, truncated, info = env.step(np.asarray([0, 6, 0, 0]))  # no chunk cap: long steps
        total += info["reward_components"]["slo_missed"]
        curve.append(total)
        if terminated or truncated:
            return curve


def test_a_tpot_miss_is_charged_once_certain_not_at_finish_and_the_sum_is_unchanged(tmp_path):
    """With early charging a TPOT miss is charged at the first decision after it became certain
    (elapsed decode time > tpot_s x (output tokens - 1)); the episode's sum is the same as when
    every miss is charged at its record, and the charge is never later."""
    early, late = _missed_curve(tmp_path, True), _missed_curve(tmp_path, False)
    assert len(early) == len(late) and early[-1] == late[-1] < 0
    assert all(e <= l for e, l in zip(early, late))
    assert any(e < l for e, l in zip(early, late))
