"""Lower tiers as prefix caches: host DRAM, NVMe and extra tiers keeping computed prefixes.

Without this, a prefix computed on an instance survives only while its blocks stay in HBM: once
HBM's LRU evicts them, a returning conversation recomputes its whole history. The engines keep a
second copy below HBM:

- **vLLM's KV offloading** (``--kv-offloading-size GiB``, ``--kv-offloading-backend native``:
  ``vllm/config/cache.py`` ``kv_offloading_size``; ``vllm/config/vllm.py`` sets the
  ``OffloadingConnector`` with ``cpu_bytes_to_use``): the connector's scheduler side stores each
  request's full blocks as they are computed (``offloading/scheduler.py``
  ``RequestOffloadState.storable_chunks``, ``advance_stored_idx``), only prompt blocks unless
  ``offload_prompt_only`` is false in its extra config (``vllm/v1/kv_offload/base.py``, default
  true); at admission ``get_num_new_matched_tokens`` reports the tokens found below HBM and the
  request waits while they load asynchronously; the CPU store evicts LRU (or ARC,
  ``vllm/v1/kv_offload/cpu/policies``).
- **LMCache** (``local_cpu`` and ``local_disk`` backends): store after prefill, look up and
  retrieve before prefill; LRU.
- **SGLang HiCache** (``--hicache-write-policy``): ``write_through`` backs a node up to host
  memory on its first use, ``write_through_selective`` on its second
  (``HiRadixCache._inc_hit_count``: ``hit_count >= write_through_threshold``, 1 or 2), and
  ``write_back`` only when the device evicts it; host entries evict LRU.

Mechanism here (one :class:`PrefixStore` per listed tier, composed by :class:`PrefixTiers`):

- **Unit.** The prefix *segment* of :mod:`.kv_cache` (one trace hash, ``hash_block_tokens``
  tokens), keyed by its chained prefix hash, so a segment found below HBM is valid only after the
  same prefix. With ``offload_prompt_only`` false a finished request's decode blocks are written
  too, as one entry no later prompt can hit (kvsched's traces identify prompt blocks only, as with
  ``cache_decode_blocks``): they cost link time and capacity, never a hit.
- **Writes** (``write_policy``) go to the first listed tier over the write links of its path
  (HBM -> DRAM over PCIe, then DRAM -> NVMe), FIFO-queued, asynchronous: no step waits for them
  (vLLM and LMCache store on a separate stream; a segment becomes loadable when its copy lands).
  ``write_through``: when the segment is computed; ``write_through_selective``: when it reaches
  ``write_threshold`` uses while in HBM (its computation counts 1, each HBM hit by a later
  admission 1; an HBM eviction resets the count);
  ``write_back``: when HBM's LRU evicts it (the HBM blocks are reused at once; the copy is charged
  on the link from the eviction time [inferred: the engines keep the device blocks until the copy
  lands, which this does not model]). A segment already stored is only refreshed.
- **Demotion.** An entry evicted from a listed tier is written to the next listed tier (e.g.
  DRAM -> NVMe over the NVMe write link), from when its copy is complete [kvsched choice: the
  hierarchy of SGLang HiCache's host -> storage backup, done lazily].
- **Capacity** is the tier's: swapped-out requests' blocks (preemption, :mod:`.preemption`) and
  cached prefixes share it; a swap evicts prefix entries it needs room from, never the reverse (a
  write that finds the tier full of swapped blocks is skipped and counted).
- **Eviction** per tier (``eviction``): ``lru`` (vLLM's offloading, LMCache, HiCache default),
  ``lfu`` (fewest uses first, LRU among equals), ``session`` (LRU, but an entry whose conversation
  -- :meth:`PrefixTiers.conversation_of` -- was active within ``session_keep_s``, its expected think time,
  goes only after every other
  [kvsched's session-aware policy, in the spirit of Mooncake's and CachedAttention's
  conversation-aware placement]) and ``clairvoyant`` (Belady, "A study of replacement algorithms
  for a virtual-storage computer", IBM Systems Journal 1966: the entry whose next use by an
  arrival of the window is farthest, the earliest stored first among equals). It reads the
  future, so it is a reference for what knowing the future is worth, never a policy. It is not a
  proven bound here: Belady's rule is optimal for one cache whose every reference hits
  independently, while a hit below HBM needs the whole leading run of a prompt's segments, and a
  use may be served by HBM or another instance instead; the tests check it against the other
  policies on fixed windows, and it can lose on contrived ones.
- **Loads.** At admission, after the HBM lookup (:meth:`.kv_manager.KVManager.cached_prefix`),
  the leading run of the request's next segments found in the listed tiers (each in the highest
  tier that holds it, its copy landed) is loaded when that is predicted faster than recomputing
  (``load_policy="cost"``: the load over the read links, queued behind transfers already there,
  plus the prefill of the rest, against the prefill of everything after the HBM hit, both with
  the cost model's lone chunked prefill ``T̂_prefill``; REFERENCE §5.4) or always
  (``"always"``). The request takes its HBM blocks for the loaded segments, holds its seat, and
  waits (admitted, not runnable) until its own copy lands -- a request waits only for its blocks
  -- then prefills the rest; the loaded segments join HBM's prefix cache at its next step. A
  load copies: the entry stays in its tier.

Counters per tier (:meth:`PrefixTiers.stats`): hit tokens (other requests' segments, first
admission only, as HBM hits), self-hit tokens, loads, bytes loaded and written, writes, skipped
writes, demotions, evictions, recompute chosen. Link bytes appear under the tier's write and
read queues in the run's ``stats["link_bytes"]``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .errors import ConfigError, bounded_repr, require
from .spec_validation import known_keys

if TYPE_CHECKING:  # pragma: no cover
    from .kv_manager import KVManager, KVTier
    from .request import RequestState, Workload

WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu", "session", "clairvoyant")
LOAD_POLICIES: tuple[str, ...] = ("cost", "always")
#: default uses before a selective write: SGLang ``HiRadixCache`` sets ``write_through_threshold``
#: to 2 under ``write_through_selective`` (1 under ``write_through``)
SELECTIVE_THRESHOLD = 2
#: the ``session`` policy looks for a victim among this many least recently used entries
#: [kvsched choice: bounds the cost of an eviction]
SESSION_SCAN = 64
#: the largest ``write_threshold`` (uses before a selective write)
MAX_WRITE_THRESHOLD = 1_000_000

COPY_LAYOUTS = ("per_block", "per_layer")
"""How one KV block's bytes lie in HBM, so how many contiguous pieces a copy of it submits:
``per_block`` one piece (vLLM >= 0.12's cross-layer blocks of the offloading connector:
``prefer_cross_layer_blocks``, one 0.5-2 MB region per block), ``per_layer`` one piece per layer
and per K and V (two per layer; one for latent attention, whose layer cache is one tensor): vLLM
0.11's ``OffloadingConnector``, whose handler splits each layer's ``(2, num_blocks, ...)`` cache
into K and V tensors (``gpu_tensor.unbind(0)``) and copies a block of each with its own
``cudaMemcpyAsync`` (``csrc/cache_kernels.cu`` ``swap_blocks``, a loop over the blocks)."""

PER_LAYER_FRAGMENT_S = 6.4e-6
"""Time per contiguous piece of a ``per_layer`` copy (s): 32 KiB (Llama-3.1-8B's K or V of one
16-token block and layer) at the ~5 GB/s an H100 reaches with vLLM 0.11's per-layer copies
(vLLM maintainer's micro-benchmark, vllm-project/vllm issue #33398, 2026-01-30: "5GB/s ... 32KB
... = 6us"; vLLM's offloading blog, 2026-01-08: the cross-layer layout of 0.12 is 4-5x faster).
The value ``kvsched validate`` replays CPU-offload runs with; not measured here."""


@dataclass(frozen=True)
class PrefixOffloadSpec:
    """Which lower tiers cache prefixes, and how (see the module docstring).

    Attributes:
        tiers: names of the tiers below HBM that cache prefix segments, top down along the copy
            path (e.g. ``("dram",)`` or ``("dram", "nvme")``); each must exist in the instance
            with capacity (``dram_kv_bytes``, ``nvme_kv_bytes`` or an extra tier holding
            ``prefix``), and each must lie below the one before it.
        write_policy: one of :data:`WRITE_POLICIES`; default ``write_through`` (vLLM's
            offloading connector, LMCache, HiCache's default).
        write_threshold: uses before a ``write_through_selective`` write (>= 1; default 2, SGLang).
        offload_prompt_only: write prompt segments only (vLLM's default); False also writes each
            finished request's decode blocks (which no later prompt can hit here).
        eviction: one policy of :data:`EVICTION_POLICIES` for every listed tier, or one per tier
            (same length as ``tiers``); default ``lru``.
        load_policy: ``cost`` (load only when predicted faster than recomputing, default) or
            ``always``.
        session_keep_s: the ``session`` policy protects a conversation's entries for this long
            after its last use (s, > 0; default 30 [kvsched choice: the order of the think times
            between turns in the conversation traces]).
        fence_pending_writes: ``write_through`` only: HBM blocks whose copy below has not landed
            cannot be reused before it lands, so a step whose allocations evict such a segment
            starts when its copy lands (vLLM's ``OffloadingConnector``: the scheduler flushes the
            store jobs of re-allocated blocks, ``offloading/scheduler.py`` ``build_connector_meta``
            ``jobs_to_flush``, and the worker waits for them before the forward pass,
            ``offloading/worker.py`` ``handle_preemptions`` -> ``worker.wait``). Default False
            (writes never delay a step, as before).
        write_hbm_hits: ``write_through`` only: a first admission's HBM-hit segments that the first
            listed tier lacks are written too, unless the admission loads from below (vLLM's
            ``update_state_after_alloc`` then moves the store index past the hit and loaded chunks;
            a preemption does not reset it) (vLLM's ``OffloadingConnector``: a request's store
            index starts at its first block, GPU prefix hits included, and ``prepare_store`` skips
            only the blocks the CPU store holds, ``offloading/scheduler.py`` ``_build_store_jobs``;
            LMCache stores every chunk it lacks). Default False: only newly computed segments
            (HiCache's ``write_through``, which backs up new radix nodes).
        copy_layout: one of :data:`COPY_LAYOUTS`: contiguous pieces per block copied between HBM
            and the first listed tier (default ``per_block``).
        copy_fragment_s: host time per piece (s, >= 0; default 0: no host cost, a copy takes its
            link time). With t > 0, the copies a step's writes and loads need (pieces = blocks x
            pieces per block) are submitted at the start of the next step, before its forward pass,
            which starts that much later (vLLM's ``OffloadingConnectorWorker`` defers stores "to
            the beginning of the next engine step" and submits them and the loads on the engine's
            thread, ``offloading/worker.py`` ``start_kv_transfers``), and each copy lasts at least
            pieces x t. :data:`PER_LAYER_FRAGMENT_S` with ``per_layer`` is vLLM 0.11's.

    Raises:
        ConfigError: an empty or repeated tier list, an unknown policy, a per-tier eviction list of
            another length, a bad threshold or keep time.
    """

    tiers: tuple[str, ...] = ("dram",)
    write_policy: str = "write_through"
    write_threshold: int = SELECTIVE_THRESHOLD
    offload_prompt_only: bool = True
    eviction: tuple[str, ...] | str = "lru"
    load_policy: str = "cost"
    session_keep_s: float = 30.0
    fence_pending_writes: bool = False
    write_hbm_hits: bool = False
    copy_layout: str = "per_block"
    copy_fragment_s: float = 0.0

    def __post_init__(self) -> None:
        o = "PrefixOffloadSpec"
        if isinstance(self.tiers, list):
            object.__setattr__(self, "tiers", tuple(self.tiers))
        require(isinstance(self.tiers, tuple) and bool(self.tiers) and all(isinstance(t, str) for t in self.tiers)
                and len(set(self.tiers)) == len(self.tiers), f"{o}.tiers", self.tiers,
                "a non-empty list of distinct tier names below HBM (e.g. ['dram'] or ['dram', 'nvme'])")
        require("hbm" not in self.tiers and "pnm" not in self.tiers, f"{o}.tiers", self.tiers,
                "tiers below HBM other than 'pnm' (HBM has its own prefix cache; PNM holds decoding requests)")
        require(self.write_policy in WRITE_POLICIES, f"{o}.write_policy", self.write_policy,
                f"one of {', '.join(WRITE_POLICIES)}")
        w = self.write_threshold
        require(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WRITE_THRESHOLD,
                f"{o}.write_threshold", w, f"an integer in [1, {MAX_WRITE_THRESHOLD}] (uses before a selective write)")
        require(w == SELECTIVE_THRESHOLD or self.write_policy == "write_through_selective", f"{o}.write_threshold",
                w, f"{SELECTIVE_THRESHOLD} (the default) unless write_policy is write_through_selective, the only "
                "policy that reads it")
        require(isinstance(self.offload_prompt_only, bool), f"{o}.offload_prompt_only", self.offload_prompt_only,
                "true or false")
        ev = self.eviction
        if isinstance(ev, str):
            ev = (ev,) * len(self.tiers)
        elif isinstance(ev, list):
            ev = tuple(ev)
        require(isinstance(ev, tuple) and len(ev) == len(self.tiers) and all(e in EVICTION_POLICIES for e in ev),
                f"{o}.eviction", self.eviction,
                f"one of {', '.join(EVICTION_POLICIES)}, or a list of them with one per tier ({len(self.tiers)})")
        object.__setattr__(self, "eviction", ev)
        require(self.load_policy in LOAD_POLICIES, f"{o}.load_policy", self.load_policy,
                f"one of {', '.join(LOAD_POLICIES)}")
        k = self.session_keep_s
        require(isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k) and k > 0,
                f"{o}.session_keep_s", k, "a finite number of seconds > 0")
        require(isinstance(self.fence_pending_writes, bool), f"{o}.fence_pending_writes", self.fence_pending_writes,
                "true or false")
        require(not self.fence_pending_writes or self.write_policy == "write_through", f"{o}.fence_pending_writes",
                self.fence_pending_writes, "false unless write_policy is write_through (the engines that fence "
                "block reuse behind pending stores write through)")
        require(isinstance(self.write_hbm_hits, bool), f"{o}.write_hbm_hits", self.write_hbm_hits, "true or false")
        require(not self.write_hbm_hits or self.write_policy == "write_through", f"{o}.write_hbm_hits",
                self.write_hbm_hits, "false unless write_policy is write_through (vLLM's and LMCache's stores)")
        require(self.copy_layout in COPY_LAYOUTS, f"{o}.copy_layout", self.copy_layout,
                f"one of {', '.join(COPY_LAYOUTS)}")
        t = self.copy_fragment_s
        require(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 <= t <= 1.0,
                f"{o}.copy_fragment_s", t, "a finite number of seconds in [0, 1] (host time per copied piece)")

    @property
    def threshold(self) -> int:
        """Uses at which a segment is written: 1 (write-through), ``write_threshold`` (selective);
        0 for write-back (written on HBM eviction instead)."""
        if self.write_policy == "write_through":
            return 1
        return self.write_threshold if self.write_policy == "write_through_selective" else 0

    @staticmethod
    def from_dict(d: Any, source: str = "prefix_offload") -> "PrefixOffloadSpec":
        """Build from a scenario mapping (the field names above).

        Raises:
            ConfigError: not a mapping, an unknown key, or a bad value (naming ``source``).
        """
        import dataclasses

        known_keys(d, [f.name for f in dataclasses.fields(PrefixOffloadSpec)], source, "PrefixOffloadSpec")
        try:
            return PrefixOffloadSpec(**dict(d))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (scenario YAML)."""
        return {"tiers": list(self.tiers), "write_policy": self.write_policy, "write_threshold": self.write_threshold,
                "offload_prompt_only": self.offload_prompt_only, "eviction": list(self.eviction),
                "load_policy": self.load_policy, "session_keep_s": self.session_keep_s,
                "fence_pending_writes": self.fence_pending_writes} | self._copy_fields()

    def _copy_fields(self) -> dict[str, Any]:
        """The fields added with the offloading connector's copy costs, written only away from
        their defaults (scenarios written before them keep their hash)."""
        out: dict[str, Any] = {}
        if self.write_hbm_hits:
            out["write_hbm_hits"] = True
        if self.copy_layout != "per_block":
            out["copy_layout"] = self.copy_layout
        if self.copy_fragment_s != 0.0:
            out["copy_fragment_s"] = self.copy_fragment_s
        return out


@dataclass(slots=True)
class _Entry:
    """One stored segment (or decode run): blocks, when its copy lands, who made it, its uses."""

    n_blocks: int
    ready_s: float
    creator_id: int
    session_id: Any  # the conversation (PrefixTiers.conversation_of), None: none
    uses: int
    last_s: float


# ---------------------------------------------------------------------------- eviction orders
class _LRU:
    """Least recently used first (vLLM ``LRUOffloadingPolicy``, LMCache, HiCache)."""

    def __init__(self) -> None:
        self.keys: OrderedDict[Any, None] = OrderedDict()

    def add(self, key: Any, e: _Entry, now_s: float) -> None:
        self.keys[key] = None

    def touch(self, key: Any, e: _Entry, now_s: float) -> None:
        self.keys.move_to_end(key)

    def remove(self, key: Any) -> None:
        del self.keys[key]

    def victim(self, entries: dict, now_s: float) -> Any:
        return next(iter(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


class _LFU:
    """Fewest uses first, least recently used among equals (a lazy heap: O(log n) per change)."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Any]] = []
        self.token: dict[Any, tuple[int, int]] = {}
        self.seq = 0

    def _push(self, key: Any, uses: int) -> None:
        self.seq += 1
        self.token[key] = (uses, self.seq)
        heapq.heappush(self.heap, (uses, self.seq, key))

    def add(self, key: Any, e: _Entry, now_s: float) -> None:
        self._push(key, e.uses)

    touch = add

    def remove(self, key: Any) -> None:
        del self.token[key]

    def __len__(self) -> int:
        return len(self.token)

    def victim(self, entries: dict, now_s: float) -> Any:
        heap, token = self.heap, self.token
        while True:
            uses, seq, key = heap[0]
            if token.get(key) == (uses, seq):
                return key
            heapq.heappop(heap)  # stale: removed or touched since


class _Session(_LRU):
    """LRU, but entries of a conversation used within ``keep_s`` go after the others among the
    :data:`SESSION_SCAN` least recently used (a bounded search: eviction stays O(1) amortised
    per entry however many conversations are active)."""

    def __init__(self, keep_s: float, last_use: dict[int, float]) -> None:
        super().__init__()
        self.keep_s = keep_s
        self.last_use = last_use  # session -> last use (s), shared with the owner

    def victim(self, entries: dict, now_s: float) -> Any:
        keep_s, last_use = self.keep_s, self.last_use
        for i, key in enumerate(self.keys):
            if i >= SESSION_SCAN:
                break
            s = entries[key].session_id
            if s is None or now_s - last_use.get(s, -math.inf) > keep_s:
                return key
        return next(iter(self.keys))  # the oldest entries' conversations are all active: plain LRU


class _Clairvoyant:
    """Belady's rule: the entry whose next use after now is farthest (or never) goes first, the
    earliest stored first among equals. Two lazy heaps over the stored next-use times: a max-heap
    to pick the victim and a min-heap to find the entries whose predicted use has passed (served
    elsewhere, e.g. by HBM), whose next use is looked up again before a victim is chosen."""

    def __init__(self, future: Callable[[Any, float], float]) -> None:
        self.future = future  # (key, now_s) -> next arrival using key after now_s (inf: none)
        self.heap: list[tuple[float, int, Any]] = []  # (-next use, seq, key): farthest first
        self.due: list[tuple[float, int, Any]] = []  # (next use, seq, key): soonest first
        self.token: dict[Any, tuple[float, int]] = {}
        self.seq = 0

    def _push(self, key: Any, now_s: float) -> None:
        nxt = self.future(key, now_s)
        self.seq += 1
        self.token[key] = (nxt, self.seq)
        heapq.heappush(self.heap, (-nxt, self.seq, key))
        if nxt != math.inf:
            heapq.heappush(self.due, (nxt, self.seq, key))

    def add(self, key: Any, e: _Entry, now_s: float) -> None:
        self._push(key, now_s)

    touch = add

    def remove(self, key: Any) -> None:
        del self.token[key]

    def __len__(self) -> int:
        return len(self.token)

    def victim(self, entries: dict, now_s: float) -> Any:
        heap, due, token = self.heap, self.due, self.token
        while due and due[0][0] <= now_s:  # predicted uses that have passed: look them up again
            nxt, seq, key = heapq.heappop(due)
            if token.get(key) == (nxt, seq):
                self._push(key, now_s)
        while True:
            neg, seq, key = heap[0]
            if token.get(key) == (-neg, seq):
                return key
            heapq.heappop(heap)  # stale: removed, touched or looked up again since


# ---------------------------------------------------------------------------------- one tier
class PrefixStore:
    """The cached prefixes of one tier (its blocks counted as the tier pool's evictable blocks).

    Args:
        tier: the :class:`~.kv_manager.KVTier` (pool, links, copy path).
        eviction: one of :data:`EVICTION_POLICIES`.
        owner: the :class:`PrefixTiers` (clock, demotion target, session activity, the future).
    """

    def __init__(self, tier: "KVTier", eviction: str, owner: "PrefixTiers") -> None:
        self.tier = tier
        self.pool = tier.pool
        self.owner = owner
        self.eviction = eviction
        self.entries: dict[Any, _Entry] = {}
        if eviction == "lru":
            self.order: Any = _LRU()
        elif eviction == "lfu":
            self.order = _LFU()
        elif eviction == "session":
            self.order = _Session(owner.spec.session_keep_s, owner.session_last_s)
        else:
            self.order = _Clairvoyant(owner.next_use_s)
        self.next: PrefixStore | None = None  # where evicted entries are demoted
        # retention (:meth:`PrefixTiers.retain`): entries out of the eviction order until a deadline
        self.protected: dict[Any, float] = {}  # key -> deadline (s): the latest of its keepers'
        self.keepers: dict[Any, dict[Any, float]] = {}  # protected key -> {conversation: deadline (s)}
        self.kept_by: dict[Any, set] = {}  # conversation -> the keys it keeps here
        self._deadlines: list[tuple[float, int, Any]] = []  # (deadline, seq, key), lazy min-heap
        self._seq = 0
        self.protected_blocks = 0
        self.by_session: dict[Any, set] | None = None  # conversation -> the keys it wrote (retention only)
        self.hit_tokens = 0
        self.self_hit_tokens = 0
        self.loads = 0
        self.loaded_segments = 0
        self.bytes_loaded = 0
        self.writes = 0
        self.bytes_written = 0
        self.skipped_writes = 0
        self.demotions = 0
        self.evicted = 0
        self.evicted_blocks = 0
        self.prefetches = 0  # copies of this tier's entries up to the first listed tier (PrefixTiers.prefetch)
        self.bytes_prefetched = 0
        self.pool.reclaimer = self.evict_one  # a swap into this tier evicts prefixes it needs room from

    def ready(self, key: Any, now_s: float) -> bool:
        """Whether ``key`` is stored here and its copy has landed by ``now_s``."""
        e = self.entries.get(key)
        return e is not None and e.ready_s <= now_s

    def put(self, key: Any, n_blocks: int, creator_id: int, session_id: Any, ready_s: float, now_s: float,
            hops: list) -> bool:
        """Store ``key`` (``n_blocks``) copied over ``hops`` (tiers whose write links it crosses,
        top down) from ``max(ready_s, now_s)``; refresh it when already stored. Returns whether
        it is stored (:meth:`put_many`)."""
        return self.put_many([key], n_blocks, creator_id, session_id, now_s, hops, ready_s)

    def put_many(self, keys: list, n_blocks: int, creator_id: int, session_id: Any, now_s: float,
                 hops: list, ready_s: float = 0.0,
                 first_hop_s_per_block: float = 0.0) -> bool:
        """Store segments ``keys`` of ``n_blocks`` each, copied over ``hops`` (tiers whose write
        links they cross, top down) from ``max(ready_s, now_s)`` as one copy (one reservation per
        link: a request's newly computed segments go down together, so the cost grows with
        writes, not segments); the first hop lasts at least ``first_hop_s_per_block`` (s) per
        block written (:meth:`PrefixTiers.copy_floor_s`). Already stored ones are refreshed. Evicts
        for room (never swapped blocks); when the tier cannot make room for all the new ones, none is written (a skipped
        write). Returns whether every key is stored."""
        entries, order, protected = self.entries, self.order, self.protected
        new = []
        for key in reversed(keys):  # a prefix's tail first: its head is the most recent (vLLM's
            e = entries.get(key)  # LRUOffloadingManager.touch walks reversed(block_hashes))
            if e is None:
                new.append(key)
            else:
                e.last_s = now_s
                if key not in protected:
                    order.touch(key, e, now_s)
        if not new:
            return True
        pool = self.pool
        total = n_blocks * len(new)
        by_session = self.by_session
        until = -math.inf if by_session is None else self.owner.keep_until_s.get(session_id, -math.inf)
        room = pool.free_blocks + pool.evictable_blocks
        if self.protected and until <= now_s:  # a write not kept itself never evicts kept entries
            self._release(now_s)
            room -= self.protected_blocks
        if total > room:
            self.skipped_writes += 1
            return False
        while pool.free_blocks < total:
            self.evict_one(now_s)
        pool.free_blocks -= total
        pool.evictable_blocks += total
        owner = self.owner
        nbytes = total * owner.block_bytes
        transfer = owner.kv.cost.transfer_time_s
        t = ready_s if ready_s > now_s else now_s
        floor_s = total * first_hop_s_per_block
        for hop in hops:
            d = transfer(total, hop.links()[0])
            if floor_s > d:
                d = floor_s
            floor_s = 0.0
            t = hop.write(t, d, nbytes, "prefix_write", creator_id)
        for key in new:  # tail first (reversed above)
            e = entries[key] = _Entry(n_blocks, t, creator_id, session_id, 1, now_s)
            if until > now_s:  # its conversation is kept: out of the order until its deadline
                order.add(key, e, now_s)
                self.keep_keys(session_id, (key,), until, now_s)
            else:
                order.add(key, e, now_s)
        if by_session is not None:
            by_session.setdefault(session_id, set()).update(new)
        self.writes += 1
        self.bytes_written += nbytes
        return True

    def evict_one(self, now_s: float | None = None) -> int:
        """Evict the policy's victim at ``now_s`` (default: the owner's clock, for a swap into the
        tier), demoting it to the next listed tier; returns its blocks."""
        if now_s is None:
            now_s = self.owner.now_s
        protected = self.protected
        if protected:
            self._release(now_s)
            if len(protected) == len(self.entries):  # everything is kept: the earliest deadline goes
                key = self._earliest_protected()
                return self.remove(key, now_s, demote=True)
        return self.remove(self.order.victim(self.entries, now_s), now_s, demote=True)

    def remove(self, key: Any, now_s: float, demote: bool) -> int:
        """Evict ``key`` at ``now_s``, demoting it to the next listed tier when ``demote`` (and
        there is one); returns its blocks."""
        e = self.entries.pop(key)
        if self.protected.pop(key, None) is None:
            self.order.remove(key)
        else:
            self.protected_blocks -= e.n_blocks
            for conv in self.keepers.pop(key, ()):
                kept = self.kept_by.get(conv)
                if kept is not None:
                    kept.discard(key)
                    if not kept:
                        del self.kept_by[conv]
        if self.by_session is not None:
            keys = self.by_session.get(e.session_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_session[e.session_id]
        pool = self.pool
        pool.evictable_blocks -= e.n_blocks
        pool.free_blocks += e.n_blocks
        self.evicted += 1
        self.evicted_blocks += e.n_blocks
        nxt = self.next
        if demote and nxt is not None and nxt.put(key, e.n_blocks, e.creator_id, e.session_id, e.ready_s, now_s,
                                                  [nxt.tier]):
            self.demotions += 1
        return e.n_blocks

    # ------------------------------------------------------------------------ retention
    def keep_keys(self, conv: Any, keys, until_s: float, now_s: float) -> None:
        """Conversation ``conv`` keeps ``keys`` (those stored here) until ``until_s`` (s),
        replacing a deadline it gave them before. A key leaves the eviction order while any
        conversation keeps it, until the latest of their deadlines. Among kept entries of equal
        deadline the ones kept first go first: give a prefix tail first."""
        entries, protected, order, keepers = self.entries, self.protected, self.order, self.keepers
        mine = self.kept_by.setdefault(conv, set())
        for key in keys:
            e = entries.get(key)
            if e is None:
                continue
            k = keepers.setdefault(key, {})
            k[conv] = until_s
            mine.add(key)
            deadline = max(k.values())
            if key not in protected:
                order.remove(key)
                self.protected_blocks += e.n_blocks
            protected[key] = deadline
            self._seq += 1
            heapq.heappush(self._deadlines, (deadline, self._seq, key))
        if not mine:
            del self.kept_by[conv]

    def unkeep(self, conv: Any, now_s: float) -> None:
        """Conversation ``conv`` no longer keeps anything here: a key nobody else keeps (past
        ``now_s``) rejoins the eviction order, the others keep the latest remaining deadline."""
        keys = self.kept_by.pop(conv, None)
        if not keys:
            return
        for key in sorted(keys, key=self._chain_rank):
            k = self.keepers.get(key)
            if k is None:
                continue
            k.pop(conv, None)
            self._settle(key, now_s)

    def _settle(self, key: Any, now_s: float) -> None:
        """Recompute ``key``'s deadline from its keepers at ``now_s``: keepers whose deadline
        passed let go; without any left it rejoins the order (as if used at ``now_s``: an order
        has no place for an older use [kvsched choice])."""
        k = self.keepers.get(key, {})
        for conv in [c for c, u in k.items() if u <= now_s]:
            del k[conv]
            kept = self.kept_by.get(conv)
            if kept is not None:
                kept.discard(key)
                if not kept:
                    del self.kept_by[conv]
        if k:
            deadline = max(k.values())
            if self.protected.get(key) != deadline:
                self.protected[key] = deadline
                self._seq += 1
                heapq.heappush(self._deadlines, (deadline, self._seq, key))
            return
        self.keepers.pop(key, None)
        if self.protected.pop(key, None) is not None:
            e = self.entries[key]
            self.protected_blocks -= e.n_blocks
            self.order.add(key, e, now_s)

    def _release(self, now_s: float) -> None:
        """Entries whose deadline passed rejoin the eviction order (:meth:`_settle`)."""
        heap, protected = self._deadlines, self.protected
        while heap and heap[0][0] <= now_s:
            until, _, key = heapq.heappop(heap)
            if protected.get(key) == until:
                self._settle(key, now_s)

    def _earliest_protected(self) -> Any:
        heap, protected = self._deadlines, self.protected
        while True:
            until, _, key = heap[0]
            if protected.get(key) == until:
                return key
            heapq.heappop(heap)  # stale: removed or given another deadline since

    def _chain_rank(self, key: Any) -> tuple:
        """A deterministic order of a conversation's keys: most recently used last."""
        e = self.entries.get(key)
        return (e.last_s if e is not None else -math.inf, repr(key))

    def own_unkept(self, conv: Any) -> list:
        """The entries conversation ``conv`` wrote that nobody keeps, least recently used first."""
        keys = self.by_session.get(conv) if self.by_session is not None else None
        if not keys:
            return []
        return sorted((k for k in keys if k not in self.protected), key=self._chain_rank)

    def evict_keys(self, keys: list, now_s: float, demote: bool) -> int:
        """Evict ``keys`` (demoted to the next listed tier when ``demote``); returns the blocks freed."""
        return sum(self.remove(key, now_s, demote) for key in keys if key in self.entries)

    def refresh(self, chain: Sequence, now_s: float) -> None:
        """A request computed ``chain`` (its prompt's segments so far, head first): those stored
        here become the most recently used, the head last (vLLM's
        ``LRUOffloadingManager.touch`` walks ``reversed(block_hashes)``), so a tier evicts a
        prefix from its tail and what stays is a loadable leading run. Kept entries are left as
        they are."""
        entries, order, protected = self.entries, self.order, self.protected
        for key in reversed(chain):
            e = entries.get(key)
            if e is not None and key not in protected:
                e.last_s = now_s
                order.touch(key, e, now_s)

    def use(self, key: Any, now_s: float) -> None:
        """A load read ``key``: count the use and refresh its place in the eviction order."""
        e = self.entries[key]
        e.uses += 1
        e.last_s = now_s
        if key not in self.protected:
            self.order.touch(key, e, now_s)

    def check(self) -> None:
        """Assert the stored blocks are the pool's evictable blocks."""
        held = sum(e.n_blocks for e in self.entries.values())
        if held != self.pool.evictable_blocks:
            raise AssertionError(f"{self.tier.name} prefix store holds {held} blocks, the pool counts "
                                 f"{self.pool.evictable_blocks} evictable")
        for key, k in self.keepers.items():
            if key not in self.protected or not k or self.protected[key] != max(k.values()):
                raise AssertionError(f"{self.tier.name} prefix store: kept entry {bounded_repr(key)} has keepers "
                                     f"{bounded_repr(k)} and deadline {bounded_repr(self.protected.get(key))}")
        if set(self.keepers) != set(self.protected):
            raise AssertionError(f"{self.tier.name} prefix store: kept entries without keepers")
        kept = sum(self.entries[k].n_blocks for k in self.protected)
        if len(self.order) + len(self.protected) != len(self.entries) or kept != self.protected_blocks:
            raise AssertionError(f"{self.tier.name} prefix store: {len(self.order)} ordered + "
                                 f"{len(self.protected)} kept entries of {len(self.entries)}; kept blocks "
                                 f"{kept} vs counted {self.protected_blocks}")

    def stats(self) -> dict[str, Any]:
        """Counters of this tier (JSON-ready); ``prefetches`` and ``bytes_prefetched`` only when a
        prefetch copied from it (a run without prefetch decisions keeps its summary's bytes)."""
        out = {"eviction": self.eviction, "stored_segments": len(self.entries),
                "stored_blocks": self.pool.evictable_blocks, "capacity_blocks": self.pool.capacity_blocks,
                "hit_tokens": self.hit_tokens, "self_hit_tokens": self.self_hit_tokens, "loads": self.loads,
                "loaded_segments": self.loaded_segments, "bytes_loaded": self.bytes_loaded,
                "writes": self.writes, "bytes_written": self.bytes_written, "skipped_writes": self.skipped_writes,
                "demotions": self.demotions, "evicted_segments": self.evicted}
        if self.prefetches:
            out["prefetches"] = self.prefetches
            out["bytes_prefetched"] = self.bytes_prefetched
        return out


# ------------------------------------------------------------------------------- the tiers
class PrefixTiers:
    """The prefix stores of one instance's listed tiers (see the module docstring).

    Args:
        spec: the :class:`PrefixOffloadSpec`.
        kv: the instance's :class:`~.kv_manager.KVManager` (tiers, cost model, HBM pool).
    """

    def __init__(self, spec: PrefixOffloadSpec, kv: "KVManager") -> None:
        self.spec = spec
        self.kv = kv
        self.block_bytes = kv.block_bytes
        self.now_s = 0.0  # the instance's clock, set at each scheduling pass (KVManager.now_s)
        #: latest landing time (s) of a pending write whose HBM blocks this pass reused
        #: (``fence_pending_writes``); the instance starts its step no earlier
        self.fence_s = 0.0
        #: ``fence_pending_writes``: HBM segment -> when its write below lands (s), until HBM evicts
        #: it (the write is pending in the engine even if the lower tier drops the entry first)
        self._write_lands: dict[Any, float] | None = {} if spec.fence_pending_writes else None
        self.session_last_s: dict[Any, float] = {}  # conversation -> last use (s)
        self._future: dict[int, np.ndarray] = {}
        self.threshold = spec.threshold
        self._uses: dict[int, int] = {}  # HBM uses per segment (selective writes)
        self._session_of: dict[int, Any] = {}  # request id -> conversation (write-back of its segments)
        self.recompute_chosen = 0
        self.keep_until_s: dict[Any, float] = {}  # conversation -> retention deadline (s), :meth:`retain`
        self.retention_queue: list | None = None  # finished requests awaiting a retention decision
        self.retention_decisions = 0
        self.hbm_kept_blocks = 0  # HBM blocks kept by retention decisions (``hbm="keep"``), summed
        self.hbm_evict_first_blocks = 0  # HBM blocks sent to the LRU head (``hbm="evict_first"``), summed
        self.prefetch_decisions = 0  # prefetches asked (:meth:`prefetch`)
        #: kept HBM segment -> {conversation: deadline s} (``hbm="keep"``; pruned as keeps end)
        self._hbm_keepers: dict[Any, dict[Any, float]] = {}
        self._sessions = "session" in spec.eviction
        self._conv_of_request: dict[int, Any] = {}  # request id -> conversation (conversation_of)
        self._conv_by_chain_end: dict[int, Any] = {}  # a request's last full-segment key -> its conversation
        self._seen_keys: set = set()  # every full-segment key of a request seen so far
        self.stores = [PrefixStore(kv.by_name[name], ev, self) for name, ev in zip(spec.tiers, spec.eviction)]
        for upper, lower in zip(self.stores, self.stores[1:]):
            upper.next = lower
        first = self.stores[0].tier
        self._first_hops = list(first.path)  # HBM -> first listed tier: every write link on the path
        #: host time per copied piece (s) and pieces per block (``copy_layout``), per rank: the TP
        #: ranks submit their shares of a copy in parallel, each with every layer
        self.fragment_s = float(spec.copy_fragment_s)
        model = kv.spec.model
        layers = model.n_layers
        if kv.spec.parallel is not None:  # a pipeline stage holds its share of the layers
            layers = round(layers * kv.spec.parallel.stage_fraction(layers))  # ceil(L / stages), exact
        self.fragments_per_block = (layers * (1 if model.is_mla else 2)) if spec.copy_layout == "per_layer" else 1
        #: host time (s) of the copies submitted at the start of the instance's next step (writes of
        #: the step that ended, loads admitted), which that step waits for (``copy_fragment_s`` > 0)
        self.submit_s = 0.0
        #: host time (s) of the loads admitted in the scheduling pass under way, submitted before
        #: that pass's own step (vLLM: a step's load jobs go out before its forward pass)
        self.load_submit_s = 0.0
        #: the host is busy until then (s) with stores an idle engine submitted
        #: (vLLM: a step without a forward pass, ``kv_connector_no_forward``)
        self.host_busy_until_s = 0.0
        self._admission_loads = False  # set while try_load_admit takes a loading request's HBM hits

    # -------------------------------------------------------------------- conversations
    def conversation_of(self, st: "RequestState") -> Any:
        """The conversation ``st`` belongs to, for the ``session`` eviction policy: its session
        id when the workload gives one (>= 0); otherwise derived from its prefix keys as kvsched's
        session router does (docs/cluster-routing.md "Sessions"): a request continues the
        conversation of the earlier request whose whole chain of full-segment keys is the longest
        prefix of its own (a turn repeats the previous prompt), else it starts one. A conversation
        continues from its latest turn only (a chain two later requests extend is a template, not
        one conversation: the second starts its own); a request whose
        last key was seen before (its prompt adds nothing new, e.g. a shared system prompt alone) is
        no conversation later requests continue. Memoised per
        request; None without a session id or prefix keys, and when no tier evicts by session."""
        if not self._sessions:  # only the session policy reads conversations
            return None
        conv = self._conv_of_request.get(st.rid)
        if conv is not None or st.rid in self._conv_of_request:
            return conv
        sid = st.req.session_id
        if sid >= 0:
            conv = ("session", sid)
        elif st.hashes:
            chain_end = self._conv_by_chain_end
            n = st.n_cacheable_segments
            for key in reversed(st.hashes[:n]):
                conv = chain_end.pop(key, None)  # a conversation continues from its latest turn only:
                if conv is not None:  # a second request extending the same chain starts its own
                    break
            else:
                conv = ("request", st.rid)
            seen = self._seen_keys
            if n and st.hashes[n - 1] not in seen:  # a chain adding nothing new (e.g. only a shared
                chain_end[st.hashes[n - 1]] = conv  # system prompt) is no conversation to continue
            seen.update(st.hashes[:n])
        self._conv_of_request[st.rid] = conv
        return conv

    def peek_conversation(self, st: "RequestState") -> Any:
        """:meth:`conversation_of` without memoising it or claiming the chain it continues (an
        observer's look at a request that has not computed yet: the conversation its prefix
        chain continues now, else a new one)."""
        if not self._sessions:
            return None
        if st.rid in self._conv_of_request:
            return self._conv_of_request[st.rid]
        if st.req.session_id >= 0:
            return ("session", st.req.session_id)
        if not st.hashes:
            return None
        chain_end = self._conv_by_chain_end
        for key in reversed(st.hashes[:st.n_cacheable_segments]):
            conv = chain_end.get(key)
            if conv is not None:
                return conv
        return ("request", st.rid)

    # -------------------------------------------------------------------------- the future
    def set_future(self, workload: "Workload", arrivals_s: np.ndarray | None = None) -> None:
        """Index, for the ``clairvoyant`` reference, when each prefix hash is next used: the arrival
        times (s) of the window's requests whose prompt holds it."""
        off = np.asarray(workload.hash_offsets)
        hashes = np.asarray(workload.hashes)
        if not len(hashes):
            self._future = {}
            return
        from .request import _chain

        t = np.asarray(workload.arrival_s if arrivals_s is None else arrivals_s, dtype=np.float64)
        uses: dict[int, list[float]] = {}
        for i in range(len(t)):  # the chained keys the instances cache by (RequestState.hashes)
            a, b = int(off[i]), int(off[i + 1])
            if b > a:
                for key in _chain(tuple(int(h) for h in hashes[a:b])):
                    uses.setdefault(key, []).append(float(t[i]))
        self._future = {k: np.sort(np.asarray(v)) for k, v in uses.items()}

    def next_use_s(self, key: Any, now_s: float) -> float:
        """The first arrival after ``now_s`` whose prompt holds ``key`` (``inf``: none)."""
        ts = self._future.get(int(key)) if isinstance(key, (int, np.integer)) else None
        if ts is None:
            return math.inf
        i = bisect_right(ts, now_s)
        return float(ts[i]) if i < len(ts) else math.inf

    # ------------------------------------------------------------------------------ writes
    def _write_first(self, keys: list, n_blocks: int, creator_id: int, session_id: Any, now_s: float) -> None:
        """Write ``keys`` to the first listed tier (one copy) and charge the host time of the
        pieces it submits to the next step (``copy_fragment_s``)."""
        first = self.stores[0]
        before = first.bytes_written
        first.put_many(keys, n_blocks, creator_id, session_id, now_s, self._first_hops,
                       first_hop_s_per_block=self.fragments_per_block * self.fragment_s)
        if self.fragment_s > 0.0 and first.bytes_written > before:
            blocks = (first.bytes_written - before) // self.block_bytes
            self.submit_s += blocks * self.fragments_per_block * self.fragment_s

    def copy_floor_s(self, n_blocks: int) -> float:
        """The least time (s) a copy of ``n_blocks`` between HBM and the first listed tier takes:
        its pieces at ``copy_fragment_s`` each (0 when the cost is off)."""
        return n_blocks * self.fragments_per_block * self.fragment_s

    def take_submit_s(self) -> float:
        """The host time (s) of the stores pending submission (the writes of the steps before),
        which the next step waits for before its forward pass, cleared."""
        t, self.submit_s = self.submit_s, 0.0
        return t

    def take_load_submit_s(self) -> float:
        """The host time (s) of the loads admitted in this scheduling pass, cleared."""
        t, self.load_submit_s = self.load_submit_s, 0.0
        return t

    def on_computed(self, st: "RequestState", new_hashes: list, seg_blocks: int, now_s: float) -> None:
        """``st`` computed and cached ``new_hashes`` in HBM: write them through (threshold 1) or
        count their first use (selective)."""
        sess = self.conversation_of(st)
        self._session_of[st.rid] = sess
        if sess is not None:
            self.session_last_s[sess] = now_s
        th = self.threshold
        if th == 0:  # write-back: nothing until HBM evicts them
            return
        first = self.stores[0]
        if th == 1:
            self._write_first(new_hashes, seg_blocks, st.rid, sess, now_s)
            lands = self._write_lands
            if lands is not None:
                entries = first.entries
                for h in new_hashes:
                    e = entries.get(h)
                    if e is not None:
                        lands[h] = e.ready_s
            first.refresh(st.hashes[:st.next_seg], now_s)  # the prompt so far: its head the most recent
            return
        uses = self._uses
        due = []
        for h in new_hashes:
            n = uses[h] = uses.get(h, 0) + 1
            if n >= th:
                due.append(h)
        if due:
            self._write_first(due, seg_blocks, st.rid, sess, now_s)

    def on_hbm_hit(self, st: "RequestState", hashes, seg_blocks: int, creator_of: Callable[[int], int]) -> None:
        """An admission reused ``hashes`` from HBM: count a use (selective writes) and the
        conversation's activity."""
        now_s = self.now_s
        sess = self.conversation_of(st)
        if sess is not None:
            self.session_last_s[sess] = now_s
        if self.threshold == 1 and self.spec.write_hbm_hits:  # vLLM: the blocks the CPU store lacks
            # only at a first admission without a load: a load moves vLLM's store index past the
            # hit and loaded chunks (update_state_after_alloc, CHUNK_LEVEL policy), and the index is
            # not reset by a preemption (a resumed request stores only what it computes anew)
            if self._admission_loads or st.admissions > 0:
                return
            entries = self.stores[0].entries
            due = [h for h in hashes if h not in entries]
            if due:
                creator = creator_of(due[0])
                self._write_first(due, seg_blocks, creator, self._session_of.get(creator), now_s)
                lands = self._write_lands
                if lands is not None:
                    for h in due:
                        e = entries.get(h)
                        if e is not None:
                            lands[h] = e.ready_s
            return
        if self.threshold < 2:
            return
        uses, th, first = self._uses, self.threshold, self.stores[0]
        due = []
        for h in hashes:
            n = uses[h] = uses.get(h, 0) + 1
            if n >= th and h not in first.entries:
                due.append(h)
        if due:  # written as the request's own copy (the creator of each is rarely needed)
            creator = creator_of(due[0])
            self._write_first(due, seg_blocks, creator, self._session_of.get(creator), now_s)

    def forget_uses(self, evicted: list) -> None:
        """Selective writes: HBM evicted ``evicted`` ((hash, blocks, creator id)); a segment
        computed again later starts counting its uses anew (SGLang drops the evicted node, and its
        ``hit_count`` with it)."""
        uses = self._uses
        for h, _, _ in evicted:
            uses.pop(h, None)

    def fence_evicted(self, evicted: list) -> None:
        """``fence_pending_writes``: HBM evicted ``evicted`` ((hash, blocks, creator id)) for
        reuse; a segment whose write to the first listed tier has not landed holds the step until
        it lands (:attr:`fence_s`)."""
        lands = self._write_lands
        if lands is None:
            return
        fence = self.fence_s
        for h, _, _ in evicted:
            land = lands.pop(h, 0.0)
            if land > fence:
                fence = land
        self.fence_s = fence

    def on_hbm_evict(self, evicted: list) -> None:
        """Write-back: one HBM allocation evicted cached segments ``evicted`` ((hash, blocks,
        creator id), eviction order); copy them to the first listed tier, one copy per creator run."""
        now_s = self.now_s
        session_of = self._session_of
        i, n = 0, len(evicted)
        while i < n:
            _, nb, creator = evicted[i]
            j = i
            while j < n and evicted[j][1] == nb and evicted[j][2] == creator:
                j += 1
            self._write_first([e[0] for e in evicted[i:j]], nb, creator, session_of.get(creator), now_s)
            i = j

    def on_finished(self, st: "RequestState", now_s: float) -> None:
        """With ``offload_prompt_only`` false: write ``st``'s decode blocks (an entry no prompt
        hits). With retention control (:meth:`enable_retention`): queue ``st`` for a decision."""
        if self.retention_queue is not None:
            self.retention_queue.append((self._instance_id, st, now_s))
        if self.spec.offload_prompt_only:
            return
        bs = self.kv.bs
        n = -(-(st.prompt_tokens + st.generated) // bs) - (-(-st.prompt_tokens // bs))
        if n > 0:
            self._write_first([("decode", st.rid)], n, st.rid, self.conversation_of(st), now_s)

    # ---------------------------------------------------------------------------- retention
    def enable_retention(self, queue: list, instance_id: int) -> None:
        """Let a caller decide how long each conversation's entries stay (:meth:`retain`): index
        the stores' entries by conversation and append ``(instance id, request, finish time s)``
        to ``queue`` for every finished request. Call before the run starts (the conversations
        of entries already stored are unknown)."""
        self.retention_queue = queue
        self._instance_id = instance_id
        self._sessions = True
        for s in self.stores:
            if s.by_session is None:
                s.by_session = {}
                for key, e in s.entries.items():
                    s.by_session.setdefault(e.session_id, set()).add(key)

    def retain(self, st: "RequestState", kind: str, keep_s: float, now_s: float, hbm: str = "lru") -> None:
        """Apply a retention decision for the conversation of finished request ``st`` at ``now_s``
        in every listed tier (:mod:`.retention` defines the kinds), and for the HBM copies of its
        prompt's cached segments (``hbm``, :data:`.retention.HBM_CHOICES`):

        - ``"default"``: what it kept follows the tiers' eviction orders again (entries another
          conversation keeps stay kept until that one's deadline);
        - ``"keep"``: the segments of ``st``'s prompt stored in the tiers (shared prefixes another
          conversation wrote included: a hit needs the whole leading run) and the entries the
          conversation wrote, and those it writes later, leave the eviction orders until
          ``now_s + keep_s``. A write of an entry nobody keeps never evicts a kept one (it is
          skipped when nothing else is evictable); a kept conversation's write, a swap, or a tier
          holding nothing but kept entries evicts the earliest deadline first, a prefix's tail
          before its head;
        - ``"drop"``: the entries the conversation wrote that nobody keeps are evicted from every
          listed tier now, without demotion (shared prefixes others wrote stay);
        - ``"demote"``: those of them in the first listed tier move to the next one now (over the
          link; with one listed tier, as ``"drop"``).

        In HBM (``st``'s prompt segments cached there and referenced by nobody; the others are
        left as they are): ``"lru"`` ends the keep an earlier decision of this conversation gave
        them (they rejoin vLLM's LRU free queue at its head; one another conversation keeps stays
        kept until that one's deadline, as in the listed tiers); ``"keep"`` (with
        ``kind="keep"``) keeps them out of the LRU until ``now_s + keep_s``
        (:meth:`.kv_cache.BlockPool.keep_segments`: evicted only when nothing else is, never
        refusing an allocation; a reuse ends the keep); ``"evict_first"`` ends this
        conversation's keeps as ``"lru"`` and moves those nobody keeps to the LRU head, the
        prompt's tail first (their copies below stay, per ``write_policy``).

        Raises:
            ConfigError: an unknown kind or HBM choice, ``hbm="keep"`` without ``kind="keep"``,
                or a keep time that is not a finite number >= 0.
        """
        from .retention import HBM_CHOICES, RETENTION_KINDS

        require(kind in RETENTION_KINDS, "retention kind", kind, f"one of {', '.join(RETENTION_KINDS)}")
        require(isinstance(keep_s, (int, float)) and not isinstance(keep_s, bool) and math.isfinite(keep_s)
                and keep_s >= 0, "keep_s", keep_s, "a finite number of seconds >= 0")
        require(hbm in HBM_CHOICES and (hbm != "keep" or (kind == "keep" and keep_s > 0)), "hbm", hbm,
                f"one of {', '.join(HBM_CHOICES)} ('keep' only with kind 'keep' and keep_s > 0)")
        prompt = st.hashes[:st.n_cacheable_segments]
        pool = self.kv.hbm
        pool.expire_kept(now_s)
        conv = self.conversation_of(st)
        if hbm == "keep":
            self._hbm_keep(prompt, conv, now_s + keep_s)
        else:  # this conversation's HBM keeps end; a segment another one keeps stays kept
            others = self._hbm_unkeep(prompt, conv, now_s) if pool.kept_blocks else set()
            if hbm == "evict_first":
                self.hbm_evict_first_blocks += pool.evict_first([h for h in prompt if h not in others])
        if conv is None:
            return
        self.retention_decisions += 1
        until = now_s + keep_s if kind == "keep" and keep_s > 0 else -math.inf
        if until > now_s:
            self.keep_until_s[conv] = until
        else:
            self.keep_until_s.pop(conv, None)
        for store in self.stores:
            store.unkeep(conv, now_s)
        if kind == "drop":
            for store in self.stores:
                store.evict_keys(store.own_unkept(conv), now_s, demote=False)
        elif kind == "demote":
            first = self.stores[0]
            first.evict_keys(first.own_unkept(conv), now_s, demote=True)
        elif until > now_s:
            chain = list(st.hashes[:st.n_cacheable_segments])
            in_chain = set(chain)
            for store in self.stores:
                own = store.by_session.get(conv, ()) if store.by_session is not None else ()
                rest = sorted((k for k in own if k not in in_chain), key=store._chain_rank)
                store.keep_keys(conv, rest + chain[::-1], until, now_s)  # a prefix's tail first

    def _hbm_keep(self, prompt, conv: Any, until_s: float) -> None:
        """``hbm="keep"``: keep ``prompt``'s unreferenced HBM segments until ``until_s`` for
        ``conv`` (a segment another conversation keeps longer keeps its deadline)."""
        pool, keepers = self.kv.hbm, self._hbm_keepers
        fresh = {h for h in prompt if pool.kept_until(h) is None}  # their keepers start anew
        self.hbm_kept_blocks += pool.keep_segments(prompt[::-1], until_s)  # tail first: evicted first
        for h in prompt:
            if pool.kept_until(h) is not None:
                k = keepers[h] = {} if h in fresh or h not in keepers else keepers[h]
                k[conv] = until_s

    def _hbm_unkeep(self, prompt, conv: Any, now_s: float) -> set:
        """End ``conv``'s HBM keeps of ``prompt``'s segments: a segment nobody else keeps past
        ``now_s`` rejoins the LRU at its head; one another conversation keeps gets that one's
        latest deadline (as the listed tiers' ``keepers``). Returns the segments still kept."""
        pool, keepers = self.kv.hbm, self._hbm_keepers
        ended, others = [], set()
        for h in prompt:
            until = pool.kept_until(h)
            if until is None:
                keepers.pop(h, None)  # its keep ended (a reuse, an eviction, its deadline)
                continue
            k = keepers.get(h, {})
            k.pop(conv, None)
            for c in [c for c, u in k.items() if u <= now_s]:
                del k[c]
            if k:
                others.add(h)
                latest = max(k.values())
                if latest != until:
                    pool.rekeep(h, latest)
            else:
                keepers.pop(h, None)
                ended.append(h)
        pool.unkeep_segments(ended)
        return others

    def session_blocks(self, st: "RequestState", conv: Any = None) -> list[int]:
        """Blocks each listed tier holds of the conversation of ``st`` (or ``conv`` when given):
        the segments of ``st``'s prompt stored there (shared prefixes included) and the entries
        the conversation wrote."""
        if conv is None:
            conv = self.conversation_of(st)
        chain = set(st.hashes[:st.n_cacheable_segments])
        out = []
        for s in self.stores:
            keys = chain.union(s.by_session.get(conv, ()) if s.by_session is not None else ())
            out.append(sum(s.entries[k].n_blocks for k in keys if k in s.entries))
        return out

    # --------------------------------------------------------------------------- prefetch
    def promotable(self, st: "RequestState", now_s: float) -> list[tuple[Any, "PrefixStore"]]:
        """``(segment key, store)`` of the segments of ``st``'s prompt a :meth:`prefetch` would
        copy up: those of the leading run after its HBM hit (as an admission now would look them
        up, :meth:`.kv_manager.KVManager.cached_prefix`) held, landed, only by a listed tier below
        the first one (and not on its way into the first), whose copy path crosses the first.
        Empty with one listed tier."""
        stores = self.stores
        if len(stores) < 2:
            return []
        hit, max_seg = self.kv.cached_prefix(st, st.prompt_tokens + st.generated)
        keys = st.hashes[hit:max_seg]
        first = stores[0]
        out = []
        for h, s in zip(keys, self._run(keys, now_s)):
            if s is not first and h not in first.entries and first.tier in s.tier.path:
                out.append((h, s))
        return out

    def prefetch(self, st: "RequestState", now_s: float) -> int:
        """Copy :meth:`promotable` segments of ``st``'s prompt into the first listed tier now (e.g.
        NVMe -> host DRAM), so its admission loads them from there: CachedAttention's
        scheduler-aware fetching (Gao et al., USENIX ATC 2024, section 3.4: a queued job's KV is
        fetched from disk to host memory before it runs). One copy per source tier over the read
        links between it and the first tier, queued FIFO behind transfers already there (an
        admission load from that tier queues behind it too); the entries land in the first tier
        when it ends (loads before then still read the lower tier), stay in their own tier (a copy),
        and are written like any other entry (room made by the first tier's eviction order; a
        tier that cannot make room skips the write). Returns the segments copied."""
        pairs = self.promotable(st, now_s)
        self.prefetch_decisions += 1
        if not pairs:
            return 0
        first = self.stores[0]
        seg_blocks = st.seg_tokens // self.kv.bs
        transfer = self.kv.cost.transfer_time_s
        by_store: dict[PrefixStore, list] = {}
        for h, s in pairs:
            by_store.setdefault(s, []).append(h)
        # every source read before any write: making room in the first tier demotes down the
        # tiers, which may evict a source entry of this or another tier (three listed tiers)
        copies = []
        for store, keys in by_store.items():
            n_blocks = len(keys) * seg_blocks
            nbytes = n_blocks * self.block_bytes
            t = now_s
            for hop in reversed(store.tier.path):
                if hop is first.tier:
                    break
                t = hop.read(t, transfer(n_blocks, hop.links()[1]), nbytes, "prefix_prefetch", st.rid)
            store.prefetches += 1
            store.bytes_prefetched += nbytes
            owners = []
            for h in keys:
                e = store.entries[h]
                owners.append((e.creator_id, e.session_id))
                store.use(h, now_s)
            copies.append((keys, owners, t))
        copied = 0
        for keys, owners, t in copies:
            i = 0
            while i < len(keys):  # one write per run of the same creator and conversation
                j = i
                while j < len(keys) and owners[j] == owners[i]:
                    j += 1
                if first.put_many(keys[i:j], seg_blocks, owners[i][0], owners[i][1], now_s, [], t):
                    copied += j - i
                i = j
        return copied

    # ------------------------------------------------------------------------------- loads
    def _run(self, hashes, now_s: float) -> list[PrefixStore]:
        """For the leading run of ``hashes`` stored below HBM (landed by ``now_s``), the highest
        listed tier holding each."""
        out = []
        stores = self.stores
        for h in hashes:
            for s in stores:
                if s.ready(h, now_s):
                    out.append(s)
                    break
            else:
                break
        return out

    def _load_end_s(self, groups: dict, seg_blocks: int, now_s: float, reserve: bool,
                    request_id: int = -1) -> float:
        """When loads of ``groups`` (store -> segments) land in HBM: each group's copy crosses the
        read links of its tier's path bottom up, queued FIFO; the groups go in the run's order.
        ``reserve`` False predicts without queueing anything; ``request_id`` (the request loading)
        labels the copies for an observer."""
        transfer = self.kv.cost.transfer_time_s
        busy: dict[int, float] = {}
        end = now_s
        for store, n_segs in groups.items():
            n_blocks = n_segs * seg_blocks
            nbytes = n_blocks * self.block_bytes
            t = now_s
            path = store.tier.path
            for hop in reversed(path):
                d = transfer(n_blocks, hop.links()[1])
                if hop is path[0]:  # into HBM: its pieces (copy_fragment_s)
                    floor_s = self.copy_floor_s(n_blocks)
                    if floor_s > d:
                        d = floor_s
                if reserve:
                    t = hop.read(t, d, nbytes, "prefix_load", request_id)
                else:
                    q = hop.read_q
                    start = max(t, busy.get(id(q), q.busy_until_s))
                    t = busy[id(q)] = start + d
            end = t if t > end else end
        return end

    def try_load_admit(self, inst, st: "RequestState", hit: int, max_seg: int, now_s: float) -> bool:
        """Admit ``st`` on ``inst`` with the segments after its ``hit`` HBM ones loaded from the
        listed tiers (called by :meth:`~.admission.Admitter.try_admit`). Returns ``True`` when it
        was admitted with a load (it holds its blocks and waits for its copy), ``False`` when the
        instance should admit it the usual way (nothing below HBM, recompute predicted faster, or
        no HBM room for the loaded blocks)."""
        from .shared_kv import FETCH_EVENT

        run = self._run(st.hashes[hit:max_seg], now_s)
        f = len(run)
        if f == 0:
            return False
        seg = st.seg_tokens
        kv = inst.kv
        seg_blocks = seg // kv.bs
        groups: dict[PrefixStore, int] = {}
        for s in run:
            groups[s] = groups.get(s, 0) + 1
        need = f * seg_blocks
        hit_hashes = st.hashes[:hit]
        if need > kv.hbm.available_blocks - kv.evictable_hit_blocks(hit_hashes):
            return False  # no room now (checked first: a blocked head is asked again every step)
        if self.spec.load_policy == "cost":
            total = st.prompt_tokens + st.generated
            recompute_s = float(inst.cost.prefill_time_s(total, hit * seg))
            load_s = (self._load_end_s(groups, seg_blocks, now_s, False) - now_s
                      + float(inst.cost.prefill_time_s(total, (hit + f) * seg)))
            if load_s >= recompute_s:
                self.recompute_chosen += 1
                return False
        first_admission = st.admissions == 0
        # before anything below can evict them; the tail first, so the head is the most recent
        for h, s in reversed(list(zip(st.hashes[hit:hit + f], run))):
            e = s.entries[h]
            if first_admission and e.creator_id != st.rid:
                s.hit_tokens += seg
            else:
                s.self_hit_tokens += seg
            s.use(h, now_s)
        # the HBM hits (a selective write may follow) and the HBM blocks (a write-back may follow):
        # either may evict an entry just read, whose copy is delivered all the same (the read is
        # reserved below, from what was read now)
        self._admission_loads = True  # on_hbm_hit: this admission loads (no stores of its hits)
        try:
            kv.acquire_prefix(st, hit_hashes)
        finally:
            self._admission_loads = False
        ok = kv.allocate(need)
        assert ok, "prefix_offload: load allocation failed after the availability check"
        from .kv_manager import add_tier_bytes

        for s, n in groups.items():
            s.loads += 1
            s.loaded_segments += n
            s.bytes_loaded += n * seg_blocks * self.block_bytes
            add_tier_bytes(st, s.tier.name + "_to_hbm", n * seg_blocks * self.block_bytes)  # the record's column
        ready = self._load_end_s(groups, seg_blocks, now_s, True, st.rid)
        if self.fragment_s > 0.0:  # submitted on the engine's thread before this step's forward pass
            self.load_submit_s += self.copy_floor_s(need)
        sess = self.conversation_of(st)
        if sess is not None:
            self.session_last_s[sess] = now_s
        # next_seg = hit: the loaded segments join HBM's prefix cache at the request's next step
        inst.admitter.take_residency(st, hit_hashes, hit * seg_blocks, need, hit, (hit + f) * seg, now_s)
        st.ready_s = ready
        inst.pending_events.append((ready, FETCH_EVENT, st))
        return True

    # ------------------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert every store's blocks match its pool."""
        for s in self.stores:
            s.check()

    def stats(self) -> dict[str, Any]:
        """Counters per listed tier plus the spec (JSON-ready)."""
        out = {"write_policy": self.spec.write_policy, "load_policy": self.spec.load_policy,
               "recompute_chosen": self.recompute_chosen,
               "tiers": {s.tier.name: s.stats() for s in self.stores}}
        if self.retention_queue is not None:
            out["retention_decisions"] = self.retention_decisions
        if self.hbm_kept_blocks or self.hbm_evict_first_blocks:  # HBM retention choices were made
            out["hbm_kept_blocks"] = self.hbm_kept_blocks
            out["hbm_evict_first_blocks"] = self.hbm_evict_first_blocks
        if self.prefetch_decisions:
            out["prefetch_decisions"] = self.prefetch_decisions
        return out
