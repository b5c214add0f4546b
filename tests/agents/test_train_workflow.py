"""The training workflow of ``kvsched train``: short runs checkpoint and evaluate by default, the
metadata is on disk from the start, budgets and SIGINT/SIGTERM stop a run with ``final.zip``
saved, and each evaluation logs serving metrics to TensorBoard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from installed import needs  # noqa: E402

pytestmark = needs("sb3_contrib")  # imported by the tests, not at collection

from kvsched.agents.callbacks import summary_metrics  # noqa: E402
from kvsched.agents.train import default_interval, train  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"n_steps": 16, "batch_size": 16, "n_epochs": 1}


def test_default_intervals_give_a_short_run_checkpoints_and_evaluations():
    assert default_interval(100) == 20 and default_interval(10_000_000) == 10_000 and default_interval(3) == 1


def test_a_short_run_checkpoints_evaluates_and_logs_serving_metrics_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 48, tmp_path, window_s=10.0, hyperparameters=SMALL,
                 eval_episodes=1, progress_bar=False, bench_headroom=0.04)
    assert meta["status"] == "finished" and meta["checkpoint_every"] == 9 and meta["eval_every"] == 9
    assert list((tmp_path / "checkpoints").glob("maskable_ppo_*_steps.zip"))
    assert (tmp_path / "eval" / "evaluations.npz").is_file()
    assert 0.0 <= meta["last_eval"]["slo_attainment"] <= 1.0 and "ttft_p99_s/all" in meta["last_eval"]
    assert json.loads((tmp_path / "train.json").read_text())["status"] == "finished"
    (run,) = (tmp_path / "tb").iterdir()
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/slo_attainment", "eval/goodput_rps", "eval/ttft_p99_s/all", "eval/tpot_p99_s/all",
            "eval/reference_slo_attainment", "eval/slo_attainment_vs_reference", "eval/bench_score_estimate"} <= tags
    last = meta["last_eval"]
    assert last["bench_score_estimate"] == pytest.approx(last["slo_attainment_vs_reference"] / 0.04)


def test_a_wall_budget_stops_the_run_and_saves_final_zip(tmp_path):
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 100_000, tmp_path, window_s=10.0, hyperparameters=SMALL,
                 progress_bar=False, max_wall_s=1e-6)
    assert meta["status"] == "stopped: wall budget" and meta["timesteps"] < 100_000
    assert (tmp_path / "final.zip").is_file() and not meta["stopped_by_cpu_budget"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_budgets_that_are_not_positive_finite_seconds_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="--max-wall-s=.* is not allowed: expected a finite number of seconds > 0"):
        train("kvsched/Scheduling-v0", "maskable_ppo", 8, tmp_path, window_s=10.0, max_wall_s=bad,
              progress_bar=False)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_training_gracefully_with_metadata_from_the_start(tmp_path, sig):
    code = ("import sys; from kvsched.agents.train import train\n"
            "train('kvsched/Scheduling-v0', 'maskable_ppo', 10_000_000, sys.argv[1], window_s=10.0, "
            "hyperparameters={'n_steps': 16, 'batch_size': 16, 'n_epochs': 1}, checkpoint_every=16, "
            "eval_every=10_000_000, progress_bar=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "checkpoints").glob("*.zip")):  # training is under way
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        assert json.loads((tmp_path / "train.json").read_text())["status"] == "running"
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    meta = json.loads((tmp_path / "train.json").read_text())
    assert meta["status"] == f"stopped: signal {signal.Signals(sig).name}" and (tmp_path / "final.zip").is_file()


def test_summary_metrics_average_what_each_episode_has():
    s1 = {"classes": {"all": {"slo": {"attainment": 1.0}, "goodput_rps": 2.0, "ttft_s": {"p99": 0.2},
                              "tpot_s": {"p99": None}},
                      "short": {"ttft_s": {"p99": 0.1}, "tpot_s": {"p99": 0.02}}}}
    s2 = {"classes": {"all": {"slo": {"attainment": 0.5}, "goodput_rps": 4.0, "ttft_s": {"p99": 0.4},
                              "tpot_s": {"p99": 0.05}}}}
    m = summary_metrics([s1, s2])
    assert m == pytest.approx({"slo_attainment": 0.75, "goodput_rps": 3.0, "ttft_p99_s/all": 0.3,
                               "tpot_p99_s/all": 0.05, "ttft_p99_s/short": 0.1, "tpot_p99_s/short": 0.02})
    assert summary_metrics([]) == {}


def test_evaluations_pair_the_agent_with_its_reference_on_the_same_windows(tmp_path):
    """An agent that always plays action 0 *is* the reference: its paired difference to the
    reference on the evaluation windows is exactly 0 (a window mismatch would show)."""
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 32, tmp_path, window_s=10.0, hyperparameters=SMALL,
                 eval_episodes=3, eval_every=32, progress_bar=False, reference_bias=50.0, eval_split="train")
    last = meta["last_eval"]
    assert last["slo_attainment_vs_reference"] == 0.0
    assert last["reference_slo_attainment"] == pytest.approx(last["slo_attainment"])


def test_default_intervals_follow_the_whole_rollouts_an_on_policy_run_takes(tmp_path):
    # 20 steps with rollouts of 16 x 2 environments take 32: a fifth of 32 (6), not of 20 (4),
    # so a short PPO run evaluates about five times, not once per few steps
    meta = train("kvsched/Scheduling-v0", "maskable_ppo", 20, tmp_path, window_s=10.0, n_envs=2,
                 hyperparameters=SMALL, eval_episodes=1, progress_bar=False)
    assert meta["timesteps"] == 32 and meta["checkpoint_every"] == 6 and meta["eval_every"] == 6


def test_planned_timesteps_rounds_up_to_whole_rollouts_for_on_policy_algorithms_only():
    from types import SimpleNamespace

    from sb3_contrib import MaskablePPO

    from kvsched.agents.train import planned_timesteps

    model = MaskablePPO.__new__(MaskablePPO)
    model.n_steps, model.n_envs = 128, 8
    assert planned_timesteps(model, 500) == 1024 and planned_timesteps(model, 1024) == 1024
    assert planned_timesteps(SimpleNamespace(n_steps=128, n_envs=8), 500) == 500
