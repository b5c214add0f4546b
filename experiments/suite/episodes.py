"""The held-out episode pool of a task and its strata.

The pool is every held-out episode of the task's environment (:mod:`kvsched.envs.episodes`):
for a synthetic scenario the held-out windows of each of ``pool_seeds`` held-out workload seeds
(``HELDOUT_SEED_BASE + s``), for a trace its held-out windows. Episodes without requests are
left out. Each episode is measured from its workload alone (:func:`.bounds.isolation_stats`,
every request served alone with FCFS, vLLM's default), never from how a heuristic does on it, so
that the strata do not favour or disfavour any agent:

- ``all``: ``stratum_episodes`` episodes drawn uniformly from the pool (seed 0, without
  replacement; the whole pool when it is smaller);
- ``hard``: the ``stratum_episodes`` episodes of the pool with the highest ``hard_by`` measure
  (offered load, KV pressure or reuse pressure, :data:`.tasks.HARD_BY`; ties broken by pool order).

Every agent is evaluated on the same episodes; the episode seed (for stochastic agents, and the
hindsight search's) comes from the episode's index among the strata's episodes
(:func:`episode_indices`), so an episode in both strata gets one seed, the random baseline's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.envs.episodes import HELDOUT_SEED_BASE, EpisodeConfig, EpisodeSource

from .bounds import IsolationStats, isolation_stats
from .tasks import BenchTask

STRATA = ("all", "hard")


@dataclass(frozen=True)
class Episode:
    """One held-out episode: which window of which workload.

    Attributes:
        workload_seed: the scenario's generator seed (held-out: >= HELDOUT_SEED_BASE) or the
            trace scenario's seed.
        window_index: the window of the scenario's span.
    """

    workload_seed: int
    window_index: int

    def as_options(self) -> dict[str, int]:
        """The environment's ``reset(options=...)`` for this episode."""
        return {"workload_seed": self.workload_seed, "window_index": self.window_index}

    def key(self) -> str:
        """``<workload_seed>:<window_index>``, the episode's key in results files."""
        return f"{self.workload_seed}:{self.window_index}"


def task_source(task: BenchTask, split: str = "heldout") -> EpisodeSource:
    """The task's episode source for ``split``."""
    from kvsched.runner.scenario import scenario_path

    return EpisodeSource(EpisodeConfig(scenario=str(scenario_path(task.scenario)), window_s=float(task.window_s),
                                       split=split, heldout_fraction=task.heldout_fraction))


def pool(task: BenchTask) -> list[Episode]:
    """Every held-out episode of the task (empty windows included; see :func:`measure_pool`)."""
    src = task_source(task, "heldout")
    seeds = ([HELDOUT_SEED_BASE + s for s in range(task.pool_seeds)] if src.synthetic else [src.scenario.seed])
    return [Episode(int(s), int(w)) for s in seeds for w in src.heldout_windows]


def train_episodes(task: BenchTask, n: int) -> list[Episode]:
    """``n`` train episodes for tuning: train windows spread evenly over the span, workload seeds
    ``0, 1, ...`` for a synthetic scenario (never held-out seeds or windows)."""
    src = task_source(task, "train")
    windows = list(src.train_windows)
    picks = [windows[int(round(i * (len(windows) - 1) / max(1, n - 1)))] for i in range(n)] if n > 1 else [windows[0]]
    return [Episode(i if src.synthetic else src.scenario.seed, int(w)) for i, w in enumerate(picks)]


def measure_pool(task: BenchTask, episodes: list[Episode], progress=None) -> dict[str, IsolationStats]:
    """:class:`IsolationStats` of each episode (key -> stats), alone-runs with FCFS."""
    from kvsched.envs.common import build_cluster
    from kvsched.policies.base import make_policy

    src = task_source(task, "heldout")
    spec = src.scenario.instance_spec()
    metrics = src.scenario.metrics_config()
    instances = max(1, task.instances)

    def run_alone(w):
        return build_cluster(src, lambda i: make_policy("fcfs"), n_instances=1).run(w).records

    out = {}
    cache = prefix_cache_tokens(task)
    for i, ep in enumerate(episodes):
        w = src.workload(ep.workload_seed, ep.window_index)
        out[ep.key()] = isolation_stats(w, run_alone, metrics, task.window_s, instances,
                                        spec.num_hbm_blocks * spec.block_size_tokens, cache)
        if progress is not None:
            progress(i + 1, len(episodes))
    return out


def prefix_cache_tokens(task: BenchTask) -> int:
    """Tokens of prefixes one instance of the task can cache: its HBM KV capacity plus the
    capacity of every lower tier that caches prefixes (``instance.prefix_offload``), read from the
    instance the simulator builds."""
    from kvsched.envs.common import build_cluster
    from kvsched.policies.base import make_policy

    src = task_source(task, "heldout")
    inst = build_cluster(src, lambda i: make_policy("fcfs"), n_instances=1).instances[0]
    blocks = inst.hbm.capacity_blocks
    if inst.kv.prefix_tiers is not None:
        blocks += sum(s.pool.capacity_blocks for s in inst.kv.prefix_tiers.stores)
    return int(blocks * src.scenario.instance_spec().block_size_tokens)


def strata(task: BenchTask, episodes: list[Episode], stats: dict[str, IsolationStats]) -> dict[str, list[Episode]]:
    """The ``all`` and ``hard`` strata of the pool (see the module docstring)."""
    served = [ep for ep in episodes if stats[ep.key()].requests > 0]
    k = min(task.stratum_episodes, len(served))
    rng = np.random.default_rng(0)
    pick = sorted(rng.choice(len(served), size=k, replace=False).tolist())
    measure = np.array([getattr(stats[ep.key()], task.hard_by) for ep in served])
    order = np.lexsort((np.arange(len(served)), -measure))  # highest first, then pool order
    return {"all": [served[i] for i in pick], "hard": [served[i] for i in sorted(order[:k].tolist())]}


def episode_indices(strata: dict[str, list[Episode]]) -> dict[str, int]:
    """Key -> index of every episode of the strata (one in both counted once), in the order of
    workload seed and window: what seeds a stochastic agent on the episode (:func:`.runs.episode_seed`)."""
    todo = sorted({ep for eps in strata.values() for ep in eps}, key=lambda e: (e.workload_seed, e.window_index))
    return {ep.key(): i for i, ep in enumerate(todo)}
