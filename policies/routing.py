"""Cluster routers: which instance an arriving request goes to, from a :class:`RouterTable`.

The interface is one method: ``route(table) -> row`` (an index into the table's instance rows;
:mod:`kvsched.envs.sim.routing` lists the columns). ``bind(n_instances, seed)`` is called once
before the first request. A router sees the arriving request's prompt length, session id and
prefix-block keys, never its output length, and the instances' state possibly ``delay_s`` old.

Registered routers (``make_router(name, params)``; ``kvsched simulate --router NAME``):

================== ==========================================================================
``round-robin``    instances in turn (alias ``rr``)
``least-loaded``   least ``(queue + running) / max_num_seqs + KV utilisation``
``session-affinity`` a session stays on its instance while it lives; new sessions least-loaded
``cache-affinity`` longest cached prefix, with SGLang's load guard (switches to least-loaded
                   when the cluster is imbalanced or the match is short)
``prefix``         pure prefix matching: longest cached prefix whatever the load
``llm-d``          llm-d's weighted scorer: queue 2, KV-cache utilisation 2, prefix 3
``dynamo``         NVIDIA Dynamo's KV-router cost: overlap weight x prefill blocks + decode blocks
================== ==========================================================================

Ties (several instances with the best score) are broken by rotation: the k-th tied decision
takes the (k mod m)-th of the m tied rows, so an idle cluster is filled evenly and the choice
stays deterministic. Parameters are frozen dataclasses validated at construction.

Search spaces. A router's parameter class declares what ``kvsched tune --router NAME`` may
vary (``SEARCH_SPACE``, name -> :class:`~kvsched.policies.base.SearchDim`, each with the source
of its range), next to the parameters, as policies do. Every space contains the router's
published defaults (the dataclass defaults), which a study runs as its baseline.
:func:`tunable_router_names` lists the routers that declare one (``round-robin`` has no
parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, ClassVar, Mapping

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require
from kvsched.envs.sim.registry import Registry
from kvsched.envs.sim.routing import RoundRobinPlacement, RouterTable

from .base import SearchDim


def _real(owner: str, name: str, v: object, ok: Callable[[float], bool], allowed: str) -> None:
    require(not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v) and ok(float(v)),
            f"{owner}.{name}", v, allowed)


@dataclass(frozen=True)
class RouterParams:
    """Base of every router's frozen parameter dataclass (no common parameters)."""

    #: What ``kvsched tune --router`` may vary: parameter name -> :class:`SearchDim`. Empty
    #: here (a router without parameters, e.g. round-robin, cannot be tuned); each router with
    #: real tunables declares its own next to its parameters.
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {}


class Router:
    """Base class: ``route(table)`` returns the row of the chosen instance (implements the core's
    :class:`kvsched.envs.sim.policy_api.Router` protocol)."""

    name = "base"
    params_cls: type = RouterParams

    def __init__(self, params: RouterParams | None = None) -> None:
        self.params = params if params is not None else self.params_cls()
        self.n_instances = 0
        self._tie = 0

    def bind(self, n_instances: int, seed: int = 0) -> None:
        """Called once by the cluster before the first request. Routers whose parameters set
        ``track_routed_prefixes`` get their own index of the prefixes they routed."""
        self.n_instances = int(n_instances)
        p = self.params
        self._routed = (RoutedPrefixIndex(self.n_instances, p.routed_prefix_ttl_s)
                        if getattr(p, "track_routed_prefixes", False) else None)

    def route(self, table: RouterTable) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _pick(self, best_mask: np.ndarray) -> int:
        rows = np.flatnonzero(best_mask)
        r = int(rows[self._tie % len(rows)])
        self._tie += 1
        return r

    def _argmin(self, values: np.ndarray) -> int:
        return self._pick(values <= values.min())

    def _argmax(self, values: np.ndarray) -> int:
        return self._pick(values >= values.max())


class RoutedPrefixIndex:
    """The router's own record of which prefix blocks it sent where (approximate prefix index).

    Routers that cannot wait for KV events insert a request's prefix-block keys into the chosen
    instance's index when they route it: SGLang's router inserts the prompt into the worker's
    radix tree at selection, llm-d's approximate prefix scorer records routed blocks per pod, and
    Dynamo without KV events keeps routed blocks for ``router_ttl_secs`` = 120 s (REFERENCE.md
    §4.3). Entries expire ``ttl_s`` after they were last routed. Together with the exact
    instance-side overlap this lets back-to-back requests with one prefix follow each other
    before the first has computed it.
    """

    def __init__(self, n_instances: int, ttl_s: float) -> None:
        self.ttl_s = float(ttl_s)
        self._maps: list[dict[int, float]] = [{} for _ in range(n_instances)]

    def overlap(self, keys, limit: int, now_s: float) -> np.ndarray:
        """Leading run of ``keys[:limit]`` routed to each instance within the last ``ttl_s``."""
        oldest = now_s - self.ttl_s
        out = np.zeros(len(self._maps), dtype=np.int64)
        for row, m in enumerate(self._maps):
            n = 0
            for k in keys[:limit]:
                t = m.get(k)
                if t is None or t < oldest:
                    break
                n += 1
            out[row] = n
        return out

    def insert(self, row: int, keys, limit: int, now_s: float) -> None:
        m = self._maps[row]
        for k in keys[:limit]:
            m[k] = now_s


def _prefix_overlap(router: "Router", table: RouterTable) -> np.ndarray:
    """Exact instance-side overlap, raised by the router's own routed-prefix index when it has one."""
    exact = table.prefix_overlap_segments
    idx = getattr(router, "_routed", None)
    if idx is None or not table.prefix_blocks:
        return exact
    return np.maximum(exact, idx.overlap(table.prefix_keys, table.prefix_blocks, table.now_s))


def _record_route(router: "Router", table: RouterTable, row: int) -> int:
    idx = getattr(router, "_routed", None)
    if idx is not None and table.prefix_blocks:
        idx.insert(row, table.prefix_keys, table.prefix_blocks, table.now_s)
    return row


def _check_tracking(owner: str, track: object, ttl: object) -> None:
    require(isinstance(track, bool), f"{owner}.track_routed_prefixes", track, "true or false")
    _real(owner, "routed_prefix_ttl_s", ttl, lambda x: x > 0, "a number of seconds > 0")


ROUTERS: Registry[type] = Registry("router", aliases=None, sort_names=True)
"""The registered cluster routers by name (alias ``rr`` for ``round-robin``)."""


def register_router(name: str) -> Callable[[type], type]:
    """Class decorator adding a router to :data:`ROUTERS` under ``name``."""
    return ROUTERS.register(name)


def make_router(name: str, params: RouterParams | dict | None = None) -> Router:
    """Instantiate the registered router ``name`` (``params`` as its dataclass or a dict).

    Raises:
        UnknownPresetError: unknown name (the message lists the known ones).
        ConfigError: unknown parameter names or invalid values.
    """
    if not isinstance(name, str):
        raise ConfigError(f"router={bounded_repr(name)} is not allowed: expected a router name "
                          f"({', '.join(router_names())})")
    name = ROUTERS.canonical(name)  # messages name the registered router, not what was typed
    cls = ROUTERS.get(name)
    if params is None or isinstance(params, dict):
        given = dict(params or {})
        allowed = {f.name for f in fields(cls.params_cls)}
        unknown = sorted(set(given) - allowed, key=str)  # YAML keys may be numbers
        if unknown:
            raise ConfigError(f"router {bounded_repr(name)}: unknown parameters {bounded_repr(unknown)}; "
                              f"allowed: {sorted(allowed)}")
        try:
            params = cls.params_cls(**given)
        except TypeError as e:
            raise ConfigError(f"router {bounded_repr(name)}: {e}") from None
    elif not isinstance(params, cls.params_cls):
        raise ConfigError(f"router {bounded_repr(name)}: params must be a {cls.params_cls.__name__} or a dict, "
                          f"got {type(params).__name__}")
    return cls(params)


def router_names() -> list[str]:
    """Registered router names (aliases not included)."""
    return ROUTERS.names()


def tunable_router_names() -> list[str]:
    """Registered routers whose parameter class declares a non-empty ``SEARCH_SPACE``."""
    return [n for n, cls in ROUTERS.items() if cls.params_cls.SEARCH_SPACE]


# ------------------------------------------------------------------------------ round-robin
@register_router("round-robin")
class RoundRobin(Router):
    """Instances in turn, ignoring their state (vLLM production-stack ``roundrobin``; the
    cluster's default placement, :class:`kvsched.envs.sim.routing.RoundRobinPlacement`, which this
    router runs)."""

    def __init__(self, params: RouterParams | None = None) -> None:
        super().__init__(params)
        self._placement = RoundRobinPlacement()

    def bind(self, n_instances: int, seed: int = 0) -> None:
        super().bind(n_instances, seed)
        self._placement.bind(n_instances, seed)

    def route(self, table: RouterTable) -> int:
        return self._placement.route(table)

    def arrivals_until(self, index: int, n_instances: int) -> int:
        """Arrivals still to come before the one routed to instance ``index`` (0: the next).

        The cluster uses it as that instance's fast-forward horizon (arrivals to the others
        cannot change its batch).
        """
        return self._placement.arrivals_until(index, n_instances)


# ----------------------------------------------------------------------------- least-loaded
@dataclass(frozen=True)
class LeastLoadedParams(RouterParams):
    """Weights of the load terms (both >= 0, not both 0).

    Attributes:
        queue_weight: weight of ``(queue_len + running) / max_num_seqs`` (requests per batch slot).
        kv_weight: weight of ``kv_utilization`` (fraction of HBM KV blocks in use).
    """

    #: Only the ratio of the two weights changes a decision (the argmin of a positive multiple is
    #: the same), so a log scale 0.1-10 for each spans ratios 0.01-100 (near-pure queue to
    #: near-pure KV load); 0 is left out so the two cannot both vanish (an invalid pair).
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "queue_weight": SearchDim("float", 0.1, 10.0, log=True,
                                  source="kvsched choice: log 0.1-10 around the default 1 (llm-d weighs its queue and "
                                         "kv-cache-utilization scorers equally, REFERENCE.md §4.3); only the ratio "
                                         "to kv_weight matters"),
        "kv_weight": SearchDim("float", 0.1, 10.0, log=True,
                               source="kvsched choice: log 0.1-10 around the default 1 (llm-d weighs its queue and "
                                      "kv-cache-utilization scorers equally, REFERENCE.md §4.3); only the ratio to "
                                      "queue_weight matters"),
    }

    queue_weight: float = 1.0
    kv_weight: float = 1.0

    def __post_init__(self) -> None:
        for n in ("queue_weight", "kv_weight"):
            _real("LeastLoadedParams", n, getattr(self, n), lambda x: 0 <= x < math.inf, "a finite number >= 0")
        require(self.queue_weight + self.kv_weight > 0, "LeastLoadedParams.queue_weight", self.queue_weight,
                "a positive weight for at least one of queue_weight and kv_weight")


def _load(table: RouterTable, queue_weight: float = 1.0, kv_weight: float = 1.0) -> np.ndarray:
    return (queue_weight * (table.queue_len + table.running) / np.maximum(table.max_num_seqs, 1)
            + kv_weight * table.kv_utilization)


@register_router("least-loaded")
class LeastLoaded(Router):
    """Least ``queue_weight * (queue + running) / max_num_seqs + kv_weight * KV utilisation``.

    The two load signals of llm-d's ``queue-scorer`` and ``kv-cache-utilization-scorer`` with
    equal weights and no prefix term (REFERENCE.md §4.3); requests are counted per batch slot so
    heterogeneous instances compare fairly (kvsched's normalisation).
    """

    params_cls = LeastLoadedParams

    def route(self, table: RouterTable) -> int:
        p = self.params
        return self._argmin(_load(table, p.queue_weight, p.kv_weight))


# ------------------------------------------------------------------------- session affinity
@dataclass(frozen=True)
class SessionAffinityParams(RouterParams):
    """Attributes:
        ttl_s: a session lives until ``ttl_s`` seconds pass without a request of it, 10800 s
            (Kubernetes Service ``sessionAffinityConfig.clientIP.timeoutSeconds`` default).
        derive_sessions: when the trace has no session ids (Mooncake, Azure: ``session_id`` -1),
            derive them from prefix keys (see :class:`SessionAffinity`).
        min_shared_blocks: prefix blocks a request must share with an earlier one to continue
            its session (>= 1).
    """

    #: ``derive_sessions`` is a property of the trace (ids present or not), not a tunable.
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "ttl_s": SearchDim("float", 60.0, 86400.0, log=True,
                           source="Kubernetes sessionAffinityConfig.clientIP.timeoutSeconds (default 10800 s, "
                                  "allowed (0, 86400]); lower bound 60 s kvsched choice, log scale"),
        "min_shared_blocks": SearchDim("int", 1, 8,
                                       source="kvsched choice: session derivation from prefix keys is kvsched's "
                                              "(default 1 block); up to 8 prefix blocks shared"),
    }

    ttl_s: float = 10800.0
    derive_sessions: bool = True
    min_shared_blocks: int = 1

    def __post_init__(self) -> None:
        _real("SessionAffinityParams", "ttl_s", self.ttl_s, lambda x: x > 0, "a number of seconds > 0 (inf allowed)")
        require(isinstance(self.derive_sessions, bool), "SessionAffinityParams.derive_sessions",
                self.derive_sessions, "true or false")
        require(not isinstance(self.min_shared_blocks, bool) and isinstance(self.min_shared_blocks, int)
                and self.min_shared_blocks >= 1, "SessionAffinityParams.min_shared_blocks",
                self.min_shared_blocks, "an integer >= 1")


@register_router("session-affinity")
class SessionAffinity(Router):
    """Same session to the same instance while the session lives; new sessions least-loaded.

    Sticky sessions as load balancers implement them (Kubernetes ``sessionAffinity``, vLLM
    production-stack ``session`` routing by a session header); the session's earlier turns then
    stay in that instance's prefix cache.

    **Sessions.** The trace's ``session_id`` when it has one (synthetic workloads). Mooncake and
    Azure traces carry none. For Mooncake they are derived online from the prefix keys a router
    sees: a conversation's next prompt repeats the previous prompt (plus the answer and a new
    question), so its chained prefix keys start with the previous prompt's full-block keys. A
    request continues the session of the earlier request whose full-block key chain is the
    longest prefix of its own (at least ``min_shared_blocks`` blocks), but only if that earlier
    request is still the latest of its session: a second request extending the same turn (a
    shared system prompt or a regenerated answer) starts a new session, so a common system
    prompt does not merge unrelated users into one session. Prompts shorter than one prefix
    block (and every Azure request, which has no prefix keys) get no session and are routed
    least-loaded.
    """

    params_cls = SessionAffinityParams

    def bind(self, n_instances: int, seed: int = 0) -> None:
        super().bind(n_instances, seed)
        self._where: dict[tuple[int, int], tuple[int, float]] = {}  # session -> (row, last request s)
        self._key_session: dict[int, int] = {}                      # full-block prefix key -> derived session
        self._tip: dict[int, int] = {}                              # derived session -> key of its latest request
        self._next_derived = 0
        self._fallback = LeastLoaded()
        self.derived_sessions = 0
        self.continued = 0

    def _session(self, table: RouterTable) -> tuple[int, int] | None:
        if table.session_id >= 0:
            return (0, table.session_id)
        p = self.params
        nb = table.prefix_blocks
        if not p.derive_sessions or nb == 0:
            return None
        keys = table.prefix_keys
        sid = -1
        for j in range(nb, p.min_shared_blocks - 1, -1):
            s = self._key_session.get(keys[j - 1])
            if s is not None:
                if self._tip.get(s) == keys[j - 1]:
                    sid = s
                    self.continued += 1
                break
        if sid < 0:
            sid = self._next_derived
            self._next_derived += 1
            self.derived_sessions += 1
        own = keys[nb - 1]
        self._key_session.setdefault(own, sid)
        self._tip[sid] = own
        return (1, sid)

    def route(self, table: RouterTable) -> int:
        key = self._session(table)
        now = table.now_s
        if key is not None:
            hit = self._where.get(key)
            if hit is not None and now - hit[1] <= self.params.ttl_s:
                self._where[key] = (hit[0], now)
                return hit[0]
        row = self._fallback.route(table)
        if key is not None:
            self._where[key] = (row, now)
        return row


# --------------------------------------------------------------------------- cache affinity
@dataclass(frozen=True)
class CacheAffinityParams(RouterParams):
    """SGLang Model Gateway ``cache_aware`` policy parameters (docs: concepts/routing/cache-aware).

    Attributes:
        cache_threshold: route to the longest-prefix instance only when the matched share of the
            prompt is above this, in [0, 1); default 0.3 (SMG ``--cache-threshold``).
        balance_abs_threshold: the cluster is imbalanced when ``max_load - min_load`` exceeds
            this (load = queued + running requests); default 64 (SMG ``--balance-abs-threshold``).
        balance_rel_threshold: ... and ``max_load > balance_rel_threshold * min_load``; default
            1.5 (SMG ``--balance-rel-threshold``). When imbalanced, route least-loaded.
        track_routed_prefixes: also count the prefixes this router itself sent to each instance
            (:class:`RoutedPrefixIndex`; SGLang's router inserts at selection), default True.
        routed_prefix_ttl_s: how long a routed prefix counts, 120 s (SMG ``--eviction-interval``
            and Dynamo ``router_ttl_secs``).
    """

    #: ``track_routed_prefixes`` models what SGLang's router does (insert at selection); it is
    #: not a gateway flag and stays fixed.
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "cache_threshold": SearchDim("float", 0.0, 0.9,
                                     source="SGLang Model Gateway --cache-threshold (default 0.3, a share of the "
                                            "prompt in [0, 1)); range kvsched choice: 0 (any match) to 0.9"),
        "balance_abs_threshold": SearchDim("int", 1, 1024, log=True,
                                           source="SGLang Model Gateway --balance-abs-threshold (default 64 "
                                                  "requests); range kvsched choice 1-1024 requests (vLLM's "
                                                  "max_num_seqs default), log scale"),
        "balance_rel_threshold": SearchDim("float", 1.0, 4.0,
                                           source="SGLang Model Gateway --balance-rel-threshold (default 1.5, "
                                                  ">= 1); range kvsched choice 1-4"),
        "routed_prefix_ttl_s": SearchDim("float", 10.0, 1200.0, log=True,
                                         source="SGLang Model Gateway --eviction-interval and Dynamo "
                                                "router_ttl_secs (default 120 s); range kvsched choice 10-1200 s, "
                                                "log scale"),
    }

    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64.0
    balance_rel_threshold: float = 1.5
    track_routed_prefixes: bool = True
    routed_prefix_ttl_s: float = 120.0

    def __post_init__(self) -> None:
        o = type(self).__name__
        _check_tracking(o, self.track_routed_prefixes, self.routed_prefix_ttl_s)
        _real(o, "cache_threshold", self.cache_threshold, lambda x: 0 <= x < 1, "a number in [0, 1)")
        _real(o, "balance_abs_threshold", self.balance_abs_threshold, lambda x: x >= 0, "a number >= 0 (inf: no guard)")
        _real(o, "balance_rel_threshold", self.balance_rel_threshold, lambda x: x >= 1, "a number >= 1 (inf: no guard)")


@register_router("cache-affinity")
class CacheAffinity(Router):
    """The instance holding the longest prefix of the request's block keys, with a load guard.

    SGLang Model Gateway (sgl-router) ``cache_aware``: when the cluster is imbalanced (both
    thresholds exceeded), least loaded; otherwise the longest cached prefix if its share of the
    prompt exceeds ``cache_threshold`` (ties: the less loaded), else the least loaded instance.
    Load is queued + running requests, as SMG counts active requests per worker. Prefix
    matches come from the instances' HBM prefix caches (exact, as SMG's mirrored radix tree).
    """

    params_cls = CacheAffinityParams

    def route(self, table: RouterTable) -> int:
        return _record_route(self, table, self._choose(table))

    def _choose(self, table: RouterTable) -> int:
        p = self.params
        load = (table.queue_len + table.running).astype(np.float64)
        lo, hi = float(load.min()), float(load.max())
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            return self._argmin(load)
        overlap = _prefix_overlap(self, table)
        best = int(overlap.max())
        if best > 0 and best * table.prefix_block_tokens > p.cache_threshold * table.prompt_tokens:
            cand = overlap == best
            masked = np.where(cand, load, np.inf)
            return self._pick(masked <= masked.min())
        return self._argmin(load)


@dataclass(frozen=True)
class PrefixParams(CacheAffinityParams):
    """Pure prefix matching: no match threshold, no load guard (see :class:`CacheAffinityParams`).

    Its search space is the routed-prefix lifetime only: a threshold or a finite load guard
    would make it :class:`CacheAffinity` (tune ``cache-affinity`` for those), and its infinite
    guard defaults lie in no finite range.
    """

    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "routed_prefix_ttl_s": CacheAffinityParams.SEARCH_SPACE["routed_prefix_ttl_s"],
    }

    cache_threshold: float = 0.0
    balance_abs_threshold: float = math.inf
    balance_rel_threshold: float = math.inf


@register_router("prefix")
class PurePrefix(CacheAffinity):
    """Longest cached prefix whatever the load (least loaded only when nothing matches): the
    llm-d blog's "prefix-only" baseline (REFERENCE.md §4.3)."""

    params_cls = PrefixParams


# ----------------------------------------------------------------------------------- llm-d
@dataclass(frozen=True)
class LlmdParams(RouterParams):
    """Scorer weights of llm-d's default ``EndpointPickerConfig`` (REFERENCE.md §4.3).

    Attributes:
        queue_weight: ``queue-scorer``, 2.
        kv_cache_weight: ``kv-cache-utilization-scorer``, 2.
        prefix_weight: ``prefix-cache-scorer``, 3.
        track_routed_prefixes, routed_prefix_ttl_s: the prefix scorer's own record of routed
            blocks (llm-d's approximate mode), as in :class:`CacheAffinityParams`; True, 120 s.
    """

    #: 0 switches a scorer off; only the ratios of the three weights change a decision (the
    #: argmax of a positive multiple is the same).
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "queue_weight": SearchDim("float", 0.0, 10.0,
                                  source="llm-d EndpointPickerConfig queue-scorer weight (default profile 2; "
                                         "REFERENCE.md §4.3); range kvsched choice 0-10"),
        "kv_cache_weight": SearchDim("float", 0.0, 10.0,
                                     source="llm-d EndpointPickerConfig kv-cache-utilization-scorer weight (default "
                                            "profile 2; REFERENCE.md §4.3); range kvsched choice 0-10"),
        "prefix_weight": SearchDim("float", 0.0, 10.0,
                                   source="llm-d EndpointPickerConfig prefix-cache-scorer weight (default profile "
                                          "3; REFERENCE.md §4.3); range kvsched choice 0-10"),
    }

    queue_weight: float = 2.0
    kv_cache_weight: float = 2.0
    prefix_weight: float = 3.0
    track_routed_prefixes: bool = True
    routed_prefix_ttl_s: float = 120.0

    def __post_init__(self) -> None:
        _check_tracking("LlmdParams", self.track_routed_prefixes, self.routed_prefix_ttl_s)
        for n in ("queue_weight", "kv_cache_weight", "prefix_weight"):
            _real("LlmdParams", n, getattr(self, n), lambda x: 0 <= x < math.inf, "a finite number >= 0")


@register_router("llm-d")
class LlmdScorer(Router):
    """llm-d inference scheduler: filter, score, pick the maximum of ``sum_s weight_s * score_s``.

    Scores in [0, 1] per instance (REFERENCE.md §4.3; normalisations [mem/inferred] there):
    queue = ``1 - (q - q_min) / (q_max - q_min)`` over the instances with ``q`` the waiting
    queue (1 when all are equal); kv-cache = ``1 - kv_utilization``; prefix = cached prefix
    blocks / the request's blocks.
    """

    params_cls = LlmdParams

    def route(self, table: RouterTable) -> int:
        p = self.params
        q = table.queue_len.astype(np.float64)
        span = q.max() - q.min()
        queue = 1.0 - (q - q.min()) / span if span > 0 else np.ones(len(q))
        kv = 1.0 - table.kv_utilization
        matched = _prefix_overlap(self, table) * table.prefix_block_tokens // table.block_size_tokens
        prefix = np.clip(matched / np.maximum(table.request_blocks, 1), 0.0, 1.0)
        score = p.queue_weight * queue + p.kv_cache_weight * kv + p.prefix_weight * prefix
        return _record_route(self, table, self._argmax(score))


# ---------------------------------------------------------------------------------- dynamo
@dataclass(frozen=True)
class DynamoParams(RouterParams):
    """NVIDIA Dynamo ``KvRouterConfig::default`` (REFERENCE.md §4.3).

    Attributes:
        overlap_score_weight: weight of the prefill blocks, 1.0 (``--kv-overlap-score-weight``).
        router_temperature: 0.0 picks the minimum cost; > 0 samples ``softmax(-logit / T)`` over
            costs divided by their maximum (``--router-temperature``).
        seed: seed of the sampler when the temperature is > 0 (one seeded NumPy generator).
    """

    #: ``seed`` is not tuned: ``kvsched tune`` gives it each run's seed.
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "overlap_score_weight": SearchDim("float", 0.0, 5.0,
                                          source="Dynamo --kv-overlap-score-weight (--router-kv-overlap-score-weight "
                                                 "in Dynamo 1.x; default 1.0, 0 = pure load balancing, higher "
                                                 "favours TTFT over ITL; REFERENCE.md §4.3); range kvsched choice 0-5"),
        "router_temperature": SearchDim("float", 0.0, 1.0,
                                        source="Dynamo --router-temperature (default 0.0 = argmin; REFERENCE.md "
                                               "§4.3); range kvsched choice 0-1: costs are divided by their "
                                               "maximum, so at T = 1 the sampling weights differ by at most e"),
    }

    overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _real("DynamoParams", "overlap_score_weight", self.overlap_score_weight, lambda x: 0 <= x < math.inf,
              "a finite number >= 0")
        _real("DynamoParams", "router_temperature", self.router_temperature, lambda x: 0 <= x < math.inf,
              "a finite number >= 0")
        require(not isinstance(self.seed, bool) and isinstance(self.seed, int) and self.seed >= 0,
                "DynamoParams.seed", self.seed, "an integer >= 0")


@register_router("dynamo")
class DynamoKV(Router):
    """Dynamo KV router: ``logit_w = overlap_score_weight * potential_prefill_blocks_w + decode_blocks_w``.

    ``potential_prefill_blocks_w = (pending_prefill_tokens_w + ISL - overlap_blocks_w * block_size) / block_size``
    and ``decode_blocks_w`` = the KV blocks in use on worker ``w`` (``used_blocks_hbm``); lower is
    better (REFERENCE.md §4.3, ai-dynamo/dynamo ``KvRouterConfig::default`` and the selector).
    """

    params_cls = DynamoParams

    def bind(self, n_instances: int, seed: int = 0) -> None:
        super().bind(n_instances, seed)
        self._rng = np.random.default_rng(self.params.seed)

    def logits(self, table: RouterTable) -> np.ndarray:
        """Cost of each instance (blocks; lower is better)."""
        bs = table.block_size_tokens.astype(np.float64)
        prefill = (table.pending_prefill_tokens + table.prompt_tokens - table.prefix_overlap_blocks * bs) / bs
        return self.params.overlap_score_weight * prefill + table.used_blocks_hbm

    def route(self, table: RouterTable) -> int:
        logit = self.logits(table)
        t = self.params.router_temperature
        if t == 0.0:
            return self._argmin(logit)
        top = logit.max()
        z = -(logit / top if top > 0 else logit) / t
        w = np.exp(z - z.max())
        return int(self._rng.choice(len(w), p=w / w.sum()))


ROUTERS.add_alias("rr", "round-robin")
