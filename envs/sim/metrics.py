"""Metrics: per-request records and streamed inter-token latencies -> a JSON-ready summary.

The simulator produces two things while it runs:

* one **record** per request (a :class:`pandas.DataFrame` with the columns in
  :data:`RECORD_COLUMNS`), written when the request finishes or is rejected;
* **inter-token-latency (ITL) samples**, streamed into one :class:`LogHistogram` per length
  class, so memory stays O(bins) however many tokens are decoded.

:func:`summarize` turns them, plus an optional KV-occupancy time series, into a nested dict of
plain Python values (TTFT, TPOT, ITL, E2E, queueing delay, SLO attainment, goodput,
throughput, preemptions, prefix hits, bytes per link, starvation, KV utilisation), for all
requests and per length class ("short" / "long"). :func:`summary_to_json` serialises it
deterministically and :func:`format_summary_rows` flattens it into table rows.

Definitions follow docs REFERENCE.md §6 (Metrics), which follows the vLLM benchmark:

* TTFT = first_token_s - arrival_s;
* TPOT = (finish_s - first_token_s) / (generated_tokens - 1), defined only when
  generated_tokens > 1 (vLLM ``benchmark_serving`` skips single-token requests too);
* ITL = every gap between two consecutive tokens of a request, pooled over requests;
* E2E = finish_s - arrival_s;
* queueing delay = first_scheduled_s - arrival_s;
* SLO attainment = fraction of *arrived* requests meeting TTFT and TPOT (and E2E if set);
  rejected requests count as misses (REFERENCE §6: ignoring them biases the tail);
* goodput = requests meeting their SLO / duration, the ``vllm bench serve --goodput``
  variant (requests/s), not DistServe's "maximum sustainable rate" (that needs a rate sweep);
* starvation: a request is starved when its queueing delay exceeds
  ``starvation_factor`` x its class TTFT SLO (REFERENCE §6: "e.g. 10x their SLO").

All times are in seconds, token counts are integers, bytes are bytes.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd

from .errors import ConfigError, require

__all__ = [
    "LogHistogram",
    "SLO",
    "SLOTable",
    "MetricsConfig",
    "RECORD_COLUMNS",
    "BYTE_COLUMNS",
    "LENGTH_CLASSES",
    "SUMMARY_ROW_HEADERS",
    "length_class",
    "summarize",
    "summary_to_json",
    "format_summary_rows",
]

# --------------------------------------------------------------------------------------------
# Log-spaced histogram for streamed durations
# --------------------------------------------------------------------------------------------


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
        # Scalar fast path (one token gap at a time): no array allocation.
        if isinstance(values, (float, int, np.floating, np.integer)) and isinstance(
                weights, (int, np.integer)):
            x, w = float(values), int(weights)
            if not 0.0 <= x < math.inf:
                raise ConfigError(f"LogHistogram.add: value={x!r} is not allowed: expected finite"
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
        if isinstance(weights, (int, np.integer)):
            w_scalar = int(weights)
            if w_scalar < 0:
                raise ConfigError(
                    f"LogHistogram.add: weight={w_scalar} is not allowed: expected >= 0")
            if w_scalar == 0:
                return
            w = None
        else:
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
                w = np.broadcast_to(w_in.astype(np.int64), np.shape(values)).ravel()
            except ValueError:
                raise ConfigError(
                    f"LogHistogram.add: weights of shape {w_in.shape} are not allowed: expected"
                    f" a shape that broadcasts to values of shape {np.shape(values)}"
                ) from None
            if w.size and w.min() < 0:
                raise ConfigError(
                    f"LogHistogram.add: weight={int(w[w < 0][0])} is not allowed: expected >= 0"
                )
        vmin, vmax = float(v.min()), float(v.max())  # NaN propagates into both
        if not (vmin >= 0.0 and vmax < math.inf):
            bad = v[~(np.isfinite(v) & (v >= 0))][0]
            raise ConfigError(
                f"LogHistogram.add: value={float(bad)!r} is not allowed: expected finite"
                " durations >= 0 s"
            )
        if w is not None:
            keep = w > 0
            if not keep.all():
                v, w = v[keep], w[keep]
                if v.size == 0:
                    return
                vmin, vmax = float(v.min()), float(v.max())
        idx = self.bin_index(v)
        if w is None:
            if v.size < self._SMALL_BATCH:
                np.add.at(self._counts, idx, w_scalar)
            else:
                self._counts += np.bincount(idx, minlength=self.N_BINS + 1) * w_scalar
            self._count += w_scalar * int(v.size)
            self._sum += float(v.sum()) * w_scalar
        else:
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
            raise ConfigError(f"percentile q={q!r} is not allowed: expected 0 <= q <= 100")
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
            "min_s": _clean(self.min),
            "max_s": _clean(self.max),
            "mean_s": _clean(self.mean),
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


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _positive_finite(x: object) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
            and math.isfinite(float(x)) and float(x) > 0)


@dataclass(frozen=True)
class SLO:
    """Latency service-level objective of one request class.

    Attributes:
        ttft_s: time-to-first-token bound in seconds (> 0).
        tpot_s: time-per-output-token bound in seconds (> 0); requests with a single output
            token have no TPOT and meet this bound by definition.
        e2e_s: optional end-to-end latency bound in seconds (> 0), ``None`` to ignore.

    Raises:
        ConfigError: a bound is not a finite number > 0.
    """

    ttft_s: float
    tpot_s: float
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        require(_positive_finite(self.ttft_s), "SLO.ttft_s", self.ttft_s, "a finite number > 0 (s)")
        require(_positive_finite(self.tpot_s), "SLO.tpot_s", self.tpot_s, "a finite number > 0 (s)")
        require(self.e2e_s is None or _positive_finite(self.e2e_s), "SLO.e2e_s", self.e2e_s,
                "None or a finite number > 0 (s)")

    def to_dict(self) -> dict[str, float | None]:
        """``{"ttft_s", "tpot_s", "e2e_s"}`` as plain floats (``e2e_s`` may be ``None``)."""
        return {"ttft_s": float(self.ttft_s), "tpot_s": float(self.tpot_s),
                "e2e_s": None if self.e2e_s is None else float(self.e2e_s)}


class SLOTable(Mapping[str, SLO]):
    """Immutable, hashable, picklable mapping ``class name -> SLO`` (sorted by name).

    Built from a dict, a mapping or an iterable of ``(name, SLO)`` pairs; an SLO may also be
    given as a mapping ``{"ttft_s": ..., "tpot_s": ..., "e2e_s": ...}`` (e.g. from YAML).

    Raises:
        ConfigError: a name is not a non-empty string, is duplicated, or a value is not an SLO.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | Any = ()) -> None:
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        out: dict[str, SLO] = {}
        for pair in pairs:
            require(isinstance(pair, tuple) and len(pair) == 2, "MetricsConfig.slos entry", pair,
                    "(name, SLO) pairs")
            name, slo = pair
            require(isinstance(name, str) and name != "", "MetricsConfig.slos key", name,
                    "a non-empty string")
            require(name not in out, "MetricsConfig.slos key", name, "unique class names")
            if isinstance(slo, Mapping):
                unknown = set(slo) - {"ttft_s", "tpot_s", "e2e_s"}
                require(not unknown, f"MetricsConfig.slos[{name!r}]", dict(slo),
                        "keys ttft_s, tpot_s and optionally e2e_s")
                try:
                    slo = SLO(**slo)
                except TypeError:
                    raise ConfigError(
                        f"MetricsConfig.slos[{name!r}]={dict(slo)!r} is not allowed: expected"
                        " keys ttft_s, tpot_s and optionally e2e_s") from None
            require(isinstance(slo, SLO), f"MetricsConfig.slos[{name!r}]", slo,
                    "an SLO or a mapping with ttft_s/tpot_s[/e2e_s]")
            out[name] = slo
        self._items: tuple[tuple[str, SLO], ...] = tuple(sorted(out.items()))

    def __getitem__(self, key: str) -> SLO:
        for name, slo in self._items:
            if name == key:
                return slo
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SLOTable):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __reduce__(self):  # pickle via the pairs
        return (SLOTable, (self._items,))

    def __repr__(self) -> str:
        return f"SLOTable({dict(self._items)!r})"


def _default_slos() -> SLOTable:
    # kvsched defaults for interactive chat; NOT taken from a paper. TTFT 1 s for short
    # prompts; TPOT 100 ms is ~10 tokens/s, about human reading speed (the llm-d blog reports
    # ITLs of 25-50 ms on real deployments, so this is a loose bound). Long prompts (>= 8192
    # tokens) get 10 s TTFT (prefill of tens of thousands of tokens) and 200 ms TPOT.
    return SLOTable({"short": SLO(ttft_s=1.0, tpot_s=0.1), "long": SLO(ttft_s=10.0, tpot_s=0.2)})


LENGTH_CLASSES: tuple[str, ...] = ("short", "long")


@dataclass(frozen=True)
class MetricsConfig:
    """How requests are classed and judged.

    Attributes:
        long_prompt_tokens: requests with ``prompt_tokens >= long_prompt_tokens`` are class
            "long", the rest "short" (default 8192: the ">8k" column of the trace README).
            Integer >= 1.
        slos: class name -> :class:`SLO`; stored as an immutable :class:`SLOTable` (a dict or
            pairs are accepted). Must contain "short" and "long". A request is judged against
            ``slos[record.slo_class]`` when its ``slo_class`` is a key here, otherwise against
            its length class. Defaults (kvsched's own choice for interactive chat, not from a
            paper): short = SLO(ttft_s=1.0, tpot_s=0.1), long = SLO(ttft_s=10.0, tpot_s=0.2);
            TPOT 100 ms ~ 10 tok/s reading speed, the llm-d blog reports ITL 25-50 ms.
        percentiles: percentiles reported for every latency, each in (0, 100], unique, sorted
            on construction; keys are ``f"p{q:g}"`` (``p50``, ``p99.9``).
        starvation_factor: a request is starved when its queueing delay exceeds
            ``starvation_factor * (its TTFT SLO)`` (REFERENCE §6 "e.g. 10x their SLO"); > 0.

    Raises:
        ConfigError: naming the field, the value and what is allowed.
    """

    long_prompt_tokens: int = 8192
    slos: SLOTable = field(default_factory=_default_slos)
    percentiles: tuple[float, ...] = (50, 90, 99)
    starvation_factor: float = 10.0

    def __post_init__(self) -> None:
        lpt = self.long_prompt_tokens
        require(isinstance(lpt, (int, np.integer)) and not isinstance(lpt, bool) and lpt >= 1,
                "MetricsConfig.long_prompt_tokens", lpt, "an integer >= 1 (tokens)")
        object.__setattr__(self, "long_prompt_tokens", int(lpt))

        slos = self.slos if isinstance(self.slos, SLOTable) else SLOTable(self.slos)
        missing = [c for c in LENGTH_CLASSES if c not in slos]
        require(not missing, "MetricsConfig.slos", dict(slos),
                f"a mapping that contains the length classes {list(LENGTH_CLASSES)}"
                f" (missing {missing})")
        object.__setattr__(self, "slos", slos)

        ps = self.percentiles
        require(isinstance(ps, (tuple, list)) and len(ps) > 0, "MetricsConfig.percentiles", ps,
                "a non-empty tuple of numbers in (0, 100]")
        ok = all(isinstance(q, (int, float, np.integer, np.floating)) and not isinstance(q, bool)
                 and math.isfinite(float(q)) and 0 < float(q) <= 100 for q in ps)
        require(ok, "MetricsConfig.percentiles", ps, "numbers q with 0 < q <= 100")
        require(len({float(q) for q in ps}) == len(ps), "MetricsConfig.percentiles", ps,
                "unique values")
        norm = tuple(sorted(int(q) if float(q).is_integer() else float(q) for q in ps))
        object.__setattr__(self, "percentiles", norm)

        require(_positive_finite(self.starvation_factor), "MetricsConfig.starvation_factor",
                self.starvation_factor, "a finite number > 0")

    def slo(self, name: str) -> SLO:
        """The SLO of class ``name``. Raises KeyError when unknown."""
        return self.slos[name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy of the configuration."""
        return {
            "long_prompt_tokens": self.long_prompt_tokens,
            "slos": {k: v.to_dict() for k, v in self.slos.items()},
            "percentiles": [float(q) for q in self.percentiles],
            "starvation_factor": float(self.starvation_factor),
        }


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

BYTE_COLUMNS: tuple[str, ...] = (
    "bytes_hbm_to_dram",
    "bytes_dram_to_hbm",
    "bytes_hbm_to_nvme",
    "bytes_nvme_to_hbm",
    "bytes_hbm_to_pnm",
)

#: Columns of the per-request records DataFrame, in order. Times are seconds from the start of
#: the workload; token counts and bytes are integers.
#:
#: request_id (int), instance_id (int), arrival_s (float), prompt_tokens (int),
#: output_tokens (int, requested), slo_class (str, the trace's tag), length_class ("short" |
#: "long", the class the summary groups by: prompt_tokens >= MetricsConfig.long_prompt_tokens), status ("finished" | "rejected"),
#: reject_reason (str, "" if none), first_scheduled_s, first_token_s, finish_s (float, NaN when
#: the event did not happen; finish_s is NaN for rejected requests), generated_tokens (int),
#: preemptions (int), recomputed_tokens (int), prefix_hit_tokens (int), max_itl_s (float, the
#: largest gap between two of the request's tokens, NaN with < 2 tokens), and the four
#: per-link byte counters in :data:`BYTE_COLUMNS` (``bytes_hbm_to_pnm``: KV migrated GPU->PNM).
RECORD_COLUMNS: tuple[str, ...] = (
    "request_id",
    "instance_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "slo_class",
    "length_class",
    "status",
    "reject_reason",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "generated_tokens",
    "preemptions",
    "recomputed_tokens",
    "prefix_hit_tokens",
    "max_itl_s",
) + BYTE_COLUMNS

STATUSES: tuple[str, ...] = ("finished", "rejected")


def length_class(prompt_tokens: np.ndarray, cfg: MetricsConfig) -> np.ndarray:
    """Length class of each request: "long" when ``prompt_tokens >= cfg.long_prompt_tokens``.

    Args:
        prompt_tokens: integer array of prompt lengths (tokens), any shape.
        cfg: the metrics configuration.

    Returns:
        A string array (dtype ``<U5``) of the same shape with "short" or "long".
    """
    p = np.asarray(prompt_tokens)
    return np.where(p >= cfg.long_prompt_tokens, "long", "short")


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def _clean(x: Any) -> Any:
    """Plain Python value for JSON: numpy scalars -> int/float, NaN/inf -> None."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        f = float(x)
        return f if math.isfinite(f) else None
    return x


def _pkey(q: float) -> str:
    return f"p{q:g}"


def _stats(x: np.ndarray, percentiles: tuple[float, ...]) -> dict[str, Any]:
    """count/mean/max and percentiles (np.percentile, method "linear") of a 1-D sample."""
    x = np.asarray(x, dtype=np.float64)
    out: dict[str, Any] = {"count": int(x.size)}
    if x.size == 0:
        out.update({"mean": None, "max": None})
        out.update({_pkey(q): None for q in percentiles})
        return out
    out["mean"] = _clean(np.mean(x))
    out["max"] = _clean(np.max(x))
    vals = np.percentile(x, np.asarray(percentiles, dtype=np.float64), method="linear")
    out.update({_pkey(q): _clean(v) for q, v in zip(percentiles, vals)})
    return out


def _hist_stats(h: LogHistogram | None, percentiles: tuple[float, ...]) -> dict[str, Any]:
    if h is None:
        h = LogHistogram()
    out: dict[str, Any] = {"count": int(h.count), "mean": _clean(h.mean), "max": _clean(h.max)}
    out.update({_pkey(q): _clean(h.percentile(q)) for q in percentiles})
    return out


def _itl_stats(h: LogHistogram | None, percentiles: tuple[float, ...], decode_span_s: np.ndarray,
               generated: np.ndarray) -> dict[str, Any]:
    """ITL count/percentiles from the pooled histogram; the mean exactly from the records.

    A request's inter-token gaps telescope to ``finish - first_token``, so the pooled mean ITL
    is ``sum(finish - first_token) / sum(generated - 1)`` over requests with >= 2 tokens: exact,
    and independent of how the gaps were streamed into the histogram.
    """
    out = _hist_stats(h, percentiles)
    n_gaps = int(np.sum(generated - 1))
    if n_gaps > 0:
        out["mean"] = _clean(float(np.sum(decode_span_s)) / n_gaps)
    return out


def _rate(n: float, duration_s: float | None) -> float | None:
    return None if duration_s is None else _clean(n / duration_s)


def _check_records(records: pd.DataFrame) -> None:
    if not isinstance(records, pd.DataFrame):
        raise ConfigError(
            f"records={type(records).__name__} is not allowed: expected a pandas DataFrame")
    missing = [c for c in RECORD_COLUMNS if c not in records.columns]
    require(not missing, "records columns", missing,
            f"all of RECORD_COLUMNS {list(RECORD_COLUMNS)}")
    status = records["status"].astype(str).to_numpy()
    bad = ~np.isin(status, STATUSES)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(
            f"records.status={status[i]!r} (request_id={records['request_id'].iloc[i]}) is not"
            f" allowed: expected one of {list(STATUSES)}")
    fin = status == "finished"
    a = records["arrival_s"].to_numpy(dtype=np.float64)
    s = records["first_scheduled_s"].to_numpy(dtype=np.float64)
    f = records["first_token_s"].to_numpy(dtype=np.float64)
    e = records["finish_s"].to_numpy(dtype=np.float64)
    g = records["generated_tokens"].to_numpy()
    ok = np.isfinite(a)
    ok &= ~fin | (np.isfinite(s) & np.isfinite(f) & np.isfinite(e) & (g >= 1))
    with np.errstate(invalid="ignore"):
        ok &= ~fin | ((a <= s) & (s <= f) & (f <= e))
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ConfigError(
            f"record request_id={records['request_id'].iloc[i]} has arrival_s={a[i]!r},"
            f" first_scheduled_s={s[i]!r}, first_token_s={f[i]!r}, finish_s={e[i]!r},"
            f" generated_tokens={g[i]!r}, status={status[i]!r}: not allowed: expected a finite"
            " arrival_s and, for finished requests, finite arrival <= first_scheduled <="
            " first_token <= finish with generated_tokens >= 1")


def _occupancy_summary(occ: pd.DataFrame) -> dict[str, Any]:
    """Time-weighted mean and max utilisation per tier of a piecewise-constant series."""
    if not isinstance(occ, pd.DataFrame):
        raise ConfigError(
            f"occupancy={type(occ).__name__} is not allowed: expected a pandas DataFrame or None")
    require("time_s" in occ.columns, "occupancy columns", list(occ.columns),
            "a time_s column plus used_blocks_<tier> / capacity_blocks_<tier> pairs")
    t = occ["time_s"].to_numpy(dtype=np.float64)
    if t.size == 0:  # e.g. a run without any scheduling event
        return {"time_span_s": None, "samples": 0, "tiers": {}}
    require(bool(np.all(np.isfinite(t))) and bool(np.all(np.diff(t) >= 0)), "occupancy.time_s",
            "unsorted or non-finite times", "finite, non-decreasing sample times (s)")
    tiers = sorted(m.group(1) for c in occ.columns
                   if (m := re.fullmatch(r"used_blocks_(\w+)", str(c))))
    span = float(t[-1] - t[0])
    # Sample k holds on [t_k, t_{k+1}); the last sample closes the window (zero width).
    dt = np.append(np.diff(t), 0.0)
    out: dict[str, Any] = {"time_span_s": _clean(span), "samples": int(t.size), "tiers": {}}
    for tier in tiers:
        cap_col = f"capacity_blocks_{tier}"
        require(cap_col in occ.columns, "occupancy columns", list(occ.columns),
                f"{cap_col} next to used_blocks_{tier}")
        used = occ[f"used_blocks_{tier}"].to_numpy(dtype=np.float64)
        cap = occ[cap_col].to_numpy(dtype=np.float64)
        if not np.any(cap > 0):
            out["tiers"][tier] = {"mean_utilization": None, "max_utilization": None,
                                  "max_capacity_blocks": _clean(np.max(cap)),
                                  "max_used_blocks": _clean(np.max(used))}
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            u = np.where(cap > 0, used / np.where(cap > 0, cap, 1.0), 0.0)
        mean = float(np.dot(u, dt) / span) if span > 0 else float(u[-1])
        out["tiers"][tier] = {
            "mean_utilization": _clean(mean),
            "max_utilization": _clean(np.max(u)),
            "max_capacity_blocks": _clean(np.max(cap)),
            "max_used_blocks": _clean(np.max(used)),
        }
    return out


def summarize(
    records: pd.DataFrame,
    itl: Mapping[str, LogHistogram] | None,
    occupancy: pd.DataFrame | None,
    cfg: MetricsConfig,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """Summarise one simulation run into a JSON-ready nested dict.

    Args:
        records: per-request records with (at least) the columns of :data:`RECORD_COLUMNS`,
            one row per arrived request.
        itl: length class name ("short"/"long") -> :class:`LogHistogram` of that class's
            inter-token gaps (s). An "all" entry is used for the "all" class if present;
            otherwise "all" is the merge of every entry. ``None`` or missing classes give
            empty ITL stats.
        occupancy: optional KV occupancy samples: ``time_s`` (non-decreasing) plus
            ``used_blocks_<tier>`` and ``capacity_blocks_<tier>`` columns (tiers hbm, dram,
            nvme, any others are reported too). Values hold until the next sample
            (piecewise constant); the window is first to last sample. An empty frame gives
            ``{"time_span_s": None, "samples": 0, "tiers": {}}``.
        cfg: classes, SLOs, percentiles and starvation factor.
        duration_s: the denominator of every rate (s). Default: last finish_s minus first
            arrival_s; ``None`` (rates reported as None) when no request finished or that span
            is not positive.

    Returns:
        ``{"duration_s", "config", "classes": {"all": C, "short": C, "long": C},
        "kv_occupancy": {"time_span_s", "samples", "tiers": {tier: {"mean_utilization",
        "max_utilization", "max_capacity_blocks", "max_used_blocks"}}} | None}``, where only
        classes with at least one arrived request appear besides "all", and each C is::

            counts: {arrived, finished, rejected, rejected_by_reason: {reason: n}}
            ttft_s, tpot_s, e2e_s, queueing_delay_s: {count, mean, max, p50, p90, p99}
                (over finished requests; tpot_s only over those with generated_tokens > 1)
            itl_s: {count, mean, max, p50, ...}  (from the class's LogHistogram)
            max_itl_s                             (max of the records' max_itl_s)
            slo: {met, attainment}                (attainment = met / arrived)
            goodput_rps                           (met / duration_s)
            throughput: {requests_per_s, output_tokens_per_s, total_tokens_per_s}
                (finished requests; output = generated_tokens, total = prompt + generated)
            preemptions: {total, requests_preempted, recomputed_tokens}
            prefix: {hit_tokens, prompt_tokens, hit_rate}  (finished requests)
            bytes_moved: {hbm_to_dram, dram_to_hbm, hbm_to_nvme, nvme_to_hbm, total}
            starvation: {max_queueing_delay_s, starved, threshold_factor}

        A request meets its SLO when it finished, TTFT <= ttft_s, TPOT <= tpot_s (a
        single-token request meets TPOT by definition) and, if set, E2E <= e2e_s. Rejected
        requests count as arrived and as misses. Starvation looks at every request that was
        scheduled at least once (finished or not). All numbers are plain int/float; NaN -> None.

    Raises:
        ConfigError: missing columns, an unknown status, inconsistent timestamps of a finished
            request, a non-positive ``duration_s``, or malformed ``occupancy``.
    """
    require(isinstance(cfg, MetricsConfig), "cfg", type(cfg).__name__, "a MetricsConfig")
    _check_records(records)
    if duration_s is not None:
        require(_positive_finite(duration_s), "duration_s", duration_s,
                "None or a finite number > 0 (s)")
        duration_s = float(duration_s)

    n = len(records)
    a = records["arrival_s"].to_numpy(dtype=np.float64)
    s = records["first_scheduled_s"].to_numpy(dtype=np.float64)
    f = records["first_token_s"].to_numpy(dtype=np.float64)
    e = records["finish_s"].to_numpy(dtype=np.float64)
    g = records["generated_tokens"].to_numpy(dtype=np.int64)
    prompt = records["prompt_tokens"].to_numpy(dtype=np.int64)
    status = records["status"].astype(str).to_numpy()
    reason = records["reject_reason"].fillna("").astype(str).to_numpy()
    slo_cls = records["slo_class"].astype(str).to_numpy()
    fin = status == "finished"
    rej = status == "rejected"

    if duration_s is None and fin.any():
        span = float(np.max(e[fin]) - np.min(a))
        duration_s = span if span > 0 else None

    lcls = length_class(prompt, cfg)
    # an untagged request (None / NaN) goes by its length class whatever str() makes of the
    # missing value (pandas 2: "None", pandas 3: NaN), even with a class named "None"
    tagged = records["slo_class"].notna().to_numpy()
    judged = np.where(tagged & np.isin(slo_cls, list(cfg.slos.keys())), slo_cls, lcls)
    slo_ttft = np.array([cfg.slos[c].ttft_s for c in judged], dtype=np.float64)
    slo_tpot = np.array([cfg.slos[c].tpot_s for c in judged], dtype=np.float64)
    slo_e2e = np.array([np.inf if cfg.slos[c].e2e_s is None else cfg.slos[c].e2e_s
                        for c in judged], dtype=np.float64)

    with np.errstate(invalid="ignore", divide="ignore"):
        ttft = f - a
        e2e = e - a
        qdelay = s - a
        multi = fin & (g > 1)
        tpot = np.full(n, np.nan)
        tpot[multi] = (e[multi] - f[multi]) / (g[multi] - 1)
        met = fin & (ttft <= slo_ttft) & (~multi | (tpot <= slo_tpot)) & (e2e <= slo_e2e)
        scheduled = np.isfinite(s)
        starved = scheduled & (qdelay > cfg.starvation_factor * slo_ttft)

    max_itl = records["max_itl_s"].to_numpy(dtype=np.float64)
    pre = records["preemptions"].to_numpy(dtype=np.int64)
    recomputed = records["recomputed_tokens"].to_numpy(dtype=np.int64)
    hits = records["prefix_hit_tokens"].to_numpy(dtype=np.int64)
    link_bytes = {c[len("bytes_"):]: records[c].to_numpy(dtype=np.int64) for c in BYTE_COLUMNS}

    itl = dict(itl or {})
    for k, h in itl.items():
        require(isinstance(h, LogHistogram), f"itl[{k!r}]", type(h).__name__, "a LogHistogram")
    if "all" not in itl:
        merged = LogHistogram()
        for k in sorted(itl):
            merged.merge(itl[k])
        itl["all"] = merged

    ps = cfg.percentiles

    def section(mask: np.ndarray, name: str) -> dict[str, Any]:
        m_fin = mask & fin
        m_rej = mask & rej
        reasons, rcounts = np.unique(reason[m_rej], return_counts=True)
        n_met = int(np.count_nonzero(mask & met))
        arrived = int(np.count_nonzero(mask))
        mi = max_itl[mask]
        mi = mi[np.isfinite(mi)]
        prompt_fin = int(prompt[m_fin].sum())
        hit_fin = int(hits[m_fin].sum())
        q_sched = qdelay[mask & scheduled]
        bytes_moved = {k: int(v[mask].sum()) for k, v in link_bytes.items()}
        bytes_moved["total"] = int(sum(bytes_moved.values()))
        return {
            "counts": {
                "arrived": arrived,
                "finished": int(np.count_nonzero(m_fin)),
                "rejected": int(np.count_nonzero(m_rej)),
                "rejected_by_reason": {str(r): int(c) for r, c in zip(reasons, rcounts)},
            },
            "ttft_s": _stats(ttft[m_fin], ps),
            "tpot_s": _stats(tpot[mask & multi], ps),
            "e2e_s": _stats(e2e[m_fin], ps),
            "queueing_delay_s": _stats(qdelay[m_fin], ps),
            "itl_s": _itl_stats(itl.get(name), ps, e[mask & multi] - f[mask & multi], g[mask & multi]),
            "max_itl_s": _clean(np.max(mi)) if mi.size else None,
            "slo": {"met": n_met, "attainment": _clean(n_met / arrived) if arrived else None},
            "goodput_rps": _rate(n_met, duration_s),
            "throughput": {
                "requests_per_s": _rate(np.count_nonzero(m_fin), duration_s),
                "output_tokens_per_s": _rate(int(g[m_fin].sum()), duration_s),
                "total_tokens_per_s": _rate(int(g[m_fin].sum()) + prompt_fin, duration_s),
            },
            "preemptions": {
                "total": int(pre[mask].sum()),
                "requests_preempted": int(np.count_nonzero(mask & (pre > 0))),
                "recomputed_tokens": int(recomputed[mask].sum()),
            },
            "prefix": {
                "hit_tokens": hit_fin,
                "prompt_tokens": prompt_fin,
                "hit_rate": _clean(hit_fin / prompt_fin) if prompt_fin else None,
            },
            "bytes_moved": bytes_moved,
            "starvation": {
                "max_queueing_delay_s": _clean(np.max(q_sched)) if q_sched.size else None,
                "starved": int(np.count_nonzero(mask & starved)),
                "threshold_factor": float(cfg.starvation_factor),
            },
        }

    classes: dict[str, Any] = {"all": section(np.ones(n, dtype=bool), "all")}
    for c in LENGTH_CLASSES:
        mask = lcls == c
        if mask.any():
            classes[c] = section(mask, c)

    return {
        "duration_s": _clean(duration_s),
        "config": cfg.to_dict(),
        "classes": classes,
        "kv_occupancy": None if occupancy is None else _occupancy_summary(occupancy),
    }


def summary_to_json(summary: Mapping[str, Any]) -> str:
    """Deterministic JSON text of a :func:`summarize` result (sorted keys, indent 2).

    Raises:
        ValueError: the summary holds NaN/inf (``allow_nan=False``); :func:`summarize` never
            produces them.
    """
    return json.dumps(summary, sort_keys=True, indent=2, allow_nan=False)


SUMMARY_ROW_HEADERS: tuple[str, ...] = (
    "class", "n", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
    "E2E p50 s", "E2E p99 s", "SLO %", "goodput req/s", "preemptions", "rejected",
)


def _fmt(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    """``x * scale`` with ``digits`` decimals; a value that would print as zero without being
    zero (one request met in an hour of goodput) gets two significant digits instead."""
    if x is None:
        return "-"
    v = x * scale
    s = f"{v:.{digits}f}"
    if v != 0 and float(s) == 0:
        s = f"{v:.2g}"
    return s


def format_summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Rows of strings for a table, one per class ("all", then "short", "long" if present).

    Columns are :data:`SUMMARY_ROW_HEADERS`: class, n (arrived), TTFT p50/p99 (ms), TPOT
    p50/p99 (ms), ITL p99 (ms), E2E p50/p99 (s), SLO attainment (%), goodput (req/s),
    preemptions (total), rejected. Missing values (no samples, or a percentile not in the
    config) print as "-".
    """
    rows: list[tuple[str, ...]] = []
    order = ["all"] + [k for k in LENGTH_CLASSES if k in summary["classes"]]
    for name in order:
        c = summary["classes"][name]
        att = c["slo"]["attainment"]
        rows.append((
            name,
            str(c["counts"]["arrived"]),
            _fmt(c["ttft_s"].get("p50"), 1e3),
            _fmt(c["ttft_s"].get("p99"), 1e3),
            _fmt(c["tpot_s"].get("p50"), 1e3),
            _fmt(c["tpot_s"].get("p99"), 1e3),
            _fmt(c["itl_s"].get("p99"), 1e3),
            _fmt(c["e2e_s"].get("p50"), 1.0, 3),
            _fmt(c["e2e_s"].get("p99"), 1.0, 3),
            _fmt(att, 100.0),
            _fmt(c["goodput_rps"], 1.0, 3),
            str(c["preemptions"]["total"]),
            str(c["counts"]["rejected"]),
        ))
    return rows
