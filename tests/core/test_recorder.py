"""The recorder (envs/sim/recorder.py): one row per request with the client's times, byte columns
of extra tiers, length classes, and inter-token gaps binned per class."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.sim.metrics import RECORD_COLUMNS, MetricsConfig
from kvsched.envs.sim.recorder import Recorder
from kvsched.envs.sim.request import FINISHED, REJECTED, Request, RequestState

STANDARD = ["hbm", "dram", "nvme", "pnm"]


def finished(rid=0, first=1.0, finish=3.0, generated=5, prompt=100, tier_bytes=None):
    st = RequestState(Request(rid, 0.5, prompt, generated, slo_class="gold"), 16, 0)
    st.status = FINISHED
    st.first_scheduled_s, st.first_token_s, st.finish_s, st.generated = 0.75, first, finish, generated
    st.tier_bytes = tier_bytes
    return st


def test_a_record_row_has_every_column_in_order():
    rec = Recorder(MetricsConfig())
    rec.register_instance(0, STANDARD, (10, 0, 0, 0))
    rec.record(finished(tier_bytes={"hbm_to_dram": 7, "dram_to_hbm": 7}))
    df = rec.records_frame()
    assert list(df.columns) == list(RECORD_COLUMNS)
    r = df.iloc[0]
    assert (r.request_id, r.arrival_s, r.slo_class, r.length_class, r.status) == (0, 0.5, "gold", "short", "finished")
    assert (r.first_scheduled_s, r.first_token_s, r.finish_s, r.generated_tokens) == (0.75, 1.0, 3.0, 5)
    assert (r.bytes_hbm_to_dram, r.bytes_dram_to_hbm, r.bytes_hbm_to_nvme) == (7, 7, 0)


def test_rows_come_out_sorted_by_request_id_and_rejections_keep_nan_times():
    rec = Recorder(MetricsConfig(), output_overhead_s=0.01)
    rec.register_instance(0, STANDARD, (10, 0, 0, 0))
    rej = RequestState(Request(3, 0.0, 10, 2), 16, 0)
    rej.status, rej.reject_reason = REJECTED, "exceeds_max_model_len"
    rec.record(rej)
    rec.record(finished(rid=1))
    df = rec.records_frame()
    assert df["request_id"].tolist() == [1, 3]
    assert df.loc[1, "status"] == "rejected" and df.loc[1, "reject_reason"] == "exceeds_max_model_len"
    assert math.isnan(df.loc[1, "first_token_s"]) and math.isnan(df.loc[1, "finish_s"])


def test_extra_tiers_add_byte_columns_in_registration_order():
    rec = Recorder(MetricsConfig())
    rec.register_instance(0, ["hbm", "dram", "nvme", "cxl", "pnm"], (10, 0, 0, 5, 0))
    rec.register_instance(1, ["hbm", "dram", "nvme", "cxl", "ssd2", "pnm"], (10, 0, 0, 5, 5, 0))
    assert rec.extra_bytes == ["hbm_to_cxl", "cxl_to_hbm", "hbm_to_ssd2", "ssd2_to_hbm"]
    rec.record(finished(tier_bytes={"hbm_to_cxl": 5, "hbm_to_dram": 2}))
    df = rec.records_frame()
    assert list(df.columns)[-4:] == ["bytes_hbm_to_cxl", "bytes_cxl_to_hbm", "bytes_hbm_to_ssd2", "bytes_ssd2_to_hbm"]
    assert (df.loc[0, "bytes_hbm_to_cxl"], df.loc[0, "bytes_cxl_to_hbm"], df.loc[0, "bytes_hbm_to_dram"]) == (5, 0, 2)


def test_output_overhead_shifts_first_token_and_finish():
    rec = Recorder(MetricsConfig(), output_overhead_s=0.25)
    rec.register_instance(0, STANDARD, (10, 0, 0, 0))
    rec.record(finished())
    r = rec.records_frame().iloc[0]
    assert (r.first_token_s, r.finish_s) == (1.25, 3.25)


def test_first_chunk_delay_adds_mean_gaps_to_the_first_token_capped_at_the_finish():
    rec = Recorder(MetricsConfig(), first_chunk_delay_tokens=1.0)
    rec.register_instance(0, STANDARD, (10, 0, 0, 0))
    rec.record(finished(rid=0, first=1.0, finish=3.0, generated=5))  # mean gap 0.5 s
    rec.record(finished(rid=1, first=1.0, finish=1.2, generated=2))  # one gap of 0.2 s
    rec.record(finished(rid=2, first=1.0, finish=1.0, generated=1))  # a single token: no gap
    late = Recorder(MetricsConfig(), first_chunk_delay_tokens=10.0)
    late.register_instance(0, STANDARD, (10, 0, 0, 0))
    late.record(finished(rid=0, first=1.0, finish=3.0, generated=5))
    assert rec.records_frame()["first_token_s"].tolist() == [1.5, 1.2, 1.0]
    assert late.records_frame()["first_token_s"].tolist() == [3.0]  # never after the last token


def test_length_class_is_long_from_the_threshold_on():
    rec = Recorder(MetricsConfig(long_prompt_tokens=100))
    assert (rec.length_class(99), rec.length_class(100)) == (0, 1)


def test_itl_gaps_go_to_their_class_and_shared_gaps_count_once_per_request():
    rec = Recorder(MetricsConfig())
    rec.add_itl(np.array([0.1, 0.2, 0.3]), np.array([0, 1, 1]), np.array([0.05, 0.06]))
    rec.add_itl_by_class(([0.01], []), None)
    itl = rec.itl
    assert itl["short"].count == 1 + 2 + 1 and itl["long"].count == 2 + 2 * 2
    assert itl["long"].max == 0.3 and itl["short"].min == 0.01
    assert itl["long"].sum == pytest.approx(0.2 + 0.3 + 2 * (0.05 + 0.06))


def test_buffered_itl_samples_equal_direct_histogram_adds():
    from kvsched.envs.sim.histogram import LogHistogram

    rec = Recorder(MetricsConfig())
    direct = LogHistogram()
    rng = np.random.default_rng(0)
    for _ in range(40):  # more than one flush of ~64k samples
        gaps = rng.lognormal(-4, 1, 2000).tolist()
        rec.add_itl_by_class((gaps, []), None)
        direct.add(np.array(gaps))
    assert np.array_equal(rec.itl["short"].counts, direct.counts) and rec.itl["short"].count == 80_000
