"""The batched masked sampler draws from exactly sb3-contrib's masked distribution, and the
training-throughput measurement reports what it claims."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from installed import lazy_module, needs

pytestmark = needs("torch", "sb3_contrib")
# imported by the tests, not while pytest collects (torch and SB3 take seconds)
th = lazy_module("torch")
dist = lazy_module("sb3_contrib.common.maskable.distributions")
sb3_policies = lazy_module("sb3_contrib.common.maskable.policies")
fs = lazy_module("kvsched.agents.fast_sampling")

NVEC = [5, 7, 5, 4]


def _random_case(seed: int, batch: int = 32):
    g = np.random.default_rng(seed)
    logits = th.as_tensor(g.normal(0, 2, (batch, sum(NVEC))), dtype=th.float32)
    masks = g.random((batch, sum(NVEC))) < 0.6
    start = 0
    for n in NVEC:  # every part keeps at least one allowed choice
        masks[:, start + g.integers(n)] = True
        start += n
    return logits, masks


def _sb3_distribution(logits, masks: np.ndarray):
    d = dist.MaskableMultiCategoricalDistribution(NVEC).proba_distribution(logits)
    d.apply_masking(masks)
    return d


@pytest.mark.parametrize("seed", range(4))
def test_log_prob_of_sampled_actions_equals_sb3_contrib(seed):
    logits, masks = _random_case(seed)
    th.manual_seed(seed)
    actions, log_prob = fs.sample_masked(logits, masks, fs.PaddedParts(NVEC))
    expected = _sb3_distribution(logits, masks).log_prob(actions)
    assert th.allclose(log_prob, expected, atol=1e-5)


def test_masked_choices_are_never_drawn_and_deterministic_is_sb3_mode():
    logits, masks = _random_case(7, batch=64)
    parts = fs.PaddedParts(NVEC)
    th.manual_seed(0)
    for _ in range(50):
        actions, _ = fs.sample_masked(logits, masks, parts)
        offsets = np.cumsum([0] + NVEC[:-1])
        flat = actions.numpy() + offsets
        assert masks[np.arange(len(flat))[:, None], flat].all()
    mode, _ = fs.sample_masked(logits, masks, parts, deterministic=True)
    assert th.equal(mode, _sb3_distribution(logits, masks).get_actions(deterministic=True))


def test_sample_frequencies_match_the_masked_probabilities():
    logits, masks = _random_case(3, batch=1)
    rows = logits.repeat(20_000, 1)
    th.manual_seed(1)
    actions, _ = fs.sample_masked(rows, np.repeat(masks, 20_000, axis=0), fs.PaddedParts(NVEC))
    probs = _sb3_distribution(logits, masks).distributions
    for p, dist in enumerate(probs):
        freq = np.bincount(actions[:, p].numpy(), minlength=NVEC[p]) / 20_000
        # 20,000 draws: the standard error of a frequency is at most 0.0036; 5 of them
        assert np.abs(freq - dist.probs[0].numpy()).max() < 0.018


def test_policy_forward_gives_sb3_values_and_log_probs():
    obs_space = spaces.Box(-1, 1, (12,), np.float32)
    act_space = spaces.MultiDiscrete(NVEC)
    th.manual_seed(0)
    fast = fs.FastMaskablePolicy(obs_space, act_space, lambda _: 3e-4)
    plain = sb3_policies.MaskableActorCriticPolicy(obs_space, act_space, lambda _: 3e-4)
    plain.load_state_dict(fast.state_dict())
    _, masks = _random_case(5, batch=16)
    obs = th.as_tensor(np.random.default_rng(0).uniform(-1, 1, (16, 12)), dtype=th.float32)
    actions, values, log_prob = fast(obs, action_masks=masks)
    v2, lp2, _ = plain.evaluate_actions(obs, actions, action_masks=masks)
    assert th.allclose(values, v2) and th.allclose(log_prob, lp2, atol=1e-5)


def test_part_sizes_refuses_other_action_spaces():
    assert fs.part_sizes(spaces.Discrete(3)) == [3]
    with pytest.raises(ValueError, match="Discrete or 1-D MultiDiscrete"):
        fs.part_sizes(spaces.Box(0, 1, (2,)))


def test_training_throughput_rows_cover_training_and_environment():
    from kvsched.agents.throughput import measure_training

    rows = measure_training("CartPole-v1", steps=256, n_envs=2)
    assert [r["part"] for r in rows] == ["training", "environment"]
    for r in rows:
        assert r["steps"] == 256 and r["cpu_s"] > 0 and r["steps_per_cpu_s"] == pytest.approx(256 / r["cpu_s"])
    with pytest.raises(ValueError, match="n_envs=0"):
        measure_training("CartPole-v1", steps=8, n_envs=0)


def test_a_part_with_every_choice_masked_samples_inside_the_part_as_sb3_contrib():
    """Padding shared the masked logit, so a part with no allowed choice (sb3-contrib: uniform over
    its choices) could draw a padding index beyond the part's size, with the wrong log-probability."""
    logits, masks = _random_case(5, batch=256)
    masks[:, NVEC[0]:NVEC[0] + NVEC[1]] = False  # part 1 (7 choices) fully masked; part 0 is narrower (5)
    masks[:, :NVEC[0]] = False  # part 0 (5 choices, padded to 7) fully masked
    th.manual_seed(0)
    actions, log_prob = fs.sample_masked(logits, masks, fs.PaddedParts(NVEC))
    assert (actions < th.as_tensor(NVEC)).all()
    assert th.allclose(log_prob, _sb3_distribution(logits, masks).log_prob(actions), atol=1e-4)
