"""The optional graded SLO reward (envs/reward.py, ``RewardConfig.graded``): a finished request
that misses its SLO earns ``met * min(1, bound / observed)`` over its judged bounds in the
component ``slo_graded``; off by default, when the reward is unchanged and the key is absent."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.reward import RewardConfig, SLOReward
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import RECORD_COLUMNS, SLO, MetricsConfig

_LONG = 4096
#: short: TTFT 1 s, TPOT 0.1 s; long: TTFT 10 s, TPOT 0.2 s; gold: TTFT 0.5 s, TPOT 0.05 s, E2E 4 s
_SLOS = {"short": SLO(1.0, 0.1), "long": SLO(10.0, 0.2), "gold": SLO(0.5, 0.05, e2e_s=4.0)}


def _row(first_s, finish_s, generated, tag=None, prompt=100, status="finished", arrival_s=0.0, rid=0):
    """A record row in ``RECORD_COLUMNS`` order (times in s from the arrival at ``arrival_s``)."""
    rejected = status == "rejected"
    return (rid, 0, arrival_s, prompt, max(generated, 1), tag, "long" if prompt >= _LONG else "short", status,
            "too_long" if rejected else None, math.nan if rejected else arrival_s,
            math.nan if rejected else arrival_s + first_s, math.nan if rejected else arrival_s + finish_s,
            0 if rejected else generated, 0, 0, 0, 0.0) + (0,) * (len(RECORD_COLUMNS) - 17)


def _reward(graded=True, met=1.0):
    return SLOReward(RewardConfig(graded=graded, met=met), MetricsConfig(long_prompt_tokens=_LONG, slos=_SLOS))


@pytest.mark.parametrize("row, grade", [
    # short class, TTFT 2 s against 1 s: 0.5 (TPOT (3 - 2) / 10 = 0.1 s, met)
    (_row(2.0, 3.0, 11), 0.5),
    # TPOT (5 - 0.5) / 9 = 0.5 s against 0.1 s: 0.2 (TTFT met)
    (_row(0.5, 5.0, 10), 0.2),
    # both missed: the worse ratio (TTFT 1 / 4 = 0.25, TPOT 0.1 / ((4.1 - 4) / 1 = 0.1): met)
    (_row(4.0, 4.1, 2), 0.25),
    # both missed, TPOT worse: TTFT 1 / 1.25 = 0.8, TPOT 0.1 / ((6.25 - 1.25) / 10 = 0.5) = 0.2
    (_row(1.25, 6.25, 11), 0.2),
    # gold class: E2E 8 s against 4 s: 0.5 (TTFT 0.4 s, TPOT (8 - 0.4) / 200 = 0.038 s, met)
    (_row(0.4, 8.0, 201, tag="gold"), 0.5),
    # a one-token request: TPOT is not judged, only TTFT 1.6 s against 1 s (finish - first would
    # otherwise be a TPOT of 8.4 / 0 tokens)
    (_row(1.6, 10.0, 1), 1.0 / 1.6),
    # a long prompt untagged: its length class (TTFT 10 s): 20 s -> 0.5
    (_row(20.0, 21.0, 6, prompt=_LONG), 0.5),
    # an unknown tag: its length class (short, TTFT 1 s): 3 s -> 1/3
    (_row(3.0, 3.0, 1, tag="bronze"), 1.0 / 3.0),
])
def test_the_grade_of_a_missed_row_is_the_worst_bound_over_observed_ratio(row, grade):
    reward = _reward()
    assert not reward.is_met(row)
    assert reward.grade(row) == pytest.approx(grade, rel=1e-12)
    assert 0.0 <= reward.grade(row) < 1.0
    comps = reward.collect([row])
    assert comps == {"slo_met": 0.0, "slo_missed": -1.0, "slo_graded": pytest.approx(grade, rel=1e-12)}


def test_the_graded_component_is_weighted_by_met():
    comps = _reward(met=2.5).collect([_row(2.0, 3.0, 11)])
    assert comps["slo_graded"] == pytest.approx(2.5 * 0.5)


def test_met_rows_earn_exactly_met_and_no_graded_credit():
    """A met request keeps +met; its grade (1) is not added to ``slo_graded`` on top."""
    reward = _reward()
    met = [_row(0.0, 0.0, 1), _row(1.0, 1.9, 10), _row(0.5, 4.0, 71, tag="gold")]  # zero, at-bound, gold
    assert all(reward.is_met(r) and reward.grade(r) == 1.0 for r in met)
    assert reward.collect(met) == {"slo_met": 3.0, "slo_missed": 0.0, "slo_graded": 0.0}


def test_rejected_rows_earn_no_graded_credit():
    reward = _reward()
    rejected = _row(0.0, 0.0, 0, status="rejected")
    assert reward.grade(rejected) == 0.0
    assert reward.collect([rejected]) == {"slo_met": 0.0, "slo_missed": -1.0, "slo_graded": 0.0}


def test_collect_grades_each_record_once_and_keeps_a_running_sum():
    reward = _reward()
    rows = [_row(2.0, 3.0, 11, rid=0)]
    assert reward.collect(rows)["slo_graded"] == pytest.approx(0.5)
    rows.append(_row(0.5, 5.0, 10, rid=1))
    assert reward.collect(rows)["slo_graded"] == pytest.approx(0.2)
    assert reward.collect(rows)["slo_graded"] == 0.0  # nothing new
    assert reward.grades == pytest.approx(0.7) and (reward.met, reward.missed) == (0, 2)


def test_graded_off_reports_no_graded_component():
    reward = _reward(graded=False)
    assert reward.collect([_row(2.0, 3.0, 11)]) == {"slo_met": 0.0, "slo_missed": -1.0}
    assert reward.grades == 0.0


@pytest.mark.parametrize("value", ["yes", 1, 0, None, 1.0])
def test_a_non_bool_graded_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^RewardConfig\.graded=.* is not allowed: expected True or False$"):
        RewardConfig(graded=value)
    with pytest.raises(ConfigError, match=r"RewardConfig\.graded="):
        RewardConfig.from_mapping({"graded": value})


# ------------------------------------------------------------------------------- on an episode
gym = pytest.importorskip("gymnasium")

import kvsched.envs  # noqa: E402,F401

#: a short real episode with finished misses (25 requests, about 30 decisions)
SMALL = dict(window_s=10.0, max_requests=25, horizon_s=math.inf)
OPTIONS = {"workload_seed": 2**20, "window_index": 0}


def _episode(reward):
    """(per-step rewards, per-step reward components, the unwrapped env at the end) of the
    reference policy's episode."""
    env = gym.make("kvsched/Scheduling-v0", reward=reward, **SMALL)
    env.reset(seed=0, options=OPTIONS)
    rewards, comps = [], []
    while True:
        _, r, terminated, truncated, info = env.step(np.zeros(4, dtype=np.int64))
        rewards.append(r)
        comps.append(info["reward_components"])
        if terminated or truncated:
            assert terminated
            return rewards, comps, env.unwrapped


def _grades_from_records(records, cfg: MetricsConfig) -> np.ndarray:
    """The grade of each finished request that missed its SLO, computed with ``summarize``'s
    per-request arrays (vectorised; independent of SLOReward's per-row loop)."""
    from kvsched.envs.sim.metrics import _request_arrays, _slo_bounds

    req = _request_arrays(records, cfg)
    ttft_b, tpot_b, e2e_b = _slo_bounds(records, req.length_class, cfg)

    def ratio(bound, observed, judged):
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(judged & (observed > 0), bound / observed, 1.0)
        return np.minimum(1.0, r)

    grade = np.minimum.reduce([ratio(ttft_b, req.ttft_s, req.finished),
                               ratio(tpot_b, req.tpot_s, req.multi),
                               ratio(e2e_b, req.e2e_s, req.finished & np.isfinite(e2e_b))])
    return grade[req.finished & ~req.met]


def test_graded_is_off_by_default_and_the_reward_is_unchanged():
    """Default and ``graded=False``: no ``slo_graded`` key, the same per-step rewards and
    components, which are the graded run's without its ``slo_graded`` (the schedule is the same)."""
    default, default_comps, env = _episode(RewardConfig())
    off, off_comps, _ = _episode({"graded": False})
    on, on_comps, _ = _episode({"graded": True})
    assert all("slo_graded" not in c for c in default_comps)
    assert (default, default_comps) == (off, off_comps)
    assert default_comps == [{k: v for k, v in c.items() if k != "slo_graded"} for c in on_comps]
    assert default == [float(sum(v for k, v in c.items() if k != "slo_graded")) for c in on_comps]
    assert sum(default) == pytest.approx(env.slo_reward.met - env.slo_reward.missed)
    assert on != default  # the episode has graded misses, so the comparison above can fail


def test_the_graded_components_sum_to_met_times_the_grades_of_the_final_records():
    """Over a real Scheduling-v0 episode the ``slo_graded`` components sum to ``met`` times the
    grades of its missed finished requests, computed from the final records; every grade is in
    [0, 1) and the episode sums to ``met * n_met - missed * n_missed + met * sum(grades)``."""
    w_met = 2.0
    rewards, comps, env = _episode(RewardConfig(graded=True, met=w_met))
    records = env.cluster.result().records
    grades = _grades_from_records(records, env.metrics)
    assert len(grades) > 0  # the episode has finished misses
    assert np.all((grades >= 0.0) & (grades < 1.0))
    graded = sum(c["slo_graded"] for c in comps)
    assert graded == pytest.approx(w_met * grades.sum(), rel=1e-12)
    assert env.slo_reward.grades == pytest.approx(grades.sum(), rel=1e-12)
    n_met, n_missed = env.slo_reward.met, env.slo_reward.missed
    assert sum(rewards) == pytest.approx(w_met * n_met - n_missed + w_met * grades.sum(), rel=1e-12)
    # the same per row through SLOReward.grade
    per_row = sorted(env.slo_reward.grade(r) for r in env.cluster.recorder.rows if not env.slo_reward.is_met(r))
    assert per_row == pytest.approx(sorted(grades), rel=1e-12)


@pytest.mark.parametrize("env_id", ["kvsched/Scheduling-v0", "kvsched/Scheduling-v1", "kvsched/Routing-v0",
                                    "kvsched/Knobs-v0"])
@pytest.mark.parametrize("as_mapping", [False, True], ids=["config", "mapping"])
def test_every_environment_passes_the_graded_component_into_its_reward(env_id, as_mapping):
    """Each environment built on SLOReward.collect reports ``slo_graded`` at every step, its
    reward is the sum of its components, and the component sums to ``met`` times the grades. The
    reward may be a mapping of its fields (``--env-kwargs`` JSON) in every environment."""
    reward = {"graded": True, "met": 2.0} if as_mapping else RewardConfig(graded=True, met=2.0)
    env = gym.make(env_id, window_s=10.0, max_requests=25, reward=reward)
    env.action_space.seed(0)
    env.reset(seed=0, options=OPTIONS)
    graded = 0.0
    while True:
        _, r, terminated, truncated, info = env.step(env.action_space.sample())
        comps = info["reward_components"]
        assert r == float(sum(comps.values()))
        graded += comps["slo_graded"]
        if terminated or truncated:
            break
    assert graded == pytest.approx(2.0 * env.unwrapped.slo_reward.grades, rel=1e-12)


@pytest.mark.parametrize("env_id", ["kvsched/Scheduling-v0", "kvsched/Routing-v0", "kvsched/Knobs-v0"])
@pytest.mark.parametrize("reward, match", [({"gradd": True}, "gradd"), ("graded", "reward")])
def test_every_environment_refuses_a_bad_reward_naming_it(env_id, reward, match):
    with pytest.raises(ConfigError, match=match):
        gym.make(env_id, window_s=10.0, reward=reward)
