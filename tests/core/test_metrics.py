"""summarize (envs/sim/metrics.py): the run summary of a records frame.

The 4-request fixture (``simkit.four_requests``) is computed by hand in its comments; every
expected number below comes from those comments, not from running the code.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import SLO, LogHistogram, MetricsConfig, summarize, summary_to_json
from simkit import approx, four_requests
from simkit import frame as _frame
from simkit import record as _record


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


def test_empty_records():
    s = summarize(_frame([]), {}, None, MetricsConfig())
    assert s["duration_s"] is None
    a = s["classes"]["all"]
    assert a["counts"]["arrived"] == 0
    assert a["slo"]["attainment"] is None and a["goodput_rps"] is None
    assert set(s["classes"]) == {"all"}


def test_summary_json_is_sorted_and_indented_and_rejects_nan() -> None:
    text = summary_to_json({"b": 1, "a": {"d": None, "c": 0.5}})
    assert text == json.dumps({"a": {"c": 0.5, "d": None}, "b": 1}, sort_keys=True, indent=2)
    with pytest.raises(ValueError):
        summary_to_json({"a": float("nan")})
