"""LogHistogram: streamed positive durations in fixed log-spaced bins, O(bins) memory.

The simulator streams every inter-token gap (ITL sample, seconds) of a run into one
:class:`LogHistogram` per length class (``envs/sim/recorder.py``), so memory stays O(bins)
however many tokens are decoded; :func:`kvsched.envs.sim.metrics.summarize` reads count, mean,
max and percentiles back from it. The bin layout (462 bins per decade from 1 µs to 10^4 s,
relative bin width <= 0.5 %) is kvsched's own choice: fine enough that a percentile is within
0.25 % of the exact order statistic, coarse enough that the counts fit in 37 kB.

All durations are in seconds; weights and counts are non-negative integers.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any, Mapping

import numpy as np

from .errors import ConfigError, require, bounded_repr

__all__ = ["LogHistogram"]

#: Scalar types :meth:`LogHistogram.add` takes on its no-allocation fast path.
_SCALAR_TYPES = (float, int, np.floating, np.integer)
_INT_TYPES = (int, np.integer)


def _finite_or_none(x: float) -> float | None:
    """``float(x)``, or ``None`` when ``x`` is NaN or infinite (JSON has neither)."""
    return float(x) if math.isfinite(x) else None


def _value_range(v: np.ndarray) -> tuple[float, float]:
    """``(min, max)`` of a non-empty float64 array of durations (s).

    Raises:
        ConfigError: a value is negative, infinite or NaN (the message names the first one).
    """
    vmin, vmax = float(v.min()), float(v.max())  # NaN propagates into both
    if not (vmin >= 0.0 and vmax < math.inf):
        bad = v[~(np.isfinite(v) & (v >= 0))][0]
        raise ConfigError(
            f"LogHistogram.add: value={bounded_repr(float(bad))} is not allowed: expected finite"
            " durations >= 0 s"
        )
    return vmin, vmax


def _weight_array(weights: Any, values_shape: tuple[int, ...]) -> np.ndarray:
    """Per-value weights as a flat int64 array of ``prod(values_shape)`` entries.

    Args:
        weights: array-like of integers (or of integral floats) broadcastable to
            ``values_shape``.
        values_shape: shape of the values the weights go with.

    Raises:
        ConfigError: a non-integer dtype or value, a negative weight, or a shape that does not
            broadcast to ``values_shape``.
    """
    w_in = np.asarray(weights)
    if (w_in.dtype.kind == "f" and np.all(np.isfinite(w_in))
            and np.all(w_in == np.round(w_in))):
        w_in = w_in.astype(np.int64)
    if w_in.dtype.kind not in "iub":
        raise ConfigError(
            f"LogHistogram.add: weights of dtype {w_in.dtype} are not allowed: expected"
            " non-negative integers"
        )
    try:
        w = np.broadcast_to(w_in.astype(np.int64), values_shape).ravel()
    except ValueError:
        raise ConfigError(
            f"LogHistogram.add: weights of shape {w_in.shape} are not allowed: expected"
            f" a shape that broadcasts to values of shape {values_shape}"
        ) from None
    if w.size and w.min() < 0:
        raise ConfigError(
            f"LogHistogram.add: weight={int(w[w < 0][0])} is not allowed: expected >= 0"
        )
    return w


class LogHistogram:
    """Histogram of positive durations (seconds) over fixed log-spaced bins, O(bins) memory.

    Bins: ``BINS_PER_DECADE = 462`` bins per decade between ``LO_S = 1e-6`` s and
    ``HI_S = 1e4`` s (4620 bins), so adjacent edges differ by a factor
    ``10**(1/462) = 1.004996`` (relative bin width <= 0.5 %). Bin ``i`` covers
    ``(edge[i], edge[i+1]]``; values ``<= 1e-6`` (including 0) go to bin 0 and values
    ``> 1e4`` to one extra overflow bin. Count, sum, min and max are kept exactly (the sum is a
    float accumulated batch by batch).

    :meth:`percentile` returns the geometric midpoint of the bin holding the requested rank,
    clamped to ``[min, max]``; its relative error against the exact order statistic is at
    most ``sqrt(1.004996) - 1 = 0.25 %`` (plus the rank convention, see :meth:`percentile`).
    The overflow bin answers with the exact max. Everything is deterministic.

    Example:
        >>> h = LogHistogram(); h.add(np.array([0.01, 0.02, 0.03])); h.count
        3
    """

    LO_S: float = 1e-6
    HI_S: float = 1e4
    BINS_PER_DECADE: int = 462
    N_BINS: int = 462 * 10  # regular bins, (1e-6, 1e4]; index N_BINS is the overflow bin
    EDGES: np.ndarray = LO_S * 10.0 ** (np.arange(N_BINS + 1) / BINS_PER_DECADE)
    EDGES.setflags(write=False)
    _MID: np.ndarray = np.sqrt(EDGES[:-1] * EDGES[1:])
    _EDGES_LIST: list = EDGES.tolist()
    _EDGES_EXT: np.ndarray = np.append(EDGES, np.inf)  # upper edge of the overflow bin
    _SMALL_BATCH = 256  # below this, np.add.at beats an O(bins) bincount

    __slots__ = ("_counts", "_count", "_sum", "_min", "_max")

    def __init__(self) -> None:
        self._counts = np.zeros(self.N_BINS + 1, dtype=np.int64)
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    # -- filling -------------------------------------------------------------------------

    @classmethod
    def bin_index(cls, values: np.ndarray) -> np.ndarray:
        """Bin index of each value (int64, flat): 0 for ``v <= 1e-6``, ``N_BINS`` for overflow.

        Identical to ``max(searchsorted(EDGES, v, side="left") - 1, 0)``; large batches use a
        log10 estimate corrected by one comparison each way against ``EDGES`` (a binary search
        over unsorted values is cache-unfriendly and ~4x slower).
        """
        v = np.asarray(values, dtype=np.float64).ravel()
        if v.size < cls._SMALL_BATCH:
            idx = np.searchsorted(cls.EDGES, v, side="left")
            idx -= 1
            np.maximum(idx, 0, out=idx)
            return idx
        with np.errstate(divide="ignore"):
            est = (np.log10(v) + 6.0) * cls.BINS_PER_DECADE  # log10(v / LO_S) * bins/decade
        np.clip(est, 0, cls.N_BINS, out=est)
        idx = est.astype(np.int64)
        # want EDGES_EXT[i] < v <= EDGES_EXT[i + 1] (bin 0 also takes v <= LO_S)
        idx -= (v <= cls._EDGES_EXT[idx]) & (idx > 0)
        idx += v > cls._EDGES_EXT[idx + 1]
        return idx

    def add(self, values: np.ndarray | float, weights: np.ndarray | int = 1) -> None:
        """Add durations ``values`` (s), each counted ``weights`` times.

        Args:
            values: scalar or array of durations in seconds, finite and >= 0 (any shape; it is
                flattened).
            weights: non-negative integer count per value: a scalar, or an array broadcastable
                to ``values``. A zero weight adds nothing (and does not touch min/max).

        Raises:
            ConfigError: a value is negative or not finite, or a weight is negative or not an
                integer, or the shapes do not broadcast.
        """
        # Scalar fast path (one token gap at a time): no array allocation, no helper call.
        if isinstance(values, _SCALAR_TYPES) and isinstance(weights, _INT_TYPES):
            x, w = float(values), int(weights)
            if not 0.0 <= x < math.inf:
                raise ConfigError(f"LogHistogram.add: value={bounded_repr(x)} is not allowed: expected finite"
                                  " durations >= 0 s")
            if w < 0:
                raise ConfigError(f"LogHistogram.add: weight={w} is not allowed: expected >= 0")
            if w:
                self._counts[max(bisect_left(self._EDGES_LIST, x) - 1, 0)] += w
                self._count += w
                self._sum += x * w
                if x < self._min:
                    self._min = x
                if x > self._max:
                    self._max = x
            return
        v = np.asarray(values, dtype=np.float64)
        if v.ndim != 1:
            v = v.ravel()
        if v.size == 0:
            return
        if isinstance(weights, _INT_TYPES):
            self._add_uniform(v, int(weights))
        else:
            self._add_weighted(v, _weight_array(weights, np.shape(values)))

    def _add_uniform(self, v: np.ndarray, w: int) -> None:
        """Add every value of ``v`` (flat non-empty float64, s) ``w`` times.

        Raises:
            ConfigError: ``w < 0``, or a value is negative or not finite (values are not
                checked when ``w == 0``).
        """
        if w < 0:
            raise ConfigError(f"LogHistogram.add: weight={w} is not allowed: expected >= 0")
        if w == 0:
            return
        vmin, vmax = _value_range(v)
        idx = self.bin_index(v)
        if v.size < self._SMALL_BATCH:
            np.add.at(self._counts, idx, w)
        else:
            self._counts += np.bincount(idx, minlength=self.N_BINS + 1) * w
        self._count += w * int(v.size)
        self._sum += float(v.sum()) * w
        self._widen(vmin, vmax)

    def _add_weighted(self, v: np.ndarray, w: np.ndarray) -> None:
        """Add value ``v[i]`` (flat non-empty float64, s) ``w[i]`` times (int64 >= 0, same size).

        Raises:
            ConfigError: a value is negative or not finite (zero-weight values included).
        """
        vmin, vmax = _value_range(v)
        keep = w > 0
        if not keep.all():
            v, w = v[keep], w[keep]
            if v.size == 0:
                return
            vmin, vmax = float(v.min()), float(v.max())
        idx = self.bin_index(v)
        if v.size < self._SMALL_BATCH:
            np.add.at(self._counts, idx, w)
        else:
            self._counts += np.bincount(idx, weights=w, minlength=self.N_BINS + 1).astype(
                np.int64)
        self._count += int(w.sum())
        # not np.dot: a BLAS dot over a ~64k-sample flush wakes OpenBLAS's threads, which then
        # spin on the other cores (the simulator is single-threaded), and its result depends
        # on their number
        self._sum += float((v * w).sum())
        self._widen(vmin, vmax)

    def _widen(self, vmin: float, vmax: float) -> None:
        """Extend the exact min/max (s) by a batch's ``vmin`` / ``vmax``."""
        if vmin < self._min:
            self._min = vmin
        if vmax > self._max:
            self._max = vmax

    def add_repeated(self, value: float, count: int) -> None:
        """Add one duration ``value`` (s) ``count`` times (e.g. a stretch of equal decode steps).

        Raises:
            ConfigError: as :meth:`add`.
        """
        self.add(value, count)

    def merge(self, other: "LogHistogram") -> "LogHistogram":
        """Add every sample of ``other`` into this histogram (in place) and return ``self``.

        Raises:
            ConfigError: ``other`` is not a :class:`LogHistogram`.
        """
        if not isinstance(other, LogHistogram):
            raise ConfigError(
                f"LogHistogram.merge: other={type(other).__name__} is not allowed: expected"
                " LogHistogram"
            )
        if other._count == 0:
            return self
        self._counts += other._counts
        self._count += other._count
        self._sum += other._sum
        self._min = min(self._min, other._min)
        self._max = max(self._max, other._max)
        return self

    def copy(self) -> "LogHistogram":
        """An independent copy."""
        return LogHistogram().merge(self)

    # -- reading -------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Number of samples added (sum of weights)."""
        return self._count

    @property
    def sum(self) -> float:
        """Sum of all samples in seconds (0.0 when empty)."""
        return self._sum

    @property
    def mean(self) -> float:
        """Mean sample in seconds; NaN when empty."""
        return self._sum / self._count if self._count else math.nan

    @property
    def min(self) -> float:
        """Smallest sample in seconds; NaN when empty."""
        return self._min if self._count else math.nan

    @property
    def max(self) -> float:
        """Largest sample in seconds; NaN when empty."""
        return self._max if self._count else math.nan

    @property
    def counts(self) -> np.ndarray:
        """Read-only view of the per-bin counts, shape ``(N_BINS + 1,)`` (last = overflow)."""
        view = self._counts.view()
        view.setflags(write=False)
        return view

    def percentile(self, q: float) -> float:
        """Approximate ``q``-th percentile in seconds (q in [0, 100]); NaN when empty.

        The answer is the geometric midpoint of the bin that holds the sample of rank
        ``max(1, ceil(q/100 * count))`` (the "inverted CDF" convention), clamped to
        ``[min, max]``; ``q = 0`` gives the exact min, ``q = 100`` and the overflow bin give the
        exact max. Relative error vs. the exact order statistic <= 0.25 %.

        Raises:
            ConfigError: ``q`` outside [0, 100] or not finite.
        """
        q = float(q)
        if not (math.isfinite(q) and 0.0 <= q <= 100.0):
            raise ConfigError(f"percentile q={bounded_repr(q)} is not allowed: expected 0 <= q <= 100")
        if self._count == 0:
            return math.nan
        if q == 0.0:
            return self._min
        if q == 100.0:
            return self._max
        rank = max(1, math.ceil(q / 100.0 * self._count))
        b = int(np.searchsorted(np.cumsum(self._counts), rank, side="left"))
        if b >= self.N_BINS:
            return self._max
        return min(max(float(self._MID[b]), self._min), self._max)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state: bin layout, exact count/sum/min/max and the non-empty bins.

        ``bins`` is a list of ``[bin_index, count]`` pairs in ascending index order (index
        ``N_BINS`` is the overflow bin); min/max/mean are ``None`` when empty.
        """
        nz = np.flatnonzero(self._counts)
        return {
            "lo_s": self.LO_S,
            "hi_s": self.HI_S,
            "bins_per_decade": self.BINS_PER_DECADE,
            "count": int(self._count),
            "sum_s": float(self._sum),
            "min_s": _finite_or_none(self.min),
            "max_s": _finite_or_none(self.max),
            "mean_s": _finite_or_none(self.mean),
            "bins": [[int(i), int(self._counts[i])] for i in nz],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LogHistogram":
        """Rebuild a histogram from :meth:`to_dict` output.

        Raises:
            ConfigError: the bin layout differs from this class's, or a bin entry is invalid.
        """
        layout = (d.get("lo_s"), d.get("hi_s"), d.get("bins_per_decade"))
        require(layout == (cls.LO_S, cls.HI_S, cls.BINS_PER_DECADE), "LogHistogram layout",
                layout, f"{(cls.LO_S, cls.HI_S, cls.BINS_PER_DECADE)}")
        h = cls()
        for i, c in d.get("bins", []):
            require(0 <= int(i) <= cls.N_BINS and int(c) >= 0, "LogHistogram bin", [i, c],
                    f"index in [0, {cls.N_BINS}] and count >= 0")
            h._counts[int(i)] += int(c)
        h._count = int(d["count"])
        require(h._count == int(h._counts.sum()), "LogHistogram count", h._count,
                f"the sum of bin counts ({int(h._counts.sum())})")
        h._sum = float(d["sum_s"])
        if h._count:
            h._min, h._max = float(d["min_s"]), float(d["max_s"])
        return h

    def __repr__(self) -> str:
        return (f"LogHistogram(count={self._count}, mean={self.mean:.6g}s, "
                f"min={self.min:.6g}s, max={self.max:.6g}s)")
