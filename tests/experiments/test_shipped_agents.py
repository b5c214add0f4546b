"""Learned agents shipped with kvsched bench v1: on the leaderboard by default, reproducible from
their checkpoints, and saved only when evaluated on every episode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvsched.agents.es import LinearScheduler
from kvsched.experiments.cli import main
from kvsched.experiments.suite.agents import evaluate_agent
from kvsched.experiments.suite.results import load_results
from kvsched.experiments.suite.shipped import SUFFIX, checkpoint_file, load_shipped
from kvsched.experiments.suite.tasks import get_task

sys.path.insert(0, str(Path(__file__).parent))
from bench_fixtures import planted_results  # noqa: E402

SHIPPED = load_shipped("v1")


@pytest.mark.parametrize("label", sorted(SHIPPED))
def test_shipped_agent_reproduces_its_recorded_scores(label):
    """The first two episodes of each stratum, re-evaluated from the checkpoint, give the recorded
    scores exactly (a change to the environment that moves them fails here)."""
    entry = SHIPPED[label]
    ckpt = checkpoint_file(entry)
    assert ckpt.is_file() and entry["training"]["command"], "a shipped agent names its checkpoint and command"
    results = load_results("v1")
    for task_id, per_stratum in entry["scores"].items():
        got = evaluate_agent(get_task("v1", task_id), results["tasks"][task_id], str(ckpt), limit=2)
        for stratum, scores in per_stratum.items():
            assert len(scores) == len(results["tasks"][task_id]["strata"][stratum])
            assert got[stratum] == scores[:2]


def test_shipped_agents_are_on_the_default_leaderboard(capsys):
    if not SHIPPED:
        pytest.skip("no shipped agents")
    assert main(["leaderboard", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["agent"] for r in rows if r["kind"] == "agent"} == {label + SUFFIX for label in SHIPPED}
    assert main(["leaderboard", "--json", "--no-shipped"]) == 0
    assert not [r for r in json.loads(capsys.readouterr().out) if r["kind"] == "agent"]


def test_a_task_no_shipped_agent_covers_says_so_on_the_leaderboard(capsys):
    """routing-stale and residency-sessions have no learned agent (ES acts in the scheduling
    environments only): the leaderboard says so instead of a blank cell or an invented row."""
    covered = {t for e in SHIPPED.values() for t in e["scores"]}
    bare = [t for t in ("routing-stale", "residency-sessions") if t not in covered]
    if not SHIPPED or not bare:
        pytest.skip("every task has a shipped agent")
    assert main(["leaderboard", "--tasks", ",".join(bare), "--markdown"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 2 * len(bare) and all(row.endswith("| none shipped |") for row in rows), rows
    assert main(["leaderboard", "--tasks", bare[-1]]) == 0
    assert f"no shipped agent on {bare[-1]}" in capsys.readouterr().out


def test_save_agents_records_scores_path_and_command(tmp_path, capsys):
    folder = planted_results(tmp_path / "res")
    ckpt = tmp_path / "run" / "final.zip"
    ckpt.parent.mkdir()
    LinearScheduler(16, [16, 7, 5, 4]).save(ckpt)  # the reference itself
    (ckpt.parent / "train.json").write_text(json.dumps({"env_id": "kvsched/Scheduling-v0", "algo": "es",
                                                        "command": "kvsched train --algo es ...", "env_kwargs": {}}))
    out = tmp_path / "agents.json"
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(ckpt),
                 "--save-agents", str(out), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # --json stays parseable: the "saved" line goes to stderr
    saved = json.loads(out.read_text())
    entry = saved["agents"]["final.zip"]
    assert entry["training"]["command"] == "kvsched train --algo es ..." and entry["checkpoint"].endswith("final.zip")
    assert set(entry["scores"]["overload-burst"]) == {"all", "hard"}
    assert all(len(v) == 2 and all(isinstance(x, float) for x in v) for v in entry["scores"]["overload-burst"].values())
    # --episodes with --save-agents is refused: a shipped agent is scored on every episode
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(ckpt),
                 "--episodes", "1", "--save-agents", str(out)]) == 2
    assert "--save-agents" in capsys.readouterr().err


def test_a_broken_shipped_file_is_a_clean_error(tmp_path, capsys):
    folder = planted_results(tmp_path / "res")
    (folder / "v1-agents.json").write_text("{not json")
    assert main(["leaderboard", "--results", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "not a readable shipped-agents file" in err and "Traceback" not in err


@pytest.mark.parametrize("scores, expected", [
    ({"overload-burst": {"all": ["a", "b"]}}, "expected an object of stratum -> list"),  # was a ValueError traceback
    ({"overload-burst": {"all": 0.5}}, "expected an object of stratum -> list"),  # was a TypeError traceback
    ({"overload-burst": ["x"]}, "expected an object of stratum -> list"),  # was silently ignored
    ({"overload-burst": {"all": [0.5]}}, "has 1 scores on 'overload-burst' 'all'"),  # was paired on 1 episode
    ({"overload-burst": {"nope": [0.5, 0.5]}}, "no such stratum"),  # was silently ignored
])
def test_bad_scores_in_a_shipped_file_are_a_clean_error(tmp_path, capsys, scores, expected):
    folder = planted_results(tmp_path / "res")
    (folder / "v1-agents.json").write_text(json.dumps({"format": "kvsched-bench-agents/1",
                                                       "agents": {"x": {"scores": scores}}}))
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--json"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_save_agents_never_overwrites_a_file_of_another_format(tmp_path, capsys):
    """--save-agents FILE with an existing file not named <suite>-agents.json read its "agents"
    (none) and replaced the whole file: the suite's results file was lost."""
    folder = planted_results(tmp_path / "res")
    ckpt = tmp_path / "run" / "final.zip"
    ckpt.parent.mkdir()
    LinearScheduler(16, [16, 7, 5, 4]).save(ckpt)
    (ckpt.parent / "train.json").write_text(json.dumps({"env_id": "kvsched/Scheduling-v0", "algo": "es",
                                                        "command": "kvsched train --algo es ...", "env_kwargs": {}}))
    results_file = folder / "v1.json"
    before = results_file.read_bytes()
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(ckpt),
                 "--save-agents", str(results_file), "--json"]) == 2
    err = capsys.readouterr().err
    assert "not a kvsched-bench-agents/1 file" in err and "Traceback" not in err
    assert results_file.read_bytes() == before


def _es_checkpoint(folder: Path, env_kwargs: dict) -> Path:
    ckpt = folder / "final.zip"
    folder.mkdir(parents=True)
    LinearScheduler(16, [16, 7, 5, 4]).save(ckpt)
    # json.dumps writes inf as Infinity, as kvsched train --task writes horizon_s
    (folder / "train.json").write_text(json.dumps({"env_id": "kvsched/Scheduling-v0", "algo": "es",
                                                   "command": f"kvsched train --out {folder}",
                                                   "env_kwargs": env_kwargs}))
    return ckpt


def test_save_agents_takes_a_task_run_whose_metadata_holds_an_infinite_horizon(tmp_path, capsys):
    """Every ``kvsched train --task`` run records ``horizon_s: inf``; saving it was a ValueError
    traceback from strict JSON after the whole evaluation."""
    folder = planted_results(tmp_path / "res")
    ckpt = _es_checkpoint(tmp_path / "run", {"horizon_s": float("inf")})
    out = folder / "v1-agents.json"
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(ckpt),
                 "--save-agents", str(out), "--json"]) == 0
    entry = load_shipped("v1", folder)["final.zip"]
    assert entry["training"]["env_kwargs"]["horizon_s"] == "inf"
    assert "Infinity" not in out.read_text()


def test_save_agents_keeps_two_runs_of_the_same_file_name_and_says_where_it_is_shown(tmp_path, capsys):
    folder = planted_results(tmp_path / "res")
    a, b = _es_checkpoint(tmp_path / "a", {}), _es_checkpoint(tmp_path / "b", {})
    out = folder / "v1-agents.json"
    for ckpt in (a, b):
        assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(ckpt),
                     "--save-agents", str(out), "--json"]) == 0
    agents = load_shipped("v1", folder)
    assert {e["checkpoint"] for e in agents.values()} == {str(a), str(b)}  # the second did not replace the first
    assert "the leaderboard shows" not in capsys.readouterr().err  # saved where --results reads it
    elsewhere = tmp_path / "mine.json"
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", str(a),
                 "--save-agents", str(elsewhere)]) == 0
    assert "shown when it is that file of the folder given to --results" in capsys.readouterr().err


def test_a_checkpoint_saved_from_the_checkout_is_found_again():
    from kvsched.experiments.suite.shipped import repository_root

    assert checkpoint_file({"checkpoint": "runs/x/final.zip"}) == repository_root() / "runs/x/final.zip"
    assert checkpoint_file({"checkpoint": "agents/checkpoints/scheduling_maskable_ppo.zip"}).is_file()


def test_saving_an_agent_again_keeps_its_scores_on_other_tasks(tmp_path):
    """Saving a checkpoint evaluated on task B replaced its task-A scores."""
    from kvsched.experiments.suite.shipped import save_shipped

    ckpt = _es_checkpoint(tmp_path / "run", {})
    out = tmp_path / "v1-agents.json"
    save_shipped(out, "v1", {"final.zip": {"a": {"all": [0.5]}}}, {"final.zip": str(ckpt)}, "kvsched ...")
    save_shipped(out, "v1", {"final.zip": {"b": {"all": [0.7]}}}, {"final.zip": str(ckpt)}, "kvsched ...")
    assert load_shipped("v1", tmp_path)["final.zip"]["scores"] == {"a": {"all": [0.5]}, "b": {"all": [0.7]}}


def test_save_agents_refuses_heuristics_before_evaluating(tmp_path, capsys, monkeypatch):
    """--save-agents with a heuristic among --agents was refused only after the whole evaluation."""
    import kvsched.experiments.suite.agents as suite_agents

    monkeypatch.setattr(suite_agents, "evaluate_agent", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    folder = planted_results(tmp_path / "res")
    ckpt = _es_checkpoint(tmp_path / "run", {})
    assert main(["leaderboard", "--results", str(folder), "--tasks", "overload-burst", "--agents", f"{ckpt},lars",
                 "--save-agents", str(folder / "v1-agents.json")]) == 2
    err = capsys.readouterr().err
    assert "--save-agents keeps learned agents" in err and "'lars'" in err and "Traceback" not in err
