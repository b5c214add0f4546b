"""Rewards of the environments: SLO attainment, request by request.

A request *meets its SLO* exactly as :func:`kvsched.envs.sim.metrics.summarize` judges it:
finished, TTFT <= its class's ``ttft_s``, TPOT <= ``tpot_s`` (when it generated more than one
token) and E2E <= ``e2e_s`` (when set); its class is the record's ``slo_class`` when the
metrics configuration names it, else its length class. SLO attainment = met / arrived, so the
episode's reward sum is ``w_met * met - w_missed * missed`` where every request counts once:
``+w_met`` when its record is written (finish), ``-w_missed`` at the first decision at which
its miss is certain (``early_miss``, default: it waited past its TTFT SLO without a first token,
its first token came late, its TPOT can no longer meet the SLO given its output length, or it
waited past its E2E SLO; :meth:`SLOReward.certain_misses`) -- or else when its record is
written (finish or rejection). Charging a certain miss
when it becomes certain, not when the request finishes seconds later, shortens the credit
assignment without changing the episode's sum. When an episode is truncated at its horizon,
the requests already past their TTFT SLO are charged too.

Optional **potential-based shaping** (``RewardConfig.shaping`` > 0; Ng, Harada and Russell,
"Policy invariance under reward transformations", ICML 1999, Thm. 1): a component
``gamma * Phi(s') - Phi(s)`` with the potential ``Phi(s) = -shaping * sum over the requests
still without a first token of min(1, waited / their TTFT SLO)`` (0 at the end of an episode).
Over an episode its discounted sum is ``-Phi(s_0)``, the same for every policy, so with
``shaping_gamma`` equal to the learner's discount the optimal policies are unchanged; it only
moves credit earlier (a request's wait costs as it grows, not when its miss is charged).

Optional **graded SLO credit** (``RewardConfig.graded``): SLO attainment is a step function of
latency, so a request that misses its TTFT SLO by 1 % earns the same as one that misses it by
10x and a near miss gives a learner no signal to improve on. With ``graded`` each *finished*
request whose record misses its SLO also earns ``met * grade`` in the component ``slo_graded``
when its record is written, where (latencies and bounds in s, the same SLO the binary judgement
uses)::

    grade = min(1, ttft_slo / ttft, tpot_slo / tpot [generated > 1 token], e2e_slo / e2e [e2e bound set])

(a ratio whose observed value is 0 counts as 1); a rejected request earns 0, a met one keeps
exactly ``+met`` (no graded component). The miss penalty is unchanged, so an episode sums to
``met * n_met - missed * n_missed + met * sum of the grades of the missed finished requests``:
it still rises with attainment but ranks a near miss above a far one. Unlike shaping this
*changes the objective* (it is not policy-invariant): a policy may now give up a met request
(a loss of ``met + missed - met * its grade``) when that raises the grades of other missed
requests by more. Off by default.

Components are reported in ``info["reward_components"]`` (``slo_graded`` only when ``graded``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.metrics import LENGTH_CLASSES, RECORD_COLUMNS, MetricsConfig

_I = {c: i for i, c in enumerate(RECORD_COLUMNS)}
_STATUS, _SLO_CLASS, _PROMPT = _I["status"], _I["slo_class"], _I["prompt_tokens"]
_ARRIVAL, _FIRST, _FINISH, _GENERATED = _I["arrival_s"], _I["first_token_s"], _I["finish_s"], _I["generated_tokens"]
_RID = _I["request_id"]
#: a record row's fields SLOReward judges it by, in one C call per row
_JUDGED_FIELDS = operator.itemgetter(_STATUS, _SLO_CLASS, _PROMPT, _ARRIVAL, _FIRST, _FINISH, _GENERATED, _RID)


@dataclass(frozen=True)
class RewardConfig:
    """Reward weights (per request).

    Attributes:
        met: reward for a request that meets its SLO (>= 0).
        missed: penalty for one that misses it or is rejected (>= 0; the reward is ``-missed``).
        early_miss: charge ``missed`` as soon as a request waited past its TTFT SLO without a
            first token (else at its record).
        shaping: weight of the potential-based shaping term (>= 0; 0: none; module docstring).
        shaping_gamma: its discount (0 < gamma <= 1); set it to the learner's ``gamma``.
        graded: also give each finished request that misses its SLO ``met * grade`` (grade in
            [0, 1): the worst of bound / observed latency over its TTFT, TPOT and E2E bounds;
            module docstring) as the component ``slo_graded``. Changes the objective; off by
            default.
    """

    met: float = 1.0
    missed: float = 1.0
    early_miss: bool = True
    shaping: float = 0.0
    shaping_gamma: float = 0.99
    graded: bool = False

    def __post_init__(self) -> None:
        for name in ("met", "missed", "shaping"):
            v = getattr(self, name)
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                    f"RewardConfig.{name}", v, "a finite number >= 0")
        require(isinstance(self.early_miss, bool), "RewardConfig.early_miss", self.early_miss, "True or False")
        require(isinstance(self.graded, bool), "RewardConfig.graded", self.graded, "True or False")
        g = self.shaping_gamma
        require(isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g <= 1,
                "RewardConfig.shaping_gamma", g, "a number in (0, 1] (the learner's discount)")

    @classmethod
    def from_mapping(cls, values) -> "RewardConfig":
        """A config from a mapping (e.g. ``--env-kwargs '{"reward": {"shaping": 0.5}}'``).

        Raises:
            ConfigError: a key that is not a field (the message lists them), or a bad value.
        """
        import dataclasses

        from kvsched.envs.sim.errors import ConfigError, bounded_repr

        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in values if k not in names)
        if unknown:
            raise ConfigError(f"reward: {bounded_repr(unknown)} not allowed: expected keys of {names}")
        return cls(**dict(values))


def reward_config(value) -> RewardConfig:
    """An environment's ``reward`` argument as a :class:`RewardConfig`: one as is, or a mapping of
    its fields (e.g. from ``--env-kwargs`` JSON).

    Raises:
        ConfigError: anything else, an unknown field or a bad value.
    """
    from collections.abc import Mapping

    if isinstance(value, Mapping):
        return RewardConfig.from_mapping(value)
    require(isinstance(value, RewardConfig), "reward", value, "a RewardConfig or a mapping of its fields")
    return value


def _bounds(slo) -> tuple:
    """``(ttft_s, tpot_s, e2e_s)`` of an :class:`SLO`, ``math.inf`` for an unset E2E bound."""
    return slo.ttft_s, slo.tpot_s, math.inf if slo.e2e_s is None else slo.e2e_s


def _grade(ttft: float, tpot: float, e2e: float, bounds: tuple) -> float:
    """``min(1, ttft_s / ttft, tpot_s / tpot, e2e_s / e2e)`` of one finished request: observed
    TTFT, TPOT (0.0 for a single-token request: not judged) and E2E in s against its ``(ttft_s,
    tpot_s, e2e_s or inf)`` bounds. A ratio counts only when its observed value exceeds its
    bound, so an observed 0 (or an unset E2E bound, ``inf``) counts as 1."""
    ttft_s, tpot_s, e2e_s = bounds
    grade = ttft_s / ttft if ttft > ttft_s else 1.0
    if tpot > tpot_s:
        grade = min(grade, tpot_s / tpot)
    if e2e > e2e_s:
        grade = min(grade, e2e_s / e2e)
    return grade


class SLOReward:
    """Turns new request records into reward (reads the recorder's rows incrementally).

    Args:
        config: the weights.
        metrics: the SLO classes and thresholds.
    """

    def __init__(self, config: RewardConfig, metrics: MetricsConfig) -> None:
        self.config = config
        self.metrics = metrics
        self._seen = 0
        self.met = 0
        self.missed = 0
        #: sum of the grades of the missed finished requests so far (0.0 unless ``config.graded``)
        self.grades = 0.0
        self._graded = config.graded
        self.charged: set[int] = set()  # request ids already charged as certain misses
        # per-step lookups: a plain dict of the SLO classes, the (short, long) SLOs, and the
        # smallest TTFT SLO (a request that waited no longer than it cannot be a certain miss)
        self._slos = dict(metrics.slos)
        self._length_slos = (metrics.slos[LENGTH_CLASSES[0]], metrics.slos[LENGTH_CLASSES[1]])
        self._min_ttft_s = min(slo.ttft_s for slo in self._slos.values())
        # the smallest TPOT and E2E bounds: a running request within all three of the smallest
        # bounds cannot be a certain miss (the per-step check skips its SLO lookup)
        self._min_tpot_s = min(slo.tpot_s for slo in self._slos.values())
        self._min_e2e_s = min((slo.e2e_s for slo in self._slos.values() if slo.e2e_s is not None), default=math.inf)
        # (ttft_s, tpot_s, e2e_s or inf) per SLO class and per length class, for is_met
        self._bounds = {name: _bounds(slo) for name, slo in self._slos.items()}
        # the same per record tag as it appears in the records (a str, or None when untagged): the
        # bounds of the SLO class named str(tag), or False for "judge by length class" (always
        # for None); filled as tags are first seen
        self._bounds_by_tag: dict = {}
        self._length_bounds = tuple(_bounds(slo) for slo in self._length_slos)
        self._long_prompt_tokens = metrics.long_prompt_tokens

    def judged_slo(self, slo_class: str, prompt_tokens: int):
        """The :class:`SLO` a request is judged by (its SLO class if configured, else length class)."""
        slo = self._slos.get(slo_class)
        if slo is None:
            slo = self._length_slos[1 if prompt_tokens >= self.metrics.long_prompt_tokens else 0]
        return slo

    def is_met(self, row: tuple) -> bool:
        """Whether one record row (``RECORD_COLUMNS`` order) meets its SLO (as ``summarize``)."""
        return self._judge((row,))[0] == 1

    def grade(self, row: tuple) -> float:
        """The grade of one record row (``RECORD_COLUMNS`` order): 1.0 when it meets its SLO, 0.0
        when it did not finish (rejected), else the smallest ``bound / observed`` over its TTFT,
        TPOT (more than one token) and E2E (when set) bounds, in [0, 1) (module docstring)."""
        met, _, _, grades = self._judge((row,), True)
        return 1.0 if met else grades

    def _judge(self, rows, graded: bool = False) -> tuple[int, int, int, float]:
        """``(met, missed, missed and not yet charged, sum of the grades of the missed finished
        rows)`` over record rows (the SLO a row is judged by as :meth:`judged_slo`; met as
        ``summarize``: finished, TTFT, TPOT when it generated more than one token, E2E when set).
        The grade sum is 0.0 unless ``graded`` (no grade is computed then)."""
        met = missed = uncharged = 0
        grades = 0.0
        by_tag, length_bounds, long_tokens, charged = self._bounds_by_tag, self._length_bounds, \
            self._long_prompt_tokens, self.charged
        for status, slo_class, prompt, arrival_s, first_s, finish_s, g, rid in map(_JUDGED_FIELDS, rows):
            if status == "finished":
                bounds = by_tag.get(slo_class)
                if bounds is None:  # a tag not seen yet: its configured class's bounds, or False
                    # (untagged, None: its length class, as judged_slo and summarize -- not a
                    # class named "None")
                    bounds = by_tag[slo_class] = False if slo_class is None else \
                        self._bounds.get(str(slo_class), False)
                if bounds is False:  # judged by its length class
                    bounds = length_bounds[1 if prompt >= long_tokens else 0]
                ttft_s, tpot_s, e2e_s = bounds
                if first_s - arrival_s <= ttft_s and (g <= 1 or (finish_s - first_s) / (g - 1) <= tpot_s) \
                        and finish_s - arrival_s <= e2e_s:
                    met += 1
                    continue
                if graded:
                    grades += _grade(first_s - arrival_s, (finish_s - first_s) / (g - 1) if g > 1 else 0.0,
                                     finish_s - arrival_s, bounds)
            missed += 1
            if rid not in charged:
                uncharged += 1
        return met, missed, uncharged, grades

    def collect(self, rows: list) -> dict[str, float]:
        """Reward components of the records written since the last call: ``slo_met``,
        ``slo_missed`` and, only with ``config.graded``, ``slo_graded``."""
        met = charged = 0
        grades = 0.0
        if len(rows) > self._seen:
            met, missed, charged, grades = self._judge(rows[self._seen:], self._graded)
            self._seen = len(rows)
            self.met += met
            self.missed += missed
            self.grades += grades
        comps = {"slo_met": self.config.met * met, "slo_missed": -self.config.missed * charged}
        if self._graded:
            comps["slo_graded"] = self.config.met * grades
        return comps

    def certain_misses(self, states, now_s: float) -> float:
        """``-missed`` for each unfinished request of ``states`` not yet charged whose miss is
        certain at ``now_s``; marks them charged. Certain means (the request finishes after
        ``now_s``): no first token yet and waited past its TTFT SLO; a first token that came after
        the TTFT SLO; ``now_s - first_token_s > tpot_s * (output_tokens - 1)`` (its TPOT,
        ``(finish - first) / (output_tokens - 1)``, must exceed the SLO); or waited past its
        E2E SLO. The output length is the environment's to judge by, never an observation."""
        n = 0
        charged, min_ttft_s, min_tpot_s, min_e2e_s = self.charged, self._min_ttft_s, self._min_tpot_s, self._min_e2e_s
        for st in states:
            waited = now_s - st.arrival_s
            if st.generated == 0:
                if waited <= min_ttft_s or st.rid in charged:
                    continue
                slo = self.judged_slo(st.req.slo_class, st.prompt_tokens)
                certain = waited > slo.ttft_s or (slo.e2e_s is not None and waited > slo.e2e_s)
            else:
                if st.rid in charged or (st.first_token_s - st.arrival_s <= min_ttft_s and waited <= min_e2e_s
                                         and now_s - st.first_token_s <= min_tpot_s * (st.output_tokens - 1)):
                    continue
                slo = self.judged_slo(st.req.slo_class, st.prompt_tokens)
                certain = (st.first_token_s - st.arrival_s > slo.ttft_s
                           or (st.output_tokens > 1 and now_s - st.first_token_s > slo.tpot_s * (st.output_tokens - 1))
                           or (slo.e2e_s is not None and waited > slo.e2e_s))
            if certain:
                charged.add(st.rid)
                n += 1
        return -self.config.missed * n

    truncation_penalty = certain_misses

    def potential(self, states, now_s: float) -> float:
        """The shaping potential ``Phi`` at ``now_s`` (module docstring): ``-shaping`` times the
        sum over ``states`` without a first token of ``min(1, waited / TTFT SLO)``."""
        total = 0.0
        for st in states:
            if st.generated == 0:
                total += min(1.0, max(0.0, now_s - st.arrival_s) /
                             self.judged_slo(st.req.slo_class, st.prompt_tokens).ttft_s)
        return -self.config.shaping * total


def ttft_slo_by_length_class(reward: SLOReward) -> tuple[float, float]:
    """TTFT SLO (s) of the short and of the long length class (a FeatureTable has no SLO tag, so
    a candidate is judged by its length class)."""
    m = reward.metrics
    return float(m.slos["short"].ttft_s), float(m.slos["long"].ttft_s)


def ttft_slo_column(reward: SLOReward, table) -> np.ndarray:
    """TTFT SLO (s) of each row of a FeatureTable (by length class; the table has no SLO tag)."""
    short, long = ttft_slo_by_length_class(reward)
    return np.where(table.prompt_tokens >= reward.metrics.long_prompt_tokens, long, short).astype(np.float64)
