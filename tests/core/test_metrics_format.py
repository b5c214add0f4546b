"""Summary rows for tables (envs/sim/metrics_format.py): one row of strings per length class."""

from __future__ import annotations

from kvsched.envs.sim.metrics import SUMMARY_ROW_HEADERS, MetricsConfig, format_summary_rows, summarize
from kvsched.envs.sim.metrics_format import format_number
from simkit import four_requests


def test_format_summary_rows():
    s = summarize(four_requests(), {}, None, MetricsConfig())
    rows = format_summary_rows(s)
    assert [r[0] for r in rows] == ["all", "short", "long"]
    assert all(len(r) == len(SUMMARY_ROW_HEADERS) for r in rows)
    a = dict(zip(SUMMARY_ROW_HEADERS, rows[0]))
    assert a["n"] == "4"
    assert a["TTFT p50 ms"] == "1250.0"
    assert a["TPOT p50 ms"] == "75.0"
    assert a["ITL p99 ms"] == "-"  # no ITL samples
    assert a["E2E p50 s"] == "2.250"
    assert a["SLO %"] == "75.0"
    assert a["goodput req/s"] == "0.250"
    assert a["preemptions"] == "3"
    assert a["rejected"] == "0"


def test_tiny_nonzero_values_do_not_print_as_zero():
    """One request meeting its SLO in ~an hour is a goodput of 0.00029 req/s, not 0.000."""
    from kvsched.envs.sim.metrics import _fmt
    from kvsched.experiments.compare import _fmt as compare_fmt

    assert _fmt(1 / 3504, 1.0, 3) == "0.00029"
    assert _fmt(0.0, 1.0, 3) == "0.000" and _fmt(2.5, 1.0, 3) == "2.500" and _fmt(None) == "-"
    assert compare_fmt(1 / 3504, 0.0, 1.0, 2, True) == "0.00029"
    assert compare_fmt(1 / 3504, 1e-5, 1.0, 2, True) == "0.00029±1e-05"
    assert compare_fmt(3.0, 0.5, 1.0, 2, True) == "3.00±0.50" and compare_fmt(0.0, 0.0, 1.0, 2, True) == "0.00"


def test_format_number_scales_rounds_and_prints_missing_as_a_dash() -> None:
    assert format_number(0.0125, 1e3) == "12.5"
    assert format_number(2.0, 1.0, 3) == "2.000"
    assert format_number(None, 1e3) == "-"
    assert format_number(-1e-9, 1.0, 1) == "-1e-09"  # tiny but not zero: two significant digits
