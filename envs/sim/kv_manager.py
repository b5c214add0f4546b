"""The KV manager of one instance: block residency over its tiers, the prefix cache, the links.

In the spirit of vLLM V1's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): the
scheduler asks it for a request's cached prefix (``get_computed_blocks`` there,
:meth:`KVManager.cached_prefix` here), allocates all-or-nothing (``allocate_slots``;
:meth:`KVManager.allocate`), and frees a request's blocks (``free``; :meth:`KVManager.free`,
tail first as vLLM V1 does with one LRU free queue). Below HBM it moves blocks between tiers
(:meth:`KVManager.swap_out`, :meth:`KVManager.swap_in`) over the links of
:mod:`kvsched.envs.sim.tiers`, each a FIFO :class:`~.kv_cache.LinkQueue`.

The manager owns one :class:`~.kv_cache.BlockPool` per tier of ``spec.tiers`` (a
:class:`KVTier`); the instance reads no pool internals. Requests keep their own holdings
(``shared`` prefix segments and ``private_blocks`` in HBM, ``lower_blocks`` in ``lower_tier``,
``pnm_blocks``), which :mod:`kvsched.envs.sim.invariants` checks against the pools.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .hardware import LinkSpec
from .kv_cache import BlockPool, LinkQueue
from .prefix_offload import PrefixTiers
from .request import RequestState
from .tiers import TierSpec, tier_path

if TYPE_CHECKING:  # pragma: no cover
    from .cost_model import CostModel
    from .instance_spec import InstanceSpec

_USED = attrgetter("used_blocks")


class KVTier:
    """One tier at run time: its spec, its block pool and its link queues.

    Attributes:
        spec: the :class:`~.tiers.TierSpec`.
        index: position in the instance's tier list (HBM is 0); the ``tier`` code of
            :class:`~.features.FeatureTable` rows.
        name: ``spec.name``.
        pool: the tier's :class:`~.kv_cache.BlockPool`.
        write_q, read_q: queues of the links to and from the parent tier (None for HBM).
        path: the tiers a copy from HBM to this one lands in, top down (HBM excluded; empty for HBM).
    """

    __slots__ = ("spec", "index", "name", "pool", "write_q", "read_q", "write_link", "read_link", "path")

    def __init__(self, spec: TierSpec, index: int, pool: BlockPool) -> None:
        self.spec = spec
        self.index = index
        self.name = spec.name
        self.pool = pool
        self.write_q: LinkQueue | None = None
        self.read_q: LinkQueue | None = None
        self.write_link = spec.write_link
        self.read_link = spec.read_link
        self.path: list[KVTier] = []

    def write(self, ready_s: float, duration_s: float, n_bytes: int, kind: str = "", request_id: int = -1) -> float:
        """Queue a copy into this tier on its write link; returns when it lands (s). ``kind`` and
        ``request_id`` label it for an observer (:meth:`~.kv_cache.LinkQueue.reserve`)."""
        assert self.write_q is not None, "HBM has no link to a tier above it"
        return self.write_q.reserve(ready_s, duration_s, n_bytes, kind, request_id)[1]

    def read(self, ready_s: float, duration_s: float, n_bytes: int, kind: str = "", request_id: int = -1) -> float:
        """Queue a copy out of this tier on its read link; returns when it lands (s). ``kind`` and
        ``request_id`` label it for an observer (:meth:`~.kv_cache.LinkQueue.reserve`)."""
        assert self.read_q is not None, "HBM has no link to a tier above it"
        return self.read_q.reserve(ready_s, duration_s, n_bytes, kind, request_id)[1]

    def links(self) -> tuple[LinkSpec, LinkSpec]:
        """``(write_link, read_link)`` of a tier below HBM."""
        assert self.write_link is not None and self.read_link is not None, "HBM has no link to a tier above it"
        return self.write_link, self.read_link


class KVManager:
    """Block residency of one instance over ``spec.tiers``.

    Args:
        spec: the instance spec (tiers, block size, prefix caching, ``cache_decode_blocks``).
        cost: the instance's cost model (transfer times per link, per TP rank).

    Attributes:
        tiers: the :class:`KVTier` list, in ``spec.tiers`` order.
        by_name: tier name -> :class:`KVTier`.
        hbm, pnm: the HBM and PNM pools (PNM has capacity 0 without a PNM device).
        links: link-queue name -> :class:`~.kv_cache.LinkQueue`, in tier order (the keys of a
            run's ``stats["link_bytes"]``).
        tier_codes: tier name -> index (``""`` -> -1), for feature tables.
        block_bytes: KV bytes of one block, whole instance (all TP ranks).
        publish: called ``publish(key, n_blocks, creator_id, now_s)`` when a prefix segment is
            registered in HBM (the cluster KV tier's write-through), or None.
    """

    def __init__(self, spec: InstanceSpec, cost: CostModel) -> None:
        self.spec = spec
        self.cost = cost
        self.bs = spec.block_size_tokens
        self.block_bytes = int(round(spec.kv_bytes_per_block))
        self.links: dict[str, LinkQueue] = {}
        self.tiers: list[KVTier] = []
        for i, (tspec, blocks) in enumerate(zip(spec.tiers, spec.tier_capacity_blocks)):
            if i == 0:
                pool = BlockPool(tspec.name, blocks, spec.enable_prefix_caching,
                                 single_free_queue=spec.cache_decode_blocks)
            else:
                pool = BlockPool(tspec.name, blocks)
            tier = KVTier(tspec, i, pool)
            if i:
                tier.write_q = self._queue(tspec.write_queue)
                tier.read_q = self._queue(tspec.read_queue)
            self.tiers.append(tier)
        for tier in self.tiers:
            tier.path = [self.tiers[j] for j in tier_path(spec.tiers, tier.index)]
        self.by_name = {t.name: t for t in self.tiers}
        self.tier_codes = {t.name: t.index for t in self.tiers}
        self.tier_codes[""] = -1
        self.hbm = self.tiers[0].pool
        # kvsched <= 0.1 freed head first only without cache_decode_blocks (with it: tail first)
        self._head_first = spec.kv_free_order == "head_first" and not spec.cache_decode_blocks
        self.pnm = self.by_name["pnm"].pool
        self._pools = [t.pool for t in self.tiers]
        #: blocks of the given cached segments nobody references (``BlockPool.evictable_blocks_of``)
        self.evictable_hit_blocks = self.hbm.evictable_blocks_of  # type: ignore[method-assign]
        #: all-or-nothing HBM allocation (``BlockPool.allocate`` of HBM; see :meth:`allocate`)
        self.allocate = self.hbm.allocate  # type: ignore[method-assign]  # bound once: no extra call per step
        self.publish: Callable[[int, int, int, float], None] | None = None
        #: lower tiers caching prefixes (:mod:`.prefix_offload`), None without ``spec.prefix_offload``
        self.prefix_tiers: PrefixTiers | None = None
        #: whether HBM evictions have side effects -- written back below, or fenced behind pending
        #: writes (``fence_pending_writes``) -- so a fast-forward stretch never evicts
        self.writes_back = False
        if spec.prefix_offload is not None and spec.enable_prefix_caching:
            self.prefix_tiers = PrefixTiers(spec.prefix_offload, self)
            if spec.prefix_offload.write_policy == "write_back":
                self.hbm.on_evict = self.prefix_tiers.on_hbm_evict
                self.writes_back = True
            elif spec.prefix_offload.write_policy == "write_through_selective":
                self.hbm.on_evict = self.prefix_tiers.forget_uses
            elif spec.prefix_offload.fence_pending_writes:
                self.hbm.on_evict = self.prefix_tiers.fence_evicted
                self.writes_back = True
        modes = {t.spec.preemption_mode: t.index for t in self.tiers if t.spec.preemption_mode}
        swap = [t for t in self.tiers if t.spec.holds_swapped]
        #: preemption mode -> the tiers it tries in order (its own, then the later swap tiers)
        self._targets = {m: [t for t in swap if t.index >= i] for m, i in modes.items()}

    def _queue(self, name: str) -> LinkQueue:
        q = self.links.get(name)
        if q is None:
            q = self.links[name] = LinkQueue(name)
        return q

    # ------------------------------------------------------------------------ occupancy
    def used_blocks(self) -> tuple[int, ...]:
        """Blocks in use per tier (``tiers`` order)."""
        return tuple(map(_USED, self._pools))

    def capacity_blocks(self) -> tuple[int, ...]:
        """Capacity in blocks per tier (``tiers`` order)."""
        return tuple(t.pool.capacity_blocks for t in self.tiers)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` KV tokens: ``ceil(tokens / block_size)``."""
        return -(-tokens // self.bs)

    # ----------------------------------------------------------------- HBM prefix cache
    @property
    def stretch_evicts_nothing(self) -> bool:
        """Whether a fast-forward stretch, which allocates every step's blocks up front, must take
        free blocks only: HBM evictions have side effects at their own step's time
        (:attr:`writes_back`), or kept segments' order changes when a keep expires
        (``BlockPool.kept_blocks``), so evicting up front would differ from stepping."""
        return self.writes_back or self.hbm.kept_blocks > 0

    def cached_prefix(self, st: RequestState, total_tokens: int) -> tuple[int, int]:
        """``(hit, max_seg)``: leading prefix segments of ``st`` cached in HBM, and how many it may
        use (every segment fully inside ``total_tokens - 1``: at least one token is computed, as
        vLLM's ``get_computed_blocks`` leaves the last token to compute)."""
        if not (st.n_cacheable_segments and self.hbm.prefix_caching):
            return 0, 0
        max_seg = min(st.n_cacheable_segments, (total_tokens - 1) // st.seg_tokens)
        return self.hbm.cached_prefix_segments(st.hashes, max_seg), max_seg

    def cached_prefix_tokens(self, st: RequestState) -> int:
        """Tokens of ``st``'s prompt (and generated tokens) a prefix-cache lookup would hit in HBM
        if it were admitted now: :meth:`cached_prefix`'s segments over all its tokens, times the
        segment size (what :meth:`~.admission.Admitter.try_admit` takes as cached)."""
        hit, _ = self.cached_prefix(st, st.prompt_tokens + st.generated)
        return hit * st.seg_tokens

    def evictable_hit_blocks(self, hashes) -> int:
        """Blocks of the cached segments ``hashes`` nobody references: evictable now, yet no room
        for the request that hits them (it pins them)."""
        return self.hbm.evictable_blocks_of(hashes)

    def acquire_prefix(self, st: RequestState, hashes) -> None:
        """Reference the cached segments ``hashes`` for ``st`` and count its hit tokens.

        Reuse across requests counts once, at the first admission (``prefix_hit_tokens``); what a
        preempted request finds again is its own work restored (``self_hit_tokens``).
        """
        hbm = self.hbm
        first_admission = st.admissions == 0
        seg = st.seg_tokens
        for h in hashes:
            creator = hbm.segment_creator(h)
            hbm.acquire_segment(h)
            if first_admission and creator != st.rid:
                st.prefix_hit_tokens += seg
            else:
                st.self_hit_tokens += seg
        if self.prefix_tiers is not None and hashes:
            self.prefix_tiers.on_hbm_hit(st, hashes, seg // self.bs, hbm.segment_creator)

    def allocate(self, n_blocks: int) -> bool:
        """Take ``n_blocks`` HBM blocks, all or nothing (evicting LRU cached segments if needed)."""
        return self.hbm.allocate(n_blocks)

    def register_segments(self, st: RequestState, now: float) -> None:
        """Turn ``st``'s newly completed prompt segments into cached prefix segments (vLLM caches
        each full block once computed); a segment already cached by another request stays a
        private copy. Each new segment is published to the cluster KV tier when there is one."""
        if st.next_seg >= st.n_cacheable_segments:  # nothing (more) to cache; seg_tokens may be 0
            return
        stop = min(st.n_cacheable_segments, st.computed // st.seg_tokens)  # segments now complete
        if st.next_seg >= stop:
            return
        seg_blocks = st.seg_tokens // self.bs
        new = self.hbm.register_segments(st.hashes[st.next_seg:stop], seg_blocks, st.rid, st.private_blocks)
        st.next_seg = stop
        if new:
            st.private_blocks -= seg_blocks * len(new)
            st.shared.extend(new)
            st.shared_blocks += seg_blocks * len(new)
            if self.publish is not None:  # write-through to the cluster KV tier
                for h in new:
                    self.publish(h, seg_blocks, st.rid, now)
            if self.prefix_tiers is not None:  # the instance's own lower tiers
                self.prefix_tiers.on_computed(st, new, seg_blocks, now)

    def register_scheduled_segments(self, st: RequestState, tokens: int, now: float) -> None:
        """:meth:`register_segments` for the segments ``st`` completes once the ``tokens`` (>= 0)
        scheduled for it in the step being composed are computed: vLLM V1 caches blocks when
        ``KVCacheManager.allocate_slots`` (``vllm/v1/core/kv_cache_manager.py``) allocates them
        (``cache_blocks(request, num_computed + num_new_tokens)``), before the forward pass.
        Used for the children of a parallel-sampling request only (:mod:`.admission`): kvsched
        caches other requests' segments when their step ends. The step's own end then finds
        nothing more to cache for these tokens."""
        computed = st.computed
        st.computed = computed + tokens
        try:
            self.register_segments(st, now)
        finally:
            st.computed = computed

    def free(self, st: RequestState) -> None:
        """Release every HBM block ``st`` holds.

        As vLLM V1 (``KVCacheManager.free`` -> ``BlockPool.free_blocks`` of the reversed block
        list) a request's blocks are freed tail first (``spec.kv_free_order`` "tail_first", the
        default): with the single free queue (``cache_decode_blocks``) its private (decode /
        partial) blocks age oldest; its prefix segments enter the LRU last segment first, so its
        root segment, the one a follow-up sharing the prompt needs first, is evicted last.
        "head_first" (kvsched <= 0.1 without ``cache_decode_blocks``, for reproducing results
        computed with it) releases the segments head first and then the private blocks.
        """
        hbm = self.hbm
        if self._head_first:
            hbm.release_segments(st.shared)
            if st.private_blocks:
                hbm.release_private(st.private_blocks)
        else:
            if st.private_blocks:
                hbm.release_private(st.private_blocks)
            hbm.release_segments(reversed(st.shared))
        st.shared = []
        st.shared_blocks = 0
        st.private_blocks = 0

    def unreferenced_blocks(self, st: RequestState, seg_refs: dict[int, int]) -> int:
        """HBM blocks of the prefix segments ``st`` holds the last reference to, as if it were
        released now after the releases already counted in ``seg_refs`` (segment -> references
        left; updated with ``st``'s). Nothing is released."""
        return self.hbm.unreferenced_blocks(st.shared, seg_refs)

    def freed_by_release(self, st: RequestState) -> int:
        """HBM blocks that releasing ``st`` alone would free (private + segments only it holds)."""
        return st.private_blocks + self.hbm.sole_holder_blocks(st.shared)

    def block_limit_protecting(self, protect, wanted: int) -> int:
        """HBM blocks an allocation may take without evicting a segment of ``protect`` (a blocked
        waiting request's cached prefix); ``available_blocks`` when nothing is protected."""
        hbm = self.hbm
        if not protect:
            return hbm.available_blocks
        return hbm.blocks_before_evicting(set(protect), wanted)

    # ---------------------------------------------------------------------- lower tiers
    def swap_tiers(self, mode: str) -> list[KVTier]:
        """The tiers a preemption in ``mode`` tries, in order (empty for recompute / migrate)."""
        return self._targets.get(mode, [])

    def swap_out(self, st: RequestState, n_blocks: int, mode: str, now: float) -> tuple[KVTier | None, float]:
        """Copy ``st``'s ``n_blocks`` HBM blocks to the first tier of ``mode`` with room (vLLM V0
        swap; swap falls back to NVMe and later swap tiers). Its HBM blocks are released either way.

        The copy crosses the write link of every tier on the path (HBM -> DRAM over PCIe, then
        DRAM -> NVMe), each queued FIFO; the first hop is synchronous (the step waits for it).

        Returns:
            ``(tier, first_hop_end_s)``: the tier that now holds the blocks (``st.ready_s`` is when
            the last hop lands), or ``(None, now)`` when no tier took them (recompute).
        """
        target = None
        if self.prefix_tiers is not None:
            self.prefix_tiers.now_s = now  # a swap may evict (and demote) cached prefixes
        if n_blocks:
            for tier in self.swap_tiers(mode):
                if tier.pool.capacity_blocks and tier.pool.allocate(n_blocks):
                    target = tier
                    break
        self.free(st)
        if target is None:
            return None, now
        nbytes = n_blocks * self.block_bytes
        transfer = self.cost.transfer_time_s
        first_end = now
        ready = now
        for k, hop in enumerate(target.path):
            ready = hop.write(ready, transfer(n_blocks, hop.links()[0]), nbytes, "swap_out", st.rid)
            if k == 0:
                first_end = ready
        st.ready_s = ready
        add_tier_bytes(st, "hbm_to_" + target.name, nbytes)
        st.lower_tier = target.name
        st.lower_blocks = n_blocks
        st.tier = target.name
        return target, first_end

    def swap_in(self, st: RequestState, now: float) -> float:
        """Copy a swapped request's blocks back to HBM (already allocated there) over the read
        links of its tier's path, bottom up; returns when the copy lands (s)."""
        tier = self.by_name[st.lower_tier]
        n_blocks = st.lower_blocks
        nbytes = n_blocks * self.block_bytes
        ready = now if now > st.ready_s else st.ready_s  # the swap-out copy must have landed
        transfer = self.cost.transfer_time_s
        for hop in reversed(tier.path):
            ready = hop.read(ready, transfer(n_blocks, hop.links()[1]), nbytes, "swap_in", st.rid)
        add_tier_bytes(st, tier.name + "_to_hbm", nbytes)
        return ready

    def release_lower(self, st: RequestState) -> None:
        """Free the lower-tier copy of ``st`` (its swap-in landed)."""
        self.by_name[st.lower_tier].pool.release_private(st.lower_blocks)
        st.lower_blocks = 0
        st.lower_tier = ""

    def round_trip_costs(self, blocks: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds a swap to each lower tier and back would cost requests holding ``blocks`` HBM
        blocks, keyed by the tier's preemption mode; ``inf`` where the tier has no room. Only
        tiers with capacity (REFERENCE §5.4).

        Per tier, the legs of its path: a symmetric link (same spec both ways)
        ``2 (latency + b / bandwidth)``, an asymmetric one ``latency_w + latency_r +
        b (1 / bandwidth_w + 1 / bandwidth_r)``, with ``b`` the per-rank bytes
        (``kv_bytes_per_token_per_gpu * block_size``) per block.
        """
        per_block = self.cost.kv_bytes_per_token_per_gpu
        bs = self.bs
        rt: dict[int, Any] = {0: 0.0}
        out: dict[str, np.ndarray] = {}
        for tier in self.tiers[1:]:
            w, r = tier.links()
            acc = rt[self.by_name[tier.spec.parent].index]
            if w == r:
                leg = 2.0 * (w.latency_s + blocks * per_block * bs / w.bytes_per_s)
                rt[tier.index] = leg if tier.spec.parent == "hbm" else acc + leg
            else:
                rt[tier.index] = (acc + w.latency_s + r.latency_s
                                  + blocks * per_block * bs * (1.0 / w.bytes_per_s + 1.0 / r.bytes_per_s))
            if tier.spec.holds_swapped:
                if tier.pool.capacity_blocks:
                    out[tier.spec.preemption_mode] = np.where(blocks <= tier.pool.available_blocks,
                                                              rt[tier.index], np.inf)
        return out


def add_tier_bytes(st: RequestState, key: str, n_bytes: int) -> None:
    """Count ``n_bytes`` moved for ``st`` under ``key`` (``"hbm_to_<tier>"`` / ``"<tier>_to_hbm"``,
    the records' ``bytes_<key>`` column)."""
    d = st.tier_bytes
    if d is None:
        st.tier_bytes = {key: n_bytes}
    else:
        d[key] = d.get(key, 0) + n_bytes
