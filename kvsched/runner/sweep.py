"""Grids of simulation runs (policy x seed x trace window), run locally or as Ray tasks.

A *cell* is one simulation: a scenario, a policy with its parameters, a seed and one window
of the scenario's workload. :func:`run_cell` is a pure function of its :class:`Cell` (the
simulator is deterministic: no wall clock, no global RNG), so a grid gives the same results
whether its cells run one after another in this process (``backend="local"``) or as Ray
tasks on any number of machines (``backend="ray"``); :func:`run_cells` returns them in cell
order either way, and the tables built from them are byte-identical (tested).

Windows. ``windows=W`` cuts the scenario's workload (after its own window, rate scaling
and request cap) into ``W`` consecutive windows of equal simulated time, each rebased to
start at 0 (:func:`kvsched.envs.workload.traces.window`); every window is served from an
empty system (cold caches), as a separate run. ``W = 1`` serves the workload whole.

Ray is an optional extra (``pip install -e '.[ray]'`` in the checkout): the default install does not
import it. ``address=None`` starts (or joins) a local Ray instance inside this process;
``address="HOST:PORT"`` or ``"auto"`` submits to a running cluster (``ray start --head``),
whose workers must have kvsched installed (same version).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from kvsched.envs.sim.errors import ConfigError, bounded_repr

from .scenario import Scenario

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class Cell:
    """One simulation of a grid.

    Attributes:
        scenario: the scenario (its ``policy`` field is ignored; ``seed`` is this cell's seed; its
            ``router``, ``router_params``, ``router_delay_s`` and ``shared_kv`` are used).
        policy: registered policy name.
        params: the policy's parameters (validated by the policy's dataclass).
        window: index of the window, ``0 <= window < windows``.
        windows: how many equal windows the workload is cut into (>= 1).
        fast_forward: the simulator's fast-forward option (results are identical either way).
        timeline: write the run's schedule to this file (:mod:`kvsched.runner.timeline`; on the
            machine the cell runs on), or ``None``.
        timeline_window_s: the timeline's ``(start_s, end_s)`` window, or ``None`` (all of it).
    """

    scenario: Scenario
    policy: str
    params: dict = field(default_factory=dict)
    window: int = 0
    windows: int = 1
    fast_forward: bool = True
    timeline: str | None = None
    timeline_window_s: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("window", "windows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"Cell.{name}={bounded_repr(v)} must be an integer")
        if self.windows < 1:
            raise ConfigError(f"Cell.windows={bounded_repr(self.windows)} must be >= 1")
        if not 0 <= self.window < self.windows:
            raise ConfigError(f"Cell.window={bounded_repr(self.window)} must be in [0, {self.windows})")

    @property
    def seed(self) -> int:
        return self.scenario.seed


@dataclass
class CellResult:
    """What one cell produced: the run's summary, records and KV occupancy samples."""

    cell: Cell
    summary: dict
    records: pd.DataFrame
    occupancy: pd.DataFrame


def cell_workload(cell: Cell):
    """The requests cell ``cell`` serves: the scenario's workload, cut to its window.

    Raises:
        ConfigError: a window that holds no request (fewer requests than windows).
    """
    from kvsched.envs.workload.traces import window

    w = cell.scenario.workload()
    if cell.windows == 1:
        return w
    if len(w) == 0:
        raise ConfigError(f"scenario {bounded_repr(cell.scenario.name)} has no request to cut into windows")
    first, last = float(w.arrival_s[0]), float(w.arrival_s[-1])
    width = (last - first) / cell.windows
    lo = first + cell.window * width
    # the last window closes just after the last arrival, so every request is in one window
    hi = first + (cell.window + 1) * width if cell.window < cell.windows - 1 else float(np.nextafter(last, np.inf))
    try:
        return window(w, lo, hi)
    except ConfigError as e:
        raise ConfigError(f"scenario {bounded_repr(cell.scenario.name)}: window {cell.window} of {cell.windows}: {e}; "
                          "use fewer windows") from None


def run_cell(cell: Cell) -> CellResult:
    """Serve one cell (pure: the same cell gives the same result in any process).

    Raises:
        ConfigError / UnknownPresetError: invalid scenario, policy or parameters.
    """
    from kvsched.envs.sim.instance import InstanceOptions

    from .simulate import build_cluster

    sc = cell.scenario
    workload = cell_workload(cell)
    sc.check_slo_classes(workload)
    options = InstanceOptions(fast_forward=cell.fast_forward, oracle_lengths=sc.oracle_lengths)
    spec = sc.instance_spec()
    with contextlib.ExitStack() as stack:
        observer = None
        if cell.timeline is not None:
            from .timeline import TimelineWriter, instance_labels

            meta = {"scenario": sc.name, "policy": cell.policy, "seed": sc.seed, "window": cell.window,
                    "windows": cell.windows, "n_instances": sc.n_instances}
            if sc.n_instances > 1:
                meta["router"] = sc.router
            observer = stack.enter_context(TimelineWriter(cell.timeline, instance_labels(sc.n_instances, spec),
                                                          cell.timeline_window_s, meta))
        layout = sc.cluster_layout()
        roles = {} if layout is None else {
            "disagg": layout.disagg_spec(), "prefill_router": layout.prefill_router,
            "prefill_router_params": dict(layout.prefill_router_params)}
        cluster = build_cluster(sc.instance_specs(), cell.policy, dict(cell.params),
                                metrics=sc.metrics_config(), options=options, router=sc.router,
                                router_params=dict(sc.router_params), router_delay_s=sc.router_delay_s,
                                shared_kv=sc.shared_kv_spec(), seed=sc.seed, observer=observer, **roles)
        res = cluster.run(workload)
        if observer is not None:
            observer.add_records(res.records)
    return CellResult(cell=cell, summary=res.summary, records=res.records, occupancy=res.occupancy)


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("backend 'ray' needs Ray: pip install -e '.[ray]' in the kvsched checkout (the default "
                          "install is Ray-free)") from None
    return ray


def run_cells(cells: Sequence[Cell], backend: str = "local", address: str | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[CellResult]:
    """Run every cell; results in the order of ``cells``.

    Args:
        cells: the grid.
        backend: ``"local"`` (this process, one cell after another) or ``"ray"`` (one Ray task
            per cell, ``ray.remote(num_cpus=1)``).
        address: Ray cluster address (``"HOST:PORT"``, ``"auto"``); ``None`` starts or joins a
            local Ray instance. Only with ``backend="ray"``.
        progress: optional ``progress(finished, total)`` called as cells finish (in finishing
            order under Ray).

    Raises:
        ConfigError: an unknown backend, an address without Ray, or Ray not installed.
    """
    return map_tasks(run_cell, [(c,) for c in cells], backend, address, progress)


def map_tasks(fn: Callable[..., Any], args: Sequence[tuple], backend: str = "local", address: str | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Any]:
    """``[fn(*a) for a in args]``, here or as one Ray task each; results in the order of ``args``.

    ``fn`` must be a module-level (picklable) pure function for the results not to depend on
    the backend. Raises :class:`ConfigError` as :func:`run_cells`.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend={bounded_repr(backend)}: allowed {list(BACKENDS)}")
    if address is not None and backend != "ray":
        raise ConfigError(f"address={bounded_repr(address)} is only used with backend 'ray' "
                          f"(backend={bounded_repr(backend)})")
    total = len(args)
    if backend == "local":
        out = []
        for i, a in enumerate(args):
            out.append(fn(*a))
            if progress is not None:
                progress(i + 1, total)
        return out
    from .ray_connect import init_ray

    ray = _ray()
    started_here = init_ray(ray, address)
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(*a) for a in args]
        index = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * total
        pending = list(refs)
        done = 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                results[index[r]] = ray.get(r)
                done += 1
                if progress is not None:
                    progress(done, total)
        return results
    finally:
        if started_here:
            ray.shutdown()
