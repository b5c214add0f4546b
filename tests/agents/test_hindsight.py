"""The hindsight teacher of Residency-v0 labels each decision with the keep bin its conversation's
next arrival needs (kvsched.agents.hindsight), and the student it teaches reads the observation
vector only."""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from kvsched.agents.hindsight import (HindsightIndex, ImitationPolicy, hindsight_action, record,  # noqa: E402
                                      teacher_action)
from kvsched.envs.residency_env import BASE_ACTIONS, FEATURES, KEEP_BINS_S, ResidencyEnv  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

SCENARIO = str(Path(__file__).resolve().parents[2] / "experiments" / "scenarios" / "residency-sessions.yaml")
KEEP = {b: len(BASE_ACTIONS) + i for i, b in enumerate(KEEP_BINS_S)}


def _workload(sessions, arrivals):
    return SimpleNamespace(session_id=np.asarray(sessions, np.int64), arrival_s=np.asarray(arrivals, float))


def test_a_conversation_returning_after_20_s_gets_the_30_s_bin():
    w = _workload([7, 8, 7, 7], [0.0, 1.0, 20.0, 100.0])
    index = HindsightIndex(w)
    assert index.next_arrival_s(7, 0.0) == 20.0 and index.next_arrival_s(7, 20.0) == 100.0
    assert index.next_arrival_s(8, 1.0) == math.inf and index.next_arrival_s(99, 0.0) == math.inf
    assert hindsight_action(20.0, KEEP_BINS_S) == KEEP[30.0]
    assert hindsight_action(80.0, KEEP_BINS_S) == KEEP[120.0]


def test_the_margin_moves_a_label_up_a_bin_and_no_return_is_drop_or_default():
    assert hindsight_action(0.0, KEEP_BINS_S) == KEEP[5.0]
    assert hindsight_action(28.5, KEEP_BINS_S, margin_s=2.0) == KEEP[60.0]
    assert hindsight_action(28.5, KEEP_BINS_S, margin_s=0.0) == KEEP[30.0]
    assert hindsight_action(599.0, KEEP_BINS_S, margin_s=2.0, beyond=1) == 1
    assert hindsight_action(math.inf, KEEP_BINS_S, beyond=0) == 0


def test_bad_teacher_inputs_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="gap_s"):
        hindsight_action(-1.0, KEEP_BINS_S)
    with pytest.raises(ConfigError, match="beyond"):
        hindsight_action(1.0, KEEP_BINS_S, beyond=2)
    with pytest.raises(ConfigError, match="workload.session_id"):
        HindsightIndex(_workload([-1, -1], [0.0, 1.0]))


def test_the_teacher_labels_each_decision_with_the_gap_to_its_conversations_next_turn():
    env = ResidencyEnv(scenario=SCENARIO, window_s=60.0, max_requests=40)
    env.reset(options={"workload_seed": 0, "window_index": 1})
    index = HindsightIndex(env.workload)
    sid, t = np.asarray(env.workload.session_id), np.asarray(env.workload.arrival_s)
    labels = set()
    while True:
        p = env._point
        st = p.request
        later = t[(sid == st.req.session_id) & (t > st.arrival_s)]
        gap = max(later.min() - p.time_s, 0.0) if len(later) else math.inf
        a = teacher_action(env, index, margin_s=2.0, beyond=1)
        bins = [b for b in KEEP_BINS_S if b >= gap + 2.0]
        assert a == (KEEP[bins[0]] if bins else 1)
        labels.add(a)
        *_, term, trunc, _ = env.step(a)
        if term or trunc:
            break
    assert len(labels) >= 2  # the window has conversations that come back and ones that do not


def test_the_student_reads_the_observation_vector_only():
    env = ResidencyEnv(scenario=SCENARIO, window_s=60.0, max_requests=40)
    obs, acts, masks = record(env, [(0, 1)])
    assert obs.shape == (len(acts), len(FEATURES)) and masks.shape == (len(acts), env.n_actions)
    student = ImitationPolicy(len(FEATURES), env.n_actions, seed=0)
    student.fit(obs, acts, masks, epochs=2)
    assert list(inspect.signature(student.act).parameters) == ["obs", "mask"]  # no environment, no workload
    chosen = [student.act(o, m) for o, m in zip(obs, masks)]
    assert all(m[a] for a, m in zip(chosen, masks))  # argmax over the valid actions only
    with pytest.raises(ConfigError, match="obs"):
        student.act(np.zeros(len(FEATURES) + 1, np.float32), masks[0])


def test_dagger_records_the_teachers_labels_on_the_states_the_behaviour_reaches():
    env = ResidencyEnv(scenario=SCENARIO, window_s=60.0, max_requests=40)
    played = []

    def drop(obs, mask):
        played.append(1)
        return 1

    obs_t, acts_t, _ = record(env, [(0, 1)])
    obs_b, acts_b, _ = record(env, [(0, 1)], behaviour=drop)
    assert len(played) == len(acts_b) == len(acts_t)  # every decision played by the behaviour
    assert set(acts_b) != {1}  # labelled by the teacher, not by what was played
    assert not np.array_equal(obs_b, obs_t)  # dropping everything reaches other states
