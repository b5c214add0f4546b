"""Compare scheduler policies -- or cluster routers -- on one scenario: the same workload and seeds for each.

With ``routers`` (``kvsched compare --routers rr,cache-affinity``) the compared names are
routers (:mod:`kvsched.policies.routing`), each run with the scenario's policy; the label column
is then ``router`` instead of ``policy``. Cluster metrics are reported on the ``all`` row:
``load_imbalance`` (max over mean of the requests routed per instance), ``load_share_max`` (the
busiest instance's share of requests) and the shared KV tier's ``shared_kv_bytes_fetched`` /
``shared_kv_hit_tokens``; ``prefix_hit_rate`` (prefix-cache hit tokens / prompt tokens of
finished requests, reuse across requests only) is given per class.

:func:`run_compare` serves the scenario's workload once per (policy, seed) and gathers, per
length class ("all", "short", "long"; :mod:`kvsched.envs.sim.metrics`), TTFT / TPOT / E2E
p50 and p99, SLO attainment, goodput, preemptions, bytes moved per link and the longest
queueing delay (``starvation.max_queueing_delay_s``; on the ``long`` row, the maximum wait of
a long request). :func:`aggregate` averages over seeds with the spread (std, min, max);
:func:`write_outputs` writes the tables as CSV and three plots (matplotlib, Agg backend):

* ``ttft_cdf.png`` -- empirical CDF of TTFT per length class, one line per policy, built from
  the per-request records (finished requests, all seeds pooled);
* ``kv_occupancy.png`` -- KV blocks in use / capacity per tier over time, summed over
  instances (:attr:`SimulationResult.occupancy`, first seed), one line per policy;
* ``slo_attainment.png`` -- SLO attainment per class and policy (mean over seeds, error bar
  = min..max).

Seeds. ``seeds`` runs use scenario seeds ``scenario.seed, scenario.seed + 1, ...``. The seed
regenerates *synthetic* workloads; a trace scenario serves the same requests for every seed,
so there seeds only change seeded policy internals (EWSJF's Optuna sampler). A policy whose
parameters have a ``seed`` field gets the run's seed unless ``policy_params`` sets it.

Determinism: the simulator is deterministic (no wall clock, no global RNG), so the same
scenario, policies, parameters and seeds give byte-identical CSV tables.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.metrics import BYTE_COLUMNS, LENGTH_CLASSES

from kvsched.envs.sim.disagg import parse_layout_label
from kvsched.runner.scenario import Scenario
from kvsched import atomic_files
from kvsched.experiments.cli_types import MAX_REPEATS, MAX_SEED

#: Class rows of the table, in order ("all" first, then the length classes present).
CLASS_ORDER: tuple[str, ...] = ("all",) + tuple(LENGTH_CLASSES)
#: Link byte columns (bytes; from the summary's ``bytes_moved``).
LINK_COLUMNS: tuple[str, ...] = tuple(c for c in BYTE_COLUMNS)
#: Metric columns of one (policy, seed, class) row. Times in seconds, bytes in bytes.
METRIC_COLUMNS: tuple[str, ...] = (
    "n", "finished", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s",
    "slo_attainment", "goodput_rps", "preemptions",
) + LINK_COLUMNS + ("max_wait_s", "prefix_hit_rate", "load_imbalance", "load_share_max", "shared_kv_bytes_fetched",
                    "shared_kv_hit_tokens", "gpus", "kv_transfer_bytes", "kv_link_utilisation", "remote_prefill_share")
#: Label columns of a runs or aggregated frame, by what was compared.
LABEL_COLUMNS: tuple[str, ...] = ("router", "cluster", "policy")


def label_column(frame: pd.DataFrame) -> str:
    """The label column of ``frame``: ``router``, ``cluster`` or ``policy``."""
    return next(c for c in LABEL_COLUMNS if c in frame.columns or c == "policy")


@dataclass
class CompareResult:
    """What :func:`run_compare` produced.

    Attributes:
        runs: one row per (policy, seed, class): ``policy``, ``seed``, ``class`` and
            :data:`METRIC_COLUMNS` (NaN where a metric is undefined, e.g. no finished request).
        records: ``(name, seed, window) -> per-request records`` (``RECORD_COLUMNS``); ``name`` is
            the policy, or the router when ``axis == "router"``.
        occupancy: ``(name, seed, window) -> KV occupancy samples``.
        policies, seeds: what was run, in order (``policies`` holds the router names when
            ``axis == "router"``).
        windows: how many windows the workload was cut into.
        params: ``policy -> parameters given`` (before the per-seed ``seed`` injection).
        axis: ``"policy"``, ``"router"`` or ``"cluster"`` (layouts such as ``2P2D``): what the
            compared names are, and the label column.
    """

    runs: pd.DataFrame
    records: dict[tuple[str, int], pd.DataFrame] = field(default_factory=dict)
    occupancy: dict[tuple[str, int], pd.DataFrame] = field(default_factory=dict)
    policies: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    params: dict[str, dict] = field(default_factory=dict)
    windows: int = 1
    axis: str = "policy"


def _parse_names(text: str | Sequence[str], flag: str, what: str, make: Callable[[str], Any]) -> list[str]:
    """Names from comma-separated ``text`` (or a list): non-empty (an empty item is refused), each
    known to ``make`` (which
    raises UnknownPresetError listing the known names) and each once, counting a name in another
    case or an alias as the registered name it refers to (``make(name).name``). The names are
    returned as given (they label the rows)."""
    from .cli_types import comma_list

    names = comma_list(text, flag) if isinstance(text, str) else [str(s).strip() for s in text]
    if not all(names):
        raise ConfigError(f"{flag}={bounded_repr(text)}: an empty {what} name; give each name")
    if not names:
        raise ConfigError(f"{flag}={bounded_repr(text)}: give at least one {what} name, comma-separated")
    registered = [make(n).name for n in names]
    dup = sorted({n for n in registered if registered.count(n) > 1})
    if dup:
        raise ConfigError(f"{flag}={bounded_repr(text)}: {dup} given twice")
    return names


def parse_policies(text: str | Sequence[str]) -> list[str]:
    """Policy names from ``"fcfs,ewsjf"`` (or a list), checked against the registry.

    Raises:
        UnknownPresetError: an unknown name (the message lists the known ones).
        ConfigError: an empty list or a name given twice.
    """
    from kvsched.policies.base import make_policy

    return _parse_names(text, "--policies", "policy", make_policy)


def _parse_named_params(text: str | None, flag: str, kind: str, kinds: str, compared: Sequence[str],
                        make: Callable, example: str) -> dict[str, dict]:
    """``{name: {param: value}}`` from the JSON ``text`` of ``flag``, each validated by ``make``."""
    if text is None:
        return {}
    from kvsched.envs.sim.strict_json import parse_object

    data = parse_object(text, flag, f"{kind} name -> {{parameter: value}}, e.g. {example}")
    if not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"{flag}={bounded_repr(text)}: must map {kind} name -> {{parameter: value}}")
    # a key in another case or an alias ("LARS", "rr") is the compared name it refers to
    label = {_registered(make, c): c for c in compared}
    data = {label.get(_registered(make, k), k): v for k, v in data.items()}
    unknown = sorted(set(data) - set(compared))
    if unknown:
        raise ConfigError(f"{flag} names {kinds} {unknown} that are not compared; "
                          f"compared: {list(compared)}")
    for name, params in data.items():
        make(name, dict(params))  # validates names and values
    return {k: dict(v) for k, v in data.items()}


def _registered(make: Callable, name: str) -> str:
    """The registered name ``name`` refers to (``make(name).name``), or ``name`` when none."""
    from kvsched.envs.sim.errors import UnknownPresetError

    try:
        return make(name).name
    except UnknownPresetError:
        return name


def parse_policy_params(text: str | None, policies: Sequence[str]) -> dict[str, dict]:
    """``{"policy": {param: value}}`` from JSON text (``None`` -> no parameters).

    Raises:
        ConfigError: invalid JSON, not a mapping of mappings, a policy not in ``policies``, or
            a parameter the policy does not have / an invalid value (naming it).
    """
    from kvsched.policies.base import make_policy

    return _parse_named_params(text, "--policy-params", "policy", "policies", policies, make_policy,
                               '\'{"ewsjf": {"meta_window_s": 10}}\'')


def _params_for(name: str, given: Mapping[str, Any], seed: int) -> dict:
    """``given`` plus ``seed`` = the run's seed when the policy has a seed parameter not given."""
    from kvsched.policies.base import make_policy

    pcls = type(make_policy(name)).params_cls
    out = dict(given)
    if "seed" in {f.name for f in fields(pcls)} and "seed" not in out:
        out["seed"] = int(seed)
    return out


def _metric_row(c: Mapping[str, Any]) -> dict[str, float]:
    def g(*path):
        v: Any = c
        for p in path:
            if not isinstance(v, Mapping) or p not in v:
                return math.nan
            v = v[p]
        return math.nan if v is None else float(v)

    row = {
        "n": g("counts", "arrived"), "finished": g("counts", "finished"),
        "ttft_p50_s": g("ttft_s", "p50"), "ttft_p99_s": g("ttft_s", "p99"),
        "tpot_p50_s": g("tpot_s", "p50"), "tpot_p99_s": g("tpot_s", "p99"),
        "e2e_p50_s": g("e2e_s", "p50"), "e2e_p99_s": g("e2e_s", "p99"),
        "slo_attainment": g("slo", "attainment"), "goodput_rps": g("goodput_rps"),
        "preemptions": g("preemptions", "total"),
    }
    for col in LINK_COLUMNS:
        row[col] = g("bytes_moved", col[len("bytes_"):])
    row["max_wait_s"] = g("starvation", "max_queueing_delay_s")
    row["prefix_hit_rate"] = g("prefix", "hit_rate")
    for key in (c.get("bytes_moved") or {}):  # the links of extra KV tiers (tiers as data)
        if key != "total" and f"bytes_{key}" not in row:
            row[f"bytes_{key}"] = g("bytes_moved", key)
    return row


def extra_link_columns(frame: pd.DataFrame) -> list[str]:
    """The ``bytes_<from>_to_<to>`` columns of ``frame`` beyond :data:`LINK_COLUMNS` (the links of
    extra KV tiers, ``InstanceSpec.extra_tiers``), in frame order; they follow
    :data:`METRIC_COLUMNS` in a runs frame."""
    return [str(c) for c in frame.columns if str(c).startswith("bytes_") and c not in METRIC_COLUMNS
            and not str(c).endswith(("_std", "_min", "_max"))]


def _cluster_row(summary: Mapping[str, Any]) -> dict[str, float]:
    """Cluster-level metrics of a run (the ``all`` row): load imbalance and share, shared-tier use."""
    r = summary.get("routing") or {}
    k = summary.get("shared_kv") or {}
    share = r.get("load_share") or [1.0]
    imb = r.get("load_imbalance")
    return {"load_imbalance": 1.0 if not r else (math.nan if imb is None else float(imb)),
            "load_share_max": float(max(share)),
            "shared_kv_bytes_fetched": float(k["bytes_fetched"]) if k else math.nan,
            "shared_kv_hit_tokens": float(k["hit_tokens"]) if k else math.nan,
            **_disagg_row(summary)}


def _disagg_row(summary: Mapping[str, Any]) -> dict[str, float]:
    """Prefill/decode disaggregation metrics of a run (NaN without roles): bytes moved over the
    KV-transfer link, the busiest port's utilisation (busy seconds / makespan) and the share of
    requests prefilled remotely."""
    d = summary.get("disaggregation")
    if not d:
        return {"kv_transfer_bytes": math.nan, "kv_link_utilisation": math.nan, "remote_prefill_share": math.nan}
    n = d["remote_prefills"] + d["local_prefills"]
    return {"kv_transfer_bytes": float(d["bytes_moved"]), "kv_link_utilisation": float(d["link_utilisation_max"]),
            "remote_prefill_share": d["remote_prefills"] / n if n else math.nan}


def parse_clusters(text: str | Sequence[str]) -> list[str]:
    """Cluster layout labels from ``"2P2D,4M,1P3D"`` (or a list), each checked.

    Raises:
        ConfigError: an empty list, an empty or malformed label, or a layout given twice.
    """
    from kvsched.envs.sim.disagg import parse_layout_label

    from .cli_types import comma_list

    names = comma_list(text, "--clusters") if isinstance(text, str) else [str(s).strip() for s in text]
    if not names or not all(names):
        raise ConfigError(f"--clusters={bounded_repr(text)}: give layouts such as 2P2D,4M,1P3D (no empty item)")
    seen: dict[tuple, str] = {}
    for n in names:
        key = tuple(sorted(parse_layout_label(n).items()))
        if key in seen:
            raise ConfigError(f"--clusters={bounded_repr(text)}: {n} and {seen[key]} are the same layout")
        seen[key] = n
    return names


def parse_routers(text: str | Sequence[str]) -> list[str]:
    """Router names from ``"rr,cache-affinity"`` (or a list), checked against the registry.

    Raises:
        UnknownPresetError: an unknown name (the message lists the known ones).
        ConfigError: an empty list or a name given twice.
    """
    from kvsched.policies.routing import make_router

    return _parse_names(text, "--routers", "router", make_router)


def parse_router_params(text: str | None, routers: Sequence[str]) -> dict[str, dict]:
    """``{"router": {param: value}}`` from JSON text (``None`` -> no parameters).

    Raises:
        ConfigError: invalid JSON, not a mapping of mappings, a router not compared, or an
            unknown parameter / invalid value.
    """
    from kvsched.policies.routing import make_router

    return _parse_named_params(text, "--router-params", "router", "routers", routers, make_router,
                               '\'{"cache-affinity": {"cache_threshold": 0.5}}\'')


def run_compare(scenario: Scenario, policies: Sequence[str] | None = None, seeds: int = 1,
                policy_params: Mapping[str, Mapping[str, Any]] | None = None,
                fast_forward: bool = True,
                progress: Callable[[int, int], None] | None = None,
                windows: int = 1, backend: str = "local", address: str | None = None,
                routers: Sequence[str] | None = None,
                router_params: Mapping[str, Mapping[str, Any]] | None = None,
                timeline_dir: str | Path | None = None,
                timeline_window_s: tuple[float, float] | None = None,
                clusters: Sequence[str] | None = None) -> CompareResult:
    """Serve ``scenario`` with every policy (or every router, or every cluster layout), seed and window.

    Args:
        scenario: the scenario (workload, instance, metrics, base seed, router options).
        policies: registered policy names (``scenario.policy`` is then ignored). With
            ``routers``, leave it ``None``: the scenario's policy serves every run.
        seeds: number of seeds (>= 1): ``scenario.seed + k`` for ``k < seeds``.
        policy_params: ``policy -> {parameter: value}``.
        fast_forward: the simulator's fast-forward option (results are identical either way).
        progress: optional ``progress(finished_runs, total_runs)``.
        windows: cut the workload into this many consecutive windows of equal simulated time,
            each served separately (:func:`kvsched.runner.sweep.cell_workload`); >= 1.
        backend: ``"local"`` or ``"ray"`` (one Ray task per run; identical results).
        address: Ray cluster address (``backend="ray"`` only; ``None`` = a local Ray).
        routers: compare these routers (``scenario.router`` is then ignored).
        router_params: ``router -> {parameter: value}``.
        timeline_dir: write each run's schedule (:mod:`kvsched.runner.timeline`) into this folder
            as ``timeline-<policy or router>-seed<seed>[-window<k>].json.gz``; ``None``: none.
        timeline_window_s: the timelines' ``(start_s, end_s)`` window (``None``: all of each run).
        clusters: compare these cluster layouts, ``xPyD`` labels such as ``2P2D``, ``1P3D``, ``4M``
            (:func:`kvsched.envs.sim.disagg.parse_layout_label`), each with the scenario's policy
            and its ``cluster:`` section's role specs and link (docs/disaggregation.md).

    Returns:
        A :class:`CompareResult`; ``runs`` has a row per (policy, seed, window, class).

    Raises:
        UnknownPresetError: an unknown policy (before anything runs).
        ConfigError: ``seeds`` or ``windows`` < 1, invalid policy parameters, an invalid
            scenario, an unknown backend, or Ray missing for ``backend="ray"``.
    """
    from kvsched.policies.base import make_policy
    from kvsched.policies.routing import make_router

    from kvsched.runner.sweep import Cell, run_cells

    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_REPEATS:
        raise ConfigError(f"seeds={bounded_repr(seeds)} must be an integer in [1, {MAX_REPEATS}] (as --seeds)")
    if scenario.seed + seeds - 1 > MAX_SEED:
        raise ConfigError(f"seeds={seeds} from the scenario's seed {scenario.seed} would run seeds up to "
                          f"{scenario.seed + seeds - 1}, above {MAX_SEED} (2**31-1); give fewer --seeds or a "
                          "smaller --seed")
    if isinstance(windows, bool) or not isinstance(windows, int) or not 1 <= windows <= MAX_REPEATS:
        raise ConfigError(f"windows={bounded_repr(windows)} must be an integer in [1, {MAX_REPEATS}] (as --windows)")
    axis = "policy"
    rgiven: dict[str, dict] = {}
    names: list[str] = []
    layouts: dict[str, Scenario] = {}
    if clusters is not None:
        if policies is not None or routers is not None:
            raise ConfigError("compare cluster layouts under the scenario's policy and router: give only `clusters`")
        if router_params:
            raise ConfigError("router_params only apply when comparing routers")
        axis = "cluster"
        names = parse_clusters(clusters)
        layouts = {lab: scenario.with_layout(parse_layout_label(lab)) for lab in names}
        policies = [scenario.policy]
    elif routers is not None:
        if policies is not None:
            raise ConfigError("compare either policies or routers: give one of `policies` and `routers`")
        if scenario.n_instances < 2:
            raise ConfigError(f"routers: comparing routers needs n_instances >= 2 (a router picks among "
                              f"instances); the scenario has n_instances={scenario.n_instances} "
                              "(give --instances N)")
        axis = "router"
        names = parse_routers(list(routers))
        rgiven = {k: dict(v) for k, v in (router_params or {}).items()}
        unknown = sorted(set(rgiven) - set(names))
        if unknown:
            raise ConfigError(f"router_params names routers {unknown} that are not compared; compared: {names}")
        for name in names:
            make_router(name, rgiven.get(name, {}))
        policies = [scenario.policy]
    elif policies is None:
        raise ConfigError("give the policies (or the routers) to compare")
    elif router_params:
        raise ConfigError("router_params only apply when comparing routers")
    policies = parse_policies(list(policies))
    given = {k: dict(v) for k, v in (policy_params or {}).items()}
    unknown = sorted(set(given) - set(policies))
    if unknown:
        raise ConfigError(f"policy_params names policies {unknown} that are not compared; compared: {policies}")
    for name in policies:  # validate every parameter set before the first run
        make_policy(name, _params_for(name, given.get(name, {}), scenario.seed))
    seed_list = [scenario.seed + k for k in range(seeds)]
    labels = names if axis in ("router", "cluster") else policies
    cells, cell_labels = [], []
    for seed in seed_list:
        sc = scenario.with_overrides(seed=seed)
        for k in range(windows):
            for label in labels:
                csc, name = sc, label
                if axis == "router":
                    csc, name = sc.with_overrides(router=label, router_params=rgiven.get(label, {})), sc.policy
                elif axis == "cluster":
                    csc, name = layouts[label].with_overrides(seed=seed), sc.policy
                tl = None if timeline_dir is None else str(Path(timeline_dir) / timeline_file_name(label, seed, k,
                                                                                                   windows))
                cells.append(Cell(csc, name, _params_for(name, given.get(name, {}), seed), window=k,
                                  windows=windows, fast_forward=fast_forward, timeline=tl,
                                  timeline_window_s=timeline_window_s))
                cell_labels.append(label)
    outs = run_cells(cells, backend=backend, address=address, progress=progress)
    rows: list[dict] = []
    result = CompareResult(runs=pd.DataFrame(), policies=list(labels), seeds=seed_list,
                           params=rgiven if axis == "router" else given, windows=windows, axis=axis)
    for cell, label, res in zip(cells, cell_labels, outs):
        key = (label, cell.seed, cell.window)
        result.records[key] = res.records
        result.occupancy[key] = res.occupancy
        cluster_row = _cluster_row(res.summary)
        cluster_row["gpus"] = float(sum(s.tp for s in cell.scenario.instance_specs()))
        for cls in CLASS_ORDER:
            c = res.summary["classes"].get(cls)
            if c is None:
                continue
            row = {axis: label, "seed": cell.seed, "window": cell.window, "class": cls, **_metric_row(c)}
            row.update(cluster_row if cls == "all" else dict.fromkeys(cluster_row, math.nan))
            rows.append(row)
    extra = list(dict.fromkeys(k for row in rows for k in row if k.startswith("bytes_") and k not in METRIC_COLUMNS))
    result.runs = pd.DataFrame(rows, columns=[axis, "seed", "window", "class", *METRIC_COLUMNS, *extra])
    return result


def timeline_file_name(label: str, seed: int, window: int, windows: int) -> str:
    """The timeline file of one compared run: ``timeline-<label>-seed<seed>[-window<k>].json.gz``
    (``label`` the policy or router name, characters other than letters, digits, ``.``, ``_`` and
    ``-`` replaced by ``_``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label).lstrip(".") or "_"
    return f"timeline-{safe}-seed{seed}" + (f"-window{window}" if windows > 1 else "") + ".json.gz"


def aggregate(runs: pd.DataFrame, policies: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean over runs (seeds x windows) per (policy, class), with ``<metric>_std`` (population),
    ``_min``, ``_max``.

    The label column is ``policy``, or ``router`` for a router comparison (kept as named).

    Rows come in policy order (``policies``, default order of appearance), then class order
    ("all", "short", "long"). ``seeds`` counts the runs averaged (seeds x windows). NaN values
    (undefined metrics) are skipped; a metric undefined in every run stays NaN.
    """
    key = label_column(runs)
    if policies is None:
        policies = list(dict.fromkeys(runs[key]))
    metrics = [*METRIC_COLUMNS, *extra_link_columns(runs)]
    out = []
    for p in policies:
        for cls in CLASS_ORDER:
            sub = runs[(runs[key] == p) & (runs["class"] == cls)]
            if sub.empty:
                continue
            row: dict[str, Any] = {key: p, "class": cls, "seeds": int(len(sub))}
            for m in metrics:
                v = sub[m].to_numpy(dtype=np.float64)
                v = v[np.isfinite(v)]
                row[m] = float(v.mean()) if v.size else math.nan
                row[f"{m}_std"] = float(v.std()) if v.size else math.nan
                row[f"{m}_min"] = float(v.min()) if v.size else math.nan
                row[f"{m}_max"] = float(v.max()) if v.size else math.nan
            out.append(row)
    cols = [key, "class", "seeds"] + [f"{m}{s}" for m in metrics for s in ("", "_std", "_min", "_max")]
    return pd.DataFrame(out, columns=cols)


#: Metrics of the paired table: (column, lower is better).
PAIRED_METRICS: tuple[tuple[str, bool], ...] = (("ttft_p50_s", True), ("ttft_p99_s", True), ("tpot_p50_s", True),
                                                ("e2e_p99_s", True), ("slo_attainment", False),
                                                ("goodput_rps", False))


def paired(runs: pd.DataFrame, policies: Sequence[str] | None = None, cls: str = "all", key: str | None = None,
           metrics: Sequence[tuple[str, bool]] = PAIRED_METRICS) -> pd.DataFrame:
    """Each policy (router, layout) against the first, run by run: every label served the same
    (seed, window) runs, so the difference ``d = label - first`` is taken per run and averaged, with
    its 95 % percentile-bootstrap interval (:func:`kvsched.experiments.suite.stats.bootstrap_ci`,
    seeded: the same numbers in every run) and the count of runs where the label is worse.

    Rows: one per (label other than the first, metric of :data:`PAIRED_METRICS`), for class
    ``cls``; columns ``<label column>``, ``baseline``, ``metric``, ``runs`` (pairs with both values
    defined), ``diff_mean``, ``diff_lo``, ``diff_hi`` (in the metric's unit: s, a share or req/s),
    ``worse`` (runs where the label is worse than the baseline: higher for latencies, lower for
    attainment and goodput). Empty with fewer than two labels. ``key`` names the label column
    (default :func:`label_column`; ``agent`` for ``kvsched evaluate``'s episodes), ``metrics``
    the (column, lower is better) pairs; runs are matched on ``seed`` and ``window``.
    """
    from .suite.stats import bootstrap_ci

    key = label_column(runs) if key is None else key
    if policies is None:
        policies = list(dict.fromkeys(runs[key]))
    cols = [key, "baseline", "metric", "runs", "diff_mean", "diff_lo", "diff_hi", "worse"]
    if len(policies) < 2:
        return pd.DataFrame([], columns=cols)
    sub = runs[runs["class"] == cls]
    by = {p: sub[sub[key] == p].set_index(["seed", "window"]) for p in policies}
    base = policies[0]
    out = []
    for p in policies[1:]:
        common = by[base].index.intersection(by[p].index)
        for m, lower_better in metrics:
            if m not in sub.columns:
                continue
            d = (by[p].loc[common, m].to_numpy(dtype=np.float64) - by[base].loc[common, m].to_numpy(dtype=np.float64))
            d = d[np.isfinite(d)]
            lo, hi = bootstrap_ci(d) if d.size else (math.nan, math.nan)
            worse = int(np.count_nonzero(d > 0 if lower_better else d < 0))
            out.append({key: p, "baseline": base, "metric": m, "runs": int(d.size),
                        "diff_mean": float(d.mean()) if d.size else math.nan, "diff_lo": lo, "diff_hi": hi,
                        "worse": worse})
    return pd.DataFrame(out, columns=cols)


# ------------------------------------------------------------------------------ presentation
_PAIRED_SHOW = {"ttft_p50_s": ("TTFT p50 ms", 1e3), "ttft_p99_s": ("TTFT p99 ms", 1e3),
                "tpot_p50_s": ("TPOT p50 ms", 1e3), "e2e_p99_s": ("E2E p99 s", 1.0),
                "slo_attainment": ("SLO %", 100.0), "goodput_rps": ("goodput req/s", 1.0)}


def paired_rich_table(table: pd.DataFrame, title: str):
    """The paired differences of :func:`paired` as a rich table: a row per label, a column per
    metric, ``mean [lo, hi]`` and the runs where the label is worse."""
    from rich.table import Table

    key = str(table.columns[0])  # the label column (policy, router, cluster or agent)
    t = Table(title=title)
    t.add_column(key)
    metrics = [m for m in dict.fromkeys(table["metric"]) if m in _PAIRED_SHOW]
    for m in metrics:
        t.add_column(f"Δ {_PAIRED_SHOW[m][0]}", justify="right")
    for label in dict.fromkeys(table[key]):
        cells = []
        for m in metrics:
            r = table[(table[key] == label) & (table["metric"] == m)].iloc[0]
            scale = _PAIRED_SHOW[m][1]
            if not math.isfinite(r["diff_mean"]):
                cells.append("-")
                continue
            cells.append(f"{r['diff_mean'] * scale:+.3g} [{r['diff_lo'] * scale:+.3g}, {r['diff_hi'] * scale:+.3g}]"
                         f" worse {r['worse']}/{r['runs']}")
        t.add_row(str(label), *cells)
    return t


def _fmt(mean: float, std: float, scale: float, digits: int, spread: bool) -> str:
    if not math.isfinite(mean):
        return "-"
    s = f"{mean * scale:.{digits}f}"
    if mean != 0 and float(s) == 0:  # nonzero, would print as zero: two significant digits
        s = f"{mean * scale:.2g}"
    if spread and math.isfinite(std) and std > 0:
        s += f"±{std * scale:.2g}" if float(f"{std * scale:.{digits}f}") == 0 else f"±{std * scale:.{digits}f}"
    return s


def rich_table(agg: pd.DataFrame, title: str):
    """A :class:`rich.table.Table` of the aggregated rows (mean, ``±std`` when seeds > 1).

    Link columns appear only for links that moved bytes in some row (GB = 1e9 B).
    """
    from rich.table import Table

    key = label_column(agg)
    spread = bool((agg["seeds"] > 1).any()) if len(agg) else False
    links = [c for c in (*LINK_COLUMNS, *extra_link_columns(agg)) if (agg[c].fillna(0) > 0).any()]
    cols = [("TTFT p50 ms", "ttft_p50_s", 1e3, 0), ("TTFT p99 ms", "ttft_p99_s", 1e3, 0),
            ("TPOT p50 ms", "tpot_p50_s", 1e3, 1), ("TPOT p99 ms", "tpot_p99_s", 1e3, 1),
            ("E2E p50 s", "e2e_p50_s", 1.0, 2), ("E2E p99 s", "e2e_p99_s", 1.0, 2),
            ("SLO %", "slo_attainment", 100.0, 1), ("goodput req/s", "goodput_rps", 1.0, 2),
            ("preempt", "preemptions", 1.0, 0)]
    cols += [(f"GB {c[len('bytes_'):].replace('_to_', '→')}", c, 1e-9, 2) for c in links]
    cols += [("max wait s", "max_wait_s", 1.0, 2), ("prefix hit %", "prefix_hit_rate", 100.0, 1)]
    if key == "router" or (agg["load_imbalance"].fillna(1.0) != 1.0).any():
        cols += [("imbalance", "load_imbalance", 1.0, 2), ("max share %", "load_share_max", 100.0, 1)]
    if agg["shared_kv_bytes_fetched"].notna().any():
        cols += [("GB shared→hbm", "shared_kv_bytes_fetched", 1e-9, 1)]
    if key == "cluster" or agg["kv_transfer_bytes"].notna().any():
        cols += [("GPUs", "gpus", 1.0, 0), ("GB kv link", "kv_transfer_bytes", 1e-9, 2),
                 ("link util %", "kv_link_utilisation", 100.0, 1),
                 ("remote prefill %", "remote_prefill_share", 100.0, 1)]
    t = Table(title=title)
    t.add_column(key, no_wrap=True)
    t.add_column("class", no_wrap=True)
    t.add_column("n", justify="right")
    for head, *_ in cols:
        t.add_column(head, justify="right")
    prev = None
    for _, r in agg.iterrows():
        t.add_row(r[key] if r[key] != prev else "", r["class"], _fmt(r["n"], r["n_std"], 1.0, 0, spread),
                  *[_fmt(r[c], r[f"{c}_std"], sc, d, spread) for _, c, sc, d in cols],
                  end_section=False)
        prev = r[key]
    return t


def _ecdf(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(x[np.isfinite(x)])
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def plot_ttft_cdf(result: CompareResult, path: Path) -> None:
    """TTFT CDF per length class (one panel each), a line per policy, seeds pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = [c for c in LENGTH_CLASSES
               if any((r["length_class"] == c).any() for r in result.records.values())]
    fig, axes = plt.subplots(1, max(len(classes), 1), figsize=(5.5 * max(len(classes), 1), 4), squeeze=False)
    for ax, cls in zip(axes[0], classes):
        for name in result.policies:
            parts = [r for (p, _, _), r in result.records.items() if p == name]
            rec = pd.concat(parts, ignore_index=True)
            m = (rec["length_class"] == cls) & (rec["status"] == "finished")
            x, y = _ecdf((rec.loc[m, "first_token_s"] - rec.loc[m, "arrival_s"]).to_numpy(dtype=np.float64))
            if len(x):
                ax.step(x, y, where="post", label=f"{name} (n={len(x)})",
                        linestyle=("-", "--", ":", "-.")[result.policies.index(name) % 4])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of finished requests")
        ax.set_title(f"TTFT CDF, {cls} requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def _summed_occupancy(occ: pd.DataFrame, tier: str) -> tuple[np.ndarray, np.ndarray]:
    """Time and used/capacity of one tier summed over instances (values hold until the next sample)."""
    if occ.empty:
        return np.zeros(0), np.zeros(0)
    used = occ.pivot_table(index="time_s", columns="instance_id", values=f"used_blocks_{tier}",
                           aggfunc="last").sort_index().ffill().fillna(0.0)
    cap = occ.pivot_table(index="time_s", columns="instance_id", values=f"capacity_blocks_{tier}",
                          aggfunc="last").sort_index().ffill().fillna(0.0)
    total_cap = cap.sum(axis=1).to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(total_cap > 0, used.sum(axis=1).to_numpy(dtype=np.float64) / total_cap, np.nan)
    return used.index.to_numpy(dtype=np.float64), frac


def plot_occupancy(result: CompareResult, path: Path) -> None:
    """KV blocks in use / capacity per tier over time (first seed), a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = result.seeds[0]
    occs = {p: result.occupancy[(p, seed, 0)] for p in result.policies}
    names = dict.fromkeys(str(c)[len("capacity_blocks_"):] for o in occs.values() for c in o.columns
                          if str(c).startswith("capacity_blocks_"))  # standard tiers first, then extra ones
    tiers = [t for t in names if t != "pnm"
             and any(f"capacity_blocks_{t}" in o and (o[f"capacity_blocks_{t}"] > 0).any() for o in occs.values())]
    tiers = tiers or ["hbm"]
    fig, axes = plt.subplots(len(tiers), 1, figsize=(9, 2.8 * len(tiers)), squeeze=False, sharex=True)
    for ax, tier in zip(axes[:, 0], tiers):
        for name, occ in occs.items():
            t, frac = _summed_occupancy(occ, tier)
            if len(t):
                ax.step(t, 100.0 * frac, where="post", label=name, linewidth=1.0,
                        linestyle=("-", "--", ":", "-.")[list(occs).index(name) % 4])
        ax.set_ylabel(f"{tier.upper()} used %")
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[0, 0].set_title(f"KV cache occupancy per tier (seed {seed}"
                        + (", window 0)" if result.windows > 1 else ")"))
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def plot_slo(agg: pd.DataFrame, policies: Sequence[str], path: Path) -> None:
    """Grouped bars: SLO attainment (%) per class, a bar per policy (error bar = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = label_column(agg)
    classes = [c for c in CLASS_ORDER if (agg["class"] == c).any()]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(classes) * max(len(policies), 1) / 2), 4))
    width = 0.8 / max(len(policies), 1)
    x = np.arange(len(classes))
    for j, name in enumerate(policies):
        vals, lo, hi = [], [], []
        for cls in classes:
            r = agg[(agg[key] == name) & (agg["class"] == cls)]
            v = float(r["slo_attainment"].iloc[0]) if len(r) else math.nan
            vals.append(100 * v)
            lo.append(100 * (v - float(r["slo_attainment_min"].iloc[0])) if len(r) else 0.0)
            hi.append(100 * (float(r["slo_attainment_max"].iloc[0]) - v) if len(r) else 0.0)
        err = np.nan_to_num(np.array([lo, hi]))
        ax.bar(x + (j - (len(policies) - 1) / 2) * width, vals, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(x, classes)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title("SLO attainment (mean over seeds)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


#: Files :func:`write_outputs` writes.
OUTPUT_FILES: tuple[str, ...] = ("compare.csv", "compare_runs.csv", "compare_paired.csv", "compare.json",
                                 "ttft_cdf.png", "kv_occupancy.png", "slo_attainment.png")


def write_outputs(result: CompareResult, agg: pd.DataFrame, scenario: Scenario, out: Path) -> list[Path]:
    """Write :data:`OUTPUT_FILES` into ``out`` (created); returns their paths.

    ``compare.csv`` is the aggregated table, ``compare_runs.csv`` one row per
    (policy, seed, window, class), ``compare_paired.csv`` each policy against the first run by run
    (:func:`paired`), ``compare.json`` what was compared (kvsched and Python versions, scenario and its hash,
    policies, parameters, seeds, windows). CSV floats are written with 17 significant digits (round
    trip) so identical runs give identical files.
    """
    out.mkdir(parents=True, exist_ok=True)
    with atomic_files.replacing(out / "compare.csv") as tmp:
        agg.to_csv(tmp, index=False, float_format="%.17g")
    with atomic_files.replacing(out / "compare_runs.csv") as tmp:
        result.runs.to_csv(tmp, index=False, float_format="%.17g")
    with atomic_files.replacing(out / "compare_paired.csv") as tmp:
        paired(result.runs, result.policies).to_csv(tmp, index=False, float_format="%.17g")
    import platform

    import kvsched

    meta = {"kvsched_version": kvsched.__version__, "python": platform.python_version(),
            "scenario": scenario.to_dict(), "scenario_sha256": scenario.sha256(), "seeds": result.seeds,
            "windows": result.windows}
    if result.axis == "router":
        meta.update(routers=result.policies, router_params=result.params, policy=scenario.policy)
    elif result.axis == "cluster":
        meta.update(clusters=result.policies, policy=scenario.policy)
    else:
        meta.update(policies=result.policies, policy_params=result.params)
    atomic_files.write_text(out / "compare.json", json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    plot_ttft_cdf(result, out / "ttft_cdf.png")
    plot_occupancy(result, out / "kv_occupancy.png")
    plot_slo(agg, result.policies, out / "slo_attainment.png")
    return [out / f for f in OUTPUT_FILES]
