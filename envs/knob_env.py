"""``kvsched/Knobs-v0``: the agent tunes a heuristic's parameters every interval of simulated time.

Adapter only: the simulation is :class:`kvsched.envs.sim.cluster.Cluster`, advanced with
``run_until_decision(until_s)`` from one interval boundary to the next; in between the
heuristic schedules on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kvsched.envs.common import (EpisodeTimelines, build_cluster, check_steppable, episode_config,
                                 queued_prefill_tokens, reference, step_info, unfinished)
from kvsched.envs.episodes import EpisodeSource
from kvsched.envs.reward import RewardConfig, SLOReward, reward_config
from kvsched.envs.sim.cluster import DecisionWatch
from kvsched.envs.sim.errors import ConfigError, require, bounded_repr

#: tunable parameters per heuristic: (field, low, high, integer multiple or None). The action
#: ``a`` in [-1, 1] maps affinely to [low, high]; integer fields are rounded to the multiple.
#: LARS ranges: REFERENCE §1.2-1.3 (kappa 2-5 suggested, widened; TTFT floor 0.25-1 s, widened
#: down; TBT target and chunk ceiling around the defaults 0.05 s and 8192 tokens).
KNOB_SETS: dict[str, tuple[tuple[str, float, float, int | None], ...]] = {
    "lars": (("kappa", 1.0, 8.0, None), ("ttft_floor_s", 0.05, 1.0, None), ("tbt_target_s", 0.01, 0.2, None),
             ("max_chunk_tokens", 256, 8192, 16)),
}

OBS_FEATURES = ("hbm_used", "hbm_available", "waiting", "running", "swapped", "queued_prefill", "arrived",
                "finished", "met_fraction", "missed")


class ParamsBuilder:
    """Builds one policy's parameters for each interval: ``dataclasses.replace(params, **values)``
    for a fixed set of replaced fields (the knobs), cheaper.

    A parameter class whose ``__init__`` takes exactly its fields (no ``InitVar``, no
    ``init=False`` field, no ``__slots__``) gets a new instance with the initial fields and
    ``values`` in its ``__dict__``, validated by the check its class chooses once for those
    fields (:meth:`kvsched.policies.base.PolicyParams.validator_for`; default the full
    ``__post_init__``, as the generated ``__init__`` would call it) -- the same object as
    ``replace`` builds, without the generated ``__init__``'s one ``object.__setattr__`` per
    field nor re-checking the unchanged fields. Any other class goes through
    ``dataclasses.replace``.

    Args:
        params: the policy's validated parameters at the start of the episode.
        knobs: the names of the fields every call replaces.
    """

    __slots__ = ("params", "cls", "fields", "validate")

    def __init__(self, params, knobs) -> None:
        self.params = params
        self.cls = type(params)
        #: the initial fields (each call starts from them: only the knobs ever change)
        self.fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
        self.validate = self.cls.validator_for(frozenset(knobs)) if _plain_params(self.cls) else None

    def __call__(self, values: dict):
        """New parameters: the initial ones with ``values`` (knob name -> value).

        Raises:
            ConfigError: the parameter class's validation rejects a value.
        """
        if self.validate is None:
            return dataclasses.replace(self.params, **values)
        new = object.__new__(self.cls)
        d = new.__dict__
        d.update(self.fields)
        d.update(values)
        self.validate(new)
        return new


@functools.cache
def _plain_params(cls) -> bool:
    """Whether :class:`ParamsBuilder` may fill ``cls``' ``__dict__`` directly (see there)."""
    if not dataclasses.is_dataclass(cls) or any("__slots__" in vars(c) for c in cls.__mro__ if c is not object):
        return False
    names = [f.name for f in dataclasses.fields(cls)]
    init_params = list(inspect.signature(cls.__init__).parameters)[1:]
    return all(f.init for f in dataclasses.fields(cls)) and init_params == names


class KnobEnv(gym.Env):
    """Parameters of a heuristic (default LARS), set every ``interval_s`` of simulated time.

    **Decision points**: t = 0, interval_s, 2 interval_s, ... (simulated seconds).

    **Action** ``Box(-1, 1, (d,), float32)``: one entry per knob of :data:`KNOB_SETS`
    (LARS: kappa in [1, 8], ttft_floor_s in [0.05, 1] s, tbt_target_s in [0.01, 0.2] s,
    max_chunk_tokens in [256, 8192] tokens, multiples of 16), mapped affinely
    ``low + (a + 1) / 2 (high - low)``; values outside [-1, 1] are an error (no clipping). The
    same parameters apply to every instance until the next decision.

    **Observation** ``Box(-1, 1, (10 + d,), float32)``, averages over instances, fixed scales:

    ==================  ====================================================================
    hbm_used            used / capacity HBM blocks
    hbm_available       (free + evictable) / capacity HBM blocks
    waiting             n / (n + 16), n = waiting requests
    running             running requests / max_num_seqs
    swapped             n / (n + 1)
    queued_prefill      q / (q + max_model_len), q = tokens still to prefill
    arrived             n / (n + 10), requests arrived in the last interval
    finished            n / (n + 10), requests recorded in the last interval
    met_fraction        share of those meeting their SLO (0 when none)
    missed              n / (n + 1), those missing it
    knobs (d)           the current parameters, mapped back to [-1, 1]
    ==================  ====================================================================

    **Reward**: SLO attainment per recorded request, as ``kvsched/Scheduling-v0``.

    **Episodes**: windows of the scenario; ``terminated`` when served, ``truncated`` at the
    first interval boundary at or after ``horizon_s``.

    Args:
        scenario, window_s, split, heldout_fraction, max_requests: see ``Scheduling-v0``.
        heuristic: a key of :data:`KNOB_SETS`.
        interval_s: simulated seconds between decisions (> 0).
        horizon_s: truncation time (s), default ``3 * window_s``.
        reward: :class:`RewardConfig`, or a mapping of its fields.
        timeline: write each episode's schedule as a Chrome/Perfetto trace: a file name with an
            ``{episode}`` field (e.g. ``"runs/tl/episode-{episode:04d}.json.gz"``; docs/timeline.md,
            :class:`~kvsched.envs.common.EpisodeTimelines`), or None (default).
    """

    metadata = {"render_modes": []}
    #: what :class:`kvsched.agents.heuristic.HeuristicAgent` plays here (it checks the class, not the id)
    heuristic_role = "knobs"

    def __init__(self, scenario: str | None = None, window_s: float = 60.0, split: str = "train",
                 heldout_fraction: float = 0.25, max_requests: int | None = None, heuristic: str = "lars",
                 interval_s: float = 5.0, horizon_s: float | None = None,
                 reward: RewardConfig = RewardConfig(), timeline: str | None = None) -> None:
        require(heuristic in KNOB_SETS, "heuristic", heuristic, f"one of {sorted(KNOB_SETS)}")
        require(isinstance(interval_s, (int, float)) and not isinstance(interval_s, bool) and interval_s > 0,
                "interval_s", interval_s, "a number of seconds > 0")
        self.source = EpisodeSource(episode_config(scenario, window_s, split, heldout_fraction, max_requests))
        self.heuristic = heuristic
        self.knobs = KNOB_SETS[heuristic]
        self.interval_s = float(interval_s)
        self.horizon_s = 3.0 * window_s if horizon_s is None else float(horizon_s)
        require(self.horizon_s > 0, "horizon_s", horizon_s, "a number of seconds > 0")
        self.reward_config = reward_config(reward)  # a mapping too, e.g. from --env-kwargs JSON
        require(not self.reward_config.shaping, "reward.shaping", self.reward_config.shaping,
                "0 on Knobs-v0 (potential-based shaping is implemented in kvsched/Scheduling-v0/v1 only)")
        self.metrics = self.source.scenario.metrics_config()
        d = len(self.knobs)
        self.action_space = spaces.Box(-1.0, 1.0, (d,), np.float32)
        self.observation_space = spaces.Box(-1.0, 1.0, (len(OBS_FEATURES) + d,), np.float32)
        self._mask = np.ones(d, dtype=bool)  # nothing to mask; action_masks returns a copy
        #: (field, low, high - low, multiple or None) per knob: the affine map's terms, computed once
        self._spans = tuple((name, lo, hi - lo, mult) for name, lo, hi, mult in self.knobs)
        self._reference_values: tuple[np.ndarray, dict] | None = None  # heuristic_action's (action, values)
        self._check_knob_box()
        self.cluster = None
        self._timelines = EpisodeTimelines(timeline)

    def _check_knob_box(self) -> None:
        """Build the scenario's parameters at every corner of the knob box (each knob at its low
        and its high end) and validate them, so that a scenario whose fixed parameters conflict
        with a knob range (e.g. LARS ``min_chunk_tokens`` 512 against the ``max_chunk_tokens``
        range's low end 256) fails here, not in the middle of a training run at the first
        action that reaches the conflict. The checks of the parameter classes are bounds on
        single fields and on the order of two of them, so the corners cover the whole box.

        Raises:
            ConfigError: naming the scenario, the knob corner and the parameter class's message.
        """
        import itertools

        build = ParamsBuilder(reference(self.heuristic, None, self.source).params, [n for n, *_ in self.knobs])
        for corner in itertools.product((-1.0, 1.0), repeat=len(self.knobs)):
            values = self.values(np.array(corner))
            try:
                build(values)
            except ConfigError as e:
                raise ConfigError(f"Knobs-v0 on scenario {bounded_repr(self.source.scenario.name)}: "
                                  f"its {self.heuristic} "
                                  f"parameters conflict with the knob ranges at {values}: {e}") from None

    def heuristic_action(self, heuristic: str | None = None) -> np.ndarray:
        """The action that keeps the heuristic's own parameters (the scenario's, or its defaults):
        an episode so played equals the heuristic's direct run (tested). :meth:`values` maps this
        exact action back to those exact values (the affine map alone could be off in the last bit).

        Raises:
            ConfigError: another heuristic than the environment's, or parameters outside the knob
                ranges (no action reaches them).
        """
        if heuristic is not None and heuristic != self.heuristic:
            require(False, "heuristic", heuristic, f"the environment's heuristic {self.heuristic!r} (Knobs-v0 sets "
                    f"its parameters; make the environment with heuristic={heuristic!r})")
        if self._reference_values is None:
            params = reference(self.heuristic, None, self.source).params
            vals = {n: getattr(params, n) for n, *_ in self.knobs}
            x = np.array(self._knob_vector(vals), dtype=np.float32)
            if not np.all((x >= -1.0) & (x <= 1.0)):
                require(False, "heuristic parameters", vals, f"values inside the knob ranges {self.knobs}")
            x.flags.writeable = False
            self._reference_values = (x, vals)
        return self._reference_values[0].copy()

    def values(self, action) -> dict:
        """The parameter values of ``action`` (see the class docstring); the exact values of the
        heuristic's own parameters for :meth:`heuristic_action`'s action.

        Raises:
            ConfigError: wrong shape, an entry outside [-1, 1] or not finite, or entries that
                are not real numbers (see :meth:`_real_entries`).
        """
        ref = self._reference_values
        if ref is not None and type(action) is np.ndarray and np.array_equal(action, ref[0]):
            return dict(ref[1])
        # the usual case, a 1-D float array: tolist() gives its entries as Python floats, exactly
        a = action.tolist() if type(action) is np.ndarray else None
        if type(a) is not list or len(a) != len(self._spans) or not all(type(x) is float for x in a):
            a = self._real_entries(action)
        out = {}
        for x, (name, lo, span, mult) in zip(a, self._spans):
            if not -1.0 <= x <= 1.0:  # NaN fails too
                require(False, "action", action, f"{len(self.knobs)} numbers in [-1, 1]")
            v = lo + (x + 1.0) / 2.0 * span
            out[name] = int(round(v / mult) * mult) if mult else v
        return out

    def _real_entries(self, action) -> list[float]:
        """The entries of any array-like of real numbers (float, integer or bool entries), as
        Python floats: converted to float64 (the same numbers as ``tolist()`` gives for a float
        array), flattened. Anything that is not real numbers -- complex (whose imaginary part the
        conversion would drop), strings, dates, a masked array with masked entries (whose mask it
        would drop), ragged nesting -- is rejected, not converted.

        Raises:
            ConfigError: not real numbers, or not ``d`` of them.
        """
        allowed = f"{len(self.knobs)} numbers in [-1, 1]"
        try:
            arr = np.asarray(action)
        except (TypeError, ValueError):  # ragged nesting
            require(False, "action", action, allowed)
        kind = arr.dtype.kind
        if not (kind in "biuf" or (kind == "O" and all(isinstance(x, numbers.Real) for x in arr.flat))) \
                or np.ma.is_masked(action):
            require(False, "action", action, allowed)
        a = arr.astype(np.float64).reshape(-1).tolist()
        if len(a) != len(self.knobs):
            require(False, "action", action, allowed)
        return a

    def _set(self, values: dict) -> None:
        """Every instance's policy gets parameters with ``values`` (built and validated by its
        :class:`ParamsBuilder`); ``set_params`` updates what the policy derives from them."""
        for pol, build in self._builders:
            pol.set_params(build(values))

    def _knob_vector(self, values: dict) -> list[float]:
        """Parameter values mapped back to [-1, 1] (the observation's last ``d`` entries)."""
        return [2.0 * (values[n] - lo) / span - 1.0 for n, lo, span, _ in self._spans]

    def close(self) -> None:
        """Write the unfinished episode's timeline, if any (the ``timeline`` option)."""
        self._timelines.end(self.cluster)
        super().close()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.workload, self.episode = self.source.choose(self.np_random, options)
        self._timelines.end(self.cluster)  # an unfinished episode's timeline
        observer = self._timelines.begin(self.source, self.source.scenario.n_instances, self.episode)
        self.cluster = build_cluster(self.source, lambda i: reference(self.heuristic, None, self.source),
                                     observer=observer)
        #: (policy, the builder of its parameters) per instance
        knob_names = [n for n, *_ in self.knobs]
        self._builders = [(inst.policy, ParamsBuilder(inst.policy.params, knob_names))
                          for inst in self.cluster.instances]
        #: per instance, what the observation reads and its fixed scales: (instance, HBM pool,
        #: capacity blocks (>= 1), max_model_len tokens, max_num_seqs), as floats where divided by
        self._obs_instances = [(inst, inst.hbm, float(max(inst.hbm.capacity_blocks, 1)),
                                float(inst.spec.model_len_limit), inst.spec.max_seqs)
                               for inst in self.cluster.instances]
        self.slo_reward = SLOReward(self.reward_config, self.metrics)
        self.cluster.start(self.workload, DecisionWatch())
        self.decisions = 0
        self._over = False
        self._t = 0.0
        self._arrived0 = 0
        params = self.cluster.instances[0].policy.params
        return self._observe(0, 0, 0, {n: getattr(params, n) for n, *_ in self.knobs}), step_info(self, self._t, {})

    def _observe(self, met: int, missed: int, arrived: int, knobs: dict) -> np.ndarray:
        """The observation (see the class docstring): float64 values, rounded to float32 once."""
        rows = []
        for inst, hbm, cap, max_len, max_seqs in self._obs_instances:
            q = queued_prefill_tokens(inst)
            nw, ns = len(inst.waiting), len(inst.swapped)
            rows.append((hbm.used_blocks / cap, hbm.available_blocks / cap, nw / (nw + 16.0),
                         len(inst.running) / max_seqs, ns / (ns + 1.0), q / (q + max_len)))
        # the mean over instances; one instance: its row itself (x / 1.0 == x)
        vals = list(rows[0]) if len(rows) == 1 else np.mean(np.asarray(rows), axis=0).tolist()
        done = met + missed
        vals += (arrived / (arrived + 10.0), done / (done + 10.0), met / done if done else 0.0,
                 missed / (missed + 1.0))
        vals += self._knob_vector(knobs)
        return np.array(vals, dtype=np.float32)

    def action_masks(self) -> np.ndarray:
        """Continuous action: nothing to mask. One True per dimension, for a uniform API; a new
        array every call (``info["action_mask"]`` too: Gymnasium >= 1.4's ``check_env`` refuses
        data shared between two returned infos, as a caller may keep and modify them)."""
        return self._mask.copy()

    def step(self, action):
        if self.cluster is None or self._over:
            check_steppable(self)  # raises
        values = self.values(action)
        self._set(values)
        self.decisions += 1
        self._t = t = self._t + self.interval_s
        cluster, reward = self.cluster, self.slo_reward
        point = cluster.run_until_decision(t)
        met0, missed0 = reward.met, reward.missed
        comps = reward.collect(cluster.recorder.rows)
        arrived = cluster.arrived - self._arrived0
        self._arrived0 = cluster.arrived
        terminated = point is None
        truncated = not terminated and t >= self.horizon_s
        # the episode may end before the interval does: its end, not the interval's, is the time
        end_s = cluster.now_s if terminated and cluster.now_s < t else t
        extra = {"knobs": values, "elapsed_s": end_s - (t - self.interval_s)}
        obs = self._observe(reward.met - met0, reward.missed - missed0, arrived, values)
        if truncated:
            comps["truncation"] = reward.truncation_penalty(unfinished(cluster), t)
        elif not terminated and self.reward_config.early_miss:
            comps["slo_missed"] += reward.certain_misses(unfinished(cluster), t)
        if terminated or truncated:
            self._timelines.end(cluster)
            self._over = True
            if terminated:
                extra["summary"] = cluster.result().summary
        extra["reward_components"] = comps
        return obs, float(sum(comps.values())), terminated, truncated, step_info(self, end_s, extra)
