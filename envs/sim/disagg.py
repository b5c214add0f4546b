"""Prefill/decode disaggregation: instance roles, the KV hand-off over a link, decode-side admission.

Roles (:data:`ROLES`), one per instance of a :class:`~.cluster.Cluster`:

- ``prefill``: runs prompts only. A request prefilled remotely runs here as a *prefill-phase*
  copy with ``max_tokens = 1`` (vLLM's disaggregated prefill: the proxy sends the prompt to the
  KV producer with ``max_tokens=1``, ``examples/online_serving/disaggregated_serving/
  disagg_proxy_demo.py`` and ``.../disaggregated_prefill.sh``; vLLM docs "Disaggregated
  Prefilling"). The token it produces is **not** the client's: the prefill instance's output is
  discarded by the proxy and nothing is recorded for it. When its step ends the request leaves
  the prefill instance's batch but its KV blocks stay held until the decode side has read them
  (vLLM V1 ``NixlConnectorScheduler.request_finished`` returns ``delay_free_blocks=True``; the
  blocks are freed when the consumer's read completes, ``vllm/distributed/kv_transfer/
  kv_connector/v1/nixl_connector.py``).
- ``decode``: receives the KV and continues. In vLLM V1 the decode instance (KV consumer) gets
  the same prompt with ``kv_transfer_params``; its connector reports the remote tokens as
  externally computed (``get_num_new_matched_tokens``), the scheduler allocates their blocks
  (``allocate_slots``) and parks the request (``WAITING_FOR_REMOTE_KVS``) until the read lands;
  a request always computes at least one token, so the first step after landing computes the
  last prompt token and **emits the first output token the client sees**. Here: the decode
  request is admitted with ``prompt_tokens - 1`` tokens of KV received and ``ready_s`` = the
  landing time; its first step (one token) produces the first token.
  A decode instance also prefills locally when the disaggregated decision says so (Dynamo's
  decode workers do: conditional disaggregation).
- ``mixed``: an ordinary instance that prefills and decodes its own requests (never a prefill
  instance for another one).

**TTFT** of a remotely prefilled request = front-end delay + prefill queue + prefill +
(decode-side admission wait) + KV transfer + the first decode step (the record's
``first_token_s`` is the decode instance's first token; ``first_scheduled_s`` is when the
prefill instance first scheduled it; ``prefix_hit_tokens`` are the prefill instance's hits).

**Which requests go remote** (Dynamo's disaggregated router, ``DisaggregatedRouter.
prefill_remote`` in ``ai-dynamo/dynamo`` ``lib/llm/src/disagg_router.rs``, config
``max_local_prefill_length``, default 1000): the decode instance is chosen first (the cluster's
router over the decode and mixed instances); the prompt is prefilled remotely when its length
minus the tokens the chosen decode instance caches exceeds ``max_local_prefill_tokens`` and a
prefill instance exists, else locally on the decode instance. ``max_local_prefill_tokens = 0``
(the default) sends every request with a prefill instance remote: vLLM's proxy behaviour. Mixed
decode targets always prefill locally. Requests with ``n > 1`` (parallel sampling) prefill
locally. The prefill instance is chosen by a second router over the prefill instances
(``prefill_router``: round-robin, least-loaded, or KV-aware such as cache-affinity / dynamo).

**KV transfer** (``transfer``):

- ``whole`` (vLLM V1 NIXL, pull): the prefill instance finishes the prompt; the request then
  joins the decode instance's waiting queue; when that instance's scheduler admits it (in its
  policy's order, under its seat and block limits) it allocates the blocks and the read starts;
  the bytes are ``(prompt_tokens - 1 - decode-side cached tokens) x KV bytes per token``.
- ``layerwise`` (Dynamo's original vLLM disaggregation: the decode worker allocates the blocks
  first, then queues a remote prefill that writes into them layer by layer; LMCache /
  P2pNcclConnector ``save_kv_layer``): the request joins the decode instance's waiting queue at
  arrival; when it is admitted there (blocks allocated) the prefill-phase copy is queued on the
  prefill instance; each layer's KV of the last prefill step may leave as soon as that layer is
  computed, so the transfer starts at ``last step start + step / L`` (L layers) at the earliest
  and lands at ``max(start + t_link(bytes), step end + t_link(bytes / L))`` [inferred from the
  mechanism: the earlier chunks' KV is treated as produced during the last step, which is
  conservative for chunked prompts].

Links: ``t = latency + bytes / (bandwidth x ports)``; ``ports = min(tp_prefill, tp_decode)``
(each TP rank moves its shard over its own NIC/NVLink port in parallel [inferred]). Each instance
has one send port queue and one receive port queue; a transfer occupies the prefill instance's
send port and the decode instance's receive port for its whole duration, in FIFO order of
reservation (**serialised, not bandwidth-shared**: a transfer starts when both ports are free.
Serialising gives the last transfer of a burst the same finish time as fair sharing and those
ahead of it earlier finishes, but a short transfer queued behind a long prompt's waits for all of
it (head-of-line blocking that fair sharing would avoid); NIXL posts one RDMA read per request,
and a known end time per transfer keeps the event loop exact [inferred]).

**No room on the decode side** (``on_no_room``), when the decode instance cannot allocate the
received blocks at its admission attempt:

- ``wait`` (vLLM V1 and Dynamo): the request stays in the waiting queue, head of line, and the
  prefill instance keeps holding its blocks (vLLM frees them only after the read or the
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, which is not modelled).
- ``recompute``: the remote KV is dropped (the prefill instance frees it at once) and the decode
  instance prefills the prompt itself when it can (vLLM's ``kv_load_failure_policy="recompute"``,
  which recomputes locally when a KV load fails).
- ``reject``: the request is rejected with reason ``decode_kv_no_room`` (vLLM's
  ``kv_load_failure_policy="fail"``: the request errors out).

Received KV joins the decode instance's prefix cache at its next step (the prompt segments are
hashed there as vLLM's decode-side ``KVCacheManager`` caches computed blocks) unless
``decode_prefix_cache`` is false; decode-side cached prefix segments are not transferred.

Block conservation: a remotely prefilled request holds blocks on the prefill instance (its
``sending`` list) from its prefill until the transfer lands, and on the decode instance from its
admission there; every instance's pool conserves its blocks at every event
(:func:`~.invariants.check_instance` counts the ``sending`` holders).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .errors import ConfigError, UnknownPresetError, bounded_repr, require
from .hardware import LINK_PRESETS, LinkSpec, get_link
from .kv_cache import LinkQueue
from .request import REJECTED, RUNNING, RequestState

ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
TRANSFER_MODES: tuple[str, ...] = ("whole", "layerwise")
NO_ROOM_POLICIES: tuple[str, ...] = ("wait", "recompute", "reject")
#: Instance event kind: queue a prefill-phase copy on its prefill instance (layerwise mode).
REMOTE_PREFILL_EVENT = "remote_prefill"
#: Instance event kind: a KV transfer lands on the decode instance.
KV_LANDED_EVENT = "kv_landed"

DISAGG_LINK_PRESETS: dict[str, LinkSpec] = {
    lk.name: lk
    for lk in (
        # REFERENCE §5.2: NVLink4 (H100/H200) ~350-400 GB/s p2p achievable; §1.4: ~5-10 µs NVLink
        LinkSpec("nvlink4", 375e9, 5e-6),
        # REFERENCE §5.2: NVLink5 (B200) ~700+ GB/s achievable
        LinkSpec("nvlink5", 700e9, 5e-6),
        # REFERENCE §5.2: InfiniBand NDR 400G per NIC ~45 GB/s achievable; §1.4: ~10-30 µs IB
        LinkSpec("ib_ndr_400g", 45e9, 20e-6),
        # RoCE v2 at 400 GbE: the same line rate as NDR [inferred], a higher per-operation latency [inferred]
        LinkSpec("roce_400g", 45e9, 30e-6),
        # InfiniBand HDR 200G: half of NDR's achievable rate [inferred]
        LinkSpec("ib_hdr_200g", 22.5e9, 20e-6),
    )
}
"""KV-transfer links between instances (plus the host links of :data:`~.hardware.LINK_PRESETS`)."""


def get_disagg_link(name: str) -> LinkSpec:
    """A KV-transfer link preset: one of :data:`DISAGG_LINK_PRESETS` or :data:`~.hardware.LINK_PRESETS`.

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    if isinstance(name, str) and name.lower() in DISAGG_LINK_PRESETS:
        return DISAGG_LINK_PRESETS[name.lower()]
    try:
        return get_link(name)
    except UnknownPresetError:
        raise UnknownPresetError(f"unknown KV-transfer link {bounded_repr(name)}; known: "
                                 f"{', '.join([*DISAGG_LINK_PRESETS, *LINK_PRESETS])}") from None


@dataclass(frozen=True)
class DisaggSpec:
    """How a cluster disaggregates prefill and decode (see the module docstring).

    Attributes:
        roles: one of :data:`ROLES` per instance, in instance order.
        link: the KV-transfer link between instances (default ``ib_ndr_400g``).
        transfer: ``"whole"`` or ``"layerwise"``.
        on_no_room: ``"wait"``, ``"recompute"`` or ``"reject"``.
        decode_prefix_cache: received prompt segments join the decode instance's prefix cache.
        max_local_prefill_tokens: prefill locally when the prompt tokens the decode instance does
            not cache are at most this (tokens, >= 0; Dynamo's ``max_local_prefill_length``);
            0: every request goes remote when a prefill instance exists.

    Raises:
        ConfigError: an unknown role, mode or policy; no decode-capable instance; a link that is
            not a LinkSpec; a negative or non-integer threshold.
    """

    roles: tuple[str, ...]
    link: LinkSpec = DISAGG_LINK_PRESETS["ib_ndr_400g"]
    transfer: str = "whole"
    on_no_room: str = "wait"
    decode_prefix_cache: bool = True
    max_local_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        require(isinstance(self.roles, tuple) and len(self.roles) > 0, "DisaggSpec.roles", self.roles,
                "a non-empty tuple of roles, one per instance")
        bad = next((r for r in self.roles if r not in ROLES), None)
        require(bad is None, "DisaggSpec.roles", bad, f"one of {', '.join(ROLES)}")
        require(any(r != "prefill" for r in self.roles), "DisaggSpec.roles", self.roles,
                "at least one decode or mixed instance (someone must decode)")
        require(isinstance(self.link, LinkSpec), "DisaggSpec.link", self.link,
                "a LinkSpec (or, in a scenario, a link preset name or an inline mapping)")
        require(self.transfer in TRANSFER_MODES, "DisaggSpec.transfer", self.transfer,
                f"one of {', '.join(TRANSFER_MODES)}")
        require(self.on_no_room in NO_ROOM_POLICIES, "DisaggSpec.on_no_room", self.on_no_room,
                f"one of {', '.join(NO_ROOM_POLICIES)}")
        require(isinstance(self.decode_prefix_cache, bool), "DisaggSpec.decode_prefix_cache",
                self.decode_prefix_cache, "true or false")
        m = self.max_local_prefill_tokens
        require(isinstance(m, int) and not isinstance(m, bool) and m >= 0, "DisaggSpec.max_local_prefill_tokens",
                m, "an integer number of tokens >= 0")


@dataclass(slots=True)
class Handoff:
    """One remotely prefilled request in flight (prefill-phase copy ``pst``, decode request ``dst``)."""

    dst: RequestState
    d_inst: Any
    p_inst: Any
    pst: RequestState | None = None
    prefilled_s: float = math.nan  # when the prefill-phase copy finished (its step end)
    step_start_s: float = math.nan  # start of its last prefill step
    admitted: bool = False  # the decode instance allocated the blocks
    kv_tokens: int = 0  # tokens whose KV is moved
    land_s: float = math.nan
    p_freed: bool = False
    waited: bool = False  # the decode instance had no room for it at least once


@dataclass
class DisaggStats:
    """Counters of one run (JSON-ready via :meth:`DisaggRuntime.stats`)."""

    remote_prefills: int = 0
    local_prefills: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    transfer_s: list = field(default_factory=list)
    decode_wait_s: list = field(default_factory=list)
    waits_for_room: int = 0
    recomputed: int = 0
    rejected: int = 0
    preempted_receiving: int = 0
    decode_hit_tokens: int = 0


class DisaggRuntime:
    """The disaggregation state of one cluster run: roles, port queues, requests in flight.

    Args:
        spec: the disaggregation configuration.
        instances: the cluster's instances (same model and KV dtype on every one).

    Raises:
        ConfigError: ``roles`` not one per instance, or instances that cannot exchange KV.
    """

    def __init__(self, spec: DisaggSpec, instances: Sequence) -> None:
        if len(spec.roles) != len(instances):
            raise ConfigError(f"disagg.roles has {len(spec.roles)} roles for {len(instances)} instances; "
                              "give one role per instance")
        first = instances[0].spec
        for inst in instances:
            s = inst.spec
            if (s.model, s.kv_dtype_bytes) != (first.model, first.kv_dtype_bytes):
                raise ConfigError(
                    f"disagg: instance {inst.instance_id} ({s.model.name}, kv {s.kv_dtype_bytes} B) cannot take KV "
                    f"from instance 0 ({first.model.name}, kv {first.kv_dtype_bytes} B): every instance must serve "
                    "the same model with the same KV dtype")
        self.spec = spec
        self.instances = list(instances)
        self.roles = spec.roles
        self.prefill_ids = [i for i, r in enumerate(spec.roles) if r == "prefill"]
        self.decode_ids = [i for i, r in enumerate(spec.roles) if r != "prefill"]
        self.send = [LinkQueue(f"kv_send_{i}") for i in range(len(instances))]
        self.recv = [LinkQueue(f"kv_recv_{i}") for i in range(len(instances))]
        self.by_dst: dict[int, Handoff] = {}  # id(dst) -> hand-off, until the decode side admitted it
        self.by_pst: dict[int, Handoff] = {}  # id(pst) -> hand-off, until its prefill finished
        self.landing: dict[int, Handoff] = {}  # id(dst) -> hand-off, admitted, until its KV landed
        #: prefill-phase copies still queued or running, per instance (fast-forward horizons)
        self.live_prefills = [0] * len(instances)
        #: hand-offs whose prefill finished in the step just completed (the cluster places them)
        self.prefilled: list[Handoff] = []
        self.counters = DisaggStats()
        #: prefill instances whose blocks were freed outside their own events (the cluster wakes them)
        self.wake: list = []
        self.kv_bytes_per_token = [float(i.spec.kv_bytes_per_block) / i.bs for i in instances]
        for inst in instances:
            inst.remote_kv = self

    # ----------------------------------------------------------------------- decisions
    def goes_remote(self, d_inst, st: RequestState) -> bool:
        """Dynamo's decision: prefill remotely when the decode instance's uncached prompt tokens
        exceed ``max_local_prefill_tokens`` (only for a ``decode`` target, ``n == 1``, and when a
        prefill instance exists)."""
        if not self.prefill_ids or self.roles[d_inst.instance_id] != "decode" or st.req.n > 1 or st.prompt_tokens < 2:
            return False
        cached = d_inst.kv.cached_prefix_tokens(st) if d_inst.spec.enable_prefix_caching else 0
        return st.prompt_tokens - cached > self.spec.max_local_prefill_tokens

    def fits_prefill(self, p_inst, st: RequestState) -> bool:
        """Whether ``p_inst`` can ever run the prompt (``prompt + 1`` within its model length, its KV
        within its HBM); else the request prefills locally."""
        return (st.prompt_tokens + 1 <= p_inst.spec.model_len_limit
                and -(-st.prompt_tokens // p_inst.bs) <= p_inst.kv.hbm.capacity_blocks)

    def start(self, st: RequestState, d_inst, p_inst) -> Handoff:
        """Register a remotely prefilled request: ``st`` is the decode instance's request."""
        h = Handoff(st, d_inst, p_inst)
        self.by_dst[id(st)] = h
        self.counters.remote_prefills += 1
        return h

    def prefill_copy(self, h: Handoff) -> RequestState:
        """The prefill-phase copy of ``h``'s request (``max_tokens = 1``) for its prefill instance."""
        p = h.p_inst
        pst = RequestState(h.dst.req, p.bs, h.dst.length_class)
        pst.output_tokens = 1
        h.pst = pst
        self.by_pst[id(pst)] = h
        self.live_prefills[p.instance_id] += 1
        return pst

    # ------------------------------------------------------------ the prefill instance
    def is_prefill_copy(self, st: RequestState) -> bool:
        """Whether ``st`` is a prefill-phase copy (its finish is a hand-off, not a record)."""
        return id(st) in self.by_pst

    def on_prefilled(self, inst, st: RequestState, step_start_s: float) -> None:
        """``st`` (a prefill-phase copy on ``inst``) produced its token: it leaves the batch, keeps
        its blocks (``inst.sending``) until its KV has been read."""
        h = self.by_pst.pop(id(st))
        self.live_prefills[inst.instance_id] -= 1
        inst.sending.append(st)
        h.prefilled_s = st.last_token_s
        h.step_start_s = step_start_s
        self.prefilled.append(h)

    def free_prefill(self, h: Handoff) -> None:
        """Release the prefill instance's blocks of ``h`` (its KV was read, or dropped)."""
        if h.p_freed or h.pst is None or math.isnan(h.prefilled_s):
            return
        p = h.p_inst
        p.sending.remove(h.pst)
        p.kv.free(h.pst)
        h.p_freed = True
        if p not in self.wake:
            self.wake.append(p)

    # -------------------------------------------------------------- the decode instance
    def try_admit(self, inst, st: RequestState, now: float) -> bool | None:
        """Admission hook of the decode instance (:meth:`.admission.Admitter.try_admit`).

        Returns ``None`` when ``st`` is not waiting for remote KV (admit it the usual way),
        ``True`` when it was admitted to receive (or rejected: it leaves the queue), ``False``
        when it must wait (no room, ``on_no_room="wait"``).
        """
        h = self.by_dst.get(id(st))
        if h is None:
            return None
        c = self.counters
        kv = inst.kv
        kv_tokens = st.prompt_tokens - 1
        hit, max_seg = kv.cached_prefix(st, st.prompt_tokens)
        seg = st.seg_tokens
        hit_tokens = hit * seg if hit else 0
        hit_hashes = st.hashes[:hit]
        hit_blocks = hit * (seg // kv.bs) if hit else 0
        need = kv.blocks_for(kv_tokens) - hit_blocks
        if need > kv.hbm.available_blocks - (kv.evictable_hit_blocks(hit_hashes) if hit else 0):
            policy = self.spec.on_no_room
            if policy == "wait":
                if not h.waited:  # requests that waited (not attempts: those depend on fast-forwarding)
                    h.waited = True
                    c.waits_for_room += 1
                return False
            del self.by_dst[id(st)]
            self.free_prefill(h)  # the remote KV is dropped: the prefill instance frees it now
            if policy == "recompute":
                c.recomputed += 1
                return None  # a plain request now: prefilled here when it can be
            c.rejected += 1
            inst._reject(st, "decode_kv_no_room")
            return True
        del self.by_dst[id(st)]
        if hit:  # decode-side hits shorten the transfer; the record's hits are the prefill instance's
            counted = st.prefix_hit_tokens, st.self_hit_tokens
            kv.acquire_prefix(st, hit_hashes)
            st.prefix_hit_tokens, st.self_hit_tokens = counted
            c.decode_hit_tokens += hit_tokens
        ok = kv.allocate(need)
        assert ok, "disagg: decode allocation failed after the availability check"
        inst.admitter.take_residency(st, hit_hashes, hit_blocks, need, hit, kv_tokens, now)
        if not self.spec.decode_prefix_cache:
            st.next_seg = st.n_cacheable_segments  # received segments stay private
        h.admitted = True
        h.kv_tokens = kv_tokens - hit_tokens
        self.landing[id(st)] = h
        if self.spec.transfer == "whole":
            self._reserve(h, now)
        else:  # layerwise: the prefill starts now, into these blocks
            st.ready_s = math.inf
            inst.pending_events.append((now, REMOTE_PREFILL_EVENT, st))
        return True

    def on_handoff(self, h: Handoff, now: float) -> None:
        """Called by the cluster after the prefill-phase copy of ``h`` finished (at ``now``)."""
        d = h.dst
        d.first_scheduled_s = h.pst.first_scheduled_s if h.pst is not None else d.first_scheduled_s
        d.prefix_hit_tokens = h.pst.prefix_hit_tokens if h.pst is not None else d.prefix_hit_tokens
        if self.spec.transfer == "layerwise":
            if self.landing.get(id(d)) is not h:  # preempted on the decode side while the prefill ran
                self.free_prefill(h)
                return
            self._reserve(h, now)

    def _reserve(self, h: Handoff, now: float) -> None:
        """Reserve the ports for ``h``'s KV and set the decode request's landing time."""
        p, d = h.p_inst, h.d_inst
        link = self.spec.link
        nbytes = int(round(h.kv_tokens * self.kv_bytes_per_token[d.instance_id]))
        ports = min(p.spec.tp, d.spec.tp)
        dur = float(link.transfer_time_s(nbytes)) if nbytes else 0.0
        if nbytes and ports > 1:
            dur = link.latency_s + nbytes / (link.bytes_per_s * ports)
        out, inn = self.send[p.instance_id], self.recv[d.instance_id]
        ready = now
        tail = now
        if self.spec.transfer == "layerwise" and nbytes:
            layers = d.spec.model.n_layers
            step = h.prefilled_s - h.step_start_s
            ready = h.step_start_s + step / layers
            tail = h.prefilled_s + link.latency_s + nbytes / layers / (link.bytes_per_s * ports)
        start = max(ready, out.busy_until_s, inn.busy_until_s)
        out.reserve(start, dur, nbytes, "kv_transfer", h.dst.rid)
        inn.reserve(start, dur, nbytes, "kv_transfer", h.dst.rid)
        land = max(start + dur, tail, now)
        h.land_s = land
        h.dst.ready_s = land
        c = self.counters
        c.transfers += 1
        c.bytes_moved += nbytes
        c.transfer_s.append(land - max(ready, h.prefilled_s if self.spec.transfer == "whole" else ready))
        d.pending_events.append((land, KV_LANDED_EVENT, h.dst))

    def on_landed(self, st: RequestState, now: float):
        """The KV of decode request ``st`` landed at ``now``: the prefill instance frees it.
        Returns that prefill instance, or ``None`` for a stale event (``st`` was preempted)."""
        h = self.landing.get(id(st))
        if h is None or h.land_s != now:
            return None
        del self.landing[id(st)]
        self.free_prefill(h)  # the cluster wakes the prefill instance (``wake``)
        self.counters.decode_wait_s.append(now - h.prefilled_s)
        return h.p_inst

    def on_preempted(self, st: RequestState, now: float) -> None:
        """``st`` is preempted on its instance: when it was receiving KV, the transfer is abandoned
        (the prefill instance frees its copy now, or when its prefill ends) and ``st`` recomputes
        like any preempted request."""
        h = self.landing.pop(id(st), None)
        if h is None:
            return
        self.counters.preempted_receiving += 1
        st.ready_s = now
        self.free_prefill(h)  # no-op while the prefill still runs (on_handoff frees it then)

    # ----------------------------------------------------------------------- reporting
    def stats(self, makespan_s: float) -> dict[str, Any]:
        """``summary["disaggregation"]``: counts, bytes, transfer times (s) and port utilisation
        (busy seconds over the run's makespan, per instance port that moved bytes)."""
        c = self.counters
        ts = sorted(c.transfer_s)
        hs = sorted(c.decode_wait_s)

        def q(xs: list, p: float) -> float | None:
            if not xs:
                return None
            return float(xs[min(len(xs) - 1, int(p * len(xs)))])

        util = {}
        for qs in (self.send, self.recv):
            for lq in qs:
                if lq.bytes_moved:
                    util[lq.name] = lq.busy_s / makespan_s if makespan_s > 0 else None
        busy = [v for v in util.values() if v is not None]
        return {
            "roles": list(self.roles),
            "link": {"name": self.spec.link.name, "bytes_per_s": self.spec.link.bytes_per_s,
                     "latency_s": self.spec.link.latency_s},
            "transfer": self.spec.transfer, "on_no_room": self.spec.on_no_room,
            "remote_prefills": c.remote_prefills, "local_prefills": c.local_prefills,
            "transfers": c.transfers, "bytes_moved": c.bytes_moved,
            "transfer_s": {"mean": (sum(ts) / len(ts)) if ts else None, "p50": q(ts, 0.5), "p99": q(ts, 0.99)},
            # from the end of the prefill to the landing: decode-side admission wait + port queue + transfer
            "handoff_s": {"mean": (sum(hs) / len(hs)) if hs else None, "p50": q(hs, 0.5), "p99": q(hs, 0.99)},
            "waits_for_room": c.waits_for_room, "recomputed": c.recomputed, "rejected": c.rejected,
            "preempted_receiving": c.preempted_receiving, "decode_hit_tokens": c.decode_hit_tokens,
            "port_utilisation": util,
            "link_utilisation_max": max(busy) if busy else 0.0,
        }


# ---------------------------------------------------------------------------- scenario form
CLUSTER_KEYS: tuple[str, ...] = ("prefill", "decode", "mixed", "link", "transfer", "on_no_room",
                                 "decode_prefix_cache", "max_local_prefill_tokens", "prefill_router",
                                 "prefill_router_params")
ROLE_KEYS: tuple[str, ...] = ("count", "instance")


@dataclass(frozen=True)
class ClusterLayout:
    """A scenario's ``cluster:`` section, resolved: instances per role and the spec overrides.

    Attributes:
        counts: ``role -> instances`` (every role of :data:`ROLES`, >= 0).
        overrides: ``role -> InstanceSpec fields`` merged over the scenario's ``instance``.
        spec: the :class:`DisaggSpec` fields other than ``roles`` (``link`` resolved).
        prefill_router: router name for the prefill side; ``prefill_router_params`` its parameters.
    """

    counts: Mapping[str, int]
    overrides: Mapping[str, Mapping[str, Any]]
    link: LinkSpec
    transfer: str
    on_no_room: str
    decode_prefix_cache: bool
    max_local_prefill_tokens: int
    prefill_router: str
    prefill_router_params: Mapping[str, Any]

    @property
    def roles(self) -> tuple[str, ...]:
        """One role per instance: the prefill instances first, then decode, then mixed."""
        return tuple(r for r in ROLES for _ in range(self.counts[r]))

    def disagg_spec(self) -> DisaggSpec:
        """The :class:`DisaggSpec` of this layout."""
        return DisaggSpec(self.roles, self.link, self.transfer, self.on_no_room, self.decode_prefix_cache,
                          self.max_local_prefill_tokens)

    def with_counts(self, counts: Mapping[str, int], source: str = "cluster") -> "ClusterLayout":
        """A copy with other instance counts (e.g. from an ``xPyD`` label)."""
        from dataclasses import replace

        new = dict(self.counts)
        new.update(counts)
        _check_counts(new, source)
        return replace(self, counts=new)


MAX_ROLE_INSTANCES = 9999
"""Most instances of one role in a ``cluster:`` section or an ``xPyD`` label (a bound on memory
and run time: every instance holds its own pools and state) [kvsched choice]."""


def _check_counts(counts: Mapping[str, int], source: str) -> None:
    for r in ROLES:
        n = counts.get(r, 0)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ROLE_INSTANCES:
            raise ConfigError(f"{source}.{r}.count={bounded_repr(n)} must be an integer in [0, {MAX_ROLE_INSTANCES}]")
    if counts.get("decode", 0) + counts.get("mixed", 0) < 1:
        raise ConfigError(f"{source}: needs at least one decode or mixed instance (got prefill "
                          f"{counts.get('prefill', 0)}, decode {counts.get('decode', 0)}, "
                          f"mixed {counts.get('mixed', 0)})")


def cluster_layout_from_dict(d: Any, source: str = "cluster") -> ClusterLayout:
    """Parse a scenario's ``cluster:`` mapping (see docs/disaggregation.md).

    ``{prefill: {count, instance: {...}}, decode: {...}, mixed: {...}, link: <preset or inline>,
    transfer, on_no_room, decode_prefix_cache, max_local_prefill_tokens, prefill_router,
    prefill_router_params}``; a role left out has count 0.

    Raises:
        ConfigError: not a mapping, unknown keys, bad counts, an unknown link, mode or policy.
    """
    from .spec_io import _preset_or_inline

    if not isinstance(d, Mapping):
        raise ConfigError(f"{source} must be a mapping with role sections (prefill, decode, mixed) and link "
                          f"options, got {type(d).__name__}")
    unknown = [k for k in d if k not in CLUSTER_KEYS]
    if unknown:
        raise ConfigError(f"{source}: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(CLUSTER_KEYS)}")
    counts: dict[str, int] = {}
    overrides: dict[str, dict] = {}
    for role in ROLES:
        sec = d.get(role)
        if sec is None:
            counts[role] = 0
            overrides[role] = {}
            continue
        if not isinstance(sec, Mapping):
            raise ConfigError(f"{source}.{role} must be a mapping {{count, instance}}, got {type(sec).__name__}")
        bad = [k for k in sec if k not in ROLE_KEYS]
        if bad:
            raise ConfigError(f"{source}.{role}: unknown key {bounded_repr(bad[0])}; allowed keys: "
                              f"{', '.join(ROLE_KEYS)}")
        if "count" not in sec:
            raise ConfigError(f"{source}.{role}: missing key 'count' (instances of this role)")
        counts[role] = sec["count"]
        inst = sec.get("instance")
        inst = {} if inst is None else inst  # (an empty list, 0 or "" is a wrong type, not "no fields")
        if not isinstance(inst, Mapping):
            raise ConfigError(f"{source}.{role}.instance must be a mapping of InstanceSpec fields, "
                              f"got {type(inst).__name__}")
        overrides[role] = dict(inst)
    _check_counts(counts, source)
    link = (_preset_or_inline(d["link"], get_disagg_link, LinkSpec, f"{source}.link") if "link" in d
            else DISAGG_LINK_PRESETS["ib_ndr_400g"])
    router = d.get("prefill_router", "least-loaded")
    if not isinstance(router, str):
        raise ConfigError(f"{source}.prefill_router={bounded_repr(router)} must be a router name")
    rparams = d.get("prefill_router_params")
    rparams = {} if rparams is None else rparams
    if not isinstance(rparams, Mapping):
        raise ConfigError(f"{source}.prefill_router_params={bounded_repr(rparams)} must be a mapping of the "
                          "router's parameters")
    layout = ClusterLayout(counts, overrides, link, d.get("transfer", "whole"), d.get("on_no_room", "wait"),
                           d.get("decode_prefix_cache", True), d.get("max_local_prefill_tokens", 0),
                           router, dict(rparams))
    try:
        DisaggSpec(("decode",), layout.link, layout.transfer, layout.on_no_room, layout.decode_prefix_cache,
                   layout.max_local_prefill_tokens)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return layout


_LABEL_PART = {"P": "prefill", "D": "decode", "M": "mixed"}


def parse_layout_label(label: str) -> dict[str, int]:
    """Instance counts from an ``xPyD`` label: ``2P2D``, ``1P3D``, ``4M``, ``1P2D1M``
    (case-insensitive; a role left out has count 0).

    Raises:
        ConfigError: not a sequence of ``<count><P|D|M>`` parts, a role given twice, or no
            decode or mixed instance.
    """
    import re

    if not isinstance(label, str) or not re.fullmatch(r"(\d+[PpDdMm])+", label.strip()):
        raise ConfigError(f"cluster layout {bounded_repr(label)} is not allowed: expected <n>P<n>D and/or <n>M, "
                          "e.g. 2P2D, 1P3D, 4M")
    counts: dict[str, int] = {r: 0 for r in ROLES}
    seen: set[str] = set()
    for n, r in re.findall(r"(\d+)([PpDdMm])", label.strip()):
        role = _LABEL_PART[r.upper()]
        if role in seen:
            raise ConfigError(f"cluster layout {bounded_repr(label)}: role {r.upper()} given twice")
        seen.add(role)
        if len(n.lstrip("0")) > len(str(MAX_ROLE_INSTANCES)):
            raise ConfigError(f"cluster layout {bounded_repr(label, 60)}: {role} count {bounded_repr(n, 20)} is not "
                              f"allowed: expected an integer in [0, {MAX_ROLE_INSTANCES}]")
        counts[role] = int(n)
    _check_counts(counts, f"cluster layout {bounded_repr(label)}")
    return counts
