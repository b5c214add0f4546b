"""The records frame (envs/sim/records.py): length classes, byte columns and the checks a frame
passes before it is summarised."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import MetricsConfig, length_class, summarize
from kvsched.envs.sim.records import BYTE_COLUMNS, RECORD_COLUMNS, byte_columns, check_records
from simkit import four_requests


def test_length_class_threshold_is_inclusive():
    cfg = MetricsConfig()
    got = length_class(np.array([1, 8191, 8192, 8193]), cfg)
    assert got.tolist() == ["short", "short", "long", "long"]
    assert length_class(np.array([99, 100]), MetricsConfig(long_prompt_tokens=100)).tolist() == [
        "short", "long"]
    s = summarize(four_requests(), {}, None, MetricsConfig(long_prompt_tokens=100_000))
    assert set(s["classes"]) == {"all", "short"}  # absent classes are not reported


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


def test_standard_byte_columns_stay_required_and_extra_ones_are_named_by_link():
    with pytest.raises(ConfigError, match="records columns"):
        summarize(four_requests().drop(columns=["bytes_hbm_to_pnm"]), {}, None, MetricsConfig())
    for bad in ("bytes_total", "bytes_hbm", "bytes_HBM_to_cxl"):
        df = four_requests()
        df[bad] = 0
        with pytest.raises(ConfigError, match="records byte columns"):
            summarize(df, {}, None, MetricsConfig())


def test_byte_columns_are_every_bytes_column_in_frame_order() -> None:
    df = four_requests()
    df["bytes_hbm_to_cxl"] = 0
    assert byte_columns(df) == list(BYTE_COLUMNS) + ["bytes_hbm_to_cxl"]
    assert RECORD_COLUMNS[-len(BYTE_COLUMNS):] == BYTE_COLUMNS


def test_check_records_refuses_a_non_frame_and_unordered_timestamps() -> None:
    with pytest.raises(ConfigError, match="expected a pandas DataFrame"):
        check_records([{"request_id": 0}])
    check_records(four_requests())
    df = four_requests()
    df.loc[0, "finish_s"] = 0.4  # before its first token (0.5)
    with pytest.raises(ConfigError, match="request_id=0"):
        check_records(df)
    df = four_requests()
    df.loc[3, "generated_tokens"] = 0  # finished without a token
    with pytest.raises(ConfigError, match="request_id=3"):
        check_records(df)
    rejected = four_requests()
    rejected.loc[1, ["status", "first_token_s", "finish_s"]] = ["rejected", np.nan, np.nan]
    check_records(rejected)  # a rejected request has no timestamps to order
    assert isinstance(rejected, pd.DataFrame)
