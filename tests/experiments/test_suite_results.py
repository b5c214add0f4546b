"""The committed results of suite v1 (experiments/suite/results/v1.json) keep the suite's promises:
every task of the suite is there, computed for its current definition; the tasks released with v1
keep their results byte for byte (a task added later is computed alone); on the hard stratum the
achievable bound beats the tuned best heuristic by >= 3 points with the interval above 0 (the
rule that kept the task); the bound is >= every baseline on every episode; and no tuning study
served a request of a held-out episode."""

from __future__ import annotations

import hashlib
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


#: sha256 of each task's results as released with v1 (its entry of v1.json, JSON with sorted keys)
RELEASED = {
    "kv-burst-tiers": "823c216597aa807439177e17e0a99b8db93b9065ec99868716d56fb7fc305b5c",
    "mooncake-1i": "d7752ae4e07be7356af5883fe7b74bb5644d7e726d706b45ac46726e49229709",
    "overload-burst": "5116c9cbd07557ed1c4f1e5da78ff2f783b4c54a99756f4f6aacf417b44f9082",
    "routing-stale": "4756888e3e29dc5c77d4b2acdb68735375e39a88e093c72ca27caea5a5bd7fe2",
    "sessions-small-kv": "5580d666c2012476c5053e429e1b50e122d847e2977e28f90c11286486977929",
}


@pytest.mark.parametrize("task_id", sorted(RELEASED))
def test_a_released_tasks_results_are_unchanged_when_a_task_is_added(task_id):
    """Adding a task (residency-sessions, after v1's release) merges its results beside the others;
    recomputing or editing a released task's results would need a new suite version."""
    entry = RESULTS["tasks"][task_id]
    assert hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest() == RELEASED[task_id]
    assert RESULTS["provenance"]["tasks"][task_id] == entry["provenance"]


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
