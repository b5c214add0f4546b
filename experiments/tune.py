"""Bayesian tuning of a policy's or a cluster router's parameters with Optuna (``kvsched tune``).

One *trial* serves the scenario's workload in ``len(windows) x len(seeds)`` short runs with
one parameter set and scores each run on one metric of one length class (``goodput_rps:all``,
``ttft_p99_s:short``, ...; the metric names of :data:`kvsched.experiments.compare.METRIC_COLUMNS`).
The trial's value is the mean over runs; the spread (population std, min, max) and every
run's value are stored as user attributes.

Search space. Each policy declares it next to its parameters
(``PolicyParams.SEARCH_SPACE``, a mapping name -> :class:`~kvsched.policies.base.SearchDim`,
e.g. :class:`~kvsched.policies.lars.LARSParams`). ``--tune-engine`` adds the engine knobs of
:data:`ENGINE_SPACE` (vLLM flags of the same names, applied to the scenario's instance);
those trial parameters are named ``engine.<field>``.

Router studies (``--router NAME``, :attr:`TuneConfig.router`). The trial parameters are then
the cluster router's (``RouterParams.SEARCH_SPACE`` in :mod:`kvsched.policies.routing`, plain
field names as for a policy; ``--tune-engine`` may add the engine knobs). The tuned router
replaces the scenario's ``router`` and ``router_params`` (its other fields keep the router's
defaults; a ``seed`` field gets the run's seed, as for policies); the scenario's policy and
``policy_params``, router delay, shared KV tier and instance count stay as the scenario says.
It needs a scenario with ``n_instances >= 2``. ``--tune-residency`` (policy parameters) is
refused there.

Windows and seeds. Windows are ``[start, start + window_s)`` sub-intervals of the scenario's
workload (inside its own ``window_s`` if it has one), spread evenly over its arrival span;
each run starts from an empty instance (no warm-up: queues left at a window's end are
served to completion, arrivals after it are not). Seeds ``seed, seed+1, ...`` regenerate
synthetic workloads; on a trace they only change seeded policy internals (EWSJF's sampler,
whose ``seed`` parameter gets the run's seed unless tuned).

Pruning. After each window (all its seeds) the running mean of the objective is reported as
the intermediate value of step ``window index``; Optuna's ``MedianPruner`` (default;
``--pruner none`` turns it off) stops a trial whose running mean is worse than the median of
earlier trials at the same step.

Constraints (``--constraint 'ttft_p99_s:short<=1.0'``, repeatable). Each is stored as
``value - bound`` (``<=``) or ``bound - value`` (``>=``) of the mean over runs; feasible
when ``<= 0``. Samplers that support Optuna's ``constraints_func`` (TPE, GP) get them there
and the trial's value stays the raw objective. CMA-ES has no constraint support, so there the
value told to Optuna is penalised: ``objective -/+ penalty x sum(relative violation)``
(relative violation = ``max(0, c) / max(|bound|, 1e-9)``; ``-`` when maximising), with
``--penalty`` (default 10, in objective units per 100 % violation); the raw objective is kept
in the ``objective_mean`` user attribute. The *best* trial is always chosen by kvsched among
feasible finished trials by the raw mean objective, never from Optuna's penalised value.

Baseline. The policy's (or router's) published defaults (the parameter dataclass defaults, and the
scenario's engine settings) are enqueued as the study's first trial (user attribute
``baseline``). The report compares the best trial with it; when no trial beats it, that is
said. ``--holdout-seeds K`` re-evaluates baseline and best on K seeds the study never saw
(the in-sample gain of a maximum over many noisy trials is biased upward).

Storage. No ``--storage``: in memory (one process). ``journal:PATH`` or a path ending in
``.journal``/``.log``: Optuna's ``JournalStorage`` file (any number of processes on one
machine). ``sqlite:///...``, ``postgresql://...``: Optuna's ``RDBStorage`` (SQLAlchemy; for
PostgreSQL the psycopg2 driver), which lets ``kvsched tune`` workers on several machines
join one study, with heartbeats (a killed worker's running trial is marked failed after
``grace_period`` and retried once). ``--workers N`` starts N processes on this machine
(a journal file in ``--out`` when no storage is given). ``--trials N`` is the study's total
of COMPLETE trials (pruned and failed ones do not count; Optuna's ``MaxTrialsCallback``
default): every worker checks before each trial and stops when the study holds ``N``, and
one that finds enough trials in flight on live workers waits for them (:mod:`.tune_gate`), so
a journal or in-memory study ends with exactly ``N`` (an RDB study shared across machines
with up to ``workers - 1`` more). A worker stops with an error after
:data:`MAX_FAILED_IN_A_ROW` failed trials in a row. Re-running the same command after a kill
resumes the study and runs only the missing trials; finished trials are in the storage as
soon as they finish and are never re-run. A trial that was running when its process was
killed stays ``RUNNING`` in a journal (it never finished) and is not counted. The sampler is
seeded from ``--seed``, the worker's slot (one no concurrent worker or command on the same
journal holds; 0 for a worker alone, :mod:`.tune_gate`) and the number of trials already in the
study (:func:`sampler_seed`), so a resumed study continues the sampler's sequence instead of
replaying the parameter sets it already ran, and concurrent commands do not propose the same
ones. A journal whose last record was cut short (a full disk) is recovered up to its last
complete record when it is opened, and the trials the lost records left running are marked
failed; one damaged in the middle is refused, untouched (:mod:`.journal`). A storage write that
fails (a full disk) ends the command with one line; finished trials are kept.

Results: the best parameters and their objective vs the baseline (printed and
``tune.json``), ``trials.csv``, and plots ``history.png`` (optimisation history) and
``importances.png`` (PED-ANOVA parameter importances, Optuna's default evaluator) from
``optuna.visualization.matplotlib``
(Agg backend). The study opens in optuna-dashboard (``pip install optuna-dashboard``;
``optuna-dashboard <storage URL>``; for a journal file ``optuna-dashboard PATH``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import multiprocessing as mp
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import kvsched
from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.metrics import LENGTH_CLASSES
from kvsched.policies.base import SearchDim, make_policy

from .compare import METRIC_COLUMNS, _metric_row
from kvsched.runner.scenario import Scenario
from kvsched import atomic_files

#: Engine knobs ``--tune-engine`` adds (InstanceSpec fields = vLLM flags of the same names).
#: Ranges: kvsched choice around the vLLM defaults for >= 70 GiB GPUs (token budget 8192,
#: 1024 sequences; REFERENCE §4.1); the long-prefill threshold 0 = off.
ENGINE_SPACE: Mapping[str, SearchDim] = {
    "max_num_batched_tokens": SearchDim("int", 512, 16384, log=True, source="vLLM --max-num-batched-tokens"),
    "max_num_seqs": SearchDim("int", 32, 1024, log=True, source="vLLM --max-num-seqs"),
    "long_prefill_token_threshold": SearchDim("categorical", choices=(0, 512, 1024, 2048, 4096),
                                              source="vLLM --long-prefill-token-threshold"),
}
ENGINE_PREFIX = "engine."
#: Metrics where larger is better; every other metric is minimised.
MAXIMISED = frozenset({"goodput_rps", "slo_attainment", "finished"})
SAMPLERS = ("tpe", "gp", "cmaes")
#: Classes a run's summary reports metrics for ("all" and the length classes).
METRIC_CLASSES: tuple[str, ...] = ("all",) + LENGTH_CLASSES
_CONSTRAINT_RE = re.compile(r"^\s*([a-z0-9_]+)(?::([A-Za-z0-9_-]+))?\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")


# ----------------------------------------------------------------------------- specifications
@dataclass(frozen=True)
class MetricRef:
    """A metric of one class: ``name`` in METRIC_COLUMNS, ``cls`` one of :data:`METRIC_CLASSES`
    (the classes of a run's summary, :func:`kvsched.envs.sim.metrics.summarize`)."""

    name: str
    cls: str = "all"

    @classmethod
    def parse(cls, text: str, what: str = "--objective") -> "MetricRef":
        """``"goodput_rps"`` or ``"ttft_p99_s:short"``. Raises ConfigError naming the allowed metrics."""
        name, _, c = str(text).strip().partition(":")
        if name not in METRIC_COLUMNS:
            raise ConfigError(f"{what}={bounded_repr(text)}: unknown metric {bounded_repr(name)}; "
                              f"allowed: {', '.join(METRIC_COLUMNS)} "
                              f"(optionally ':CLASS', e.g. ttft_p99_s:short)")
        c = c or "all"
        if c not in METRIC_CLASSES:
            raise ConfigError(f"{what}={bounded_repr(text)}: unknown class {bounded_repr(c)}; "
                              f"allowed: {', '.join(METRIC_CLASSES)}")
        return cls(name, c)

    @property
    def maximise(self) -> bool:
        return self.name in MAXIMISED

    def __str__(self) -> str:
        return f"{self.name}:{self.cls}"


@dataclass(frozen=True)
class Constraint:
    """``metric <= bound`` or ``metric >= bound`` on the mean over a trial's runs."""

    metric: MetricRef
    op: str
    bound: float

    @classmethod
    def parse(cls, text: str) -> "Constraint":
        """``"ttft_p99_s:short<=1.0"``. Raises ConfigError on another form."""
        m = _CONSTRAINT_RE.match(str(text))
        if not m:
            raise ConfigError(f"--constraint={bounded_repr(text)}: expected METRIC[:CLASS]<=BOUND or >=BOUND, "
                              "e.g. 'ttft_p99_s:short<=1.0'")
        try:
            bound = float(m.group(4))
        except ValueError:
            raise ConfigError(f"--constraint={bounded_repr(text)}: bound {bounded_repr(m.group(4))} "
                              "is not a number") from None
        ref = MetricRef.parse(m.group(1) + (f":{m.group(2)}" if m.group(2) else ""), "--constraint")
        return cls(ref, m.group(3), bound)

    def violation(self, value: float) -> float:
        """``value - bound`` for ``<=``, ``bound - value`` for ``>=`` (feasible when <= 0; NaN -> +inf)."""
        if not math.isfinite(value):
            return math.inf
        return value - self.bound if self.op == "<=" else self.bound - value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"


@dataclass(frozen=True)
class TuneConfig:
    """Everything that defines a study's objective (stored with the study as provenance).

    Attributes:
        policy: registered policy name (with ``router``: the scenario's policy, run with the
            scenario's ``policy_params``, not tuned).
        objective: the metric to optimise (direction from :data:`MAXIMISED`).
        constraints: bounds on other metrics.
        windows_s: ``(start_s, end_s)`` per window, relative to the scenario's workload.
        seeds: scenario seeds of every window.
        tune_engine: add :data:`ENGINE_SPACE`.
        tune_residency: add the KV-residency knobs every policy has
            (:attr:`~kvsched.policies.base.PolicyParams.RESIDENCY_SEARCH_SPACE`).
        sampler: "tpe", "gp" or "cmaes".
        penalty: CMA-ES constraint penalty (objective units per 100 % violation).
        pruner: "median" or "none".
        sampler_seed: seed of the sampler (worker k uses ``sampler_seed + k``).
        router: ``None`` (tune the policy) or a registered router name (canonical after
            validation): tune that router's ``SEARCH_SPACE`` instead of the policy's.
    """

    policy: str
    objective: MetricRef
    constraints: tuple[Constraint, ...] = ()
    windows_s: tuple[tuple[float, float], ...] = ((0.0, 60.0),)
    seeds: tuple[int, ...] = (0,)
    tune_engine: bool = False
    sampler: str = "tpe"
    tune_residency: bool = False
    penalty: float = 10.0
    pruner: str = "median"
    sampler_seed: int = 0
    router: str | None = None

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--sampler={bounded_repr(self.sampler)}: allowed {', '.join(SAMPLERS)}")
        if self.pruner not in ("median", "none"):
            raise ConfigError(f"--pruner={bounded_repr(self.pruner)}: allowed median, none")
        if not self.windows_s or not self.seeds:
            raise ConfigError("tuning needs at least one window and one seed")
        if not (self.penalty >= 0 and math.isfinite(self.penalty)):
            raise ConfigError(f"--penalty={bounded_repr(self.penalty)} must be a finite number >= 0")
        make_policy(self.policy)  # unknown name -> error listing the known ones
        if self.router is not None:
            self._check_router()
            return
        if not self.space():
            raise ConfigError(f"policy {bounded_repr(self.policy)} declares no search space "
                              "(PolicyParams.SEARCH_SPACE); "
                              "add --tune-residency (the KV-residency knobs every policy has) or --tune-engine "
                              "(the engine knobs)")

    def _check_router(self) -> None:
        """Validate ``router`` and store its canonical name (``rr`` -> ``round-robin``)."""
        from kvsched.policies.routing import ROUTERS, router_names, tunable_router_names

        if not isinstance(self.router, str) or self.router not in ROUTERS:
            raise ConfigError(f"--router={bounded_repr(self.router)} is not allowed: unknown router; known: "
                              f"{', '.join(router_names())} (with a search space: {', '.join(tunable_router_names())})")
        object.__setattr__(self, "router", ROUTERS.canonical(self.router))
        if not ROUTERS.get(self.router).params_cls.SEARCH_SPACE:
            raise ConfigError(f"--router={bounded_repr(self.router)} declares no search space "
                              "(RouterParams.SEARCH_SPACE: it has "
                              f"no tunable parameters); routers with one: {', '.join(tunable_router_names())}")
        if self.tune_residency:
            raise ConfigError(f"--tune-residency with --router={bounded_repr(self.router)} is not allowed: "
                              "a router study keeps "
                              "the scenario's policy and policy_params fixed; tune the residency knobs in a policy "
                              "study (--policy)")

    @property
    def direction(self) -> str:
        return "maximize" if self.objective.maximise else "minimize"

    @property
    def tuned(self) -> str:
        """What the study tunes, in words: ``"policy lars"`` or ``"router llm-d"``."""
        return f"router {self.router}" if self.router is not None else f"policy {self.policy}"

    def space(self) -> dict[str, SearchDim]:
        """Trial parameter name -> dimension (policy or router fields, then ``engine.<field>``)."""
        if self.router is not None:
            from kvsched.policies.routing import ROUTERS

            out = dict(ROUTERS.get(self.router).params_cls.SEARCH_SPACE)
            if self.tune_engine:
                out.update({ENGINE_PREFIX + k: v for k, v in ENGINE_SPACE.items()})
            return out
        pcls = type(make_policy(self.policy)).params_cls
        out = dict(pcls.SEARCH_SPACE)
        if self.tune_residency:
            out.update({k: v for k, v in pcls.RESIDENCY_SEARCH_SPACE.items() if k not in out})
        if self.tune_engine:
            out.update({ENGINE_PREFIX + k: v for k, v in ENGINE_SPACE.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "objective": str(self.objective), "direction": self.direction,
                "constraints": [str(c) for c in self.constraints], "windows_s": [list(w) for w in self.windows_s],
                "seeds": list(self.seeds), "tune_engine": self.tune_engine,
                "tune_residency": self.tune_residency, "sampler": self.sampler,
                "penalty": self.penalty, "pruner": self.pruner, "sampler_seed": self.sampler_seed,
                "router": self.router}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TuneConfig":
        return cls(policy=d["policy"], objective=MetricRef.parse(d["objective"]),
                   constraints=tuple(Constraint.parse(c) for c in d["constraints"]),
                   windows_s=tuple(tuple(w) for w in d["windows_s"]), seeds=tuple(d["seeds"]),
                   tune_engine=d["tune_engine"], tune_residency=bool(d.get("tune_residency", False)),
                   sampler=d["sampler"], penalty=d["penalty"],
                   pruner=d["pruner"], sampler_seed=d["sampler_seed"],
                   router=d.get("router"))  # studies from before --router existed: None


def even_windows(scenario: Scenario, n_windows: int, window_s: float) -> tuple[tuple[float, float], ...]:
    """``n_windows`` windows of ``window_s`` seconds spread evenly over the scenario's arrival span.

    The span is the scenario's workload (seed ``scenario.seed``, inside its own ``window_s``)
    from 0 to its last arrival, in the workload's own seconds: windows are applied the way
    ``kvsched simulate --window`` applies them, before ``rate_scale`` and ``max_requests``
    (so with ``rate_scale: 2`` a 60 s window holds 60 trace seconds served in 30 s, and
    ``max_requests`` caps each window).

    Raises:
        ConfigError: ``n_windows < 1``, ``window_s <= 0`` or a window longer than the span.
    """
    if isinstance(n_windows, bool) or not isinstance(n_windows, int) or n_windows < 1:
        raise ConfigError(f"--windows={bounded_repr(n_windows)} must be an integer >= 1")
    if not (isinstance(window_s, (int, float)) and window_s > 0 and math.isfinite(window_s)):
        raise ConfigError(f"--window-s={bounded_repr(window_s)} must be a finite number > 0 (seconds)")
    # the span in the time windows are cut in (run_scenario: the scenario's window_s, applied
    # before rate scaling and the request cap)
    w = scenario.with_overrides(rate_scale=1.0, max_requests=None).workload()
    span_s = float(w.arrival_s[-1]) if len(w) else 0.0
    if window_s > span_s:
        raise ConfigError(f"--window-s={window_s}: longer than the scenario's arrival span ({span_s:.1f} s)")
    if n_windows == 1:
        return ((0.0, float(window_s)),)
    stride = (span_s - window_s) / (n_windows - 1)
    return tuple((round(k * stride, 6), round(k * stride + window_s, 6)) for k in range(n_windows))


# ----------------------------------------------------------------------------- evaluation
def split_params(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """Trial parameters -> ``(policy or router params, engine overrides)``."""
    pol = {k: v for k, v in params.items() if not k.startswith(ENGINE_PREFIX)}
    eng = {k[len(ENGINE_PREFIX):]: v for k, v in params.items() if k.startswith(ENGINE_PREFIX)}
    return pol, eng


def check_scenario(cfg: TuneConfig, scenario: Scenario) -> None:
    """What a router study needs of its scenario (nothing for a policy study).

    Raises:
        ConfigError: ``n_instances < 2`` (a router picks among instances), or ``cfg.policy`` not
            the scenario's policy (a router study runs the scenario's policy with its
            ``policy_params``).
    """
    if cfg.router is None:
        return
    check_router_cluster(cfg.router, scenario)
    mine, theirs = type(make_policy(cfg.policy)).name, type(make_policy(scenario.policy)).name
    if mine != theirs:
        raise ConfigError(f"policy={bounded_repr(cfg.policy)} is not allowed with --router={bounded_repr(cfg.router)}: "
                          f"expected the scenario's policy {bounded_repr(theirs)} (a router study runs it with the "
                          "scenario's policy_params)")


def check_router_cluster(router: str, scenario: Scenario) -> None:
    """A router study's scenario must have ``n_instances >= 2``.

    Raises:
        ConfigError: naming ``n_instances``, its value and the scenario.
    """
    if scenario.n_instances < 2:
        raise ConfigError(f"n_instances={bounded_repr(scenario.n_instances)} is not allowed with "
                          f"--router={bounded_repr(router)}: "
                          f"expected n_instances >= 2 (a router picks among instances; set n_instances in "
                          f"scenario {bounded_repr(scenario.name)})")


def run_args(cfg: TuneConfig, scenario: Scenario, params: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :func:`run_scenario` for one trial's parameters: policy and its
    parameters, engine overrides and, in a router study, the router and its parameters."""
    given, eng = split_params(params)
    if cfg.router is None:
        return {"policy": cfg.policy, "policy_params": given, "engine": eng}
    return {"policy": cfg.policy, "policy_params": dict(scenario.policy_params), "engine": eng,
            "router": cfg.router, "router_params": given}


def baseline_params(cfg: TuneConfig, scenario: Scenario) -> dict[str, Any]:
    """The policy's (router's) published defaults for every tuned dimension (and the scenario's
    engine values)."""
    if cfg.router is not None:
        from kvsched.policies.routing import make_router

        params: Any = make_router(cfg.router).params
    else:
        params = make_policy(cfg.policy).params
    spec = scenario.instance_spec()
    out: dict[str, Any] = {}
    for name in cfg.space():
        if name.startswith(ENGINE_PREFIX):
            field_name = name[len(ENGINE_PREFIX):]
            v = getattr(spec, field_name)
            if v is None:  # vLLM default resolved by the spec
                v = {"max_num_batched_tokens": spec.token_budget, "max_num_seqs": spec.max_seqs}[field_name]
            out[name] = v
        else:
            out[name] = getattr(params, name)
    return out


def run_scenario(scenario: Scenario, window: tuple[float, float], seed: int, policy: str,
                 policy_params: Mapping[str, Any], engine: Mapping[str, Any] | None = None,
                 workload_cache: dict | None = None, router: str | None = None,
                 router_params: Mapping[str, Any] | None = None) -> dict:
    """Serve one window of ``scenario`` with one seed; returns the run's summary dict.

    ``window`` is relative to the scenario's own ``window_s`` (if any). A policy with a
    ``seed`` parameter gets ``seed`` unless ``policy_params`` sets it (as ``kvsched compare``).
    ``router`` ``None``: the scenario's router and ``router_params``; a router name: that
    router with ``router_params`` over its defaults (the scenario's ``router_params`` are not
    used; a ``seed`` field gets ``seed`` unless given), as a router study runs it.
    """
    from kvsched.envs.sim.instance import InstanceOptions
    from kvsched.runner.simulate import build_cluster

    sc = scenario_for(scenario, window, seed, engine)
    key = (tuple(window), seed)
    if workload_cache is not None and key in workload_cache:
        workload = workload_cache[key]
    else:
        workload = sc.workload()
        sc.check_slo_classes(workload)
        if workload_cache is not None:
            workload_cache[key] = workload
    params = full_policy_params(policy, policy_params, seed)
    spec = sc.instance_spec()
    # the cluster `kvsched simulate` builds for this scenario: router, its state delay, shared
    # KV tier and seed included (a --policy-file round trip must see the same cluster)
    if router is None:
        router, rparams = sc.router, dict(sc.router_params)
    else:
        rparams = full_router_params(router, router_params or {}, seed)
    layout = sc.cluster_layout()  # prefill/decode roles (docs/disaggregation.md), or None
    roles = {} if layout is None else {
        "disagg": layout.disagg_spec(), "prefill_router": layout.prefill_router,
        "prefill_router_params": dict(layout.prefill_router_params)}
    cluster = build_cluster([spec] * sc.n_instances if layout is None else sc.instance_specs(), policy, dict(params),
                            metrics=sc.metrics_config(),
                            options=InstanceOptions(fast_forward=True, oracle_lengths=sc.oracle_lengths),
                            router=router, router_params=rparams,
                            router_delay_s=sc.router_delay_s, shared_kv=sc.shared_kv_spec(), seed=sc.seed, **roles)
    res = cluster.run(workload)
    res.summary["workload_sha256"] = workload.content_sha256()
    return res.summary


def scenario_for(scenario: Scenario, window: tuple[float, float], seed: int,
                 engine: Mapping[str, Any] | None = None) -> Scenario:
    """The scenario of one run: its window nested in the scenario's own, its seed, engine overrides."""
    base = scenario.window_s[0] if scenario.window_s else 0.0
    over: dict[str, Any] = {"window_s": (base + window[0], base + window[1]), "seed": int(seed)}
    if engine:
        over["instance"] = {**scenario.instance, **dict(engine)}
    return scenario.with_overrides(**over)


def full_policy_params(policy: str, given: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """Every field of the policy's parameter dataclass (``given`` over defaults; ``seed`` field = run seed)."""
    pcls = type(make_policy(policy)).params_cls
    d = dict(given)
    if "seed" in {f.name for f in dataclasses.fields(pcls)} and "seed" not in d:
        d["seed"] = int(seed)
    return dataclasses.asdict(make_policy(policy, d).params)


def full_router_params(router: str, given: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """Every field of the router's parameter dataclass (``given`` over defaults; ``seed`` field = run seed).

    Raises:
        UnknownPresetError: unknown router. ConfigError: unknown fields or invalid values.
    """
    from kvsched.policies.routing import ROUTERS, make_router

    d = dict(given)
    if "seed" in {f.name for f in dataclasses.fields(ROUTERS.get(router).params_cls)} and "seed" not in d:
        d["seed"] = int(seed)
    return dataclasses.asdict(make_router(router, d).params)


def metric_value(summary: Mapping[str, Any], ref: MetricRef) -> float:
    """The value of ``ref`` in one run's summary (NaN when the class or metric is undefined)."""
    c = summary["classes"].get(ref.cls)
    if c is None:
        return math.nan
    return float(_metric_row(c)[ref.name])


# ----------------------------------------------------------------------------- the objective
class Objective:
    """Optuna objective: evaluate one parameter set on every window and seed (see module doc)."""

    def __init__(self, cfg: TuneConfig, scenario: Scenario,
                 progress: Callable[[str], None] | None = None) -> None:
        check_scenario(cfg, scenario)
        self.cfg, self.scenario, self.progress = cfg, scenario, progress
        self.space = cfg.space()
        self._cache: dict = {}

    def suggest(self, trial) -> dict[str, Any]:
        return {name: d.suggest(trial, name) for name, d in self.space.items()}

    def __call__(self, trial) -> float:
        import optuna

        params = self.suggest(trial)
        kw = run_args(self.cfg, self.scenario, params)
        cfg = self.cfg
        t0 = time.perf_counter()
        values: list[float] = []
        cons: list[list[float]] = [[] for _ in cfg.constraints]
        for k, window in enumerate(cfg.windows_s):
            for seed in cfg.seeds:
                s = run_scenario(self.scenario, window, seed, workload_cache=self._cache, **kw)
                values.append(metric_value(s, cfg.objective))
                for j, c in enumerate(cfg.constraints):
                    cons[j].append(metric_value(s, c.metric))
            running = _nanmean(values)
            if math.isfinite(running):
                trial.report(running, k)
            if cfg.pruner != "none" and trial.should_prune():
                trial.set_user_attr("objective_values", values)
                trial.set_user_attr("wall_s", time.perf_counter() - t0)
                raise optuna.TrialPruned()
        v = np.asarray(values, dtype=np.float64)
        mean = _nanmean(values)
        trial.set_user_attr("objective_values", values)
        trial.set_user_attr("objective_mean", mean)
        trial.set_user_attr("objective_std", float(np.nanstd(v)) if np.isfinite(v).any() else math.nan)
        trial.set_user_attr("objective_min", float(np.nanmin(v)) if np.isfinite(v).any() else math.nan)
        trial.set_user_attr("objective_max", float(np.nanmax(v)) if np.isfinite(v).any() else math.nan)
        violations = []
        for c, vals in zip(cfg.constraints, cons):
            cm = _nanmean(vals)
            trial.set_user_attr(f"constraint:{c}", cm)
            violations.append(c.violation(cm))
        # Optuna stores constraint values as finite floats; an undefined metric counts as violated
        finite = [x if math.isfinite(x) else 1e12 for x in violations]
        trial.set_user_attr("constraints", finite)
        if _HAS_SET_CONSTRAINT and cfg.sampler != "cmaes":  # Optuna >= 5 (TPE, GP read them)
            for c, x in zip(cfg.constraints, finite):
                trial.set_constraint(str(c), x)
        trial.set_user_attr("feasible", all(x <= 0 for x in violations))
        trial.set_user_attr("wall_s", time.perf_counter() - t0)
        if not math.isfinite(mean):
            raise ValueError(f"objective {cfg.objective} undefined in every run (no request of that class?)")
        if cfg.sampler == "cmaes" and cfg.constraints:
            rel = sum(max(0.0, x) / max(abs(c.bound), 1e-9) if math.isfinite(x) else 1e3
                      for c, x in zip(cfg.constraints, violations))
            return mean - cfg.penalty * rel if cfg.objective.maximise else mean + cfg.penalty * rel
        return mean


def _nanmean(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def _has_set_constraint() -> bool:
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


_HAS_SET_CONSTRAINT = _has_set_constraint()


def _constraints_func(trial) -> Sequence[float]:
    return trial.user_attrs.get("constraints", [1e12])


# ----------------------------------------------------------------------------- storage / study
def make_storage(url: str | None, notify: Callable[[str], None] | None = None):
    """``None`` -> in memory; ``journal:PATH`` / ``*.journal`` / ``*.log`` -> JournalStorage file;
    anything with ``://`` -> RDBStorage (heartbeat 10 s, grace 30 s, a killed trial retried once).

    A journal file is checked first (:func:`kvsched.experiments.journal.check_journal`): one whose
    last records were cut short (a full disk) is recovered up to its last complete record, the
    original kept as ``<journal>.torn-<n>.bak``, the trials the lost records left ``RUNNING``
    without a live worker are marked ``FAIL`` (:func:`kvsched.experiments.tune_gate.fail_dead_trials`),
    and ``notify`` (default: print to stderr) gets the one-line message saying what was dropped
    and failed. A journal damaged in the middle (complete records after a bad line) is refused,
    untouched.

    Raises:
        ConfigError: another form, a journal path naming a file that is not an Optuna journal, a
            journal damaged in the middle, or a torn journal that cannot be repaired (e.g. the disk
            is still full).
    """
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from .journal import check_journal

    if url is None:
        return optuna.storages.InMemoryStorage()
    path = journal_path(url)
    if path is not None:
        shown = bounded_repr(url)
        if not path:
            raise ConfigError(f"--storage={shown} is not allowed: the journal path is empty")
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--storage={shown}: cannot make the journal's folder ({e.strerror or e})") from None
        if Path(path).is_dir():
            raise ConfigError(f"--storage={shown} is not allowed: {bounded_repr(path)} is a folder; give a file name")
        message = check_journal(path)
        try:  # JournalStorage replays the file's log lines (JSON) when opened
            storage = JournalStorage(JournalFileBackend(str(path)))
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:  # records Optuna cannot apply
            why = str(e).splitlines()[0] if str(e) else repr(e)
            raise ConfigError(f"--storage={shown}: {bounded_repr(path)} is not an Optuna journal file "
                              f"({type(e).__name__}: {bounded_repr(why)}); give a journal that kvsched tune wrote, "
                              "or a new file name") from None
        if message is not None:  # a torn tail was cut off: its lost records may have ended trials
            from .outputs import os_reason
            from .tune_gate import fail_dead_trials

            try:
                n = fail_dead_trials(storage, path)
            except OSError as e:
                raise ConfigError(f"--storage={shown}: cannot mark the trials the torn records left running as "
                                  f"failed ({os_reason(e)}); free space and run again") from None
            if n:
                message += (f"; {n} trial(s) the lost records left running without a live worker were marked "
                            "FAIL (they do not count toward --trials)")
            (notify or _print_stderr)(message)
        return storage
    if "://" in url:
        return _rdb_storage(rdb_url(url))
    raise ConfigError(f"--storage={bounded_repr(url)}: give journal:PATH, a PATH ending in .journal or .log, "
                      "or an RDB URL (sqlite:///FILE, postgresql://USER@HOST:PORT/DB)")


RDB_SCHEMES = ("sqlite", "postgresql", "mysql")


def rdb_url(url: str) -> str:
    """Check an RDB URL's scheme and pick the PostgreSQL driver that is installed.

    SQLAlchemy >= 2.1 maps a bare ``postgresql://`` to psycopg 3, while the ``postgres`` extra
    installs psycopg2; when only psycopg2 is importable, ``postgresql://`` becomes
    ``postgresql+psycopg2://`` (an explicit ``+driver`` is kept).

    Raises:
        ConfigError: a scheme other than sqlite, postgresql or mysql (with an optional ``+driver``).
    """
    import importlib.util

    scheme, _, rest = url.partition("://")
    dialect = scheme.split("+", 1)[0]
    if dialect not in RDB_SCHEMES:
        raise ConfigError(f"--storage={bounded_repr(_redact(url))}: unknown database {bounded_repr(dialect)}; "
                          f"give journal:PATH, a PATH "
                          f"ending in .journal or .log, or an RDB URL ({', '.join(s + '://...' for s in RDB_SCHEMES)})")
    if scheme == "postgresql" and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql+psycopg2://{rest}"
    return url


def _rdb_storage(url: str, attempts: int = 5):
    """RDBStorage with heartbeats; retried because workers starting together on an empty
    database race to create its tables (the loser gets an IntegrityError and, on retry, finds
    them)."""
    import optuna.storages as st

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna_experimental_warning())
        if hasattr(st, "RetryHeartbeatStaleTrialCallback"):  # Optuna >= 4.9
            cb = {"heartbeat_stale_trial_callback": st.RetryHeartbeatStaleTrialCallback(max_retry=1)}
        else:
            cb = {"failed_trial_callback": st.RetryFailedTrialCallback(max_retry=1)}
        for k in range(attempts):
            try:
                return st.RDBStorage(url, heartbeat_interval=10, grace_period=30,
                                     engine_kwargs={"pool_pre_ping": True}, **cb)
            except Exception as e:  # driver missing, server down, table-creation race
                if k == attempts - 1 or "already exists" not in str(e):
                    raise ConfigError(f"--storage {_redact(url)}: cannot open ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0]})") from None
                time.sleep(0.2 * (k + 1))


def _print_stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def optuna_experimental_warning():
    import optuna

    return optuna.exceptions.ExperimentalWarning


def journal_path(url: str | None) -> str | None:
    if url is None:
        return None
    if url.startswith("journal:"):
        return url[len("journal:"):]
    if "://" not in url and url.endswith((".journal", ".log")):
        return url
    return None


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def sampler_seed(seed: int, worker: int = 0, history: int = 0) -> int:
    """The seed of the sampler of the worker in slot ``worker`` (:class:`.tune_gate.TrialGate`'s
    ``slot``) in a study that holds ``history`` trials (any
    state) when the worker opens it: ``numpy.random.SeedSequence((seed, worker, history))``'s
    first 32-bit word.

    A sampler seeded only by ``--seed`` would, on resume, draw the same random start-up points
    (TPE's and GP's first ten trials, CMA-ES's independent draws) as the first run, so finished
    parameter sets would be proposed and run again. Folding in the number of trials already in
    the study continues the sequence instead, and keeps a study a function of ``--seed`` and its
    history: the same command on the same stored study proposes the same trials. (CMA-ES also
    restores its search state from the stored trials, as Optuna does.)
    """
    return int(np.random.SeedSequence((int(seed), int(worker), int(history))).generate_state(1)[0])


def make_sampler(cfg: TuneConfig, worker: int = 0, baseline: Mapping[str, Any] | None = None, history: int = 0):
    """The sampler of ``cfg``, seeded :func:`sampler_seed` ``(cfg.sampler_seed, worker, history)``;
    constraints where supported."""
    import optuna

    seed = sampler_seed(cfg.sampler_seed, worker, history)
    # Optuna < 5 takes constraints through the sampler's constraints_func; >= 5 through
    # Trial.set_constraint (the objective sets them), the sampler argument being deprecated
    cf = _constraints_func if cfg.constraints and not _HAS_SET_CONSTRAINT else None
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constraints_func=cf)
    if cfg.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, constraints_func=cf)
    # CMA-ES: numeric dimensions only; categorical ones go to its independent (random) sampler
    x0 = None
    if baseline:
        x0 = {k: v for k, v in baseline.items() if cfg.space()[k].kind != "categorical"}
    return optuna.samplers.CmaEsSampler(seed=seed, x0=x0 or None, warn_independent_sampling=False,
                                        independent_sampler=optuna.samplers.RandomSampler(seed=seed))


def open_study(name: str, storage_url: str | None, cfg: TuneConfig | None = None, worker: int = 0,
               storage=None):
    """Load or create study ``name``. With ``cfg``, a new study stores it (and an existing one
    must match it: the objective of a resumed study cannot change).

    Raises:
        ConfigError: the stored configuration differs from ``cfg``, or no such study to load.
    """
    import optuna

    storage = storage if storage is not None else make_storage(storage_url)
    if cfg is None:
        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
            raise ConfigError(f"--study {bounded_repr(name)}: no such study in the storage; "
                              f"studies there: {names}") from None
    study = optuna.create_study(study_name=name, storage=storage, direction=cfg.direction,
                                sampler=optuna.samplers.RandomSampler(seed=0), load_if_exists=True,
                                pruner=_make_pruner(cfg))
    # seeded from the study's history: a resumed study continues instead of replaying
    study.sampler = make_sampler(cfg, worker, history=len(study.get_trials(deepcopy=False)))
    stored = study.user_attrs.get("tune_config")
    if stored is None:
        study.set_user_attr("tune_config", cfg.to_dict())
    else:
        mine = {k: v for k, v in cfg.to_dict().items() if k not in ("sampler", "sampler_seed", "penalty", "pruner")}
        theirs = {k: v for k, v in stored.items() if k not in ("sampler", "sampler_seed", "penalty", "pruner")}
        theirs.setdefault("tune_residency", False)  # studies from before --tune-residency existed
        theirs.setdefault("router", None)  # ... and before --router
        if json.loads(json.dumps(mine)) != theirs:
            diff = sorted(k for k in mine if mine.get(k) != theirs.get(k))
            raise ConfigError(f"study {bounded_repr(name)} exists with another objective "
                              f"({', '.join(diff)} differ: stored "
                              f"{ {k: theirs.get(k) for k in diff} }); use another --study name")
    return study


def _make_pruner(cfg: TuneConfig):
    import optuna

    if cfg.pruner == "none":
        return optuna.pruners.NopPruner()
    # Optuna's defaults except warm-up: the first window already informs (kvsched choice)
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0)


#: A worker stops after this many failed trials in a row (an objective undefined in every run).
MAX_FAILED_IN_A_ROW = 5


def _worker(study_name: str, storage_url: str | None, cfg_dict: dict, scenario: Scenario, n_trials: int,
            worker: int, storage=None) -> None:
    """Run trials until the study holds ``n_trials`` COMPLETE trials (:mod:`.tune_gate`).

    Raises:
        ConfigError: :data:`MAX_FAILED_IN_A_ROW` trials in a row failed (the last one's reason),
            or the storage cannot be written (a full disk: finished trials are kept; run the
            same command again once there is space).
    """
    import optuna

    from .tune_gate import TrialGate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    cfg = TuneConfig.from_dict(cfg_dict)
    objective = Objective(cfg, scenario)
    failed: list[str] = []

    def run(trial) -> float:
        try:
            value = objective(trial)
        except ValueError as e:
            failed.append(str(e))
            raise
        failed.clear()
        return value

    jp = journal_path(storage_url)
    try:
        study = open_study(study_name, storage_url, cfg, worker, storage=storage)
        rdb = storage_url is not None and jp is None
        with TrialGate(study, n_trials, journal=jp, rdb=rdb, storage=storage, worker=worker) as gate:
            # seeded by the slot no concurrent worker holds (not the worker index: several
            # commands on one journal are all worker 0) and the trials in the study now
            study.sampler = make_sampler(cfg, gate.slot, history=len(study.get_trials(deepcopy=False)))
            while gate.next():
                try:
                    study.optimize(gate.wrap(run), n_trials=1, catch=(ValueError,))
                finally:
                    gate.release()
                if len(failed) >= MAX_FAILED_IN_A_ROW:
                    raise ConfigError(f"{cfg.tuned}: {len(failed)} trials in a row failed; the last: "
                                      f"{bounded_repr(failed[-1])}")
    except (OSError, AssertionError) as e:  # the journal or its lock files (e.g. no space left on device)
        err = _storage_not_written(e, jp or _redact(storage_url or "memory"))
        if err is None:
            raise
        raise err from None


#: ``errno`` values of a write the system refused for lack of room or a failing or read-only device.
_WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EIO", "EFBIG", "EROFS")
                          if hasattr(errno, n))


def _write_failure(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: ``e`` itself, or one in its ``__cause__`` / ``__context__``
    chain with a write-failure errno (:data:`_WRITE_ERRNOS`). Optuna's ``_run_trial`` turns a
    storage write that fails while it records a trial's result into ``AssertionError: Should not
    reach.`` raised in its ``finally`` block, the ``OSError`` being its ``__context__``."""
    if isinstance(e, OSError):
        return e
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _WRITE_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _storage_not_written(e: BaseException, where: str) -> ConfigError | None:
    """The one-line :class:`ConfigError` for a study storage that could not be written (``e`` or
    its chain holds the ``OSError``, :func:`_write_failure`); ``None`` when it holds none (a
    genuine bug: its traceback is wanted)."""
    from .outputs import os_reason

    cause = _write_failure(e)
    if cause is None:
        return None
    return ConfigError(f"--storage {bounded_repr(where)}: the study's storage could not be written "
                       f"({os_reason(cause)}); finished trials are kept; free space and run the same command again "
                       "(a record cut short is recovered then)")


@dataclass
class TuneResult:
    """What :func:`tune` produced: the study and the report (see :func:`report`)."""

    study: Any
    report: dict = field(default_factory=dict)
    wall_s: float = 0.0


def tune(scenario: Scenario, cfg: TuneConfig, study_name: str, storage_url: str | None = None,
         n_trials: int = 20, workers: int = 1, holdout_seeds: int = 0, scenario_path: str | None = None,
         out: Path | None = None) -> TuneResult:
    """Run (or resume) the study until it holds ``n_trials`` COMPLETE trials; see module doc.

    Raises:
        ConfigError: bad arguments, a storage that cannot open, a study with another objective,
            a storage that cannot be written (e.g. a full disk; finished trials are kept).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"--trials={bounded_repr(n_trials)} must be an integer >= 1")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers={bounded_repr(workers)} must be an integer >= 1")
    if isinstance(holdout_seeds, bool) or not isinstance(holdout_seeds, int) or holdout_seeds < 0:
        raise ConfigError(f"--holdout-seeds={bounded_repr(holdout_seeds)} must be an integer >= 0")
    if workers > 1 and storage_url is None:
        if out is None:
            raise ConfigError("--workers > 1 needs --storage (a journal file or an RDB URL) or --out")
        from .outputs import inside

        storage_url = f"journal:{inside(Path(out), study_name, 'study name', '.journal')}"
    check_scenario(cfg, scenario)
    t0 = time.perf_counter()
    storage = make_storage(storage_url)
    try:
        return _tune(scenario, cfg, study_name, storage_url, storage, n_trials, workers, holdout_seeds,
                     scenario_path, t0)
    except (OSError, AssertionError) as e:  # the study's storage cannot be written (e.g. no space left on device)
        err = _storage_not_written(e, journal_path(storage_url) or _redact(storage_url or "memory"))
        if err is None:
            raise
        raise err from None


def _tune(scenario: Scenario, cfg: TuneConfig, study_name: str, storage_url: str | None, storage, n_trials: int,
          workers: int, holdout_seeds: int, scenario_path: str | None, t0: float) -> TuneResult:
    import optuna

    base = baseline_params(cfg, scenario)
    outside = [k for k, v in base.items() if not cfg.space()[k].contains(v)]
    if outside:  # Optuna would reject the enqueued values; say so instead of silently clipping
        raise ConfigError(f"{cfg.tuned}: published defaults {[(k, base[k]) for k in outside]} lie "
                          "outside the declared search space; widen SEARCH_SPACE")
    try:  # exactly one of several workers starting together creates the study (unique name) ...
        created = optuna.create_study(study_name=study_name, storage=storage, direction=cfg.direction)
    except optuna.exceptions.DuplicatedStudyError:
        created = None
    else:  # ... and enqueues the baseline at once, before any worker can ask for a trial
        created.enqueue_trial(base, user_attrs={"baseline": True})
    study = open_study(study_name, storage_url, cfg, storage=storage)
    _store_provenance(study, scenario, cfg, scenario_path)
    # a joining worker enqueues it only if it is missing (the creator died in between)
    if created is None and not any(t.user_attrs.get("baseline") for t in study.get_trials(deepcopy=False)):
        study.enqueue_trial(base, user_attrs={"baseline": True}, skip_if_exists=True)
    if workers == 1:
        _worker(study_name, storage_url, cfg.to_dict(), scenario, n_trials, 0, storage=storage)
    else:
        ctx = mp.get_context("spawn")  # no inherited locks or open database connections
        procs = [ctx.Process(target=_worker, args=(study_name, storage_url, cfg.to_dict(), scenario, n_trials, k))
                 for k in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise ConfigError(f"{len(bad)} of {workers} tuning workers failed (exit codes {bad})")
        study = open_study(study_name, storage_url, storage=make_storage(storage_url))
    wall = time.perf_counter() - t0
    rep = report(study, cfg)
    rep["wall_s_this_run"] = wall
    if holdout_seeds:
        rep["holdout"] = holdout(scenario, cfg, rep, holdout_seeds)
    return TuneResult(study=study, report=rep, wall_s=wall)


def _store_provenance(study, scenario: Scenario, cfg: TuneConfig, scenario_path: str | None) -> None:
    if "scenario" in study.user_attrs:
        return
    hashes = {}
    for seed in cfg.seeds:
        for w in cfg.windows_s:
            hashes[f"{w[0]:g}-{w[1]:g}@{seed}"] = scenario_for(scenario, w, seed).workload().content_sha256()
    study.set_user_attr("scenario", scenario.to_dict() | {"instance": dict(scenario.instance)})
    from kvsched.envs.sim.specs import instance_spec_to_dict

    study.set_user_attr("scenario_resolved_instance", instance_spec_to_dict(scenario.instance_spec()))
    study.set_user_attr("scenario_sha256", scenario.sha256())
    study.set_user_attr("scenario_path", scenario_path)
    study.set_user_attr("workload_sha256", hashes)
    study.set_user_attr("kvsched_version", kvsched.__version__)
    study.set_user_attr("optuna_version", __import__("optuna").__version__)


def scenario_of_study(study) -> Scenario:
    """The scenario a study was tuned on (from its stored plain-data form)."""
    d = dict(study.user_attrs["scenario"])
    d["window_s"] = tuple(d["window_s"]) if d.get("window_s") else None
    return Scenario(**d, source=f"study {study.study_name}")


def finished_trials(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if math.isfinite(t.user_attrs.get("objective_mean", math.nan))]


def best_trial(study, cfg: TuneConfig):
    """Best feasible complete trial by raw mean objective (ties: earliest); ``None`` if none feasible."""
    trials = [t for t in finished_trials(study) if t.user_attrs.get("feasible", True)]
    if not trials:
        return None
    sign = -1.0 if cfg.objective.maximise else 1.0
    return min(trials, key=lambda t: (sign * t.user_attrs["objective_mean"], t.number))


def report(study, cfg: TuneConfig) -> dict:
    """Baseline vs best (raw mean objective, spread, constraints), trial counts."""
    from optuna.trial import TrialState

    states = {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,))) for s in TrialState}

    def row(t) -> dict | None:
        if t is None:
            return None
        ua = t.user_attrs
        return {"trial": t.number, "params": dict(t.params), "objective_mean": ua.get("objective_mean"),
                "objective_std": ua.get("objective_std"), "objective_min": ua.get("objective_min"),
                "objective_max": ua.get("objective_max"), "feasible": ua.get("feasible"),
                "constraints": {str(c): ua.get(f"constraint:{c}") for c in cfg.constraints},
                "wall_s": ua.get("wall_s")}

    base = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.user_attrs.get("baseline")), None)
    best = best_trial(study, cfg)
    rep = {"study": study.study_name, "tuned": cfg.tuned, "objective": str(cfg.objective), "direction": cfg.direction,
           "constraints": [str(c) for c in cfg.constraints], "trials": states,
           "baseline": row(base), "best": row(best)}
    if base is not None and best is not None:
        b, t = base.user_attrs["objective_mean"], best.user_attrs["objective_mean"]
        rep["improvement"] = (t - b) if cfg.objective.maximise else (b - t)
        rep["improvement_rel"] = rep["improvement"] / abs(b) if b else math.nan
        rep["best_is_baseline"] = best.number == base.number
        # paired over the same windows and seeds: improvement per run, its standard error
        bv = np.asarray(base.user_attrs["objective_values"], dtype=np.float64)
        tv = np.asarray(best.user_attrs["objective_values"], dtype=np.float64)
        d = (tv - bv) if cfg.objective.maximise else (bv - tv)
        d = d[np.isfinite(d)]
        sem = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size >= 2 else math.nan
        rep["paired_improvement_sem"] = sem
        rep["verdict"] = _verdict(rep["improvement"], rep["improvement_rel"], sem, rep["best_is_baseline"])
    total_trial_wall = sum(t.user_attrs.get("wall_s", 0.0) for t in study.get_trials(deepcopy=False))
    rep["trial_wall_s_total"] = total_trial_wall
    return rep


def _verdict(improvement: float, rel: float, sem: float, is_baseline: bool) -> str:
    """Plain words: no gain, a gain below 1 % (negligible), within 2 paired standard errors, or a gain."""
    if is_baseline or improvement <= 0:
        return "no trial beat the baseline"
    tail = f"{improvement:+.4g} ({100 * rel:+.2f} %)"
    if abs(rel) < 0.01:
        return f"negligible: {tail}, below 1 %"
    if math.isfinite(sem) and improvement < 2 * sem:
        return f"within noise: {tail}, < 2 paired standard errors ({sem:.3g})"
    return f"improvement {tail}, in-sample (paired s.e. {sem:.3g})"


def holdout(scenario: Scenario, cfg: TuneConfig, rep: dict, n_seeds: int) -> dict:
    """Baseline and best re-evaluated on ``n_seeds`` seeds after the study's (same windows)."""
    if rep.get("best") is None or rep.get("baseline") is None:
        return {}
    seeds = [max(cfg.seeds) + 1 + k for k in range(n_seeds)]
    out = {"seeds": seeds}
    for key in ("baseline", "best"):
        kw = run_args(cfg, scenario, rep[key]["params"])
        vals = [metric_value(run_scenario(scenario, w, s, **kw), cfg.objective) for w in cfg.windows_s for s in seeds]
        out[key] = {"objective_mean": _nanmean(vals), "objective_std": float(np.nanstd(vals)), "values": vals}
    return out



def _save_plot(ax, path: Path) -> Path:
    """Save ``ax``'s figure (8 x 5 in, 110 dpi) to ``path``, close it, return ``path``."""
    import matplotlib.pyplot as plt

    ax.figure.set_size_inches(8, 5)
    ax.figure.tight_layout()
    with atomic_files.replacing(path) as tmp:
        ax.figure.savefig(tmp, dpi=110)
    plt.close(ax.figure)
    return path

def write_results(study, rep: dict, out: Path) -> list[Path]:
    """``tune.json``, ``trials.csv``, ``history.png`` and ``importances.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import optuna
    from optuna.visualization import matplotlib as ovm

    out.mkdir(parents=True, exist_ok=True)
    files = []
    p = out / "tune.json"
    atomic_files.write_text(p, json.dumps(rep, indent=2, sort_keys=True, default=float) + "\n")
    files.append(p)
    p = out / "trials.csv"
    from .tune_gate import OWNER_ATTR

    df = study.trials_dataframe()
    df = df.drop(columns=[c for c in df.columns if c == f"user_attrs_{OWNER_ATTR}"])  # a random token per worker
    with atomic_files.replacing(p) as tmp:
        df.to_csv(tmp, index=False)
    files.append(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", UserWarning)  # PED-ANOVA direction notice (handled above)
        ax = ovm.plot_optimization_history(study, target=lambda t: t.user_attrs.get("objective_mean", math.nan),
                                           target_name=rep["objective"])
        # Optuna draws no best-so-far line for a custom target: the running best feasible mean
        sign = 1.0 if rep["direction"] == "maximize" else -1.0
        xs, best, cur = [], [], None
        for t in sorted(finished_trials(study), key=lambda t: t.number):
            v = t.user_attrs["objective_mean"]
            if t.user_attrs.get("feasible", True) and (cur is None or sign * v > sign * cur):
                cur = v
            if cur is not None:
                xs.append(t.number)
                best.append(cur)
        if xs:
            ax.step(xs, best, where="post", color="tab:red", label="best feasible")
            ax.legend(loc="best")
        files.append(_save_plot(ax, out / "history.png"))
        if len(finished_trials(study)) >= 2:
            try:
                # PED-ANOVA (Optuna's default, no scikit-learn) ranks importance for reaching *low*
                # target values, so a maximised objective is negated
                sign = -1.0 if rep["direction"] == "maximize" else 1.0
                ax = ovm.plot_param_importances(
                    study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
                    target=lambda t: sign * t.user_attrs.get("objective_mean", math.nan),
                    target_name=("-" if sign < 0 else "") + rep["objective"])
            except (RuntimeError, ValueError) as e:  # e.g. every trial had the same value
                rep.setdefault("notes", []).append(f"no importance plot: {e}")
            else:
                files.append(_save_plot(ax, out / "importances.png"))
    return files
