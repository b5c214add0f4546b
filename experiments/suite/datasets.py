"""Offline data of a task: the tuned heuristic's rollouts as a Minari dataset.

``kvsched/<task>/<heuristic>-v1`` holds episodes of the task's environment (train split; the
tuned best heuristic as its reference, acting through :class:`~kvsched.agents.heuristic.HeuristicAgent`,
i.e. the reference's own action; on a residency task the tuned keep's action, or action 0 of a
tier order) recorded with Minari's ``DataCollector`` (observations,
actions, rewards, terminations, and with ``record_infos`` the action masks): for behaviour
cloning (:mod:`kvsched.agents.bc`) and offline RL. Minari writes under ``MINARI_DATASETS_PATH``
(default ``~/.minari/datasets``); pass ``path`` to choose a folder (the variable is set for the
recording only, then restored).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

from kvsched.envs.sim.errors import ConfigError, bounded_repr

from .tasks import BenchTask


def dataset_id(task: BenchTask, heuristic: str) -> str:
    """The Minari id of a task's dataset of ``heuristic``: ``kvsched/<task>/<heuristic>-v<N>`` for
    suite ``vN`` (Minari ids end in an integer version; another suite name gives ``-v0``)."""
    safe = heuristic.replace("_", "-")
    version = int(task.suite[1:]) if task.suite[:1] == "v" and task.suite[1:].isdigit() else 0
    return f"kvsched/{task.task_id}/{safe}-v{version}"


def record(task: BenchTask, task_result: Mapping[str, Any], episodes: int, path: Path | None = None,
           seed: int = 0) -> Any:
    """Record ``episodes`` train episodes of the task's tuned reference heuristic through Minari's
    ``DataCollector``; returns the ``MinariDataset``.

    The collector wraps the task's environment; :class:`_MaskOnly` keeps, of each step's infos,
    the action mask (the environment's other infos change keys over an episode, which the
    collector's per-episode arrays cannot hold). Minari's ``DataCollector`` needs JAX
    (``minari[create]``, in kvsched's ``rl`` extra).

    Raises:
        ConfigError: Minari or JAX missing (``pip install 'minari[create,arrow]'``), or
            ``episodes`` < 1.
    """
    try:
        import jax  # noqa: F401  (the collector's episode buffer maps its trees with jax.tree_util)
        import minari  # noqa: F401
    except ImportError:
        raise ConfigError("recording datasets needs Minari's DataCollector: pip install "
                          "'minari[create,arrow]>=0.5' (or pip install -e '.[rl]' in the kvsched checkout)") from None
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ConfigError(f"episodes={bounded_repr(episodes)} is not allowed: expected an integer >= 1")
    with _minari_root(path):
        return _record(task, task_result, episodes, seed)


@contextlib.contextmanager
def _minari_root(path: Path | None) -> Iterator[None]:
    """Point Minari at ``path`` for the block (Minari reads its root only from the
    ``MINARI_DATASETS_PATH`` environment variable), then restore the variable as it was."""
    if path is None:
        yield
        return
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(Path(path).resolve())
    try:
        yield
    finally:
        if old is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def _record(task: BenchTask, task_result: Mapping[str, Any], episodes: int, seed: int) -> Any:
    """:func:`record`'s work, with Minari's root already chosen."""
    import minari
    from minari import DataCollector

    from kvsched.agents.heuristic import HeuristicAgent

    from .runs import make_env

    tuning = task_result["tuning"]
    ref = tuning["reference"]
    if task.env_id == "kvsched/Residency-v0":  # a tier order, or a keep with its tuned time (.residency)
        from .residency import play_of

        order, name, keep = play_of(task, ref, tuning[ref]["params"])
        env = make_env(task, split="train", eviction=order)
        agent = HeuristicAgent(name, env, params=None if keep is None else {"keep_s": keep})
    else:
        env = make_env(task, ref, tuning[ref]["params"], split="train")
        agent = HeuristicAgent(ref, env)
    collector = DataCollector(env, step_data_callback=_mask_only_callback(), record_infos=True,
                              data_format="arrow")
    for i in range(episodes):
        obs, _ = collector.reset(seed=seed + i)
        while True:
            obs, _, term, trunc, _ = collector.step(agent.predict(obs)[0])
            if term or trunc:
                break
    ds_id = dataset_id(task, ref)
    if ds_id in minari.list_local_datasets():
        minari.delete_dataset(ds_id)
    with warnings.catch_warnings():
        # Minari asks for a code permalink, an author e-mail and an evaluation env; the dataset's
        # description names the task, provenance (command, versions, commit) is in the suite's results file,
        # and evaluation is the leaderboard's (held-out episodes), so the reminders are noise
        warnings.filterwarnings("ignore", message=r"`(code_permalink|author_email|eval_env)` is set to None",
                                category=UserWarning)
        ds = _create(collector, ds_id, task, ref, tuning)
    collector.close()
    return ds


def _create(collector, ds_id: str, task: BenchTask, ref: str, tuning: Mapping[str, Any]):
    """``collector.create_dataset`` with the suite's metadata."""
    return collector.create_dataset(
        dataset_id=ds_id, algorithm_name=f"{ref} tuned on train episodes (kvsched HeuristicAgent)",
        author="kvsched",
        description=f"{task.description} Behaviour: the tuned reference {ref} {tuning[ref]['params']} (action 0 "
                    f"of {task.env_id} whose reference policy it is); train split of {task.scenario}.")


def _mask_only_callback():
    """A Minari ``StepDataCallback`` class (the collector instantiates it) that keeps only
    ``infos["action_mask"]`` (see :func:`record`)."""
    from minari.data_collector.callbacks import StepDataCallback

    class _MaskOnly(StepDataCallback):
        def __call__(self, env, **kwargs):
            step = super().__call__(env, **kwargs)
            step["info"] = {"action_mask": step["info"]["action_mask"]}
            return step

    return _MaskOnly
