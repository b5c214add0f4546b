"""Paged KV-cache block manager over tiers (HBM, host DRAM, NVMe).

Mechanisms and sources:

- **Paged blocks** of ``block_size_tokens`` tokens (vLLM ``--block-size``, default 16;
  PagedAttention, Kwon et al., SOSP'23). A request holds ``ceil(kv_tokens / block_size)``
  blocks. Allocation is all-or-nothing: either every requested block is granted or nothing
  changes (vLLM ``KVCacheManager.allocate_slots`` returns ``None``).
- **Prefix caching** (vLLM ``--enable-prefix-caching``, REFERENCE.md §4.1). vLLM hashes each
  full 16-token block with a hash chained to its parent. Traces give prefix identity at a
  coarser grain (Mooncake ``hash_ids`` cover 512 tokens), so the cache stores *segments*: one
  trace hash = ``hash_block_tokens / block_size_tokens`` consecutive blocks that are always
  allocated, referenced and freed together. This equals chained per-block hashing for every
  block inside a segment; only whole segments are cached (a partly-filled trailing segment
  stays private). Hits are counted over the longest *leading* run of cached segments.
- **LRU reuse of freed cached blocks**: when the last reference to a segment goes, its blocks
  stay cached but become evictable, oldest first (vLLM's free-block queue). Never-cached free
  blocks are used before evicting cached ones (as vLLM's free queue front holds them).
- **One LRU free queue** (``single_free_queue``, InstanceSpec ``cache_decode_blocks``): vLLM V1
  hashes every full block, generated tokens included, and ``BlockPool.free_blocks`` appends all
  freed blocks of a request to the tail of one free queue (vLLM <= 0.23). Released private
  blocks (a request's decode blocks and partial last block, never reused by a later prompt)
  then join the LRU as one anonymous run in free order instead of the free pool: allocation
  takes never-used blocks first, then pops the LRU head, evicting a cached segment only when
  the head is one. So long outputs push cached prompts out of a small cache.
- **Kept segments** (:meth:`BlockPool.keep_segments`, a retention decision of
  ``kvsched/Residency-v0``, :mod:`.retention`): unreferenced cached segments a caller keeps leave
  the LRU order until a deadline; they stay evictable (an allocation never fails for them) but
  go only once nothing else is, the earliest deadline first; a kept segment reused by a request
  is no longer kept. Expired keeps rejoin the LRU at its head, a later deadline ahead of an
  earlier one whenever the pass runs (:meth:`BlockPool.expire_kept`, at each scheduling pass).
  :meth:`BlockPool.evict_first` moves segments to the LRU head. vLLM has
  neither (its free queue is pure LRU); they are the agent's levers over HBM residency
  [kvsched choice, issue #21 item 3].
- **Lower tiers** (DRAM, NVMe, extra tiers, PNM) hold swapped, offloaded or PNM-resident
  requests' blocks privately and, when the instance lists them in ``prefix_offload``, cached
  prefixes (:mod:`.prefix_offload`, whose store counts them as the pool's evictable blocks and
  evicts for a swap that needs room: ``reclaimer``); which tier holds what, and the links
  between them, is :mod:`kvsched.envs.sim.tiers`; :mod:`kvsched.envs.sim.kv_manager` composes
  one pool per tier.

Invariant, checked by :meth:`BlockPool.check`: in every tier at every event
``free_blocks + evictable_blocks + used_blocks == capacity_blocks``.
"""

from __future__ import annotations

from collections import OrderedDict
import heapq
from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError

TIER_NAMES: tuple[str, ...] = ("hbm", "dram", "nvme")


@dataclass(slots=True)
class Segment:
    """A cached run of ``n_blocks`` KV blocks identified by one prefix hash."""

    n_blocks: int
    refs: int
    creator_id: int


class BlockPool:
    """Block accounting of one tier.

    Args:
        name: tier name (``"hbm"``, ``"dram"`` or ``"nvme"``).
        capacity_blocks: number of KV blocks the tier holds (>= 0; HBM must be >= 1).
        prefix_caching: whether freed segments stay cached for reuse (HBM only).
        single_free_queue: with ``prefix_caching``, released private blocks age in the LRU with
            the cached segments (vLLM V1's one free queue, see the module docstring) instead of
            returning to the free pool. Default False.

    Attributes:
        free_blocks: blocks holding nothing.
        evictable_blocks: blocks in the LRU queue: cached segments nobody references and, with
            ``single_free_queue``, released private blocks waiting for reuse (LRU order).
        used_blocks: blocks referenced by at least one request.
    """

    __slots__ = ("name", "capacity_blocks", "prefix_caching", "free_blocks", "used_blocks",
                 "evictable_blocks", "segments", "_lru", "evicted_segments", "single_free_queue", "_next_anon",
                 "on_evict", "reclaimer", "_kept", "_kept_heap", "_kept_seq", "kept_blocks")

    def __init__(self, name: str, capacity_blocks: int, prefix_caching: bool = False,
                 single_free_queue: bool = False) -> None:
        if capacity_blocks < 0:
            raise ConfigError(f"{name} capacity_blocks={capacity_blocks} must be >= 0")
        self.name = name
        self.capacity_blocks = int(capacity_blocks)
        self.prefix_caching = prefix_caching
        self.free_blocks = int(capacity_blocks)
        self.used_blocks = 0
        self.evictable_blocks = 0
        self.segments: dict[int, Segment] = {}
        self._lru: OrderedDict[int | tuple[str, int], int] = OrderedDict()  # segment hash or a released private run
        self.evicted_segments = 0
        self.single_free_queue = bool(single_free_queue and prefix_caching)
        self._next_anon = 0
        #: called once per allocation that evicted cached segments, with their (hash, blocks,
        #: creator id) in eviction order (a lower tier's write-back, :mod:`.prefix_offload`);
        #: None: nothing is told
        self.on_evict: Callable[[list], None] | None = None
        #: a lower tier caching prefixes: frees blocks by evicting one of its entries, returning
        #: how many (:meth:`.prefix_offload.PrefixStore.evict_one`); None: the LRU below
        self.reclaimer: Callable[[], int] | None = None
        #: kept segments (:meth:`keep_segments`): hash -> (deadline s, sequence number)
        self._kept: dict[int, tuple[float, int]] = {}
        self._kept_heap: list[tuple[float, int, int]] = []  # (deadline, seq, hash), stale ones skipped
        self._kept_seq = 0
        #: blocks of kept segments (part of ``evictable_blocks``)
        self.kept_blocks = 0

    # -------------------------------------------------------------------------------- queries
    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable cached blocks."""
        return self.free_blocks + self.evictable_blocks

    def check(self) -> None:
        """Assert block conservation (used by tests and debug runs)."""
        total = self.free_blocks + self.evictable_blocks + self.used_blocks
        if total != self.capacity_blocks or min(self.free_blocks, self.evictable_blocks,
                                                 self.used_blocks) < 0:
            raise AssertionError(
                f"{self.name}: free {self.free_blocks} + evictable {self.evictable_blocks} + used "
                f"{self.used_blocks} != capacity {self.capacity_blocks}")
        kept = sum(self.segments[h].n_blocks for h in self._kept)
        if kept != self.kept_blocks or any(self.segments[h].refs for h in self._kept):
            raise AssertionError(f"{self.name}: kept segments hold {kept} blocks, kept_blocks says "
                                 f"{self.kept_blocks} (or a kept segment is referenced)")
        if self.reclaimer is None and sum(self._lru.values()) + kept != self.evictable_blocks:
            raise AssertionError(f"{self.name}: LRU holds {sum(self._lru.values())} blocks and kept segments "
                                 f"{kept}, evictable_blocks says {self.evictable_blocks}")

    def referenced_blocks(self) -> int:
        """Blocks of cached segments that at least one request references."""
        return sum(seg.n_blocks for seg in self.segments.values() if seg.refs > 0)

    def total_refs(self) -> int:
        """Sum of the segments' reference counts (one per holder and segment)."""
        return sum(seg.refs for seg in self.segments.values())

    def segment_refs(self, h: int) -> int:
        """References to cached segment ``h`` (KeyError when not cached)."""
        return self.segments[h].refs

    def segment_blocks(self, h: int) -> int:
        """Blocks of cached segment ``h`` (KeyError when not cached)."""
        return self.segments[h].n_blocks

    def segment_creator(self, h: int) -> int:
        """Request id that computed cached segment ``h`` (KeyError when not cached)."""
        return self.segments[h].creator_id

    def unreferenced_blocks(self, shared, seg_refs: dict[int, int]) -> int:
        """Blocks of the segments in ``shared`` (one holder's references) that would become
        unreferenced if that holder released them after the releases already counted in
        ``seg_refs`` (segment -> references left; updated). Nothing is released."""
        freed = 0
        segments = self.segments
        for h in shared:
            left = seg_refs.get(h, segments[h].refs) - 1
            seg_refs[h] = left
            if left == 0:
                freed += segments[h].n_blocks
        return freed

    def sole_holder_blocks(self, shared) -> int:
        """Blocks of the segments in ``shared`` that only one holder references (freed if it goes)."""
        segments = self.segments
        return sum(segments[h].n_blocks for h in shared if segments[h].refs == 1)

    def evictable_blocks_of(self, hashes) -> int:
        """Blocks of the cached segments among ``hashes`` that nobody references (evictable now)."""
        segs = self.segments
        return sum(segs[h].n_blocks for h in hashes if segs[h].refs == 0)

    def blocks_before_evicting(self, protected: set, wanted: int) -> int:
        """Blocks an allocation may take before it evicts one of the ``protected`` segments.

        Free blocks first, then LRU entries in eviction order up to the first protected segment,
        stopping once ``wanted`` blocks are reachable (a lower bound of what is allowed).
        """
        limit = self.free_blocks
        for h, nb in self._lru.items():
            if h in protected or limit >= wanted:
                return limit
            limit += nb
        kept = self._kept
        for until, seq, h in sorted(self._kept_heap):  # then kept segments, earliest deadline first
            if limit >= wanted:
                break
            if kept.get(h) == (until, seq):
                if h in protected:
                    break
                limit += self.segments[h].n_blocks
        return limit

    def cached_prefix_segments(self, hashes: list[int] | tuple[int, ...], max_segments: int) -> int:
        """Length of the leading run of ``hashes[:max_segments]`` cached in this tier."""
        n = 0
        segs = self.segments
        for h in hashes[:max_segments]:
            if h not in segs:
                break
            n += 1
        return n

    # ------------------------------------------------------------------------------ mutations
    def allocate(self, n_blocks: int) -> bool:
        """Take ``n_blocks`` private blocks, evicting LRU cached segments if needed.

        All-or-nothing: returns ``False`` and changes nothing when fewer than ``n_blocks`` are
        available (free + evictable).
        """
        if n_blocks <= 0:
            return True
        if n_blocks > self.free_blocks + self.evictable_blocks:
            return False
        if self.free_blocks < n_blocks:  # the usual case, free blocks enough, skips all of this
            self._evict_for(n_blocks)
        self.free_blocks -= n_blocks
        self.used_blocks += n_blocks
        return True

    def _evict_for(self, n_blocks: int) -> None:
        """Evict until ``n_blocks`` blocks are free (the caller checked they are reachable): a
        lower tier's prefix store picks its own victims (``reclaimer``); otherwise the LRU head
        goes, cached segments counted and reported to ``on_evict`` in one call."""
        if self.reclaimer is not None:
            while self.free_blocks < n_blocks:
                self.reclaimer()
            return
        on_evict = self.on_evict
        evicted: list | None = [] if on_evict is not None else None
        while self.free_blocks < n_blocks:
            if self._lru:
                h, nb = self._lru.popitem(last=False)
            else:  # only kept segments are left: the earliest deadline goes
                h = self._pop_kept()
                nb = self.segments[h].n_blocks
            self.evictable_blocks -= nb
            self.free_blocks += nb
            if not isinstance(h, tuple):  # a tuple: released private blocks
                seg = self.segments.pop(h, None)
                if seg is not None:
                    self.evicted_segments += 1
                    if evicted is not None:
                        evicted.append((h, nb, seg.creator_id))
        if evicted and on_evict is not None:
            on_evict(evicted)

    def release_private(self, n_blocks: int) -> None:
        """Return ``n_blocks`` private blocks to the free pool."""
        self.used_blocks -= n_blocks
        if self.single_free_queue and n_blocks > 0:
            self._lru[("free", self._next_anon)] = n_blocks
            self._next_anon += 1
            self.evictable_blocks += n_blocks
            return
        self.free_blocks += n_blocks

    def acquire_segment(self, h: int) -> int:
        """Add a reference to cached segment ``h``; returns its block count. A kept segment is
        no longer kept."""
        seg = self.segments[h]
        if seg.refs == 0:
            nb = self._lru.pop(h, 0)
            if not nb:
                del self._kept[h]  # a kept segment reused: its keep is over (the heap entry goes stale)
                nb = seg.n_blocks
                self.kept_blocks -= nb
            self.evictable_blocks -= nb
            self.used_blocks += nb
        seg.refs += 1
        return seg.n_blocks

    def release_segment(self, h: int) -> None:
        """Drop a reference to segment ``h``; at zero references it becomes evictable."""
        seg = self.segments[h]
        seg.refs -= 1
        if seg.refs == 0:
            self._lru[h] = seg.n_blocks
            self.used_blocks -= seg.n_blocks
            self.evictable_blocks += seg.n_blocks

    def release_segments(self, hashes) -> None:
        """:meth:`release_segment` for each of ``hashes``, in that order (one call per request
        release instead of one per segment: the environment's hot path)."""
        segments, lru = self.segments, self._lru
        freed = 0
        for h in hashes:
            seg = segments[h]
            seg.refs -= 1
            if seg.refs == 0:
                lru[h] = seg.n_blocks
                freed += seg.n_blocks
        self.used_blocks -= freed
        self.evictable_blocks += freed

    # -------------------------------------------------------------------------- kept segments
    def keep_segments(self, hashes, until_s: float) -> int:
        """Keep the unreferenced cached segments among ``hashes`` out of the LRU order until
        ``until_s`` (s), in the order given (give a prefix tail first: among equal deadlines the
        first given goes first); a segment already kept gets the later deadline. Referenced or
        uncached hashes are skipped. Returns the blocks newly kept."""
        segments, lru, kept, heap = self.segments, self._lru, self._kept, self._kept_heap
        added = 0
        for h in hashes:
            seg = segments.get(h)
            if seg is None or seg.refs:
                continue
            old = kept.get(h)
            if old is None:
                if lru.pop(h, None) is None:
                    continue
                added += seg.n_blocks
            elif old[0] >= until_s:
                continue
            self._kept_seq += 1
            kept[h] = (until_s, self._kept_seq)
            heapq.heappush(heap, (until_s, self._kept_seq, h))
        self.kept_blocks += added
        return added

    def kept_until(self, h: int) -> float | None:
        """The deadline (s) of kept segment ``h``; None when it is not kept."""
        v = self._kept.get(h)
        return None if v is None else v[0]

    def rekeep(self, h: int, until_s: float) -> None:
        """Give kept segment ``h`` the deadline ``until_s`` (s; earlier or later), as the last
        kept among that deadline's segments (KeyError when it is not kept)."""
        self._kept[h]  # noqa: B018  (KeyError when not kept)
        self._kept_seq += 1
        self._kept[h] = (until_s, self._kept_seq)
        heapq.heappush(self._kept_heap, (until_s, self._kept_seq, h))

    def unkeep_segments(self, hashes) -> None:
        """End the keep of the kept segments among ``hashes``: they rejoin the LRU at its head
        (their keep is over; they are evicted before anything the order holds)."""
        kept, lru = self._kept, self._lru
        for h in hashes:
            if kept.pop(h, None) is not None:
                nb = self.segments[h].n_blocks
                self.kept_blocks -= nb
                lru[h] = nb
                lru.move_to_end(h, last=False)

    def expire_kept(self, now_s: float) -> None:
        """Segments whose keep ended by ``now_s`` rejoin the LRU at its head as if each had
        rejoined at its own deadline: a later deadline goes ahead of an earlier one (evicted
        sooner), and among equal deadlines the first kept goes first. The resulting order does not
        depend on when the passes that expire them run (one pass per step, or one after a
        fast-forwarded stretch: :mod:`.fast_forward` must equal stepping). Nothing to do, and
        O(1), when no keep is due."""
        heap, kept = self._kept_heap, self._kept
        if not heap or heap[0][0] > now_s:
            return
        group: list[int] = []  # the expired segments of one deadline, first kept first
        group_until = heap[0][0]
        while heap and heap[0][0] <= now_s:
            until, seq, h = heapq.heappop(heap)
            if until != group_until:  # an earlier deadline's segments rejoin first (later ones pass them)
                self.unkeep_segments(reversed(group))
                group, group_until = [], until
            if kept.get(h) == (until, seq):
                group.append(h)
        self.unkeep_segments(reversed(group))  # each to the head: the first kept ends at the head

    def _pop_kept(self) -> int:
        """Remove and return the kept segment with the earliest deadline (the caller evicts it)."""
        heap, kept = self._kept_heap, self._kept
        while True:
            until, seq, h = heapq.heappop(heap)
            if kept.get(h) == (until, seq):
                del kept[h]
                self.kept_blocks -= self.segments[h].n_blocks
                return h

    def evict_first(self, hashes) -> int:
        """Move the unreferenced cached segments among ``hashes`` (kept ones included: their keep
        ends) to the LRU head, so HBM evicts them before anything else, the last given first (give
        a prefix head first: its tail goes first). Returns their blocks."""
        hashes = list(hashes)
        self.unkeep_segments(hashes)
        lru, segments = self._lru, self.segments
        moved = 0
        for h in hashes:
            if h in lru and not isinstance(h, tuple):
                lru.move_to_end(h, last=False)
                moved += segments[h].n_blocks
        return moved

    def register_segments(self, hashes, n_blocks: int, creator_id: int, private_blocks: int) -> list[int]:
        """:meth:`register_segment` for each of ``hashes`` in order while ``private_blocks`` still
        cover ``n_blocks`` more, each hash turning ``n_blocks`` of them into a cached segment;
        returns the hashes registered (the others are already cached or caching is off, and
        stay private copies, as vLLM keeps duplicate blocks uncached)."""
        if not self.prefix_caching:
            return []
        segments = self.segments
        out = []
        for h in hashes:
            if private_blocks < n_blocks:
                break
            if h not in segments:
                segments[h] = Segment(n_blocks, 1, creator_id)
                private_blocks -= n_blocks
                out.append(h)
        return out

    def register_segment(self, h: int, n_blocks: int, creator_id: int) -> bool:
        """Turn ``n_blocks`` private blocks of a request into cached segment ``h`` (1 ref).

        Returns ``False`` (the blocks stay private) when caching is off or ``h`` is already
        cached: vLLM keeps such duplicate blocks uncached too.
        """
        if not self.prefix_caching or h in self.segments:
            return False
        self.segments[h] = Segment(n_blocks=n_blocks, refs=1, creator_id=creator_id)
        return True


@dataclass(slots=True)
class Transfer:
    """A KV move scheduled on one or more links (sequentially, staged through DRAM)."""

    start_s: float
    end_s: float
    n_bytes: int


class LinkQueue:
    """FIFO occupancy of one link: a transfer starts when the link is free.

    Models ``t = latency + bytes / bandwidth`` per operation (REFERENCE.md §5.2, §5.4) with
    transfers serialised on the link, so a burst of swaps queues behind each other.
    """

    __slots__ = ("name", "busy_until_s", "bytes_moved", "busy_s", "watch")

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until_s = 0.0
        self.bytes_moved = 0
        self.busy_s = 0.0
        #: told of every copy, ``watch(link, kind, request_id, start_s, end_s, n_bytes)``
        #: (:class:`~.observer.LinkWatch`), or None (the default: nothing is built)
        self.watch: Callable[[str, str, int, float, float, int], None] | None = None

    def reserve(self, ready_s: float, duration_s: float, n_bytes: int, kind: str = "",
                request_id: int = -1) -> tuple[float, float]:
        """Occupy the link for ``duration_s`` from ``max(ready_s, busy_until_s)``; returns
        ``(start_s, end_s)``. ``kind`` (one of :data:`~.observer.TRANSFER_KINDS`) and
        ``request_id`` (-1: none) only label the copy for an attached :attr:`watch`."""
        start = ready_s if ready_s > self.busy_until_s else self.busy_until_s
        end = start + duration_s
        self.busy_until_s = end
        self.bytes_moved += n_bytes
        self.busy_s += duration_s
        if self.watch is not None:
            self.watch(self.name, kind, request_id, start, end, n_bytes)
        return start, end
