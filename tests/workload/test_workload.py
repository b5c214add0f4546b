"""Tests of kvsched.envs.workload: trace loaders, bundled registry, windows, synthetic generator.

Expected numbers for the real traces come from ``shared/traces/README.md`` (row counts, sha256
of the uncompressed content, spans, means) and from the first lines of the files themselves
(``zcat FILE | head``), not from running the loaders. Fixture files are tiny and written in
``tmp_path``; their expected values are worked out in the comments.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError, TraceFormatError
from kvsched.envs.workload import synthetic as syn
from kvsched.envs.workload import traces
from kvsched.envs.workload import traces as tr

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "envs" / "workload" / "data"

# sha256 of the uncompressed files, copied from shared/traces/README.md
SHA_AZURE_CONV = "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8"
SHA_AZURE_CODE = "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6"
SHA_MC_CONV = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
SHA_MC_SYN = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


def _shared_traces() -> Path | None:
    env = os.environ.get("KVSCHED_SHARED")
    cands = [Path(env) / "traces", Path(env)] if env else []
    cands.append(REPO.parent / "shared" / "traces")
    for c in cands:
        if (c / "README.md").is_file():
            return c
    return None


SHARED = _shared_traces()
needs_shared = pytest.mark.skipif(
    SHARED is None, reason="shared trace directory not found: set KVSCHED_SHARED to the folder "
    "holding traces/ (or traces/ itself), or place it at ../shared/traces next to the repo")


# =============================================================================================
# Real traces
# =============================================================================================
@pytest.fixture(scope="module")
def azure_conv():
    return tr.load_trace("azure-conv-2023")


@pytest.fixture(scope="module")
def mooncake_conv():
    return tr.load_trace("mooncake-conversation")


def test_bundled_azure_conv(azure_conv):
    w = azure_conv
    assert len(w) == 19_366
    assert w.name == "azure-conv-2023"
    assert w.source_sha256 == SHA_AZURE_CONV
    # README: span 3,502 s, mean input 1,155 and output 211 (rounded)
    assert w.arrival_s[0] == 0.0
    assert abs(w.arrival_s[-1] - 3502) < 1
    assert abs(w.prompt_tokens.mean() - 1155) < 1
    assert abs(w.output_tokens.mean() - 211) < 1
    assert w.prompt_tokens.max() == 14_050
    # first rows: 18:15:46.6805900,374,44 and 18:15:50.9951690,396,109
    assert (w.prompt_tokens[0], w.output_tokens[0]) == (374, 44)
    assert w.arrival_s[1] == pytest.approx(50.995169 - 46.680590, abs=1e-6)
    assert list(w.request_id[:3]) == [0, 1, 2]
    assert len(w.hashes) == 0 and w.hash_block_tokens == 0
    assert np.all(w.session_id == -1)
    assert not any(n.startswith("sorted") for n in w.notes)  # upstream file is sorted


def test_bundled_mooncake_conv(mooncake_conv):
    w = mooncake_conv
    assert len(w) == 12_031
    assert w.name == "mooncake-conversation"
    assert w.source_sha256 == SHA_MC_CONV
    assert w.hash_block_tokens == 512
    assert len(w.hashes) == 288_500 and w.hashes.dtype == np.int64
    assert len(np.unique(w.hashes)) == 182_790  # README: unique blocks
    assert abs(w.arrival_s[-1] - 3537) < 1
    assert abs(w.prompt_tokens.mean() - 12_035) < 1
    assert abs(w.output_tokens.mean() - 343) < 1
    # first two lines of the file
    r0, r1 = w.request(0), w.request(1)
    assert (r0.prompt_tokens, r0.output_tokens, r0.arrival_s) == (6758, 500, 0.0)
    assert r0.prefix_hashes == tuple(range(14))
    assert r1.prefix_hashes[:3] == (0, 14, 15) and len(r1.prefix_hashes) == 15
    # every row: len(hash_ids) == ceil(input/512)
    lens = np.diff(w.hash_offsets)
    assert np.array_equal(lens, -(-w.prompt_tokens // 512))
    # README reuse ratio: fraction of block refs whose id appeared in an earlier request
    seen, reused = set(), 0
    for i in range(len(w)):
        hs = w.hashes[w.hash_offsets[i]:w.hash_offsets[i + 1]].tolist()
        reused += sum(h in seen for h in hs)
        seen.update(hs)
    assert reused / len(w.hashes) == pytest.approx(0.366, abs=0.001)


def test_sha256_is_of_uncompressed_content():
    for fname, sha in (("AzureLLMInferenceTrace_conv.csv.gz", SHA_AZURE_CONV),
                       ("mooncake_conversation_trace.jsonl.gz", SHA_MC_CONV)):
        raw = gzip.decompress((DATA / fname).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == sha
        assert tr.BUNDLED_SHA256[next(k for k, v in tr.BUNDLED_TRACES.items()
                                      if v.filename == fname)] == sha


def test_load_trace_by_path_detects_format(azure_conv, tmp_path):
    w = tr.load_trace(DATA / "AzureLLMInferenceTrace_conv.csv.gz")
    assert w.content_sha256() == azure_conv.content_sha256()
    assert w.name == "AzureLLMInferenceTrace_conv"
    # uncompressed copy: same content hash, same sha256
    plain = tmp_path / "conv.csv"
    plain.write_bytes(gzip.decompress((DATA / "AzureLLMInferenceTrace_conv.csv.gz").read_bytes()))
    w2 = tr.load_trace(str(plain))
    assert w2.source_sha256 == SHA_AZURE_CONV
    assert w2.content_sha256() == azure_conv.content_sha256()


@needs_shared
@pytest.mark.parametrize("fname,rows,sha,mean_in,mean_out,span", [
    ("AzureLLMInferenceTrace_code.csv.gz", 8_819, SHA_AZURE_CODE, 2_048, 27.9, 3_436),
    ("mooncake_synthetic_trace.jsonl.gz", 3_993, SHA_MC_SYN, 15_325, 149, 1_022),
    ("AzureLLMInferenceTrace_conv.csv.gz", 19_366, SHA_AZURE_CONV, 1_155, 211, 3_502),
    ("mooncake_conversation_trace.jsonl.gz", 12_031, SHA_MC_CONV, 12_035, 343, 3_537),
])
def test_shared_traces(fname, rows, sha, mean_in, mean_out, span):
    w = tr.load_trace(SHARED / fname)
    assert len(w) == rows
    assert w.source_sha256 == sha
    assert abs(w.prompt_tokens.mean() - mean_in) < 1
    assert abs(w.output_tokens.mean() - mean_out) < 0.5
    assert abs(w.arrival_s[-1] - w.arrival_s[0] - span) < 1


@needs_shared
def test_shared_mooncake_synthetic_block_refs():
    w = tr.load_trace(SHARED / "mooncake_synthetic_trace.jsonl.gz")
    assert len(w.hashes) == 121_877 and len(np.unique(w.hashes)) == 43_924


def test_list_traces_and_unknown_name():
    rows = tr.list_traces()
    assert [r["name"] for r in rows] == ["azure-conv-2023", "mooncake-conversation"]
    assert [r["default"] for r in rows] == ["yes", ""]
    assert tr.DEFAULT_TRACE == "azure-conv-2023"
    assert all(set(r) == {"name", "default", "file", "description", "attribution"} for r in rows)
    assert "CC-BY 4.0" in rows[0]["attribution"] and "Apache-2.0" in rows[1]["attribution"]
    with pytest.raises(ConfigError) as e:
        tr.load_trace("azure-conv-2024")
    assert "azure-conv-2023" in str(e.value) and "mooncake-conversation" in str(e.value)


def test_load_trace_rejects_unknown_format(tmp_path):
    p = tmp_path / "other.csv"
    p.write_text("time,in,out\n0,1,1\n")
    with pytest.raises(TraceFormatError, match="load_generic"):
        tr.load_trace(p)
    q = tmp_path / "other.jsonl"
    q.write_text('{"t": 0, "in": 1, "out": 1}\n')
    with pytest.raises(TraceFormatError, match="load_generic"):
        tr.load_trace(q)
    r = tmp_path / "trace.txt"
    r.write_text("x")
    with pytest.raises(TraceFormatError, match="load_generic"):
        tr.load_trace(r)


# =============================================================================================
# Fixtures and error messages
# =============================================================================================
AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _azure(tmp_path, rows: list[str], name="az.csv") -> Path:
    p = tmp_path / name
    p.write_text(AZ_HEADER + "".join(r + "\n" for r in rows))
    return p


def _ts(sec: float) -> str:
    return f"2023-11-16 18:00:{sec:010.7f}"  # e.g. 2023-11-16 18:00:05.5000000


def _mooncake(tmp_path, rows: list, name="mc.jsonl", gz=False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    p = tmp_path / (name + (".gz" if gz else ""))
    p.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return p


def _mc(ts, n_in, n_out, first_hash=0):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out,
            "hash_ids": list(range(first_hash, first_hash + math.ceil(n_in / 512)))}


def test_azure_fixture_values(tmp_path):
    p = _azure(tmp_path, [f"{_ts(1.25)},10,3", f"{_ts(2.0)},20,4"])
    w = tr.load_azure_csv(p)
    assert np.allclose(w.arrival_s, [0.0, 0.75])
    assert list(w.prompt_tokens) == [10, 20] and list(w.output_tokens) == [3, 4]
    assert w.source_sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert w.name == "az"


@pytest.mark.parametrize("row,field,value", [
    ("{ts},abc,3", "ContextTokens", "'abc'"),       # non-numeric
    ("{ts},12,-5", "GeneratedTokens", "'-5'"),      # negative
    ("{ts},0,5", "ContextTokens", "'0'"),           # zero
    ("{ts},nan,5", "ContextTokens", "'nan'"),       # NaN
    ("{ts},12.5,5", "ContextTokens", "'12.5'"),     # not an integer
    ("{ts},12,", "GeneratedTokens", "''"),          # empty cell
    ("yesterday noon,12,5", "TIMESTAMP", "'yesterday noon'"),  # unparsable timestamp
])
def test_azure_bad_row_names_file_line_field_value(tmp_path, row, field, value):
    # data rows on lines 2, 3, 4; the bad one is line 3
    p = _azure(tmp_path, [f"{_ts(1)},10,3", row.format(ts=_ts(2)), f"{_ts(3)},10,3"])
    with pytest.raises(TraceFormatError) as e:
        tr.load_azure_csv(p)
    msg = str(e.value)
    assert str(p) in msg and "line 3:" in msg and field in msg and value in msg
    assert "expected" in msg


def test_azure_missing_column_lists_expected_and_found(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,Output\n" + f"{_ts(1)},10,3\n")
    with pytest.raises(TraceFormatError) as e:
        tr.load_azure_csv(p)
    msg = str(e.value)
    assert "GeneratedTokens" in msg and "'Output'" in msg and str(p) in msg


def test_azure_ragged_row_and_empty_file(tmp_path):
    p = _azure(tmp_path, [f"{_ts(1)},10,3", f"{_ts(2)},10,3,7"])
    with pytest.raises(TraceFormatError, match="line 3"):
        tr.load_azure_csv(p)
    q = tmp_path / "empty.csv"
    q.write_text("")
    with pytest.raises(TraceFormatError, match="empty"):
        tr.load_azure_csv(q)
    r = tmp_path / "header_only.csv"
    r.write_text(AZ_HEADER)
    with pytest.raises(TraceFormatError, match="no requests"):
        tr.load_azure_csv(r)


def test_azure_unsorted_rows_are_sorted_with_note(tmp_path, caplog):
    # seconds 0, 10, 5, 3, 20, 10: rows 2 (5) and 3 (3) are below the running max 10 and row 5
    # (10) is below the running max 20 -> 3 rows; the stable sort keeps row 1 before row 5
    secs = [0, 10, 5, 3, 20, 10]
    p = _azure(tmp_path, [f"{_ts(s)},{100 + i},{1 + i}" for i, s in enumerate(secs)])
    with caplog.at_level(logging.WARNING, logger="kvsched.envs.workload.traces"):
        w = tr.load_azure_csv(p)
    assert list(w.arrival_s) == [0, 3, 5, 10, 10, 20]
    assert list(w.request_id) == [0, 3, 2, 1, 5, 4]
    assert list(w.prompt_tokens) == [100, 103, 102, 101, 105, 104]
    note = f"sorted: 3 rows were out of arrival order in {p}"
    assert any(n.startswith(note) for n in w.notes)
    assert any(note in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_sort_is_stable_with_many_ties(tmp_path):
    # 300 rows with arrivals (7*i) % 5 s: ties must keep file order (request_id increasing)
    p = tmp_path / "ties.csv"
    p.write_text("t,n,m\n" + "".join(f"{(7 * i) % 5},{i + 1},1\n" for i in range(300)))
    w = tr.load_generic(p, {"arrival_s": "t", "prompt_tokens": "n", "output_tokens": "m"})
    assert list(w.request_id) == sorted(range(300), key=lambda i: ((7 * i) % 5, i))
    assert np.array_equal(w.prompt_tokens, w.request_id + 1)


def test_blank_lines_are_noted_not_silent(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text(AZ_HEADER + f"{_ts(1)},10,3\n\n{_ts(2)},11,3\n")
    w = tr.load_azure_csv(p)
    assert len(w) == 2
    assert any("skipped 1 empty line" in n and "lines 3" in n for n in w.notes)
    q = _mooncake(tmp_path, [_mc(0, 10, 1), "", _mc(5, 10, 1)])
    w = tr.load_mooncake_jsonl(q)
    assert len(w) == 2 and any("skipped 1 empty line" in n and "lines 2" in n for n in w.notes)


def test_mooncake_fixture_values_gz(tmp_path):
    rows = [_mc(0, 600, 7, 0), _mc(1500, 1024, 8, 10), _mc(2500, 1, 9, 20)]
    p = _mooncake(tmp_path, rows, gz=True)
    w = tr.load_mooncake_jsonl(p)
    assert np.allclose(w.arrival_s, [0, 1.5, 2.5])
    assert [r.prefix_hashes for r in w] == [(0, 1), (10, 11), (20,)]
    assert w.hash_block_tokens == 512
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    assert w.source_sha256 == hashlib.sha256(text).hexdigest()  # of the uncompressed bytes
    assert w.name == "mc"


@pytest.mark.parametrize("line2,needle", [
    ('{"timestamp": 1, "input_length": 5', "malformed JSON"),
    ('[1, 2, 3]', "JSON object"),
    ('{"timestamp": 1, "input_length": 5, "hash_ids": [0]}', "'output_length' is missing"),
    ('{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}', "-5"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 0, "hash_ids": [0]}', "output_length"),
    ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "nan"),
    ('{"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "-3"),
    ('{"timestamp": "1", "input_length": 5, "output_length": 1, "hash_ids": [0]}', "'1'"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [0.5]}', "0.5"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 7}', "hash_ids"),
])
def test_mooncake_bad_line_names_file_and_line(tmp_path, line2, needle):
    p = _mooncake(tmp_path, [_mc(0, 10, 1), line2, _mc(5, 10, 1)])
    with pytest.raises(TraceFormatError) as e:
        tr.load_mooncake_jsonl(p)
    msg = str(e.value)
    assert str(p) in msg and "line 2:" in msg and needle in msg


def test_mooncake_hash_length_mismatch(tmp_path):
    bad = {"timestamp": 10, "input_length": 1025, "output_length": 3, "hash_ids": [1, 2]}
    p = _mooncake(tmp_path, [_mc(0, 10, 1), _mc(5, 10, 1), bad])
    with pytest.raises(TraceFormatError) as e:
        tr.load_mooncake_jsonl(p)
    msg = str(e.value)
    # ceil(1025/512) = 3 ids needed, 2 given, on line 3
    assert str(p) in msg and "line 3:" in msg and "hash_ids" in msg and "= 3 ids" in msg


def test_mooncake_unsorted_moves_hashes_with_rows(tmp_path, caplog):
    rows = [_mc(3000, 600, 1, 100), _mc(1000, 1100, 2, 200), _mc(2000, 10, 3, 300)]
    p = _mooncake(tmp_path, rows)
    with caplog.at_level(logging.WARNING):
        w = tr.load_mooncake_jsonl(p)
    assert list(w.arrival_s) == [1.0, 2.0, 3.0]
    assert list(w.request_id) == [1, 2, 0]
    assert [r.prefix_hashes for r in w] == [(200, 201, 202), (300,), (100, 101)]
    assert [r.output_tokens for r in w] == [2, 3, 1]
    assert any(n.startswith(f"sorted: 2 rows were out of arrival order in {p}") for n in w.notes)
    assert any("sorted: 2 rows" in r.getMessage() for r in caplog.records)


# =============================================================================================
# Generic loader
# =============================================================================================
def test_generic_csv_mapping_ms_sessions_classes_hashes(tmp_path):
    p = tmp_path / "g.csv"
    p.write_text("t_ms,inp,outp,conv,cls,blocks,extra\n"
                 "2500,40,5,abc,chat,\"[7, 8, 9]\",x\n"
                 "500,17,6,,batch,4 5,y\n"
                 "1500,16,7,abc,chat,,z\n")
    w = tr.load_generic(p, {"arrival_s": "t_ms", "prompt_tokens": "inp", "output_tokens": "outp",
                            "session_id": "conv", "slo_class": "cls", "prefix_hashes": "blocks"},
                        time_unit="ms", hash_block_tokens=16)
    # sorted by arrival: rows 1 (0.5 s), 2 (1.5 s), 0 (2.5 s)
    assert list(w.request_id) == [1, 2, 0]
    assert np.allclose(w.arrival_s, [0.5, 1.5, 2.5])
    assert list(w.prompt_tokens) == [17, 16, 40] and list(w.output_tokens) == [6, 7, 5]
    # string session ids numbered by first appearance ("abc" -> 0), empty -> -1
    assert list(w.session_id) == [-1, 0, 0]
    assert [r.slo_class for r in w] == ["batch", "chat", "chat"]
    assert [r.prefix_hashes for r in w] == [(4, 5), (), (7, 8, 9)]
    assert w.hash_block_tokens == 16
    assert any("numbered 1 distinct ids" in n for n in w.notes)
    assert any("sorted: 2 rows" in n for n in w.notes)


def test_generic_jsonl_us_and_errors(tmp_path):
    p = tmp_path / "g.jsonl.gz"
    lines = [{"at": 2_000_000, "p": 3, "o": 1, "s": 4}, {"at": 3_500_000, "p": 9, "o": 2}]
    p.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    cols = {"arrival_s": "at", "prompt_tokens": "p", "output_tokens": "o", "session_id": "s"}
    w = tr.load_generic(p, cols, time_unit="us")
    assert np.allclose(w.arrival_s, [2.0, 3.5]) and list(w.session_id) == [4, -1]
    w = tr.load_generic(p, cols, time_unit="us", rebase_time=True)
    assert np.allclose(w.arrival_s, [0.0, 1.5])
    with pytest.raises(ConfigError, match="time_unit"):
        tr.load_generic(p, cols, time_unit="minutes")
    with pytest.raises(ConfigError, match="unknown field"):
        tr.load_generic(p, {**cols, "tenant": "x"})
    with pytest.raises(ConfigError, match="output_tokens"):
        tr.load_generic(p, {"arrival_s": "at", "prompt_tokens": "p"})
    with pytest.raises(TraceFormatError, match=r"line 1: required key 'out' is missing"):
        tr.load_generic(p, {**cols, "output_tokens": "out"})
    q = tmp_path / "g.csv"
    q.write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError) as e:
        tr.load_generic(q, cols)
    assert "'at'" in str(e.value) and "found ['a', 'b']" in str(e.value)
    with pytest.raises(ConfigError, match="hash_block_tokens"):
        tr.load_generic(q, {**cols, "prefix_hashes": "h"})


def test_generic_datetime_and_bad_value(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("when,n,m\n2024-01-01T00:00:10,5,1\n2024-01-01T00:00:12.5,6,1\n")
    w = tr.load_generic(p, {"arrival_s": "when", "prompt_tokens": "n", "output_tokens": "m"},
                        time_unit="datetime")
    assert np.allclose(w.arrival_s, [0, 2.5])
    p.write_text("t,n,m\n1,5,1\n2,5,1\n3,-1,1\n")
    with pytest.raises(TraceFormatError) as e:
        tr.load_generic(p, {"arrival_s": "t", "prompt_tokens": "n", "output_tokens": "m"})
    assert "line 4:" in str(e.value) and "'n'" in str(e.value) and "'-1'" in str(e.value)


# =============================================================================================
# Windows, rate scaling, head
# =============================================================================================
@pytest.fixture
def six(tmp_path):
    # arrivals 0..5 s; request i has prompt 600*(i+1) tokens -> i+2 hashes starting at 100*i
    rows = [{"timestamp": 1000 * i, "input_length": 600 * (i + 1), "output_length": i + 1,
             "hash_ids": [100 * i + k for k in range(math.ceil(600 * (i + 1) / 512))]}
            for i in range(6)]
    return tr.load_mooncake_jsonl(_mooncake(tmp_path, rows))


def test_window(six):
    w = tr.window(six, 1.0, 4.0)  # arrivals 1, 2, 3 (4 excluded), rebased by -1
    assert list(w.arrival_s) == [0.0, 1.0, 2.0]
    assert list(w.request_id) == [1, 2, 3] and list(w.output_tokens) == [2, 3, 4]
    assert [r.prefix_hashes[0] for r in w] == [100, 200, 300]
    assert [len(r.prefix_hashes) for r in w] == [3, 4, 5]  # ceil(1200/512), ceil(1800/512), ...
    assert w.notes[-1].startswith("window [1, 4) s: kept 3 of 6 requests")
    w2 = tr.window(six, 0.5, 2.0, rebase=False)
    assert list(w2.arrival_s) == [1.0]
    assert w2.request(0).prefix_hashes == six.request(1).prefix_hashes
    with pytest.raises(ConfigError, match="must be <"):
        tr.window(six, 3.0, 3.0)
    with pytest.raises(ConfigError) as e:
        tr.window(six, 10.0, 20.0)
    assert "holds no requests" in str(e.value) and "0.000-5.000 s" in str(e.value)


def test_scale_rate_and_head(six):
    w = tr.scale_rate(six, 2.0)
    assert list(w.arrival_s) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]  # twice the rate
    assert "scale_rate x2" in w.notes[-1]
    assert np.array_equal(w.hashes, six.hashes)
    assert list(tr.scale_rate(six, 0.5).arrival_s) == [0, 2, 4, 6, 8, 10]
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="factor"):
            tr.scale_rate(six, bad)
    h = tr.head(six, 2)
    assert list(h.request_id) == [0, 1] and len(h.hashes) == 2 + 3
    assert "head(2)" in h.notes[-1]
    assert len(tr.head(six, 99)) == 6 and "kept all 6" in tr.head(six, 99).notes[-1]
    with pytest.raises(ConfigError):
        tr.head(six, 0)


def test_window_on_real_trace(azure_conv):
    w = tr.window(azure_conv, 600, 1200)
    ref = azure_conv.arrival_s
    expect = np.count_nonzero((ref >= 600) & (ref < 1200))
    assert len(w) == expect > 0
    assert w.arrival_s[0] >= 0 and w.arrival_s[-1] < 600
    assert np.allclose(w.arrival_s, ref[(ref >= 600) & (ref < 1200)] - 600)


# =============================================================================================
# Synthetic
# =============================================================================================
def _cols(w):
    return (w.arrival_s, w.prompt_tokens, w.output_tokens, w.session_id, w.slo_class,
            w.hash_offsets, w.hashes)


def test_synthetic_determinism_and_provenance():
    cfg = syn.mixed_traffic_config(rate_per_s=8, duration_s=300)
    a, b, c = syn.generate(cfg, seed=7), syn.generate(cfg, seed=7), syn.generate(cfg, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(_cols(a), _cols(b)))
    assert a.content_sha256() == b.content_sha256() != c.content_sha256()
    assert not np.array_equal(a.arrival_s[:100], c.arrival_s[:100])
    assert "seed=7" in a.name and "rate_per_s=8" in a.name
    assert a.source_sha256 == b.source_sha256 != c.source_sha256
    assert any('"rate_per_s": 8' in n for n in a.notes)
    assert a.slo_class_names == ("short", "long")


def test_synthetic_hashes_identical_across_processes():
    """No salted hash(): a fresh interpreter with another PYTHONHASHSEED gives the same hashes."""
    code = ("from kvsched.envs.workload import synthetic as s;"
            "print(s.generate(s.mixed_traffic_config(rate_per_s=5, duration_s=60), seed=3)"
            ".content_sha256())")
    here = syn.generate(syn.mixed_traffic_config(rate_per_s=5, duration_s=60), seed=3)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == here.content_sha256()


def test_synthetic_poisson_rate():
    # Poisson count over 2000 s at 10/s: mean 20000, sd sqrt(20000) = 141 -> 3% tolerance = 4.2 sd
    w = syn.generate(syn.SyntheticConfig(rate_per_s=10, duration_s=2000), seed=1)
    assert abs(len(w) - 20_000) < 0.03 * 20_000
    assert 0 < w.arrival_s[0] and w.arrival_s[-1] < 2000
    gaps = np.diff(w.arrival_s)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: cv 1 (sd of est ~0.7%)


def test_synthetic_bursty_rate_and_cv():
    # Gamma renewal, cv 3: count sd ~ cv*sqrt(n) = 424 (2.1%) -> 10% tolerance is ~4.7 sd
    cfg = syn.SyntheticConfig(rate_per_s=10, duration_s=2000, arrival="bursty", burstiness_cv=3.0)
    w = syn.generate(cfg, seed=2)
    assert abs(len(w) - 20_000) < 0.10 * 20_000
    gaps = np.diff(w.arrival_s)
    assert abs(gaps.std() / gaps.mean() - 3.0) < 0.45  # the sample cv of heavy gaps is noisy
    n = syn.generate(syn.SyntheticConfig(rate_per_s=3, num_requests=1234), seed=0)
    assert len(n) == 1234


def test_synthetic_long_fraction_and_lengths():
    cfg = syn.SyntheticConfig(rate_per_s=50, num_requests=20_000, long_fraction=0.05,
                              long_min_tokens=8192, long_max_tokens=65536,
                              prompt_median_tokens=300, prompt_sigma=0.5, prompt_min_tokens=10,
                              prompt_max_tokens=5000, output_median_tokens=100,
                              output_sigma=0.6, output_min_tokens=1, output_max_tokens=4000)
    w = syn.generate(cfg, seed=5)
    is_long = w.slo_class == 1
    # Binomial(20000, 0.05): sd = 31 requests = 0.0015 -> tolerance 0.01 is ~6.5 sd
    assert abs(is_long.mean() - 0.05) < 0.01
    lp = w.prompt_tokens[is_long]
    assert lp.min() >= 8192 and lp.max() <= 65536
    assert lp.mean() > 1.3 * np.median(lp)  # heavy right tail
    assert np.all(w.session_id[is_long] == -1)
    sp = w.prompt_tokens[~is_long]  # single-turn, no system prompt: prompt = question
    assert sp.min() >= 10 and sp.max() <= 5000
    # bounds are >= 5 sigma from the median, so truncation barely moves the median
    assert abs(np.median(sp) / 300 - 1) < 0.05
    assert abs(np.median(w.output_tokens) / 100 - 1) < 0.05
    assert np.array_equal(np.diff(w.hash_offsets), -(-w.prompt_tokens // 16))
    # long requests share no hash with any other request
    owner = np.repeat(np.arange(len(w)), np.diff(w.hash_offsets))
    long_h = set(w.hashes[is_long[owner]].tolist())
    assert long_h.isdisjoint(w.hashes[~is_long[owner]].tolist())


def test_synthetic_sessions_share_prefixes_and_grow():
    cfg = syn.SyntheticConfig(rate_per_s=20, num_requests=4000, system_prompt_tokens=64,
                              num_system_prompts=2, concurrent_sessions=16, turns_per_session=4,
                              prompt_median_tokens=100, prompt_min_tokens=5,
                              prompt_max_tokens=400, output_max_tokens=300,
                              max_session_tokens=100_000)
    w = syn.generate(cfg, seed=11)
    hs = [w.hashes[w.hash_offsets[i]:w.hash_offsets[i + 1]] for i in range(len(w))]
    sids = np.unique(w.session_id)
    assert np.all(sids >= 0)
    multi = 0
    for s in sids:
        idx = np.flatnonzero(w.session_id == s)
        assert len(idx) <= 4
        for a, b in zip(idx[:-1], idx[1:]):
            multi += 1
            new = w.prompt_tokens[b] - w.prompt_tokens[a] - w.output_tokens[a]
            assert 5 <= new <= 400  # previous prompt + previous output + a new question
            full = w.prompt_tokens[a] // 16
            assert np.array_equal(hs[b][:full], hs[a][:full])  # shares the previous prompt
            assert hs[b][full] != hs[a][full] if w.prompt_tokens[a] % 16 else True
        # first turn: system prompt (64 tokens) + question
        assert 64 + 5 <= w.prompt_tokens[idx[0]] <= 64 + 400
    assert multi > 2000
    # the 4 system-prompt blocks are shared by all sessions of a group: exactly 2 distinct prefixes
    prefixes = {tuple(h[:4].tolist()) for h in hs}
    assert len(prefixes) == 2
    # blocks past the system prompt are not shared between different sessions
    first_turns = [np.flatnonzero(w.session_id == s)[0] for s in sids]
    fifth = [int(hs[i][4]) for i in first_turns if len(hs[i]) > 5]
    assert len(set(fifth)) == len(fifth)


def test_synthetic_session_ends_at_max_tokens():
    cfg = syn.SyntheticConfig(rate_per_s=10, num_requests=2000, concurrent_sessions=4,
                              turns_per_session=1000, prompt_max_tokens=500,
                              output_max_tokens=500, max_session_tokens=3000)
    w = syn.generate(cfg, seed=0)
    assert (w.prompt_tokens + w.output_tokens).max() <= 3000
    assert len(np.unique(w.session_id)) > 4  # sessions were replaced when full


@pytest.mark.parametrize("kw,field", [
    (dict(rate_per_s=0, duration_s=10), "rate_per_s"),
    (dict(rate_per_s=1), "exactly one"),
    (dict(rate_per_s=1, duration_s=10, num_requests=5), "exactly one"),
    (dict(rate_per_s=1, duration_s=10, arrival="bursty"), "burstiness_cv"),
    (dict(rate_per_s=1, duration_s=10, arrival="bursty", burstiness_cv=0.5), "burstiness_cv"),
    (dict(rate_per_s=1, duration_s=10, burstiness_cv=2.0), "burstiness_cv"),
    (dict(rate_per_s=1, duration_s=10, arrival="mmpp"), "arrival"),
    (dict(rate_per_s=1, duration_s=10, hash_block_tokens=24), "hash_block_tokens"),
    (dict(rate_per_s=1, duration_s=10, hash_block_tokens=0), "hash_block_tokens"),
    (dict(rate_per_s=1, duration_s=10, long_fraction=1.0), "long_fraction"),
    (dict(rate_per_s=1, duration_s=10, long_min_tokens=10, long_max_tokens=5), "long_max_tokens"),
    (dict(rate_per_s=1, duration_s=10, prompt_median_tokens=1e6, prompt_sigma=0.1), "mass"),
    (dict(rate_per_s=1, duration_s=10, system_prompt_tokens=40000), "max_session_tokens"),
    (dict(rate_per_s=1, num_requests=True), "num_requests"),
])
def test_synthetic_config_validation(kw, field):
    with pytest.raises(ConfigError, match=field):
        syn.SyntheticConfig(**kw)


def test_generate_rejects_bad_seed_and_empty():
    cfg = syn.SyntheticConfig(rate_per_s=1, duration_s=10)
    with pytest.raises(ConfigError, match="seed"):
        syn.generate(cfg, seed=-1)
    with pytest.raises(ConfigError, match="no request arrived"):
        syn.generate(syn.SyntheticConfig(rate_per_s=0.001, duration_s=0.001), seed=0)


def test_mixed_traffic_config():
    cfg = syn.mixed_traffic_config(rate_per_s=40, num_requests=20_000)
    assert cfg.duration_s is None and cfg.long_fraction == 0.03
    w = syn.generate(cfg, seed=0)
    assert abs((w.slo_class == 1).mean() - 0.03) < 0.006  # sd 0.0012
    assert w.prompt_tokens[w.slo_class == 1].min() >= 16384
    with pytest.raises(ConfigError, match="unknown field"):
        syn.mixed_traffic_config(rate=3)


def _azure_tz(tmp_path: Path, name: str, rows: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return p


def test_azure_timestamp_utc_offsets_are_honoured_or_refused(tmp_path):
    """Azure-format CSV whose TIMESTAMP carries a UTC offset (valid ISO 8601).

    Defect (envs/workload/traces.py ``_datetime_seconds(..., slice26=True)``): the loader cuts
    every timestamp to 26 characters, so ``2023-11-16 18:17:04.9799600+01:00`` loses its
    ``+01:00`` silently: a request that arrived one hour *before* the other is placed one
    second *after* it. With shorter timestamps the offsets survive the cut, and pandas raises
    a bare ``ValueError: Mixed timezones detected`` that names neither the file nor the line
    (``kvsched simulate --trace file.csv`` prints a traceback).

    Expected: offsets are honoured (arrivals relative to the earliest instant: 3599 s and 0 s)
    or the file is refused with a TraceFormatError naming the file and line.
    """
    long_ts = _azure_tz(tmp_path, "long.csv", ["2023-11-16 18:17:03.9799600+00:00,10,5",
                                             "2023-11-16 18:17:04.9799600+01:00,10,5"])
    short_ts = _azure_tz(tmp_path, "short.csv", ["2023-11-16 18:17:03+00:00,10,5",
                                               "2023-11-16 18:17:04+01:00,10,5"])
    for path in (long_ts, short_ts):
        try:
            w = traces.load_azure_csv(path)
        except TraceFormatError as e:
            assert str(path) in str(e) and "line" in str(e)
            continue
        by_row = dict(zip(w.request_id.tolist(), w.arrival_s.tolist()))
        assert by_row[0] == pytest.approx(3599.0, abs=1e-3)  # row 2 is one hour earlier (UTC)
        assert by_row[1] == pytest.approx(0.0, abs=1e-3)
