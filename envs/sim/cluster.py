"""The event loop: arrivals, instances and a router hook. A single instance is a cluster of one.

Data flow (ARCHITECTURE.md): a workload's requests arrive in time order; the router picks an
instance; each idle instance plans its next step (or fast-forwarded stretch) with its policy,
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
from .specs import InstanceSpec

Router = Callable[[RequestState, Sequence[Instance]], int]


def _round_robin() -> Router:
    state = {"next": 0}

    def route(st: RequestState, instances: Sequence[Instance]) -> int:
        i = state["next"] % len(instances)
        state["next"] += 1
        return i

    return route


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
        router: ``router(state, instances) -> index``; default round-robin (trivial for one).
        options: simulation options shared by all instances.
        progress: optional callback ``progress(n_requests_done)`` called every 1,000 requests.
    """

    def __init__(self, specs: Sequence[InstanceSpec], policy_factory: Callable[[], object],
                 metrics: MetricsConfig = MetricsConfig(), router: Router | None = None,
                 options: InstanceOptions = InstanceOptions(),
                 progress: Callable[[int], None] | None = None) -> None:
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
        self.router = router or _round_robin()
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
        while len(ev):
            t, kind, payload = ev.pop()
            if kind == STEP_END:
                inst = payload
                inst.complete_step(t)
                self._wake(inst, t)
            elif kind == ARRIVAL:
                req = workload.request(next_idx if order is None else int(order[next_idx]))
                next_idx += 1
                if next_idx < n:
                    ev.push(float(arrivals[next_idx]), ARRIVAL, None)
                any_inst = instances[0]
                st = RequestState(req, block_size[any_inst.instance_id], rec.length_class(req.prompt_tokens))
                idx = self.router(st, instances) if len(instances) > 1 else 0
                inst = instances[idx]
                if inst.bs != any_inst.bs:  # heterogeneous block sizes: segments in its blocks
                    st = RequestState(req, inst.bs, st.length_class)
                if inst.add_request(st, t):
                    self._wake(inst, t)
            elif kind == TRANSFER_DONE:
                inst, st = payload
                inst.complete_transfer(st, t)
                self._wake(inst, t)
            else:  # SCHEDULE
                inst = payload
                inst.schedule_pending = False
                if not inst.busy:
                    horizon = float(arrivals[next_idx]) if next_idx < n else math.inf
                    end = inst.schedule(t, horizon)
                    if end is not None:
                        ev.push(end, STEP_END, inst)
                    if inst.pending_events:
                        for when, what, st in inst.pending_events:
                            if what == TRANSFER_EVENT:
                                ev.push(when, TRANSFER_DONE, (inst, st))
                        inst.pending_events.clear()
            if self.progress is not None and len(rec.rows) - done_reported >= 1000:
                done_reported = len(rec.rows)
                self.progress(done_reported)
        if self.progress is not None:
            self.progress(len(rec.rows))
        return self._result(workload)

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
        stats = {
            "events": self.events.popped,
            "steps": sum(i.steps for i in self.instances),
            "fast_forward_stretches": sum(i.stretches for i in self.instances),
            "fast_forward_steps": sum(i.stretch_steps for i in self.instances),
            "preemptions": sum(i.preemptions for i in self.instances),
            "mean_batch_size": (sum(i.sum_batch for i in self.instances)
                                / max(1, sum(i.steps for i in self.instances))),
            "link_bytes": {name: sum(i.links[name].bytes_moved for i in self.instances)
                           for name in ("pcie_d2h", "pcie_h2d", "nvme_write", "nvme_read")},
            "evicted_prefix_segments": sum(i.hbm.evicted_segments for i in self.instances),
        }
        return SimulationResult(records=records, summary=summary, occupancy=occupancy, stats=stats)


def simulate(workload: Workload, spec: InstanceSpec, policy: str = "fcfs",
             metrics: MetricsConfig = MetricsConfig(), options: InstanceOptions = InstanceOptions(),
             n_instances: int = 1, progress: Callable[[int], None] | None = None,
             policy_params: dict | None = None) -> SimulationResult:
    """Run ``workload`` on ``n_instances`` copies of ``spec`` with the named policy.

    ``policy_params`` (a dict of the policy's parameter fields) is validated once and used for
    every instance.

    Raises:
        UnknownPresetError: unknown policy name.
        ConfigError: invalid spec, policy parameters or request fields.
    """
    from kvsched.policies.base import make_policy

    params = make_policy(policy, policy_params).params  # fail early on an unknown name or field
    cluster = Cluster([spec] * n_instances, lambda: make_policy(policy, params), metrics=metrics,
                      options=options, progress=progress)
    return cluster.run(workload)
