"""Scheduling-v1's observation: version 0's values where they overlap, every value inside the
space, arrivals seen only up to the decision, and the output-length signal only when declared."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsched.envs  # noqa: F401
from kvsched.envs.observation import CANDIDATE_FEATURES, INSTANCE_FEATURES
from kvsched.envs.observation_v1 import (CANDIDATE_FEATURES_V1, INSTANCE_FEATURES_V1, ArrivalRates,
                                         observation_size_v1)
from kvsched.envs.sim.errors import ConfigError

K = 16
R0, I0, R1, I1 = len(CANDIDATE_FEATURES), len(INSTANCE_FEATURES), len(CANDIDATE_FEATURES_V1), len(INSTANCE_FEATURES_V1)


def _pair(**kw):
    return (gym.make("kvsched/Scheduling-v0", max_requests=80, **kw),
            gym.make("kvsched/Scheduling-v1", max_requests=80, **kw))


def test_version_1_extends_version_0_at_every_decision():
    e0, e1 = _pair(reference_policy="lars")
    o0, _ = e0.reset(seed=2)
    o1, _ = e1.reset(seed=2)
    assert o1.shape == (observation_size_v1(K),) == (K * 11 + 18,)
    rng = np.random.default_rng(0)
    for _ in range(300):
        assert np.array_equal(o1[:K * R1].reshape(K, R1)[:, :R0], o0[:K * R0].reshape(K, R0))
        assert np.array_equal(o1[K * R1:K * R1 + I0], o0[K * R0:])
        a = np.array([0, rng.integers(7), rng.integers(5), 0])
        o0, _, t0, tr0, _ = e0.step(a)
        o1, _, t1, tr1, _ = e1.step(a)
        assert (t0, tr0) == (t1, tr1)
        if t0 or tr0:
            break


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000))
def test_every_value_lies_in_the_space(seed):
    env = gym.make("kvsched/Scheduling-v1", max_requests=60, output_signal={"log_sd": 1.0})
    obs, info = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        assert env.observation_space.contains(obs)
        mask = info["action_mask"]
        parts, i = [], 0
        for n in env.action_space.nvec:
            parts.append(rng.choice(np.flatnonzero(mask[i:i + n])))
            i += n
        obs, _, term, trunc, info = env.step(np.array(parts))
        if term or trunc:
            break


def test_arrival_rates_use_arrivals_up_to_now_only():
    arrivals = np.array([0.0, 0.5, 1.0, 1.2, 5.0, 9.0])
    later = np.array([0.0, 0.5, 1.0, 1.2, 1.3, 1.31])  # differs only after t = 1.25
    a, b = ArrivalRates(arrivals, (10.0, 1.0)), ArrivalRates(later, (10.0, 1.0))
    for t in (0.2, 0.9, 1.25):
        assert a.at(t) == b.at(t)
    # the exponentially weighted sum, by brute force
    c = ArrivalRates(arrivals, (10.0,))
    for t in (0.7, 3.0, 9.5):
        want = sum(math.exp(-(t - x) / 10.0) for x in arrivals if x <= t) / 10.0
        assert c.at(t)[0] == pytest.approx(want, rel=1e-12)


def _signal_column(env, seed=1):
    obs, _ = env.reset(seed=seed)
    rows = obs[:K * R1].reshape(K, R1)
    return rows[:, 10], rows[:, 0] == 1.0, obs[-1]


def test_output_signal_only_when_declared():
    none = gym.make("kvsched/Scheduling-v1", max_requests=80)
    col, valid, flag = _signal_column(none)
    assert valid.any() and not col.any() and flag == 0.0
    oracle = gym.make("kvsched/Scheduling-v1", max_requests=80, output_signal="oracle")
    col, valid, flag = _signal_column(oracle)
    base = oracle.unwrapped
    max_len = base.inst.spec.model_len_limit
    ids = base._shown_ids
    want = [min(1.0, base.workload.output_tokens[base.workload.request_id == i][0] / max_len) for i in ids]
    assert flag == 1.0 and np.allclose(col[:len(ids)], want)
    noisy = gym.make("kvsched/Scheduling-v1", max_requests=80, output_signal={"log_sd": 0.5})
    c1, _, _ = _signal_column(noisy, seed=1)
    c2, _, _ = _signal_column(noisy, seed=1)
    assert np.array_equal(c1, c2) and not np.allclose(c1[:len(ids)], want)  # seeded, and not exact


@pytest.mark.parametrize("kw, field", [({"output_signal": {"log_sd": -1}}, "output_signal"),
                                       ({"output_signal": "exact"}, "output_signal"),
                                       ({"observation_version": 2}, "observation_version")])
def test_bad_observation_arguments_are_refused(kw, field):
    with pytest.raises(ConfigError, match=field):
        gym.make("kvsched/Scheduling-v0", **kw)


def test_a_large_predictor_error_is_an_observation_not_a_crash():
    """{"log_sd": s} allows any finite s >= 0; a large s overflowed math.exp (OverflowError
    traceback at the first decision). The feature clips to 1, so huge factors are just 1 (or 0)."""
    env = gym.make("kvsched/Scheduling-v1", max_requests=80, output_signal={"log_sd": 1000})
    obs, info = env.reset(seed=0)
    for _ in range(20):
        assert env.observation_space.contains(obs)
        obs, _, term, trunc, info = env.step(np.zeros(4, dtype=np.int64))
        if term or trunc:
            break
    assert env.observation_space.contains(obs)


def test_the_v1_id_refuses_another_observation_version():
    """Gymnasium merges make's kwargs over the id's: observation_version=0 silently gave a
    version-0 environment under the v1 id."""
    with pytest.raises(ConfigError, match="observation_version"):
        gym.make("kvsched/Scheduling-v1", observation_version=0)
    assert gym.make("kvsched/Scheduling-v1", observation_version=1).observation_space.shape == (K * 11 + 18,)
