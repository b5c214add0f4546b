"""HBM residency as a retention decision and prefetch of a returning request's prefix (issue #21,
item 3): kept HBM segments go only when nothing else can, never refusing an allocation; a reuse
or the deadline ends a keep; ``evict_first`` sends a prompt to the LRU head; a returning turn
kept in HBM hits there where LRU evicted it; blocks stay conserved under any mix of decisions;
fast-forward equals stepping; a prefetch copies NVMe-only segments up to DRAM and its admission
loads them from DRAM; declining every prefetch is the plain run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from simkit import assert_identical, build_workload, growing_sessions, make_spec, run

from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.kv_cache import BlockPool
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.retention import HBM_CHOICES, RetentionDecision
from kvsched.policies.base import make_policy

SEG = 32
BLOCK_BYTES = 16 * 131072  # one 16-token block of Llama-3.1-8B


def _pool_with_segments(n: int, nb: int = 2) -> BlockPool:
    """An HBM pool of ``n`` cached, unreferenced segments 0..n-1 (LRU order 0 first), no free block."""
    pool = BlockPool("hbm", n * nb, prefix_caching=True)
    for h in range(n):
        assert pool.allocate(nb)
        assert pool.register_segment(h, nb, creator_id=h)
        pool.used_blocks -= nb  # the private blocks became the segment's (as KVManager does)
        pool.used_blocks += nb
        pool.release_segment(h)
    pool.check()
    return pool


def _evicted_order(pool: BlockPool, n_blocks: int) -> list[int]:
    got: list[int] = []
    pool.on_evict = lambda ev: got.extend(h for h, _, _ in ev)
    assert pool.allocate(n_blocks)
    pool.check()
    return got


def test_kept_segments_go_only_after_every_other_and_never_refuse_an_allocation():
    pool = _pool_with_segments(5)
    assert pool.keep_segments([1, 0], until_s=10.0) == 4
    assert pool.kept_blocks == 4 and pool.available_blocks == 10  # still evictable: nothing refused
    # LRU 2, 3, 4 first, then the kept ones, the first given first (a prefix's tail first)
    assert _evicted_order(pool, 10) == [2, 3, 4, 1, 0]
    assert pool.kept_blocks == 0


def test_a_reuse_ends_a_keep_and_an_expired_keep_rejoins_the_lru_at_its_head():
    pool = _pool_with_segments(4)
    pool.keep_segments([0, 1], until_s=5.0)
    pool.acquire_segment(0)  # reused: no longer kept
    assert pool.kept_blocks == 2
    pool.release_segment(0)  # back in the LRU at its tail, as any release
    pool.expire_kept(4.9)
    assert pool.kept_blocks == 2
    pool.expire_kept(5.0)
    assert pool.kept_blocks == 0
    assert _evicted_order(pool, 4) == [1, 2]  # the expired keep first, then the LRU order


def test_evict_first_sends_a_prompt_to_the_lru_head_tail_first():
    pool = _pool_with_segments(5)
    assert pool.evict_first([3, 4]) == 4
    assert _evicted_order(pool, 6) == [4, 3, 0]


def test_blocks_before_evicting_counts_kept_segments_after_the_lru():
    pool = _pool_with_segments(4)
    pool.keep_segments([0], until_s=9.0)
    assert pool.blocks_before_evicting({0}, 8) == 6  # 1, 2, 3 may go; the kept 0 is protected
    assert pool.blocks_before_evicting({2}, 8) == 2


@settings(max_examples=40, deadline=None)
@given(ops=hst.lists(hst.tuples(hst.sampled_from(["keep", "unkeep", "first", "expire", "alloc", "acquire",
                                                  "release", "free"]),
                                hst.lists(hst.integers(0, 7), max_size=4), hst.integers(0, 12)), max_size=40))
def test_hbm_blocks_are_conserved_under_any_mix_of_keeps_and_allocations(ops):
    pool = _pool_with_segments(8)
    held: list[int] = []
    private = 0
    for op, hs, k in ops:
        hs = [h for h in hs if h in pool.segments]
        if op == "keep":
            pool.keep_segments(hs, float(k))
        elif op == "unkeep":
            pool.unkeep_segments(hs)
        elif op == "first":
            pool.evict_first(hs)
        elif op == "expire":
            pool.expire_kept(float(k))
        elif op == "alloc" and pool.allocate(k):
            private += k
        elif op == "acquire" and hs:
            pool.acquire_segment(hs[0])
            held.append(hs[0])
        elif op == "release" and held:
            pool.release_segment(held.pop())
        elif op == "free" and private:
            pool.release_private(private)
            private = 0
        pool.check()


def test_a_bad_hbm_choice_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="hbm"):
        RetentionDecision(hbm="pin")
    with pytest.raises(ConfigError, match="hbm"):
        RetentionDecision("drop", hbm="keep")  # an HBM keep needs a keep time
    assert HBM_CHOICES == ("lru", "keep", "evict_first")
    assert RetentionDecision("keep", 30.0, hbm="keep").label == "keep 30s +hbm"
    assert RetentionDecision(hbm="evict_first").label == "default, hbm first"


def _spec(po=PrefixOffloadSpec(), dram_blocks=120, nvme_blocks=300, hbm=260):
    return make_spec(hbm_kv_blocks=hbm, max_num_batched_tokens=512, dram_kv_bytes=dram_blocks * BLOCK_BYTES,
                     nvme_kv_bytes=nvme_blocks * BLOCK_BYTES, prefix_offload=po)


def _play(workload, spec, decide=lambda p: None, prefetch=lambda p: False, check=True, ff=True):
    c = Cluster([spec], lambda: make_policy("fcfs"),
                options=InstanceOptions(check_invariants=check, fast_forward=ff))
    c.start(workload, DecisionWatch(residency=True, prefetch=True))
    kinds: dict[str, int] = {}
    while (p := c.run_until_decision()) is not None:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
        if p.kind == "residency":
            d = decide(p)
            if d is not None:
                c.retain(d)
        elif prefetch(p):
            c.prefetch()
    return c.result(), kinds


def _hbm_kept_vs_flood(hbm: str):
    """Conversation 1 (1,024 tokens, 64 blocks) finishes first; unrelated prompts then pass
    through HBM (200 blocks, no lower tier holds them long: 64-block DRAM); it returns at 30 s."""
    rows = [(0.0, 1024, 2, 1)] + [(1.0 + 0.5 * i, 1024, 2, 10 + i) for i in range(6)] + [(30.0, 1088, 2, 1)]
    w = build_workload(rows, seg_tokens=SEG)
    d = RetentionDecision("keep", 60.0, hbm=hbm) if hbm == "keep" else RetentionDecision(hbm=hbm)
    r, _ = _play(w, _spec(dram_blocks=64, hbm=200), lambda p: d if p.request.rid == 0 else None)
    return r.records.set_index("request_id").loc[len(rows) - 1], r.summary


def test_a_turn_kept_in_hbm_hits_there_where_the_lru_evicted_it():
    last_lru, s_lru = _hbm_kept_vs_flood("lru")
    last_kept, s_kept = _hbm_kept_vs_flood("keep")
    assert last_lru["prefix_hit_tokens"] == 0
    assert last_kept["prefix_hit_tokens"] == 1024  # its whole first turn found in HBM
    assert last_kept["first_token_s"] - last_kept["arrival_s"] < last_lru["first_token_s"] - last_lru["arrival_s"]
    assert s_kept["prefix_tiers"]["hbm_kept_blocks"] == 64 and "hbm_kept_blocks" not in s_lru["prefix_tiers"]


def test_fast_forward_equals_stepping_under_hbm_keeps_and_prefetches():
    w = growing_sessions(11, n=60)
    menu = [RetentionDecision("keep", 3.0, hbm="keep"), RetentionDecision(hbm="evict_first"),
            RetentionDecision("keep", 0.4, hbm="keep"), RetentionDecision()]
    spec = _spec(PrefixOffloadSpec(tiers=("dram", "nvme")), dram_blocks=40, hbm=160)

    def go(ff):
        return _play(w, spec, lambda p: menu[p.request.rid % 4], lambda p: p.request.rid % 2 == 0,
                     check=False, ff=ff)[0]

    assert_identical(go(True), go(False))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=hst.integers(0, 10_000), choices=hst.lists(hst.integers(0, 5), min_size=1, max_size=30),
       write=hst.sampled_from(("write_through", "write_back")))
def test_blocks_are_conserved_with_hbm_keeps_and_prefetches_mixed(seed, choices, write):
    """check_invariants after every event (every tier: free + cached + used = capacity, kept HBM
    segments unreferenced); every request is served."""
    menu = [RetentionDecision("keep", 2.0, hbm="keep"), RetentionDecision(hbm="evict_first"),
            RetentionDecision("drop"), RetentionDecision("keep", 1e4, hbm="keep"), RetentionDecision("demote"),
            None]
    i = iter(range(10**6))
    po = PrefixOffloadSpec(tiers=("dram", "nvme"), write_policy=write)
    r, _ = _play(growing_sessions(seed), _spec(po, dram_blocks=60, nvme_blocks=150, hbm=140),
                 lambda p: menu[choices[next(i) % len(choices)]],
                 lambda p: choices[p.request.rid % len(choices)] % 2 == 0)
    assert len(r.records) == 40


def _returning_from_nvme(prefetch: bool):
    """Conversation 1 (1,024 tokens, 64 blocks) is demoted to NVMe by a flood through a 128-block
    DRAM; one seat, held by a request decoding 300 tokens when its second turn arrives, so the
    turn waits in the queue while a prefetch copies its prefix up."""
    rows = [(0.0, 1024, 2, 1)] + [(0.5 + 0.3 * i, 1024, 2, 10 + i) for i in range(4)]
    rows += [(20.0, 512, 300, 50), (20.3, 1088, 2, 1)]
    w = build_workload(rows, seg_tokens=SEG)
    po = PrefixOffloadSpec(tiers=("dram", "nvme"), load_policy="always")
    spec = make_spec(hbm_kv_blocks=200, max_num_batched_tokens=512, max_num_seqs=1,
                     dram_kv_bytes=128 * BLOCK_BYTES, nvme_kv_bytes=2000 * BLOCK_BYTES, prefix_offload=po)
    return _play(w, spec, prefetch=lambda p: prefetch and p.request.rid == len(rows) - 1)


def test_a_prefetch_copies_a_returning_prefix_from_nvme_to_dram_before_its_admission():
    plain, kinds_plain = _returning_from_nvme(False)
    pre, kinds = _returning_from_nvme(True)
    assert kinds["prefetch"] >= 1 and kinds == kinds_plain
    nvme = pre.summary["prefix_tiers"]["tiers"]["nvme"]
    assert nvme["prefetches"] == 1 and nvme["bytes_prefetched"] == 64 * BLOCK_BYTES
    # without the prefetch its admission loads the prefix from NVMe, with it from DRAM
    assert plain.summary["prefix_tiers"]["tiers"]["nvme"]["hit_tokens"] == 1024
    assert pre.summary["prefix_tiers"]["tiers"]["dram"]["hit_tokens"] == 1024
    assert nvme["hit_tokens"] == 0
    last = [r.records.set_index("request_id").iloc[-1] for r in (plain, pre)]
    assert last[1]["first_token_s"] < last[0]["first_token_s"]  # DRAM loads faster than NVMe
    assert pre.summary["prefix_tiers"]["prefetch_decisions"] == kinds["prefetch"]


def test_declining_every_prefetch_is_the_plain_run():
    w = growing_sessions(5, n=50)
    spec = _spec(PrefixOffloadSpec(tiers=("dram", "nvme")), dram_blocks=40, hbm=160)
    plain = run(w, spec)
    watched, kinds = _play(w, spec)
    assert kinds.get("prefetch", 0) > 0
    watched.summary["prefix_tiers"].pop("retention_decisions")
    assert_identical(plain, watched)


def test_prefetch_without_a_pending_prefetch_point_is_an_error():
    c = Cluster([_spec()], lambda: make_policy("fcfs"))
    c.start(growing_sessions(1, n=5), DecisionWatch(residency=True, prefetch=True))
    with pytest.raises(RuntimeError, match="no prefetch decision point"):
        c.prefetch()
