"""Retention decisions for lower-tier prefix caches (kvsched.envs.sim.retention, PrefixTiers.retain):
'default' everywhere is the plain run, a kept conversation survives writes that would have evicted
it, drop and demote move what they say, blocks stay conserved under any decisions, conversations
are told apart from shared templates, bad decisions are refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from simkit import assert_identical, build_workload, growing_sessions, make_spec, run

from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.retention import RETENTION_KINDS, RetentionDecision
from kvsched.policies.base import make_policy

SEG = 32
BLOCK_BYTES = 16 * 131072  # one 16-token block of Llama-3.1-8B




def _spec(po=PrefixOffloadSpec(), dram_blocks=120, nvme_blocks=300, hbm=260):
    return make_spec(hbm_kv_blocks=hbm, max_num_batched_tokens=512, dram_kv_bytes=dram_blocks * BLOCK_BYTES,
                     nvme_kv_bytes=nvme_blocks * BLOCK_BYTES, prefix_offload=po)


def _play(workload, spec, decide, check=True):
    """Serve ``workload`` with retention decisions ``decide(point) -> RetentionDecision | None``."""
    c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(check_invariants=check))
    c.start(workload, DecisionWatch(residency=True))
    points = []
    while (p := c.run_until_decision()) is not None:
        assert p.kind == "residency" and p.request is not None
        points.append(p)
        d = decide(p)
        if d is not None:
            c.retain(d)
    return c.result(), points


@pytest.mark.parametrize("po", [PrefixOffloadSpec(), PrefixOffloadSpec(tiers=("dram", "nvme"), eviction="lfu"),
                                PrefixOffloadSpec(write_policy="write_back", eviction="clairvoyant")],
                         ids=["lru", "two-tiers-lfu", "back-clairvoyant"])
def test_default_decisions_everywhere_are_the_plain_run(po):
    w = growing_sessions(3, n=50)
    spec = _spec(po)
    plain = run(w, spec)
    watched, points = _play(w, spec, lambda p: RetentionDecision())
    assert len(points) == 50  # one decision per finished request
    assert watched.summary["prefix_tiers"].pop("retention_decisions") == 50
    assert_identical(plain, watched)
    undecided, _ = _play(w, spec, lambda p: None)  # deciding is optional
    undecided.summary["prefix_tiers"].pop("retention_decisions")
    assert_identical(plain, undecided)


def _kept_vs_flood(keep: bool):
    """Conversation 1 (a 1,024-token prompt) finishes at ~0.1 s; a flood of unrelated prompts
    then writes 4x the DRAM tier's capacity; conversation 1 returns at 30 s."""
    rows = [(0.0, 1024, 2, 1)]
    rows += [(1.0 + 0.5 * i, 1024, 2, 10 + i) for i in range(16)]
    rows.append((30.0, 1024 + 64, 2, 1))
    w = build_workload(rows, seg_tokens=SEG)
    spec = _spec(dram_blocks=256, hbm=200)  # DRAM holds 4 prompts of 64 blocks; HBM evicts the first
    decide = (lambda p: RetentionDecision("keep", 60.0) if p.request.rid == 0 else None) if keep else (lambda p: None)
    r, _ = _play(w, spec, decide)
    return r.records.set_index("request_id").loc[len(rows) - 1], r.summary["prefix_tiers"]["tiers"]["dram"]


def test_a_kept_conversation_survives_writes_that_evict_it_under_lru_and_its_next_turn_hits_dram():
    last_lru, dram_lru = _kept_vs_flood(keep=False)
    last_kept, dram_kept = _kept_vs_flood(keep=True)
    assert dram_lru["hit_tokens"] == 0  # LRU evicted it under the flood
    assert dram_kept["hit_tokens"] == 1024  # kept: the whole first turn loads from DRAM
    assert last_kept["first_token_s"] - last_kept["arrival_s"] < last_lru["first_token_s"] - last_lru["arrival_s"]
    # the flood still went through DRAM, in the room the kept conversation left
    assert dram_kept["skipped_writes"] == 0 and dram_kept["evicted_segments"] > 0


def test_a_keep_lapses_at_its_deadline():
    """Kept for 5 s only: the flood after the deadline evicts it as LRU would."""
    rows = [(0.0, 1024, 2, 1)] + [(10.0 + 0.5 * i, 1024, 2, 10 + i) for i in range(16)] + [(30.0, 1088, 2, 1)]
    w = build_workload(rows, seg_tokens=SEG)
    r, _ = _play(w, _spec(dram_blocks=256, hbm=200),
                 lambda p: RetentionDecision("keep", 5.0) if p.request.rid == 0 else None)
    assert r.summary["prefix_tiers"]["tiers"]["dram"]["hit_tokens"] == 0


def test_drop_evicts_the_conversation_from_every_tier_and_demote_moves_it_down():
    rows = [(0.0, 1024, 2, 1), (5.0, 512, 2, 2)]
    w = build_workload(rows, seg_tokens=SEG)
    spec = _spec(PrefixOffloadSpec(tiers=("dram", "nvme")))
    seen = {}

    def decide(kind):
        def f(p):
            pt = c_ref[0].instances[0].kv.prefix_tiers
            before = pt.session_blocks(p.request)
            c_ref[0].retain(RetentionDecision(kind))
            seen[p.request.rid] = (before, pt.session_blocks(p.request))
            return None
        return f

    for kind in ("drop", "demote"):
        c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(check_invariants=True))
        c_ref = [c]
        c.start(w, DecisionWatch(residency=True))
        f = decide(kind)
        while (p := c.run_until_decision()) is not None:
            f(p)
        c.result()
        before, after = seen[0]
        assert before[0] == 64  # the 1,024-token prompt's 64 blocks were written through to DRAM
        if kind == "drop":
            assert after == [0, 0]
        else:
            assert after[0] == 0 and after[1] == before[0]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=hst.integers(0, 10_000), choices=hst.lists(hst.integers(0, 8), min_size=1, max_size=40),
       two_tiers=hst.booleans(), write=hst.sampled_from(("write_through", "write_back")))
def test_blocks_are_conserved_under_any_retention_decisions(seed, choices, two_tiers, write):
    """check_invariants after every step: each tier's free + cached + used blocks equal its
    capacity, kept + ordered entries are the store's; the run ends with every request served."""
    menu = [RetentionDecision(), RetentionDecision("drop"), RetentionDecision("demote"),
            RetentionDecision("keep", 0.5), RetentionDecision("keep", 5.0), RetentionDecision("keep", 60.0),
            RetentionDecision("keep", 1e4), None, RetentionDecision("keep", 2.0)]
    po = PrefixOffloadSpec(tiers=("dram", "nvme") if two_tiers else ("dram",), write_policy=write)
    i = iter(range(10**6))
    r, points = _play(growing_sessions(seed), _spec(po, dram_blocks=90, nvme_blocks=150),
                      lambda p: menu[choices[next(i) % len(choices)]])
    assert len(r.records) == 40 and len(points) == 40


def test_fast_forward_equals_stepping_under_retention_decisions():
    w = growing_sessions(11, n=60)
    menu = [RetentionDecision("keep", 3.0), RetentionDecision("drop"), RetentionDecision()]

    def go(ff):
        spec = _spec(PrefixOffloadSpec(), dram_blocks=90)
        c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(fast_forward=ff))
        c.start(w, DecisionWatch(residency=True))
        while (p := c.run_until_decision()) is not None:
            c.retain(menu[p.request.rid % 3])
        return c.result()

    a, b = go(True), go(False)
    assert_identical(a, b)


def test_a_shared_template_is_not_one_conversation():
    """Two requests extending the same one-request chain: the first continues its conversation,
    the second starts its own; a request adding nothing new (a template alone) continues none."""
    h = lambda g, n: tuple(1000 * g + k for k in range(n))  # noqa: E731
    reqs = [Request(0, 0.0, 4 * SEG, 2, prefix_hashes=h(1, 4), hash_block_tokens=SEG),
            Request(1, 1.0, 8 * SEG, 2, prefix_hashes=h(1, 4) + h(2, 4), hash_block_tokens=SEG),
            Request(2, 2.0, 8 * SEG, 2, prefix_hashes=h(1, 4) + h(3, 4), hash_block_tokens=SEG),
            Request(3, 3.0, 12 * SEG, 2, prefix_hashes=h(1, 4) + h(2, 4) + h(4, 4), hash_block_tokens=SEG),
            Request(4, 4.0, 4 * SEG, 2, prefix_hashes=h(1, 4), hash_block_tokens=SEG),
            Request(5, 5.0, 8 * SEG, 2, prefix_hashes=h(1, 4) + h(5, 4), hash_block_tokens=SEG)]
    w = Workload.from_requests(reqs)
    cl = Cluster([_spec()], lambda: make_policy("fcfs"))
    cl.start(w, DecisionWatch(residency=True))
    got = {}
    while (p := cl.run_until_decision()) is not None:
        got[p.request.rid] = cl.instances[0].kv.prefix_tiers.conversation_of(p.request)
    assert got[1] == got[0] and got[3] == got[0]  # 1 continues 0; 3 continues 1
    assert got[2] != got[0]  # 2 extends the template 0 a second time: its own conversation
    assert got[5] != got[4] and got[5] != got[0]  # 4 adds nothing new: nobody continues it


@pytest.mark.parametrize("kw,match", [(dict(kind="forget"), "kind"), (dict(kind="keep"), "keep_s"),
                                      (dict(kind="keep", keep_s=float("inf")), "keep_s"),
                                      (dict(kind="drop", keep_s=3.0), "keep_s"),
                                      (dict(kind="keep", keep_s=True), "keep_s")])
def test_a_bad_retention_decision_is_refused_naming_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        RetentionDecision(**kw)


def test_retain_without_a_pending_residency_point_is_an_error():
    c = Cluster([_spec()], lambda: make_policy("fcfs"))
    c.start(growing_sessions(1, n=5), DecisionWatch(residency=True))
    with pytest.raises(RuntimeError, match="no residency decision point"):
        c.retain(RetentionDecision())
    p = c.run_until_decision()
    assert p is not None and p.kind == "residency"
    c.retain(RetentionDecision("keep", 1.0))
    with pytest.raises(RuntimeError, match="no residency decision point"):
        c.retain(RetentionDecision())


def test_the_kinds_are_the_documented_ones():
    assert RETENTION_KINDS == ("default", "drop", "demote", "keep")
    assert RetentionDecision("keep", 30).label == "keep 30s" and RetentionDecision().label == "default"


def _h(group: int, n: int) -> tuple:
    return tuple(1000 * group + k for k in range(n))


def test_keeping_a_conversation_keeps_the_shared_prefix_another_conversation_wrote():
    """Conversation 2 extends conversation 1's 512-token template; a flood then fills DRAM.
    Keeping conversation 2 alone must keep the template too (a hit needs the whole leading run)."""
    reqs = [Request(0, 0.0, 512, 2, session_id=1, prefix_hashes=_h(1, 16), hash_block_tokens=SEG),
            Request(1, 0.5, 1024, 2, session_id=2, prefix_hashes=_h(1, 16) + _h(2, 16), hash_block_tokens=SEG)]
    reqs += [Request(2 + i, 1.0 + 0.5 * i, 1024, 2, session_id=10 + i, prefix_hashes=_h(10 + i, 32),
                     hash_block_tokens=SEG) for i in range(16)]
    reqs.append(Request(18, 30.0, 1088, 2, session_id=2, prefix_hashes=_h(1, 16) + _h(2, 16) + _h(3, 2),
                        hash_block_tokens=SEG))
    w = Workload.from_requests(reqs)
    r, _ = _play(w, _spec(dram_blocks=256, hbm=200),
                 lambda p: RetentionDecision("keep", 60.0) if p.request.rid == 1 else None)
    assert r.summary["prefix_tiers"]["tiers"]["dram"]["hit_tokens"] == 1024


def test_lifting_a_keep_returns_every_tier_to_its_order_and_demote_keeps_nothing_below():
    w = Workload.from_requests([Request(0, 0.0, 1024, 2, session_id=1, prefix_hashes=_h(1, 32),
                                        hash_block_tokens=SEG)])
    c = Cluster([_spec(PrefixOffloadSpec(tiers=("dram", "nvme")))], lambda: make_policy("fcfs"),
                options=InstanceOptions(check_invariants=True))
    c.start(w, DecisionWatch(residency=True))
    p = c.run_until_decision()
    pt = c.instances[0].kv.prefix_tiers
    c.retain(RetentionDecision("keep", 600.0))
    for _ in range(10):  # e.g. a kept write of another conversation, or a swap, takes room
        pt.stores[0].evict_one(p.time_s)
    assert [s.protected_blocks for s in pt.stores] == [44, 20]  # demoted entries stay kept below
    pt.retain(p.request, "demote", 0.0, p.time_s)
    assert [s.protected_blocks for s in pt.stores] == [0, 0] and pt.session_blocks(p.request) == [0, 64]
    for s in pt.stores:
        s.check()


@pytest.mark.parametrize("eviction", ["lru", "lfu", "session", "clairvoyant"])
def test_a_tier_evicts_a_prefix_from_its_tail_so_what_stays_is_a_leading_run(eviction):
    """A 1,024-token prompt (32 segments) computed in 512-token chunks, then another prompt's write
    needs room: what stays of the first is a leading run a later turn can load."""
    from kvsched.envs.sim.request import _chain

    reqs = [Request(0, 0.0, 1024, 2, prefix_hashes=_h(1, 32), hash_block_tokens=SEG),
            Request(1, 1.0, 512, 2, prefix_hashes=_h(2, 16), hash_block_tokens=SEG)]
    c = Cluster([_spec(PrefixOffloadSpec(eviction=eviction), dram_blocks=80, hbm=200)], lambda: make_policy("fcfs"),
                options=InstanceOptions(check_invariants=True))
    c.start(Workload.from_requests(reqs))
    c.run_until_decision()
    store = c.instances[0].kv.prefix_tiers.stores[0]
    chain = list(_chain(_h(1, 32)))
    left = [i for i, k in enumerate(chain) if k in store.entries]
    assert 0 < len(left) < 32 and left == list(range(len(left)))
