"""The evaluation protocol's statistics: paired differences, bootstrap intervals, normalised scores.

Every agent serves the same episodes of a stratum, so an agent is compared with the tuned best
heuristic episode by episode: ``d_i = agent_i - tuned_i``. Reported per stratum:

- the mean difference and its 95 % bootstrap confidence interval (``scipy.stats.bootstrap``,
  percentile method, 10,000 resamples, seeded: the same numbers in every run);
- the normalised score ``(agent - tuned) / (bound - tuned)`` on the stratum means (0: the tuned
  heuristic, 1: the hindsight bound; it can exceed 1, the bound being a found schedule, not an
  optimum), with the interval of the mean difference scaled alike;
- how many episodes the agent is worse on (``d_i < 0``).

Episodes where either score is undefined (an empty window) are left out of the pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Paired:
    """One agent against the tuned heuristic on one stratum.

    Attributes:
        episodes: episodes with both scores defined.
        agent_mean, tuned_mean, bound_mean: stratum means (SLO attainment).
        diff_mean: mean of ``agent - tuned``; ``diff_lo``, ``diff_hi``: its 95 % bootstrap CI.
        normalised: ``(agent_mean - tuned_mean) / (bound_mean - tuned_mean)`` (None when the bound
            equals the tuned heuristic's mean); ``norm_lo``, ``norm_hi``: the CI scaled alike.
        worse: episodes where the agent is below the tuned heuristic.
    """

    episodes: int
    agent_mean: float
    tuned_mean: float
    bound_mean: float
    diff_mean: float
    diff_lo: float
    diff_hi: float
    normalised: float | None
    norm_lo: float | None
    norm_hi: float | None
    worse: int


def bootstrap_ci(x: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of ``x`` (a point when ``x`` is constant)."""
    from scipy import stats

    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1 or np.all(x == x[0]):
        return float(x[0]), float(x[0])
    res = stats.bootstrap((x,), np.mean, n_resamples=RESAMPLES, confidence_level=CONFIDENCE, method="percentile",
                          random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired(agent: Sequence[float | None], tuned: Sequence[float | None], bound: Sequence[float | None],
           seed: int = 0) -> Paired:
    """Compare per-episode scores (same episodes, same order; None = undefined).

    Raises:
        ValueError: sequences of different lengths.
    """
    if not (len(agent) == len(tuned) == len(bound)):
        raise ValueError(f"paired scores need equal lengths, got {len(agent)}, {len(tuned)}, {len(bound)}")
    keep = [i for i in range(len(agent)) if agent[i] is not None and tuned[i] is not None and bound[i] is not None
            and not any(math.isnan(float(v[i])) for v in (agent, tuned, bound))]
    a = np.array([agent[i] for i in keep], dtype=np.float64)
    t = np.array([tuned[i] for i in keep], dtype=np.float64)
    b = np.array([bound[i] for i in keep], dtype=np.float64)
    if not keep:
        nan = math.nan
        return Paired(0, nan, nan, nan, nan, nan, nan, None, None, None, 0)
    d = a - t
    lo, hi = bootstrap_ci(d, seed)
    gap = float(b.mean() - t.mean())
    norm = (float(d.mean()) / gap, lo / gap, hi / gap) if gap > 1e-12 else (None, None, None)
    return Paired(len(keep), float(a.mean()), float(t.mean()), float(b.mean()), float(d.mean()), lo, hi,
                  norm[0], norm[1], norm[2], int(np.count_nonzero(d < 0)))


def headroom(tuned: Sequence[float | None], bound: Sequence[float | None], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``bound - tuned`` over the episodes where both are defined, and its 95 % CI."""
    keep = [i for i in range(len(tuned)) if tuned[i] is not None and bound[i] is not None]
    d = np.array([bound[i] - tuned[i] for i in keep], dtype=np.float64)  # type: ignore[operator]
    if not len(d):
        return math.nan, math.nan, math.nan
    lo, hi = bootstrap_ci(d, seed)
    return float(d.mean()), lo, hi
