"""Per-request scheduling priority in workloads (issue #21 item 4): vLLM's default 0 when absent,
carried through every workload transformation, read from trace columns with one-line errors, set
per SLO class in synthetic workloads and scenarios, and seen by policies in the FeatureTable."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError, TraceFormatError
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.request import PRIORITY_MAX, PRIORITY_MIN, Request, RequestState, Workload
from kvsched.envs.workload import synthetic as syn
from kvsched.envs.workload import traces as tr
from kvsched.runner.scenario import Scenario

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens,priority\n"


def _ts(sec: float) -> str:
    return f"2023-11-16 18:00:{sec:010.7f}"


def _azure(tmp_path: Path, rows: list[str]) -> Path:
    p = tmp_path / "az.csv"
    p.write_text(AZ_HEADER + "".join(r + "\n" for r in rows))
    return p


def _mooncake(tmp_path: Path, rows: list[dict]) -> Path:
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _mc(ts, n_in, n_out, **extra):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out,
            "hash_ids": list(range(math.ceil(n_in / 512))), **extra}


def six() -> Workload:
    return Workload.from_requests([Request(i, float(i), 10 + i, 5, priority=p)
                                   for i, p in enumerate([3, -1, 0, 7, 2, 3])])


# ------------------------------------------------------------------------------- the column
def test_a_workload_without_priorities_gives_every_request_vllms_default_zero():
    w = Workload.from_requests([Request(0, 0.0, 10, 5), Request(1, 1.0, 10, 5)])
    assert w.priority.tolist() == [0, 0] and w.priority.dtype == np.int64
    assert [r.priority for r in w] == [0, 0]
    bare = Workload(name="x", request_id=np.arange(2), arrival_s=np.array([0.0, 1.0]),
                    prompt_tokens=np.array([3, 4]), output_tokens=np.array([1, 1]),
                    session_id=np.array([-1, -1]), slo_class=np.zeros(2, np.int16),
                    hash_offsets=np.zeros(3, np.int64), hashes=np.zeros(0, np.int64))
    assert bare.priority.tolist() == [0, 0]


def test_priorities_stay_with_their_requests_through_every_transformation():
    w = six()
    assert w.priority.tolist() == [3, -1, 0, 7, 2, 3]
    assert [w.request(i).priority for i in range(6)] == [3, -1, 0, 7, 2, 3]
    assert w.subset(np.array([1, 3, 4])).priority.tolist() == [-1, 7, 2]
    assert w.subset(w.prompt_tokens > 12).priority.tolist() == [7, 2, 3]
    assert tr.window(w, 2.0, 5.0).priority.tolist() == [0, 7, 2]
    assert tr.head(w, 2).priority.tolist() == [3, -1]
    assert tr.scale_rate(w, 2.0).priority.tolist() == [3, -1, 0, 7, 2, 3]
    from kvsched.experiments.bench import tile_workload

    t = tile_workload(w, 2)  # reorders the copies by arrival: prompt 10 + i identifies row i
    assert len(t) == 12 and np.array_equal(t.priority, np.array([3, -1, 0, 7, 2, 3])[t.prompt_tokens - 10])


def test_the_content_hash_changes_with_priorities_and_not_for_all_zero_ones():
    reqs = [Request(i, float(i), 10, 5) for i in range(3)]
    plain = Workload.from_requests(reqs)
    zero = Workload.from_requests(reqs)
    object.__setattr__(zero, "priority", np.zeros(3, dtype=np.int64))
    # the hash the workload had before the column existed: the same bytes, no priority
    h = hashlib.sha256()
    for arr in (plain.request_id, plain.arrival_s, plain.prompt_tokens, plain.output_tokens, plain.session_id,
                plain.slo_class, plain.hash_offsets, plain.hashes):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(repr((plain.hash_block_tokens, plain.slo_class_names)).encode())
    assert plain.content_sha256() == zero.content_sha256() == h.hexdigest()
    prio = Workload.from_requests([Request(i, float(i), 10, 5, priority=i) for i in range(3)])
    assert prio.content_sha256() != plain.content_sha256()


@pytest.mark.parametrize("bad,match", [
    (np.array([0, PRIORITY_MAX + 1, 0]), rf"priority={PRIORITY_MAX + 1} \(row 1\)"),
    (np.array([0, 0, PRIORITY_MIN - 1]), rf"priority={PRIORITY_MIN - 1} \(row 2\)"),
    (np.array([0.0, 1.5, 0.0]), "column priority has dtype float64"),
    (np.array([0, 1]), "column priority has 2 rows, expected 3"),
])
def test_a_workload_refuses_priorities_out_of_range_or_not_integers(bad, match):
    w = Workload.from_requests([Request(i, float(i), 10, 5) for i in range(3)])
    with pytest.raises(ConfigError, match=match):
        Workload(name="x", request_id=w.request_id, arrival_s=w.arrival_s, prompt_tokens=w.prompt_tokens,
                 output_tokens=w.output_tokens, session_id=w.session_id, slo_class=w.slo_class,
                 hash_offsets=w.hash_offsets, hashes=w.hashes, priority=bad)


@pytest.mark.parametrize("bad", [1.5, True, "1", PRIORITY_MAX + 1, PRIORITY_MIN - 1])
def test_a_request_refuses_a_priority_out_of_range_or_not_an_integer(bad):
    with pytest.raises(ConfigError, match="priority"):
        Request(0, 0.0, 10, 5, priority=bad)
    assert Request(0, 0.0, 10, 5, priority=np.int64(PRIORITY_MIN)).priority == PRIORITY_MIN


def test_policies_see_the_priority_in_the_feature_table():
    w = six()
    states = [RequestState(w.request(i), 16, 0) for i in range(len(w))]
    t = FeatureTable(states, now_s=10.0)
    assert t.priority.tolist() == [3, -1, 0, 7, 2, 3] and t.priority.dtype == np.int64
    assert [s.priority for s in states] == [3, -1, 0, 7, 2, 3]


# ------------------------------------------------------------------------------ trace columns
def test_an_azure_csv_priority_column_is_read_and_sorted_with_its_rows(tmp_path):
    p = _azure(tmp_path, [f"{_ts(5)},10,3,2", f"{_ts(1)},20,4,-7", f"{_ts(3)},30,5,0"])
    w = tr.load_azure_csv(p)
    assert w.prompt_tokens.tolist() == [20, 30, 10] and w.priority.tolist() == [-7, 0, 2]
    assert any("priority from column 'priority'" in n for n in w.notes)
    assert tr.load_trace(p).priority.tolist() == [-7, 0, 2]  # by path: detected as the Azure format


@pytest.mark.parametrize("cell,shown", [("1.5", "'1.5'"), ("", "''"), ("high", "'high'"), ("nan", "'nan'"),
                                        (str(PRIORITY_MAX + 1), f"'{PRIORITY_MAX + 1}'")])
def test_a_bad_azure_priority_cell_is_named_by_line_and_value_on_one_line(tmp_path, cell, shown):
    p = _azure(tmp_path, [f"{_ts(1)},10,3,0", f"{_ts(2)},10,3,{cell}"])
    with pytest.raises(TraceFormatError) as e:
        tr.load_azure_csv(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and "line 3:" in msg and "'priority'" in msg and shown in msg
    assert "expected" in msg


def test_a_mooncake_priority_key_is_read_and_required_on_every_line_once_given(tmp_path):
    w = tr.load_mooncake_jsonl(_mooncake(tmp_path, [_mc(0, 10, 1, priority=4), _mc(5, 10, 1, priority=-2)]))
    assert w.priority.tolist() == [4, -2]
    assert tr.load_mooncake_jsonl(_mooncake(tmp_path, [_mc(0, 10, 1), _mc(5, 10, 1)])).priority.tolist() == [0, 0]
    for bad, needle in ((_mc(5, 10, 1), "None"), (_mc(5, 10, 1, priority=None), "None"),
                        (_mc(5, 10, 1, priority=2.5), "2.5"), (_mc(5, 10, 1, priority="1"), "'1'"),
                        (_mc(5, 10, 1, priority=True), "True")):
        with pytest.raises(TraceFormatError) as e:
            tr.load_mooncake_jsonl(_mooncake(tmp_path, [_mc(0, 10, 1, priority=4), bad]))
        msg = str(e.value)
        assert "line 2:" in msg and "'priority'" in msg and needle in msg and "\n" not in msg


def test_load_generic_maps_a_priority_column_in_csv_and_jsonl(tmp_path):
    c = tmp_path / "g.csv"
    c.write_text("t,n,m,prio\n2,10,1,5\n1,11,1,-3\n")
    cols = {"arrival_s": "t", "prompt_tokens": "n", "output_tokens": "m", "priority": "prio"}
    assert tr.load_generic(c, cols).priority.tolist() == [-3, 5]
    assert tr.load_generic(c, {k: v for k, v in cols.items() if k != "priority"}).priority.tolist() == [0, 0]
    j = tmp_path / "g.jsonl"
    j.write_text(json.dumps({"t": 0, "n": 10, "m": 1, "prio": 1}) + "\n" + json.dumps({"t": 1, "n": 10, "m": 1}) + "\n")
    with pytest.raises(TraceFormatError, match=r"line 2: field 'priority' \(column 'prio'\) has value None"):
        tr.load_generic(j, cols)


# ------------------------------------------------------------------------ synthetic / scenario
def test_synthetic_priorities_follow_the_slo_class():
    cfg = syn.SyntheticConfig(rate_per_s=5.0, num_requests=400, long_fraction=0.3, long_min_tokens=2000,
                              long_max_tokens=4000, short_priority=2, long_priority=-1)
    w = syn.generate(cfg, seed=3)
    is_long = w.slo_class == syn.SLO_CLASSES.index("long")
    assert 0 < is_long.sum() < len(w)
    assert (w.priority[is_long] == -1).all() and (w.priority[~is_long] == 2).all()
    # priorities draw no random numbers: the requests are those of the default config
    base = syn.generate(syn.SyntheticConfig(rate_per_s=5.0, num_requests=400, long_fraction=0.3,
                                            long_min_tokens=2000, long_max_tokens=4000), seed=3)
    assert np.array_equal(base.prompt_tokens, w.prompt_tokens) and not base.priority.any()
    assert base.source_sha256 != w.source_sha256 and "long_priority=-1" in w.name


def test_default_synthetic_provenance_is_what_it_was_before_priorities():
    cfg = syn.mixed_traffic_config(rate_per_s=8, duration_s=30)
    w = syn.generate(cfg, seed=7)
    old = {k: v for k, v in asdict(cfg).items() if k not in ("short_priority", "long_priority", "n_samples")}
    full = json.dumps({"generator": syn.GENERATOR_VERSION, "config": old, "seed": 7}, sort_keys=True)
    assert w.source_sha256 == hashlib.sha256(full.encode()).hexdigest()
    assert "priority" not in w.name and not any("priority" in n for n in w.notes)


@pytest.mark.parametrize("field,bad", [("short_priority", 1.5), ("long_priority", PRIORITY_MAX + 1),
                                       ("long_priority", True)])
def test_synthetic_priorities_are_validated(field, bad):
    with pytest.raises(ConfigError, match=rf"SyntheticConfig.{field}=.* is not allowed: expected an integer"):
        syn.SyntheticConfig(rate_per_s=1.0, num_requests=3, **{field: bad})


def test_a_scenario_sets_class_priorities_in_its_synthetic_workload():
    sc = Scenario(trace=None, synthetic=dict(rate_per_s=5.0, num_requests=200, long_fraction=0.2,
                                             long_min_tokens=1000, long_max_tokens=2000, long_priority=1),
                  policy="vllm-priority")
    w = sc.workload()
    assert set(w.priority[w.slo_class == 1].tolist()) == {1} and set(w.priority[w.slo_class == 0].tolist()) == {0}
    with pytest.raises(ConfigError, match="long_priority"):
        Scenario(trace=None, synthetic=dict(rate_per_s=5.0, num_requests=2, long_priority="high")).workload()
