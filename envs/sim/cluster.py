"""The event loop: arrivals, instances and a router hook. A single instance is a cluster of one.

Data flow (ARCHITECTURE.md): a workload's requests arrive in time order; the router picks an
instance from a :class:`~kvsched.envs.sim.routing.RouterTable` of the cluster's state (possibly
``router_delay_s`` old); each idle instance plans its next step (or fast-forwarded stretch) with its policy,
KV manager and cost model; step ends, transfer completions and arrivals are events in one
deterministic queue (:mod:`kvsched.envs.sim.events`). Nothing here reads the wall clock or a
global random generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from .errors import ConfigError
from .events import ARRIVAL, SCHEDULE, STEP_END, TRANSFER_DONE, EventQueue
from .instance import TRANSFER_EVENT, Instance, InstanceOptions
from .metrics import MetricsConfig, summarize
from .recorder import Recorder
from .request import RequestState, Workload
from .routing import RouterTable, StateProvider
from .shared_kv import FETCH_EVENT, SharedKVPool, SharedKVSpec
from .specs import InstanceSpec


@dataclass
class SimulationResult:
    """What one run produced.

    Attributes:
        records: per-request records (``kvsched.envs.sim.metrics.RECORD_COLUMNS``).
        summary: the metrics summary (JSON-ready dict).
        occupancy: KV blocks in use per tier over time (summed over instances).
        stats: simulator counters (events, steps, fast-forwarded stretches, preemptions).
    """

    records: pd.DataFrame
    summary: dict
    occupancy: pd.DataFrame
    stats: dict = field(default_factory=dict)


class Cluster:
    """N instances on one event loop.

    Args:
        specs: one :class:`InstanceSpec` per instance (heterogeneous allowed).
        policy_factory: called once per instance to build its scheduler policy.
        metrics: the metrics configuration.
        router: a router name (``kvsched.policies.routing.router_names()``) or a router object
            with ``bind(n_instances, seed)`` and ``route(table) -> row``; default round-robin.
            Not called with a single instance.
            A router whose choice depends only on how many requests it has routed may expose
            ``router.arrivals_until(index, n_instances)`` (arrivals still to come before the
            one routed to ``index``): without a shared KV tier, a fast-forwarded stretch of that
            instance then runs up to its own next arrival rather than the cluster's
            (round-robin does; same results).
        options: simulation options shared by all instances.
        progress: optional callback ``progress(n_requests_done)`` called every 1,000 requests.
        router_params: parameters of a named router (dict of its parameter fields).
        router_delay_s: staleness of the state routers see (s, >= 0; :mod:`.routing`).
        shared_kv: the cluster KV tier shared by all instances (:mod:`.shared_kv`), or ``None``.
        seed: handed to the router's ``bind`` (routers with a sampler seed it from their params).

    Raises:
        ConfigError: front-end parameters that differ between instances, an unknown router or
            invalid router parameters, a negative delay, instances that cannot share a KV tier.
    """

    def __init__(self, specs: Sequence[InstanceSpec], policy_factory: Callable[[], object],
                 metrics: MetricsConfig = MetricsConfig(), router=None,
                 options: InstanceOptions = InstanceOptions(),
                 progress: Callable[[int], None] | None = None, router_params: dict | None = None,
                 router_delay_s: float = 0.0, shared_kv: SharedKVSpec | None = None, seed: int = 0) -> None:
        if not specs:
            raise ValueError("a cluster needs at least one instance spec")
        front = {(s.cost.request_overhead_s, s.cost.prompt_token_overhead_s, s.cost.output_token_overhead_s,
                  s.cost.first_chunk_delay_tokens) for s in specs}
        if len(front) > 1:
            raise ConfigError("instances of one cluster share the API front end: their CostParams must agree on "
                              "request_overhead_s, prompt_token_overhead_s, output_token_overhead_s and "
                              f"first_chunk_delay_tokens; got {sorted(front)}")
        self.front_end = specs[0].cost
        self.recorder = Recorder(metrics, output_overhead_s=self.front_end.output_token_overhead_s,
                                 first_chunk_delay_tokens=self.front_end.first_chunk_delay_tokens)
        self.metrics = metrics
        self.instances = [Instance(spec, policy_factory(), self.recorder, i, options)
                          for i, spec in enumerate(specs)]
        from kvsched.policies.routing import make_router

        if router is None or isinstance(router, str):
            router = make_router(router or "round-robin", router_params)
        elif router_params is not None:
            raise ConfigError("router_params only apply to a router given by name; got a router object")
        if not callable(getattr(router, "route", None)) or not callable(getattr(router, "bind", None)):
            raise ConfigError(f"router={router!r} is not allowed: expected a router name or an object with "
                              "bind(n_instances, seed) and route(table) -> row")
        router.bind(len(self.instances), seed)
        self.router = router
        self.state_provider = StateProvider(router_delay_s)
        if shared_kv is not None and not isinstance(shared_kv, SharedKVSpec):
            raise ConfigError(f"shared_kv={shared_kv!r} is not allowed: expected a SharedKVSpec or None")
        self.shared_kv = SharedKVPool(shared_kv, self.instances) if shared_kv is not None else None
        for inst in self.instances:
            inst.shared_kv = self.shared_kv
        self.routed_requests = np.zeros(len(self.instances), dtype=np.int64)
        self.routed_prompt_tokens = np.zeros(len(self.instances), dtype=np.int64)
        self.progress = progress
        self.events = EventQueue()

    def run(self, workload: Workload) -> SimulationResult:
        """Serve every request of ``workload``; returns records, summary and counters.

        A request reaches the router and scheduler ``CostParams.server_delay_s(prompt_tokens)``
        after its ``arrival_s`` (the API front end: HTTP, tokenisation, hand-off to the engine;
        one front end for the cluster); its record keeps the client's ``arrival_s``, so TTFT and
        E2E include that delay.
        """
        ev = self.events
        n = len(workload)
        instances = self.instances
        rec = self.recorder
        block_size = {inst.instance_id: inst.bs for inst in instances}
        # when the engine sees each request (after the API front end), and in which order
        arrivals = workload.arrival_s + self.front_end.server_delay_s(workload.prompt_tokens)
        order = None
        if n > 1 and np.any(np.diff(arrivals) < 0):  # per-token delays can reorder arrivals
            order = np.argsort(arrivals, kind="stable")
            arrivals = arrivals[order]
        next_idx = 0
        if n:
            ev.push(float(arrivals[0]), ARRIVAL, None)
        done_reported = 0
        check_pool = self.shared_kv is not None and instances[0].options.check_invariants
        ahead = (getattr(self.router, "arrivals_until", None)
                 if len(instances) > 1 and self.shared_kv is None else None)
        while len(ev):
            t, kind, payload = ev.pop()
            if kind == STEP_END:
                inst = payload
                inst.complete_step(t)
                if check_pool:
                    self.shared_kv.check()
                self._wake(inst, t)
            elif kind == ARRIVAL:
                req = workload.request(next_idx if order is None else int(order[next_idx]))
                next_idx += 1
                if next_idx < n:
                    ev.push(float(arrivals[next_idx]), ARRIVAL, None)
                any_inst = instances[0]
                st = RequestState(req, block_size[any_inst.instance_id], rec.length_class(req.prompt_tokens))
                inst = instances[self._route(st, t)]
                if inst.bs != any_inst.bs:  # heterogeneous block sizes: segments in its blocks
                    st = RequestState(req, inst.bs, st.length_class)
                if inst.add_request(st, t):
                    self._wake(inst, t)
            elif kind == TRANSFER_DONE:
                inst, st = payload
                if st is not None:  # None: a shared-tier fetch landed (nothing to free)
                    inst.complete_transfer(st, t)
                self._wake(inst, t)
            else:  # SCHEDULE
                inst = payload
                inst.schedule_pending = False
                if not inst.busy:
                    # the next arrival this instance can receive: with round-robin routing, the
                    # one its turn comes at (others cannot change its batch); else the next one
                    j = next_idx
                    if ahead is not None and j < n:
                        j += ahead(inst.instance_id, len(instances))
                    horizon = float(arrivals[j]) if j < n else math.inf
                    end = inst.schedule(t, horizon)
                    if end is not None:
                        ev.push(end, STEP_END, inst)
                    if inst.pending_events:
                        for when, what, st in inst.pending_events:
                            if what == TRANSFER_EVENT:
                                ev.push(when, TRANSFER_DONE, (inst, st))
                            elif what == FETCH_EVENT:
                                ev.push(when, TRANSFER_DONE, (inst, None))
                        inst.pending_events.clear()
            if self.progress is not None and len(rec.rows) - done_reported >= 1000:
                done_reported = len(rec.rows)
                self.progress(done_reported)
        if self.progress is not None:
            self.progress(len(rec.rows))
        return self._result(workload)

    def _route(self, st: RequestState, t: float) -> int:
        """Index of the instance an arriving request goes to (the router's choice, checked)."""
        instances = self.instances
        if len(instances) == 1:
            idx = 0
        else:
            view = self.state_provider.view(instances, t, self.shared_kv)
            idx = self.router.route(RouterTable(view, st, t, self.shared_kv))
            if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)) or not 0 <= idx < len(instances):
                raise ConfigError(f"router {getattr(self.router, 'name', self.router)!r} returned {idx!r} for "
                                  f"request {st.rid}; expected an instance row 0..{len(instances) - 1}")
            idx = int(idx)
        self.routed_requests[idx] += 1
        self.routed_prompt_tokens[idx] += st.prompt_tokens
        return idx

    def routing_summary(self) -> dict:
        """Per-instance load share of the run (JSON-ready).

        ``requests`` / ``prompt_tokens``: routed to each instance; ``load_share``: each
        instance's fraction of the requests; ``load_imbalance``: max over mean of the requests per
        instance (1.0 = perfectly even, N = everything on one of N instances).
        """
        n = self.routed_requests
        total = int(n.sum())
        mean = total / len(n) if len(n) else 0.0
        return {
            "router": getattr(self.router, "name", type(self.router).__name__),
            "router_delay_s": self.state_provider.delay_s,
            "snapshot_refreshes": self.state_provider.refreshes,
            "requests": [int(x) for x in n],
            "prompt_tokens": [int(x) for x in self.routed_prompt_tokens],
            "load_share": [float(x) / total if total else 0.0 for x in n],
            "load_imbalance": float(n.max()) / mean if mean > 0 else None,
        }

    def _wake(self, inst: Instance, t: float) -> None:
        if not inst.busy and not inst.schedule_pending:
            inst.schedule_pending = True
            self.events.push(t, SCHEDULE, inst)

    def _result(self, workload: Workload) -> SimulationResult:
        rec = self.recorder
        records = rec.records_frame()
        if len(records) != len(workload):
            stuck = [(i.instance_id, len(i.waiting), len(i.running), len(i.swapped)) for i in self.instances]
            raise RuntimeError(f"{len(workload) - len(records)} requests neither finished nor were "
                               f"rejected (instance, waiting, running, swapped): {stuck}")
        occupancy = rec.occupancy_frame()
        summary = summarize(records, rec.itl, None, self.metrics)
        summary["kv_occupancy"] = rec.occupancy.summary()
        if len(self.instances) > 1:
            summary["routing"] = self.routing_summary()
        if self.shared_kv is not None:
            if self.instances[0].options.check_invariants:
                self.shared_kv.check()
            summary["shared_kv"] = self.shared_kv.stats()
        stats = {
            "events": self.events.popped,
            "steps": sum(i.steps for i in self.instances),
            "fast_forward_stretches": sum(i.stretches for i in self.instances),
            "fast_forward_steps": sum(i.stretch_steps for i in self.instances),
            "preemptions": sum(i.preemptions for i in self.instances),
            "mean_batch_size": (sum(i.sum_batch for i in self.instances)
                                / max(1, sum(i.steps for i in self.instances))),
            "link_bytes": {name: sum(i.links[name].bytes_moved for i in self.instances)
                           for name in ("pcie_d2h", "pcie_h2d", "nvme_write", "nvme_read", "pnm_link")},
            "pnm_migrations": sum(i.pnm_migrations for i in self.instances),
            "evicted_prefix_segments": sum(i.hbm.evicted_segments for i in self.instances),
            "routed_requests": [int(x) for x in self.routed_requests],
        }
        if self.shared_kv is not None:
            stats["shared_kv"] = self.shared_kv.stats()
        return SimulationResult(records=records, summary=summary, occupancy=occupancy, stats=stats)


def simulate(workload: Workload, spec: InstanceSpec, policy: str = "fcfs",
             metrics: MetricsConfig = MetricsConfig(), options: InstanceOptions = InstanceOptions(),
             n_instances: int = 1, progress: Callable[[int], None] | None = None,
             policy_params: dict | None = None, router: str = "round-robin", router_params: dict | None = None,
             router_delay_s: float = 0.0, shared_kv: SharedKVSpec | None = None, seed: int = 0) -> SimulationResult:
    """Run ``workload`` on ``n_instances`` copies of ``spec`` with the named policy and router.

    ``policy_params`` (a dict of the policy's parameter fields) is validated once and used for
    every instance. ``router``, ``router_params``, ``router_delay_s``, ``shared_kv`` and
    ``seed``: see :class:`Cluster`.

    Raises:
        UnknownPresetError: unknown policy or router name.
        ConfigError: invalid spec, policy or router parameters, or request fields.
    """
    from kvsched.policies.base import make_policy

    params = make_policy(policy, policy_params).params  # fail early on an unknown name or field
    cluster = Cluster([spec] * n_instances, lambda: make_policy(policy, params), metrics=metrics,
                      options=options, progress=progress, router=router, router_params=router_params,
                      router_delay_s=router_delay_s, shared_kv=shared_kv, seed=seed)
    return cluster.run(workload)
