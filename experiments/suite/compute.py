"""Computing a task of the suite: tuning on train episodes, baselines and bounds on held-out ones.

For one :class:`~.tasks.BenchTask`:

1. **pool and strata** (:mod:`.episodes`): every held-out episode, measured alone, split into
   the ``all`` and ``hard`` strata;
2. **tuning on train episodes only**: each heuristic of ``task.tuned`` is tuned with
   ``kvsched tune``'s machinery (:func:`kvsched.experiments.tune.tune`: Optuna TPE, defaults
   enqueued first, objective ``slo_attainment:all``) on ``task.tune_episodes`` train episodes
   (train windows; for a synthetic scenario train seeds ``0, 1, ...``, disjoint from the held-out
   seeds). The study is a journal file kept with the results. The tuned heuristic with the best
   *train* objective is the task's reference: its environment's reference policy;
3. **baselines on every stratum episode**: every heuristic with its defaults and every tuned one
   (in the simulator), the constant actions (:func:`.runs.constant_actions`), the random agent and
   the behaviour clone of the tuned reference (:func:`train_clone`: its Minari dataset of train
   episodes, :mod:`kvsched.agents.bc`), these three through the environment on the tuned
   reference;
4. **bounds**: the isolation bound (from the pool's alone-runs) and the hindsight bound
   (:func:`.search.hindsight`, starting from the baselines; >= every baseline by construction).

A residency task (``kvsched/Residency-v0``) does each step with the environment's vocabulary
(:mod:`.residency`): its heuristics are tier orders and session keeps played through the
environment, its tuning is the keep time over the keep bins, and its bound is the clairvoyant
eviction order (no search).

Episodes are independent: they run in ``jobs`` processes; results do not depend on ``jobs``.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any, Callable

from kvsched.envs.sim.errors import ConfigError

from .episodes import Episode, episode_indices, measure_pool, pool, strata, task_source, train_episodes
from .runs import (constant_actions, episode_seed, make_env, random_actor, run_env, run_heuristic, score)
from .search import Schedule, hindsight
from .tasks import BenchTask

OBJECTIVE = "slo_attainment:all"


def tune_task(task: BenchTask, out_dir: Path, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tune every heuristic of ``task.tuned`` on train episodes (see the module docstring).

    Returns ``{policy: {"params", "train_objective", "baseline_objective", "study", "journal",
    "trials", "windows_s", "seeds", "workload_sha256"}}`` for each tuned heuristic, ``{policy:
    {"params": {}, "train_objective"}}`` for each other heuristic (its defaults on the same train
    episodes), and ``"reference"``: the heuristic with the best train objective (tuned or not),
    the task's reference policy.
    """
    from kvsched.runner.scenario import load_scenario

    from ..tune import MetricRef, TuneConfig, report, tune

    eps = train_episodes(task, task.tune_episodes)
    src = task_source(task, "train")
    # kvsched tune cuts windows before rate scaling (in the trace's own seconds); an episode's
    # window is in served seconds, after it: the same requests lie in [w, w') x rate_scale
    r = float(src.scenario.rate_scale)
    windows = sorted({(e.window_index * task.window_s * r, (e.window_index + 1) * task.window_s * r) for e in eps})
    seeds = sorted({e.workload_seed for e in eps}) if src.synthetic else [src.scenario.seed]
    if src.synthetic:  # cross product of windows and seeds: as many of each as the episode count allows
        n_seeds = 2 if task.tune_episodes >= 4 else 1
        seeds = list(range(n_seeds))
        windows = windows[:max(1, task.tune_episodes // n_seeds)]
    if task.env_id == "kvsched/Residency-v0":  # the session keep over its bins, on the same train episodes
        from .residency import tune as tune_residency

        return tune_residency(task, out_dir, windows, seeds, progress)
    scenario = load_scenario(task.scenario)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    routing = task.env_id == "kvsched/Routing-v0"
    if routing:  # the heuristics are routers; the instances keep the scenario's policy
        scenario = scenario.with_overrides(n_instances=task.instances)
    for policy in task.tuned:
        cfg = TuneConfig(policy=scenario.policy if routing else policy, router=policy if routing else None,
                         objective=MetricRef.parse(OBJECTIVE), windows_s=tuple(windows),
                         seeds=tuple(seeds), sampler="tpe", pruner="none", sampler_seed=0,
                         tune_residency=task.tune_residency)
        journal = out_dir / f"{policy}.journal"
        if progress:
            progress(f"{task.name}: tuning {policy} ({task.tune_trials} trials x {len(windows) * len(seeds)} "
                     "train episodes)")
        res = tune(scenario, cfg, f"{task.name}-{policy}", f"journal:{journal}", n_trials=task.tune_trials)
        rep = report(res.study, cfg)
        best = rep["best"] or rep["baseline"]
        out[policy] = {"params": dict(best["params"]), "train_objective": best["objective_mean"],
                       "baseline_objective": (rep["baseline"] or {}).get("objective_mean"),
                       "study": f"{task.name}-{policy}", "journal": journal.name,
                       "trials": rep["trials"], "windows_s": [list(w) for w in windows], "seeds": list(seeds),
                       "workload_sha256": dict(res.study.user_attrs.get("workload_sha256", {}))}
    # the heuristics not tuned, with their defaults, on the same train episodes
    for policy in task.heuristics:
        if policy in task.tuned:
            continue
        vals = [_train_score(scenario, w, s, policy, routing) for w in windows for s in seeds]
        out[policy] = {"params": {}, "train_objective": finite_mean(vals), "tuned": False}
    order = list(task.heuristics)
    ref = max(order, key=lambda p: (out[p]["train_objective"], -order.index(p)))
    out["reference"] = ref
    return out


def _train_score(scenario, window, seed, heuristic: str, routing: bool = False) -> float:
    """The train objective of ``heuristic`` with its defaults: a policy, or (``routing``) a router
    in front of the scenario's policy."""
    from ..tune import MetricRef, metric_value, run_scenario

    if routing:
        summary = run_scenario(scenario, window, seed, scenario.policy, dict(scenario.policy_params),
                               router=heuristic, router_params={})
    else:
        summary = run_scenario(scenario, window, seed, heuristic, {})
    return metric_value(summary, MetricRef.parse(OBJECTIVE))


#: train episodes in a task's behaviour-cloning dataset, and the clone's fitting epochs
CLONE_EPISODES = 8
CLONE_EPOCHS = 5


def train_clone(task: BenchTask, tuned: dict[str, Any], out_dir: Path) -> Path | None:
    """Record the tuned reference's train episodes as a Minari dataset (in ``out_dir/minari``) and
    fit a MaskablePPO policy to them; returns the clone's checkpoint (``out_dir/clone.zip``), or
    None when Minari or sb3-contrib is not installed (the baseline is then left out)."""
    try:
        import minari  # noqa: F401
        import sb3_contrib  # noqa: F401
    except ImportError:
        return None
    from kvsched.agents.bc import behaviour_clone, save_clone

    from .datasets import dataset_id, record
    from .runs import make_env

    ref = tuned["reference"]
    ds = record(task, {"tuning": tuned}, CLONE_EPISODES, path=out_dir / "minari")
    env = make_env(task, ref, tuned[ref]["params"])
    algo = "ppo" if task.env_id == "kvsched/Routing-v0" else "maskable_ppo"  # Scheduling-v0, Residency-v0 mask
    model = behaviour_clone(ds, env.unwrapped, algo=algo, epochs=CLONE_EPOCHS, seed=0)
    path = out_dir / "clone.zip"
    kw = task.env_kwargs_for("train", ref, tuned[ref]["params"]) if task.env_id == "kvsched/Scheduling-v0" \
        else task.env_kwargs_for("train")  # routing, residency: no reference behind action 0
    save_clone(model, path, task.env_id, kw, dataset_id(task, ref), episodes=CLONE_EPISODES, epochs=CLONE_EPOCHS)
    env.close()
    return path


def episode_baselines(task: BenchTask, episode: Episode, index: int, tuned: dict[str, Any],
                      clone: Path | None = None) -> dict[str, Any]:
    """Every baseline and the hindsight bound on one held-out episode (one process's work).

    Returns ``{"scores": {label: score}, "bound": {...}}`` (see :func:`.search.hindsight`; for a
    residency task the bound is the clairvoyant order's, :func:`.residency.episode_baselines`).
    """
    if task.env_id == "kvsched/Residency-v0":
        from .residency import episode_baselines as residency_baselines

        return residency_baselines(task, episode, index, tuned, clone)
    ref = tuned["reference"]
    ref_params = tuned[ref]["params"]
    scores: dict[str, float | None] = {}
    schedules: dict[str, tuple[float | None, Schedule | None]] = {}
    for h in task.heuristics:
        s = score(run_heuristic(task, episode, h, {}).summary)
        scores[f"{h} (default)"] = s
        schedules[f"{h} (default)"] = (s, Schedule(h, {}))
    for h in task.tuned:
        p = tuned[h]["params"]
        s = score(run_heuristic(task, episode, h, p).summary)
        scores[f"{h} (tuned)"] = s
        schedules[f"{h} (tuned)"] = (s, Schedule(h, p))
    env = make_env(task, ref, ref_params)
    for label, action in constant_actions(task, env):
        s = score(run_env(env, episode, lambda o, i, e, a=action: a, seed=episode_seed(index)))
        scores[f"constant {label}"] = s
        schedules[f"constant {label}"] = (s, None)
    s = score(run_env(env, episode, random_actor(episode_seed(index)), seed=episode_seed(index)))
    scores["random"] = s
    schedules["random"] = (s, None)
    if clone is not None:
        from .agents import load_checkpoint
        from .runs import model_actor

        model, meta = load_checkpoint(clone)
        s = score(run_env(env, episode, model_actor(model, meta["algo"] == "maskable_ppo"), seed=episode_seed(index)))
        scores["behaviour clone"] = s
        schedules["behaviour clone"] = (s, None)
    env.close()
    bound = hindsight(task, episode, schedules, seed=index)
    return {"scores": scores, "bound": bound}


def _episode_job(args):
    task, episode, index, tuned, clone = args
    t0 = time.process_time()
    out = episode_baselines(task, episode, index, tuned, clone)
    out["cpu_s"] = time.process_time() - t0
    return episode.key(), out


def compute_task(task: BenchTask, out_dir: Path, jobs: int = 1, progress: Callable[[str], None] | None = None,
                 tuned: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the results file holds for ``task`` (see the module docstring)."""
    t0 = time.time()
    episodes = pool(task)
    if progress:
        progress(f"{task.name}: measuring {len(episodes)} held-out episodes alone")
    stats = measure_pool(task, episodes)
    st = strata(task, episodes, stats)
    if tuned is None:
        tuned = tune_task(task, out_dir, progress)
        check_tuning_saw_no_heldout(task, tuned)  # a leak stops the computation, never lands in results
    if progress:
        progress(f"{task.name}: recording the tuned reference's dataset and fitting its behaviour clone")
    clone = train_clone(task, tuned, out_dir)
    index = episode_indices(st)
    todo = sorted({ep for eps in st.values() for ep in eps}, key=lambda e: index[e.key()])
    if progress:
        progress(f"{task.name}: baselines and hindsight search on {len(todo)} episodes ({jobs} processes)")
    args = [(task, ep, index[ep.key()], tuned, clone) for ep in todo]
    per_episode: dict[str, Any] = {}
    if jobs <= 1:
        for a in args:
            k, v = _episode_job(a)
            per_episode[k] = v
            if progress:
                progress(f"{task.name}: episode {len(per_episode)}/{len(args)} {k} bound {v['bound']['score']}")
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            for k, v in ex.map(_episode_job, args):
                per_episode[k] = v
                if progress:
                    progress(f"{task.name}: episode {len(per_episode)}/{len(args)} {k} bound {v['bound']['score']}")
    for ep in todo:
        per_episode[ep.key()]["isolation"] = stats[ep.key()].attainment
        per_episode[ep.key()]["offered_load"] = stats[ep.key()].offered_load
        per_episode[ep.key()]["kv_pressure"] = stats[ep.key()].kv_pressure
        per_episode[ep.key()]["reuse_pressure"] = stats[ep.key()].reuse_pressure
        per_episode[ep.key()]["requests"] = stats[ep.key()].requests
    return {"task": task_record(task), "tuning": tuned,
            "strata": {name: [ep.key() for ep in eps] for name, eps in st.items()},
            "pool": len(episodes), "episodes": per_episode, "wall_s": time.time() - t0}


def task_record(task: BenchTask) -> dict[str, Any]:
    """The task's definition as JSON-ready data."""
    import dataclasses

    d = dataclasses.asdict(task)
    d["env_kwargs"] = [list(kv) for kv in task.env_kwargs]
    return d


def tuning_requests(task: BenchTask, tuned: dict[str, Any], policy: str) -> set[tuple[int, int]]:
    """``(workload seed, request id)`` of every request the study of ``policy`` served (its windows
    and seeds rebuilt from the study's stored configuration); the seed is 0 for a trace."""
    from kvsched.runner.scenario import load_scenario

    from ..tune import scenario_for

    scenario = load_scenario(task.scenario)
    synthetic = scenario.synthetic is not None
    out: set[tuple[int, int]] = set()
    for seed in tuned[policy]["seeds"]:
        for w in tuned[policy]["windows_s"]:
            ids = scenario_for(scenario, tuple(w), seed).workload().request_id
            out |= {(int(seed) if synthetic else 0, int(i)) for i in ids}
    return out


def heldout_requests(task: BenchTask) -> set[tuple[int, int]]:
    """``(workload seed, request id)`` of every request of the task's held-out pool (seed 0 for a trace)."""
    src = task_source(task)
    out: set[tuple[int, int]] = set()
    for ep in pool(task):
        ids = src.workload(ep.workload_seed, ep.window_index).request_id
        out |= {(ep.workload_seed if src.synthetic else 0, int(i)) for i in ids}
    return out


def check_tuning_saw_no_heldout(task: BenchTask, tuned: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` if a tuning study served any request of a held-out episode.

    Requests are identified by ``(workload seed, request id)``: a trace's request ids are its
    rows, a synthetic workload's are per seed (held-out seeds are >= HELDOUT_SEED_BASE).
    """
    held = heldout_requests(task)
    for policy in task.tuned:
        seen = tuning_requests(task, tuned, policy)
        if not seen:
            raise ConfigError(f"{task.name}: the {policy} study served no request")
        bad = seen & held
        if bad:
            raise ConfigError(f"{task.name}: the {policy} study served {len(bad)} request(s) of held-out episodes")


def finite_mean(values) -> float:
    """Mean of the defined values (NaN when none)."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan
