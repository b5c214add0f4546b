"""The stretch planner (envs/sim/fast_forward.py): step end times of a stretch are the same float
additions as stepping one by one (scalar and NumPy paths), a stretch stops at the horizon and
before the step the cache cannot give, block growth, the blocked head's protected prefix, and the
fold's free-block rule. (Whole-run byte identity: tests/invariants/test_fast_forward_equivalence.py.)"""

from __future__ import annotations

import math

import pytest

from simkit import NO_FRONT_END, make_instance, make_spec, place_running, run_cluster, state, three_way
from simkit import build_workload as build


def decoding_instance(hbm_blocks=64, outputs=(200, 200), xs=(20, 40)):
    """An instance whose running requests are ready decodes at KV positions ``xs``."""
    inst = make_instance(make_spec(hbm_kv_blocks=hbm_blocks))
    for i, (x, out) in enumerate(zip(xs, outputs)):
        place_running(inst, state(i, x, output=out), x, generated=1)  # prompt x, one token out
    return inst


def sequential_ends(cost, start, n, s0, k):
    ends, e = [], start
    for j in range(k):
        ctx = float(s0 + n * j)
        e = e + cost.step_time_fast(float(n), ctx, ctx, float(n))  # n decodes: n sequences
        ends.append(e)
    return ends


@pytest.mark.parametrize("k", [5, 24, 25, 300])
def test_stretch_end_times_are_the_sequential_sums_of_step_times(k):
    """Up to SCALAR_STEPS steps are timed in Python, more with one NumPy call and a cumulative
    sum: bitwise the same floats as adding the step times one by one."""
    inst = make_instance(make_spec())
    planner = inst.stretch
    ends = planner.stretch_end_times(0.25, math.inf, 3, 300, k)
    assert ends == sequential_ends(inst.cost, 0.25, 3, 300, k)
    assert planner.SCALAR_STEPS == 24


def test_a_stretch_stops_at_the_first_step_ending_at_or_after_the_horizon():
    inst = make_instance(make_spec())
    full = sequential_ends(inst.cost, 0.0, 2, 100, 400)
    for horizon in (full[10], (full[10] + full[11]) / 2, full[300]):
        ends = inst.stretch.stretch_end_times(0.0, horizon, 2, 100, 400)
        assert ends[-1] >= horizon > ends[-2] and ends == full[:len(ends)]


def test_a_stretch_stops_before_the_step_whose_blocks_the_cache_cannot_give():
    inst = decoding_instance(hbm_blocks=12)  # holds 2 + 3 blocks; 7 free
    xs = (20, 40)
    fits = 0
    while sum(-(-(x + fits + 1) // 16) for x in xs) <= 12:  # blocks the next step needs in all
        fits += 1
    end = inst.schedule(0.0)
    planner = inst.stretch
    assert planner.ends is not None and len(planner.ends) == fits == 60 and end == planner.ends[-1]
    assert inst.kv.hbm.used_blocks == 12 and planner.reserved == 7  # reserved ahead for steps 2..K
    assert inst.stretch.in_use_now() == (5, 0, 0, 0)  # not in use before their steps
    assert planner.used[0] == 5 and planner.used[-1] == 12
    inst.complete_step(end)
    assert [s.generated for s in inst.running] == [61, 61] and inst.stretches == 1 and inst.stretch_steps == 60
    inst.check()


def test_growth_blocks_count_block_boundaries_crossed():
    inst = make_instance(make_spec())
    assert inst.stretch.growth_blocks([15, 16, 31], 1) == 2  # 15 -> 16 and 31 -> 32 reach a new block
    assert inst.stretch.growth_blocks([0], 32) == 2
    assert inst.stretch.growth_blocks([5, 5], 0) == 0


def test_a_blocked_heads_cached_prefix_bounds_what_a_stretch_may_allocate():
    inst = make_instance(make_spec(hbm_kv_blocks=40))
    a = place_running(inst, state(0, 64, hashes=(1, 2), seg=32), 64)
    inst.kv.register_segments(a, 0.0)
    inst.kv.free(a)  # its two segments are cached and unreferenced (freed tail first, LRU: second, first)
    inst.running.remove(a)
    assert inst.stretch.block_limit(100) == inst.kv.hbm.available_blocks == 40
    inst._blocked_hit_hashes = (a.hashes[0],)  # a waiting head would hit the first segment
    assert inst.stretch.block_limit(100) == 36 + 2  # free blocks, then the second segment only


@pytest.mark.parametrize("hbm_blocks, c_output, folded", [(11, 17, 1), (12, 40, 2)])
def test_fold_through_finishing_decodes_allocates_only_never_cached_free_blocks(hbm_blocks, c_output, folded):
    """A and B (outputs 10, private blocks only) finish at the end of the step that admits C's
    whole prompt; S's prompt segment (group 1, output 1) is cached and unreferenced (evictable).
    One by one, A and B free their blocks at that step end (free pool, no single free queue)
    before C's next blocks are allocated, so nothing is evicted and the probe P (group 1, at
    5 s) finds S's 32 tokens. The fold knows only the blocks free before those frees: with 11
    blocks C's second-step block is not free (0 free, 2 evictable), so the step is not folded;
    with 12 (1 free) it is, and the stretch's later blocks come from the free pool only (its
    limit binds; the next one-by-one stretch picks up after A's and B's frees). Allowing
    free + evictable in either place evicts S's segment and P's hit drops to 0."""
    rows = [(0.0, 32, 1, 1), (0.1, 14, 10, 0), (0.1, 21, 10, 2), (0.16, 80, c_output, 3), (5.0, 80, 1, 1)]
    spec = make_spec(hbm_kv_blocks=hbm_blocks, max_model_len=hbm_blocks * 16, max_num_batched_tokens=2048,
                     cost=NO_FRONT_END)
    res, _ = run_cluster(build(rows), [spec])
    r = res.records.set_index("request_id")
    assert r.loc[1, "finish_s"] == r.loc[2, "finish_s"] == r.loc[3, "first_token_s"]  # A, B end at C's admission step
    assert r.loc[4, "prefix_hit_tokens"] == 32  # S's segment was never evicted
    # + that step with 12 blocks (A and B's own admission step folds too)
    assert three_way(build(rows), [spec]) == folded
