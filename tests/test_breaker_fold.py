"""Breaker tests for the fold of a prompt-completing step into the decode stretch after it
(``StretchPlanner.fold``, commits c975293..).

The promise: results (records, summary JSON, occupancy frame, ITL histogram bins) are
byte-identical with the fold, without it (``_fold_into_stretch`` returning the single step's
end) and stepping one by one (``InstanceOptions(fast_forward=False)``).

* ``test_defect_*``: a divergence found by fuzzing; fails on the code as first committed.
* ``test_promise_*``: the fuzz harness, small enough to run in seconds.
* ``test_defect_*_livelock``: two preemption livelocks the fuzzing found outside the fold
  (also stepping one by one), fixed since.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as hst

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.fast_forward import StretchPlanner
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.policies.base import make_policy, policy_names

MODEL = get_model("Llama-3.1-8B")
GPU = get_gpu("H100-SXM")
BLOCK_BYTES = 131072 * 16  # Llama-3.1-8B bf16 KV bytes per 16-token block
NO_FRONT_END = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)


class Stuck(Exception):
    """The run did not end within :data:`STUCK_AFTER_S` simulated seconds (a preemption
    livelock; the two the fuzzing found, outside the fold, are fixed: see the two
    ``test_defect_*_livelock`` tests)."""


STUCK_AFTER_S = 60.0  # the generated workloads end within a few simulated seconds


def make_spec(**kw) -> InstanceSpec:
    base = dict(model=MODEL, gpu=GPU, hbm_kv_blocks=4096, max_num_batched_tokens=512, max_num_seqs=64)
    base.update(kw)
    return InstanceSpec(**base)


def build(rows, seg_tokens=32) -> Workload:
    """rows: (arrival_s, prompt, output, prefix group); a group > 0 shares leading segments."""
    reqs = []
    for i, (arr, p, o, g) in enumerate(rows):
        hashes = tuple(1000 * g + k for k in range(p // seg_tokens)) if g else ()
        reqs.append(Request(i, arr, p, o, prefix_hashes=hashes, hash_block_tokens=seg_tokens if hashes else 0))
    return Workload.from_requests(reqs)


def run(w, specs, policy="fcfs", params=None, ff=True, fold=True, check=False, oracle=False):
    """One run; returns (result, ITL histograms as (count, bin counts bytes, min, max))."""
    orig = StretchPlanner.fold
    if not fold:
        StretchPlanner.fold = lambda self, start, end1, *a: end1
    try:
        pp = make_policy(policy, params).params
        c = Cluster(specs, lambda: make_policy(policy, pp),
                    options=InstanceOptions(fast_forward=ff, check_invariants=check, oracle_lengths=oracle))
        c.start(w)
        if c.run_until_decision(until_s=STUCK_AFTER_S) is not None:
            raise Stuck  # a preemption livelock that is not the fold's (see Stuck)
        res = c.result()
        itl = {k: (h.count, h._counts.tobytes(), h.min, h.max) for k, h in c.recorder.itl.items()}
        return res, itl
    finally:
        StretchPlanner.fold = orig


def assert_same(a, b):
    (ra, ia), (rb, ib) = a, b
    pd.testing.assert_frame_equal(ra.records, rb.records, check_exact=True)
    assert summary_to_json(ra.summary) == summary_to_json(rb.summary)
    pd.testing.assert_frame_equal(ra.occupancy, rb.occupancy, check_exact=True)
    assert ia == ib


def three_way(w, specs, **kw) -> int:
    """Fold on (invariants checked every step) == fold off == one by one; returns folded steps."""
    on = run(w, specs, fold=True, check=True, **kw)
    assert_same(on, run(w, specs, fold=False, **kw))
    assert_same(on, run(w, specs, ff=False, **kw))
    return on[0].stats["folded_steps"]


# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lars", "sarathi"])
def test_defect_fold_in_a_stall_free_policy_kept_the_plan_order_not_the_running_order(policy):
    """A stall-free policy (Sarathi-Serve, LARS) plans decodes first and then the prefills in its
    own order, so the plan of a prompt-completing step need not be in running (admission) order.
    The fold kept that plan order for the whole stretch, while one by one the stretch planned
    at the step's end runs in running order: two members finishing at the same step then freed
    their blocks in the other order, the prefix cache's LRU evicted a different segment later,
    and a later request got a different prefix hit (request 7: 160 instead of 256 tokens with
    LARS) and first-token time. The fold must decline such a step (or keep running order)."""
    rows = [(0.001, 440, 7, 2), (0.71879, 471, 10, 2), (0.71979, 176, 21, 2), (0.72079, 273, 11, 2),
            (1.37257, 106, 28, 0), (1.37357, 407, 17, 0), (1.37457, 290, 9, 0), (2.20419, 395, 15, 2)]
    spec = make_spec(hbm_kv_blocks=71, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1136,
                     max_num_partial_prefills=2)
    assert three_way(build(rows), [spec], policy=policy) >= 1  # other steps still fold


def test_promise_fold_declines_a_plan_out_of_running_order_but_folds_in_order():
    """Sarathi with two partial prefills: the plan [1, 2, 0] is out of running order [1, 0, 2]
    (not folded), with one partial prefill the same workload folds; both exact."""
    w = Workload.from_requests([Request(0, 0.0, 300, 20), Request(1, 0.001, 10, 30), Request(2, 0.002, 20, 30)])
    folded = {}
    for mp in (1, 2):
        spec = make_spec(max_num_batched_tokens=64, max_num_partial_prefills=mp, max_long_partial_prefills=mp)
        folded[mp] = three_way(w, [spec], policy="sarathi")
    assert folded == {1: 1, 2: 0}


def test_promise_fold_through_a_decode_finishing_at_the_step_end():
    """A (output 3) and C (sharing A's prompt segments, prefix hit) decode while B's prompt is
    admitted; A emits its last token at the end of that step, as B its first. The step still
    folds: A runs only the stretch's first step, C finishes inside the stretch and B runs on.
    A's release at the step end leaves C the last reference to the shared segments, so C's
    finish frees them; the step end and a later step end fall into new occupancy sampling
    cells (1 s), so the samples check HBM in use after those frees. Exact against no fold and
    stepping one by one."""
    t0 = 0.98  # the admission step ends just past 1.0 s, B's stretch runs past 2.0 s
    rows = [(t0, 256, 3, 1), (t0 + 0.005, 256, 6, 1), (t0 + 0.012, 200, 200, 0)]
    spec = make_spec(cost=NO_FRONT_END)
    res, _ = run(build(rows), [spec])
    r = res.records.set_index("request_id")
    assert r.loc[0, "finish_s"] == r.loc[2, "first_token_s"]  # A finishes at B's admission step end
    assert r.loc[0, "finish_s"] > 1.0 > r.loc[1, "first_token_s"] and r.loc[2, "finish_s"] > 2.0
    assert r.loc[1, "prefix_hit_tokens"] == 224 and r.loc[2, "first_token_s"] < r.loc[1, "finish_s"]
    assert three_way(build(rows), [spec]) == 1  # that step (the others have an arrival inside)


# ------------------------------------------------------------------------------------------
POLICIES = policy_names()


@hst.composite
def cases(draw):
    """A small served system and workload that reach the fold often: staggered and simultaneous
    arrivals, short outputs, shared prefixes, tiny KV caches and budgets, several instances."""
    chunked = draw(hst.booleans()) or draw(hst.booleans())
    policy = draw(hst.sampled_from(POLICIES))
    if policy == "nonpreemptive":
        chunked = False  # the policy runs whole prompts
    elif policy == "sarathi":
        chunked = True  # its own token budget (512) need not cover max_model_len
    bs = draw(hst.sampled_from([16, 32]))
    hbm = draw(hst.sampled_from([24, 40, 71, 150, 4096]))
    mml = min(2048, hbm * bs)
    mode = draw(hst.sampled_from(["recompute", "swap", "offload"]))
    mp = draw(hst.sampled_from([1, 2, 3, 4])) if chunked else 1
    spec_kw = dict(
        hbm_kv_blocks=hbm, block_size_tokens=bs, max_model_len=mml, enable_chunked_prefill=chunked,
        max_num_batched_tokens=draw(hst.sampled_from([8, 33, 64, 512])) if chunked else mml,
        max_num_seqs=draw(hst.sampled_from([1, 2, 3, 64])),
        long_prefill_token_threshold=draw(hst.sampled_from([0, 40])) if chunked else 0,
        max_num_partial_prefills=mp, max_long_partial_prefills=draw(hst.integers(1, mp)),
        enable_prefix_caching=draw(hst.booleans()) or draw(hst.booleans()),
        cache_decode_blocks=draw(hst.booleans()), preemption_mode=mode,
        dram_kv_bytes=40 * BLOCK_BYTES * bs // 16 if mode == "swap" else 0,
        nvme_kv_bytes=200 * BLOCK_BYTES * bs // 16 if mode != "recompute" else 0)
    if draw(hst.booleans()):
        spec_kw["cost"] = NO_FRONT_END  # arrivals reach the engine exactly at arrival_s
    n_inst = draw(hst.sampled_from([1, 1, 2, 3]))
    specs = [make_spec(**spec_kw)]
    for _ in range(n_inst - 1):  # heterogeneous instances: other budgets, seats and caches
        kw = dict(spec_kw, max_num_seqs=draw(hst.sampled_from([2, 64])),
                  hbm_kv_blocks=max(-(-mml // bs), draw(hst.sampled_from([40, 300]))))
        if chunked:
            kw["max_num_batched_tokens"] = draw(hst.sampled_from([16, 512]))
        specs.append(make_spec(**kw))
    tick = draw(hst.sampled_from([0.0, 0.01, 0.3]))
    rows = draw(hst.lists(hst.tuples(hst.integers(0, 12).map(lambda k: k * tick),
                                     hst.one_of(hst.integers(1, 40), hst.integers(1, 700)),
                                     hst.one_of(hst.integers(1, 3), hst.integers(1, 60)),
                                     hst.integers(0, 3)), min_size=1, max_size=14))
    params = draw(hst.sampled_from([None, None, {"admission_preemption": "always", "admission_victim_min_tokens": 1},
                                    {"admission_preemption": "cost-gated", "admission_victim_min_tokens": 1}]))
    return dict(rows=rows, specs=specs, policy=policy, params=params, oracle=draw(hst.booleans()),
                seg=draw(hst.sampled_from([bs, 2 * bs])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=cases())
def test_promise_fold_is_exact_across_policies_tiers_and_instances(case):
    """Every policy (oracle lengths or not, admission preemption), chunked or whole prefills,
    several partial prefills, tiny budgets and KV caches with recompute/swap/offload
    preemption, prefix caching with shared prefixes and the single free queue, one to three
    (heterogeneous) round-robin instances: fold on == fold off == one by one."""
    try:
        three_way(build(case["rows"], case["seg"]), case["specs"], policy=case["policy"], params=case["params"],
                  oracle=case["oracle"])
    except Stuck:
        reject()


def test_promise_fold_is_exact_when_arrivals_land_on_step_ends():
    """Arrivals placed exactly at step ends of an earlier run (first-token and finish times; no
    front-end delay, so the engine sees them then): the fold must not run past such an arrival."""
    rng = np.random.default_rng(3)
    spec = make_spec(hbm_kv_blocks=150, max_num_batched_tokens=64, cost=NO_FRONT_END, cache_decode_blocks=True)
    total = 0
    for _ in range(6):
        rows = [(float(rng.integers(0, 10)) * 0.05, int(rng.integers(1, 400)), int(rng.integers(1, 40)),
                 int(rng.integers(0, 3))) for _ in range(10)]
        res, _ = run(build(rows), [spec])
        times = np.concatenate([res.records.first_token_s.to_numpy(), res.records.finish_s.to_numpy()])
        rows += [(float(t), int(rng.integers(1, 300)), int(rng.integers(2, 30)), int(rng.integers(0, 3)))
                 for t in rng.choice(times, 6)]
        rows.sort(key=lambda r: r[0])
        total += three_way(build(rows), [spec])
    assert total > 0


def test_defect_prefetch_offload_preemption_livelock():
    """Found while fuzzing the fold, present stepping one by one and before the fold commits:
    the ``prefetch`` policy (tier-aware preemption, prefetch) with ``offload`` preemption and a
    small HBM kept preempting its two running requests (~940 preemptions in 60 simulated
    seconds, nothing waiting) and never finished; fcfs serves the same workload in ~0.5 s. Two
    long prefills that cannot fit together each chose itself (the most computed tokens, the
    least recompute cost per freed block) when short of blocks, and the other's prefill then
    ran into the same wall. Tier-aware preemption now never picks the oldest candidate while
    there are others (vLLM's newest-victim rule guarantees progress the same way)."""
    spec = make_spec(hbm_kv_blocks=85, max_num_batched_tokens=2048, max_model_len=1360, max_num_partial_prefills=4,
                     max_long_partial_prefills=2, preemption_mode="offload", nvme_kv_bytes=200 * BLOCK_BYTES)
    w = build([(0.0, 982, 2, 0), (0.05, 233, 3, 1), (0.1, 1132, 47, 2), (0.0, 555, 2, 2), (0.0, 112, 4, 1)])
    res, _ = run(w, [spec], policy="fcfs", ff=False)
    assert (res.records.status == "finished").all()
    res, _ = run(w, [spec], policy="prefetch", ff=False)
    assert (res.records.status == "finished").all()


def test_defect_lars_swap_preemption_livelock():
    """Found while fuzzing the fold, stepping one by one: LARS with swap preemption, a 33-block
    HBM, three partial prefills (three of them long) kept swapping one request out and the
    other back in (~7,000 preemptions in 60 simulated seconds, 56 steps, nothing waiting) and
    never finished. The only ready request, short of a block while the other was being copied
    back in, preempted itself; now it waits for the copy to land (``Instance._make_room``),
    and then vLLM's newest-victim rule swaps the other out again, so the older one progresses."""
    spec = make_spec(hbm_kv_blocks=33, max_num_batched_tokens=16, max_num_seqs=3, max_model_len=528,
                     max_num_partial_prefills=3, max_long_partial_prefills=3, preemption_mode="swap",
                     dram_kv_bytes=30 * BLOCK_BYTES, nvme_kv_bytes=100 * BLOCK_BYTES)
    w = build([(1.26293, 264, 3, 1), (1.72202, 380, 2, 3), (1.72102, 330, 3, 0), (1.72102, 304, 7, 1)])
    res, _ = run(w, [spec], policy="lars", ff=False)
    assert (res.records.status == "finished").all()


@pytest.mark.parametrize("hbm_blocks, c_output, folded", [(11, 17, 1), (12, 40, 2)])
def test_promise_fold_through_finishing_decodes_allocates_only_never_cached_free_blocks(hbm_blocks, c_output, folded):
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
    res, _ = run(build(rows), [spec])
    r = res.records.set_index("request_id")
    assert r.loc[1, "finish_s"] == r.loc[2, "finish_s"] == r.loc[3, "first_token_s"]  # A, B end at C's admission step
    assert r.loc[4, "prefix_hit_tokens"] == 32  # S's segment was never evicted
    assert three_way(build(rows), [spec]) == folded  # + that step with 12 blocks (A and B's own admission step folds too)
