"""Tests of kvsched.envs.sim.metrics: LogHistogram, config validation, summarize, formatting.

The 4-request fixture is computed by hand in the comments; every expected number below comes
from those comments, not from running the code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import (
    RECORD_COLUMNS,
    SLO,
    SUMMARY_ROW_HEADERS,
    LogHistogram,
    MetricsConfig,
    format_summary_rows,
    length_class,
    summarize,
    summary_to_json,
)

NAN = float("nan")


def _record(**kw):
    base = dict(
        request_id=0, instance_id=0, arrival_s=0.0, prompt_tokens=100, output_tokens=10,
        slo_class="default", status="finished", reject_reason="", first_scheduled_s=NAN,
        first_token_s=NAN, finish_s=NAN, generated_tokens=0, preemptions=0,
        recomputed_tokens=0, prefix_hit_tokens=0, max_itl_s=NAN, bytes_hbm_to_dram=0,
        bytes_dram_to_hbm=0, bytes_hbm_to_nvme=0, bytes_nvme_to_hbm=0, bytes_hbm_to_pnm=0,
    )
    base.update(kw)
    return base


def _frame(rows):
    return pd.DataFrame(rows, columns=list(RECORD_COLUMNS))


# Hand-computed fixture (default config: short SLO TTFT 1 s / TPOT 0.1 s, long 10 s / 0.2 s,
# long when prompt >= 8192):
#   r0 short: arr 0,   sched 0.1,  first 0.5, fin 2.0,  gen 21 -> TTFT 0.5, TPOT 1.5/20=0.075,
#             E2E 2.0, queue 0.1                                      -> meets
#   r1 short: arr 1.0, sched 1.5,  first 3.0, fin 3.5,  gen 11 -> TTFT 2.0, TPOT 0.5/10=0.05,
#             E2E 2.5, queue 0.5                                      -> misses (TTFT)
#   r2 long (prompt == 8192): arr 2, sched 2, first 7, fin 12, gen 51 -> TTFT 5, TPOT 0.1,
#             E2E 10, queue 0                                         -> meets
#   r3 short: arr 3.0, sched 3.25, first 3.5, fin 3.5, gen 1   -> TTFT 0.5, no TPOT,
#             E2E 0.5, queue 0.25                                     -> meets
#   duration = last finish 12 - first arrival 0 = 12 s
def four_requests() -> pd.DataFrame:
    return _frame([
        _record(request_id=0, arrival_s=0.0, prompt_tokens=100, first_scheduled_s=0.1,
                first_token_s=0.5, finish_s=2.0, generated_tokens=21, preemptions=1,
                recomputed_tokens=100, prefix_hit_tokens=64, max_itl_s=0.2,
                bytes_hbm_to_dram=1000, bytes_dram_to_hbm=1000),
        _record(request_id=1, arrival_s=1.0, prompt_tokens=200, first_scheduled_s=1.5,
                first_token_s=3.0, finish_s=3.5, generated_tokens=11, max_itl_s=0.1),
        _record(request_id=2, instance_id=1, arrival_s=2.0, prompt_tokens=8192,
                first_scheduled_s=2.0, first_token_s=7.0, finish_s=12.0, generated_tokens=51,
                preemptions=2, recomputed_tokens=4096, prefix_hit_tokens=4096, max_itl_s=0.5,
                bytes_hbm_to_nvme=7, bytes_nvme_to_hbm=5),
        _record(request_id=3, arrival_s=3.0, prompt_tokens=50, first_scheduled_s=3.25,
                first_token_s=3.5, finish_s=3.5, generated_tokens=1),
    ])


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# ------------------------------------------------------------------------------ summarize


def test_hand_computed_four_requests():
    s = summarize(four_requests(), {}, None, MetricsConfig())
    assert s["duration_s"] == 12.0
    a = s["classes"]["all"]
    assert a["counts"] == {"arrived": 4, "finished": 4, "rejected": 0, "rejected_by_reason": {}}
    # TTFT [0.5, 2, 5, 0.5]: sorted [0.5, 0.5, 2, 5]; linear p50 at pos 1.5 -> 1.25,
    # p90 at pos 2.7 -> 2 + 0.7*3 = 4.1, p99 at pos 2.97 -> 4.91
    assert a["ttft_s"]["count"] == 4
    assert a["ttft_s"]["mean"] == approx(2.0)
    assert a["ttft_s"]["p50"] == approx(1.25)
    assert a["ttft_s"]["p90"] == approx(4.1)
    assert a["ttft_s"]["p99"] == approx(4.91)
    assert a["ttft_s"]["max"] == approx(5.0)
    # TPOT [0.075, 0.05, 0.1] (r3 has one token: excluded)
    assert a["tpot_s"]["count"] == 3
    assert a["tpot_s"]["mean"] == approx(0.075)
    assert a["tpot_s"]["p50"] == approx(0.075)
    # E2E [2, 2.5, 10, 0.5]: sorted [0.5, 2, 2.5, 10] -> p50 2.25, mean 3.75
    assert a["e2e_s"]["mean"] == approx(3.75)
    assert a["e2e_s"]["p50"] == approx(2.25)
    # queueing [0.1, 0.5, 0, 0.25]
    assert a["queueing_delay_s"]["mean"] == approx(0.2125)
    assert a["queueing_delay_s"]["max"] == approx(0.5)
    # SLO: r0, r2, r3 meet; r1 misses TTFT
    assert a["slo"] == {"met": 3, "attainment": approx(0.75)}
    assert a["goodput_rps"] == approx(3 / 12)
    assert a["throughput"]["requests_per_s"] == approx(4 / 12)
    assert a["throughput"]["output_tokens_per_s"] == approx((21 + 11 + 51 + 1) / 12)
    assert a["throughput"]["total_tokens_per_s"] == approx((8542 + 84) / 12)
    assert a["preemptions"] == {"total": 3, "requests_preempted": 2, "recomputed_tokens": 4196}
    assert a["prefix"]["hit_tokens"] == 4160
    assert a["prefix"]["prompt_tokens"] == 8542
    assert a["prefix"]["hit_rate"] == approx(4160 / 8542)
    assert a["bytes_moved"] == {"hbm_to_dram": 1000, "dram_to_hbm": 1000, "hbm_to_nvme": 7,
                                "nvme_to_hbm": 5, "hbm_to_pnm": 0, "total": 2012}
    assert a["max_itl_s"] == approx(0.5)
    assert a["starvation"]["max_queueing_delay_s"] == approx(0.5)
    assert a["starvation"]["starved"] == 0

    short, long_ = s["classes"]["short"], s["classes"]["long"]
    assert short["counts"]["arrived"] == 3 and long_["counts"]["arrived"] == 1
    assert short["slo"] == {"met": 2, "attainment": approx(2 / 3)}
    assert long_["slo"] == {"met": 1, "attainment": approx(1.0)}
    assert short["ttft_s"]["p50"] == approx(0.5)  # [0.5, 2, 0.5]
    assert long_["ttft_s"]["p99"] == approx(5.0)
    assert short["goodput_rps"] == approx(2 / 12)
    assert long_["goodput_rps"] == approx(1 / 12)
    assert short["max_itl_s"] == approx(0.2)
    assert long_["bytes_moved"]["total"] == 12


def test_rejected_counts_as_miss_and_by_reason():
    rows = four_requests().to_dict("records")
    rows.append(_record(request_id=4, arrival_s=4.0, status="rejected",
                        reject_reason="kv_capacity"))
    rows.append(_record(request_id=5, arrival_s=5.0, status="rejected",
                        reject_reason="queue_full", prompt_tokens=9000))
    rows.append(_record(request_id=6, arrival_s=5.5, status="rejected",
                        reject_reason="kv_capacity"))
    s = summarize(_frame(rows), {}, None, MetricsConfig())
    a = s["classes"]["all"]
    assert a["counts"] == {"arrived": 7, "finished": 4, "rejected": 3,
                           "rejected_by_reason": {"kv_capacity": 2, "queue_full": 1}}
    assert a["slo"] == {"met": 3, "attainment": approx(3 / 7)}
    # latency stats are over finished requests only: unchanged
    assert a["ttft_s"]["count"] == 4 and a["ttft_s"]["mean"] == approx(2.0)
    assert a["goodput_rps"] == approx(3 / 12)  # duration still 0 -> 12 s
    assert s["classes"]["long"]["counts"]["rejected_by_reason"] == {"queue_full": 1}
    assert s["classes"]["long"]["slo"]["attainment"] == approx(1 / 2)
    assert s["classes"]["short"]["slo"]["attainment"] == approx(2 / 5)


def test_single_token_request_meets_tpot_but_not_ttft_by_default():
    tight = MetricsConfig(slos={"short": SLO(ttft_s=1.0, tpot_s=1e-9),
                                "long": SLO(ttft_s=1.0, tpot_s=1e-9)})
    one_ok = _record(request_id=0, arrival_s=0.0, first_scheduled_s=0.0, first_token_s=0.5,
                     finish_s=0.5, generated_tokens=1)
    one_late = _record(request_id=1, arrival_s=0.0, first_scheduled_s=0.0, first_token_s=2.0,
                       finish_s=2.0, generated_tokens=1)
    two = _record(request_id=2, arrival_s=0.0, first_scheduled_s=0.0, first_token_s=0.5,
                  finish_s=0.6, generated_tokens=2)
    s = summarize(_frame([one_ok, one_late, two]), {}, None, tight)
    a = s["classes"]["all"]
    assert a["slo"]["met"] == 1  # only one_ok: two misses TPOT 0.1 > 1e-9, one_late TTFT
    assert a["tpot_s"]["count"] == 1
    assert a["tpot_s"]["mean"] == pytest.approx(0.1, rel=1e-9)
    # all-single-token input: TPOT stats empty -> None, not NaN
    s1 = summarize(_frame([one_ok]), {}, None, tight)
    assert s1["classes"]["all"]["tpot_s"] == {"count": 0, "mean": None, "max": None,
                                             "p50": None, "p90": None, "p99": None}


def test_e2e_slo_and_slo_class_override():
    cfg = MetricsConfig(slos={"short": SLO(1.0, 0.1, e2e_s=1.0), "long": SLO(10.0, 0.2)})
    s = summarize(four_requests(), {}, None, cfg)
    assert s["classes"]["short"]["slo"]["met"] == 1  # r0 now misses E2E (2.0 > 1.0)
    df = four_requests()
    df.loc[0, "slo_class"] = "strict"
    cfg2 = MetricsConfig(slos={"short": SLO(1.0, 0.1), "long": SLO(10.0, 0.2),
                               "strict": SLO(ttft_s=0.1, tpot_s=1.0)})
    s2 = summarize(df, {}, None, cfg2)
    assert s2["classes"]["all"]["slo"]["met"] == 2  # r0 judged by "strict": TTFT 0.5 > 0.1


def test_goodput_is_met_over_given_duration():
    s = summarize(four_requests(), {}, None, MetricsConfig(), duration_s=30.0)
    a = s["classes"]["all"]
    assert s["duration_s"] == 30.0
    assert a["goodput_rps"] == approx(3 / 30)
    assert a["throughput"]["requests_per_s"] == approx(4 / 30)
    with pytest.raises(ConfigError, match="duration_s"):
        summarize(four_requests(), {}, None, MetricsConfig(), duration_s=0.0)


def test_default_duration_is_first_arrival_to_last_finish():
    df = four_requests()
    for c in ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s"):
        df[c] = df[c] + 5.0
    s = summarize(df, {}, None, MetricsConfig())
    assert s["duration_s"] == approx(12.0)  # 17 - 5
    assert s["classes"]["all"]["goodput_rps"] == approx(3 / 12)


def test_starvation_threshold_uses_class_ttft_slo():
    # factor 0.3: short threshold 0.3 s, long 3 s; queue delays 0.1, 0.5 (short), 0 (long),
    # 0.25 (short) -> only r1 starved
    # and r2 (long) is delayed to 2.0 s: below its 3 s threshold, above the short one.
    df = four_requests()
    df.loc[2, "first_scheduled_s"] = 4.0
    s = summarize(df, {}, None, MetricsConfig(starvation_factor=0.3))
    assert s["classes"]["all"]["starvation"]["starved"] == 1
    assert s["classes"]["short"]["starvation"]["starved"] == 1
    assert s["classes"]["long"]["starvation"]["starved"] == 0
    assert s["classes"]["long"]["starvation"]["max_queueing_delay_s"] == approx(2.0)
    s = summarize(df, {}, None, MetricsConfig(starvation_factor=0.1))  # long threshold 1 s
    assert s["classes"]["long"]["starvation"]["starved"] == 1


def test_itl_histograms_per_class_and_merged_all():
    hs, hl = LogHistogram(), LogHistogram()
    hs.add(np.array([0.01, 0.02, 0.03, 0.04]))
    hl.add(np.array([0.5, 0.6]))
    s = summarize(four_requests(), {"short": hs, "long": hl}, None, MetricsConfig())
    assert s["classes"]["short"]["itl_s"]["count"] == 4
    assert s["classes"]["short"]["itl_s"]["p99"] == hs.percentile(99)
    # the mean comes from the records, exactly: gaps telescope to finish - first_token
    # long: (12 - 7) / 50 gaps; all: (1.5 + 0.5 + 5) / (20 + 10 + 50)
    assert s["classes"]["long"]["itl_s"]["mean"] == pytest.approx(0.1)
    a = s["classes"]["all"]["itl_s"]
    assert a["count"] == 6 and a["max"] == 0.6
    assert a["mean"] == pytest.approx(7.0 / 80)
    assert s["classes"]["all"]["itl_s"]["p50"] == pytest.approx(0.03, rel=0.003)
    # no histograms -> empty stats
    s0 = summarize(four_requests(), {}, None, MetricsConfig())
    assert s0["classes"]["all"]["itl_s"]["count"] == 0
    assert s0["classes"]["all"]["itl_s"]["p99"] is None


def test_length_class_threshold_is_inclusive():
    cfg = MetricsConfig()
    got = length_class(np.array([1, 8191, 8192, 8193]), cfg)
    assert got.tolist() == ["short", "short", "long", "long"]
    assert length_class(np.array([99, 100]), MetricsConfig(long_prompt_tokens=100)).tolist() == [
        "short", "long"]
    s = summarize(four_requests(), {}, None, MetricsConfig(long_prompt_tokens=100_000))
    assert set(s["classes"]) == {"all", "short"}  # absent classes are not reported


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


def _plain(x):
    if isinstance(x, dict):
        return all(type(k) is str and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    if type(x) is float:
        return math.isfinite(x)
    return x is None or type(x) in (int, str, bool)


def test_summary_is_plain_and_deterministic():
    hs = LogHistogram()
    hs.add(np.random.default_rng(1).lognormal(-3, 1, 1000))
    rows = four_requests().to_dict("records")
    rows.append(_record(request_id=9, arrival_s=1.0, status="rejected", reject_reason="x"))
    s1 = summarize(_frame(rows), {"short": hs}, None, MetricsConfig())
    s2 = summarize(_frame(rows), {"short": hs.copy()}, None, MetricsConfig())
    assert _plain(s1)  # plain Python types only, NaN already turned into None
    j1, j2 = summary_to_json(s1), summary_to_json(s2)
    assert j1 == j2
    assert json.loads(j1) == s1
    assert j1 == json.dumps(json.loads(j1), sort_keys=True, indent=2)


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


def test_bad_records_raise():
    with pytest.raises(ConfigError, match="records columns"):
        summarize(four_requests().drop(columns=["max_itl_s"]), {}, None, MetricsConfig())
    df = four_requests()
    df.loc[1, "status"] = "running"
    with pytest.raises(ConfigError, match="status"):
        summarize(df, {}, None, MetricsConfig())
    df = four_requests()
    df.loc[2, "first_token_s"] = 1.0  # before arrival 2.0
    with pytest.raises(ConfigError, match="request_id=2"):
        summarize(df, {}, None, MetricsConfig())


def test_bytes_moved_follows_the_records_byte_columns():
    # a user-defined CXL tier adds a column pair after the standard five: r0 (short) wrote 300
    # bytes to it and read 100 back, r2 (long) wrote 40; the standard columns are as in
    # four_requests (all: 2012 bytes, long: 12)
    df = four_requests()
    df["bytes_hbm_to_cxl"] = [300, 0, 40, 0]
    df["bytes_cxl_to_hbm"] = [100, 0, 0, 0]
    s = summarize(df, {}, None, MetricsConfig())
    a = s["classes"]["all"]["bytes_moved"]
    assert list(a) == ["hbm_to_dram", "dram_to_hbm", "hbm_to_nvme", "nvme_to_hbm", "hbm_to_pnm",
                       "hbm_to_cxl", "cxl_to_hbm", "total"]
    assert a["hbm_to_cxl"] == 340 and a["cxl_to_hbm"] == 100
    assert a["total"] == 2012 + 440
    assert s["classes"]["short"]["bytes_moved"]["hbm_to_cxl"] == 300
    assert s["classes"]["short"]["bytes_moved"]["total"] == 2000 + 400
    assert s["classes"]["long"]["bytes_moved"] == {
        "hbm_to_dram": 0, "dram_to_hbm": 0, "hbm_to_nvme": 7, "nvme_to_hbm": 5, "hbm_to_pnm": 0,
        "hbm_to_cxl": 40, "cxl_to_hbm": 0, "total": 52}
    # without the extra columns the summary is what it was
    base = summarize(four_requests(), {}, None, MetricsConfig())
    assert "hbm_to_cxl" not in base["classes"]["all"]["bytes_moved"]


def test_standard_byte_columns_stay_required_and_extra_ones_are_named_by_link():
    with pytest.raises(ConfigError, match="records columns"):
        summarize(four_requests().drop(columns=["bytes_hbm_to_pnm"]), {}, None, MetricsConfig())
    for bad in ("bytes_total", "bytes_hbm", "bytes_HBM_to_cxl"):
        df = four_requests()
        df[bad] = 0
        with pytest.raises(ConfigError, match="records byte columns"):
            summarize(df, {}, None, MetricsConfig())


def test_empty_records():
    s = summarize(_frame([]), {}, None, MetricsConfig())
    assert s["duration_s"] is None
    a = s["classes"]["all"]
    assert a["counts"]["arrived"] == 0
    assert a["slo"]["attainment"] is None and a["goodput_rps"] is None
    assert set(s["classes"]) == {"all"}


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs, field", [
    ({"long_prompt_tokens": 0}, "long_prompt_tokens"),
    ({"long_prompt_tokens": 1.5}, "long_prompt_tokens"),
    ({"long_prompt_tokens": True}, "long_prompt_tokens"),
    ({"slos": {"short": SLO(1.0, 0.1)}}, "slos"),
    ({"slos": {"short": SLO(1.0, 0.1), "long": 3.0}}, "slos"),
    ({"slos": {"short": SLO(1.0, 0.1), "long": {"ttft_s": 1.0, "tpot": 0.1}}}, "slos"),
    ({"percentiles": ()}, "percentiles"),
    ({"percentiles": (0, 50)}, "percentiles"),
    ({"percentiles": (50, 150)}, "percentiles"),
    ({"percentiles": (50, 50)}, "percentiles"),
    ({"starvation_factor": 0.0}, "starvation_factor"),
    ({"starvation_factor": float("nan")}, "starvation_factor"),
])
def test_bad_metrics_config_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MetricsConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"ttft_s": 0.0, "tpot_s": 0.1}, "ttft_s"),
    ({"ttft_s": 1.0, "tpot_s": -0.1}, "tpot_s"),
    ({"ttft_s": 1.0, "tpot_s": 0.1, "e2e_s": float("nan")}, "e2e_s"),
    ({"ttft_s": float("inf"), "tpot_s": 0.1}, "ttft_s"),
])
def test_bad_slo_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SLO(**kwargs)


def test_config_frozen_hashable_picklable_and_defaults():
    cfg = MetricsConfig()
    assert cfg.long_prompt_tokens == 8192 and cfg.percentiles == (50, 90, 99)
    assert cfg.slos["short"] == SLO(ttft_s=1.0, tpot_s=0.1)
    assert cfg.slos["long"] == SLO(ttft_s=10.0, tpot_s=0.2)
    same = MetricsConfig(slos={"long": {"ttft_s": 10.0, "tpot_s": 0.2},
                               "short": SLO(1.0, 0.1)})
    assert same == cfg and hash(same) == hash(cfg)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.starvation_factor = 2.0  # type: ignore[misc]
    assert MetricsConfig(percentiles=(99.9, 50)).percentiles == (50, 99.9)
    s = summarize(four_requests(), {}, None, MetricsConfig(percentiles=(99.9, 50)))
    assert set(s["classes"]["all"]["ttft_s"]) == {"count", "mean", "max", "p50", "p99.9"}


# ------------------------------------------------------------------------------ LogHistogram


def test_histogram_bins_are_narrow_enough():
    e = LogHistogram.EDGES
    assert e[0] == pytest.approx(1e-6) and e[-1] == pytest.approx(1e4)
    assert np.max(e[1:] / e[:-1]) <= 1.005


def test_histogram_percentiles_match_numpy_within_half_percent():
    # Tolerance: 0.5 % relative. Bin edges differ by <= 0.5 % and the answer is the geometric
    # bin midpoint (<= 0.25 % from any value in the bin); with 100k samples the rank
    # convention (inverted CDF vs numpy's linear interpolation) moves it by far less.
    x = np.random.default_rng(0).lognormal(mean=-3.0, sigma=1.0, size=100_000)
    h = LogHistogram()
    h.add(x)
    assert h.count == x.size
    assert h.mean == pytest.approx(x.mean(), rel=1e-12)
    assert h.min == x.min() and h.max == x.max()
    for q in (1, 10, 25, 50, 75, 90, 99, 99.9):
        exact = np.percentile(x, q)
        assert abs(h.percentile(q) - exact) / exact <= 0.005, q
    assert h.percentile(0) == x.min() and h.percentile(100) == x.max()


def test_histogram_weights_equal_repeated_adds():
    vals = np.array([0.01, 0.5, 3.0, 0.01])
    w = np.array([3, 0, 5, 2])
    hw = LogHistogram()
    hw.add(vals, w)
    hr = LogHistogram()
    for v, k in zip(vals, w):
        for _ in range(k):
            hr.add(float(v))
    ha = LogHistogram()
    for v, k in zip(vals, w):
        ha.add_repeated(float(v), int(k))
    for h in (hr, ha):
        assert np.array_equal(hw.counts, h.counts)
        assert hw.count == h.count == 10
        assert hw.min == h.min == 0.01 and hw.max == h.max == 3.0  # 0.5 had weight 0
        assert hw.mean == pytest.approx(h.mean, rel=1e-12)
        assert hw.percentile(50) == h.percentile(50)


def test_histogram_small_and_large_batches_agree():
    x = np.random.default_rng(2).lognormal(-2, 2, 2000)  # > small-batch cutoff
    big = LogHistogram()
    big.add(x)
    small = LogHistogram()
    for chunk in np.array_split(x, 200):
        small.add(chunk)
    assert np.array_equal(big.counts, small.counts)


def test_histogram_merge_equals_adding_both():
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(-3, 1, 5000), rng.lognormal(0, 1, 300)
    ha, hb, hab = LogHistogram(), LogHistogram(), LogHistogram()
    ha.add(a)
    hb.add(b)
    hab.add(np.concatenate([a, b]))
    m = ha.copy().merge(hb)
    assert np.array_equal(m.counts, hab.counts)
    assert (m.count, m.min, m.max) == (hab.count, hab.min, hab.max)
    assert m.mean == pytest.approx(hab.mean, rel=1e-12)
    for q in (50, 90, 99):
        assert m.percentile(q) == hab.percentile(q)
    assert ha.count == 5000  # the copy was merged, not ha


def test_histogram_empty_and_edges():
    h = LogHistogram()
    assert h.count == 0
    assert math.isnan(h.mean) and math.isnan(h.percentile(50)) and math.isnan(h.percentile(0))
    assert h.to_dict()["min_s"] is None
    h.add(np.array([0.0, 1e-7, 1e5]))
    assert h.counts[0] == 2 and h.counts[-1] == 1  # underflow to bin 0, overflow bin
    assert h.percentile(90) == 1e5  # overflow bin answers with the exact max
    assert h.percentile(0) == 0.0
    assert 0.0 <= h.percentile(50) <= 1.005e-6
    with pytest.raises(ConfigError, match="value"):
        h.add(np.array([0.1, -1.0]))
    with pytest.raises(ConfigError, match="value"):
        h.add(float("nan"))
    with pytest.raises(ConfigError, match="weight"):
        h.add(np.array([0.1]), np.array([-1]))
    with pytest.raises(ConfigError, match="q="):
        h.percentile(101)
    assert h.count == 3  # failed adds changed nothing


def test_histogram_to_dict_round_trip():
    h = LogHistogram()
    h.add(np.random.default_rng(4).lognormal(-3, 1, 1000))
    d = h.to_dict()
    json.dumps(d)
    r = LogHistogram.from_dict(json.loads(json.dumps(d)))
    assert np.array_equal(r.counts, h.counts)
    assert (r.count, r.sum, r.min, r.max) == (h.count, h.sum, h.min, h.max)


def test_histogram_bin_convention_and_geometric_midpoint():
    e = LogHistogram.EDGES
    k = 2000
    h = LogHistogram()
    h.add(e[k])  # bins are (e[i], e[i+1]]: an exact edge belongs to the bin below
    assert h.counts[k - 1] == 1
    h = LogHistogram()
    a = e[k] * 1.0001  # just above the lower edge of bin k
    h.add(np.array([a, 1.0]))
    # rank 1 lies in bin k: the answer is its geometric midpoint (inside [min, max])
    assert h.percentile(50) == pytest.approx(math.sqrt(e[k] * e[k + 1]), rel=1e-12)
    assert h.percentile(50) / a - 1 <= 0.0025


def test_histogram_batch_and_scalar_paths_agree_on_edges():
    # exact edges, values just around them, underflow and overflow: the large-batch (log10)
    # path, the small-batch (searchsorted) path and the scalar path must bin identically
    e = LogHistogram.EDGES
    vals = np.concatenate([e, np.nextafter(e, 0), np.nextafter(e, np.inf), [0.0, 1e-9, 2e4]])
    big = LogHistogram()
    big.add(vals)
    small = LogHistogram()
    for chunk in np.array_split(vals, 200):
        small.add(chunk)
    scalar = LogHistogram()
    for v in vals:
        scalar.add(float(v))
    ref = np.bincount(np.maximum(np.searchsorted(e, vals, side="left") - 1, 0),
                      minlength=LogHistogram.N_BINS + 1)
    assert np.array_equal(big.counts, ref)
    assert np.array_equal(small.counts, ref)
    assert np.array_equal(scalar.counts, ref)


def test_tiny_nonzero_values_do_not_print_as_zero():
    """One request meeting its SLO in ~an hour is a goodput of 0.00029 req/s, not 0.000."""
    from kvsched.envs.sim.metrics import _fmt
    from kvsched.experiments.compare import _fmt as compare_fmt

    assert _fmt(1 / 3504, 1.0, 3) == "0.00029"
    assert _fmt(0.0, 1.0, 3) == "0.000" and _fmt(2.5, 1.0, 3) == "2.500" and _fmt(None) == "-"
    assert compare_fmt(1 / 3504, 0.0, 1.0, 2, True) == "0.00029"
    assert compare_fmt(1 / 3504, 1e-5, 1.0, 2, True) == "0.00029±1e-05"
    assert compare_fmt(3.0, 0.5, 1.0, 2, True) == "3.00±0.50" and compare_fmt(0.0, 0.0, 1.0, 2, True) == "0.00"
