"""A run summary as table rows: one row of strings per length class.

:func:`format_summary_rows` flattens a :func:`kvsched.envs.sim.metrics.summarize` result into
the columns :data:`SUMMARY_ROW_HEADERS` (the ``kvsched simulate`` table): TTFT / TPOT / ITL in
milliseconds, E2E in seconds, SLO attainment in percent, goodput in requests per second.
"""

from __future__ import annotations

from typing import Any, Mapping

from .metrics_config import LENGTH_CLASSES

__all__ = ["SUMMARY_ROW_HEADERS", "format_summary_rows", "format_number"]

SUMMARY_ROW_HEADERS: tuple[str, ...] = (
    "class", "n", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
    "E2E p50 s", "E2E p99 s", "SLO %", "goodput req/s", "preemptions", "rejected",
)


def format_number(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    """``x * scale`` with ``digits`` decimals ("-" for ``None``); a value that would print as
    zero without being zero (one request met in an hour of goodput) gets two significant digits
    instead."""
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
            format_number(c["ttft_s"].get("p50"), 1e3),
            format_number(c["ttft_s"].get("p99"), 1e3),
            format_number(c["tpot_s"].get("p50"), 1e3),
            format_number(c["tpot_s"].get("p99"), 1e3),
            format_number(c["itl_s"].get("p99"), 1e3),
            format_number(c["e2e_s"].get("p50"), 1.0, 3),
            format_number(c["e2e_s"].get("p99"), 1.0, 3),
            format_number(att, 100.0),
            format_number(c["goodput_rps"], 1.0, 3),
            str(c["preemptions"]["total"]),
            str(c["counts"]["rejected"]),
        ))
    return rows
