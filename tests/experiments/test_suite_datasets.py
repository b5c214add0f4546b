"""kvsched bench's offline data (experiments/suite/datasets.py, agents/bc.py): the tuned
reference's rollouts are a Minari dataset recorded through Minari's DataCollector, and a
behaviour clone fitted on it loads like any checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from installed import needs  # noqa: E402

pytestmark = needs("minari", "jax", "sb3_contrib")  # imported by the tests, not at collection

from kvsched.experiments.suite.datasets import dataset_id, record  # noqa: E402
from kvsched.experiments.suite.runs import make_env  # noqa: E402
from test_suite import scenario, tiny_task  # noqa: E402


def test_the_dataset_holds_the_reference_actions_and_masks_of_each_train_episode(tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "users-own-root"))
    t = tiny_task(scenario(tmp_path), suite="v1")
    tuned = {"lars": {"params": {"kappa": 2.5}}, "reference": "lars"}
    ds = record(t, {"tuning": tuned}, 2, path=tmp_path / "minari")
    import os

    assert os.environ["MINARI_DATASETS_PATH"] == str(tmp_path / "users-own-root")  # restored, not leaked
    assert (tmp_path / "minari" / "kvsched" / "tiny").is_dir()
    assert dataset_id(t, "lars") == "kvsched/tiny/lars-v1" and ds.spec.dataset_id == "kvsched/tiny/lars-v1"
    assert ds.total_episodes == 2
    env = make_env(t, "lars", {"kappa": 2.5}, split="train")
    for ep in ds.iterate_episodes():
        n = len(ep.actions)
        assert n > 0 and ep.infos["action_mask"].shape[0] == n + 1  # the reset's mask, then one per step
        masks = ep.infos["action_mask"][:-1]
        acts = np.asarray(ep.actions).reshape(n, -1)
        # every recorded action is allowed by the mask the agent saw (MultiDiscrete: per part)
        offsets = np.concatenate([[0], np.cumsum(env.action_space.nvec)[:-1]])
        assert all(masks[i][offsets + acts[i]].all() for i in range(n))
    env.close()


def test_recording_asks_for_at_least_one_episode(tmp_path):
    from kvsched.envs.sim.errors import ConfigError

    with pytest.raises(ConfigError, match="episodes=0"):
        record(tiny_task(scenario(tmp_path)), {"tuning": {"lars": {"params": {}}, "reference": "lars"}}, 0,
               path=tmp_path)
