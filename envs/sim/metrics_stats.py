"""The number blocks a run summary is made of: JSON-clean scalars, latency statistics, rates
and KV-occupancy utilisation.

:func:`kvsched.envs.sim.metrics.summarize` assembles its nested dict from these blocks: a
sample's count / mean / max / percentiles (:func:`sample_stats`, ``np.percentile`` with the
"linear" method, as vLLM's ``benchmark_serving``), the same from a :class:`LogHistogram`
(:func:`histogram_stats`, :func:`itl_stats`), events per second (:func:`rate`) and the
time-weighted utilisation of each KV tier (:func:`occupancy_summary`). Every value returned is a
plain ``int`` / ``float`` / ``None`` (NaN and infinity become ``None``: JSON has neither).

Times are seconds, rates are per second, utilisations are fractions in [0, 1].
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from .errors import ConfigError, require
from .histogram import LogHistogram

__all__ = [
    "json_scalar",
    "percentile_key",
    "sample_stats",
    "histogram_stats",
    "itl_stats",
    "rate",
    "occupancy_summary",
]


def json_scalar(x: Any) -> Any:
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


def percentile_key(q: float) -> str:
    """Key of percentile ``q`` in a stats block: ``p50``, ``p99.9``."""
    return f"p{q:g}"


def sample_stats(x: np.ndarray, percentiles: tuple[float, ...]) -> dict[str, Any]:
    """count/mean/max and percentiles (np.percentile, method "linear") of a 1-D sample.

    Returns:
        ``{"count", "mean", "max", "p<q>" for q in percentiles}``; all but count are ``None``
        for an empty sample.
    """
    x = np.asarray(x, dtype=np.float64)
    out: dict[str, Any] = {"count": int(x.size)}
    if x.size == 0:
        out.update({"mean": None, "max": None})
        out.update({percentile_key(q): None for q in percentiles})
        return out
    out["mean"] = json_scalar(np.mean(x))
    out["max"] = json_scalar(np.max(x))
    vals = np.percentile(x, np.asarray(percentiles, dtype=np.float64), method="linear")
    out.update({percentile_key(q): json_scalar(v) for q, v in zip(percentiles, vals)})
    return out


def histogram_stats(h: LogHistogram | None, percentiles: tuple[float, ...]) -> dict[str, Any]:
    """:func:`sample_stats` of the samples in ``h`` (``None``: an empty histogram)."""
    if h is None:
        h = LogHistogram()
    out: dict[str, Any] = {"count": int(h.count), "mean": json_scalar(h.mean),
                           "max": json_scalar(h.max)}
    out.update({percentile_key(q): json_scalar(h.percentile(q)) for q in percentiles})
    return out


def itl_stats(h: LogHistogram | None, percentiles: tuple[float, ...], decode_span_s: np.ndarray,
              generated: np.ndarray) -> dict[str, Any]:
    """ITL count/percentiles from the pooled histogram; the mean exactly from the records.

    A request's inter-token gaps telescope to ``finish - first_token``, so the pooled mean ITL
    is ``sum(finish - first_token) / sum(generated - 1)`` over requests with >= 2 tokens: exact,
    and independent of how the gaps were streamed into the histogram.

    Args:
        h: the class's ITL histogram (s), or ``None``.
        percentiles: as :attr:`MetricsConfig.percentiles`.
        decode_span_s: ``finish_s - first_token_s`` per request with >= 2 tokens, shape ``(n,)``.
        generated: generated tokens of the same requests, shape ``(n,)``.
    """
    out = histogram_stats(h, percentiles)
    n_gaps = int(np.sum(generated - 1))
    if n_gaps > 0:
        out["mean"] = json_scalar(float(np.sum(decode_span_s)) / n_gaps)
    return out


def rate(n: float | np.integer, duration_s: float | None) -> float | None:
    """``n / duration_s`` (per second), ``None`` when the duration is unknown."""
    return None if duration_s is None else json_scalar(n / duration_s)


def occupancy_summary(occ: pd.DataFrame) -> dict[str, Any]:
    """Time-weighted mean and max utilisation per tier of a piecewise-constant series.

    Args:
        occ: ``time_s`` (s, non-decreasing) plus ``used_blocks_<tier>`` and
            ``capacity_blocks_<tier>`` columns; sample ``k`` holds on ``[t_k, t_{k+1})``.

    Returns:
        ``{"time_span_s", "samples", "tiers": {tier: {"mean_utilization", "max_utilization",
        "max_capacity_blocks", "max_used_blocks"}}}`` with tiers sorted by name; a tier whose
        capacity is never positive has ``None`` utilisations.

    Raises:
        ConfigError: not a DataFrame, no ``time_s`` column, unsorted or non-finite times, or
            a ``used_blocks_<tier>`` column without its ``capacity_blocks_<tier>``.
    """
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
    out: dict[str, Any] = {"time_span_s": json_scalar(span), "samples": int(t.size), "tiers": {}}
    for tier in tiers:
        cap_col = f"capacity_blocks_{tier}"
        require(cap_col in occ.columns, "occupancy columns", list(occ.columns),
                f"{cap_col} next to used_blocks_{tier}")
        used = occ[f"used_blocks_{tier}"].to_numpy(dtype=np.float64)
        cap = occ[cap_col].to_numpy(dtype=np.float64)
        out["tiers"][tier] = _tier_utilisation(used, cap, dt, span)
    return out


def _tier_utilisation(used: np.ndarray, cap: np.ndarray, dt: np.ndarray,
                      span: float) -> dict[str, Any]:
    """One tier's block of :func:`occupancy_summary`.

    Args:
        used, cap: blocks in use and capacity (blocks) per sample, shape ``(n,)``.
        dt: how long each sample holds (s), shape ``(n,)``, the last one 0.
        span: last minus first sample time (s); 0 gives the last sample's utilisation as mean.
    """
    if not np.any(cap > 0):
        return {"mean_utilization": None, "max_utilization": None,
                "max_capacity_blocks": json_scalar(np.max(cap)),
                "max_used_blocks": json_scalar(np.max(used))}
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(cap > 0, used / np.where(cap > 0, cap, 1.0), 0.0)
    mean = float(np.dot(u, dt) / span) if span > 0 else float(u[-1])
    return {
        "mean_utilization": json_scalar(mean),
        "max_utilization": json_scalar(np.max(u)),
        "max_capacity_blocks": json_scalar(np.max(cap)),
        "max_used_blocks": json_scalar(np.max(used)),
    }
