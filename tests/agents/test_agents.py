"""Training, evaluation and reference agents (issue #6). Smoke-sized: seconds each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from installed import needs  # noqa: E402

pytestmark = needs("stable_baselines3", "sb3_contrib")  # imported by the tests, not at collection

from kvsched.agents.evaluate import confidence_table, evaluate  # noqa: E402
from kvsched.agents.train import train  # noqa: E402
from kvsched.envs import ENV_IDS  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.experiments.cli import main  # noqa: E402

SMALL = {"max_requests": 25}
_HERE = str(Path(__file__).parent)  # a folder that exists wherever pytest runs from
PPO_TINY = {"n_steps": 32, "batch_size": 32, "n_epochs": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 64, out, window_s=10.0, env_kwargs=SMALL,
                 checkpoint_every=32, eval_every=32, eval_episodes=1, progress_bar=False, hyperparameters=PPO_TINY)
    return out, meta


def test_maskable_ppo_smoke_checkpoints_eval_and_resume(trained):
    out, meta = trained
    assert meta["timesteps"] == 64 and meta["env_steps_per_s"] > 0
    assert (out / "final.zip").is_file() and (out / "checkpoints" / "maskable_ppo_32_steps.zip").is_file()
    ev = np.load(out / "eval" / "evaluations.npz")
    assert list(ev["timesteps"]) == [32, 64]
    assert any((out / "tb").rglob("events.out.tfevents*"))
    saved = json.loads((out / "train.json").read_text())
    assert saved["env_kwargs"] == {"window_s": 10.0, "max_requests": 25}
    out2 = out / "resumed"
    meta2 = train("kvsched/Scheduling-v0", "maskable_ppo", 32, out2, window_s=10.0, env_kwargs=SMALL,
                  checkpoint_every=32, eval_every=32, eval_episodes=1, progress_bar=False,
                  resume=out / "final.zip", n_envs=2, hyperparameters={"n_steps": 16})
    assert meta2["total_timesteps"] == 96 and meta2["resumed_from"].endswith("final.zip")
    assert meta2["hyperparameters"] == {"n_steps": 16}


@pytest.mark.parametrize("env_id,algo,hp", [
    ("kvsched/Scheduling-v0", "dqn", {"learning_starts": 16, "batch_size": 16}),
    ("kvsched/Routing-v0", "ppo", PPO_TINY),
    ("kvsched/Knobs-v0", "sac", {"learning_starts": 4, "batch_size": 4}),
])
def test_other_algorithms_train(tmp_path, env_id, algo, hp):
    steps = 8 if algo == "sac" else 32
    meta = train(env_id, algo, steps, tmp_path, window_s=10.0, env_kwargs=SMALL, checkpoint_every=1000,
                 eval_every=1000, eval_episodes=1, progress_bar=False, hyperparameters=hp)
    assert meta["timesteps"] >= steps and (tmp_path / "final.zip").is_file()
    if algo == "dqn":
        assert meta["env_kwargs"]["action_mode"] == "slot"


def test_incompatible_algorithm_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="Box"):
        train("kvsched/Scheduling-v0", "sac", 8, tmp_path, progress_bar=False)
    with pytest.raises(ConfigError, match="algo"):
        train("kvsched/Scheduling-v0", "a2c", 8, tmp_path, progress_bar=False)


def test_confidence_table_is_a_student_t_interval():
    df = pd.DataFrame({"agent": ["a"] * 4, "class": ["all"] * 4, "slo_attainment": [0.9, 1.0, 0.8, 0.9],
                       "goodput_rps": [1.0, 1.0, 1.0, 1.0], "ttft_p99_s": [0.1, 0.2, 0.3, 0.4]})
    t = confidence_table(df).iloc[0]
    # t(0.975, 3) = 3.182446; sd = 0.0816497; half = 3.182446 * 0.0816497 / 2
    assert t["slo_attainment"] == pytest.approx(0.9)
    assert t["slo_attainment_ci95"] == pytest.approx(3.182446 * 0.0816497 / 2, rel=1e-5)
    assert t["goodput_rps_ci95"] == 0.0


def test_evaluate_learned_and_heuristics_same_episodes(trained, tmp_path):
    out, _ = trained
    table = evaluate([str(out / "final.zip"), "fcfs", "lars", "random"], None, windows=1, seeds=2, out=tmp_path,
                     stochastic=True)
    assert set(table["agent"]) == {"final.zip", "final.zip (stochastic)", "fcfs", "lars", "random"}
    eps = pd.read_csv(tmp_path / "episodes.csv")
    allc = eps[eps["class"] == "all"]
    assert (allc.groupby("agent")["requests"].apply(list).apply(lambda x: x == [25, 25])).all()
    # a second run gives the same table (seeded random and stochastic agents)
    again = evaluate([str(out / "final.zip"), "random"], None, windows=1, seeds=2, out=tmp_path / "b", stochastic=True)
    first = table.set_index(["agent", "class"]).loc[again.set_index(["agent", "class"]).index]
    assert np.allclose(first["slo_attainment"].to_numpy(), again.set_index(["agent", "class"])["slo_attainment"])
    for f in ("table.csv", "table.md", "ttft_cdf.png", "learning_curve.png"):
        assert (tmp_path / f).is_file()
    row = table[(table["agent"] == "fcfs") & (table["class"] == "all")].iloc[0]
    assert 0 <= row["slo_attainment"] <= 1 and not math.isnan(row["slo_attainment_ci95"])


def test_evaluate_by_default_takes_the_held_out_windows_the_scenario_holds(tmp_path, capsys):
    """The default scenario (600 s, 60 s windows, a quarter held out) holds 3 held-out windows:
    `kvsched evaluate --agents fcfs` used to fail on its default of 4; it now evaluates the 3,
    and an explicit 4 is still an error naming the count."""
    table = evaluate(["fcfs"], None, None, 1, tmp_path / "a")
    assert table.attrs["windows"] == 3 and int(table["episodes"].iloc[0]) == 3
    with pytest.raises(ConfigError, match="--windows=4 is more than the 3 held-out windows"):
        evaluate(["fcfs"], None, 4, 1, tmp_path / "b")
    assert main(["evaluate", "--agents", "fcfs", "--seeds", "1", "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    assert "held-out evaluation (3 windows x 1 seed; mean ± 95% CI)" in capsys.readouterr().out


def test_cli_train_and_evaluate(tmp_path, capsys, monkeypatch):
    """... and off a terminal both print progress lines (kvsched.experiments.progress; interval 0)."""
    monkeypatch.setenv("KVSCHED_PROGRESS_INTERVAL_S", "0")
    out = tmp_path / "run"
    rc = main(["train", "--env", "kvsched/Scheduling-v0", "--algo", "maskable_ppo", "--timesteps", "32",
               "--window-s", "10", "--env-kwargs", json.dumps(SMALL), "--hyperparameters", json.dumps(PPO_TINY),
               "--out", str(out), "--checkpoint-every", "32", "--eval-every", "32", "--eval-episodes", "1"])
    assert rc == 0 and (out / "final.zip").is_file()
    assert "kvsched train: 32/32 env steps" in capsys.readouterr().err
    rc = main(["evaluate", "--agents", f"{out / 'final.zip'},fcfs", "--windows", "1", "--seeds", "2",
               "--out", str(tmp_path / "ev")])
    text, err = capsys.readouterr()
    assert rc == 0 and "fcfs" in text and "±" in text
    assert "kvsched evaluate: " in err and " episodes" in err, err
    rc = main(["train", "--env", "kvsched/Scheduling-v0", "--algo", "maskable_ppo", "--timesteps", "32",
               "--env-kwargs", "[1]", "--out", str(out)])
    assert rc == 2 and "--env-kwargs" in capsys.readouterr().err


def test_resume_from_a_file_that_is_no_checkpoint_or_of_another_environment(trained, tmp_path, capsys):
    """Each was a traceback: SB3's ValueError on a file that is not a zip, and on a checkpoint
    whose spaces are another environment's."""
    bad = tmp_path / "notes.zip"
    bad.write_text("not a zip")
    ckpt = trained[0] / "final.zip"
    for env, resume in (("kvsched/Scheduling-v0", bad), ("kvsched/Routing-v0", ckpt)):
        rc = main(["train", "--env", env, "--algo", "maskable_ppo", "--timesteps", "32", "--window-s", "10",
                   "--out", str(tmp_path / "run"), "--no-progress", "--resume", str(resume),
                   *(["--trust-checkpoint"] if resume == bad else [])])  # kvsched did not write notes.zip
        err = capsys.readouterr().err
        assert rc == 2 and f"--resume {str(resume)!r} is not a MaskablePPO checkpoint of {env}" in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("extra, fragment", [
    # each was a traceback: TypeError from gymnasium.make / the SB3 constructor, SB3's
    # AssertionError, FileNotFoundError from SB3's load
    (["--env-kwargs", '{"windw_s": 5}'],
     "--env-kwargs: ['windw_s'] not allowed: expected arguments of kvsched/Scheduling-v0"),
    (["--env-kwargs", '{"split": "all"}'], "--env-kwargs: ['split'] not allowed"),  # train sets it (was overridden)
    (["--hyperparameters", '{"n_step": 64}'], "--hyperparameters: ['n_step'] not allowed: expected arguments of PPO"),
    (["--hyperparameters", '{"seed": 3}'], "--hyperparameters: ['seed'] not allowed"),  # --seed's job
    (["--hyperparameters", '{"n_steps": 0}'], "--hyperparameters: n_steps=0 is not allowed: expected an integer >= 1"),
    (["--hyperparameters", '{"policy_kwargs": {"foo": 1}}'], "PPO refused them"),  # the policy's TypeError
    (["--resume", "no-such-checkpoint.zip"], "--resume 'no-such-checkpoint.zip' does not exist"),
    (["--resume", _HERE], f"--resume {_HERE!r} is a folder (expected a checkpoint .zip)"),
])
def test_cli_train_bad_arguments_are_clean_errors(tmp_path, capsys, extra, fragment):
    rc = main(["train", "--env", "kvsched/Scheduling-v0", "--algo", "ppo", "--timesteps", "32", "--window-s", "10",
               "--out", str(tmp_path / "run"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "run" / "final.zip").exists()


def test_evaluate_random_keeps_the_checkpoints_reference_parameters(tmp_path, monkeypatch):
    """The random agent acts in the checkpoint's environment with every training argument, the
    reference policy's parameters included (they were dropped: it ran on the defaults)."""
    import kvsched.agents.evaluate as ev

    seen = []
    real = ev.run_random

    def spy(episodes, scenario, window_s, env_kwargs, env_id="kvsched/Scheduling-v0"):
        seen.append(dict(env_kwargs))
        return real(episodes, scenario, window_s, env_kwargs, env_id)

    monkeypatch.setattr(ev, "run_random", spy)
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 32, tmp_path / "t", window_s=10.0,
                 env_kwargs={**SMALL, "reference_policy": "lars", "reference_params": {"kappa": 2.0}},
                 checkpoint_every=32, eval_every=32, eval_episodes=1, progress_bar=False, hyperparameters=PPO_TINY)
    assert meta["timesteps"] == 32
    evaluate([str(tmp_path / "t" / "final.zip"), "random"], None, windows=1, seeds=1, out=tmp_path / "e")
    assert seen and seen[0]["reference_params"] == {"kappa": 2.0} and seen[0]["reference_policy"] == "lars"


def test_evaluate_takes_scheduling_v1_and_its_agents_act_as_in_v0(tmp_path):
    """`kvsched evaluate --env kvsched/Scheduling-v1` (train accepts it; evaluate's choices once
    lacked it): v1 differs from v0 only in what it observes, so a heuristic and the seeded random
    agent give the same table in both."""
    tables = {}
    for v in ("v0", "v1"):
        out = tmp_path / v
        assert main(["evaluate", "--env", f"kvsched/Scheduling-{v}", "--agents", "lars,random", "--windows", "1",
                     "--seeds", "1", "--window-s", "10", "--out", str(out), "--no-progress"]) == 0
        tables[v] = (out / "table.csv").read_text()
    assert tables["v0"] == tables["v1"] and "random" in tables["v1"]


def test_evaluate_agents_of_the_routing_and_knobs_environments(tmp_path):
    """evaluate takes agents of every environment: routers (Routing-v0), the heuristic
    (Knobs-v0), random, and a checkpoint trained there."""
    meta = train("kvsched/Routing-v0", "ppo", 32, tmp_path / "r", window_s=10.0, env_kwargs=SMALL,
                 checkpoint_every=32, eval_every=32, eval_episodes=1, progress_bar=False,
                 hyperparameters={"n_steps": 32, "batch_size": 32, "n_epochs": 1})
    assert meta["env_id"] == "kvsched/Routing-v0"
    table = evaluate([str(tmp_path / "r" / "final.zip"), "least-loaded", "round-robin", "random"], None, windows=1,
                     seeds=1, out=tmp_path / "er")
    assert set(table["agent"]) == {"final.zip", "least-loaded", "round-robin", "random"}
    with pytest.raises(ConfigError, match="router of kvsched/Routing-v0"):
        evaluate(["lars"], None, 1, 1, tmp_path / "x", env_id="kvsched/Routing-v0")
    table = evaluate(["lars", "random"], None, windows=1, seeds=1, out=tmp_path / "ek", env_id="kvsched/Knobs-v0")
    assert set(table["agent"]) == {"lars", "random"}


class _Stop(Exception):
    """Raised by a stand-in for the episode runner: the test needs only the tasks."""


_AGENT_OF = {"kvsched/Routing-v0": "round-robin", "kvsched/PDRouting-v0": "round-robin",
             "kvsched/Residency-v0": "lru"}


@pytest.mark.parametrize("env_id", ENV_IDS)  # every id: a new environment gets its default checked too
def test_evaluate_without_a_scenario_draws_the_windows_of_the_scenario_the_environment_serves(
        env_id, tmp_path, monkeypatch):
    """With neither ``--scenario`` nor a checkpoint, the held-out windows come from the scenario
    ``gymnasium.make(env_id)`` serves (Residency-v0 and PDRouting-v0 have their own): they used to
    come from mixed-long-short for every id, an unrelated error for those two."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    import kvsched.runner.sweep as sweep

    seen = []

    def tasks_only(fn, tasks, **kw):
        seen.extend(tasks)
        raise _Stop

    monkeypatch.setattr(sweep, "map_tasks", tasks_only)
    with pytest.raises(_Stop):
        evaluate(["random", _AGENT_OF.get(env_id, "fcfs")], None, 1, 1, tmp_path, env_id=env_id)
    served = gym.make(env_id).unwrapped.source.scenario.name
    # the scenario each task serves (None: the environment's own) and the heuristic's window source
    served_by = ({served if t[3] is None else Path(t[3]).stem for t in seen}
                 | {t[7].scenario.name for t in seen if t[0] == "heuristic"})
    assert served_by == {served}
