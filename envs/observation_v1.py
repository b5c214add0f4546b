"""Observation version 1 of ``kvsched/Scheduling-v1``: version 0 plus what issue #20 found missing
(TPOT / step-time pressure, arrival rate and bursts, cached-prefix residency per candidate, and an
optional output-length signal).

Layout: ``K`` candidate rows of ``len(CANDIDATE_FEATURES_V1)`` = 11 features, then
``len(INSTANCE_FEATURES_V1)`` = 18 instance features: each row is the version-0 row
(:mod:`kvsched.envs.observation`, columns 0-8) plus two columns; the instance block is the
version-0 block (0-9) plus eight features. Everything a real scheduler sees at the decision:
arrivals so far, the running batch, the cache, and an output length only when the scenario
declares an oracle or the environment a predictor.

Added per-candidate features:

===  ==================  ===================================================================
col  name                value
===  ==================  ===================================================================
9    resident_prompt     share of its prompt whose KV is in HBM now: a waiting request's
                         leading cached prefix segments (prefix-cache hit if admitted now), a
                         running partial prefill's computed tokens; in [0, 1]
10   output_signal       output tokens / max_model_len from the output-length signal (exact:
                         ``"oracle"``; ``{"log_sd": s}``: times ``exp(N(0, s^2))``, drawn once
                         per request, seeded by the episode's workload seed and window, so every
                         agent sees the same predictions), clipped to 1; 0 without a signal
===  ==================  ===================================================================

Added instance features (after the version-0 ten):

===  ==================  ===================================================================
10   step_time           t / (t + TPOT SLO), t = the cost model's time (s) of a pure-decode step
                         of the running decodes (``CostModel.decode_step_time_s``)
11   decode_batch        running requests past their prefill / max_num_seqs
12   decode_context      their context tokens / HBM capacity (tokens)
13   tpot_at_risk        share of running decodes with >= 2 tokens whose mean inter-token time so
                         far exceeds their TPOT SLO (0 without such decodes)
14   tpot_slack_min      tanh(min over those decodes of (TPOT SLO - mean ITL) / TPOT SLO); 1
                         without any
15   arrival_rate        r / (r + 10 req/s), r = arrivals per second, exponentially weighted
                         over the last ``ARRIVAL_TAU_S`` = 10 s (arrivals up to now only)
16   burst               tanh(ln((r_1s + 0.1) / (r_10s + 0.1))): > 0 while arrivals come faster
                         than the 10-s average (r_1s: the same rate over 1 s)
17   has_output_signal   1 when ``output_signal`` is set
===  ==================  ===================================================================

TPOT SLOs are judged by length class (short / long), as the TTFT SLO of version 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvsched.envs.observation import CANDIDATE_FEATURES, INSTANCE_FEATURES
from kvsched.envs.sim.errors import require
from kvsched.envs.sim.request import RUNNING

CANDIDATE_FEATURES_V1 = CANDIDATE_FEATURES + ("resident_prompt", "output_signal")
INSTANCE_FEATURES_V1 = INSTANCE_FEATURES + ("step_time", "decode_batch", "decode_context", "tpot_at_risk",
                                            "tpot_slack_min", "arrival_rate", "burst", "has_output_signal")
#: the long and short time constants of the arrival-rate averages (s)
ARRIVAL_TAU_S = 10.0
BURST_TAU_S = 1.0
#: the squashing scale of the arrival rate (requests per second)
RATE_SCALE_PER_S = 10.0
#: the largest log error factor of a predictor (exp(700) ~ 1e304: beyond it the feature is 1 anyway)
MAX_LOG_FACTOR = 700.0


def observation_size_v1(k: int) -> int:
    """Length of the flat version-1 observation for ``k`` candidate rows."""
    return k * len(CANDIDATE_FEATURES_V1) + len(INSTANCE_FEATURES_V1)


def check_output_signal(value: Any) -> Any:
    """Validate ``output_signal``: ``None``, ``"oracle"`` or ``{"log_sd": s}`` with finite s >= 0.

    Raises:
        ConfigError: naming the value and what is allowed.
    """
    ok = value is None or value == "oracle" or (
        isinstance(value, dict) and set(value) == {"log_sd"} and isinstance(value["log_sd"], (int, float))
        and not isinstance(value["log_sd"], bool) and math.isfinite(value["log_sd"]) and value["log_sd"] >= 0)
    require(ok, "output_signal", value, 'None, "oracle" or {"log_sd": s} with a finite s >= 0 (a predictor whose '
            "log-error is normal with that standard deviation)")
    return value


class ArrivalRates:
    """Exponentially weighted arrival rates (requests per second) at the decision times, from the
    arrival times up to each decision (never later ones).

    Args:
        arrival_s: the episode's arrival times (s), ascending.
        taus_s: the time constants (s).
    """

    def __init__(self, arrival_s: np.ndarray, taus_s: tuple[float, ...]) -> None:
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.taus_s = taus_s
        self.values = [0.0] * len(taus_s)
        self.at_s = float(self.arrival_s[0]) if len(self.arrival_s) else 0.0
        self.next = 0

    def at(self, now_s: float) -> list[float]:
        """The rates at ``now_s`` (>= the previous call's time)."""
        if now_s < self.at_s:  # decisions never go back in time; stay put rather than extrapolate
            now_s = self.at_s
        stop = int(np.searchsorted(self.arrival_s, now_s, side="right"))
        new = self.arrival_s[self.next:stop]
        dt = now_s - self.at_s
        for i, tau in enumerate(self.taus_s):
            self.values[i] = self.values[i] * math.exp(-dt / tau) + float(np.exp(-(now_s - new) / tau).sum()) / tau
        self.next, self.at_s = stop, now_s
        return list(self.values)


def output_signal_tokens(states: list, rows: list[int], signal: Any, seed: int,
                         factors: dict[int, float] | None = None) -> list[float]:
    """The output-length signal (tokens) of ``states[r]`` for ``r`` in ``rows`` (0 without one).

    A predictor's error factor ``exp(log_sd * z)`` is drawn once per request and episode
    (``z`` from a generator seeded by ``(seed, request id)``) and kept in ``factors`` when given."""
    if signal is None:
        return [0.0] * len(rows)
    if signal == "oracle":
        return [float(states[r].output_tokens) for r in rows]
    sd = float(signal["log_sd"])
    factors = {} if factors is None else factors
    out = []
    for r in rows:
        st = states[r]
        f = factors.get(st.rid)
        if f is None:
            z = float(np.random.default_rng((seed, int(st.rid))).standard_normal())
            # a large log_sd (allowed: any finite s >= 0) overflowed math.exp; the feature clips to 1 anyway
            f = factors[st.rid] = math.exp(min(sd * z, MAX_LOG_FACTOR))
        out.append(float(st.output_tokens) * f)
    return out


def extend_observation(obs0: np.ndarray, k: int, inst, states: list, order: np.ndarray | None, running: np.ndarray,
                       tpot_slo_s: tuple[float, float], long_prompt_tokens: int, rates: ArrivalRates, now_s: float,
                       output_signal: Any, signal_seed: int, signal_factors: dict[int, float] | None = None
                       ) -> np.ndarray:
    """The version-1 observation ``(observation_size_v1(k),)`` float32 from the version-0 one.

    Args:
        obs0: the version-0 observation of the same decision.
        k, inst, states, order: as :func:`kvsched.envs.observation.build_observation`.
        running: which rows of the candidate table are running partial prefills.
        tpot_slo_s: TPOT SLO (s) of the short and the long length class.
        long_prompt_tokens: the long-class threshold (tokens).
        rates: the episode's :class:`ArrivalRates`.
        now_s: the decision's time (s).
        output_signal: see :func:`check_output_signal`.
        signal_seed: the episode's seed of the predictor's errors.
        signal_factors: the episode's cache of the predictor's error factors (request id -> factor).
    """
    n0, i0 = len(CANDIDATE_FEATURES), len(INSTANCE_FEATURES)
    rows0 = obs0[:k * n0].reshape(k, n0)
    extra_rows = np.zeros((k, 2), dtype=np.float32)
    shown = list(range(min(len(states), k))) if order is None else order[:k].tolist()
    if shown:
        max_len = float(inst.spec.model_len_limit)
        hbm = inst.kv.hbm
        signal = output_signal_tokens(states, shown, output_signal, signal_seed, signal_factors)
        for j, r in enumerate(shown):
            st = states[r]
            if running[r]:
                resident = st.computed
            elif st.n_cacheable_segments:
                resident = hbm.cached_prefix_segments(st.hashes, st.n_cacheable_segments) * st.seg_tokens
            else:
                resident = 0
            extra_rows[j, 0] = min(1.0, resident / st.prompt_tokens)
            extra_rows[j, 1] = min(1.0, signal[j] / max_len)
    short_tpot, long_tpot = tpot_slo_s
    n_dec = ctx = at_risk = judged = 0
    slack_min = math.inf
    for st in inst.running:
        if st.status != RUNNING or st.generated < 1 or st.computed < st.prompt_tokens + st.generated - 1:
            continue
        n_dec += 1
        ctx += st.prompt_tokens + st.generated
        if st.generated >= 2:
            slo = long_tpot if st.prompt_tokens >= long_prompt_tokens else short_tpot
            itl = (st.last_token_s - st.first_token_s) / (st.generated - 1)
            judged += 1
            at_risk += itl > slo
            slack_min = min(slack_min, (slo - itl) / slo)
    step_s = float(inst.cost.decode_step_time_s(n_dec, ctx)) if n_dec else 0.0
    tpot_ref = min(short_tpot, long_tpot)
    slow, fast = rates.at(now_s)
    cap_tokens = float(max(inst.kv.hbm.capacity_blocks, 1) * inst.bs)
    extra_inst = np.array([
        step_s / (step_s + tpot_ref),
        n_dec / inst.spec.max_seqs,
        min(1.0, ctx / cap_tokens),
        at_risk / judged if judged else 0.0,
        math.tanh(slack_min) if judged else 1.0,
        slow / (slow + RATE_SCALE_PER_S),
        math.tanh(math.log((fast + 0.1) / (slow + 0.1))),
        0.0 if output_signal is None else 1.0,
    ], dtype=np.float32)
    return np.concatenate((np.concatenate((rows0, extra_rows), axis=1).reshape(-1), obs0[k * n0:k * n0 + i0],
                           extra_inst))
