"""Block accounting of one tier and link queues (envs/sim/kv_cache.py): all-or-nothing allocation,
LRU eviction of unreferenced prefix segments, vLLM V1's single free queue, conservation, and FIFO
links."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.kv_cache import BlockPool, LinkQueue


def cached_pool(capacity=10, single=False) -> BlockPool:
    """An HBM pool with prefix caching and three unreferenced 2-block segments, released in the
    order 1, 3, 2 (LRU: 1 oldest): 4 free blocks, 6 evictable."""
    pool = BlockPool("hbm", capacity, prefix_caching=True, single_free_queue=single)
    for h in (1, 2, 3):
        assert pool.allocate(2) and pool.register_segment(h, 2, creator_id=h)
    for h in (1, 3, 2):
        pool.release_segment(h)
    return pool


def test_single_free_queue_ages_released_private_blocks_with_cached_segments():
    from kvsched.envs.sim.kv_cache import BlockPool

    def run(single: bool) -> tuple[bool, bool]:
        pool = BlockPool("hbm", 10, prefix_caching=True, single_free_queue=single)
        assert pool.allocate(3) and pool.register_segment(7, 3, creator_id=0)  # request A: cached prompt
        assert pool.allocate(2)  # request B: 2 private (decode) blocks
        pool.release_segment(7)  # A finishes first: its prompt ages first ...
        pool.release_private(2)  # ... then B's decode blocks
        pool.check()
        assert pool.available_blocks == 10
        assert pool.allocate(5)  # the 5 never-used blocks: nothing evicted in either mode
        kept_after_5 = 7 in pool.segments
        assert pool.allocate(2) and pool.check() is None
        return kept_after_5, 7 in pool.segments

    # simple pool: B's private blocks are free again and used before evicting A's prompt
    assert run(False) == (True, True)
    # vLLM V1's one LRU queue: A's prompt is older than B's decode blocks, so it goes first
    assert run(True) == (True, False)


def test_allocation_is_all_or_nothing():
    pool = cached_pool()
    before = (pool.free_blocks, pool.evictable_blocks, pool.used_blocks, dict(pool.segments))
    assert not pool.allocate(11)  # more than free + evictable
    assert (pool.free_blocks, pool.evictable_blocks, pool.used_blocks, dict(pool.segments)) == before
    assert pool.evicted_segments == 0
    assert pool.allocate(0) and pool.allocate(-3)  # nothing asked: granted, nothing taken
    assert pool.used_blocks == 0
    assert pool.allocate(10) and pool.available_blocks == 0 and pool.used_blocks == 10
    pool.check()


def test_free_blocks_go_before_any_cached_segment_is_evicted():
    pool = cached_pool()
    assert pool.allocate(4)
    assert set(pool.segments) == {1, 2, 3} and pool.evicted_segments == 0 and pool.free_blocks == 0


def test_unreferenced_segments_are_evicted_least_recently_released_first():
    pool = cached_pool()
    assert pool.allocate(4)
    assert pool.allocate(1)  # evicts segment 1 whole: one of its blocks is free again
    assert set(pool.segments) == {2, 3} and pool.free_blocks == 1 and pool.evicted_segments == 1
    assert pool.allocate(3)  # the free block, then segment 3 (released before 2)
    assert set(pool.segments) == {2} and pool.evicted_segments == 2
    pool.check()


def test_a_referenced_segment_is_never_evicted_and_rejoins_the_lru_at_its_tail():
    pool = cached_pool()
    assert pool.acquire_segment(1) == 2  # the oldest is referenced again: used, out of the LRU
    assert pool.used_blocks == 2 and pool.evictable_blocks == 4 and pool.segment_refs(1) == 1
    assert not pool.allocate(9)  # 4 free + 4 evictable
    assert pool.allocate(8) and set(pool.segments) == {1}
    pool.release_segment(1)  # unreferenced again: evictable, youngest
    assert pool.evictable_blocks == 2 and pool.used_blocks == 8
    pool.check()


def test_single_free_queue_puts_released_private_blocks_in_the_lru():
    pool = BlockPool("hbm", 12, prefix_caching=True, single_free_queue=True)
    for h in (1, 2, 3):
        assert pool.allocate(2) and pool.register_segment(h, 2, creator_id=h)
    assert pool.allocate(6) and pool.free_blocks == 0  # a request's private blocks
    pool.release_segment(1)
    pool.release_private(6)  # its blocks join the LRU's tail as one run, not the free pool
    pool.release_segment(2)  # LRU: segment 1, the run, segment 2
    assert pool.free_blocks == 0 and pool.evictable_blocks == 10 and pool.used_blocks == 2
    pool.check()
    assert pool.allocate(2) and set(pool.segments) == {2, 3} and pool.evicted_segments == 1
    assert pool.allocate(6) and set(pool.segments) == {2, 3} and pool.evicted_segments == 1  # the run: no eviction
    assert pool.allocate(1) and set(pool.segments) == {3} and pool.free_blocks == 1
    pool.check()
    simple = cached_pool(capacity=12)
    assert simple.allocate(6)
    simple.release_private(3)  # without the single queue: straight to the free pool
    assert simple.free_blocks == 3 and simple.evictable_blocks == 6


def test_check_catches_a_broken_count():
    pool = cached_pool()
    pool.check()
    pool.used_blocks += 1
    with pytest.raises(AssertionError, match="hbm: free 4 \\+ evictable 6 \\+ used 1 != capacity 10"):
        pool.check()
    pool = cached_pool()
    pool.free_blocks -= 1
    pool.evictable_blocks += 1  # the totals add up, the LRU does not
    with pytest.raises(AssertionError, match="LRU holds 6 blocks"):
        pool.check()
    pool = cached_pool()
    pool.free_blocks, pool.used_blocks = pool.free_blocks + 1, -1
    with pytest.raises(AssertionError):
        pool.check()


def test_registering_a_segment_needs_caching_and_a_new_hash():
    pool = BlockPool("hbm", 8, prefix_caching=True)
    assert pool.allocate(4)
    assert pool.register_segment(7, 2, creator_id=5)
    assert not pool.register_segment(7, 2, creator_id=6)  # already cached: the copy stays private
    assert pool.segment_creator(7) == 5 and pool.segment_blocks(7) == 2 and pool.segment_refs(7) == 1
    off = BlockPool("hbm", 8)
    assert off.allocate(2) and not off.register_segment(7, 2, creator_id=0) and not off.segments
    assert not BlockPool("dram", 8, prefix_caching=False, single_free_queue=True).single_free_queue


def test_cached_prefix_is_the_leading_run_of_cached_hashes():
    pool = cached_pool()
    assert pool.cached_prefix_segments([1, 2, 9, 3], 4) == 2
    assert pool.cached_prefix_segments([1, 2, 3], 1) == 1
    assert pool.cached_prefix_segments([9, 1], 2) == 0


def test_queries_about_releasing_holders_change_nothing():
    pool = BlockPool("hbm", 10, prefix_caching=True)
    for h in (1, 2):
        assert pool.allocate(2) and pool.register_segment(h, 2, creator_id=0)
    pool.acquire_segment(2)  # segment 2: two holders
    assert pool.total_refs() == 3 and pool.referenced_blocks() == 4
    left: dict[int, int] = {}
    assert pool.unreferenced_blocks([1, 2], left) == 2 and left == {1: 0, 2: 1}
    assert pool.unreferenced_blocks([2], left) == 2  # the second holder of 2 after the first
    assert pool.sole_holder_blocks([1, 2]) == 2
    pool.release_segment(1)
    assert pool.evictable_blocks_of([1, 2]) == 2
    assert pool.total_refs() == 2 and pool.segment_refs(2) == 2  # the queries released nothing


def test_blocks_before_evicting_stop_at_the_first_protected_segment():
    pool = cached_pool()  # free 4, LRU: 1, 3, 2
    assert pool.blocks_before_evicting({3}, wanted=100) == 6  # free + segment 1
    assert pool.blocks_before_evicting({1}, wanted=100) == 4
    assert pool.blocks_before_evicting(set(), wanted=5) == 6  # stops once enough is reachable
    assert pool.blocks_before_evicting({2}, wanted=3) == 4


def test_capacity_must_not_be_negative():
    with pytest.raises(ConfigError, match="dram capacity_blocks=-1"):
        BlockPool("dram", -1)
    assert BlockPool("nvme", 0).available_blocks == 0


def test_link_queue_serves_transfers_in_order_one_at_a_time():
    q = LinkQueue("pcie_d2h")
    assert q.reserve(1.0, 0.5, 100) == (1.0, 1.5)  # idle link: starts when ready
    assert q.reserve(1.2, 0.25, 50) == (1.5, 1.75)  # busy: waits for the one before
    assert q.reserve(3.0, 0.1, 10) == (3.0, 3.1)  # idle again
    assert q.busy_until_s == 3.1 and q.bytes_moved == 160 and q.busy_s == pytest.approx(0.85)
