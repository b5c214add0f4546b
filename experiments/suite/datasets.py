"""Offline data of a task: the tuned heuristic's rollouts as a Minari dataset.

``kvsched/<task>/<heuristic>-v1`` holds episodes of the task's environment (train split; the
tuned best heuristic as its reference, acting through :class:`~kvsched.agents.heuristic.HeuristicAgent`,
i.e. the reference's own action) recorded with Minari's ``DataCollector`` (observations,
actions, rewards, terminations, and with ``record_infos`` the action masks): for behaviour
cloning (:mod:`kvsched.agents.bc`) and offline RL. Minari writes under ``MINARI_DATASETS_PATH``
(default ``~/.minari/datasets``); pass ``path`` to choose a folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from kvsched.envs.sim.errors import ConfigError

from .tasks import BenchTask


def dataset_id(task: BenchTask, heuristic: str) -> str:
    """The Minari id of a task's dataset of ``heuristic``: ``kvsched/<task>/<heuristic>-v<N>`` for
    suite ``vN`` (Minari ids end in an integer version; another suite name gives ``-v0``)."""
    safe = heuristic.replace("_", "-")
    version = int(task.suite[1:]) if task.suite[:1] == "v" and task.suite[1:].isdigit() else 0
    return f"kvsched/{task.task_id}/{safe}-v{version}"


def record(task: BenchTask, task_result: Mapping[str, Any], episodes: int, path: Path | None = None,
           seed: int = 0) -> Any:
    """Record ``episodes`` train episodes of the task's tuned reference heuristic; returns the
    ``MinariDataset``.

    The episodes are stepped here and handed to Minari as ``EpisodeBuffer`` objects
    (``minari.create_dataset_from_buffers``: Minari's own format and metadata). Minari's
    ``DataCollector`` wrapper would do the same but needs JAX (``minari[create]``, ~600 MB) for one
    tree map. Each step keeps the observation, the action, the reward, termination and truncation,
    and the action mask (``infos["action_mask"]``; the reset's too).

    Raises:
        ConfigError: Minari missing (``pip install minari``), or ``episodes`` < 1.
    """
    try:
        import minari
        from minari.data_collector import EpisodeBuffer
    except ImportError:
        raise ConfigError("recording datasets needs Minari: pip install 'minari>=0.5'") from None
    from kvsched.agents.heuristic import HeuristicAgent

    from .runs import make_env

    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ConfigError(f"episodes={episodes!r} is not allowed: expected an integer >= 1")
    if path is not None:
        os.environ["MINARI_DATASETS_PATH"] = str(Path(path).resolve())
    tuning = task_result["tuning"]
    ref = tuning["reference"]
    env = make_env(task, ref, tuning[ref]["params"], split="train")
    agent = HeuristicAgent(ref, env)
    buffers = []
    for i in range(episodes):
        obs, info = env.reset(seed=seed + i)
        o, a, r, te, tr, m = [obs], [], [], [], [], [info["action_mask"]]
        while True:
            act = agent.predict(obs)[0]
            obs, rew, term, trunc, info = env.step(act)
            o.append(obs)
            a.append(act)
            r.append(rew)
            te.append(term)
            tr.append(trunc)
            m.append(info["action_mask"])
            if term or trunc:
                break
        buffers.append(EpisodeBuffer(id=i, seed=seed + i, observations=o, actions=a, rewards=r, terminations=te,
                                     truncations=tr, infos={"action_mask": m}))
    ds_id = dataset_id(task, ref)
    if ds_id in minari.list_local_datasets():
        minari.delete_dataset(ds_id)
    ds = minari.create_dataset_from_buffers(
        dataset_id=ds_id, buffer=buffers, env=env, algorithm_name=f"{ref} tuned on train episodes (kvsched "
        "HeuristicAgent)", author="kvsched", data_format="arrow",
        description=f"{task.description} Behaviour: the tuned reference {ref} {tuning[ref]['params']} (action 0 "
                    f"of {task.env_id} whose reference policy it is); train split of {task.scenario}.")
    env.close()
    return ds
