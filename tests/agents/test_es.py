"""The evolution-strategy learner: it starts exactly at the reference, never takes a masked
choice, climbs its search gradient, and its checkpoints go where the other learners' go
(kvsched evaluate, kvsched leaderboard)."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsched.envs  # noqa: F401
from kvsched.agents.es import ESConfig, LinearScheduler, centred_ranks, es_gradient, play
from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.cli import main

NVEC = [16, 7, 5, 4]


def test_initial_parameters_play_the_reference_exactly():
    env = gym.make("kvsched/Scheduling-v0", reference_policy="lars", max_requests=60)
    start = LinearScheduler(16, NVEC)
    got, steps = play(env, start, seed=3)
    obs, info = env.reset(seed=3)
    while True:
        obs, _, term, trunc, info = env.step(np.zeros(4, dtype=np.int64))
        if term or trunc:
            break
    assert steps > 10 and got == info["summary"]["classes"]["all"]["slo"]["attainment"]


def test_a_capped_episode_counts_every_unserved_request_as_missed():
    env = gym.make("kvsched/Scheduling-v0", reference_policy="lars", max_requests=60)
    start = LinearScheduler(16, NVEC)
    full, steps = play(env, start, seed=3)
    capped, n = play(env, start, seed=3, max_steps=steps // 3)
    # the same decisions, counted by the reward (+1 per request finishing within its SLO)
    obs, info = env.reset(seed=3)
    met = 0.0
    for _ in range(steps // 3):
        obs, _, _, _, info = env.step(start.act(obs, info["action_mask"]))
        met += info["reward_components"]["slo_met"]
    assert n == steps // 3 and 0 < capped < full
    assert capped == met / len(env.unwrapped.workload)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_masked_choice_is_never_taken(seed):
    g = np.random.default_rng(seed)
    pol = LinearScheduler(16, NVEC, g.normal(0, 3, LinearScheduler(16, NVEC).size()))
    obs = g.uniform(-1, 1, 16 * 9 + 10).astype(np.float32)
    mask = g.random(sum(NVEC)) < 0.5
    a = pol.act(obs, mask)
    start = 0
    for p, n in enumerate(NVEC):
        part = mask[start:start + n]
        assert part[a[p]] or (not part.any() and a[p] == 0)
        start += n


def test_search_gradient_points_up_a_linear_fitness():
    g = np.random.default_rng(0)
    direction = g.normal(size=20)
    eps = g.normal(size=(200, 20))
    fit = np.array([f for e in eps for f in (direction @ (0.1 * e), direction @ (-0.1 * e))])
    grad = es_gradient(eps, fit, 0.1)
    cos = grad @ direction / np.linalg.norm(grad) / np.linalg.norm(direction)
    assert cos > 0.8
    assert centred_ranks(np.array([3.0, 1.0, 2.0])).tolist() == [0.5, -0.5, 0.0]


def test_checkpoint_round_trip_and_bad_files(tmp_path):
    pol = LinearScheduler(16, NVEC, np.arange(LinearScheduler(16, NVEC).size(), dtype=float))
    pol.save(tmp_path / "p.zip")
    back = LinearScheduler.load(tmp_path / "p.zip")
    assert np.array_equal(back.theta, pol.theta) and back.nvec == NVEC
    (tmp_path / "bad.zip").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="not an es checkpoint"):
        LinearScheduler.load(tmp_path / "bad.zip")
    with pytest.raises(ConfigError, match="theta"):
        LinearScheduler(16, NVEC, np.zeros(3))


@pytest.mark.parametrize("hp, field", [({"pairs": 0}, "es.pairs"), ({"sigma": -1}, "es.sigma"),
                                       ({"popsize": 4}, "--hyperparameters"),
                                       ({"step_cap_factor": 0.5}, "es.step_cap_factor")])
def test_bad_settings_are_refused_naming_the_field(hp, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("-", r"\-")):
        ESConfig.from_mapping(hp)


def test_train_es_on_a_task_then_the_leaderboard_loads_it(tmp_path, capsys):
    out = tmp_path / "es"
    hp = json.dumps({"generations": 1, "pairs": 1, "windows": 1, "validation_windows": 1})
    assert main(["train", "--task", "overload-burst", "--algo", "es", "--timesteps", "1", "--out", str(out),
                 "--hyperparameters", hp, "--no-progress"]) == 0
    meta = json.loads((out / "train.json").read_text())
    assert meta["algo"] == "es" and meta["status"] == "finished" and meta["eval_split"] == "train"
    assert json.loads((out / "progress.json").read_text())[0]["generation"] == 1
    capsys.readouterr()
    assert main(["leaderboard", "--tasks", "overload-burst", "--agents", str(out / "final.zip"), "--episodes", "1",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["stratum"] for r in rows if r["agent"] == "final.zip" and r["kind"] == "agent"} == {"all", "hard"}


def test_options_es_does_not_have_are_refused(tmp_path, capsys):
    assert main(["train", "--task", "overload-burst", "--algo", "es", "--timesteps", "1", "--out", str(tmp_path),
                 "--reference-bias", "2"]) == 2
    assert "--reference-bias: not options of --algo es" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [(["--discount-time-s", "0.1"], "--algo es has no discount"),
                                             (["--env-kwargs", '{"reward": {"graded": true}}'],
                                              "--algo es ignores the environment's reward")])
def test_es_refuses_a_discount_or_reward_it_would_ignore(tmp_path, capsys, flags, expected):
    assert main(["train", "--task", "overload-burst", "--algo", "es", "--timesteps", "1", "--out", str(tmp_path),
                 *flags]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("kw, expected", [({"foo": 1}, "--env-kwargs: ['foo'] not allowed"),
                                          ({"action_mode": "slot"}, "action_mode"),
                                          ({"split": "heldout"}, "--env-kwargs: ['split'] not allowed")])
def test_es_refuses_environment_arguments_it_cannot_train_with(tmp_path, capsys, kw, expected):
    """An unknown name was a TypeError traceback from the environment's constructor, and
    action_mode "slot" an AttributeError (Discrete has no nvec); both now a one-line error."""
    hp = json.dumps({"generations": 1, "pairs": 1, "windows": 1, "validation_windows": 0})
    assert main(["train", "--env", "kvsched/Scheduling-v0", "--algo", "es", "--timesteps", "1", "--window-s", "5",
                 "--out", str(tmp_path), "--env-kwargs", json.dumps(kw), "--hyperparameters", hp,
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_each_generation_line_is_printed_once_off_a_terminal(tmp_path, capsys, monkeypatch):
    """Off a terminal the generation line came twice: plain, then again in the progress lines
    (`kvsched train: generation 1/1: ...`); the progress lines now count generations instead."""
    from kvsched.experiments.progress import INTERVAL_ENV

    monkeypatch.setenv(INTERVAL_ENV, "0")  # a progress line at every update
    hp = json.dumps({"generations": 1, "pairs": 1, "windows": 1, "validation_windows": 0})
    assert main(["train", "--env", "kvsched/Scheduling-v0", "--algo", "es", "--timesteps", "1", "--window-s", "5",
                 "--out", str(tmp_path), "--hyperparameters", hp]) == 0
    cap = capsys.readouterr()  # captured: not a terminal
    assert (cap.out + cap.err).count("generation 1/1:") == 1, (cap.out, cap.err)
    assert "kvsched train: 1/1 generations" in cap.err


def test_scheduling_v1_refuses_another_observation_version_in_env_kwargs(tmp_path, capsys):
    """kvsched/Scheduling-v1 with --env-kwargs observation_version=0 trained a version-0 agent
    recorded as Scheduling-v1 (the id's own argument silently overridden)."""
    assert main(["train", "--env", "kvsched/Scheduling-v1", "--algo", "es", "--timesteps", "1", "--window-s", "5",
                 "--out", str(tmp_path), "--env-kwargs", '{"observation_version": 0}', "--no-progress"]) == 2
    assert "['observation_version'] not allowed" in capsys.readouterr().err


def test_a_truncated_es_checkpoint_is_a_clean_error(tmp_path):
    """np.load raised zipfile.BadZipFile (a traceback in kvsched evaluate) on a truncated file."""
    LinearScheduler(16, NVEC).save(tmp_path / "p.zip")
    (tmp_path / "cut.zip").write_bytes((tmp_path / "p.zip").read_bytes()[:300])
    with pytest.raises(ConfigError, match="not an es checkpoint"):
        LinearScheduler.load(tmp_path / "cut.zip")


def test_batched_predict_without_masks_allows_everything():
    """predict on a batch without action_masks reshaped a single mask to the batch (ValueError)."""
    pol = LinearScheduler(16, NVEC)
    obs = np.zeros((3, 16 * 9 + 10), dtype=np.float32)
    actions, _ = pol.predict(obs)
    assert actions.shape == (3, 4) and not actions.any()


def test_a_signal_stops_es_after_the_generation_with_final_zip(tmp_path):
    """--max-wall-s's help says SIGINT/SIGTERM save final.zip; es installed no handler, so a
    signal killed the run with train.json left "running" and no final.zip."""
    import os
    import signal

    from kvsched.agents.es import train_es

    def interrupt(message):
        if message.startswith("generation 1/"):
            os.kill(os.getpid(), signal.SIGINT)

    meta = train_es("kvsched/Scheduling-v0", {"window_s": 5.0}, tmp_path,
                    ESConfig(generations=3, pairs=1, windows=1, validation_windows=1), progress=interrupt)
    assert meta["status"] == "stopped: signal SIGINT" and meta["generations"] == 1
    assert json.loads((tmp_path / "train.json").read_text())["status"] == "stopped: signal SIGINT"
    assert LinearScheduler.load(tmp_path / "final.zip").nvec == NVEC


def test_a_run_is_finished_after_its_generations_and_stopped_only_before_them(tmp_path):
    """--timesteps reached at the last generation asked for is a finished run, not a stopped one
    (``--hyperparameters '{"generations": 1}' --timesteps 500`` said "stopped: timesteps reached")."""
    from kvsched.agents.es import train_es

    kw = {"reference_policy": "lars", "max_requests": 30, "window_s": 10.0}
    one = ESConfig(generations=1, pairs=1, windows=1, validation_windows=0)
    assert train_es("kvsched/Scheduling-v0", kw, tmp_path / "a", one, max_steps=1)["status"] == "finished"
    two = ESConfig(generations=2, pairs=1, windows=1, validation_windows=0)
    meta = train_es("kvsched/Scheduling-v0", kw, tmp_path / "b", two, max_steps=1)
    assert meta["status"] == "stopped: timesteps reached" and meta["generations"] == 1


def test_same_parameters_give_the_same_checkpoint_bytes(tmp_path):
    """np.savez stamped each archive entry with the current time, so a re-run's checkpoint
    differed from the original in its bytes; entries now carry a fixed time."""
    import zipfile

    pol = LinearScheduler(16, NVEC, np.linspace(-1, 1, LinearScheduler(16, NVEC).size()))
    pol.save(tmp_path / "a.zip")
    pol.save(tmp_path / "b.zip")
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()
    with zipfile.ZipFile(tmp_path / "a.zip") as z:
        assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    assert np.array_equal(LinearScheduler.load(tmp_path / "a.zip").theta, pol.theta)
