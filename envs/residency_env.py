"""``kvsched/Residency-v0``: the agent decides how long each conversation's cached prefix stays in
the lower tiers (host DRAM, NVMe) of a tiered prefix cache, and optionally in HBM
(``hbm_actions``) and whether a returning request's prefix is prefetched up a tier (``prefetch``).

Adapter only: the simulation is :class:`kvsched.envs.sim.cluster.Cluster` with its finished
requests watched (``DecisionWatch(residency=True)``); the decision vocabulary (keep for a time,
drop, demote, or leave it to the tier's eviction order) is the core's, :mod:`kvsched.envs.sim.retention`.
"""

from __future__ import annotations

import dataclasses
import math

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kvsched.envs import DEFAULT_SCENARIOS, default_scenario
from kvsched.envs.common import (EpisodeTimelines, build_cluster, check_steppable, episode_config, integer_action,
                                 reference, step_info, unfinished)
from kvsched.envs.episodes import EpisodeSource
from kvsched.envs.reward import RewardConfig, SLOReward, reward_config
from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.envs.sim.errors import ConfigError, bounded_repr, require
from kvsched.envs.sim.prefix_offload import EVICTION_POLICIES
from kvsched.envs.sim.retention import RetentionDecision

#: keep times of the ``keep`` actions (s) [kvsched choice: from a few seconds to twice the
#: 5-minute think times of the conversation traces; Mooncake's and Azure's turns come back after
#: tens of seconds to minutes]
KEEP_BINS_S: tuple[float, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: actions before the keep bins
BASE_ACTIONS: tuple[str, ...] = ("default", "drop", "demote")
FEATURES: tuple[str, ...] = (
    "prompt", "generated", "prefix_hit", "turns", "first_turn", "turn_gap", "conversation_age",
    "conversation_tier0", "conversation_tier1", "tier0_prefix_fill", "tier0_kept", "tier0_swapped",
    "tier0_survival", "hbm_used", "waiting", "arrival_rate", "has_tier1",
)
#: features appended with ``hbm_actions`` or ``prefetch`` (:class:`ResidencyEnv`)
EXTRA_FEATURES: tuple[str, ...] = ("prefetch_point", "hbm_cached", "lower_only", "hbm_evictable", "hbm_kept")
#: time constant of the eviction-rate and arrival-rate averages (s) [kvsched choice]
RATE_TAU_S = 30.0
#: The bundled scenario Residency-v0 serves when none is given (experiments/scenarios/).
DEFAULT_SCENARIO = DEFAULT_SCENARIOS["kvsched/Residency-v0"]


class ResidencyEnv(gym.Env):
    """Retention decisions for the lower-tier prefix caches of every instance of a scenario.

    The scenario's instances must cache prefixes below HBM (``instance.prefix_offload``,
    docs/architecture.md "Prefix caches below HBM"); HBM keeps vLLM's LRU prefix cache.

    **Decision points**: every request that finishes, once (after the event it finished in, at
    that simulated time). Its conversation (the session id, or the prefix chain it continues:
    :meth:`~kvsched.envs.sim.prefix_offload.PrefixTiers.conversation_of`) is what the decision
    applies to, in every listed tier of the request's instance.

    **Action** ``Discrete(3 + len(keep_bins_s))``: 0 ``default`` (the tiers' eviction order
    decides: the reference), 1 ``drop`` (evict the conversation's entries now), 2 ``demote``
    (move its first-tier entries to the next listed tier now; masked without one), then
    ``keep`` for each of ``keep_bins_s`` seconds (out of the eviction order until then; a tier
    evicts kept entries only when it holds nothing else). A masked action is not an error: it
    acts as 0 and ``info["invalid_action"]`` is True.

    **Observation** ``Box(0, 1, (17,), float32)``, fixed scales (:data:`FEATURES`):

    =======================  ==================================================================
    ``prompt``               p / (p + 8192), p = the request's prompt tokens
    ``generated``            g / (g + 512), g = its output tokens
    ``prefix_hit``           prompt tokens it found cached (HBM or below) / p
    ``turns``                n / (n + 3), n = requests of its conversation finished so far
    ``first_turn``           1 when n = 1
    ``turn_gap``             d / (d + 60), d = s between the arrivals of its last two turns (0 first)
    ``conversation_age``     a / (a + 300), a = s since its conversation's first arrival
    ``conversation_tier0``   blocks its conversation holds in the first listed tier / capacity
    ``conversation_tier1``   the same in the second listed tier (0 without one)
    ``tier0_prefix_fill``    cached-prefix blocks / capacity of the first listed tier
    ``tier0_kept``           kept (retained) blocks / capacity
    ``tier0_swapped``        swapped-out requests' blocks / capacity
    ``tier0_survival``       s / (s + 60), s = capacity / eviction rate (blocks/s, averaged over
                             30 s): how long an entry the order does not protect lasts; 1 with
                             no evictions yet
    ``hbm_used``             used / capacity HBM blocks
    ``waiting``              n / (n + 16), n = waiting requests
    ``arrival_rate``         r / (r + 1), r = arrivals per second (averaged over 30 s)
    ``has_tier1``            1 when a second listed tier exists
    =======================  ==================================================================

    Output lengths are known here only because the request has finished; nothing of the future
    is shown.

    **HBM actions** (``hbm_actions=True``; :mod:`kvsched.envs.sim.retention` "hbm"): after the
    keep bins, ``hbm_first`` (the tiers' order below; HBM evicts the request's cached prompt
    segments before anything else) and ``keep+hbm`` for each keep bin (kept below *and* in HBM:
    out of vLLM's LRU free queue for that time, evicted only when HBM holds nothing else
    evictable). Without them HBM keeps vLLM's LRU order.

    **Prefetch** (``prefetch=True``): a second kind of decision point, once per arriving request
    queued on an instance where part of its cached prefix lies only in a tier below the first
    listed one (needs two listed tiers, e.g. ``[dram, nvme]``; refused on a scenario with one).
    The last action, ``prefetch``, copies those segments up to the first tier now
    (CachedAttention's scheduler-aware fetching,
    :meth:`~kvsched.envs.sim.prefix_offload.PrefixTiers.prefetch`): the copy takes the lower
    tier's read link, so an admission before it lands loads over a busier link. At a prefetch
    point only 0 (no prefetch) and ``prefetch`` are valid; at a retention
    point ``prefetch`` is masked.

    With either option the observation gains :data:`EXTRA_FEATURES` after the 17 above:

    =======================  ==================================================================
    ``prefetch_point``       1 at a prefetch decision point
    ``hbm_cached``           the request's prompt segments cached in HBM / its cacheable ones
    ``lower_only``           its segments a prefetch would copy up / its cacheable ones
    ``hbm_evictable``        HBM evictable (cached, unreferenced) blocks / capacity
    ``hbm_kept``             HBM blocks kept by ``keep+hbm`` decisions / capacity
    =======================  ==================================================================

    **Reward**: as ``kvsched/Routing-v0`` (SLO attainment per recorded request, over all
    instances; :mod:`kvsched.envs.reward`); ``info["summary"]`` at the end has the per-tier hits
    (``prefix_tiers``).

    **Heuristics** (:meth:`heuristic_action`): ``lru``, ``lfu`` and ``clairvoyant`` are the tier
    order with action 0 (make the environment with ``eviction=<name>``); ``session`` keeps every
    conversation for a fixed time (``keep_s``, one of ``keep_bins_s``). ``clairvoyant`` reads the
    window's future: a reference for what knowing it is worth, never a policy.

    Args:
        scenario, window_s, split, heldout_fraction, max_requests: see ``Scheduling-v0``
            (default scenario the bundled ``residency-mooncake``, :data:`DEFAULT_SCENARIO`; default
            window 300 s: retention acts over think times of minutes).
        eviction: the listed tiers' eviction order, one of ``lru``, ``lfu``, ``session``,
            ``clairvoyant`` (default: the scenario's).
        keep_bins_s: keep times of the keep actions (s), increasing, each > 0.
        n_instances: instances (default: the scenario's).
        horizon_s: truncation time (s), default ``3 * window_s``.
        reward: :class:`RewardConfig`, or a mapping of its fields (no shaping).
        timeline: write each episode's schedule as a Chrome/Perfetto trace: a file name with an
            ``{episode}`` field (docs/timeline.md), or None.
        hbm_actions: add the HBM actions (above). Default False (the bench v1 task's actions).
        prefetch: add prefetch decision points and the ``prefetch`` action (above). Default False.

    Raises:
        ConfigError: a scenario without ``prefix_offload`` or with a ``cluster:`` section (roles),
            an unknown eviction order, bad keep bins, a bad horizon or reward, ``hbm_actions`` or
            ``prefetch`` not a bool, or ``prefetch`` on a scenario listing one prefix tier.
    """

    metadata = {"render_modes": []}
    heuristic_role = "residency"  # kvsched.agents.heuristic.HeuristicAgent recognises the class by it

    def __init__(self, scenario: str | None = None, window_s: float = 300.0, split: str = "train",
                 heldout_fraction: float = 0.25, max_requests: int | None = None, eviction: str | None = None,
                 keep_bins_s: tuple[float, ...] | list[float] = KEEP_BINS_S, n_instances: int | None = None,
                 horizon_s: float | None = None, reward: RewardConfig = RewardConfig(),
                 timeline: str | None = None, hbm_actions: bool = False, prefetch: bool = False) -> None:
        require(isinstance(hbm_actions, bool), "hbm_actions", hbm_actions, "True or False")
        require(isinstance(prefetch, bool), "prefetch", prefetch, "True or False")
        self.hbm_actions, self.prefetch = hbm_actions, prefetch
        if scenario is None:
            scenario = default_scenario("kvsched/Residency-v0")
        self.source = EpisodeSource(episode_config(scenario, window_s, split, heldout_fraction, max_requests))
        sc = self.source.scenario
        require(sc.cluster is None, "scenario", sc.name, "a scenario without a cluster: section (Residency-v0 "
                "serves the scenario's instance spec on every instance; prefill/decode roles are PDRouting-v0's)")
        spec = sc.instance_spec()
        po = spec.prefix_offload
        require(po is not None, "scenario", sc.name, "a scenario whose instance caches prefixes below HBM "
                "(instance.prefix_offload, e.g. experiments/scenarios/residency-mooncake.yaml)")
        assert po is not None
        require(eviction is None or eviction in EVICTION_POLICIES, "eviction", eviction,
                f"one of {', '.join(EVICTION_POLICIES)} (None: the scenario's)")
        if eviction is not None:
            po = dataclasses.replace(po, eviction=eviction)
            spec = dataclasses.replace(spec, prefix_offload=po)
        require(not prefetch or len(po.tiers) >= 2, "prefetch", prefetch,
                f"False on scenario {sc.name!r}, whose prefix_offload lists one tier (a prefetch copies from a "
                "lower listed tier up to the first: list two, e.g. tiers: [dram, nvme], as residency-tiers.yaml)")
        self.eviction = po.eviction[0] if len(set(po.eviction)) == 1 else "/".join(po.eviction)
        self.instance_spec = spec
        bins = tuple(keep_bins_s) if isinstance(keep_bins_s, (list, tuple)) else None
        require(bins is not None and len(bins) >= 1
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b > 0
                        for b in bins) and all(a < b for a, b in zip(bins, bins[1:])), "keep_bins_s", keep_bins_s,
                "a non-empty increasing list of finite keep times (s) > 0")
        assert bins is not None
        self.keep_bins_s = tuple(float(b) for b in bins)
        n = sc.n_instances if n_instances is None else n_instances
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, "n_instances", n_instances,
                "an integer >= 1")
        self.n_instances = n
        self.horizon_s = 3.0 * window_s if horizon_s is None else float(horizon_s)
        require(self.horizon_s > 0, "horizon_s", horizon_s, "a number of seconds > 0 (math.inf: never truncate)")
        self.reward_config = reward_config(reward)
        require(not self.reward_config.shaping, "reward.shaping", self.reward_config.shaping,
                "0 on Residency-v0 (potential-based shaping is implemented in kvsched/Scheduling-v0/v1 only)")
        reference(sc.policy, None, self.source)  # the instances' policy: validate early
        self.metrics = sc.metrics_config()
        decisions = ([RetentionDecision("default"), RetentionDecision("drop"),
                      RetentionDecision("demote" if len(po.tiers) >= 2 else "default")]
                     + [RetentionDecision("keep", b) for b in self.keep_bins_s])
        self.labels = ["default", "drop", "demote"] + [f"keep {b:g}s" for b in self.keep_bins_s]
        if hbm_actions:
            decisions += ([RetentionDecision("default", hbm="evict_first")]
                          + [RetentionDecision("keep", b, hbm="keep") for b in self.keep_bins_s])
            self.labels += ["hbm_first"] + [f"keep+hbm {b:g}s" for b in self.keep_bins_s]
        #: the ``prefetch`` action's index (-1 without ``prefetch``)
        self.prefetch_action = len(decisions) if prefetch else -1
        if prefetch:
            decisions.append(RetentionDecision("default"))  # at a retention point it is masked: acts as 0
            self.labels.append("prefetch")
        self.n_actions = len(decisions)
        self.features = FEATURES + (EXTRA_FEATURES if hbm_actions or prefetch else ())
        self.observation_space = spaces.Box(0.0, 1.0, (len(self.features),), np.float32)
        self.action_space = spaces.Discrete(self.n_actions)
        self._mask = np.ones(self.n_actions, dtype=bool)
        self._mask[2] = len(po.tiers) >= 2  # demote needs a next tier
        if prefetch:
            self._mask[self.prefetch_action] = False
            self._prefetch_mask = np.zeros(self.n_actions, dtype=bool)
            self._prefetch_mask[[0, self.prefetch_action]] = True
        self._decisions = tuple(decisions)
        self._action_allowed = f"an action index in [0, {self.n_actions})"
        self.cluster: Cluster | None = None
        self._point = None  # the decision point the episode stopped at (reset)
        self._timelines = EpisodeTimelines(timeline)

    def close(self) -> None:
        """Write the unfinished episode's timeline, if any (the ``timeline`` option)."""
        self._timelines.end(self.cluster)
        super().close()

    # ------------------------------------------------------------------------------ episode
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.workload, self.episode = self.source.choose(self.np_random, options)
        sc = self.source.scenario
        self._timelines.end(self.cluster)  # an unfinished episode's timeline
        observer = self._timelines.begin(self.source, self.n_instances, self.episode)
        self.cluster = build_cluster(self.source, lambda i: reference(sc.policy, None, self.source),
                                     n_instances=self.n_instances, observer=observer, spec=self.instance_spec)
        self.slo_reward = SLOReward(self.reward_config, self.metrics)
        self.cluster.start(self.workload, DecisionWatch(residency=True, prefetch=self.prefetch))
        self.decisions = 0
        self._over = False
        self._turns: dict = {}  # conversation -> (turns finished, first arrival s, last arrival s, gap s)
        self._evicted = [0.0] * self.n_instances  # blocks evicted from the first tier, last seen
        self._evict_rate = [0.0] * self.n_instances  # blocks/s, averaged
        self._rate_t = [0.0] * self.n_instances
        self._arrivals_seen = 0
        self._arrival_rate = 0.0
        self._arrival_t = 0.0
        self._point = self.cluster.run_until_decision(self.horizon_s)
        self._decided_s = self.cluster.now_s
        return self._observe(), self._info({})

    def _tier0(self, inst_id: int):
        c = self.cluster
        assert c is not None
        pt = c.instances[inst_id].kv.prefix_tiers
        assert pt is not None
        return pt

    def _observe(self) -> np.ndarray:
        p = self._point
        if p is None or p.kind not in ("residency", "prefetch"):
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        c = self.cluster
        assert c is not None
        st, now = p.request, p.time_s
        inst = c.instances[p.instance_id]
        pt = self._tier0(p.instance_id)
        # a prefetch point only looks: the conversation is not claimed before the request computes
        conv = pt.conversation_of(st) if p.kind == "residency" else pt.peek_conversation(st)
        turns, first_s, last_s, gap = self._turns.get(conv, (0, st.arrival_s, st.arrival_s, 0.0))
        if p.kind == "residency":  # a turn of the conversation finished (a prefetch point only looks)
            if turns:
                gap = max(st.arrival_s - last_s, 0.0)
            turns += 1
            self._turns[conv] = (turns, first_s, st.arrival_s, gap)
        store = pt.stores[0]
        pool = store.pool
        cap = float(max(pool.capacity_blocks, 1))
        held = pt.session_blocks(st, conv)
        # the first tier's eviction rate (blocks/s), an exponential average over RATE_TAU_S
        # (the averages advance at retention points only: a prefetch point previews them, so the
        # retention points see the values they have without ``prefetch``)
        commit = p.kind == "residency"
        i = p.instance_id
        evicted = float(store.evicted_blocks)
        dt = now - self._rate_t[i]
        rate = self._evict_rate[i]
        if dt > 0:
            w = math.exp(-dt / RATE_TAU_S)
            rate = w * rate + (1 - w) * (evicted - self._evicted[i]) / dt
            if commit:
                self._evict_rate[i], self._evicted[i], self._rate_t[i] = rate, evicted, now
        survival = 1.0 if rate <= 0 else (cap / rate) / (cap / rate + 60.0)
        arrived = c.arrivals_taken
        dt = now - self._arrival_t
        r = self._arrival_rate
        if dt > 0:
            w = math.exp(-dt / RATE_TAU_S)
            r = w * r + (1 - w) * (arrived - self._arrivals_seen) / dt
            if commit:
                self._arrival_rate, self._arrivals_seen, self._arrival_t = r, arrived, now
        prompt = float(st.prompt_tokens)
        hbm = inst.hbm
        swapped = pool.capacity_blocks - pool.free_blocks - pool.evictable_blocks
        nw = len(inst.waiting)
        cap1 = float(max(pt.stores[1].pool.capacity_blocks, 1)) if len(pt.stores) > 1 else 1.0
        vals = (prompt / (prompt + 8192.0), st.generated / (st.generated + 512.0),
                min((st.prefix_hit_tokens + st.self_hit_tokens) / prompt, 1.0) if prompt else 0.0,
                turns / (turns + 3.0), 1.0 if turns == 1 else 0.0, gap / (gap + 60.0),
                (now - first_s) / (now - first_s + 300.0) if now > first_s else 0.0,
                min(held[0] / cap, 1.0), min(held[1] / cap1, 1.0) if len(held) > 1 else 0.0,
                pool.evictable_blocks / cap, store.protected_blocks / cap, swapped / cap, survival,
                hbm.used_blocks / float(max(hbm.capacity_blocks, 1)), nw / (nw + 16.0), r / (r + 1.0),
                1.0 if len(pt.stores) > 1 else 0.0)
        if len(self.features) > len(FEATURES):
            n_seg = float(max(st.n_cacheable_segments, 1))
            hbm_hit = hbm.cached_prefix_segments(st.hashes, st.n_cacheable_segments)
            hcap = float(max(hbm.capacity_blocks, 1))
            vals += (1.0 if p.kind == "prefetch" else 0.0, hbm_hit / n_seg, len(pt.promotable(st, now)) / n_seg,
                     hbm.evictable_blocks / hcap, hbm.kept_blocks / hcap)
        return np.clip(np.array(vals, dtype=np.float32), 0.0, 1.0)

    # ------------------------------------------------------------------------------- masks
    def action_masks(self) -> np.ndarray:
        """Valid actions: at a retention point all but ``demote`` without a second listed tier and
        ``prefetch``; at a prefetch point 0 and ``prefetch``."""
        p = self._point
        if self.prefetch and p is not None and p.kind == "prefetch":
            return self._prefetch_mask.copy()
        return self._mask.copy()

    def _info(self, extra: dict) -> dict:
        return step_info(self, self.cluster.now_s if self.cluster else 0.0, extra)

    def decision_of(self, action: int) -> RetentionDecision:
        """The :class:`~kvsched.envs.sim.retention.RetentionDecision` action ``action`` stands for
        at a retention point (the ``prefetch`` action: ``default``, as it is masked there)."""
        return self._decisions[action]

    # -------------------------------------------------------------------------------- step
    def step(self, action):
        if self.cluster is None or self._over:
            check_steppable(self)  # raises
        a = action if type(action) is int else integer_action(action, 1, self._action_allowed)[0]
        if not 0 <= a < self.n_actions:
            require(False, "action", action, self._action_allowed)
        c = self.cluster
        assert c is not None
        point = self._point
        if point is not None and point.kind == "prefetch":
            invalid = not self._prefetch_mask[a]
            if a == self.prefetch_action:
                c.prefetch()
            self.decisions += 1
            self._point = c.run_until_decision(self.horizon_s)
        elif point is not None and point.kind == "residency":
            invalid = not self._mask[a]
            c.retain(self._decisions[0 if invalid else a])
            self.decisions += 1
            self._point = c.run_until_decision(self.horizon_s)
        else:
            invalid = not self._mask[a]
        comps = self.slo_reward.collect(c.recorder.rows)
        terminated = self._point is None
        truncated = self._point is not None and self._point.kind == "time"
        extra: dict = {"invalid_action": invalid, "elapsed_s": c.now_s - self._decided_s}
        self._decided_s = c.now_s
        states = unfinished(c)
        if truncated:
            comps["truncation"] = self.slo_reward.truncation_penalty(states, c.now_s)
        elif not terminated and self.reward_config.early_miss:
            comps["slo_missed"] += self.slo_reward.certain_misses(states, c.now_s)
        if terminated or truncated:
            self._timelines.end(c)
            self._over = True
            if terminated:
                extra["summary"] = c.result().summary
        extra["reward_components"] = comps
        return self._observe(), float(sum(comps.values())), terminated, truncated, self._info(extra)

    # ---------------------------------------------------------------------- reference agents
    def heuristic_action(self, policy: str | None = None, keep_s: float | None = None) -> int:
        """The action of heuristic ``policy`` at this decision: the tier order (``None``, or the
        environment's ``eviction``: ``lru``, ``lfu``, ``clairvoyant``) plays 0; ``session`` keeps
        every conversation ``keep_s`` seconds (one of ``keep_bins_s``; default 30 s, the
        ``session`` order's ``session_keep_s`` default); ``session-hbm`` keeps it as long in HBM too
        (needs ``hbm_actions``). A ``+prefetch`` suffix (e.g. ``lru+prefetch``, needs ``prefetch``)
        prefetches at every prefetch point; without it a prefetch point plays 0 (no prefetch).

        Raises:
            ConfigError: another name, a tier order other than the environment's (make it with
                ``eviction=<name>``), a keep time not among the bins, or an option the
                environment was made without.
        """
        base, prefetching = policy, False
        if isinstance(policy, str) and policy.endswith("+prefetch"):
            require(self.prefetch, "policy", policy, "a '+prefetch' heuristic on an environment made with "
                    "prefetch=True")
            base, prefetching = policy[:-len("+prefetch")] or None, True
        # validated at every point (a prefetch point too): a misuse is refused where it is made
        action = self._retention_heuristic(base, keep_s)
        if self._point is not None and self._point.kind == "prefetch":
            return self.prefetch_action if prefetching else 0
        return action

    def _retention_heuristic(self, policy: str | None, keep_s: float | None) -> int:
        """:meth:`heuristic_action` of ``policy`` (no ``+prefetch`` suffix) at a retention point."""
        if policy is None or (policy == self.eviction and policy != "session"):
            return 0
        if policy in ("session", "session-hbm"):
            k = 30.0 if keep_s is None else keep_s
            require(k in self.keep_bins_s, "keep_s", keep_s, f"one of the keep bins {list(self.keep_bins_s)}")
            if policy == "session-hbm":
                require(self.hbm_actions, "policy", policy, "'session-hbm' on an environment made with "
                        "hbm_actions=True")
                return len(BASE_ACTIONS) + len(self.keep_bins_s) + 1 + self.keep_bins_s.index(k)  # after hbm_first
            return len(BASE_ACTIONS) + self.keep_bins_s.index(k)
        if policy in EVICTION_POLICIES:
            raise ConfigError(f"heuristic {bounded_repr(policy)} is a tier eviction order: make the environment "
                              f"with eviction='{policy}' and play action 0 (this one evicts by '{self.eviction}')")
        raise ConfigError(f"heuristic {bounded_repr(policy)} is not a residency heuristic; allowed: None, 'session', "
                          f"'session-hbm', or the environment's eviction order '{self.eviction}' (others: make the "
                          "environment with eviction=<name>), each with an optional '+prefetch'")
