"""The achievable hindsight bound: an offline search over schedules of one known episode.

The search knows the whole episode (every arrival and output length) and looks for a schedule
with a higher SLO attainment than the baselines'. Whatever it finds is a real schedule -- the
simulator ran it, and the result records how to run it again (:class:`Schedule`) -- so its score
is *achievable*: a valid target for how much better an agent could do, never an estimate. (It
is a lower bound of the optimum, not an upper one: an agent may beat it; the normalised score
can then exceed 1.)

Scheduling tasks, from the best baseline schedule (a heuristic and its parameters):

1. **parameters in hindsight**: ``param_trials`` Optuna TPE trials (seeded) of the tuned
   heuristic's parameters on this episode alone (the policy's ``SEARCH_SPACE``);
2. **request priorities**: first the batch move "deprioritise every request that missed" (a
   request past saving only delays the others; repeated while it helps), then a greedy search over
   single requests that missed their SLO in the best schedule so far: boost one (admitted before
   the others) or deprioritise it (after them), keeping a change when the attainment rises, until
   ``local_evals`` simulations are spent or no single change helps. The priorities act on top of
   the policy's own order (:class:`PriorityOverride`), so the empty priority map is the policy
   itself.

Routing tasks, from the best baseline router: a greedy search over reassigning single missed
requests to another instance (:class:`FixedAssignment`), the other requests keeping the
router's choice.

Residency tasks (``kvsched/Residency-v0``) have no search: their bound is the clairvoyant
eviction order, a schedule that also knows the episode (:mod:`.residency`).

Deterministic: seeded samplers, requests tried in a seeded order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from kvsched.envs.sim.features import FeatureTable
from kvsched.policies.base import SchedulerPolicy

from .episodes import Episode, task_source
from .runs import heuristic_cluster, score
from .tasks import BenchTask


@dataclass(frozen=True)
class Schedule:
    """How to run a schedule of one episode again: the heuristic, its parameters, and the
    per-request priorities (scheduling) or instance assignments (routing) on top of it."""

    heuristic: str
    params: Mapping[str, Any] = field(default_factory=dict)
    priority: Mapping[int, int] = field(default_factory=dict)
    assignment: Mapping[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (request ids as strings)."""
        return {"heuristic": self.heuristic, "params": dict(self.params),
                "priority": {str(k): int(v) for k, v in sorted(self.priority.items())},
                "assignment": {str(k): int(v) for k, v in sorted(self.assignment.items())}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Schedule":
        return Schedule(d["heuristic"], dict(d.get("params", {})),
                        {int(k): int(v) for k, v in d.get("priority", {}).items()},
                        {int(k): int(v) for k, v in d.get("assignment", {}).items()})


class PriorityOverride(SchedulerPolicy):
    """A reference policy whose admission and prefill orders put boosted requests (priority < 0)
    first and deprioritised ones (> 0) last; within a priority the reference's own order."""

    def __init__(self, reference: SchedulerPolicy, priority: Mapping[int, int]) -> None:
        self.reference = reference
        self.params = reference.params
        self.name = f"priority+{reference.name}"
        self.stall_free = reference.stall_free
        self.chunked_prefill = reference.chunked_prefill
        self.order_is_static = reference.order_is_static  # priorities are fixed per request
        self.uses_pnm = reference.uses_pnm
        self.preempts_for_head = reference.preempts_for_head
        self.priority = dict(priority)
        self.ctx = None

    def bind(self, ctx) -> None:
        self.ctx = ctx
        self.reference.bind(ctx)

    def token_budget(self, default: int) -> int:
        return self.reference.token_budget(default)

    def chunk_limit(self, *args):
        return self.reference.chunk_limit(*args)

    def choose_preemption(self, *args):
        return self.reference.choose_preemption(*args)

    def choose_admission_preemption(self, *args, **kwargs):
        return self.reference.choose_admission_preemption(*args, **kwargs)

    def choose_head_preemption(self, *args, **kwargs):
        return self.reference.choose_head_preemption(*args, **kwargs)

    def choose_migrations(self, *args):
        return self.reference.choose_migrations(*args)

    def migration_free_steps(self, *args):
        return self.reference.migration_free_steps(*args)

    def on_request_finished(self, *args) -> None:
        self.reference.on_request_finished(*args)

    @property
    def output_history(self):
        return self.reference.output_history

    def _order(self, table: FeatureTable, base) -> np.ndarray | None:
        if not self.priority:
            return base
        ids = table.request_id
        order = np.arange(len(ids)) if base is None else np.asarray(base)
        p = np.fromiter((self.priority.get(int(i), 0) for i in ids[order]), np.int64, count=len(order))
        if not p.any():
            return base
        return order[np.argsort(p, kind="stable")]

    def order_waiting(self, table: FeatureTable) -> np.ndarray | None:
        return self._order(table, self.reference.order_waiting(table))

    def order_prefills(self, table: FeatureTable) -> np.ndarray | None:
        return self._order(table, self.reference.order_prefills(table))


class FixedAssignment:
    """A router sending the requests of ``assignment`` (request id -> instance) where it says and
    the others where ``base`` (a router) would (the base router sees and learns from every request)."""

    def __init__(self, base, assignment: Mapping[int, int]) -> None:
        self.base = base
        self.assignment = dict(assignment)
        self.name = f"fixed+{getattr(base, 'name', 'router')}"

    def bind(self, n_instances: int, seed: int = 0) -> None:
        self.base.bind(n_instances, seed)

    def route(self, table) -> int:
        row = self.base.route(table)
        return self.assignment.get(table.request_id, row)


def run_schedule(task: BenchTask, episode: Episode, schedule: Schedule, workload=None):
    """Serve ``episode`` with ``schedule``; returns the :class:`SimulationResult`."""
    from kvsched.policies.routing import make_router

    if task.env_id == "kvsched/Residency-v0":  # a tier order and a constant retention action (the workload is
        from .residency import run  # the episode's)

        return run(task, episode, schedule.heuristic, schedule.params)
    w = workload if workload is not None else task_source(task).workload(episode.workload_seed,
                                                                        episode.window_index)
    if task.env_id == "kvsched/Scheduling-v0":
        wrap = (lambda p: PriorityOverride(p, schedule.priority)) if schedule.priority else None
        return heuristic_cluster(task, schedule.heuristic, schedule.params, policy_wrap=wrap).run(w)
    router = make_router(schedule.heuristic, dict(schedule.params))
    if schedule.assignment:
        router = FixedAssignment(router, schedule.assignment)
    return heuristic_cluster(task, schedule.heuristic, schedule.params, router=router).run(w)


def missed_requests(result, metrics) -> list[int]:
    """Ids of the requests of ``result`` that missed their SLO (as ``summarize`` judges them)."""
    from kvsched.envs.sim.metrics import length_class

    rec = result.records
    if not len(rec):
        return []
    cls = length_class(rec["prompt_tokens"].to_numpy(), metrics)
    tag = rec["slo_class"].astype(str).to_numpy()
    judged = np.where(rec["slo_class"].notna().to_numpy() & np.isin(tag, list(metrics.slos)), tag, cls)
    ttft_slo = np.array([metrics.slos[c].ttft_s for c in judged])
    tpot_slo = np.array([metrics.slos[c].tpot_s for c in judged])
    e2e_slo = np.array([math.inf if metrics.slos[c].e2e_s is None else metrics.slos[c].e2e_s for c in judged])
    g = rec["generated_tokens"].to_numpy()
    first = rec["first_token_s"].to_numpy()
    fin = rec["finish_s"].to_numpy()
    arr = rec["arrival_s"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(g > 1, (fin - first) / np.maximum(g - 1, 1), 0.0)
        met = (rec["status"].to_numpy() == "finished") & (first - arr <= ttft_slo) & (tpot <= tpot_slo) \
            & (fin - arr <= e2e_slo)
    return [int(x) for x in rec["request_id"].to_numpy()[~met]]


def tune_on_episode(task: BenchTask, episode: Episode, start: Schedule, trials: int, workload,
                    seed: int = 0) -> tuple[float, Schedule]:
    """Optuna TPE over the start heuristic's ``SEARCH_SPACE`` on this episode (its defaults and
    ``start.params`` enqueued first); returns the best ``(score, schedule)`` found."""
    import optuna

    from kvsched.policies.base import make_policy

    space = type(make_policy(start.heuristic)).params_cls.SEARCH_SPACE if task.env_id != "kvsched/Routing-v0" else {}
    if trials <= 0 or not space:
        return -math.inf, start
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial({k: v for k, v in start.params.items() if k in space})
    best: tuple[float, Schedule] = (-math.inf, start)

    def objective(trial) -> float:
        nonlocal best
        params = {**start.params, **{name: d.suggest(trial, name) for name, d in space.items()}}
        sched = Schedule(start.heuristic, params)
        s = score(run_schedule(task, episode, sched, workload).summary)
        s = -1.0 if s is None else s
        if s > best[0]:
            best = (s, sched)
        return s

    study.optimize(objective, n_trials=trials)
    return best


def local_search(task: BenchTask, episode: Episode, start: Schedule, start_score: float, evals: int, workload,
                 seed: int = 0) -> tuple[float, Schedule, int]:
    """The greedy single-request search (see the module docstring); returns ``(score, schedule,
    simulations spent)``."""
    metrics = task_source(task).scenario.metrics_config()
    rng = np.random.default_rng(seed)
    best, sched = start_score, start
    result = run_schedule(task, episode, sched, workload)
    spent = 0
    routing = task.env_id == "kvsched/Routing-v0"
    while not routing and spent < evals:  # batch: deprioritise every request that missed
        missed = [r for r in missed_requests(result, metrics) if sched.priority.get(r, 0) <= 0]
        if not missed:
            break
        cand = Schedule(sched.heuristic, sched.params, {**sched.priority, **{r: 1 for r in missed}}, sched.assignment)
        r2 = run_schedule(task, episode, cand, workload)
        spent += 1
        s = score(r2.summary)
        if s is None or s <= best:
            break
        best, sched, result = s, cand, r2
    while spent < evals:
        missed = missed_requests(result, metrics)
        rng.shuffle(missed)
        improved = False
        for rid in missed:
            for cand in _moves(sched, rid, result, routing, task.instances):
                if spent >= evals:
                    break
                r2 = run_schedule(task, episode, cand, workload)
                spent += 1
                s = score(r2.summary)
                if s is not None and s > best:
                    best, sched, result, improved = s, cand, r2, True
                    break
            if improved or spent >= evals:
                break
        if not improved:
            break
    return best, sched, spent


def _moves(sched: Schedule, rid: int, result, routing: bool, instances: int) -> list[Schedule]:
    """Single-request changes of ``sched`` for request ``rid``."""
    if routing:
        rec = result.records
        now = int(rec.loc[rec["request_id"] == rid, "instance_id"].iloc[0])
        return [Schedule(sched.heuristic, sched.params, sched.priority, {**sched.assignment, rid: i})
                for i in range(instances) if i != now]
    cur = sched.priority.get(rid, 0)
    return [Schedule(sched.heuristic, sched.params, {**sched.priority, rid: v}, sched.assignment)
            for v in (-1, 1) if v != cur]


def hindsight(task: BenchTask, episode: Episode, baselines: Mapping[str, tuple[float | None, Schedule | None]],
              seed: int = 0) -> dict[str, Any]:
    """The hindsight search of one episode from its baselines (label -> (score, schedule or None)).

    Returns ``{"score", "schedule", "from", "param_score", "evals"}``: the best score over the
    baselines and the search (so it is >= every baseline), the schedule that reached it when the
    search found it (None when a baseline is best), which baseline it started from. A residency
    task has no search: its bound is the clairvoyant eviction order (:func:`.residency.bound`).
    """
    if task.env_id == "kvsched/Residency-v0":
        from .residency import BOUND, bound

        clair = score(run_schedule(task, episode, Schedule(BOUND)).summary)
        return bound({label: s for label, (s, _) in baselines.items()}, clair)
    w = task_source(task).workload(episode.workload_seed, episode.window_index)
    scored = [(s, label, sch) for label, (s, sch) in baselines.items() if s is not None]
    best_score, best_label, _ = max(scored, key=lambda x: x[0])
    startable = [(s, label, sch) for s, label, sch in scored if sch is not None]
    s0, from_label, start = max(startable, key=lambda x: x[0])
    pscore, psched = tune_on_episode(task, episode, start, task.search.param_trials, w, seed)
    if pscore > s0:
        s0, start = pscore, psched
    lscore, lsched, spent = local_search(task, episode, start, s0, task.search.local_evals, w, seed)
    if lscore > s0:
        s0, start = lscore, lsched
    found = s0 >= best_score  # the search's schedule reaches the bound (else a baseline without one does)
    return {"score": max(s0, best_score), "schedule": start.to_dict() if found else None, "from": from_label,
            "param_score": None if pscore == -math.inf else pscore,
            "evals": (0 if pscore == -math.inf else task.search.param_trials) + spent,  # simulations run
            "best_baseline": best_label}


def schedule_json(schedule: Schedule) -> str:
    """Deterministic JSON of a schedule (for hashing and files)."""
    return json.dumps(schedule.to_dict(), sort_keys=True)
