"""What a cluster router may see: a per-instance table of the cluster's state at one arrival.

The cluster (:mod:`kvsched.envs.sim.cluster`) calls ``router.route(table)`` once per arriving
request, before any instance scheduler acts, and sends the request to instance
``table.instance_id[row]`` for the returned ``row``. A :class:`RouterTable` holds:

* **the arriving request** as a router sees it: ``request_id``, ``arrival_s``,
  ``prompt_tokens``, ``session_id`` (-1 when the trace has none), ``prefix_keys`` (the
  request's chained prefix-block keys, one per ``prefix_block_tokens`` prompt tokens, as vLLM's
  KV events and llm-d's / Dynamo's indexers see block hashes) and ``prefix_blocks`` (how many of
  them lie fully inside the prompt). Never the output length: it is hidden from routers, also
  when a scenario shows oracle lengths to instance schedulers.
* **one row per instance**, NumPy columns of shape ``(n_instances,)``:

  ============================  =================================================================
  ``instance_id``               int64, index in the cluster
  ``waiting``                   int64, requests queued, not yet admitted (incl. recompute-preempted)
  ``swapped``                   int64, requests swapped/offloaded out of HBM
  ``queue_len``                 int64, ``waiting + swapped``
  ``running``                   int64, requests holding KV in HBM (the running batch)
  ``max_num_seqs``              int64, the instance's batch limit (vLLM ``--max-num-seqs``)
  ``capacity_blocks_hbm``       int64, HBM KV blocks of the instance
  ``free_blocks_hbm``           int64, HBM blocks an allocation could take (free + evictable cache)
  ``free_blocks_dram``          int64, same for the DRAM tier (0 when absent)
  ``free_blocks_nvme``          int64, same for the NVMe tier (0 when absent); an extra tier
                                ``<t>`` adds ``free_blocks_<t>`` (0 on instances without it)
  ``used_blocks_hbm``           int64, HBM blocks referenced by requests (Dynamo's active blocks)
  ``kv_utilization``            float64, ``used_blocks_hbm / capacity_blocks_hbm`` in [0, 1]
                                (vLLM's ``gpu_cache_usage_perc``, what llm-d's kv-cache scorer reads)
  ``pending_prefill_tokens``    int64, prompt tokens still to compute: waiting requests' whole
                                uncomputed prompt + unfinished prefills of running requests
  ``link_backlog_s``            float64, seconds until the busiest of the instance's links
                                (PCIe both ways, NVMe read/write, shared-tier network) is free
  ``prefix_overlap_blocks``     int64, leading prefix blocks of the request cached in the
                                instance's HBM prefix cache (KV blocks of ``block_size_tokens``)
  ``prefix_overlap_tokens``     int64, the same in tokens
  ``prefix_overlap_segments``   int64, the same in ``prefix_block_tokens`` units (trace hash blocks)
  ``block_size_tokens``         int64, the instance's KV block size
  ============================  =================================================================

  and two cluster-wide values: ``shared_overlap_segments`` (leading prefix blocks held by the
  shared cluster KV tier and written by now, :mod:`kvsched.envs.sim.shared_kv`; 0 without one; live
  even with a delay) and
  ``snapshot_s`` (when the instance columns were measured; ``now_s - snapshot_s`` is their age).

**Stale information** (issue #5): with ``delay_s > 0`` the instance columns -- including which
prefix blocks each instance caches -- come from a snapshot that is refreshed at most every
``delay_s`` simulated seconds: at the first arrival at or after each refresh boundary
``k * delay_s``. Routers in between see the old snapshot and not their own recent decisions, so a
burst of arrivals can pile onto the instance that looked least loaded (real routers poll metrics
or consume KV events with a lag: llm-d's scorers read scraped metrics, Dynamo's indexer consumes
KV events asynchronously). Deterministic: the snapshot times depend only on arrival times, so
results do not depend on fast-forwarding (instance state is current at every arrival).

Columns are computed lazily on first access (live mode), so a round-robin router pays nothing.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

from .errors import ConfigError, bounded_repr

#: Instance columns of a :class:`RouterTable` (all of shape ``(n_instances,)``).
INSTANCE_COLUMNS: tuple[str, ...] = (
    "instance_id", "waiting", "swapped", "queue_len", "running", "max_num_seqs", "capacity_blocks_hbm",
    "free_blocks_hbm", "free_blocks_dram", "free_blocks_nvme", "used_blocks_hbm", "kv_utilization",
    "pending_prefill_tokens", "link_backlog_s", "block_size_tokens",
)


def instance_columns(instances: Sequence) -> tuple[str, ...]:
    """Instance column names of a router table over ``instances``: :data:`INSTANCE_COLUMNS` plus
    ``free_blocks_<tier>`` of every extra tier any instance has (tiers as data)."""
    extra: list[str] = []
    for inst in instances:
        for t in inst.kv.tiers[1:]:
            col = f"free_blocks_{t.name}"
            if col not in INSTANCE_COLUMNS and col not in extra and t.name != "pnm":
                extra.append(col)
    return INSTANCE_COLUMNS + tuple(extra)


def leading_run(keys: Sequence[int], cached: Mapping | frozenset | set, limit: int) -> int:
    """Length of the leading run of ``keys[:limit]`` that are in ``cached``."""
    n = 0
    for k in keys[:limit]:
        if k not in cached:
            break
        n += 1
    return n


class InstanceStateView:
    """The instance columns of the cluster at ``now_s`` (lazy), or a materialised snapshot.

    Args:
        instances: the cluster's :class:`~kvsched.envs.sim.instance.Instance` objects.
        now_s: simulated time (s).
        shared_kv: the shared cluster KV pool, or ``None``.
        frozen: materialise every column and copy each instance's prefix-cache key set now
            (a stale snapshot that later state changes do not affect).
    """

    def __init__(self, instances: Sequence, now_s: float, shared_kv=None, frozen: bool = False) -> None:
        self._instances = instances
        self._shared = shared_kv
        self.now_s = float(now_s)
        #: every column name: :data:`INSTANCE_COLUMNS` plus ``free_blocks_<tier>`` of extra tiers
        self.columns = instance_columns(instances)
        if frozen:
            for name in self.columns:
                getattr(self, name)
            self.prefix_sets = [frozenset(inst.hbm.segments) for inst in instances]
        else:
            self.prefix_sets = [inst.hbm.segments for inst in instances]

    def __getattr__(self, name: str):
        # ``free_blocks_<tier>`` of a lower tier: computed on first access, then cached
        if name.startswith("free_blocks_") and name in self.__dict__.get("columns", ()):
            tier = name[len("free_blocks_"):]
            col = self._ints(lambda i: i.kv.by_name[tier].pool.available_blocks if tier in i.kv.by_name else 0)
            self.__dict__[name] = col
            return col
        raise AttributeError(name)

    def _ints(self, fn) -> np.ndarray:
        return np.fromiter((fn(i) for i in self._instances), np.int64, count=len(self._instances))

    @cached_property
    def instance_id(self) -> np.ndarray:
        return self._ints(lambda i: i.instance_id)

    @cached_property
    def waiting(self) -> np.ndarray:
        return self._ints(lambda i: len(i.waiting))

    @cached_property
    def swapped(self) -> np.ndarray:
        return self._ints(lambda i: len(i.swapped))

    @cached_property
    def queue_len(self) -> np.ndarray:
        return self.waiting + self.swapped

    @cached_property
    def running(self) -> np.ndarray:
        return self._ints(lambda i: len(i.running))

    @cached_property
    def max_num_seqs(self) -> np.ndarray:
        return self._ints(lambda i: i.spec.max_seqs)

    @cached_property
    def capacity_blocks_hbm(self) -> np.ndarray:
        return self._ints(lambda i: i.hbm.capacity_blocks)

    @cached_property
    def free_blocks_hbm(self) -> np.ndarray:
        return self._ints(lambda i: i.hbm.available_blocks)

    @cached_property
    def used_blocks_hbm(self) -> np.ndarray:
        return self._ints(lambda i: i.hbm.used_blocks)

    @cached_property
    def kv_utilization(self) -> np.ndarray:
        return self.used_blocks_hbm / np.maximum(self.capacity_blocks_hbm, 1)

    @cached_property
    def pending_prefill_tokens(self) -> np.ndarray:
        def pending(inst) -> int:
            n = sum(s.prompt_tokens + s.generated - s.computed for s in inst.waiting)
            for s in inst.running:
                left = s.prompt_tokens - s.computed
                if left > 0:
                    n += left
            return n

        return self._ints(pending)

    @cached_property
    def link_backlog_s(self) -> np.ndarray:
        now = self.now_s
        shared = self._shared

        def backlog(inst) -> float:
            busy = max(link.busy_until_s for link in inst.links.values())
            if shared is not None:
                busy = max(busy, shared.busy_until_s(inst.instance_id))
            return busy - now if busy > now else 0.0

        return np.fromiter((backlog(i) for i in self._instances), np.float64, count=len(self._instances))

    @cached_property
    def block_size_tokens(self) -> np.ndarray:
        return self._ints(lambda i: i.bs)


class RouterTable:
    """The cluster state one routing decision sees (see the module docstring for columns).

    Args:
        view: the instance columns (live or a stale snapshot).
        request: the arriving :class:`~kvsched.envs.sim.request.RequestState` (only the fields
            a router may see are exposed).
        now_s: when the engine sees the request (its ``arrival_s`` plus the API front-end delay).
        shared_kv: the shared cluster KV pool, or ``None``.
    """

    def __init__(self, view: InstanceStateView, request, now_s: float, shared_kv=None) -> None:
        self._view = view
        self.now_s = float(now_s)
        self.request_id = int(request.rid)
        self.arrival_s = float(request.arrival_s)
        self.prompt_tokens = int(request.prompt_tokens)
        self.session_id = int(request.req.session_id)
        self.prefix_keys: tuple[int, ...] = request.hashes
        self.prefix_block_tokens = int(request.seg_tokens)
        self.prefix_blocks = int(request.n_cacheable_segments)
        self.snapshot_s = view.now_s
        self._shared = shared_kv

    def __len__(self) -> int:
        return len(self._view._instances)

    def __getattr__(self, name: str):
        if name in self._view.columns:
            return getattr(self._view, name)
        raise AttributeError(f"RouterTable has no column {bounded_repr(name)}; "
                             f"instance columns: {', '.join(self._view.columns)}")

    @cached_property
    def prefix_overlap_segments(self) -> np.ndarray:
        keys, limit = self.prefix_keys, self.prefix_blocks
        if not limit:
            return np.zeros(len(self), dtype=np.int64)
        return np.fromiter((leading_run(keys, s, limit) for s in self._view.prefix_sets), np.int64,
                           count=len(self))

    @cached_property
    def prefix_overlap_tokens(self) -> np.ndarray:
        return self.prefix_overlap_segments * self.prefix_block_tokens

    @cached_property
    def prefix_overlap_blocks(self) -> np.ndarray:
        return self.prefix_overlap_tokens // self._view.block_size_tokens

    @cached_property
    def shared_overlap_segments(self) -> int:
        if self._shared is None or not self.prefix_blocks:
            return 0
        return self._shared.cached_prefix_segments(self.prefix_keys, self.prefix_blocks, self.now_s)

    @property
    def request_blocks(self) -> np.ndarray:
        """KV blocks of the request's prompt on each instance (ceil(prompt / block size))."""
        return -(-self.prompt_tokens // self._view.block_size_tokens)


class StateProvider:
    """Builds the view each arrival sees: live (``delay_s = 0``) or a snapshot refreshed every ``delay_s``.

    Args:
        delay_s: staleness of router information in simulated seconds (>= 0, finite).

    Raises:
        ConfigError: ``delay_s`` negative, NaN or infinite.
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not math.isfinite(delay_s) \
                or delay_s < 0:
            raise ConfigError(f"router_delay_s={bounded_repr(delay_s)} is not allowed: expected a finite number >= 0 "
                              "(seconds of staleness of the state routers see)")
        self.delay_s = float(delay_s)
        self._snapshot: InstanceStateView | None = None
        self._next_refresh_s = -math.inf
        self.refreshes = 0

    def view(self, instances: Sequence, now_s: float, shared_kv=None) -> InstanceStateView:
        """The instance view for an arrival at ``now_s``."""
        if self.delay_s == 0.0:
            return InstanceStateView(instances, now_s, shared_kv)
        if now_s >= self._next_refresh_s or self._snapshot is None:
            self._snapshot = InstanceStateView(instances, now_s, shared_kv, frozen=True)
            self._next_refresh_s = (math.floor(now_s / self.delay_s) + 1.0) * self.delay_s
            self.refreshes += 1
        return self._snapshot


class RoundRobinPlacement:
    """The cluster's default placement: instances in turn, ignoring their state (vLLM
    production-stack ``roundrobin``). The ``round-robin`` router of :mod:`kvsched.policies.routing`
    is this placement; the core uses it when no router is given.

    Implements the :class:`~kvsched.envs.sim.policy_api.Router` protocol, plus
    :meth:`arrivals_until` (fast-forward look-ahead: arrivals to other instances cannot change an
    instance's batch).
    """

    name = "round-robin"

    def __init__(self) -> None:
        self.n_instances = 0
        self._turn = 0

    def bind(self, n_instances: int, seed: int = 0) -> None:
        """Called once by each cluster before its first request (``seed`` is not used); starts
        the turn at instance 0, so a router object reused for another run routes it the same."""
        self.n_instances = int(n_instances)
        self._turn = 0

    def route(self, table: RouterTable) -> int:
        """The next instance in turn."""
        i = self._turn % len(table)
        self._turn += 1
        return i

    def arrivals_until(self, index: int, n_instances: int) -> int:
        """Arrivals still to come before the one routed to instance ``index`` (0: the next)."""
        return (index - self._turn) % n_instances
