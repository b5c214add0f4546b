"""The ``lpm`` policy (SGLang ``--schedule-policy lpm``, policies/lpm.py) and the FeatureTable's
``cached_prefix_tokens`` column it reads: the longest cached prefix is admitted first, the
column is the prefix-cache lookup's hit, queues above 128 keep their order (FCFS), ties keep
the order the last decision left, and duplicate uncached prefixes go last (in-batch prefix
caching)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import Request, RequestState, Workload
from kvsched.policies.base import make_policy, policy_names
from kvsched.policies.lpm import LongestPrefixMatch, LPMParams
from simkit import build_workload, make_spec, run


def _seeded_then_queued(seed_rows, queued_rows, t_queue=5.0):
    """Seed requests (finished by ``t_queue``: their prompt segments stay cached), then a blocker
    and ``queued_rows`` arriving behind it; ``max_num_seqs=1`` admits one request at a time, so
    the order of first scheduling is the admission order. Rows: (prompt, prefix group)."""
    rows = [(0.1 * i, p, 2, g) for i, (p, g) in enumerate(seed_rows)]
    rows.append((t_queue, 64, 50, 0))  # the blocker: the queue builds behind it
    rows += [(t_queue + 0.001 * (1 + i), p, 2, g) for i, (p, g) in enumerate(queued_rows)]
    return build_workload(rows)


def _admission_order(res, first_rid):
    r = res.records.set_index("request_id")
    queued = r.loc[first_rid:]
    return queued.sort_values("first_scheduled_s").index.tolist()


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    """Cached: group 1's first 1,024 tokens and group 2's first 320. Queued in arrival order: no
    prefix, group 2 (320 cached), group 1 (1,024 cached). LPM admits 1, 2, then the uncached
    one; FCFS keeps arrival order."""
    w = _seeded_then_queued([(1024, 1), (320, 2)], [(400, 0), (400, 2), (1100, 1)])
    spec = make_spec(max_num_seqs=1)
    lpm = run(w, spec, policy="lpm")
    fcfs = run(w, spec, policy="fcfs")
    assert (lpm.records.status == "finished").all()
    assert _admission_order(lpm, 2) == [2, 5, 4, 3]  # blocker, then group 1, group 2, none
    assert _admission_order(fcfs, 2) == [2, 3, 4, 5]
    hits = lpm.records.set_index("request_id").prefix_hit_tokens
    assert (hits[5], hits[4], hits[3]) == (1024, 320, 0)


class _Recording(LongestPrefixMatch):
    """LPM that also keeps the ``cached_prefix_tokens`` it saw: (time, request id) -> tokens."""

    seen: dict = {}

    def order_waiting(self, table):
        for rid, tok in zip(table.request_id.tolist(), table.cached_prefix_tokens.tolist()):
            type(self).seen[(table.now_s, rid)] = tok
        return super().order_waiting(table)


def test_cached_prefix_column_equals_the_hit_admission_takes():
    """At every decision, a waiting request admitted then has ``prefix_hit_tokens`` (its first
    admission's hit on others' segments) equal to the column: the column is the lookup's hit.
    Shared prefixes of 4 groups, some evicted by a small HBM."""
    rng = np.random.default_rng(4)
    rows = [(float(t), int(rng.integers(100, 1500)), int(rng.integers(2, 40)), int(rng.integers(0, 4)))
            for t in np.sort(rng.uniform(0, 6, 80))]
    w = build_workload(rows)
    _Recording.seen = {}
    res = Cluster([make_spec(hbm_kv_blocks=400, max_num_batched_tokens=512)], lambda: _Recording(),
                  options=InstanceOptions(check_invariants=True)).run(w)
    r = res.records
    assert (r.status == "finished").all() and r.preemptions.sum() == 0  # first admissions only
    checked = 0
    for rid, t, hit in zip(r.request_id, r.first_scheduled_s, r.prefix_hit_tokens):
        assert (t, rid) in _Recording.seen
        assert _Recording.seen[(t, rid)] == hit, rid
        checked += hit > 0
    assert checked >= 10  # hits happened


def test_cached_prefix_column_is_zero_without_a_lookup_and_built_only_when_read():
    st = RequestState(Request(0, 0.0, 100, 5, prefix_hashes=(1, 2, 3), hash_block_tokens=32), 16, 0)
    assert FeatureTable([st], 0.0).cached_prefix_tokens.tolist() == [0]
    calls = []
    t = FeatureTable([st], 0.0, prefix_lookup=lambda s: calls.append(s) or 64)
    assert not calls and "cached_prefix_tokens" not in t.__dict__
    assert t.cached_prefix_tokens.tolist() == [64] and calls == [st]
    assert t.prefix_segment_tokens.tolist() == [32] and t.prefix_hashes[0] == st.hashes[:3]


def _table(rows, now=0.0):
    """A table of waiting requests with ``(rid, cached tokens, prefix hashes)`` (32-token segments)."""
    sts, cached = [], {}
    for rid, tok, hashes in rows:
        p = max(64, 32 * len(hashes) + 32)
        sts.append(RequestState(Request(rid, 0.0, p, 5, prefix_hashes=tuple(hashes),
                                        hash_block_tokens=32 if hashes else 0), 16, 0))
        cached[rid] = tok
    return FeatureTable(sts, now, prefix_lookup=lambda s: cached[s.rid])


def test_ties_keep_the_order_the_last_decision_left_and_new_requests_join_the_end():
    """SGLang sorts its waiting list in place (stable): ties keep that list's order, not arrival."""
    pol = make_policy("lpm", {"in_batch_check_tokens": -1})
    first = pol.order_waiting(_table([(0, 0, ()), (1, 64, ()), (2, 0, ())]))
    assert first.tolist() == [1, 0, 2]
    # request 1 admitted; 0 and 2 tie at 0 cached, 3 arrives with 0: list order 0, 2, then 3
    assert pol.order_waiting(_table([(0, 0, ()), (2, 0, ()), (3, 0, ())])).tolist() == [0, 1, 2]
    # now 2 and 3 tie at 32 cached tokens, ahead of 0
    assert pol.order_waiting(_table([(0, 0, ()), (2, 32, ()), (3, 32, ())])).tolist() == [1, 2, 0]
    # fresh policy: the instance's order breaks ties
    assert make_policy("lpm").order_waiting(_table([(5, 0, ()), (4, 0, ())])).tolist() == [0, 1]


def test_above_128_waiting_requests_lpm_keeps_the_list_order_fcfs():
    """SGLang ``_determine_active_policy``: len(waiting_queue) > 128 -> FCFS (no sort)."""
    pol = make_policy("lpm")
    n = 129
    rows = [(i, 32 * (i % 5), ()) for i in range(n)]
    assert pol.order_waiting(_table(rows)).tolist() == list(range(n))
    rows = rows[:128]
    order = pol.order_waiting(_table(rows)).tolist()
    cached = np.array([32 * (i % 5) for i in range(128)])
    assert order == sorted(range(128), key=lambda i: -cached[i])  # sorted again, stable
    assert make_policy("lpm", {"fcfs_above_waiting": 1000}).order_waiting(_table(
        [(i, 32 * (i % 5), ()) for i in range(n)])).tolist()[:3] == [4, 9, 14]


def test_requests_sharing_an_uncached_prefix_with_one_ahead_go_last():
    """In-batch prefix caching: three requests share 64 uncached tokens (2 segments); the first
    stays in place, the other two are sorted after every other request, which then hits the
    cache the first one computes; a shared run under 32 tokens deprioritizes nobody."""
    shared = (7, 8)
    rows = [(0, 0, shared + (1,)), (1, 0, shared + (2,)), (2, 0, (9,)), (3, 0, shared + (3,)), (4, 0, ())]
    assert make_policy("lpm").order_waiting(_table(rows)).tolist() == [0, 2, 4, 1, 3]
    off = make_policy("lpm", {"in_batch_check_tokens": -1})
    assert off.order_waiting(_table(rows)).tolist() == [0, 1, 2, 3, 4]
    # one shared 32-token segment deprioritizes (>= 32); with the threshold at 64 it does not
    one = [(0, 0, (7, 1)), (1, 0, (7, 2)), (2, 0, ())]
    assert make_policy("lpm").order_waiting(_table(one)).tolist() == [0, 2, 1]
    assert make_policy("lpm", {"in_batch_deprioritize_tokens": 64}).order_waiting(_table(one)).tolist() == [0, 1, 2]
    # a request with more than 32 cached tokens is not checked
    cached = [(0, 0, shared + (1,)), (1, 64, shared + (2,)), (2, 0, ())]
    assert make_policy("lpm").order_waiting(_table(cached)).tolist() == [1, 0, 2]


def test_lpm_is_registered_and_refuses_bad_parameters():
    assert "lpm" in policy_names()
    assert isinstance(make_policy("LPM"), LongestPrefixMatch)
    assert make_policy("lpm").params == LPMParams()
    for field, bad in (("fcfs_above_waiting", -1), ("in_batch_check_tokens", -2),
                       ("in_batch_deprioritize_tokens", 1.5), ("fcfs_above_waiting", True)):
        with pytest.raises(ConfigError, match=f"LPMParams.{field}"):
            make_policy("lpm", {field: bad})
