"""The task records of kvsched bench: what each task is, frozen and versioned.

A :class:`BenchTask` says which environment an agent acts in (id and keyword arguments), on
which scenario, with which window length and train / held-out split, which heuristics are its
baselines (with their defaults, and which of them are tuned on train episodes), how the held-out
episode pool is stratified, and what the hindsight search may spend. The tuned parameters of the
best heuristic are not written here by hand: :mod:`.compute` tunes them on train episodes and
stores them, with the study, in the suite's results file (:mod:`.results`); the environment an
agent is evaluated in has that tuned heuristic as its reference policy (:meth:`BenchTask.env_kwargs_for`).

Changing a task after its suite is released means a new suite version (a new task record).
Adding a task to a released suite changes no other task: each task's record and results are its
own (``results/<suite>.json`` holds them per task, computed by separate runs), so the released
tasks' records and results stay byte for byte what they were (``tests/experiments/test_suite_results.py``
pins them), and a new task is computed alone (``kvsched leaderboard --tasks <new> --compute``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require

#: environments a task may use
ENV_IDS = ("kvsched/Scheduling-v0", "kvsched/Routing-v0", "kvsched/Residency-v0")
#: what the hard stratum is chosen by (:mod:`.episodes`; each measured from the episode's workload
#: alone, :mod:`.bounds`):
#:
#: - ``offered_load``: the requests' alone prefill time summed over the window and the instances
#:   (how much of the GPU the prompts ask for: ordering and admission tasks);
#: - ``kv_pressure``: the peak share of the HBM KV capacity the requests alive at once would hold
#:   (preemption and swap tasks);
#: - ``reuse_pressure``: the mean share of the prefix cache (HBM and the lower tiers that cache
#:   prefixes) that blocks awaiting their next use would fill, each held from its first use to its
#:   last (Belady's live set; residency tasks: above 1 not every reuse can hit, and what to keep
#:   is a choice).
HARD_BY = ("offered_load", "kv_pressure", "reuse_pressure")
#: Residency-v0's heuristics: the tier eviction orders ``lru`` and ``lfu`` (action 0 of the
#: environment made with that order) and ``session`` (keep every finished request's conversation
#: ``keep_s`` seconds: a constant keep action); :mod:`.residency`
RESIDENCY_HEURISTICS = ("lru", "lfu", "session")


@dataclass(frozen=True)
class SearchBudget:
    """What the hindsight search (:mod:`.search`) may spend per episode.

    Attributes:
        param_trials: per-episode tuning trials of the tuned best heuristic's parameters (the
            window known), >= 0.
        local_evals: simulations of the priority search (boost or deprioritise single requests)
            or, for routing, of the reassignment search, >= 0.
    """

    param_trials: int = 12
    local_evals: int = 40

    def __post_init__(self) -> None:
        for name in ("param_trials", "local_evals"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"SearchBudget.{name}", v,
                    "an integer >= 0")


@dataclass(frozen=True)
class BenchTask:
    """One task of a suite (see the module docstring).

    Attributes:
        task_id: short name, unique in its suite (``[a-z0-9-]``).
        suite: the suite version (``"v1"``).
        description: what the task is, one sentence.
        lever: which scheduling decision has room on it (admission, chunking, preemption,
            routing ...), for readers.
        env_id: one of :data:`ENV_IDS`.
        scenario: a bundled scenario name (``experiments/scenarios/<name>.yaml``).
        window_s: episode window (s), > 0.
        heldout_fraction: share of the scenario's span held out (``EpisodeConfig``), in (0, 1).
        env_kwargs: other keyword arguments of the environment (e.g. ``k`` for Scheduling-v0),
            as ``(name, value)`` pairs.
        heuristics: baseline heuristics with their defaults: distinct policy names (Scheduling-v0),
            router names (Routing-v0) or :data:`RESIDENCY_HEURISTICS` (Residency-v0).
        tuned: the heuristics tuned on train episodes (a subset of ``heuristics``, each with a
            search space, or any policy with ``tune_residency``; on Residency-v0 ``session``, its
            keep time); the best of them on the train episodes is the task's reference.
        tune_trials: Optuna trials per tuned heuristic (TPE, defaults enqueued first), >= 1.
        tune_residency: also tune the KV-residency knobs every policy has (``kvsched tune
            --tune-residency``); lets a heuristic without parameters of its own be tuned.
        tune_episodes: train episodes in each trial's objective, >= 1.
        pool_seeds: held-out workload seeds of the episode pool (synthetic scenarios; a trace has
            one), >= 1.
        stratum_episodes: episodes per stratum, >= 1 (the protocol asks >= 24).
        hard_by: what ranks the pool for the hard stratum (:data:`HARD_BY`).
        search: the hindsight search's budget per episode. Residency-v0 has no search: its bound
            is the clairvoyant eviction order (:mod:`.residency`), so its budget is 0 and 0.
        instances: for Routing-v0, the cluster's instances (>= 2); ignored otherwise.
    """

    task_id: str
    suite: str
    description: str
    lever: str
    env_id: str
    scenario: str
    window_s: float
    heldout_fraction: float = 0.25
    env_kwargs: tuple[tuple[str, Any], ...] = ()
    heuristics: tuple[str, ...] = ("fcfs", "sarathi", "lars")
    tuned: tuple[str, ...] = ("lars",)
    tune_trials: int = 30
    tune_residency: bool = False
    tune_episodes: int = 8
    pool_seeds: int = 8
    stratum_episodes: int = 24
    hard_by: str = "offered_load"
    search: SearchBudget = field(default_factory=SearchBudget)
    instances: int = 0

    def __post_init__(self) -> None:
        for name in ("task_id", "suite"):
            v = getattr(self, name)
            require(isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", v) is not None, f"BenchTask.{name}", v,
                    "a lower-case name of letters a-z, digits and '-'")
        for name in ("description", "lever", "scenario"):
            v = getattr(self, name)
            require(isinstance(v, str) and v.strip() != "", f"BenchTask.{name}", v, "a non-empty text")
        require(self.env_id in ENV_IDS, "BenchTask.env_id", self.env_id, f"one of {ENV_IDS}")
        require(isinstance(self.window_s, (int, float)) and not isinstance(self.window_s, bool)
                and math.isfinite(self.window_s) and self.window_s > 0, "BenchTask.window_s", self.window_s,
                "a finite number of seconds > 0")
        require(isinstance(self.heldout_fraction, float) and 0 < self.heldout_fraction < 1,
                "BenchTask.heldout_fraction", self.heldout_fraction, "a number in (0, 1)")
        routing = self.env_id == "kvsched/Routing-v0"
        residency = self.env_id == "kvsched/Residency-v0"
        require(isinstance(self.instances, int) and not isinstance(self.instances, bool) and self.instances >= 0
                and (not routing or self.instances >= 2), "BenchTask.instances", self.instances,
                "an integer >= 2 for a routing task (>= 0, ignored, otherwise)")
        known = _heuristic_names(self.env_id)
        kind = "routers" if routing else "residency heuristics" if residency else "policies"
        require(isinstance(self.heuristics, tuple) and bool(self.heuristics)
                and all(isinstance(h, str) and h in known for h in self.heuristics)
                and len(set(self.heuristics)) == len(self.heuristics), "BenchTask.heuristics", self.heuristics,
                f"a non-empty tuple of distinct {kind} of {tuple(known)}")
        require(isinstance(self.tuned, tuple) and bool(self.tuned) and set(self.tuned) <= set(self.heuristics)
                and len(set(self.tuned)) == len(self.tuned), "BenchTask.tuned", self.tuned,
                f"a non-empty tuple of distinct heuristics of {self.heuristics}")
        require(isinstance(self.env_kwargs, tuple)
                and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.env_kwargs)
                and len({kv[0] for kv in self.env_kwargs}) == len(self.env_kwargs)
                and not {kv[0] for kv in self.env_kwargs} & set(TASK_SET_ENV_KWARGS), "BenchTask.env_kwargs",
                self.env_kwargs, f"a tuple of distinct (name, value) pairs, none of {TASK_SET_ENV_KWARGS}")
        require(isinstance(self.search, SearchBudget), "BenchTask.search", self.search, "a SearchBudget")
        require(not residency or self.search == SearchBudget(0, 0), "BenchTask.search", self.search,
                "SearchBudget(0, 0) on kvsched/Residency-v0 (its bound is the clairvoyant eviction order, no search)")
        for name in ("tune_trials", "tune_episodes", "pool_seeds", "stratum_episodes"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"BenchTask.{name}", v,
                    "an integer >= 1")
        require(isinstance(self.tune_residency, bool), "BenchTask.tune_residency", self.tune_residency, "true or false")
        require(self.hard_by in HARD_BY, "BenchTask.hard_by", self.hard_by, f"one of {HARD_BY}")
        untunable = [h for h in self.tuned if not _tunable(h, self.env_id, self.tune_residency)]
        require(not untunable, "BenchTask.tuned", self.tuned, f"heuristics with something to tune ({untunable} have "
                "no search space" + ("; on Residency-v0 only session (its keep time)" if residency else "" if routing
                                     else "; tune_residency=True tunes the residency knobs") + ")")

    @property
    def name(self) -> str:
        """``<task_id>@<suite>``, the task's identity in results and datasets."""
        return f"{self.task_id}@{self.suite}"

    def env_kwargs_for(self, split: str, reference: str | None = None,
                       reference_params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments of the task's environment for ``split`` ("train", "heldout"), with the
        given reference heuristic (Scheduling-v0: ``reference_policy`` / ``reference_params``;
        Routing-v0: the instances' policy stays the scenario's, the router is the agent;
        Residency-v0: the tiers keep the order of ``env_kwargs`` (or the scenario's), the
        retention decisions are the agent's, no reference behind action 0)."""
        kw: dict[str, Any] = {"scenario": self.scenario, "window_s": float(self.window_s), "split": split,
                              "heldout_fraction": self.heldout_fraction, "horizon_s": math.inf}
        kw.update(dict(self.env_kwargs))
        if self.env_id == "kvsched/Scheduling-v0":
            if reference is not None:
                kw["reference_policy"] = reference
                kw["reference_params"] = dict(reference_params or {})
        elif self.env_id == "kvsched/Routing-v0":
            kw["n_instances"] = self.instances
        return kw


#: environment keyword arguments a task sets itself (:meth:`BenchTask.env_kwargs_for`), not in ``env_kwargs``
TASK_SET_ENV_KWARGS = ("scenario", "window_s", "split", "heldout_fraction", "horizon_s", "reference_policy",
                       "reference_params", "n_instances")


def _heuristic_names(env_id: str) -> list[str]:
    """The heuristics a task of ``env_id`` may name: routers (Routing-v0), residency heuristics
    (Residency-v0) or policies (Scheduling-v0)."""
    from kvsched.policies.base import policy_names
    from kvsched.policies.routing import router_names

    if env_id == "kvsched/Residency-v0":
        return list(RESIDENCY_HEURISTICS)
    return router_names() if env_id == "kvsched/Routing-v0" else policy_names()


def _tunable(heuristic: str, env_id: str, residency: bool) -> bool:
    """Whether tuning ``heuristic`` has a search space (its own, or the residency knobs; on
    Residency-v0 only the session keep has one: its keep time)."""
    from kvsched.policies.routing import tunable_router_names

    if env_id == "kvsched/Residency-v0":
        return heuristic == "session"
    if env_id == "kvsched/Routing-v0":
        return heuristic in tunable_router_names()
    from kvsched.policies.base import make_policy

    return residency or bool(type(make_policy(heuristic)).params_cls.SEARCH_SPACE)


#: the hindsight search's budget in suite v1 (per episode): 8 trials of the tuned reference's
#: parameters with the window known, then 48 single-request priority moves (or reassignments)
V1_SEARCH = SearchBudget(param_trials=8, local_evals=48)


def _v1_tasks() -> tuple[BenchTask, ...]:
    """The tasks of suite v1 (see docs/bench.md for why each is in, its measured headroom, and the
    candidates dropped for having none)."""
    common: dict[str, Any] = dict(suite="v1", env_id="kvsched/Scheduling-v0", tune_trials=24, tune_episodes=6,
                                  stratum_episodes=24, search=V1_SEARCH)
    return (
        BenchTask(task_id="kv-burst-tiers", lever="admission, chunking and preemption tier under KV pressure",
                  description="Bursty mixed traffic (Gamma CV 4, 3 % long contexts) at 10 req/s with a 0.5 s "
                              "short TTFT SLO on a 30 % KV cache with 16 GiB DRAM and NVMe swap tiers; hard = the "
                              "windows of highest KV pressure.",
                  scenario="bench-v1-kv-burst-tiers", window_s=60.0, pool_seeds=14, hard_by="kv_pressure",
                  heuristics=("fcfs", "sarathi", "lars", "priority", "prefetch"), tuned=("lars",),
                  tune_residency=True, **common),
        BenchTask(task_id="overload-burst", lever="admission order under overload (deadline-first cascades)",
                  description="Bursty interactive 1k-token prompts (Gamma CV 4) with a 0.5 s TTFT SLO at 9 req/s "
                              "on one H100; hard = the windows of highest offered load.",
                  scenario="bench-v1-overload-burst", window_s=30.0, pool_seeds=14, hard_by="offered_load",
                  heuristics=("fcfs", "sarathi", "lars", "priority", "ewsjf"), tuned=("lars",), **common),
        BenchTask(task_id="mooncake-1i", lever="prefill ordering and chunking on a heavy-tailed real trace",
                  description="The Mooncake conversation trace at 60 % of its rate on one H100; hard = the "
                              "windows of highest offered load.",
                  scenario="bench-v1-mooncake-1i", window_s=60.0, hard_by="offered_load",
                  heuristics=("fcfs", "sarathi", "lars", "priority"), tuned=("lars",), **common),
        BenchTask(task_id="sessions-small-kv", lever="cache residency of multi-turn sessions (prefix reuse)",
                  description="Multi-turn sessions behind shared 2k-token system prompts, in bursts, on a 30 % "
                              "KV cache; hard = the windows of highest offered load.",
                  scenario="bench-v1-sessions-small-kv", window_s=30.0, pool_seeds=8, hard_by="offered_load",
                  heuristics=("fcfs", "sarathi", "lars", "priority", "ewsjf"), tuned=("lars", "priority"),
                  tune_residency=True, **common),
        BenchTask(task_id="routing-stale", lever="cluster routing with stale instance state",
                  description="The Mooncake conversation trace at 1.5x its rate on four H100s, the router seeing "
                              "instance state 2 s old; the agent places each arrival; hard = the windows of "
                              "highest offered load.",
                  scenario="bench-v1-routing-stale", window_s=20.0, hard_by="offered_load", instances=4,
                  heuristics=("round-robin", "least-loaded", "session-affinity", "cache-affinity", "prefix",
                              "llm-d", "dynamo"), tuned=("cache-affinity", "llm-d", "dynamo"),
                  **{**common, "env_id": "kvsched/Routing-v0"}),
        # added after v1's release (issue #21); the tasks above are unchanged
        BenchTask(task_id="residency-sessions",
                  lever="how long each conversation's cached prefix stays in host DRAM (retention)",
                  description="Multi-turn sessions (96 concurrent conversations behind shared 2k-token system "
                              "prompts, bursty at 2 req/s) on one H100 with a 30 % KV cache and 16 GiB of DRAM "
                              "caching prefixes (LRU); at each finished request the agent keeps, drops or demotes "
                              "its conversation's DRAM entries; the bound is the clairvoyant eviction order; hard = "
                              "the windows of highest reuse pressure.",
                  scenario="bench-v1-residency-sessions", window_s=300.0, env_kwargs=(("eviction", "lru"),),
                  pool_seeds=16, hard_by="reuse_pressure", heuristics=("lru", "lfu", "session"),
                  tuned=("session",), **{**common, "env_id": "kvsched/Residency-v0", "tune_trials": 7,
                                         "search": SearchBudget(0, 0)}),
    )


SUITES: dict[str, tuple[BenchTask, ...]] = {"v1": _v1_tasks()}


def get_suite(version: str) -> tuple[BenchTask, ...]:
    """The tasks of suite ``version``.

    Raises:
        ConfigError: an unknown version (the message lists the known ones).
    """
    if version not in SUITES:
        raise ConfigError(f"unknown suite {bounded_repr(version)}; known: {', '.join(SUITES)}")
    return SUITES[version]


def get_task(version: str, task_id: str) -> BenchTask:
    """Task ``task_id`` of suite ``version``.

    Raises:
        ConfigError: an unknown suite or task (the message lists the suite's tasks).
    """
    tasks = get_suite(version)
    for t in tasks:
        if t.task_id == task_id:
            return t
    raise ConfigError(f"suite {version} has no task {bounded_repr(task_id)}; tasks: "
                      f"{', '.join(t.task_id for t in tasks)}")
