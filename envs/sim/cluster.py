"""The event loop: arrivals, instances and a router hook. A single instance is a cluster of one.

Data flow (docs/architecture.md): a workload's requests arrive in time order; the router picks an
instance from a :class:`~kvsched.envs.sim.routing.RouterTable` of the cluster's state (possibly
``router_delay_s`` old); each idle instance plans its next step (or fast-forwarded stretch) with its policy,
KV manager and cost model; step ends, transfer completions and arrivals are events in one
deterministic queue (:mod:`kvsched.envs.sim.events`). Nothing here reads the wall clock or a
global random generator.

Parallel sampling (a request with ``n > 1``): the router sees one arrival, the parent, and all
``n`` child sequences (:meth:`~.request.Request.children`) are placed on the instance it picks,
in child order, at the same time. An external router in front of vLLM servers sees one HTTP
request carrying ``n`` and the server it picks fans it out locally (``AsyncLLM.add_request``,
``vllm/v1/engine/async_llm.py``). (vLLM's own data-parallel load balancer routes each child
separately, ``DPLBAsyncMPClient.get_core_engine_for_request`` in
``vllm/v1/engine/core_client.py``: kvsched does not model that.) The records hold one row per
child sequence with a ``parent_id`` column, and ``summary["parallel_sampling"]`` gives the
per-parent latencies (:func:`parallel_sampling_summary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from .cost_params import FRONT_END_FIELDS
from .errors import ConfigError, bounded_repr
from .events import ARRIVAL, SCHEDULE, STEP_END, TRANSFER_DONE, EventQueue
from .instance import TRANSFER_EVENT, Instance, InstanceOptions
from .metrics import MetricsConfig, summarize
from .observer import LinkWatch, RetentionEvent, RouteEvent, SimObserver
from .recorder import Recorder
from .request import RequestState, Workload, hash_block_mismatch
from .policy_api import check_router
from .routing import RoundRobinPlacement, RouterTable, StateProvider
from .shared_kv import FETCH_EVENT, SharedKVPool, SharedKVSpec
from .disagg import KV_LANDED_EVENT, REMOTE_PREFILL_EVENT, DisaggRuntime, DisaggSpec
from .routing import InstanceStateView
from .step_noise import front_end_hiccups_s
from .instance_spec import InstanceSpec


#: ``Cluster.apply(prefill_to=LOCAL_PREFILL)``: prefill on the decode instance (prefill/decode roles).
LOCAL_PREFILL = -1


@dataclass(frozen=True)
class DecisionWatch:
    """Which decision points :meth:`Cluster.run_until_decision` stops at.

    Attributes:
        route: stop at every arrival, before the router places the request (``"route"``).
            The caller then routes (``apply(route_to=...)``), so round-robin look-ahead of
            fast-forwarded stretches is off.
        schedule_instance: index of the instance whose scheduler decisions are watched
            (``"schedule"``), or ``None``.
        schedule_filter: ``filter(instance, now_s) -> bool``: stop only at the watched
            instance's scheduling points where it returns ``True`` (``None``: every one where
            the instance is idle). Must not change the instance.
        residency: stop (``"residency"``) once per request finished on an instance whose lower
            tiers cache prefixes, after the event it finished in, for a retention decision
            (:meth:`Cluster.retain`, :mod:`.retention`); nothing is suspended.
        prefetch: stop (``"prefetch"``) once per arriving request queued on an instance where
            part of its prompt's cached prefix lies only in a tier below the first listed one
            (a parallel-sampling request: once, for its first child; its children share the prompt)
            (:meth:`.prefix_offload.PrefixTiers.promotable`), after the event it arrived in, for
            a prefetch decision (:meth:`Cluster.prefetch`); nothing is suspended.
    """

    route: bool = False
    schedule_instance: int | None = None
    schedule_filter: Callable[[Instance, float], bool] | None = None
    residency: bool = False
    prefetch: bool = False


@dataclass(frozen=True)
class DecisionPoint:
    """Where the event loop stopped.

    Attributes:
        kind: ``"route"`` (an arrival to place), ``"schedule"`` (an idle instance about to plan
            its next step), ``"residency"`` (a finished request's retention decision),
            ``"prefetch"`` (an arriving request's prefetch decision) or
            ``"time"`` (the ``until_s`` of the call was reached).
        time_s: simulated time (s).
        instance_id: the instance about to schedule (``"schedule"``) or where the request
            finished (``"residency"``), else ``None``.
        request: the arriving request's state (``"route"``), the finished one's
            (``"residency"``), else ``None``.
    """

    kind: str
    time_s: float
    instance_id: int | None
    request: RequestState | None


@dataclass
class SimulationResult:
    """What one run produced.

    Attributes:
        records: per-request records (``kvsched.envs.sim.metrics.RECORD_COLUMNS``).
        summary: the metrics summary (JSON-ready dict).
        occupancy: KV blocks in use per tier over time (summed over instances).
        stats: simulator counters (events, steps, fast-forwarded stretches and their steps,
            ``folded_steps``: single steps folded into the stretch after them, preemptions).
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
        router: a router object (:class:`~.policy_api.Router`: ``bind(n_instances, seed)`` and
            ``route(table) -> row``; build a named one with
            :func:`kvsched.policies.routing.make_router`); default
            :class:`~.routing.RoundRobinPlacement`. Not called with a single instance.
            A router whose choice depends only on how many requests it has routed may expose
            ``router.arrivals_until(index, n_instances)`` (arrivals still to come before the
            one routed to ``index``): without a shared KV tier, a fast-forwarded stretch of that
            instance then runs up to its own next arrival rather than the cluster's
            (round-robin does; same results).
        options: simulation options shared by all instances.
        progress: optional callback ``progress(n_requests_done)`` called every 1,000 requests.
        router_delay_s: staleness of the state routers see (s, >= 0; :mod:`.routing`).
        shared_kv: the cluster KV tier shared by all instances (:mod:`.shared_kv`), or ``None``.
        seed: handed to the router's ``bind`` (routers with a sampler seed it from their params) and
            to each instance, whose step-time noise it seeds (:mod:`.step_noise`; only when the
            cost parameters turn noise on).
        observer: told of routing decisions, steps, preemptions and link copies while the run
            goes on (:mod:`.observer`), or ``None`` (the default: no event is built). It does not
            change the results.
        disagg: prefill/decode disaggregation (:mod:`.disagg`: roles, KV-transfer link, modes), or
            ``None`` (every instance mixed, the default). With it, ``router`` picks the decode
            instance among the decode and mixed instances (its rows are theirs, in instance
            order) and ``prefill_router`` the prefill instance among the prefill instances.
        prefill_router: the prefill side's router object (default round-robin); only with
            ``disagg``.

    Raises:
        ConfigError: front-end parameters that differ between instances, a router without
            ``bind``/``route``, a negative delay, instances that cannot share a KV tier; with
            ``disagg``: roles not one per instance, instances that cannot exchange KV, a router
            delay (routers see live state), a shared KV tier, or a ``prefill_router`` without it.
    """

    def __init__(self, specs: Sequence[InstanceSpec], policy_factory: Callable[[], object],
                 metrics: MetricsConfig = MetricsConfig(), router=None,
                 options: InstanceOptions = InstanceOptions(),
                 progress: Callable[[int], None] | None = None,
                 router_delay_s: float = 0.0, shared_kv: SharedKVSpec | None = None, seed: int = 0,
                 observer: SimObserver | None = None, disagg: DisaggSpec | None = None,
                 prefill_router=None) -> None:
        if not specs:
            raise ConfigError("specs is empty: a cluster needs at least one InstanceSpec")
        bad_spec = next((s for s in specs if not isinstance(s, InstanceSpec)), None)
        if bad_spec is not None:
            raise ConfigError(f"specs: {bounded_repr(bad_spec)} is not an InstanceSpec "
                              "(build one with InstanceSpec(...) or instance_spec_from_dict)")
        if not isinstance(metrics, MetricsConfig):
            raise ConfigError(f"metrics={bounded_repr(metrics)} is not allowed: expected a MetricsConfig "
                              "(e.g. MetricsConfig(long_prompt_tokens=8192))")
        if not isinstance(options, InstanceOptions):
            raise ConfigError(f"options={bounded_repr(options)} is not allowed: expected an InstanceOptions")
        first = specs[0].cost_params
        for i, spec in enumerate(specs[1:], start=1):
            differ = [f for f in FRONT_END_FIELDS if getattr(spec.cost_params, f) != getattr(first, f)]
            if differ:  # e.g. a calibrated H100 beside a GPU on literature defaults (other front-end costs)
                raise ConfigError(
                    f"instances of one cluster share the API front end, so their CostParams must agree on "
                    f"{', '.join(FRONT_END_FIELDS)}; instance {i} ({spec.gpu.name}) has "
                    + ", ".join(f"{f}={getattr(spec.cost_params, f):.6g}" for f in differ)
                    + f" where instance 0 ({specs[0].gpu.name}) has "
                    + ", ".join(f"{f}={getattr(first, f):.6g}" for f in differ)
                    + " (a GPU's default cost parameters come from its calibration, if any: give every instance "
                    "the same values under `cost:`)")
        self.front_end = specs[0].cost_params
        self.recorder = Recorder(metrics, output_overhead_s=self.front_end.output_token_overhead_s,
                                 first_chunk_delay_tokens=self.front_end.first_chunk_delay_tokens)
        self.metrics = metrics
        self.instances = [Instance(spec, policy_factory(), self.recorder, i, options, seed)
                          for i, spec in enumerate(specs)]
        if router is None:
            router = RoundRobinPlacement()
        check_router(router)
        router.bind(len(self.instances), seed)
        self._seed = seed
        self.router = router
        self.disagg: DisaggRuntime | None = None
        self.prefill_router = None
        if disagg is not None:
            if not isinstance(disagg, DisaggSpec):
                raise ConfigError(f"disagg={bounded_repr(disagg)} is not allowed: expected a DisaggSpec or None")
            if router_delay_s:
                raise ConfigError(f"router_delay_s={bounded_repr(router_delay_s)} is not allowed with disaggregation: "
                                  "its routers see live state (give 0)")
            if shared_kv is not None:
                raise ConfigError("shared_kv and disagg cannot be combined (give one of them)")
            self.disagg = DisaggRuntime(disagg, self.instances)
            router.bind(len(self.disagg.decode_ids), seed)
            if prefill_router is None:
                prefill_router = RoundRobinPlacement()
            check_router(prefill_router)
            prefill_router.bind(max(1, len(self.disagg.prefill_ids)), seed)
            self.prefill_router = prefill_router
        elif prefill_router is not None:
            raise ConfigError("prefill_router needs disagg (prefill/decode roles)")
        self._step_end = [0.0] * len(self.instances)
        self.state_provider = StateProvider(router_delay_s)
        if shared_kv is not None and not isinstance(shared_kv, SharedKVSpec):
            raise ConfigError(f"shared_kv={bounded_repr(shared_kv)} is not allowed: expected a SharedKVSpec or None")
        self.shared_kv = SharedKVPool(shared_kv, self.instances) if shared_kv is not None else None
        for inst in self.instances:
            inst.shared_kv = self.shared_kv
        self.observer = observer
        if observer is not None:
            for inst in self.instances:
                inst.attach_observer(observer)
            if self.shared_kv is not None:
                pool = self.shared_kv
                for q in (*pool.net_out, *pool.net_in, pool.pool_read, pool.pool_write):
                    q.watch = LinkWatch(observer, -1)
            if self.disagg is not None:  # KV transfers: the prefill instance's send port, the decode's receive port
                for i in range(len(self.instances)):
                    self.disagg.send[i].watch = LinkWatch(observer, i)
                    self.disagg.recv[i].watch = LinkWatch(observer, i)
        self.routed_requests = np.zeros(len(self.instances), dtype=np.int64)
        #: requests placed by the caller (``apply(route_to=...)``, e.g. a Routing-v0 agent), not the router
        self.caller_routes = 0
        self.routed_prompt_tokens = np.zeros(len(self.instances), dtype=np.int64)
        self.progress = progress
        self.events = EventQueue()
        self._workload: Workload | None = None
        self._pending: tuple | None = None
        self._now_s = 0.0
        self._retention: list = []
        self._retention_pending: tuple | None = None
        self._prefetch_pending: tuple | None = None
        self._prefetch_watch = False
        self._until_s = math.inf  # the caller's stop time of the current run_until_decision
        self.watch: DecisionWatch | None = None

    def run(self, workload: Workload) -> SimulationResult:
        """Serve every request of ``workload``; returns records, summary and counters.

        A request reaches the router and scheduler ``CostParams.server_delay_s(prompt_tokens)``
        after its ``arrival_s`` (the API front end: HTTP, tokenisation, hand-off to the engine;
        one front end for the cluster); its record keeps the client's ``arrival_s``, so TTFT and
        E2E include that delay.

        The same event loop as :meth:`start` + :meth:`run_until_decision` / :meth:`apply`
        with no decision points watched: identical events in identical order.
        """
        self.start(workload)
        self._loop()
        return self.result()

    # ------------------------------------------------------------------ resumable event loop
    def start(self, workload: Workload, watch: DecisionWatch | None = None) -> None:
        """Prepare to serve ``workload`` step by step (see :meth:`run_until_decision`).

        Args:
            workload: the requests.
            watch: which decision points :meth:`run_until_decision` stops at (``None``: none,
                the loop runs to the end).

        Raises:
            RuntimeError: when this cluster was already started (a cluster serves one workload).
        """
        if self._workload is not None:
            raise RuntimeError("this Cluster already served a workload; build a new one per run")
        if workload.hash_block_tokens and len(workload.hashes):  # before any event: name the key the user set
            for inst in self.instances:
                bs = inst.spec.block_size_tokens
                if workload.hash_block_tokens % bs:
                    raise ConfigError(hash_block_mismatch(workload.hash_block_tokens, bs))
        self._workload = workload
        self.watch = watch
        n = len(workload)
        # parallel sampling: ids for children k >= 1, above every id of the workload, in arrival order
        self._fan_out = workload.has_parallel_sampling
        self._next_child_id = int(workload.request_id.max()) + 1 if self._fan_out else 0
        if self._fan_out:
            self.recorder.parent_ids = []
        instances = self.instances
        # when the engine sees each request (after the API front end), and in which order
        arrivals = workload.arrival_s + self.front_end.server_delay_s(workload.prompt_tokens)
        hiccups = front_end_hiccups_s(self.front_end, self._seed, n)
        if hiccups is not None:  # seeded API-server stalls (kvsched.envs.sim.step_noise)
            arrivals = arrivals + hiccups
        order = None
        if n > 1 and np.any(np.diff(arrivals) < 0):  # per-token delays can reorder arrivals
            order = np.argsort(arrivals, kind="stable")
            arrivals = arrivals[order]
        self._arrivals = arrivals
        self._order = order
        # (instance id, finished request, finish s) awaiting a retention decision, and
        # (instance id, arriving request, arrival s, "prefetch") awaiting a prefetch decision
        self._retention = []
        self._prefetch_watch = watch is not None and watch.prefetch
        self._prefetch_pending = None
        for inst in instances:  # the clairvoyant eviction reference reads the window's future uses
            pt = inst.kv.prefix_tiers
            if pt is not None and "clairvoyant" in pt.spec.eviction:
                pt.set_future(workload)
            if pt is not None and watch is not None and watch.residency:
                pt.enable_retention(self._retention, inst.instance_id)
        self._n = n
        self._next_idx = 0
        self._done_reported = 0
        self._check_pool = self.shared_kv is not None and instances[0].options.check_invariants
        # round-robin look-ahead only when the router (not a caller) places every arrival
        self._ahead = (getattr(self.router, "arrivals_until", None)
                       if len(instances) > 1 and self.shared_kv is None and self.disagg is None
                       and not (watch is not None and watch.route)
                       else None)
        # stretches may run through completions when nothing outside an instance looks at it
        # between its own events (no router reading instance state, no watched decisions)
        through = (watch is None and self.shared_kv is None and self.disagg is None
                   and (len(instances) == 1 or self._ahead is not None))
        for inst in instances:
            inst.stretch_through_finishes = through
        if n:
            self.events.push(float(arrivals[0]), ARRIVAL, None)

    @property
    def now_s(self) -> float:
        """Simulated time of the last event taken from the queue (s); 0 before the first."""
        return self._now_s

    @property
    def arrived(self) -> int:
        """Requests the engine has seen so far (arrivals processed)."""
        return self._next_idx

    @property
    def done(self) -> bool:
        """True when every event has been processed (the workload is served)."""
        return self._workload is not None and self._pending is None and not len(self.events)

    def run_until_decision(self, until_s: float = math.inf) -> DecisionPoint | None:
        """Advance the event loop to the next watched decision point.

        Args:
            until_s: also stop (kind ``"time"``) before the first event later than this
                simulated time (s), without taking it from the queue. No fast-forwarded stretch
                runs past it, so the instances' state there (blocks in use, queues) is the
                state stepping one by one has.

        Returns:
            The decision point, or ``None`` when the workload is served. At a ``"route"`` or
            ``"schedule"`` point the loop is suspended *before* the event's effect: call
            :meth:`apply` to carry it out (the caller first sets whatever its policy should
            decide there). At a ``"time"`` point nothing is suspended.

        Raises:
            RuntimeError: before :meth:`start`, or while a decision is pending.
        """
        if self._workload is None:
            raise RuntimeError("call Cluster.start(workload) first")
        if self._pending is not None:
            raise RuntimeError("a decision is pending: call Cluster.apply() first")
        return self._loop(until_s)

    def apply(self, route_to: int | None = None, prefill_to: int | None = None) -> None:
        """Carry out the pending decision point's event.

        Args:
            route_to: at a ``"route"`` point, the instance index that gets the request
                (``None``: ask the cluster's router, as :meth:`run` does). Must be ``None`` at a
                ``"schedule"`` point: the instance's policy decides inside its step. With
                prefill/decode roles it is the decode instance (a decode or mixed one).
            prefill_to: with roles, at a ``"route"`` point: the prefill instance's index,
                :data:`LOCAL_PREFILL` (prefill on the decode instance), or ``None`` (the cluster
                decides: :meth:`disagg_choice`). A remote prefill needs a ``decode`` target.

        Raises:
            RuntimeError: when no decision is pending.
            ValueError: ``route_to`` or ``prefill_to`` out of range or of the wrong role, or
                given at a ``"schedule"`` point.
        """
        if self._pending is None:
            raise RuntimeError("no decision is pending")
        t, kind, payload = self._pending
        if kind == ARRIVAL:
            n_inst = len(self.instances)
            if route_to is not None and (isinstance(route_to, bool) or not isinstance(route_to, (int, np.integer))
                                         or not 0 <= route_to < n_inst):
                raise ValueError(f"route_to={bounded_repr(route_to)} must be an instance index in [0, {n_inst})")
            rt = self.disagg
            if rt is None and prefill_to is not None:
                raise ValueError(f"prefill_to={bounded_repr(prefill_to)} needs prefill/decode roles (disagg)")
            if rt is not None:
                if route_to is not None and rt.roles[int(route_to)] == "prefill":
                    raise ValueError(f"route_to={bounded_repr(route_to)} is a prefill instance; expected one of the "
                                     f"decode or mixed instances {rt.decode_ids}")
                if prefill_to is not None and prefill_to != LOCAL_PREFILL:
                    if isinstance(prefill_to, bool) or not isinstance(prefill_to, (int, np.integer)) \
                            or int(prefill_to) not in rt.prefill_ids:
                        raise ValueError(f"prefill_to={bounded_repr(prefill_to)} must be a prefill instance "
                                         f"{rt.prefill_ids} or LOCAL_PREFILL (-1)")
                    target = route_to if route_to is not None else None
                    if target is not None and rt.roles[int(target)] != "decode":
                        raise ValueError(f"prefill_to={bounded_repr(prefill_to)}: a remote prefill needs a decode "
                                         f"instance as route_to (got mixed instance {int(target)})")
            self._pending = None
            if route_to is None:
                idx = self._route(payload, t)
            else:
                idx = int(route_to)
                self.caller_routes += 1
                self.routed_requests[idx] += 1
                self.routed_prompt_tokens[idx] += payload.prompt_tokens
                if self.observer is not None:
                    self.observer.on_route(RouteEvent(t, payload.rid, idx, "caller", payload.prompt_tokens))
            self._place(payload, idx, t, None if prefill_to is None else int(prefill_to))
        else:
            if route_to is not None:
                raise ValueError(f"route_to={bounded_repr(route_to)} is only allowed at a 'route' decision point")
            self._pending = None
            self._schedule(payload, t)

    def disagg_choice(self, st: RequestState, decode_idx: int, t: float) -> int:
        """The cluster's own prefill decision for ``st`` going to decode instance ``decode_idx``:
        a prefill instance's index (Dynamo's threshold said remote; the prefill router chose it)
        or :data:`LOCAL_PREFILL`. Calls the prefill router (its state advances)."""
        rt = self.disagg
        if rt is None or not rt.goes_remote(self.instances[decode_idx], st):
            return LOCAL_PREFILL
        return self._route_among(self.prefill_router, rt.prefill_ids, st, t, "prefill_router")

    def _place(self, st: RequestState, idx: int, t: float, prefill_to: int | None = None) -> None:
        inst = self.instances[idx]
        if st.req.n > 1:  # parallel sampling: every child goes where the parent was routed
            children = st.req.children(self._next_child_id)
            self._next_child_id += len(children) - 1
            wake = False
            for child in children:
                cst = RequestState(child, inst.bs, st.length_class)
                if inst.add_request(cst, t):
                    if not wake:  # one prefetch point for the children (one prompt)
                        self._prefetch_point(inst, cst, t)
                    wake = True
            if wake:
                self._wake(inst, t)
            return
        if inst.bs != self.instances[0].bs:  # heterogeneous block sizes: segments in its blocks
            st = RequestState(st.req, inst.bs, st.length_class)
        rt = self.disagg
        if rt is not None and prefill_to is None:
            prefill_to = self.disagg_choice(st, idx, t)
        if rt is not None and prefill_to is not None and prefill_to != LOCAL_PREFILL \
                and st.req.n == 1 and st.prompt_tokens > 1:
            p = self.instances[prefill_to]
            if rt.fits_prefill(p, st):
                st.instance_id = inst.instance_id
                reason = inst.reject_reason(st)
                if reason:  # the decode instance can never serve it: rejected there, as vLLM's would
                    inst._reject(st, reason)
                    return
                h = rt.start(st, inst, p)
                if rt.spec.transfer == "whole":  # prefill first, the decode instance gets it afterwards
                    if p.add_request(rt.prefill_copy(h), t):
                        self._wake(p, t)
                else:  # layerwise: the decode instance allocates first (its admission queues the prefill)
                    inst.waiting.append(st)
                    self._wake(inst, t)
                return
        if rt is not None:
            rt.counters.local_prefills += 1
        if inst.add_request(st, t):
            self._prefetch_point(inst, st, t)
            self._wake(inst, t)

    def _prefetch_point(self, inst: Instance, st: RequestState, t: float) -> None:
        """With ``DecisionWatch.prefetch``: queue a prefetch decision for ``st``, just queued on
        ``inst`` at ``t``, when part of its cached prefix lies only below the first listed tier."""
        if self._prefetch_watch:
            pt = inst.kv.prefix_tiers
            if pt is not None and pt.promotable(st, t):
                self._retention.append((inst.instance_id, st, t, "prefetch"))

    def _schedule(self, inst: Instance, t: float) -> None:
        if inst.busy:
            return
        ev = self.events
        n = self._n
        # the next arrival this instance can receive: with round-robin routing, the one its
        # turn comes at (others cannot change its batch); else the next one
        j = self._next_idx
        if self._ahead is not None and j < n:
            j += self._ahead(inst.instance_id, len(self.instances))
        horizon = float(self._arrivals[j]) if j < n else math.inf
        if self._until_s < horizon:
            # a "time" decision point lets the caller look at the instance (Knobs-v0 observes HBM
            # in use): a stretch running past it would show blocks of steps not yet started
            horizon = self._until_s
        rt = self.disagg
        if rt is not None and rt.spec.transfer == "whole" and rt.roles[inst.instance_id] == "decode":
            # a prefilled request joins this instance's queue when its prefill instance's step
            # ends: no stretch may run past the step containing the next such end
            for pid in rt.prefill_ids:
                if rt.live_prefills[pid]:
                    p = self.instances[pid]
                    h = self._step_end[pid] if p.busy else t
                    if h < horizon:
                        horizon = h
        end = inst.schedule(t, horizon)
        if end is not None:
            ev.push(end, STEP_END, inst)
            self._step_end[inst.instance_id] = end
        if inst.pending_events or (rt is not None and rt.wake):
            self._drain_events(inst, t)

    def _drain_events(self, inst: Instance, t: float) -> None:
        """Queue the copies and hand-offs ``inst`` started (its ``pending_events``)."""
        ev = self.events
        rt = self.disagg
        for when, what, st in inst.pending_events:
            if what == TRANSFER_EVENT:
                ev.push(when, TRANSFER_DONE, (inst, st))
            elif what == FETCH_EVENT:
                ev.push(when, TRANSFER_DONE, (inst, None))
            elif what == KV_LANDED_EVENT:
                ev.push(when, TRANSFER_DONE, (inst, st, KV_LANDED_EVENT))
            elif what == REMOTE_PREFILL_EVENT:  # layerwise: the decode side holds the blocks, prefill now
                assert rt is not None
                h = rt.landing[id(st)]
                p = h.p_inst
                if p.add_request(rt.prefill_copy(h), t):
                    self._wake(p, t)
        inst.pending_events.clear()
        if rt is not None and rt.wake:
            for p in rt.wake:
                self._wake(p, t)
            rt.wake.clear()

    def _handoffs(self, t: float) -> None:
        """Carry out the hand-offs of the prefill-phase copies that finished at ``t``."""
        rt = self.disagg
        assert rt is not None
        done = rt.prefilled
        rt.prefilled = []
        for h in done:
            rt.on_handoff(h, t)
            d = h.d_inst
            if rt.spec.transfer == "whole":
                d.waiting.append(h.dst)  # already checked by d.reject_reason at routing
                self._wake(d, t)
            elif d.pending_events:
                self._drain_events(d, t)
        if rt.wake:
            for p in rt.wake:
                self._wake(p, t)
            rt.wake.clear()

    def _loop(self, until_s: float = math.inf) -> DecisionPoint | None:
        """The event loop; returns at a watched decision point, at ``until_s`` or at the end."""
        self._until_s = until_s
        ev = self.events
        workload = self._workload
        assert workload is not None  # start() was called (run_until_decision checks it)
        n = self._n
        instances = self.instances
        rec = self.recorder
        arrivals = self._arrivals
        order = self._order
        any_inst = instances[0]
        check_pool = self._check_pool
        watch = self.watch
        route_watched = watch is not None and watch.route
        sched_inst = None if watch is None or watch.schedule_instance is None else instances[watch.schedule_instance]
        sched_filter = None if watch is None else watch.schedule_filter
        retention = self._retention
        # disaggregation moves blocks between instances: check every instance at every event (tests)
        check_all = self.disagg is not None and any_inst.options.check_invariants
        while len(ev):
            if retention:
                return self._retention_point()
            if until_s < math.inf and ev.peek_time() > until_s:
                return DecisionPoint("time", until_s, None, None)
            t, kind, payload = ev.pop()
            self._now_s = t
            if kind == STEP_END:
                inst = payload
                inst.complete_step(t)
                if check_pool and self.shared_kv is not None:
                    self.shared_kv.check()
                if self.disagg is not None and self.disagg.prefilled:
                    self._handoffs(t)
                self._wake(inst, t)
            elif kind == ARRIVAL:
                next_idx = self._next_idx
                req = workload.request(next_idx if order is None else int(order[next_idx]))
                next_idx += 1
                self._next_idx = next_idx
                if next_idx < n:
                    ev.push(float(arrivals[next_idx]), ARRIVAL, None)
                st = RequestState(req, any_inst.bs, rec.length_class(req.prompt_tokens))
                if route_watched:
                    self._pending = (t, ARRIVAL, st)
                    return DecisionPoint("route", t, None, st)
                self._place(st, self._route(st, t), t)
            elif kind == TRANSFER_DONE:
                inst, st = payload[0], payload[1]
                if len(payload) == 3:  # disaggregation: a KV transfer landed on decode instance `inst`
                    rt = self.disagg
                    assert rt is not None
                    rt.on_landed(st, t)
                    for p in rt.wake:  # the prefill instance freed the KV it held
                        self._wake(p, t)
                    rt.wake.clear()
                elif st is not None:  # None: a shared-tier fetch landed (nothing to free)
                    inst.complete_transfer(st, t)
                self._wake(inst, t)
            else:  # SCHEDULE
                inst = payload
                inst.schedule_pending = False
                if sched_inst is not None and inst is sched_inst and not inst.busy \
                        and (sched_filter is None or sched_filter(inst, t)):
                    self._pending = (t, SCHEDULE, inst)
                    return DecisionPoint("schedule", t, inst.instance_id, None)
                self._schedule(inst, t)
            if check_all:
                for inst in instances:
                    inst.check()
            if self.progress is not None and len(rec.rows) - self._done_reported >= 1000:
                self._done_reported = len(rec.rows)
                self.progress(self._done_reported)
        if retention:
            return self._retention_point()
        if self.progress is not None:
            self.progress(len(rec.rows))
        return None

    @property
    def arrivals_taken(self) -> int:
        """Arrivals the event loop has taken in so far (routed or pending a route)."""
        return self._next_idx

    def _retention_point(self) -> DecisionPoint:
        """The next finished request awaiting a retention decision, or arriving one awaiting a
        prefetch decision (taken off the queue)."""
        entry = self._retention.pop(0)
        inst_id, st = entry[0], entry[1]
        # HBM keeps due by now end before the caller looks or decides: a fast-forwarded stretch ran
        # no scheduling pass at the deadlines one-by-one stepping would have (the order they rejoin
        # the LRU in does not depend on when, :meth:`.kv_cache.BlockPool.expire_kept`)
        self.instances[inst_id].kv.hbm.expire_kept(self._now_s)
        if len(entry) == 4:
            self._retention_pending, self._prefetch_pending = None, (inst_id, st)
            return DecisionPoint("prefetch", self._now_s, inst_id, st)
        self._retention_pending, self._prefetch_pending = (inst_id, st), None
        return DecisionPoint("residency", self._now_s, inst_id, st)

    def prefetch(self) -> int:
        """Prefetch the cached prefix of the request of the last ``"prefetch"`` point into the
        first listed tier, now (:meth:`.prefix_offload.PrefixTiers.prefetch`); optional (an
        undecided request is not prefetched). Returns the segments copied.

        Raises:
            RuntimeError: no ``"prefetch"`` point was returned since the last call.
        """
        _, st, pt = self._take_pending("prefetch")
        return pt.prefetch(st, self._now_s)

    def _take_pending(self, kind: str):
        """``(instance id, request, its PrefixTiers)`` of the pending ``kind`` point (``"prefetch"``
        or ``"residency"``), now cleared; the tiers' clock set to now.

        Raises:
            RuntimeError: no such point is pending.
        """
        attr = "_prefetch_pending" if kind == "prefetch" else "_retention_pending"
        pending = getattr(self, attr)
        if pending is None:
            raise RuntimeError(f"no {kind} decision point is pending")
        setattr(self, attr, None)
        inst_id, st = pending
        pt = self.instances[inst_id].kv.prefix_tiers
        assert pt is not None
        pt.now_s = self._now_s
        return inst_id, st, pt

    def retain(self, decision) -> None:
        """Apply a retention decision (:class:`.retention.RetentionDecision`) for the request of
        the last ``"residency"`` point, now; optional (an undecided request keeps ``default``).

        Raises:
            RuntimeError: no ``"residency"`` point was returned since the last call.
        """
        inst_id, st, pt = self._take_pending("residency")
        hook = None if self.observer is None else getattr(self.observer, "on_retention", None)
        before = tuple(pt.session_blocks(st)) if hook is not None else ()
        pt.retain(st, decision.kind, decision.keep_s, self._now_s, decision.hbm)
        if hook is not None:
            hook(RetentionEvent(inst_id, self._now_s, st.rid, decision.label, before, tuple(pt.session_blocks(st))))

    def _route(self, st: RequestState, t: float) -> int:
        """Index of the instance an arriving request goes to (the router's choice, checked)."""
        instances = self.instances
        if self.disagg is not None:
            idx = self._route_among(self.router, self.disagg.decode_ids, st, t, "router")
        elif len(instances) == 1:
            idx = 0
        else:
            view = self.state_provider.view(instances, t, self.shared_kv)
            idx = self.router.route(RouterTable(view, st, t, self.shared_kv))
            if isinstance(idx, bool) or not isinstance(idx, (int, np.integer)) or not 0 <= idx < len(instances):
                raise ConfigError(f"router {bounded_repr(getattr(self.router, 'name', self.router))} returned "
                                  f"{bounded_repr(idx)} for "
                                  f"request {st.rid}; expected an instance row 0..{len(instances) - 1}")
            idx = int(idx)
            if self.observer is not None:
                self.observer.on_route(RouteEvent(t, st.rid, idx, "router", st.prompt_tokens))
        self.routed_requests[idx] += 1
        self.routed_prompt_tokens[idx] += st.prompt_tokens
        return idx

    def _route_among(self, router, ids: Sequence[int], st: RequestState, t: float, who: str) -> int:
        """The instance ``router`` picks among ``ids`` (its table's rows are those instances, live)."""
        if len(ids) == 1:
            return ids[0]
        subset = [self.instances[i] for i in ids]
        row = router.route(RouterTable(InstanceStateView(subset, t), st, t))
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < len(ids):
            raise ConfigError(f"{who} {bounded_repr(getattr(router, 'name', router))} returned {bounded_repr(row)} "
                              f"for request {st.rid}; expected a row 0..{len(ids) - 1}")
        idx = ids[int(row)]
        if self.observer is not None:
            self.observer.on_route(RouteEvent(t, st.rid, idx, who, st.prompt_tokens))
        return idx

    def routing_summary(self) -> dict:
        """Per-instance load share of the run (JSON-ready).

        ``router``: the router's name, or ``"caller (apply route_to)"`` when the caller placed every
        request (a Routing-v0 agent); ``requests`` / ``prompt_tokens``: routed to each instance; ``load_share``: each
        instance's fraction of the requests; ``load_imbalance``: max over mean of the requests per
        instance (1.0 = perfectly even, N = everything on one of N instances). With prefill/decode
        roles they count the decode and mixed instances only (where the router places requests).
        """
        n = self.routed_requests
        if self.disagg is not None:  # the router places requests on the decode and mixed instances only
            n = n[self.disagg.decode_ids]
        total = int(n.sum())
        mean = total / len(n) if len(n) else 0.0
        return {
            "router": ("caller (apply route_to)" if total and self.caller_routes == total
                       else getattr(self.router, "name", type(self.router).__name__)),
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

    def _link_bytes(self) -> dict[str, int]:
        """Bytes moved per link queue name, summed over instances (every name any instance has,
        in tier order)."""
        names: list[str] = []
        for inst in self.instances:
            names += [n for n in inst.links if n not in names]
        return {name: sum(i.links[name].bytes_moved for i in self.instances if name in i.links) for name in names}

    def prefix_tier_summary(self, summary: dict) -> dict:
        """``summary["prefix_tiers"]``: per lower tier caching prefixes, its counters summed over
        the instances (:meth:`.prefix_offload.PrefixTiers.stats`) and its hit rate: hit tokens over
        the prompt tokens of the finished requests (the denominator of ``prefix.hit_rate``, whose
        hits are HBM's)."""
        tiers: dict[str, dict] = {}
        recompute = 0
        decisions: dict[str, int] = {}  # the decision counters of retention / prefetch control
        for inst in self.instances:
            pt = inst.kv.prefix_tiers
            if pt is None:
                continue
            st = pt.stats()
            recompute += st["recompute_chosen"]
            for key in ("retention_decisions", "hbm_kept_blocks", "hbm_evict_first_blocks", "prefetch_decisions"):
                if key in st:
                    decisions[key] = decisions.get(key, 0) + st[key]
            for name, counters in st["tiers"].items():
                acc = tiers.setdefault(name, {})
                for k, v in counters.items():
                    acc[k] = v if isinstance(v, str) else acc.get(k, 0) + v
        prompt = summary["classes"]["all"]["prefix"]["prompt_tokens"]
        for acc in tiers.values():
            acc["hit_rate"] = acc["hit_tokens"] / prompt if prompt else None
        out: dict = {"recompute_chosen": recompute, "tiers": tiers}
        out.update(decisions)
        return out

    def result(self) -> SimulationResult:
        """Records, summary and counters of the served workload (after the loop ended).

        Raises:
            RuntimeError: when requests neither finished nor were rejected (a stuck run or a
                loop that has not reached its end).
        """
        workload = self._workload
        if workload is None:
            raise RuntimeError("call Cluster.start(workload) first")
        rec = self.recorder
        records = rec.records_frame()
        if len(records) != workload.num_sequences:
            stuck = [(i.instance_id, len(i.waiting), len(i.running), len(i.swapped)) for i in self.instances]
            raise RuntimeError(f"{workload.num_sequences - len(records)} requests neither finished nor were "
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
        if any(i.kv.prefix_tiers is not None for i in self.instances):
            summary["prefix_tiers"] = self.prefix_tier_summary(summary)
        if "parent_id" in records.columns:
            summary["parallel_sampling"] = parallel_sampling_summary(records)
        stats: dict = {
            "events": self.events.popped,
            "steps": sum(i.steps for i in self.instances),
            "fast_forward_stretches": sum(i.stretches for i in self.instances),
            "fast_forward_steps": sum(i.stretch_steps for i in self.instances),
            "folded_steps": sum(i.folded_steps for i in self.instances),
            "preemptions": sum(i.preemptions for i in self.instances),
            "admission_preemptions": sum(i.admission_preemptions for i in self.instances),
            "mean_batch_size": (sum(i.sum_batch for i in self.instances)
                                / max(1, sum(i.steps for i in self.instances))),
            "link_bytes": self._link_bytes(),
            "pnm_migrations": sum(i.pnm_migrations for i in self.instances),
            "evicted_prefix_segments": sum(i.hbm.evicted_segments for i in self.instances),
            "routed_requests": [int(x) for x in self.routed_requests],
        }
        if self.shared_kv is not None:
            stats["shared_kv"] = self.shared_kv.stats()
        if self.disagg is not None:
            summary["disaggregation"] = self.disagg.stats(self._now_s)
            stats["link_bytes"]["kv_transfer"] = self.disagg.counters.bytes_moved
        return SimulationResult(records=records, summary=summary, occupancy=occupancy, stats=stats)



def _latency_stats(x: np.ndarray) -> dict:
    """``count``, ``mean``, ``p50``, ``p90``, ``p99`` of latencies ``x`` (s; None when empty)."""
    if not len(x):
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    q = np.quantile(x, [0.5, 0.9, 0.99])
    return {"count": int(len(x)), "mean": float(x.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2])}


def parallel_sampling_summary(records: pd.DataFrame) -> dict:
    """Per-parent latencies of a run with parallel sampling (``records`` with a ``parent_id`` column).

    The rest of the summary is per sequence (each child is a record, as vLLM's engine core sees it).
    Here a user request (parent) is what vLLM's API answers (``ParentRequest.get_outputs`` in
    ``vllm/v1/engine/parallel_sampling.py``): its first token is the first token any child
    streams (the earliest child ``first_token_s``; with ``RequestOutputKind.FINAL_ONLY`` vLLM
    returns nothing before every child finished), and it finishes when its last child does
    (``finished = not self.child_requests``), so its E2E is the latest child ``finish_s`` minus
    the arrival. A parent with a rejected child counts as rejected.

    Returns:
        ``{"parents", "sequences", "finished_parents", "rejected_parents", "ttft_s", "e2e_s"}``,
        the latencies (s) as ``count/mean/p50/p90/p99`` over the finished parents.
    """
    g = records.groupby("parent_id", sort=True)
    arrival = g["arrival_s"].min().to_numpy(dtype=np.float64)
    first = g["first_token_s"].min().to_numpy(dtype=np.float64)
    finish = g["finish_s"].max().to_numpy(dtype=np.float64)
    rejected = g["status"].agg(lambda s: bool((s != "finished").any())).to_numpy(dtype=bool)
    ok = ~rejected
    return {
        "parents": int(len(arrival)),
        "sequences": int(len(records)),
        "finished_parents": int(ok.sum()),
        "rejected_parents": int(rejected.sum()),
        "ttft_s": _latency_stats(first[ok] - arrival[ok]),
        "e2e_s": _latency_stats(finish[ok] - arrival[ok]),
    }
