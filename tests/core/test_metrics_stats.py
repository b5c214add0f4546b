"""The summary's number blocks (envs/sim/metrics_stats.py): JSON-clean scalars, sample and
histogram statistics, rates, and the time-weighted utilisation of an occupancy frame."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import MetricsConfig, summarize
from kvsched.envs.sim.metrics_stats import json_scalar, percentile_key, rate, sample_stats
from simkit import approx, four_requests


def test_occupancy_time_weighted_mean():
    occ = pd.DataFrame({
        "time_s": [0.0, 1.0, 3.0, 4.0],
        "used_blocks_hbm": [10, 50, 100, 0],
        "capacity_blocks_hbm": [100, 100, 100, 100],
        "used_blocks_dram": [0, 20, 20, 20],
        "capacity_blocks_dram": [200, 200, 200, 200],
        "used_blocks_nvme": [0, 0, 0, 0],
        "capacity_blocks_nvme": [0, 0, 0, 0],
    })
    s = summarize(four_requests(), {}, occ, MetricsConfig())
    k = s["kv_occupancy"]
    assert k["time_span_s"] == 4.0
    # hbm: 0.1 for 1 s, 0.5 for 2 s, 1.0 for 1 s (last sample has zero width) -> 2.1/4
    assert k["tiers"]["hbm"]["mean_utilization"] == approx(0.525)
    assert k["tiers"]["hbm"]["max_utilization"] == approx(1.0)
    # dram: 0 for 1 s, 0.1 for 3 s -> 0.3/4
    assert k["tiers"]["dram"]["mean_utilization"] == approx(0.075)
    assert k["tiers"]["dram"]["max_utilization"] == approx(0.1)
    assert k["tiers"]["nvme"]["mean_utilization"] is None  # zero capacity
    assert summarize(four_requests(), {}, None, MetricsConfig())["kv_occupancy"] is None
    empty = summarize(four_requests(), {}, occ.iloc[:0], MetricsConfig())["kv_occupancy"]
    assert empty == {"time_span_s": None, "samples": 0, "tiers": {}}
    one = summarize(four_requests(), {}, occ.iloc[1:2], MetricsConfig())["kv_occupancy"]
    assert one["tiers"]["hbm"]["mean_utilization"] == approx(0.5)  # zero span: the sample
    with pytest.raises(ConfigError, match="time_s"):
        summarize(four_requests(), {}, occ.iloc[::-1], MetricsConfig())


def test_json_scalar_gives_plain_values_and_none_for_nan_and_infinity() -> None:
    assert json_scalar(np.int64(3)) == 3 and type(json_scalar(np.int64(3))) is int
    assert type(json_scalar(np.float32(0.5))) is float and json_scalar(np.bool_(True)) is True
    assert json_scalar(float("nan")) is None and json_scalar(np.inf) is None and json_scalar(None) is None
    assert json_scalar("x") == "x"


def test_sample_stats_use_linear_percentiles_and_none_when_empty() -> None:
    s = sample_stats(np.array([0.5, 2.0, 5.0, 0.5]), (50, 99.9))
    assert s["count"] == 4 and s["mean"] == approx(2.0) and s["max"] == 5.0
    assert s["p50"] == approx(1.25) and s["p99.9"] == approx(np.percentile([0.5, 2.0, 5.0, 0.5], 99.9))
    assert sample_stats(np.array([]), (50,)) == {"count": 0, "mean": None, "max": None, "p50": None}
    assert percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"


def test_rate_is_events_per_second_and_none_without_a_duration() -> None:
    assert rate(6, 3.0) == 2.0 and type(rate(np.int64(6), 3.0)) is float
    assert rate(6, None) is None
