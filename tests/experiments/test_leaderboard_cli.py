"""``kvsched leaderboard`` as a user runs it: on results of a real v1 task (two of its held-out
episodes, baseline scores planted), agents evaluated on the same episodes, datasets recorded
from the results, and clean one-line errors for what cannot be done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")

from bench_fixtures import planted_results  # noqa: E402

from kvsched.experiments.cli import main  # noqa: E402

TASK = "overload-burst"


def results(folder: Path) -> Path:
    return planted_results(folder, TASK)


def run(argv, capsys):
    rc = main(["leaderboard", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out


def test_an_agent_is_evaluated_on_the_strata_episodes_beside_the_baselines(tmp_path, capsys):
    res = results(tmp_path / "res")
    rc, out = run(["--results", str(res), "--tasks", TASK, "--agents", "fcfs", "--json"], capsys)
    assert rc == 0, out.err
    rows = json.loads(out.out)
    mine = [r for r in rows if r["kind"] == "agent"]
    assert [(r["agent"], r["stratum"], r["paired_episodes"]) for r in mine] == [("fcfs", "all", 2), ("fcfs", "hard", 2)]
    assert all(r["headroom"] == pytest.approx(0.1) for r in rows)


@pytest.mark.parametrize("argv, needle", [
    (["--tasks", TASK, "--agents", "fcfs,fcfs"], "given twice: fcfs"),
    (["--tasks", TASK, "--agents", ","], "empty item in a comma list"),
    (["--tasks", TASK + ",", "--agents", "fcfs"], "--tasks='overload-burst,': empty item"),
    (["--tasks", "routing-stale"],
     "--tasks 'routing-stale': not in the results of suite v1 (they hold: overload-burst)"),
    (["--tasks", "nope"], "unknown 'nope'; expected distinct task ids of suite v1: kv-burst-tiers"),
    (["--tasks", TASK, "--datasets"], "--datasets writes Minari datasets: give --out DIR"),
    (["--datasets", "--agents", "fcfs"], "--datasets records datasets only"),
    (["--json", "--markdown"], "give one output format"),
])
def test_what_the_leaderboard_cannot_do_is_a_one_line_error(tmp_path, capsys, argv, needle):
    rc, out = run(["--results", str(results(tmp_path / "res")), *argv], capsys)
    assert rc == 2 and needle in out.err and len(out.err.strip().splitlines()) == 1


def test_an_agent_that_is_already_a_baseline_row_is_refused(tmp_path, capsys):
    """`--agents X,random` showed random twice (its baseline row and the same episodes again as an
    agent); an agent named as a baseline row is refused before any episode."""
    res = results(tmp_path / "res")
    data = json.loads((res / "v1.json").read_text())
    for ep in data["tasks"][TASK]["episodes"].values():
        ep["scores"]["random"] = 0.5
    (res / "v1.json").write_text(json.dumps(data))
    rc, out = run(["--results", str(res), "--tasks", TASK, "--agents", "fcfs,random"], capsys)
    assert rc == 2 and len(out.err.strip().splitlines()) == 1, out.err
    assert "--agents 'random': already a baseline row of overload-burst" in out.err


def test_agent_episodes_are_counted_in_progress_lines_not_one_line_each(tmp_path, capsys, monkeypatch):
    """Each agent episode printed a line of its own on stderr (48 per agent on a v1 task); off a
    terminal the progress lines count them now (kvsched.experiments.progress)."""
    from kvsched.experiments.progress import INTERVAL_ENV

    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every update
    rc, out = run(["--results", str(results(tmp_path / "res")), "--tasks", TASK, "--agents", "fcfs", "--json"],
                  capsys)
    assert rc == 0 and "kvsched leaderboard: 4/4 episodes" in out.err, out.err
    assert "episode 1" not in out.err


def test_tasks_missing_from_the_results_are_named_not_dropped_silently(tmp_path, capsys):
    rc, out = run(["--results", str(results(tmp_path / "res"))], capsys)
    assert rc == 0 and "not in the results (not computed): kv-burst-tiers" in out.out
    assert "overload-burst [all, 2 episodes]" in out.out


def test_datasets_are_recorded_from_the_results_without_recomputing(tmp_path, capsys):
    pytest.importorskip("minari")
    pytest.importorskip("jax")
    import minari

    from kvsched.experiments.suite.datasets import _minari_root

    res = results(tmp_path / "res")
    rc, out = run(["--results", str(res), "--tasks", TASK, "--datasets", "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, out.err
    where = tmp_path / "o" / "v1" / TASK / "minari"
    assert "kvsched/overload-burst/lars-v1: 8 train episodes" in out.out
    with _minari_root(where):
        ds = minari.load_dataset("kvsched/overload-burst/lars-v1")
        assert ds.total_episodes == 8 and "kappa" in str(ds.storage.metadata)


def test_a_checkpoint_trained_off_the_tasks_environment_is_noted():
    from kvsched.experiments.suite.agents import checkpoint_mismatches
    from kvsched.experiments.suite.tasks import get_task

    t = get_task("v1", TASK)
    params = {"kappa": 2.5}
    same = {"env_kwargs": {k: v for k, v in t.env_kwargs_for("train", "lars", params).items() if k != "split"}}
    assert checkpoint_mismatches(t, same, "lars", params) == []
    yaml = Path(__file__).resolve().parents[2] / "experiments" / "scenarios" / "bench-v1-overload-burst.yaml"
    path = {"env_kwargs": {**same["env_kwargs"], "scenario": str(yaml)}}
    assert checkpoint_mismatches(t, path, "lars", params) == []  # a path or the bundled name: the same file
    notes = checkpoint_mismatches(t, {"env_kwargs": {"window_s": 60.0}}, "lars", params)
    assert len(notes) == 3 and "mixed-long-short" in notes[0] and "window_s=60.0" in notes[1]
    assert "reference 'fcfs' {}" in notes[2] and "tuned best heuristic lars {'kappa': 2.5}" in notes[2]


def test_every_agent_name_is_checked_before_the_first_episode(tmp_path, capsys):
    """A typo in the last of several agents failed only after the agents before it had run."""
    res = results(tmp_path / "res")
    for agents, why in (("fcfs,lrs", "agent 'lrs' is not a checkpoint"),
                        (f"fcfs,{tmp_path / 'no.zip'}", "no.zip' does not exist")):
        rc, out = run(["--results", str(res), "--tasks", TASK, "--agents", agents], capsys)
        assert rc == 2 and why in out.err and "episode" not in out.err


def test_results_may_be_given_as_the_file_itself(tmp_path, capsys):
    res = results(tmp_path / "res")
    rc, out = run(["--results", str(res / "v1.json"), "--tasks", TASK], capsys)
    assert rc == 0 and "overload-burst [all, 2 episodes]" in out.out
    (tmp_path / "other.json").write_text("{}")
    rc, out = run(["--results", str(tmp_path / "other.json")], capsys)
    assert rc == 2 and "is a file; expected the folder holding v1.json" in out.err
    rc, out = run(["--results", str(tmp_path / "nowhere")], capsys)
    assert rc == 2 and "then read them with --results DIR" in out.err
