"""``kvsched/Routing-v0``: the agent places each arriving request on an instance.

Adapter only: the simulation is :class:`kvsched.envs.sim.cluster.Cluster` with its arrivals
watched (``DecisionWatch(route=True)``); the action is the cluster's router decision
(``router(state, instances) -> index``, here given by :meth:`Cluster.apply`).
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kvsched.envs.common import (EpisodeTimelines, build_cluster, check_steppable, episode_config, integer_action,
                                 queued_prefill_tokens, reference, step_info, unfinished)
from kvsched.envs.episodes import EpisodeSource
from kvsched.envs.reward import RewardConfig, SLOReward, reward_config
from kvsched.envs.sim.cluster import DecisionWatch
from kvsched.envs.sim.errors import require

REQUEST_FEATURES = ("prompt", "long", "ttft_slo")
INSTANCE_FEATURES = ("hbm_used", "hbm_available", "waiting", "running", "swapped", "queued_prefill",
                     "request_fits")


class RoutingEnv(gym.Env):
    """Which instance gets each arriving request; every instance runs the same policy.

    **Decision points**: every arrival (after the API front-end delay), before routing.

    **Observation** ``Box(0, 1, (3 + 7 N,), float32)``, fixed scales:

    ===========================  =============================================================
    request ``prompt``           prompt_tokens / max_model_len
    request ``long``             1 if prompt_tokens >= MetricsConfig.long_prompt_tokens
    request ``ttft_slo``         s / (s + 1 s), s = TTFT SLO of its length class
    per instance ``hbm_used``    used / capacity HBM blocks
    ``hbm_available``            (free + evictable) / capacity HBM blocks
    ``waiting``                  n / (n + 16), n = waiting requests
    ``running``                  running requests / max_num_seqs
    ``swapped``                  n / (n + 1), n = swapped-out requests
    ``queued_prefill``           q / (q + max_model_len), q = prompt tokens still to prefill
                                 (waiting + running partial prefills)
    ``request_fits``             1 if the request's prompt KV fits in the available blocks
    ===========================  =============================================================

    **Action** ``Discrete(N)``: the instance index. Every instance is valid (mask all True;
    ``action_masks()`` and ``info["action_mask"]`` exist for a uniform API). With a scenario
    giving prefill/decode roles (``cluster:``) the action is the decode instance: prefill
    instances are masked (a masked action is not an error: the cluster's router places the
    request and ``info["invalid_action"]`` is True) and the cluster decides the
    prefill (``kvsched/PDRouting-v0`` lets the agent decide that too).

    **Reward**: as ``kvsched/Scheduling-v0`` (SLO attainment per recorded request, over all
    instances; :mod:`kvsched.envs.reward`).

    **Episodes**: windows of the scenario as in ``Scheduling-v0``; ``terminated`` when the
    window is served, ``truncated`` at the first arrival after ``horizon_s`` (then the rest is
    not simulated).

    Args:
        scenario, window_s, split, heldout_fraction, max_requests: see ``Scheduling-v0``.
        n_instances: instances (default: the scenario's, at least 2).
        policy: the instances' scheduler policy (default: the scenario's).
        horizon_s: truncation time (s), default ``3 * window_s``.
        reward: :class:`RewardConfig`, or a mapping of its fields.
        timeline: write each episode's schedule as a Chrome/Perfetto trace: a file name with an
            ``{episode}`` field (e.g. ``"runs/tl/episode-{episode:04d}.json.gz"``; docs/timeline.md,
            :class:`~kvsched.envs.common.EpisodeTimelines`), or None (default).
    """

    metadata = {"render_modes": []}
    #: what :class:`kvsched.agents.heuristic.HeuristicAgent` plays here (it checks the class, not the id)
    heuristic_role = "routing"

    def __init__(self, scenario: str | None = None, window_s: float = 60.0, split: str = "train",
                 heldout_fraction: float = 0.25, max_requests: int | None = None, n_instances: int | None = None,
                 policy: str | None = None, horizon_s: float | None = None,
                 reward: RewardConfig = RewardConfig(), timeline: str | None = None) -> None:
        self.source = EpisodeSource(episode_config(scenario, window_s, split, heldout_fraction, max_requests))
        sc = self.source.scenario
        n = max(2, sc.n_instances) if n_instances is None else n_instances
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, "n_instances", n_instances,
                "an integer >= 1")
        self.n_instances = n
        self._action_allowed = f"an instance index in [0, {n})"  # for errors; built once, not per step
        self.policy = sc.policy if policy is None else policy
        reference(self.policy, None, self.source)  # validate early
        self.horizon_s = 3.0 * window_s if horizon_s is None else float(horizon_s)
        require(self.horizon_s > 0, "horizon_s", horizon_s, "a number of seconds > 0")
        self.reward_config = reward_config(reward)  # a mapping too, e.g. from --env-kwargs JSON
        require(not self.reward_config.shaping, "reward.shaping", self.reward_config.shaping,
                "0 on Routing-v0 (potential-based shaping is implemented in kvsched/Scheduling-v0/v1 only)")
        self.metrics = sc.metrics_config()
        self.observation_space = spaces.Box(0.0, 1.0, (len(REQUEST_FEATURES) + n * len(INSTANCE_FEATURES),),
                                            np.float32)
        self.action_space = spaces.Discrete(n)
        self._mask = np.ones(n, dtype=bool)
        layout = sc.cluster_layout()
        if layout is not None:  # prefill/decode roles: the action picks the decode instance only
            self._mask = np.array([r != "prefill" for r in layout.roles], dtype=bool)
        self.cluster = None
        self._timelines = EpisodeTimelines(timeline)
        self._heuristic = None

    def close(self) -> None:
        """Write the unfinished episode's timeline, if any (the ``timeline`` option)."""
        self._timelines.end(self.cluster)
        super().close()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.workload, self.episode = self.source.choose(self.np_random, options)
        self._timelines.end(self.cluster)  # an unfinished episode's timeline
        observer = self._timelines.begin(self.source, self.n_instances, self.episode)
        self.cluster = build_cluster(self.source, lambda i: reference(self.policy, None, self.source),
                                     n_instances=self.n_instances, observer=observer)
        self.slo_reward = SLOReward(self.reward_config, self.metrics)
        self.cluster.start(self.workload, DecisionWatch(route=True))
        self._heuristic = None  # the router heuristic_action asks (one per episode)
        self.decisions = 0
        self._over = False
        self._point = self.cluster.run_until_decision(self.horizon_s)
        self._decided_s = self.cluster.now_s  # the time of the decision the next step acts on
        return self._observe(), self._info({})

    def _observe(self) -> np.ndarray:
        p = self._point
        if p is None or p.kind != "route":
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        st = p.request
        m = self.metrics
        prompt = st.prompt_tokens
        insts = self.cluster.instances
        max_len = float(insts[0].spec.model_len_limit)
        long = prompt >= m.long_prompt_tokens
        slo = m.slos["long" if long else "short"].ttft_s
        vals = [prompt / max_len, 1.0 if long else 0.0, slo / (slo + 1.0)]
        for inst in insts:
            hbm = inst.hbm
            cap = float(max(hbm.capacity_blocks, 1))
            available = hbm.available_blocks
            queued = queued_prefill_tokens(inst)
            nw, ns = len(inst.waiting), len(inst.swapped)
            need = math.ceil(prompt / inst.bs)
            vals += (hbm.used_blocks / cap, available / cap, nw / (nw + 16.0), len(inst.running) / inst.spec.max_seqs,
                     ns / (ns + 1.0), queued / (queued + max_len), 1.0 if need <= available else 0.0)
        return np.array(vals, dtype=np.float32)  # float64 values rounded to float32 once

    def heuristic_action(self, router: str, params: dict | None = None) -> int:
        """The instance router ``router`` (a name of :mod:`kvsched.policies.routing`, with
        ``params``) sends the pending request to, from the state view the cluster would give it
        (the same staleness): an episode so played equals the direct run with that router
        (tested). The router is built and bound at the episode's first call and sees every
        arrival once, in order; call it once per step. 0 when no request is pending.

        Raises:
            ConfigError: an unknown router or invalid parameters.
        """
        from kvsched.envs.sim.routing import RouterTable
        from kvsched.policies.routing import make_router

        key = (router, repr(sorted((params or {}).items())))
        decode_ids = np.flatnonzero(self._mask)  # with prefill/decode roles: the decode and mixed instances
        if self._heuristic is None or self._heuristic[0] != key:
            r = make_router(router, dict(params or {}))
            r.bind(len(decode_ids), self.source.scenario.seed)
            self._heuristic = (key, r)
        p = self._point
        if p is None or p.kind != "route":
            return 0
        c = self.cluster
        if c.disagg is not None:
            from kvsched.envs.sim.routing import InstanceStateView

            subset = [c.instances[i] for i in decode_ids]
            row = self._heuristic[1].route(RouterTable(InstanceStateView(subset, p.time_s), p.request, p.time_s))
            return int(decode_ids[int(row)])
        view = c.state_provider.view(c.instances, p.time_s, c.shared_kv)
        return int(self._heuristic[1].route(RouterTable(view, p.request, p.time_s, c.shared_kv)))

    def _route(self, a: int) -> bool:
        """Carry out action ``a`` at the pending arrival; True when ``a`` was masked (a prefill
        instance: the cluster's router places the request, as Scheduling-v0's masked parts fall
        back to the reference)."""
        if not self._mask[a]:
            self.cluster.apply(route_to=None)
            return True
        self.cluster.apply(route_to=a)
        return False

    def action_masks(self) -> np.ndarray:
        """All instances are valid targets (with prefill/decode roles: the decode and mixed ones)."""
        return self._mask.copy()

    def _info(self, extra: dict) -> dict:
        return step_info(self, self.cluster.now_s, extra)

    def step(self, action):
        if self.cluster is None or self._over:
            check_steppable(self)  # raises
        a = action if type(action) is int else integer_action(action, 1, self._action_allowed)[0]
        if not 0 <= a < self.action_space.n:
            require(False, "action", action, self._action_allowed)
        invalid = False
        if self._point is not None and self._point.kind == "route":
            invalid = self._route(a)
            self.decisions += 1
            self._point = self.cluster.run_until_decision(self.horizon_s)
        comps = self.slo_reward.collect(self.cluster.recorder.rows)
        terminated = self._point is None
        truncated = self._point is not None and self._point.kind == "time"
        extra = {"invalid_action": invalid, "elapsed_s": self.cluster.now_s - self._decided_s}
        self._decided_s = self.cluster.now_s
        states = unfinished(self.cluster)
        if truncated:
            comps["truncation"] = self.slo_reward.truncation_penalty(states, self.cluster.now_s)
        elif not terminated and self.reward_config.early_miss:
            comps["slo_missed"] += self.slo_reward.certain_misses(states, self.cluster.now_s)
        if terminated or truncated:
            self._timelines.end(self.cluster)
            self._over = True
            if terminated:
                extra["summary"] = self.cluster.result().summary
        extra["reward_components"] = comps
        return self._observe(), float(sum(comps.values())), terminated, truncated, self._info(extra)


class PDRoutingEnv(RoutingEnv):
    """``kvsched/PDRouting-v0``: with prefill/decode roles, the agent picks each arriving
    request's decode instance **and** where its prompt is prefilled (a prefill instance, or
    locally on the decode instance). Routing-v0's ``Discrete(N)`` action names one instance, so it
    cannot carry the pair; this id keeps Routing-v0 unchanged.

    Needs a scenario with a ``cluster:`` section (docs/disaggregation.md) and at least one
    prefill instance; default: the bundled ``mixed-long-short-pd``.

    **Observation**: Routing-v0's, plus two features per instance: ``is_prefill`` (1 for a
    prefill-only instance) and ``kv_sending`` (HBM blocks a prefill instance holds for decode
    instances still to read them, over its capacity). ``Box(0, 1, (3 + 9 N,), float32)``.

    **Action** ``Discrete(D * (P + 1))`` over the D decode-capable (decode and mixed) instances
    and the P prefill instances, in instance order: ``a = d * (P + 1) + k``; ``k = 0`` prefills
    on the decode instance, ``k >= 1`` on the k-th prefill instance. ``action_masks()``: a mixed
    decode target only takes ``k = 0``. A masked action is not an error: its prefill part falls back
    to the cluster's own decision (local for a mixed target) and ``info["invalid_action"]`` is True.

    **Reward** and **episodes**: as Routing-v0. Args as Routing-v0 (``n_instances`` must be left
    out: the scenario's roles fix the instances).
    """

    def __init__(self, scenario: str | None = None, window_s: float = 60.0, split: str = "train",
                 heldout_fraction: float = 0.25, max_requests: int | None = None, n_instances: int | None = None,
                 policy: str | None = None, horizon_s: float | None = None,
                 reward: RewardConfig = RewardConfig(), timeline: str | None = None) -> None:
        if scenario is None:
            from kvsched.envs import default_scenario

            scenario = default_scenario("kvsched/PDRouting-v0")
        source = EpisodeSource(episode_config(scenario, window_s, split, heldout_fraction, max_requests))
        sc = source.scenario
        layout = sc.cluster_layout()
        require(layout is not None and layout.counts["prefill"] > 0, "scenario", scenario,
                "a scenario with a cluster: section holding at least one prefill instance (docs/disaggregation.md)")
        assert layout is not None
        require(n_instances is None or n_instances == sc.n_instances, "n_instances", n_instances,
                f"None (the scenario's roles fix {sc.n_instances} instances)")
        super().__init__(scenario, window_s, split, heldout_fraction, max_requests, sc.n_instances, policy,
                         horizon_s, reward, timeline)
        self.roles = layout.roles
        self.decode_ids = [i for i, r in enumerate(self.roles) if r != "prefill"]
        self.prefill_ids = [i for i, r in enumerate(self.roles) if r == "prefill"]
        k = len(self.prefill_ids) + 1
        n_act = len(self.decode_ids) * k
        self.action_space = spaces.Discrete(n_act)
        self._action_allowed = f"an action in [0, {n_act}): decode row * {k} + prefill choice"
        self._mask = np.array([self.roles[self.decode_ids[a // k]] == "decode" or a % k == 0 for a in range(n_act)])
        n = self.n_instances
        self.observation_space = spaces.Box(0.0, 1.0, (len(REQUEST_FEATURES) + n * (len(INSTANCE_FEATURES) + 2),),
                                            np.float32)

    def _observe(self) -> np.ndarray:
        base = super()._observe()
        p = self._point
        if p is None or p.kind != "route":
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        extra = []
        for inst in self.cluster.instances:
            cap = float(max(inst.hbm.capacity_blocks, 1))
            sending = sum(s.hbm_blocks for s in inst.sending)
            extra += (1.0 if self.roles[inst.instance_id] == "prefill" else 0.0, min(1.0, sending / cap))
        return np.concatenate([base, np.array(extra, dtype=np.float32)])

    def decode_action(self, a: int) -> tuple[int, int]:
        """``(decode instance, prefill instance or LOCAL_PREFILL)`` of action ``a``."""
        from kvsched.envs.sim.cluster import LOCAL_PREFILL

        k = len(self.prefill_ids) + 1
        d, j = divmod(int(a), k)
        return self.decode_ids[d], (LOCAL_PREFILL if j == 0 else self.prefill_ids[j - 1])

    def _route(self, a: int) -> bool:
        d, pf = self.decode_action(a)
        if not self._mask[a]:  # a remote prefill for a mixed target: the cluster's own prefill decision
            self.cluster.apply(route_to=d, prefill_to=None)
            return True
        self.cluster.apply(route_to=d, prefill_to=pf)
        return False

    def heuristic_action(self, router: str, params: dict | None = None) -> int:
        """The action the named router (over the decode and mixed instances) and the cluster's own
        prefill decision (Dynamo's threshold, the scenario's prefill router) take: an episode so
        played equals the direct run with that router (tested). 0 when no request is pending.

        Raises:
            ConfigError: an unknown router or invalid parameters.
        """
        from kvsched.envs.sim.cluster import LOCAL_PREFILL
        from kvsched.envs.sim.routing import InstanceStateView, RouterTable
        from kvsched.policies.routing import make_router

        key = (router, repr(sorted((params or {}).items())))
        if self._heuristic is None or self._heuristic[0] != key:
            r = make_router(router, dict(params or {}))
            r.bind(len(self.decode_ids), self.source.scenario.seed)
            self._heuristic = (key, r)
        p = self._point
        if p is None or p.kind != "route":
            return 0
        c = self.cluster
        subset = [c.instances[i] for i in self.decode_ids]
        row = int(self._heuristic[1].route(RouterTable(InstanceStateView(subset, p.time_s), p.request, p.time_s)))
        pf = c.disagg_choice(p.request, self.decode_ids[row], p.time_s)
        k = len(self.prefill_ids) + 1
        return row * k + (0 if pf == LOCAL_PREFILL else self.prefill_ids.index(pf) + 1)
