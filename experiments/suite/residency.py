"""Residency-v0 tasks of the suite: their heuristics, tuning, baselines and bound.

On ``kvsched/Residency-v0`` (:mod:`kvsched.envs.residency_env`) the agent decides, at each finished
request, how long its conversation's cached prefix stays in the lower tiers. What the suite does
for a scheduling or routing task it does here with the environment's own vocabulary:

- **heuristics** (:data:`.tasks.RESIDENCY_HEURISTICS`): ``lru`` and ``lfu`` are tier eviction
  orders, i.e. action 0 of the environment made with ``eviction=<order>``; ``session`` keeps every
  finished request's conversation ``keep_s`` seconds (default :data:`DEFAULT_KEEP_S`), a constant
  keep action of the task's environment. So every heuristic is a pair (tier order, constant
  action) played through the environment, and pairs that are the same run (``lru`` and the
  constant action 0, ``session`` and its keep action) are simulated once per episode;
- **tuning**: the session keep time over the environment's keep bins, every bin once (Optuna's
  ``GridSampler``, seeded; the default among them), objective the mean SLO attainment over the
  task's train episodes (the same episodes and the same no-leak check as ``kvsched tune``'s
  studies; :func:`tune`). LRU and LFU have nothing to tune; their defaults are scored on the same
  train episodes, and the heuristic with the best train objective is the task's reference;
- **constant actions**: every allowed action of ``Discrete(3 + keep bins)`` (``demote`` is masked
  without a second listed tier): ``default`` (the tier order), ``drop``, ``keep=<s>s``;
- **the bound**: the ``clairvoyant`` eviction order (Belady: it evicts the entry whose next use
  lies farthest in the window's future, :mod:`kvsched.envs.sim.prefix_offload`) with action 0, in
  place of the hindsight search of scheduling and routing tasks. It knows every future arrival of
  the episode, so it is a reference bound, never an agent; like the search's schedules it is a
  schedule the simulator ran (replayable: ``Schedule("clairvoyant")``), and like them it is not a
  proven optimum (it maximises hits, not SLO attainment). The bound stored is the best of it and
  every baseline, so it is >= each of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from kvsched.envs.sim.errors import ConfigError, bounded_repr

from .episodes import Episode
from .tasks import BenchTask

#: the tier orders among the heuristics (action 0 of the environment made with that order)
TIER_ORDERS = ("lru", "lfu")
#: the task's bound: the clairvoyant tier order (a reference, never an agent)
BOUND = "clairvoyant"
#: the session keep's default keep time (s): the ``session`` tier order's ``session_keep_s`` default
#: (:class:`kvsched.envs.sim.prefix_offload.PrefixOffloadSpec`), as ``kvsched evaluate``'s ``session``
DEFAULT_KEEP_S = 30.0


def task_order(task: BenchTask) -> str:
    """The tier order of the task's environment (its ``eviction`` keyword, else the scenario's)."""
    kw = dict(task.env_kwargs)
    if "eviction" in kw:
        return str(kw["eviction"])
    from .episodes import task_source

    po = task_source(task).scenario.instance_spec().prefix_offload
    return "lru" if po is None else po.eviction[0]


def play_of(task: BenchTask, heuristic: str, params: Mapping[str, Any] | None = None) -> tuple[str, str, float | None]:
    """``(tier order, heuristic the environment plays, keep_s)`` of a heuristic or the bound:
    ``lru`` / ``lfu`` / ``clairvoyant`` are their own order with action 0; ``session`` keeps on the
    task's order (``params``: ``{}`` or ``{"keep_s": s}``, one of the keep bins).

    Raises:
        ConfigError: another name, or parameters the heuristic does not have.
    """
    p = dict(params or {})
    if heuristic in (*TIER_ORDERS, BOUND):
        if p:
            raise ConfigError(f"residency heuristic {heuristic} has no parameters; got {bounded_repr(p)}")
        return heuristic, heuristic, None
    if heuristic == "session":
        if set(p) - {"keep_s"}:
            raise ConfigError(f"residency heuristic session has one parameter, keep_s; got {bounded_repr(p)}")
        return task_order(task), "session", float(p.get("keep_s", DEFAULT_KEEP_S))
    raise ConfigError(f"{bounded_repr(heuristic)} is not a residency heuristic; allowed: "
                      f"{', '.join((*TIER_ORDERS, 'session'))} (and the bound {BOUND})")


class Player:
    """Plays constant actions on one episode, each (tier order, action) once: an environment per
    tier order (``split``, the task's keyword arguments), the scores memoised. ``seed`` seeds the
    environments' resets; an episode's result does not depend on it (the episode is chosen by its
    options, the simulator is deterministic: a replay with seed 0 equals the baseline, tested)."""

    def __init__(self, task: BenchTask, episode: Episode, seed: int, split: str = "heldout") -> None:
        self.task, self.episode, self.seed, self.split = task, episode, seed, split
        self.envs: dict[str, Any] = {}
        self.memo: dict[tuple[str, int], float | None] = {}
        self.results: dict[tuple[str, int], Any] = {}

    def env(self, order: str):
        """The environment whose tiers evict by ``order``."""
        from .runs import make_env

        if order not in self.envs:
            self.envs[order] = make_env(self.task, split=self.split, eviction=order)
        return self.envs[order]

    def action(self, heuristic: str, params: Mapping[str, Any] | None = None) -> tuple[str, int]:
        """``(tier order, action)`` of a heuristic (:func:`play_of`)."""
        order, name, keep = play_of(self.task, heuristic, params)
        return order, int(self.env(order).unwrapped.heuristic_action(name, keep))

    def score(self, order: str, action: int) -> float | None:
        """SLO attainment of the constant ``action`` under ``order`` (run once)."""
        from .runs import constant_actor, run_env, score

        key = (order, int(action))
        if key not in self.memo:
            self.memo[key] = score(run_env(self.env(order), self.episode, constant_actor(action), seed=self.seed))
        return self.memo[key]

    def result(self, order: str, action: int):
        """The :class:`SimulationResult` of the constant ``action`` under ``order``."""
        from .runs import constant_actor, run_env

        key = (order, int(action))
        if key not in self.results:
            env = self.env(order)
            run_env(env, self.episode, constant_actor(action), seed=self.seed)
            self.results[key] = env.unwrapped.cluster.result()
        return self.results[key]

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def run(task: BenchTask, episode: Episode, heuristic: str, params: Mapping[str, Any] | None = None,
        split: str = "heldout"):
    """Serve ``episode`` with a residency heuristic (or the bound); returns the :class:`SimulationResult`."""
    p = Player(task, episode, 0, split)
    try:
        return p.result(*p.action(heuristic, params))
    finally:
        p.close()


def constant_actions(env) -> list[tuple[str, int]]:
    """``(label, action)`` of every allowed action of a Residency-v0 environment: ``default``
    (the tier order), ``drop``, ``demote`` (when a second tier exists), ``keep=<s>s``."""
    u = env.unwrapped
    mask = u.action_masks()
    out = []
    for a in range(int(env.action_space.n)):
        if mask[a]:
            d = u.decision_of(a)
            out.append((f"keep={d.keep_s:g}s" if d.kind == "keep" else d.kind, a))
    return out


def episode_baselines(task: BenchTask, episode: Episode, index: int, tuned: Mapping[str, Any],
                      clone: Path | None = None) -> dict[str, Any]:
    """Every baseline and the bound on one held-out episode (:func:`.compute.episode_baselines`
    for a residency task; the labels are the same as for the other tasks)."""
    from .runs import episode_seed, model_actor, random_actor, run_env, score

    seed = episode_seed(index)
    p = Player(task, episode, seed)
    scores: dict[str, float | None] = {}
    for h in task.heuristics:
        scores[f"{h} (default)"] = p.score(*p.action(h))
    for h in task.tuned:
        scores[f"{h} (tuned)"] = p.score(*p.action(h, tuned[h]["params"]))
    order = task_order(task)
    env = p.env(order)
    for label, action in constant_actions(env):
        scores[f"constant {label}"] = p.score(order, action)
    scores["random"] = score(run_env(env, episode, random_actor(seed), seed=seed))
    if clone is not None:
        from .agents import load_checkpoint

        model, meta = load_checkpoint(clone)
        scores["behaviour clone"] = score(run_env(env, episode, model_actor(model, meta["algo"] == "maskable_ppo"),
                                                  seed=seed))
    clair = p.score(*p.action(BOUND))
    p.close()
    return {"scores": scores, "bound": bound(scores, clair)}


def bound(scores: Mapping[str, float | None], clairvoyant: float | None) -> dict[str, Any]:
    """The bound of one episode from its baselines' scores and the clairvoyant order's: the best
    of them, with the clairvoyant schedule when it reaches the bound (as :func:`.search.hindsight`'s
    result: ``score``, ``schedule``, ``from``, ``param_score``, ``evals``, ``best_baseline``; and
    ``clairvoyant``, its score)."""
    from .search import Schedule

    scored = [(s, label) for label, s in scores.items() if s is not None]
    best_score, best_label = max(scored, key=lambda x: x[0]) if scored else (None, None)
    reached = clairvoyant is not None and (best_score is None or clairvoyant >= best_score)
    top = clairvoyant if reached else best_score
    return {"score": top, "schedule": Schedule(BOUND, {}).to_dict() if reached else None, "from": BOUND,
            "param_score": None, "evals": 1, "best_baseline": best_label, "clairvoyant": clairvoyant}


def tune(task: BenchTask, out_dir: Path, windows_s: list[tuple[float, float]], seeds: list[int],
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tune the session keep on the train episodes of ``windows_s`` x ``seeds`` (the windows and
    seeds :func:`.compute.tune_task` gives every task's studies, in the scenario's own seconds)
    and score the other heuristics there (see the module docstring); returns what
    :func:`.compute.tune_task` returns: per heuristic its ``params`` and ``train_objective`` (the
    tuned one also its study: ``journal``, ``trials``, ``baseline_objective`` (the default keep),
    ``windows_s`` and ``seeds`` for the no-leak check, ``workload_sha256``), and ``reference``."""
    import optuna

    from .compute import finite_mean
    from .episodes import task_source
    from ..tune import make_storage

    src = task_source(task, "train")
    span = task.window_s * float(src.scenario.rate_scale)  # a window of the scenario's own seconds
    runs = [(w, s, Episode(int(s), int(round(w[0] / span)))) for s in seeds for w in windows_s]
    sha = {f"{w[0]:g}-{w[1]:g}@{s}": src.workload(e.workload_seed, e.window_index).content_sha256()
           for w, s, e in runs}
    players = [Player(task, e, 0, "train") for _, _, e in runs]

    def objective_of(heuristic: str, params: Mapping[str, Any] | None = None) -> float:
        return finite_mean([p.score(*p.action(heuristic, params)) for p in players])

    out: dict[str, Any] = {}
    for h in task.tuned:  # only session has a search space (BenchTask checks)
        bins = list(players[0].env(task_order(task)).unwrapped.keep_bins_s)
        journal = out_dir / f"{h}.journal"
        if progress:
            progress(f"{task.name}: tuning {h} (keep_s over {len(bins)} bins x {len(players)} train episodes)")
        out_dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name=f"{task.name}-{h}", storage=make_storage(f"journal:{journal}"),
                                    direction="maximize", load_if_exists=True,
                                    sampler=optuna.samplers.GridSampler({"keep_s": bins}, seed=0))
        study.set_user_attr("workload_sha256", sha)
        done = len([t for t in study.trials if t.state.is_finished()])
        study.optimize(lambda trial: objective_of(h, {"keep_s": trial.suggest_categorical("keep_s", bins)}),
                       n_trials=max(0, task.tune_trials - done))
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        best = max(complete, key=lambda t: (t.value, -t.params["keep_s"]))  # ties: the shorter keep
        states = optuna.trial.TrialState
        out[h] = {"params": {"keep_s": float(best.params["keep_s"])}, "train_objective": best.value,
                  "baseline_objective": objective_of(h), "study": f"{task.name}-{h}", "journal": journal.name,
                  "trials": {name.lower(): sum(t.state == getattr(states, name) for t in study.trials)
                             for name in ("COMPLETE", "FAIL", "PRUNED", "RUNNING", "WAITING")},
                  "windows_s": [list(w) for w in windows_s], "seeds": list(seeds), "workload_sha256": sha}
    for h in task.heuristics:
        if h not in task.tuned:
            out[h] = {"params": {}, "train_objective": objective_of(h), "tuned": False}
    for p in players:
        p.close()
    order = list(task.heuristics)
    out["reference"] = max(order, key=lambda h: (out[h]["train_objective"], -order.index(h)))
    return out


def keep_bins(task: BenchTask) -> tuple[float, ...]:
    """The keep times (s) of the task's keep actions: its ``keep_bins_s`` keyword, else the
    environment's default."""
    from kvsched.envs.residency_env import KEEP_BINS_S

    return tuple(float(b) for b in dict(task.env_kwargs).get("keep_bins_s", KEEP_BINS_S))


def agent_heuristic(name: str) -> tuple[str, dict[str, Any]] | None:
    """``(heuristic, params)`` of an agent name on a residency task (``lru``, ``lfu``, ``session``,
    ``session:<s>``: ``kvsched evaluate``'s names), or None for another name (``clairvoyant`` is
    the bound: :func:`.agents.check_agent` refuses it)."""
    from kvsched.agents.evaluate import residency_heuristic

    parsed = residency_heuristic(name)
    if parsed is None or parsed[0] == BOUND:
        return None
    h, keep = parsed
    return h, ({} if keep is None else {"keep_s": keep})

