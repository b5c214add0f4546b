"""``kvsched/Scheduling-v0``: the agent makes one instance's scheduler decisions.

Adapter only: the simulation is :class:`kvsched.envs.sim.cluster.Cluster`; this module turns
its decision points into Gymnasium steps (observation: :mod:`.observation`, action:
:mod:`.action`, reward: :mod:`.reward`).
"""

from __future__ import annotations


import inspect

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kvsched.envs.action import (CHUNK_BINS_TOKENS, PREEMPTION_MODES, VICTIM_RULES, AgentDecision, AgentPolicy,
                                 mode_mask)
from kvsched.envs.common import (EpisodeTimelines, build_cluster, check_steppable, episode_config, integer_action,
                                 reference, step_info, unfinished)
from kvsched.envs.episodes import EpisodeSource
from kvsched.envs.observation import build_observation, candidates, has_scheduling_choice, observation_size, \
    reference_order
from kvsched.envs.observation_v1 import (ARRIVAL_TAU_S, BURST_TAU_S, ArrivalRates, check_output_signal,
                                         extend_observation, observation_size_v1)
from kvsched.envs.reward import RewardConfig, SLOReward, reward_config, ttft_slo_by_length_class
from kvsched.envs.sim.cluster import DecisionWatch
from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable
from kvsched.policies.base import make_policy

ACTION_MODES = ("multi", "slot")
OBSERVATION_VERSIONS = (0, 1)
#: ``_pending_end`` while a decision is pending (the episode's end is not known yet); a string, so
#: that it survives pickling (compared with ==)
_DECIDING = "deciding"
_NO_IDS = np.zeros(0, dtype=np.int64)  # shown ids without candidates (read-only)
_NO_IDS.flags.writeable = False


class SchedulingEnv(gym.Env):
    """Scheduler decisions of instance 0 of a scenario, on top of a reference policy.

    **Decision points.** The agent acts when instance 0 is idle and about to plan its next step
    and there is a choice: its waiting queue is open for admission (non-empty, no request
    swapped out unless ``admit_while_swapped``, a free seat, at least one free or evictable
    HBM block) or a running request has an unfinished prefill (its chunk size is a choice).
    Steps without a choice run on the reference policy, and fast-forwarded decode stretches
    only happen while the waiting queue is empty or blocked under a static order; the agent's
    policy declares a non-static order, so the simulator never fast-forwards past a waiting
    queue the agent could reorder. Other instances (if the scenario has several) run the
    reference policy.

    **Observation** ``Box(-1, 1, (K*9 + 10,), float32)``: the top-``K`` candidates in the
    reference policy's order, 9 features each, then 10 instance features; tables and fixed
    scales in :mod:`kvsched.envs.observation`.

    **Action** ``MultiDiscrete([K, 7, 5, 4])`` = (slot, chunk bin, victim rule, preemption
    mode), table in :mod:`kvsched.envs.action`; with ``action_mode="slot"``, ``Discrete(K)``
    (slot only; for DQN). ``(0, 0, 0, 0)`` is the reference policy's own decision. The mask
    (:meth:`action_masks`, also ``info["action_mask"]``, concatenated per part as sb3-contrib
    expects) allows the filled slots (slot 0 alone when there is no candidate, e.g. only a
    chunk choice) and the preemption modes whose tier exists. A masked action is not an error:
    its part falls back to the reference's decision and ``info["invalid_action"]`` is True.

    **Reward** per step: SLO attainment (:mod:`kvsched.envs.reward`): ``+met`` for each request
    finishing within its SLO during the step, ``-missed`` for each whose miss became certain
    during the step (waited past its TTFT SLO without a first token) or that finished missing
    it or was rejected (each request is charged once; the episode sums to
    ``met * n_met - missed * n_missed``); with ``RewardConfig.graded`` also ``met * grade`` in
    [0, 1) for each finished request that missed it (``slo_graded``); with
    ``RewardConfig.shaping`` a potential-based term; components in ``info["reward_components"]``.

    **Episodes**: one window of the scenario (``reset(options={"workload_seed", "window_index"})``
    picks one, otherwise drawn with the env's seeded generator from the ``split``).
    ``terminated`` when every request of the window finished or was rejected (``info["summary"]``
    then holds the metrics summary); ``truncated`` at the first decision point after
    ``horizon_s`` of simulated time (default 3 x ``window_s``; ``math.inf`` = never).

    Args:
        scenario: scenario YAML path (default: the bundled ``mixed-long-short.yaml``).
        window_s, split, heldout_fraction, max_requests: see :class:`kvsched.envs.episodes.EpisodeConfig`.
        reference_policy: name of the reference policy (default ``"fcfs"``).
        reference_params: its parameters (default: the scenario's when it names that policy).
        k: candidate rows shown (>= 1).
        action_mode: ``"multi"`` or ``"slot"``.
        horizon_s: truncation time (s), default ``3 * window_s``.
        reward: :class:`RewardConfig`.
        observation_version: 0 (``Scheduling-v0``'s observation) or 1 (``Scheduling-v1``: K x 11
            + 18 values, :mod:`kvsched.envs.observation_v1`).
        output_signal: version 1's output-length signal: None, ``"oracle"`` (exact lengths) or
            ``{"log_sd": s}`` (a predictor with log-normal error); None with version 0.
        timeline: write each episode's schedule as a Chrome/Perfetto trace: a file name with an
            ``{episode}`` field (e.g. ``"runs/tl/episode-{episode:04d}.json.gz"``; docs/timeline.md,
            :class:`~kvsched.envs.common.EpisodeTimelines`), or None (default).
    """

    metadata = {"render_modes": []}
    #: what :class:`kvsched.agents.heuristic.HeuristicAgent` plays here (it checks the class, not the id)
    heuristic_role = "scheduling"

    def __init__(self, scenario: str | None = None, window_s: float = 60.0, split: str = "train",
                 heldout_fraction: float = 0.25, max_requests: int | None = None, reference_policy: str = "fcfs",
                 reference_params: dict | None = None, k: int = 16, action_mode: str = "multi",
                 horizon_s: float | None = None, reward: RewardConfig = RewardConfig(),
                 observation_version: int = 0, output_signal: dict | str | None = None,
                 timeline: str | None = None) -> None:
        require(isinstance(k, int) and not isinstance(k, bool) and k >= 1, "k", k, "an integer >= 1")
        require(action_mode in ACTION_MODES, "action_mode", action_mode, f"one of {ACTION_MODES}")
        reward = reward_config(reward)  # a mapping too, e.g. from --env-kwargs JSON
        self.source = EpisodeSource(episode_config(scenario, window_s, split, heldout_fraction, max_requests))
        self.reference_params = reference_params
        # validate early; the registered name ("LARS" and aliases are "lars"), which heuristic
        # agents and imitation labels compare with
        self.reference_policy = reference(reference_policy, reference_params, self.source).name
        self.k = k
        self.action_mode = action_mode
        self.horizon_s = 3.0 * window_s if horizon_s is None else float(horizon_s)
        require(self.horizon_s > 0, "horizon_s", horizon_s, "a number of seconds > 0 (math.inf: never truncate)")
        self.reward_config = reward
        self.metrics = self.source.scenario.metrics_config()
        require(observation_version in OBSERVATION_VERSIONS and not isinstance(observation_version, bool),
                "observation_version", observation_version, f"one of {OBSERVATION_VERSIONS}")
        self.output_signal = check_output_signal(output_signal)
        require(output_signal is None or observation_version >= 1, "output_signal", output_signal,
                "None with observation_version 0 (the signal is a version-1 feature: kvsched/Scheduling-v1)")
        self.observation_version = observation_version
        size = observation_size(k) if observation_version == 0 else observation_size_v1(k)
        self.observation_space = spaces.Box(-1.0, 1.0, (size,), np.float32)
        if action_mode == "multi":
            self._nvec = (k, len(CHUNK_BINS_TOKENS), len(VICTIM_RULES), len(PREEMPTION_MODES))
            self.action_space = spaces.MultiDiscrete(list(self._nvec))
        else:
            self._nvec = (k,)
            self.action_space = spaces.Discrete(k)
        self.cluster = None
        self._timelines = EpisodeTimelines(timeline)

    # ------------------------------------------------------------------------------ episode
    def close(self) -> None:
        """Write the unfinished episode's timeline, if any (the ``timeline`` option)."""
        self._timelines.end(self.cluster)
        super().close()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.workload, self.episode = self.source.choose(self.np_random, options)

        def policy_for(i: int):
            ref = reference(self.reference_policy, self.reference_params, self.source)
            return AgentPolicy(ref) if i == 0 else ref

        self._timelines.end(self.cluster)  # an unfinished episode's timeline
        observer = self._timelines.begin(self.source, self.source.scenario.n_instances, self.episode)
        self.cluster = build_cluster(self.source, policy_for, observer=observer)
        self.inst = self.cluster.instances[0]
        self.agent_policy: AgentPolicy = self.inst.policy
        self.slo_reward = SLOReward(self.reward_config, self.metrics)
        self._ttft_slo_s = ttft_slo_by_length_class(self.slo_reward)
        if self.observation_version >= 1:
            slos = self.metrics.slos
            self._tpot_slo_s = (float(slos["short"].tpot_s), float(slos["long"].tpot_s))
            self._rates = ArrivalRates(self.workload.arrival_s, (ARRIVAL_TAU_S, BURST_TAU_S))
            # the predictor's errors: one draw per request, fixed by the episode (workload seed and
            # window), so every agent playing an episode sees the same predictions (paired comparisons)
            self._signal_seed = int(self.episode["workload_seed"]) * 1_000_003 + int(self.episode["window_index"])
            self._signal_factors: dict[int, float] = {}
        self._mode_mask = mode_mask(self.inst.spec.num_dram_blocks, self.inst.spec.num_nvme_blocks)
        self._mode_ok = tuple(self._mode_mask.tolist())
        # the mask for each number of shown candidates (action_masks returns a copy)
        if self.action_mode == "multi":
            template = np.concatenate((np.zeros(self.k, bool), np.ones(len(CHUNK_BINS_TOKENS), bool),
                                       np.ones(len(VICTIM_RULES), bool), self._mode_mask))
        else:
            template = np.zeros(self.k, dtype=bool)
        template[0] = True
        self._masks = []
        for n in range(self.k + 1):
            mask = template.copy()
            mask[1:n] = True
            self._masks.append(mask)
        self.cluster.start(self.workload, DecisionWatch(schedule_instance=0, schedule_filter=has_scheduling_choice))
        self.decisions = 0
        self._last_decision_s = 0.0
        self._over = False
        point = self.cluster.run_until_decision(self.horizon_s)
        if point is None or point.kind == "time":  # nothing to decide in this window (or no request)
            self._pending_end = point  # None: served (maybe empty); a "time" point: truncated
            self._cands, self._shown_ids = [], _NO_IDS
            obs = np.zeros(self.observation_space.shape, dtype=np.float32)
        else:
            self._pending_end = _DECIDING
            obs = self._observe(point.time_s)
        self._potential = self._phi(point)
        return obs, self._info({})

    def _phi(self, point) -> float:
        """The shaping potential at a decision ``point`` (0 when shaping is off, and at the end of
        an episode: ``point`` None)."""
        if not self.reward_config.shaping or point is None:
            return 0.0
        return self.slo_reward.potential(unfinished(self.cluster), point.time_s)

    def _observe(self, now_s: float) -> np.ndarray:
        inst = self.inst
        cands, running = candidates(inst, now_s)
        table = inst.feature_table(cands, now_s, running=running)
        order = reference_order(self.agent_policy.reference, table, inst.policy.stall_free)
        self._table = table
        self._cands = cands
        self._order = order
        if not cands:
            self._shown_ids = _NO_IDS
        elif order is None:
            ids = table.request_id
            self._shown_ids = ids if len(ids) <= self.k else ids[:self.k]
        else:
            self._shown_ids = table.request_id[order[:self.k]]
        obs = build_observation(inst, table, cands, order, self.k, self._ttft_slo_s,
                                self.metrics.long_prompt_tokens, now_s - self._last_decision_s)
        self._last_decision_s = now_s
        if self.observation_version >= 1:
            obs = extend_observation(obs, self.k, inst, cands, order, running, self._tpot_slo_s,
                                     self.metrics.long_prompt_tokens, self._rates, now_s, self.output_signal,
                                     self._signal_seed, self._signal_factors)
        return obs

    # ------------------------------------------------------------------------------- masks
    def action_masks(self) -> np.ndarray:
        """Valid actions, concatenated per action part (sb3-contrib ``MaskablePPO`` layout)."""
        return self._masks[len(self._shown_ids)].copy()  # slot 0 always; slots 1..n-1 when shown

    def _info(self, extra: dict) -> dict:
        return step_info(self, self.cluster.now_s if self.cluster else 0.0, extra)

    def decode(self, action) -> tuple[AgentDecision, bool]:
        """The :class:`AgentDecision` of ``action`` for the current candidates, and whether a
        masked part was replaced by the reference's decision."""
        if type(action) is np.ndarray and action.ndim == 1 and action.dtype.kind == "i":  # usual: no conversion
            a = action.tolist()
        else:
            a = integer_action(action, len(self._nvec), f"{len(self._nvec)} integers below {list(self._nvec)}")
        nvec = self._nvec
        ok = len(a) == len(nvec)
        for x, n in zip(a, nvec):
            ok = ok and 0 <= x < n
        if not ok:
            require(False, "action", action, f"{len(nvec)} integers below {list(nvec)}")
        invalid = False
        slot = a[0]
        n_shown = len(self._shown_ids)
        if slot >= n_shown:
            invalid = slot != 0 or n_shown > 0
            first = None
        else:
            first = None if slot == 0 else int(self._shown_ids[slot])
        chunk, victim, mode = CHUNK_BINS_TOKENS[0], VICTIM_RULES[0], PREEMPTION_MODES[0]
        if len(a) > 1:
            chunk, victim = CHUNK_BINS_TOKENS[a[1]], VICTIM_RULES[a[2]]
            if self._mode_ok[a[3]]:
                mode = PREEMPTION_MODES[a[3]]
            else:
                invalid = True
        ids = self._table.request_id if self._cands else _NO_IDS
        return AgentDecision(first, ids, self._order, chunk, victim, mode), invalid

    # -------------------------------------------------------------------------------- step
    def step(self, action):
        if self.cluster is None or self._over:
            check_steppable(self)  # raises
        invalid = False
        decided_s = self._last_decision_s  # the time of the decision this step acts on
        if isinstance(self._pending_end, str) and self._pending_end == _DECIDING:
            decision, invalid = self.decode(action)
            self.agent_policy.decision = decision
            try:
                self.cluster.apply()
            finally:
                self.agent_policy.decision = None
            self.decisions += 1
            point = self.cluster.run_until_decision(self.horizon_s)
        else:
            point = self._pending_end
        cluster = self.cluster
        comps = self.slo_reward.collect(cluster.recorder.rows)
        terminated = point is None
        truncated = point is not None and point.kind == "time"
        if self.reward_config.early_miss and not terminated and not truncated:
            comps["slo_missed"] += self.slo_reward.certain_misses(unfinished(cluster), cluster.now_s)
        extra = {"invalid_action": invalid, "elapsed_s": cluster.now_s - decided_s}
        if truncated:
            comps["truncation"] = self.slo_reward.truncation_penalty(unfinished(cluster), cluster.now_s)
        if self.reward_config.shaping:  # gamma * Phi(s') - Phi(s); Phi = 0 once the episode ended
            phi = self._phi(None if terminated else point)
            comps["shaping"] = self.reward_config.shaping_gamma * phi - self._potential
            self._potential = phi
        if terminated or truncated:
            self._timelines.end(cluster)
            self._over = True
            obs = np.zeros(self.observation_space.shape, dtype=np.float32)
            self._cands, self._shown_ids = [], _NO_IDS
            if terminated:
                extra["summary"] = cluster.result().summary
        else:
            obs = self._observe(point.time_s)
        extra["reward_components"] = comps
        return obs, float(sum(comps.values())), terminated, truncated, self._info(extra)

    # ---------------------------------------------------------------------- reference agents
    def heuristic_action(self, policy: str | None = None) -> np.ndarray:
        """The action by which heuristic ``policy`` makes this step's decisions exactly: the
        reference's own decision ``(0, 0, 0, 0)`` when ``policy`` is ``None`` or the reference
        policy (an episode so played equals the reference's direct run; tested).

        Raises:
            ConfigError: another policy. The action sets the first admission and the step's chunk
                cap, not a policy's whole order, its chunk rule and its victims, so another policy
                cannot be reproduced through it: make the environment with
                ``reference_policy=<policy>`` (:meth:`imitation_action` gives the approximation
                used for imitation labels).
        """
        if policy is not None and policy != self.reference_policy and make_policy(policy).name != self.reference_policy:
            require(False, "heuristic", policy,
                    f"the environment's reference policy {self.reference_policy!r}: a heuristic acts exactly only as "
                    f"the reference; make the environment with reference_policy={policy!r} and play action 0 "
                    "(imitation_action gives an approximation for imitation labels)")
        a = np.zeros(len(self._nvec), dtype=np.int64)
        return a if self.action_mode == "multi" else a[0]

    def imitation_action(self, policy: str, params: dict | None = None) -> np.ndarray:
        """An approximation of ``policy``'s decision in this environment's action space (imitation
        labels): its first choice among the shown candidates (its order over their FeatureTable),
        every other part the reference's. Not exact: the rest of the admission order, the chunk
        sizes and the victims stay the reference's (use :meth:`heuristic_action` for an exact
        reference)."""
        a = np.zeros(len(self._nvec), dtype=np.int64)
        if policy == self.reference_policy and not params or len(self._shown_ids) < 2:
            return a if self.action_mode == "multi" else a[0]
        key = (policy, repr(sorted((params or {}).items())))
        if not hasattr(self, "_other") or self._other[0] != key:
            p = make_policy(policy, dict(params or {}))
            p.bind(self.agent_policy.ctx)
            self._other = (key, p)
        p = self._other[1]
        rows = np.flatnonzero(np.isin(self._table.request_id, self._shown_ids))
        shown = [self._cands[int(r)] for r in rows]
        t = self.inst.feature_table(shown, self._table.now_s, running=self._table.running[rows])
        order = reference_order(p, t, self.inst.policy.stall_free)
        first_id = int(t.request_id[0 if order is None else order[0]])
        a[0] = int(np.flatnonzero(self._shown_ids == first_id)[0])
        return a if self.action_mode == "multi" else a[0]


class SchedulingEnvV1(SchedulingEnv):
    """``kvsched/Scheduling-v1``: :class:`SchedulingEnv` with observation version 1.

    Gymnasium merges ``make``'s keyword arguments over the id's own, so without this class
    ``gymnasium.make("kvsched/Scheduling-v1", observation_version=0)`` silently made a version-0
    environment under the v1 id.

    Raises:
        ConfigError: an ``observation_version`` other than 1.
    """

    def __init__(self, *args, observation_version: int = 1, **kwargs) -> None:
        require(type(observation_version) is int and observation_version == 1, "observation_version",
                observation_version, "1 for kvsched/Scheduling-v1 (kvsched/Scheduling-v0 has version 0)")
        super().__init__(*args, observation_version=1, **kwargs)


# the same parameters as SchedulingEnv for the callers that read them (kvsched train's --env-kwargs check)
SchedulingEnvV1.__init__.__signature__ = inspect.signature(SchedulingEnv.__init__)  # type: ignore[attr-defined]
