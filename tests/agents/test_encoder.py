"""The candidate-set encoder (agents/encoder.py): the slot distribution permutes with the
candidate rows, everything else is unchanged by their order, no weight depends on K, and
``kvsched train --policy-net candidate-set`` trains a checkpoint that loads and acts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gymnasium import spaces

from installed import lazy_module, needs

pytestmark = needs("torch", "sb3_contrib")
# imported by the tests, not while pytest collects (torch and SB3 take seconds)
th = lazy_module("torch")
enc = lazy_module("kvsched.agents.encoder")
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

INSTANCE = 10


def policy(k: int, cls: str = "CandidateSetMaskablePolicy"):
    cls = getattr(enc, cls)
    obs = spaces.Box(-1.0, 1.0, (k * enc.ROW + INSTANCE,), np.float32)
    act = spaces.MultiDiscrete([k, 7, 5, 4])
    th.manual_seed(0)
    return cls(obs, act, lambda _: 3e-4)


def observation(k: int, valid: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.uniform(0, 1, (k, enc.ROW)).astype(np.float32)
    rows[:, 0] = 0.0
    rows[:valid, 0] = 1.0
    rows[valid:] = 0.0  # padding rows are zeros, as the environment writes them
    return np.concatenate([rows.ravel(), rng.uniform(0, 1, INSTANCE).astype(np.float32)])


def heads(p, obs: np.ndarray):
    with th.no_grad():
        t = th.as_tensor(obs[None])
        features = p.extract_features(t)
        return p.action_net(features)[0].numpy(), p.value_net(features)[0].numpy()


@pytest.mark.parametrize("cls", ["CandidateSetMaskablePolicy", "CandidateSetPolicy"])
def test_slot_logits_permute_with_the_rows_and_the_rest_is_unchanged(cls):
    k = 16
    p = policy(k, cls)
    obs = observation(k, valid=11)
    perm = np.random.default_rng(1).permutation(k)
    shuffled = np.concatenate([obs[:k * enc.ROW].reshape(k, enc.ROW)[perm].ravel(), obs[k * enc.ROW:]])
    (logits, value), (logits2, value2) = heads(p, obs), heads(p, shuffled)
    np.testing.assert_allclose(logits2[:k], logits[:k][perm], atol=1e-5)
    np.testing.assert_allclose(logits2[k:], logits[k:], atol=1e-5)
    np.testing.assert_allclose(value2, value, atol=1e-5)
    assert not np.allclose(logits[:11], logits[0])  # rows are told apart (the test can fail)


def test_no_weight_depends_on_k_so_one_policy_serves_another_k():
    small, big = policy(8), policy(32)
    assert {n: v.shape for n, v in small.state_dict().items()} == {n: v.shape for n, v in big.state_dict().items()}
    small.load_state_dict(big.state_dict())
    obs8, obs32 = observation(8, 5), np.zeros(32 * enc.ROW + INSTANCE, np.float32)
    obs32[:8 * enc.ROW], obs32[32 * enc.ROW:] = obs8[:8 * enc.ROW], obs8[8 * enc.ROW:]
    (l8, v8), (l32, v32) = heads(small, obs8), heads(big, obs32)
    np.testing.assert_allclose(l8[:5], l32[:5], atol=1e-5)  # the same candidates, the same scores
    np.testing.assert_allclose(l8[8:], l32[32:], atol=1e-5)
    np.testing.assert_allclose(v8, v32, atol=1e-5)


def test_no_valid_row_gives_finite_outputs():
    logits, value = heads(policy(4), observation(4, valid=0))
    assert np.isfinite(logits).all() and np.isfinite(value).all()


def test_an_observation_or_action_that_is_not_scheduling_v0s_is_refused():
    with pytest.raises(ConfigError, match="K x 9 \\+ 10 values"):
        enc.rows_of(spaces.Box(0, 1, (7,), np.float32))
    obs = spaces.Box(-1.0, 1.0, (4 * enc.ROW + INSTANCE,), np.float32)
    with pytest.raises(ConfigError, match="first part picks one of the 4 candidate rows"):
        enc.CandidateSetPolicy(obs, spaces.Discrete(3), lambda _: 3e-4)


def test_train_with_the_candidate_set_policy_saves_a_checkpoint_that_loads_and_acts(tmp_path):
    import gymnasium as gym
    from sb3_contrib import MaskablePPO

    import kvsched.envs  # noqa: F401
    from kvsched.agents.train import train

    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 32, tmp_path, window_s=10.0, progress_bar=False,
                 hyperparameters={"n_steps": 16, "batch_size": 16, "n_epochs": 1}, policy_net="candidate-set")
    assert meta["policy_net"] == "candidate-set"
    assert json.loads((tmp_path / "train.json").read_text())["policy_net"] == "candidate-set"
    model = MaskablePPO.load(str(tmp_path / "final.zip"), device="cpu")
    assert type(model.policy).__name__ == "CandidateSetMaskablePolicy"
    env = gym.make("kvsched/Scheduling-v0", window_s=10.0)
    obs, info = env.reset(seed=0)
    action, _ = model.predict(obs, action_masks=info["action_mask"], deterministic=True)
    assert env.action_space.contains(action)


def test_the_candidate_set_policy_is_refused_where_it_cannot_act(tmp_path):
    from kvsched.agents.train import train

    with pytest.raises(ConfigError, match="--policy-net candidate-set is for --algo ppo or maskable_ppo"):
        train("kvsched/Routing-v0", "ppo", 8, tmp_path, policy_net="candidate-set", progress_bar=False)
    with pytest.raises(ConfigError, match="--policy-net 'deepsets' is not allowed"):
        train("kvsched/Scheduling-v0", "ppo", 8, tmp_path, policy_net="deepsets", progress_bar=False)


@pytest.mark.parametrize("net", ["mlp", "candidate-set"])
def test_a_reference_bias_starts_the_policy_at_action_0_the_reference(tmp_path, net):
    """Uniform exploration around a strong reference scores below it; with the bias the initial
    policy plays the reference's action (0 in every part) with high probability."""
    import gymnasium as gym
    from sb3_contrib import MaskablePPO

    import kvsched.envs  # noqa: F401
    from kvsched.agents.train import _policy
    from kvsched.agents.warm_start import reference_bias

    env = gym.make("kvsched/Scheduling-v0", window_s=10.0)
    obs, info = env.reset(seed=0)
    model = MaskablePPO(_policy("maskable_ppo", net), env, seed=0, device="cpu")

    def p0():
        with th.no_grad():
            dist = model.policy.get_distribution(model.policy.obs_to_tensor(obs)[0], action_masks=info["action_mask"])
        return [float(d.probs[0, 0]) for d in dist.distributions]

    before = p0()
    reference_bias(model.policy, 5.0)
    after = p0()
    assert before[1] < 0.3 and before[2] < 0.3 and min(after) > 0.9, (before, after)  # chunk (7), victim (5)
    assert list(model.predict(obs, action_masks=info["action_mask"], deterministic=True)[0]) == [0, 0, 0, 0]


def test_a_reference_bias_is_refused_where_action_0_is_no_reference(tmp_path):
    from kvsched.agents.train import train
    from kvsched.agents.warm_start import reference_bias

    with pytest.raises(ConfigError, match="--reference-bias is for --algo ppo or maskable_ppo on kvsched/Scheduling"):
        train("kvsched/Routing-v0", "ppo", 8, tmp_path, reference_bias=5.0, progress_bar=False)
    with pytest.raises(ConfigError, match="expected a finite number >= 0"):
        reference_bias(policy(4), float("nan"))
