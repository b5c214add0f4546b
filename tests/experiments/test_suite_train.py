"""``kvsched train --task``: an agent of a bench task trains in the task's environment, with the
tuned best heuristic of the suite's results as its reference, and never selects a checkpoint on
the held-out windows the leaderboard uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from installed import needs  # noqa: E402

pytestmark = needs("sb3_contrib")  # imported by the tests, not at collection

from bench_fixtures import planted_results  # noqa: E402

from kvsched.experiments.cli import main  # noqa: E402
from kvsched.experiments.suite.results import FORMAT  # noqa: E402

TUNED = {"kappa": 3.5, "min_chunk_tokens": 96}


def results(folder: Path) -> Path:
    return planted_results(folder, "overload-burst", TUNED)


def test_train_task_uses_the_tasks_environment_and_tuned_reference_and_evaluates_on_train_windows(tmp_path, capsys):
    res = results(tmp_path / "res")
    out = tmp_path / "run"
    rc = main(["train", "--task", "overload-burst", "--suite-results", str(res), "--algo", "maskable_ppo",
               "--timesteps", "64", "--hyperparameters", '{"n_steps": 32, "batch_size": 32, "n_epochs": 1}',
               "--eval-every", "32", "--eval-episodes", "1", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((out / "train.json").read_text())
    assert meta["env_id"] == "kvsched/Scheduling-v0" and meta["eval_split"] == "train"
    kw = meta["env_kwargs"]
    assert kw["scenario"] == "bench-v1-overload-burst" and kw["window_s"] == 30.0
    assert kw["reference_policy"] == "lars" and kw["reference_params"] == TUNED and "split" not in kw


@pytest.mark.parametrize("argv, needle", [
    (["--task", "overload-burst", "--env", "kvsched/Scheduling-v0"], "--env: set by --task 'overload-burst'"),
    (["--task", "overload-burst", "--window-s", "10"], "--window-s: set by --task"),
    (["--task", "overload-burst", "--env-kwargs", '{"scenario": "x.yaml"}'], "['scenario'] set by --task"),
    (["--task", "no-such-task"], "suite v1 has no task 'no-such-task'; tasks: kv-burst-tiers"),
    (["--task", "overload-burst", "--suite", "v9"], "unknown suite 'v9'"),
    (["--suite", "v1", "--suite-results", "x"], "--suite-results need --task"),
    ([], "--env or --task is required"),
])
def test_train_task_refuses_what_the_task_sets_and_unknown_tasks(tmp_path, capsys, argv, needle):
    res = results(tmp_path / "res")
    extra = [] if "--suite-results" in argv else ["--suite-results", str(res)] if "--task" in argv else []
    rc = main(["train", "--algo", "maskable_ppo", "--timesteps", "8", "--out", str(tmp_path / "o"), *argv, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_train_task_names_the_command_that_computes_missing_results(tmp_path, capsys):
    res = tmp_path / "res"
    res.mkdir()
    (res / "v1.json").write_text(json.dumps({"format": FORMAT, "tasks": {}}))
    rc = main(["train", "--task", "routing-stale", "--suite-results", str(res), "--algo", "ppo",
               "--timesteps", "8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "hold no task 'routing-stale'" in err and "--tasks routing-stale --compute" in err


def test_train_task_warm_starts_from_the_tasks_minari_dataset(tmp_path, capsys):
    """--bc-dataset with --task fits the new policy to the task's recorded tuned-heuristic
    demonstrations before RL (the reference's own dataset: action 0 everywhere)."""
    pytest.importorskip("minari")
    pytest.importorskip("jax")
    import gymnasium as gym
    from sb3_contrib import MaskablePPO

    from kvsched.experiments.suite.datasets import record
    from kvsched.experiments.suite.results import load_results
    from kvsched.experiments.suite.tasks import get_task

    res = results(tmp_path / "res")
    folder = tmp_path / "data" / "v1" / "overload-burst" / "minari"  # where kvsched leaderboard --datasets puts it
    record(get_task("v1", "overload-burst"), load_results("v1", res)["tasks"]["overload-burst"], 2, path=folder)
    out = tmp_path / "run"
    rc = main(["train", "--task", "overload-burst", "--suite-results", str(res), "--algo", "maskable_ppo",
               "--timesteps", "16", "--hyperparameters", '{"n_steps": 16, "batch_size": 16, "n_epochs": 1}',
               "--bc-dataset", str(folder), "--bc-epochs", "60", "--eval-every", "1000",
               "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    bc = json.loads((out / "train.json").read_text())["behaviour_cloning"]
    assert bc["dataset"] == "kvsched/overload-burst/lars-v1" and bc["episodes"] == 2 and bc["last_loss"] < 0.5
    model = MaskablePPO.load(str(out / "final.zip"), device="cpu")
    env = gym.make("kvsched/Scheduling-v0", **{**json.loads((out / "train.json").read_text())["env_kwargs"],
                                               "split": "train"})
    obs, info = env.reset(seed=5)
    assert list(model.predict(obs, action_masks=info["action_mask"], deterministic=True)[0]) == [0, 0, 0, 0]


def test_a_bc_dataset_that_is_not_there_is_named(tmp_path, capsys):
    res = results(tmp_path / "res")
    (tmp_path / "empty").mkdir()
    rc = main(["train", "--task", "overload-burst", "--suite-results", str(res), "--algo", "maskable_ppo",
               "--timesteps", "8", "--bc-dataset", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "no Minari dataset 'kvsched/overload-burst/lars-v1' there" in err


def test_train_task_takes_the_other_observation_version_of_its_environment(tmp_path):
    """--env kvsched/Scheduling-v1 with a Scheduling-v0 task trains on the task with observation
    version 1 (the task's own id is still refused as redundant, above)."""
    res = results(tmp_path / "res")
    out = tmp_path / "o"
    hp = json.dumps({"generations": 1, "pairs": 1, "windows": 1, "validation_windows": 0})
    assert main(["train", "--task", "overload-burst", "--suite-results", str(res), "--env", "kvsched/Scheduling-v1",
                 "--algo", "es", "--timesteps", "1", "--out", str(out), "--hyperparameters", hp, "--no-progress"]) == 0
    meta = json.loads((out / "train.json").read_text())
    assert meta["env_id"] == "kvsched/Scheduling-v1" and meta["env_kwargs"]["scenario"].endswith("overload-burst")
