"""The committed results of suite v1 (experiments/suite/results/v1.json) keep the suite's promises:
every task of the suite is there, computed for its current definition; on the hard stratum the
achievable bound beats the tuned best heuristic by >= 3 points with the interval above 0 (the
rule that kept the task); the bound is >= every baseline on every episode; and no tuning study
served a request of a held-out episode."""

from __future__ import annotations

import json

import pytest

from kvsched.experiments.suite.compute import check_tuning_saw_no_heldout, task_record
from kvsched.experiments.suite.results import baseline_labels, leaderboard, load_results
from kvsched.experiments.suite.tasks import get_suite

SUITE = get_suite("v1")
RESULTS = load_results("v1")


def test_every_task_of_the_suite_is_computed_for_its_current_definition():
    assert sorted(RESULTS["tasks"]) == sorted(t.task_id for t in SUITE)
    for t in SUITE:
        stored = RESULTS["tasks"][t.task_id]["task"]
        assert json.loads(json.dumps(stored)) == json.loads(json.dumps(task_record(t))), t.task_id
        for stratum, keys in RESULTS["tasks"][t.task_id]["strata"].items():
            assert len(keys) == t.stratum_episodes, (t.task_id, stratum)


@pytest.mark.parametrize("task", SUITE, ids=lambda t: t.task_id)
def test_every_kept_task_has_3_points_of_hard_headroom_with_the_interval_above_0(task):
    rows = [r for r in leaderboard({"tasks": {task.task_id: RESULTS["tasks"][task.task_id]}})
            if r["stratum"] == "hard"]
    assert rows[0]["headroom"] >= 0.03 and rows[0]["headroom_lo"] > 0, rows[0]


@pytest.mark.parametrize("task", SUITE, ids=lambda t: t.task_id)
def test_the_bound_is_at_least_every_baseline_on_every_episode(task):
    tr = RESULTS["tasks"][task.task_id]
    labels = baseline_labels(tr)
    for key, ep in tr["episodes"].items():
        scores = [ep["scores"][label] for label in labels if ep["scores"].get(label) is not None]
        assert ep["bound"]["score"] >= max(scores), key


@pytest.mark.parametrize("task", SUITE, ids=lambda t: t.task_id)
def test_no_tuning_study_of_the_committed_results_served_a_heldout_request(task):
    check_tuning_saw_no_heldout(task, RESULTS["tasks"][task.task_id]["tuning"])


@pytest.mark.parametrize("task", SUITE, ids=lambda t: t.task_id)
def test_training_estimates_the_bench_score_with_the_leaderboards_hard_headroom(task):
    """``kvsched train --task`` divides its paired gain by the same hard-stratum headroom the
    leaderboard normalises by (``eval/bench_score_estimate``)."""
    from kvsched.experiments.suite.agents import task_headroom

    rows = [r for r in leaderboard({"tasks": {task.task_id: RESULTS["tasks"][task.task_id]}})
            if r["stratum"] == "hard"]
    assert task_headroom("v1", task.task_id) == pytest.approx(rows[0]["headroom"])
