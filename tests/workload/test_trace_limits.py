"""Trace files under hostile or careless input: decompression bombs and huge files (capped,
the cap named with its setting), duplicate columns and keys, nulls, implausible timestamps --
each a one-line TraceFormatError; and a loaded Workload is read-only."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError, TraceFormatError
from kvsched.envs.sim.request import MAX_ARRIVAL_S, Request, Workload
from kvsched.envs.workload.traces import load_generic, load_trace, scale_rate

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:17:03.9799600,10,5\n"


def _mooncake(ts_ms: float, **extra) -> str:
    return json.dumps({"timestamp": ts_ms, "input_length": 10, "output_length": 5, "hash_ids": [1], **extra})


def test_a_gzip_bomb_stops_at_the_byte_cap_naming_it_and_its_variable(tmp_path, monkeypatch):
    p = tmp_path / "t.csv.gz"
    p.write_bytes(gzip.compress((AZURE_HEADER + ROW * 20_000).encode()))  # ~660 kB from a few kB
    monkeypatch.setenv("KVSCHED_MAX_TRACE_BYTES", "100000")
    with pytest.raises(TraceFormatError, match=r"more than 100,000 bytes \(uncompressed\).*KVSCHED_MAX_TRACE_BYTES"):
        load_trace(p)
    monkeypatch.setenv("KVSCHED_MAX_TRACE_BYTES", "1000000")  # raised: it loads
    assert len(load_trace(p)) == 20_000


def test_a_plain_file_beyond_the_line_cap_is_refused_naming_the_variable(tmp_path, monkeypatch):
    p = tmp_path / "t.csv"
    p.write_text(AZURE_HEADER + ROW * 50)
    monkeypatch.setenv("KVSCHED_MAX_TRACE_ROWS", "20")
    with pytest.raises(TraceFormatError, match=r"51 lines, more than the limit of 20.*KVSCHED_MAX_TRACE_ROWS"):
        load_trace(p)
    monkeypatch.setenv("KVSCHED_MAX_TRACE_ROWS", "ten")
    with pytest.raises(ConfigError, match="KVSCHED_MAX_TRACE_ROWS='ten' is not allowed: expected a positive integer"):
        load_trace(p)


def test_a_csv_column_named_twice_is_refused_naming_it(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n2023-11-16 18:17:03.9799600,10,5,20\n")
    with pytest.raises(TraceFormatError, match=r"line 1 \(header\): column 'ContextTokens' appears twice"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match="appears twice"):
        load_generic(p, {"arrival_s": "TIMESTAMP", "prompt_tokens": "ContextTokens",
                         "output_tokens": "GeneratedTokens"}, time_unit="datetime")


def test_a_jsonl_key_given_twice_on_a_line_is_refused(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake(0) + "\n" + '{"timestamp": 1, "timestamp": 2, "input_length": 10, "output_length": 5, '
                 '"hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r"line 2: key 'timestamp' appears twice in one JSON object"):
        load_trace(p)


def test_null_hash_ids_are_said_to_be_null_not_missing(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": None}) + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert "'hash_ids' is null" in str(e.value) and "missing" not in str(e.value)
    assert "a JSON list of integer hash ids" in str(e.value)


def test_deeply_nested_json_is_a_trace_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceFormatError, match="line 1: malformed JSON \\(nested too deeply\\)"):
        load_trace(p)


@pytest.mark.parametrize("ts_ms", [1e300, 1e13])
def test_implausible_arrival_timestamps_are_refused_with_the_bound(tmp_path, ts_ms):
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake(0) + "\n" + _mooncake(ts_ms) + "\n")
    with pytest.raises(TraceFormatError, match=r"line 2: field 'arrival_s' \(column 'timestamp'\).*at most 1e\+09 s"):
        load_trace(p)


def test_an_arrival_at_the_bound_loads_and_scaling_past_it_is_refused(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake(0) + "\n" + _mooncake(MAX_ARRIVAL_S * 1000) + "\n")
    w = load_trace(p)
    assert w.arrival_s[-1] == MAX_ARRIVAL_S
    with pytest.raises(ConfigError, match="at most 1e\\+09 s"):
        scale_rate(w, 0.5)
    with pytest.raises(ConfigError,
                       match=r"arrival_s=2000000000.0 is not allowed: expected a number of seconds in \[0, 1e\+09\]"):
        Request(0, 2e9, 10, 5)


def test_a_loaded_workloads_columns_are_read_only_and_the_callers_arrays_stay_its_own(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(AZURE_HEADER + ROW * 3)
    w = load_trace(p)
    for name in ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "session_id", "slo_class",
                 "hash_offsets", "hashes", "priority", "n"):
        col = getattr(w, name)
        assert not col.flags.writeable, name
        if len(col):
            with pytest.raises(ValueError, match="read-only"):
                col[0] = col[0]
    arrival = np.array([0.0, 1.0])
    mine = Workload(name="x", request_id=np.arange(2), arrival_s=arrival, prompt_tokens=np.ones(2, np.int64),
                    output_tokens=np.ones(2, np.int64), session_id=np.full(2, -1), slo_class=np.zeros(2, np.int16),
                    hash_offsets=np.zeros(3, np.int64), hashes=np.zeros(0, np.int64))
    arrival[1] = 5.0  # the caller's array is still writable and is not the workload's
    assert arrival.flags.writeable and mine.arrival_s[1] == 1.0
    shared = mine.with_arrivals(mine.arrival_s, "same")
    assert shared.request_id is mine.request_id  # read-only columns are shared, not copied


def test_an_empty_trace_name_is_refused():
    with pytest.raises(ConfigError, match="an empty name or path"):
        load_trace("")
