"""Requests and workloads (envs/sim/request.py): validation per request and per column, the
columnar workload's rows, order and provenance, and a request's simulator state."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.request import RUNNING, WAITING, Request, RequestState, Workload, _chain
from kvsched.envs.workload import traces as tr


@pytest.fixture(scope="module")
def mooncake_conv():
    return tr.load_trace("mooncake-conversation")


def test_non_integer_token_counts_and_ids_are_refused():
    """Request(prompt_tokens=100.7, output_tokens=10.9) is accepted (only ``< 1`` is checked),
    and ``Workload.from_requests`` silently truncates it to 100 / 10 (int64 cast); a bool is
    accepted as a token count or id as well.

    Expected (README "nothing is silently dropped or clipped"): a ConfigError naming the field
    and the value for non-integer token counts / request ids.
    """
    with pytest.raises(ConfigError, match="prompt_tokens"):
        Request(0, 0.0, 100.7, 10)
    with pytest.raises(ConfigError, match="output_tokens"):
        Request(0, 0.0, 100, 10.9)
    with pytest.raises(ConfigError, match="request_id"):
        Request(1.5, 0.0, 100, 10)


def test_request_rows_equal_validated_constructor(mooncake_conv):
    """Workload.request skips per-row checks; every row must equal what Request() builds."""
    w = mooncake_conv
    for i in (0, 1, 77, len(w) - 1):
        r = w.request(i)
        lo, hi = int(w.hash_offsets[i]), int(w.hash_offsets[i + 1])
        ref = Request(request_id=int(w.request_id[i]), arrival_s=float(w.arrival_s[i]),
                      prompt_tokens=int(w.prompt_tokens[i]), output_tokens=int(w.output_tokens[i]),
                      session_id=int(w.session_id[i]),
                      prefix_hashes=tuple(int(h) for h in w.hashes[lo:hi]),
                      hash_block_tokens=w.hash_block_tokens, slo_class=w.slo_class_names[int(w.slo_class[i])])
        assert r == ref
        assert all(type(h) is int for h in r.prefix_hashes) and type(r.request_id) is int
        assert type(r.arrival_s) is float


def test_workload_validates_columns_once():
    """What Request checks per row, Workload checks per column at construction."""
    n = 3
    good = dict(name="t", request_id=np.arange(n), arrival_s=np.array([0.0, 1.0, 2.0]),
                prompt_tokens=np.full(n, 5), output_tokens=np.full(n, 2), session_id=np.full(n, -1),
                slo_class=np.zeros(n, np.int16), hash_offsets=np.zeros(n + 1, np.int64),
                hashes=np.zeros(0, np.int64))
    Workload(**good)
    with pytest.raises(ConfigError, match="prompt_tokens has dtype float64"):
        Workload(**{**good, "prompt_tokens": np.full(n, 5.5)})
    with pytest.raises(ConfigError, match=r"request_id=-4 \(row 1\)"):
        Workload(**{**good, "request_id": np.array([0, -4, 2])})
    with pytest.raises(ConfigError, match="slo_class codes"):
        Workload(**{**good, "slo_class": np.array([0, 1, 0], np.int16)})
    with pytest.raises(ConfigError, match="hash_offsets"):
        Workload(**{**good, "hash_offsets": np.array([0, 2, 1, 0])})


@pytest.mark.parametrize("kw, field", [
    ({"request_id": -1}, "request_id=-1"), ({"arrival_s": -0.1}, "arrival_s=-0.1"),
    ({"arrival_s": float("nan")}, "arrival_s=nan"), ({"prompt_tokens": 0}, "prompt_tokens=0"),
    ({"output_tokens": 0}, "output_tokens=0"), ({"prefix_hashes": (1, 2)}, "hash_block_tokens=0"),
    ({"session_id": True}, "session_id=True"),
])
def test_a_bad_request_names_the_field_and_value(kw, field):
    base = dict(request_id=0, arrival_s=0.0, prompt_tokens=10, output_tokens=2)
    with pytest.raises(ConfigError, match=field):
        Request(**{**base, **kw})
    assert Request(**base).total_tokens == 12


def test_from_requests_sorts_by_arrival_stably_and_refuses_ambiguity():
    reqs = [Request(5, 2.0, 10, 2, slo_class="b"), Request(3, 1.0, 20, 2), Request(4, 1.0, 30, 2, slo_class="b")]
    w = Workload.from_requests(reqs)
    assert w.request_id.tolist() == [3, 4, 5] and w.slo_class_names == ("default", "b")
    assert [r.slo_class for r in w] == ["default", "b", "b"] and len(w) == 3
    with pytest.raises(ConfigError, match="unique"):
        Workload.from_requests([Request(1, 0.0, 10, 2), Request(1, 1.0, 10, 2)])
    with pytest.raises(ConfigError, match="mix hash_block_tokens"):
        Workload.from_requests([Request(0, 0.0, 64, 2, prefix_hashes=(1,), hash_block_tokens=32),
                                Request(1, 0.0, 64, 2, prefix_hashes=(1,), hash_block_tokens=64)])


def test_subset_keeps_each_rows_hashes_and_notes_what_was_done():
    w = Workload.from_requests([Request(i, float(i), 64, 2, prefix_hashes=(i, 100 + i), hash_block_tokens=32)
                                for i in range(4)])
    sub = w.subset(np.array([False, True, False, True]), note="odd rows")
    assert sub.request_id.tolist() == [1, 3] and sub.request(1).prefix_hashes == (3, 103)
    assert sub.notes == ("odd rows",) and sub.hash_block_tokens == 32
    later = w.with_arrivals(w.arrival_s + 10.0, "shifted")
    assert later.arrival_s.tolist() == [10.0, 11.0, 12.0, 13.0] and later.notes == ("shifted",)
    assert later.content_sha256() != w.content_sha256() == Workload.from_requests(list(w)).content_sha256()


def test_prefix_keys_chain_each_hash_to_its_parents():
    a, b = _chain((1, 2, 3)), _chain((9, 2, 3))
    assert len(a) == 3 and a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # same hash, other prefix
    assert _chain((1, 2)) == a[:2]


def test_request_state_counts_only_whole_segments_inside_the_prompt():
    st = RequestState(Request(0, 0.0, 100, 5, prefix_hashes=(1, 2, 3, 4), hash_block_tokens=32), 16, 0)
    assert st.n_cacheable_segments == 3 and st.hashes == _chain((1, 2, 3, 4)) and st.seg_tokens == 32
    assert st.status == WAITING and st.to_compute == 100 and st.hbm_blocks == 0
    st.computed, st.generated, st.status, st.private_blocks, st.shared_blocks = 102, 3, RUNNING, 5, 2
    assert st.to_compute == 1 and st.hbm_blocks == 7
    with pytest.raises(ConfigError, match="block_size_tokens=16 is not allowed.*divisor of 40"):
        RequestState(Request(0, 0.0, 100, 5, prefix_hashes=(1,), hash_block_tokens=40), 16, 0)
