"""kvsched bench (experiments/suite): what a careless user or a hand-edited file can feed the
leaderboard -- a partial evaluation (``--episodes``), bad task records, bad results files and
checkpoints -- is either handled as documented or refused with a one-line message."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.suite.results import FORMAT, leaderboard


def fake_results(n: int = 3) -> dict:
    """A results file of one task with ``n`` episodes in each stratum (no simulation)."""
    keys = [f"1048576:{i}" for i in range(n)]
    episodes = {k: {"scores": {"lars (tuned)": 0.5 + 0.1 * i, "fcfs (default)": 0.4, "random": 0.3},
                    "bound": {"score": 0.9, "schedule": None}, "isolation": 1.0, "requests": 10}
                for i, k in enumerate(keys)}
    tuning = {"lars": {"params": {"kappa": 2.0}, "journal": "lars.journal", "train_objective": 0.5},
              "fcfs": {"params": {}, "train_objective": 0.4, "tuned": False}, "reference": "lars"}
    return {"format": FORMAT, "suite": "v1", "tasks": {"overload-burst": {
        "tuning": tuning, "strata": {"all": keys, "hard": list(reversed(keys))}, "episodes": episodes}}}


def test_an_agent_on_the_first_n_episodes_is_paired_with_the_tuned_heuristic_on_those_n():
    res = fake_results(3)
    rows = leaderboard(res, {"mine": {"overload-burst": {"all": [0.6], "hard": [0.7, 0.6]}}})
    mine = {r["stratum"]: r for r in rows if r["agent"] == "mine"}
    assert mine["all"]["paired_episodes"] == 1 and mine["all"]["diff"] == pytest.approx(0.1)  # vs 0.5 on 1048576:0
    assert mine["hard"]["paired_episodes"] == 2 and mine["hard"]["diff"] == pytest.approx(0.0)  # vs 0.7, 0.6
    with pytest.raises(ConfigError, match="4 scores"):
        leaderboard(res, {"mine": {"overload-burst": {"all": [0.6] * 4}}})


def test_the_random_agent_on_the_leaderboard_reproduces_the_random_baseline_on_every_stratum_episode(tmp_path,
                                                                                                   monkeypatch):
    """A stochastic agent's seed is its episode's (the same in both strata), as the random baseline's."""
    pytest.importorskip("gymnasium")
    from kvsched.experiments.suite import compute
    from kvsched.experiments.suite.agents import evaluate_agent
    from test_suite import scenario, tiny_task

    monkeypatch.setattr(compute, "hindsight", lambda *a, **k: {"score": 1.0, "schedule": None})  # not under test
    monkeypatch.setattr(compute, "train_clone", lambda *a, **k: None)
    t = tiny_task(scenario(tmp_path), pool_seeds=4, stratum_episodes=2, heuristics=("lars",))
    tuned = {"lars": {"params": {}, "train_objective": 0.5}, "reference": "lars"}
    tr = compute.compute_task(t, tmp_path / "r", tuned=tuned)
    assert tr["strata"]["all"] != tr["strata"]["hard"]  # an episode's place differs between the strata
    got = evaluate_agent(t, tr, "random")
    for stratum, keys in tr["strata"].items():
        assert got[stratum] == [tr["episodes"][k]["scores"]["random"] for k in keys], stratum


def _write_results(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "v1.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("argv, says", [
    (["--tasks", "nope"], "unknown 'nope'"),
    (["--tasks", ","], "empty item in a comma list"),
    (["--tasks", " ,"], "empty item in a comma list"),  # not "no task"
    (["--tasks", "overload-burst,overload-burst"], "named twice"),
    (["--tasks", "x" * 5000], "..."),
    (["--tasks", "mooncake-1i"], "not in the results"),
    (["--tasks", "overload-burst", "--agents", ","], "empty item in a comma list"),
    (["--tasks", "overload-burst", "--agents", "fcfs,random,fcfs"], "given twice: fcfs"),
    (["--tasks", "overload-burst", "--episodes", "2"], "give --agents"),
    (["--tasks", "overload-burst", "--jobs", "2"], "give --compute"),
    (["--tasks", "overload-burst", "--agents", "fcfs", "--episodes", "3"], "at most 2"),  # not clipped to 2
    (["--tasks", "overload-burst", "--compute", "--out", "o"], "--compute writes and reads its results in --out"),
])
def test_leaderboard_flags_that_name_nothing_or_twice_are_refused_in_one_line(argv, says, tmp_path, capsys):
    """--tasks / --agents that named no, an absent or the same task or agent twice were dropped or
    deduplicated silently (two checkpoints called final.zip: one row, the second's scores), or a
    task missing from the results file ended in a KeyError traceback."""
    from kvsched.experiments.cli import main

    folder = _write_results(tmp_path / "r", fake_results(2))
    assert main(["leaderboard", "--results", str(folder), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err) < 600


@pytest.mark.parametrize("sidecar, says", [
    ({"algo": "ppo", "env_id": "kvsched/Scheduling-v0"}, "not a loadable 'ppo' checkpoint"),
    ("{not json", "not readable JSON"),
    ({"env_id": "kvsched/Scheduling-v0"}, "algo"),
    ([1, 2], "env_id and algo"),
    ({"algo": "ppo", "env_id": "kvsched/Routing-v0"}, "was trained on 'kvsched/Routing-v0'"),  # before loading
])
def test_a_broken_or_foreign_checkpoint_is_a_config_error_not_a_traceback(sidecar, says, tmp_path):
    pytest.importorskip("gymnasium")
    from kvsched.experiments.suite.agents import evaluate_agent
    from test_suite import scenario, tiny_task

    t = tiny_task(scenario(tmp_path))
    ckpt = tmp_path / "final.zip"
    ckpt.write_bytes(b"not a zip")
    (tmp_path / "final.json").write_text(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
    with pytest.raises(ConfigError, match=says):  # trusted: the file's content is what is checked here
        evaluate_agent(t, fake_results(1)["tasks"]["overload-burst"], str(ckpt), trust=True)


def test_a_checkpoint_of_other_spaces_is_refused_not_run_in_an_environment_of_its_own_choosing(tmp_path):
    """The checkpoint's k (or action mode) used to replace the task's, so an agent was scored in an
    environment that was not the task's."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO

    from kvsched.experiments.suite.agents import evaluate_agent
    from kvsched.experiments.suite.runs import make_env
    from test_suite import scenario, tiny_task

    t = tiny_task(scenario(tmp_path))
    env = make_env(t, "lars", {}, split="train", k=8)
    PPO("MlpPolicy", env, n_steps=8, batch_size=8, device="cpu").save(tmp_path / "k8.zip")
    env.close()
    (tmp_path / "k8.json").write_text(json.dumps({"algo": "ppo", "env_id": t.env_id, "env_kwargs": {"k": 8}}))
    with pytest.raises(ConfigError, match="observes shape"):
        evaluate_agent(t, fake_results(1)["tasks"]["overload-burst"], str(tmp_path / "k8.zip"), trust=True)


def _edit(path: str, value):
    def apply(data):
        *head, last = path.split("/")
        d = data
        for k in head:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return apply


T = "tasks/overload-burst"


@pytest.mark.parametrize("edit, says", [
    (_edit("tasks", []), "tasks=[]"),
    (_edit(f"{T}/strata", KeyError), "tuning, strata and episodes"),
    (_edit(f"{T}/strata/all", ["9:9"]), "strata.all"),
    (_edit(f"{T}/strata/all", ["1048576:0", "1048576:0"]), "distinct"),
    (_edit(f"{T}/episodes/1048576:0/scores/fcfs (default)", "0.5"), "scores.fcfs (default)='0.5'"),
    (_edit(f"{T}/episodes/1048576:0/scores/fcfs (default)", 1.5), "in [0, 1]"),
    (_edit(f"{T}/episodes/1048576:1/scores/extra", 0.1), "the baselines"),
    (_edit(f"{T}/episodes/1048576:0/bound/score", 0.45), ">= every baseline"),
    (_edit(f"{T}/episodes/1048576:0/isolation", None), None),  # allowed: an empty episode's
    (_edit(f"{T}/tuning/reference", "nope"), "tuning.reference='nope'"),
    (_edit(f"{T}/tuning/lars/journal", KeyError), "scores of the reference lars (default)"),
])
def test_a_hand_edited_results_file_is_refused_naming_the_field_not_a_traceback(edit, says, tmp_path, capsys):
    """A results file missing a part or with a bad score ended in KeyError / TypeError tracebacks, or
    (a bound below a baseline) in a leaderboard with a negative headroom."""
    from kvsched.experiments.cli import main

    data = fake_results(2)
    edit(data)
    folder = _write_results(tmp_path / "r", data)
    code = main(["leaderboard", "--results", str(folder), "--json"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if says is None:
        assert code == 0
    else:
        assert code == 2 and says in err and str(folder / "v1.json") in err, err


def test_results_of_another_definition_of_the_task_are_not_compared_with_an_agent_on_this_one(tmp_path):
    pytest.importorskip("gymnasium")
    from kvsched.experiments.suite.agents import evaluate_agent
    from kvsched.experiments.suite.compute import task_record
    from test_suite import scenario, tiny_task

    t = tiny_task(scenario(tmp_path))
    tr = fake_results(1)["tasks"]["overload-burst"]
    tr["task"] = json.loads(json.dumps(task_record(tiny_task(t.scenario, window_s=20.0))))
    with pytest.raises(ConfigError, match="another definition"):
        evaluate_agent(t, tr, "fcfs")


@pytest.mark.parametrize("field, value, says", [
    ("task_id", "tâsk", "BenchTask.task_id"),
    ("suite", "", "BenchTask.suite"),
    ("scenario", None, "BenchTask.scenario"),
    ("description", "  ", "BenchTask.description"),
    ("heuristics", ("fcfs", "larss"), "BenchTask.heuristics"),
    ("heuristics", ("fcfs", "fcfs", "lars"), "BenchTask.heuristics"),
    ("heuristics", ("llm-d", "lars"), "BenchTask.heuristics"),  # a router on a scheduling task
    ("tuned", ["lars"], "BenchTask.tuned"),
    ("tuned", ("fcfs",), "no search space"),  # nothing to tune without the residency knobs
    ("env_kwargs", {"k": 8}, "BenchTask.env_kwargs"),
    ("env_kwargs", (("split", "train"),), "BenchTask.env_kwargs"),  # the task sets the split itself
    ("env_kwargs", (("k", 8), ("k", 16)), "BenchTask.env_kwargs"),
    ("search", {"param_trials": 1}, "BenchTask.search"),
    ("instances", "4", "BenchTask.instances"),
    ("instances", -1, "BenchTask.instances"),
])
def test_a_bench_task_with_a_bad_field_is_refused_naming_it(field, value, says):
    """These were accepted (a typo of a heuristic failed hours later, after the pool was measured;
    a dict made the frozen record unhashable; instances='4' raised a TypeError)."""
    from kvsched.experiments.suite.tasks import BenchTask

    base = dict(task_id="t", suite="v1", description="d", lever="l", env_id="kvsched/Scheduling-v0", scenario="s",
                window_s=10.0, heuristics=("fcfs", "lars"), tuned=("lars",))
    with pytest.raises(ConfigError, match=says):
        BenchTask(**{**base, field: value})
    assert BenchTask(**{**base, "tuned": ("fcfs",), "tune_residency": True}).tuned == ("fcfs",)


def test_the_hindsight_search_counts_only_the_simulations_it_ran(tmp_path):
    """A start heuristic without parameters (priority) runs no per-episode trials; evals counted
    the budget's trials anyway."""
    pytest.importorskip("gymnasium")
    from kvsched.experiments.suite.episodes import pool
    from kvsched.experiments.suite.search import Schedule, hindsight
    from kvsched.experiments.suite.tasks import SearchBudget
    from test_suite import scenario, tiny_task

    t = tiny_task(scenario(tmp_path), search=SearchBudget(param_trials=5, local_evals=2))
    out = hindsight(t, pool(t)[0], {"priority (default)": (0.0, Schedule("priority", {}))})
    assert out["param_score"] is None and out["evals"] <= 2


def test_the_printed_leaderboard_names_each_tables_stratum(tmp_path, capsys):
    """"[hard, 24 episodes]" in a table's title was read as rich markup and vanished: the all and
    hard tables had the same title."""
    from kvsched.experiments.cli import main

    folder = _write_results(tmp_path / "r", fake_results(2))
    assert main(["leaderboard", "--results", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "overload-burst [all, 2 episodes]" in out and "overload-burst [hard, 2 episodes]" in out


def test_a_results_folder_of_a_huge_or_unreadable_name_is_one_bounded_line(tmp_path, capsys):
    from kvsched.experiments.cli import main

    for folder in (tmp_path / ("q" * 3000), tmp_path / "missing"):
        assert main(["leaderboard", "--results", str(folder)]) == 2
        err = capsys.readouterr().err
        assert "results" in err and len(err) < 400 and "Traceback" not in err
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "v1.json").write_bytes(b"\x00\xff{")
    assert main(["leaderboard", "--results", str(tmp_path / "bin")]) == 2
    assert "not a readable results file" in capsys.readouterr().err
