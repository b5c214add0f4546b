"""RLlib (the `ray` extra): every env builds from one env_config dict, Scheduling-v0's mask
reaches RLlib's action-masking module and is honoured, a few PPO iterations train on
Knobs-v0 with a checkpoint and learning curve, and an RLlib policy acts through the SB3
`predict` signature. Skips with a message when Ray is not installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from installed import needs  # noqa: E402

# located, not imported, at collection (Ray and RLlib take seconds to import)
pytestmark = needs("ray", "gymnasium", reason="RLlib tests need the `ray` extra: pip install -e '.[ray]'")

from kvsched.agents.rllib import RLLIB_ENVS, RLlibAgent, env_creator, rllib_env_kwargs, train_rllib  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

SMALL = {"train_batch_size_per_learner": 64, "minibatch_size": 32, "num_epochs": 1}


@pytest.mark.parametrize("env_id", RLLIB_ENVS)
def test_every_env_builds_from_one_env_config(env_id):
    env = env_creator({"env_id": env_id, "window_s": 20.0})
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    if env_id == "kvsched/Scheduling-v0":
        assert set(obs) == {"observations", "action_mask"}
        assert np.array_equal(obs["action_mask"], env.unwrapped.action_masks().astype(np.float32))
        assert env.action_space.n == obs["action_mask"].shape[0]
    env.close()


def test_bad_env_config_is_rejected():
    with pytest.raises(ConfigError, match="needs 'env_id'"):
        env_creator({"window_s": 20.0})
    with pytest.raises(ConfigError, match="RLlib trains on"):
        rllib_env_kwargs("CartPole-v1", {})
    with pytest.raises(ConfigError, match="action_mode='slot'"):
        rllib_env_kwargs("kvsched/Scheduling-v0", {"action_mode": "multi"})
    with pytest.raises(ConfigError, match="num-env-runners"):
        train_rllib("kvsched/Knobs-v0", 10, "/tmp/unused", num_env_runners=-1)


def test_ppo_trains_on_knobs_with_checkpoint_and_curve(tmp_path):
    meta = train_rllib("kvsched/Knobs-v0", 128, tmp_path, window_s=20.0, seed=0, hyperparameters=SMALL)
    assert meta["backend"] == "rllib" and meta["timesteps"] >= 128
    assert meta["iterations"] == len(meta["learning_curve"]) >= 2
    assert (tmp_path / "checkpoint" / "learner_group" / "learner" / "rl_module" / "default_policy").is_dir()
    assert json.loads((tmp_path / "train.json").read_text())["env_id"] == "kvsched/Knobs-v0"
    agent = RLlibAgent(tmp_path / "checkpoint", masked=False)
    env = env_creator({"env_id": "kvsched/Knobs-v0", "window_s": 20.0})
    obs, _ = env.reset(seed=0)
    action, _ = agent.predict(obs, deterministic=True)
    assert env.action_space.shape == action.shape


def test_scheduling_agent_honours_the_action_mask(tmp_path):
    train_rllib("kvsched/Scheduling-v0", 64, tmp_path, window_s=20.0, seed=1, hyperparameters=SMALL)
    agent = RLlibAgent(tmp_path / "checkpoint", masked=True)
    env = env_creator({"env_id": "kvsched/Scheduling-v0", "window_s": 20.0, "split": "heldout"})
    obs, _ = env.reset(seed=2)
    steps = violations = 0
    done = False
    while not done:
        mask = obs["action_mask"].astype(bool)
        a, _ = agent.predict(obs["observations"], deterministic=False, action_masks=mask)
        violations += not mask[int(a)]
        obs, _, term, trunc, info = env.step(a)
        steps += 1
        done = term or trunc
    assert steps > 10 and violations == 0
    assert not info.get("invalid_action", False)


def test_cli_trains_with_rllib_and_evaluate_loads_it(tmp_path, capsys):
    from kvsched.experiments.cli import main

    out = tmp_path / "rl"
    rc = main(["train", "--backend", "rllib", "--env", "kvsched/Scheduling-v0", "--algo", "ppo", "--timesteps", "64",
               "--window-s", "20", "--out", str(out), "--no-progress",
               "--hyperparameters", json.dumps(SMALL)])
    assert rc == 0 and (out / "learning_curve.png").is_file()
    rc = main(["evaluate", "--agents", f"{out / 'checkpoint'},fcfs", "--windows", "1", "--seeds", "1",
               "--out", str(tmp_path / "ev")])
    assert rc == 0
    import pandas as pd
    table = pd.read_csv(tmp_path / "ev" / "table.csv")
    assert set(table.agent) == {"checkpoint", "fcfs"}
    assert main(["train", "--backend", "rllib", "--env", "kvsched/Knobs-v0", "--algo", "sac", "--timesteps", "8",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--algo 'sac' is not allowed" in capsys.readouterr().err


def test_evaluate_on_ray_gives_the_local_table(tmp_path):
    import pandas as pd

    from kvsched.agents.evaluate import evaluate

    local = evaluate(["fcfs", "lars"], None, 1, 2, tmp_path / "a", window_s=20.0)
    remote = evaluate(["fcfs", "lars"], None, 1, 2, tmp_path / "b", window_s=20.0, backend="ray")
    pd.testing.assert_frame_equal(local, remote)
    assert (tmp_path / "a" / "episodes.csv").read_bytes() == (tmp_path / "b" / "episodes.csv").read_bytes()
