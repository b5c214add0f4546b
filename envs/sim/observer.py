"""The simulator's event hook: what an attached observer is told while a run goes on.

The core knows no output format. A caller that wants to look at the schedule (a Chrome/Perfetto
timeline, :mod:`kvsched.runner.timeline`; a test) gives :class:`~.cluster.Cluster` an object with
the methods of :class:`SimObserver`; the cluster hands it to its instances, their preemptors and
their link queues. Without one (the default) every hook is a single ``is not None`` test: no
event object is built and nothing is allocated per step.

What is reported, and when (all times are simulated seconds of the engine's clock, the event
loop's; the records' ``arrival_s`` / ``first_token_s`` / ``finish_s`` are the client's):

- :class:`RouteEvent` -- an arrival placed on an instance (only with two or more instances);
- :class:`StepEvent` -- an engine step (or a fast-forwarded stretch of steps) when it is planned,
  with its batch; a planned step always runs to its end (nothing cancels a step in flight);
- :class:`PreemptionEvent` -- a running request preempted, with the mode it got and why;
- :class:`TransferEvent` -- a KV copy queued on a link (:class:`~.kv_cache.LinkQueue`), with the
  time it starts (after the copies queued before it) and ends;
- :class:`RetentionEvent` -- a retention decision applied (:meth:`.cluster.Cluster.retain`;
  optional: told only to an observer with an ``on_retention`` method).

An observer must not change the simulation (it reads the events it is given, nothing else), so
a run with an observer gives the same results, byte for byte, as one without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, Union

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

#: ``BatchEntry.phase`` values: a prompt chunk, a chunk recomputing a preempted request's
#: prompt and generated tokens (after it emitted tokens), one decode token.
PHASES: tuple[str, ...] = ("prefill", "recompute", "decode")

#: ``TransferEvent.kind`` values (where each copy comes from):
#: ``swap_out`` / ``swap_in`` -- a preempted request's blocks to a lower tier and back
#: (:mod:`.preemption`); ``prefix_write`` / ``prefix_load`` -- cached prefixes written below HBM
#: and loaded back (:mod:`.prefix_offload`); ``pnm_migration`` -- KV moved to the PNM tier
#: (:mod:`.pnm_migration`); ``shared_write`` / ``shared_fetch`` -- the cluster KV tier
#: (:mod:`.shared_kv`); ``prefix_prefetch`` -- a cached prefix copied up to the first listed tier
#: before its request is admitted (:meth:`.prefix_offload.PrefixTiers.prefetch`).
TRANSFER_KINDS: tuple[str, ...] = ("swap_out", "swap_in", "prefix_write", "prefix_load", "pnm_migration",
                                   "shared_write", "shared_fetch", "kv_transfer", "prefix_prefetch")


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One request in a step's batch.

    Attributes:
        request_id: the request (a child sequence's own id with parallel sampling).
        tokens: tokens it computes in the step (in the stretch's first step for a stretch).
        phase: one of :data:`PHASES`.
    """

    request_id: int
    tokens: int
    phase: str


@dataclass(frozen=True, slots=True)
class StepEvent:
    """A planned engine step, or a fast-forwarded stretch of steps (:mod:`.fast_forward`).

    Attributes:
        instance_id: the instance.
        start_s: when the step starts (s; later than the time it was planned when it waits for a
            copy to land).
        ends_s: end time of each step (s): one value for a single step, ``K`` for a stretch.
            Read-only (the simulator's own array).
        batch: the first step's batch, in batch order. Every later step of a stretch decodes one
            token of each member still running.
        member_steps: for a stretch whose members leave it as they finish, the steps each batch
            member runs (``batch`` order); ``None`` when every member runs every step.
        folded: the stretch's first step is the single step that completed its prefills (only
            that step computes more than one token per request).
    """

    instance_id: int
    start_s: float
    ends_s: Union[Sequence[float], "np.ndarray"]
    batch: tuple[BatchEntry, ...]
    member_steps: tuple[int, ...] | None = None
    folded: bool = False


@dataclass(frozen=True, slots=True)
class PreemptionEvent:
    """A running request preempted.

    Attributes:
        instance_id: the instance.
        time_s: when (s).
        victim_id: the preempted request.
        mode: what it got: ``"recompute"`` (KV dropped), a lower tier's preemption mode
            (``"swap"``, ``"offload"``, an extra tier's; its blocks copied there), ``"migrate"``
            (moved to the PNM tier), or ``"cancel_load"`` (preempted while its swap-in copy was in
            flight: back to swapped, nothing copied).
        cause: ``"blocks"`` (a running request short of KV blocks: ``for_request_id``),
            ``"admission"`` (admission preemption for the blocked waiting head), ``"head_seats"``
            / ``"head_blocks"`` (the policy's head preemption, blocked for a seat or for blocks),
            ``"pnm_full"`` (the PNM pool cannot hold its next token).
        for_request_id: the request the room was made for (-1 when not one request's).
        tokens: KV tokens the victim had computed.
        blocks: KV blocks it held (HBM, or PNM for a PNM resident).
    """

    instance_id: int
    time_s: float
    victim_id: int
    mode: str
    cause: str
    for_request_id: int
    tokens: int
    blocks: int


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """A KV copy on one link.

    Attributes:
        instance_id: the instance whose link it is (-1: a link of the cluster KV tier).
        link: the link queue's name (``stats["link_bytes"]`` keys, e.g. ``dram_write``).
        kind: one of :data:`TRANSFER_KINDS`.
        request_id: the request whose KV moves (-1 when the copy is not one request's, e.g. a
            cached prefix written back on eviction).
        start_s, end_s: when the copy occupies the link (s).
        n_bytes: bytes moved (whole instance, all TP ranks).
    """

    instance_id: int
    link: str
    kind: str
    request_id: int
    start_s: float
    end_s: float
    n_bytes: int


@dataclass(frozen=True, slots=True)
class RouteEvent:
    """An arrival placed on an instance.

    Attributes:
        time_s: when the engine saw the request (s; after the API front end's delay).
        request_id: the request (the parent with parallel sampling: its children go with it).
        instance_id: where it went.
        by: ``"router"`` (the cluster's router) or ``"caller"`` (``Cluster.apply(route_to=...)``,
            e.g. a Routing-v0 agent).
        prompt_tokens: its prompt length.
    """

    time_s: float
    request_id: int
    instance_id: int
    by: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RetentionEvent:
    """A retention decision for a finished request's conversation (:mod:`.retention`).

    Attributes:
        instance_id: the instance whose lower tiers it applies to.
        time_s: when (s).
        request_id: the finished request.
        decision: ``default``, ``drop``, ``demote`` or ``keep <s>s``.
        blocks_before, blocks_after: blocks its conversation held in each listed tier before and
            after the decision (top down).
    """

    instance_id: int
    time_s: float
    request_id: int
    decision: str
    blocks_before: tuple[int, ...]
    blocks_after: tuple[int, ...]


class SimObserver(Protocol):
    """What an observer implements (every method is called synchronously, in event order)."""

    def on_step(self, event: StepEvent) -> None: ...

    def on_preemption(self, event: PreemptionEvent) -> None: ...

    def on_transfer(self, event: TransferEvent) -> None: ...

    def on_route(self, event: RouteEvent) -> None: ...


class LinkWatch:
    """Binds an observer to one link queue's owner (what :class:`~.kv_cache.LinkQueue` calls).

    Args:
        observer: the observer.
        instance_id: the instance owning the link (-1 for a cluster link).
    """

    __slots__ = ("observer", "instance_id")

    def __init__(self, observer: SimObserver, instance_id: int) -> None:
        self.observer = observer
        self.instance_id = instance_id

    def __call__(self, link: str, kind: str, request_id: int, start_s: float, end_s: float, n_bytes: int) -> None:
        self.observer.on_transfer(TransferEvent(self.instance_id, link, kind, request_id, start_s, end_s, n_bytes))
