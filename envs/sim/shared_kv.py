"""Cluster KV tier: an NVMe-backed KV pool shared by all instances over a network link.

Mechanism (REFERENCE.md §9.2, NVIDIA CMX: cluster-level NVMe KV offload reached over the
network; the same role as Mooncake Store or LMCache's remote backend):

- **Contents.** Prefix segments (one trace hash block, ``hash_block_tokens`` tokens, the unit
  of the instances' prefix caches; :mod:`kvsched.envs.sim.kv_cache`) keyed by their chained
  prefix key, so a segment found in the pool is valid only after the same prefix.
- **Write policy: write-through on prefill.** When an instance finishes computing a prompt
  segment and registers it in its HBM prefix cache, it also publishes it to the pool: an
  asynchronous copy out over the instance's network link, then into the pool's NVMe write
  queue (SGLang HiCache's ``write_through`` policy and LMCache's store-after-prefill, REFERENCE
  §5.4; the copy runs behind compute and never stalls a step). A segment becomes fetchable only
  when its write has landed. Segments already in the pool (or on their way) are not written
  again (content-addressed deduplication, as Mooncake Store and LMCache do). A write is
  dropped when the pool's NVMe write queue is already more than ``max_write_backlog_s`` behind
  (a bounded offload queue [inferred]: otherwise a cluster that computes new prefixes faster
  than the pool's drives absorb them would publish ever later, unboundedly).
- **Capacity and eviction.** ``capacity_bytes`` holds ``floor(capacity_bytes / kv_bytes_per_block)``
  KV blocks. A write that does not fit evicts least-recently-used segments (a fetch or a
  repeated publish refreshes a segment); a segment larger than the whole pool is not written.
  Invariant (:meth:`SharedKVPool.check`): ``free_blocks + used_blocks == capacity_blocks`` and
  ``used_blocks`` equals the blocks of the stored segments.
- **Fetch vs recompute.** When an instance admits a request whose prompt continues past what
  its own HBM prefix cache holds, and the pool holds the next ``f`` segments, the instance
  compares (``fetch_policy="cost"``) the predicted time to the end of the request's prefill
  both ways (REFERENCE §5.4): recompute = ``T̂_prefill(total, cached)``; fetch = the fetch time
  -- pool NVMe read, then the network link into the instance, each ``latency + bytes /
  bandwidth`` and queued behind the transfers already on them -- plus ``T̂_prefill(total,
  cached + f * seg)``, with ``T̂_prefill`` the cost model's lone chunked prefill
  (:meth:`CostModel.prefill_time_s`, roofline of §5.3). The cheaper one wins. A fetch allocates the HBM blocks, the
  request waits (admitted, not runnable) until the copy lands in HBM (GPUDirect RDMA: no PCIe
  hop is charged), then prefills the rest; the fetched segments join the instance's prefix
  cache at its next step. ``fetch_policy="always"`` fetches whatever is available,
  ``"never"`` only fills the pool (ablation).
- **Accounting.** Fetched tokens are *shared-tier hits*, counted apart from the instance's
  own prefix-cache hits. Like those, they count only at a request's first admission and only
  for segments another request wrote: a preempted request fetching its own work back is not a
  hit. Counters: bytes and segments fetched and written, hit tokens, fetch and recompute
  decisions, evictions.

Links (defaults): network ``cmx-400g``, 50 GB/s and 10 µs per operation (400 Gb/s per node,
the low end of REFERENCE §9.2's 400-800 Gb/s [mem]; the per-operation latency is an RDMA
round trip [inferred]); pool NVMe read / write: the NVMe Gen4 presets (6 / 4 GB/s, 80 µs,
REFERENCE §5.2) -- a pool of one drive; give inline :class:`LinkSpec` values for a striped pool.
With these defaults a fetch of Llama-3.1-8B KV costs about 24.6 µs per token plus 90 µs per
operation; recomputing costs about 25 µs per token plus the attention term on an H100 with the
plain roofline (``CostParams()``), and a short remainder still pays a step's weight read. So,
with an 8,192-token budget, idle links and nothing cached, a 512- or 1,024-token prefix is
recomputed (18 vs 20 ms, 32 vs 33 ms), from 1,536 tokens on it is fetched, and at 64k tokens
the fetch path takes 1.6 s against 3.6 s (REFERENCE §5.4: "about break-even with recompute for
short contexts and much better for long ones"). With the calibrated H100 parameters (an
``InstanceSpec`` without ``cost``; calibration version 2, MFU 0.78) recomputing is cheaper per
token and the fetch wins only from about 15k tokens (29 segments of 512; 64k: 2.8 s recompute vs
1.6 s fetch).

Limits: one network link per instance whatever its TP degree; the pool's NVMe read and write
queues are shared by the cluster; reads are charged when reserved (a segment evicted while a
fetch of it is queued is still delivered); all instances must share the model, KV dtype and
block size (KV is only reusable between identical models).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import ConfigError, UnknownPresetError, require, bounded_repr
from .kv_cache import LinkQueue
from .request import RequestState
from .hardware import LINK_PRESETS, LinkSpec, get_link

#: Instance event kind for a finished shared-tier fetch (handled by the cluster).
FETCH_EVENT = "shared_fetch"
FETCH_POLICIES: tuple[str, ...] = ("cost", "always", "never")
CMX_400G = LinkSpec("cmx-400g", 50e9, 10e-6)
"""400 Gb/s network link per node (REFERENCE §9.2, 400-800 Gb/s [mem]); 10 µs per operation [inferred]."""


def _get_shared_link(name: str) -> LinkSpec:
    """A link preset for the tier: ``cmx-400g`` (the default network) or any :data:`LINK_PRESETS` name.

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    if isinstance(name, str) and name.lower() == CMX_400G.name:
        return CMX_400G
    try:
        return get_link(name)
    except UnknownPresetError:
        raise UnknownPresetError(f"unknown link {bounded_repr(name)}; "
                                 f"known: {CMX_400G.name}, {', '.join(LINK_PRESETS)}") from None


@dataclass(frozen=True)
class SharedKVSpec:
    """The cluster KV tier (see the module docstring).

    Attributes:
        capacity_bytes: KV bytes the pool holds (> 0; whole-model KV, all TP ranks).
        network: link between each instance and the pool (one per instance, each direction);
            in a scenario a preset name (``cmx-400g``, the default, or a link preset) or inline fields.
        pool_read, pool_write: the pool's NVMe read and write bandwidth (shared by the cluster).
        fetch_policy: "cost" (fetch when predicted cheaper than recompute), "always" or "never".
        max_write_backlog_s: drop a write when the pool's write queue is busy for longer than
            this from now (s, >= 0; inf: never drop), default 10.0 [inferred].

    Raises:
        ConfigError: a non-positive or non-finite capacity, a link that is not a LinkSpec, an
            unknown fetch policy.
    """

    capacity_bytes: float
    network: LinkSpec = CMX_400G
    pool_read: LinkSpec = LINK_PRESETS["nvme_gen4_read"]
    pool_write: LinkSpec = LINK_PRESETS["nvme_gen4_write"]
    fetch_policy: str = "cost"
    max_write_backlog_s: float = 10.0

    def __post_init__(self) -> None:
        c = self.capacity_bytes
        require(not isinstance(c, bool) and isinstance(c, (int, float)) and math.isfinite(c) and c > 0,
                "SharedKVSpec.capacity_bytes", c, "a finite number of bytes > 0")
        for name in ("network", "pool_read", "pool_write"):
            require(isinstance(getattr(self, name), LinkSpec), f"SharedKVSpec.{name}", getattr(self, name),
                    "a LinkSpec (or, in a scenario, a link preset name or an inline mapping)")
        require(self.fetch_policy in FETCH_POLICIES, "SharedKVSpec.fetch_policy", self.fetch_policy,
                f"one of {', '.join(FETCH_POLICIES)}")
        b = self.max_write_backlog_s
        require(not isinstance(b, bool) and isinstance(b, (int, float)) and not math.isnan(b) and b >= 0,
                "SharedKVSpec.max_write_backlog_s", b, "a number of seconds >= 0 (inf: never drop a write)")

    @staticmethod
    def from_dict(d: Mapping[str, Any], source: str = "shared_kv") -> "SharedKVSpec":
        """Build from a mapping (scenario YAML): links as preset names or inline LinkSpec fields.

        Raises:
            ConfigError: not a mapping, unknown or missing keys, invalid values.
        """
        from .spec_io import _preset_or_inline
        from .spec_validation import as_float as _as_float

        if not isinstance(d, Mapping):
            raise ConfigError(f"{source} must be a mapping of SharedKVSpec fields, got {type(d).__name__}")
        allowed = ("capacity_bytes", "network", "pool_read", "pool_write", "fetch_policy", "max_write_backlog_s")
        unknown = [k for k in d if k not in allowed]
        if unknown:
            raise ConfigError(f"{source}: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(allowed)}")
        if "capacity_bytes" not in d:
            raise ConfigError(f"{source}: missing key 'capacity_bytes'")
        kw: dict[str, Any] = {"capacity_bytes": _as_float(d["capacity_bytes"], f"{source}.capacity_bytes")}
        for key in ("network", "pool_read", "pool_write"):
            if key in d:
                kw[key] = _preset_or_inline(d[key], _get_shared_link, LinkSpec, f"{source}.{key}")
        if "fetch_policy" in d:
            kw["fetch_policy"] = d["fetch_policy"]
        if "max_write_backlog_s" in d:
            kw["max_write_backlog_s"] = _as_float(d["max_write_backlog_s"], f"{source}.max_write_backlog_s")
        try:
            return SharedKVSpec(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


@dataclass(slots=True)
class _Entry:
    n_blocks: int
    ready_s: float
    creator_id: int


class SharedKVPool:
    """The shared pool of one cluster run (state, link queues, counters).

    Args:
        spec: the tier's configuration.
        instances: the cluster's instances (same model, KV dtype, block size, prefix caching on).

    Raises:
        ConfigError: instances that cannot share KV, prefix caching off, or a pool smaller than
            one KV block.
    """

    def __init__(self, spec: SharedKVSpec, instances: Sequence) -> None:
        first = instances[0].spec
        for inst in instances:
            s = inst.spec
            if (s.model, s.kv_dtype_bytes, s.block_size_tokens) != (first.model, first.kv_dtype_bytes,
                                                                  first.block_size_tokens):
                raise ConfigError(
                    f"shared_kv: instance {inst.instance_id} ({s.model.name}, kv {s.kv_dtype_bytes} B, block "
                    f"{s.block_size_tokens}) cannot share KV with instance 0 ({first.model.name}, kv "
                    f"{first.kv_dtype_bytes} B, block {first.block_size_tokens}): every instance must serve the "
                    "same model with the same KV dtype and block size")
            if not s.enable_prefix_caching:
                raise ConfigError(f"shared_kv needs enable_prefix_caching=True on every instance "
                                  f"(instance {inst.instance_id} has it off)")
        self.spec = spec
        self.block_bytes = int(round(first.kv_bytes_per_block))
        self.capacity_blocks = int(spec.capacity_bytes // self.block_bytes)
        if self.capacity_blocks < 1:
            raise ConfigError(f"shared_kv.capacity_bytes={bounded_repr(spec.capacity_bytes)} holds no KV block "
                              f"({self.block_bytes} bytes each); expected >= {self.block_bytes}")
        self.free_blocks = self.capacity_blocks
        self.used_blocks = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU first
        n = len(instances)
        self.net_in = [LinkQueue(f"shared_net_in_{i}") for i in range(n)]
        self.net_out = [LinkQueue(f"shared_net_out_{i}") for i in range(n)]
        self.pool_read = LinkQueue("shared_pool_read")
        self.pool_write = LinkQueue("shared_pool_write")
        # counters
        self.fetches = 0
        self.fetched_segments = 0
        self.bytes_fetched = 0
        self.hit_tokens = 0
        self.self_hit_tokens = 0
        self.recompute_chosen = 0
        self.writes = 0
        self.bytes_written = 0
        self.evicted_segments = 0
        self.skipped_writes = 0  # segments larger than the pool, or dropped behind a full write queue

    # ------------------------------------------------------------------------------ queries
    def cached_prefix_segments(self, keys: Sequence[int], limit: int, now_s: float = math.inf) -> int:
        """Leading run of ``keys[:limit]`` stored in the pool and written by ``now_s``."""
        n = 0
        entries = self._entries
        for k in keys[:limit]:
            e = entries.get(k)
            if e is None or e.ready_s > now_s:
                break
            n += 1
        return n

    def busy_until_s(self, instance_id: int) -> float:
        """When the links a fetch into ``instance_id`` would use are free."""
        a, b = self.net_in[instance_id].busy_until_s, self.pool_read.busy_until_s
        return a if a > b else b

    def check(self) -> None:
        """Assert block conservation of the pool."""
        held = sum(e.n_blocks for e in self._entries.values())
        if self.free_blocks + self.used_blocks != self.capacity_blocks or held != self.used_blocks \
                or min(self.free_blocks, self.used_blocks) < 0:
            raise AssertionError(f"shared_kv: free {self.free_blocks} + used {self.used_blocks} != capacity "
                                 f"{self.capacity_blocks} or stored segments hold {held}")

    def stats(self) -> dict[str, Any]:
        """Counters for the run summary (bytes, segments, tokens; JSON-ready)."""
        return {
            "capacity_blocks": self.capacity_blocks, "used_blocks": self.used_blocks,
            "fetches": self.fetches, "fetched_segments": self.fetched_segments,
            "bytes_fetched": self.bytes_fetched, "hit_tokens": self.hit_tokens,
            "self_hit_tokens": self.self_hit_tokens, "recompute_chosen": self.recompute_chosen,
            "writes": self.writes, "bytes_written": self.bytes_written,
            "evicted_segments": self.evicted_segments, "skipped_writes": self.skipped_writes,
            "fetch_policy": self.spec.fetch_policy,
        }

    # ------------------------------------------------------------------------------ writes
    def publish(self, inst, key: int, n_blocks: int, creator_id: int, now_s: float) -> None:
        """Write-through of a segment ``inst`` just computed (no-op when already stored)."""
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
            return
        if n_blocks > self.capacity_blocks or self.pool_write.busy_until_s - now_s > self.spec.max_write_backlog_s:
            self.skipped_writes += 1
            return
        while self.free_blocks < n_blocks:
            _, old = self._entries.popitem(last=False)
            self.free_blocks += old.n_blocks
            self.used_blocks -= old.n_blocks
            self.evicted_segments += 1
        nbytes = n_blocks * self.block_bytes
        spec = self.spec
        _, out_end = self.net_out[inst.instance_id].reserve(now_s, float(spec.network.transfer_time_s(nbytes)), nbytes,
                                                            "shared_write", creator_id)
        _, ready = self.pool_write.reserve(out_end, float(spec.pool_write.transfer_time_s(nbytes)), nbytes,
                                           "shared_write", creator_id)
        self._entries[key] = _Entry(n_blocks, ready, creator_id)
        self.free_blocks -= n_blocks
        self.used_blocks += n_blocks
        self.writes += 1
        self.bytes_written += nbytes

    # ------------------------------------------------------------------------------ fetches
    def fetch_time_s(self, instance_id: int, n_bytes: int, now_s: float) -> float:
        """Predicted seconds from ``now_s`` until ``n_bytes`` from the pool land in the instance's HBM."""
        spec = self.spec
        start = max(now_s, self.pool_read.busy_until_s)
        t1 = start + float(spec.pool_read.transfer_time_s(n_bytes))
        t2 = max(t1, self.net_in[instance_id].busy_until_s) + float(spec.network.transfer_time_s(n_bytes))
        return t2 - now_s

    def decide(self, cost, instance_id: int, total_tokens: int, cached_tokens: int, fetch_tokens: int,
               now_s: float) -> tuple[float, float]:
        """Predicted seconds to the end of the prefill: ``(recompute_s, fetch_s)`` (see module doc).

        ``recompute_s = T̂_prefill(total, cached)``; ``fetch_s = fetch time + T̂_prefill(total,
        cached + fetched)`` with :meth:`CostModel.prefill_time_s` (lone chunked prefill, REFERENCE
        §1.2 / §5.3) and :meth:`fetch_time_s` (link queues included).
        """
        nbytes = fetch_tokens // cost.spec.block_size_tokens * self.block_bytes
        recompute = float(cost.prefill_time_s(total_tokens, cached_tokens))
        fetch = (self.fetch_time_s(instance_id, nbytes, now_s)
                 + float(cost.prefill_time_s(total_tokens, cached_tokens + fetch_tokens)))
        return recompute, fetch

    def try_fetch_admit(self, inst, st: RequestState, hit: int, max_seg: int, now_s: float) -> bool:
        """Admit ``st`` on ``inst`` with the segments after its ``hit`` local ones fetched from the pool.

        Called by :meth:`~.admission.Admitter.try_admit` after the local prefix lookup (``hit`` leading
        segments in HBM, at most ``max_seg`` usable). Returns ``True`` when the request was
        admitted with a fetch (it holds its blocks and waits for the copy), ``False`` when the
        instance should admit it the usual way (nothing to fetch, recompute is cheaper, or no
        room for the fetched blocks).
        """
        if hit >= max_seg or self.spec.fetch_policy == "never":
            return False
        f = self.cached_prefix_segments(st.hashes[hit:], max_seg - hit, now_s)
        if f == 0:
            return False
        seg = st.seg_tokens
        seg_blocks = seg // inst.bs
        need = f * seg_blocks
        nbytes = need * self.block_bytes
        if self.spec.fetch_policy == "cost":
            recompute_s, fetch_s = self.decide(inst.cost, inst.instance_id, st.prompt_tokens + st.generated,
                                               hit * seg, f * seg, now_s)
            if fetch_s >= recompute_s:
                self.recompute_chosen += 1
                return False
        kv = inst.kv
        hit_hashes = st.hashes[:hit]
        if need > kv.hbm.available_blocks - kv.evictable_hit_blocks(hit_hashes):
            return False
        first_admission = st.admissions == 0
        kv.acquire_prefix(st, hit_hashes)  # the local hits, counted as the instance counts them
        for h in st.hashes[hit:hit + f]:
            e = self._entries[h]
            self._entries.move_to_end(h)
            if first_admission and e.creator_id != st.rid:
                self.hit_tokens += seg
            else:
                self.self_hit_tokens += seg
        ok = kv.allocate(need)
        assert ok, "shared_kv: fetch allocation failed after the availability check"
        pool_t = float(self.spec.pool_read.transfer_time_s(nbytes))
        _, t1 = self.pool_read.reserve(now_s, pool_t, nbytes, "shared_fetch", st.rid)
        _, ready = self.net_in[inst.instance_id].reserve(t1, float(self.spec.network.transfer_time_s(nbytes)), nbytes,
                                                         "shared_fetch", st.rid)
        self.fetches += 1
        self.fetched_segments += f
        self.bytes_fetched += nbytes
        covered = (hit + f) * seg
        # next_seg = hit: the fetched segments join the prefix cache at the request's next step
        inst.admitter.take_residency(st, hit_hashes, hit * seg_blocks, need, hit, covered, now_s)
        st.ready_s = ready
        inst.pending_events.append((ready, FETCH_EVENT, st))
        return True
