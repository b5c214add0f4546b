"""Fast-forward equivalence: a fast-forwarded stretch of decode steps (and a prompt-completing
step folded into the stretch after it) gives byte-identical records, summary JSON, occupancy
frame and ITL histogram bins as stepping one by one (``InstanceOptions(fast_forward=False)``),
across policies, preemption modes, tiers, PNM residents, routers and the shared KV tier.

The fold cases were found by fuzzing the fold (``StretchPlanner.fold``); the harness is
``simkit.three_way``: fold on (invariants checked every step) == fold off == one by one.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as hst

from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.shared_kv import SharedKVSpec
from kvsched.policies.base import policy_names
from kvsched.runner.simulate import simulate
from simkit import (BLOCK_BYTES, MODEL_BLOCK_BYTES, NO_FRONT_END, Stuck, cluster, literature_spec, make_spec,
                    pnm_tier, routing_spec, run, run_cluster, run_policy, three_way)
from simkit import build_workload as build
from simkit import mixed_prefix_workload as _mixed_prefix_workload


def _fast_and_slow(w, spec):
    """The run with fast-forward and stepping one by one, checked identical (records, summary,
    occupancy, step count)."""
    fast = run(w, spec, fast_forward=True)
    slow = run(w, spec, fast_forward=False)
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)
    assert fast.stats["steps"] == slow.stats["steps"]
    return fast, slow


def test_decode_stretch_is_fast_forwarded_and_exact():
    spec = make_spec()
    reqs = [Request(i, 0.0, 200 + 37 * i, 300 + 11 * i) for i in range(8)]
    w = Workload.from_requests(reqs)
    fast, slow = _fast_and_slow(w, spec)
    assert fast.stats["fast_forward_steps"] > 0.9 * fast.stats["steps"]
    assert fast.stats["events"] < slow.stats["events"] / 20


def test_stretch_runs_through_completions_when_nothing_waits():
    """Eight requests start together and finish one after another: with nothing waiting, one
    fast-forwarded stretch carries the shrinking batch through all seven earlier completions
    (events do not grow with completions), each finishing at its own step end, exactly as
    stepping one by one. With a request waiting (max_num_seqs 7) a completion admits it, so
    stretches end there and still match."""
    reqs = [Request(i, 0.0, 200 + 37 * i, 300 + 11 * i) for i in range(8)]
    w = Workload.from_requests(reqs)
    for max_seqs, stretches in ((64, 1), (7, None)):
        spec = make_spec(max_num_seqs=max_seqs)
        fast, slow = _fast_and_slow(w, spec)
        assert fast.records["finish_s"].nunique() == 8  # finishes at eight different step ends
        if stretches is not None:
            assert fast.stats["fast_forward_stretches"] == stretches
        else:
            assert fast.stats["fast_forward_stretches"] > 1


def _no_fold(monkeypatch):
    from kvsched.envs.sim.fast_forward import StretchPlanner
    monkeypatch.setattr(StretchPlanner, "fold", lambda self, start, end1, *a: end1)


@pytest.mark.parametrize("with_prefixes", [False, True])
def test_admission_step_folds_into_the_following_stretch_exactly(monkeypatch, with_prefixes):
    """A single step that completes prompts (decodes + fresh prefills, nothing waiting) is
    folded into the decode stretch after it: fewer events, the same records, summary and
    occupancy as without folding and as stepping one by one. Staggered arrivals so that each
    admission is such a step; outputs of 2-4 tokens finish at the fold's second step or inside
    it (stretch through completions); shared prompt prefixes are registered at the fold."""
    rng = np.random.default_rng(7)
    reqs = []
    for i in range(60):
        out = int(rng.integers(2, 5)) if i % 5 == 0 else int(rng.integers(20, 160))
        prompt = int(rng.integers(64, 700))
        hashes = tuple(100 + k for k in range(prompt // 32)) if with_prefixes and i % 2 else ()
        reqs.append(Request(i, 0.37 * i, prompt, out, prefix_hashes=hashes, hash_block_tokens=32 if hashes else 0))
    w = Workload.from_requests(reqs)
    spec = make_spec()
    folded, slow = _fast_and_slow(w, spec)
    assert folded.stats["folded_steps"] >= 40  # nearly every admission
    assert slow.stats["folded_steps"] == 0
    if with_prefixes:
        assert (folded.records.prefix_hit_tokens > 0).sum() >= 10
    _no_fold(monkeypatch)
    plain = run(w, spec, fast_forward=True)
    assert plain.stats["folded_steps"] == 0
    pd.testing.assert_frame_equal(folded.records, plain.records, check_exact=True)
    assert summary_to_json(folded.summary) == summary_to_json(plain.summary)
    pd.testing.assert_frame_equal(folded.occupancy, plain.occupancy, check_exact=True)
    assert folded.stats["events"] <= plain.stats["events"] - folded.stats["folded_steps"]


def test_steps_are_not_folded_when_a_router_reads_instance_state():
    """Folding applies a step's prefills before the step ends, so it is off when something
    outside the instance could look in between (a state-reading router; a watched decision
    point): least-loaded folds nothing, round-robin does, and both match stepping one by one."""
    reqs = [Request(i, 0.21 * i, 300 + 7 * i, 40 + i) for i in range(40)]
    w = Workload.from_requests(reqs)
    spec = make_spec()
    for router, folds in (("least-loaded", False), ("round-robin", True)):
        fast = simulate(w, spec, "fcfs", n_instances=2, router=router, options=InstanceOptions(check_invariants=True))
        slow = simulate(w, spec, "fcfs", n_instances=2, router=router, options=InstanceOptions(fast_forward=False))
        assert (fast.stats["folded_steps"] > 0) == folds
        pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
        assert summary_to_json(fast.summary) == summary_to_json(slow.summary)


def test_round_robin_stretches_run_to_each_instance_own_next_arrival():
    """With round-robin routing a stretch stops at the instance's own next arrival, not the
    cluster's: same records, summary and occupancy as a router that does not say so, and as no
    fast-forward, in fewer events."""
    from kvsched.envs.sim.cluster import Cluster
    from kvsched.policies.base import make_policy

    rng = np.random.default_rng(3)
    n = 90
    arr = np.cumsum(rng.exponential(0.05, n))
    w = Workload.from_requests([Request(i, float(a), int(rng.integers(50, 400)), int(rng.integers(20, 200)))
                                for i, a in enumerate(arr)])
    spec = make_spec()

    class PlainRoundRobin:  # the same choices, without arrivals_until
        name = "round-robin"  # (the summary names the router)

        def bind(self, n_instances, seed):
            self.next = 0

        def route(self, table):
            self.next += 1
            return (self.next - 1) % len(table)

    def plain_round_robin():
        return PlainRoundRobin()

    def run_cluster(router=None, ff=True):
        c = Cluster([spec] * 3, lambda: make_policy("fcfs"), router=router,
                    options=InstanceOptions(fast_forward=ff, check_invariants=True))
        return c.run(w)

    own = run_cluster()
    shared = run_cluster(plain_round_robin())
    slow = run_cluster(ff=False)
    for other in (shared, slow):
        pd.testing.assert_frame_equal(own.records, other.records, check_exact=True)
        assert summary_to_json(own.summary) == summary_to_json(other.summary)
        pd.testing.assert_frame_equal(own.occupancy, other.occupancy, check_exact=True)
    assert own.stats["steps"] == shared.stats["steps"]
    assert own.stats["events"] < 0.8 * shared.stats["events"]
    assert own.stats["fast_forward_stretches"] < shared.stats["fast_forward_stretches"]


@pytest.mark.parametrize("n_instances", [1, 2])
def test_instance_state_at_a_time_point_is_the_same_with_fast_forward(n_instances):
    """``run_until_decision(until_s=t)`` returns at a "time" point where the caller reads the
    instances (Knobs-v0 observes HBM in use every interval). A decode stretch planned before t
    ran past it and had allocated the blocks of its steps after t, so HBM in use there was
    higher than stepping one by one (Knobs-v0's observation differed with fast-forward). No
    stretch runs past the caller's stop time now: the state at every time point, and the
    results, equal stepping one by one, and stretches still run between the points."""
    from kvsched.envs.sim.cluster import Cluster, DecisionWatch
    from kvsched.experiments.bench import fixed_length_poisson
    from kvsched.policies.base import make_policy

    w = fixed_length_poisson(300, 10.0, 800, 400, seed=1, name="blis-300")

    def states(ff):
        c = Cluster([make_spec()] * n_instances, lambda: make_policy("fcfs"),
                    options=InstanceOptions(fast_forward=ff))
        c.start(w, DecisionWatch())
        seen = []
        for k in range(1, 200):
            point = c.run_until_decision(k * 0.37)
            seen.append([(i.hbm.used_blocks, i.hbm.available_blocks, len(i.running), len(i.waiting))
                         for i in c.instances])
            if point is None:
                break
        return seen, c.result()

    (fast, fast_res), (slow, slow_res) = states(True), states(False)
    assert len(fast) > 50 and fast == slow
    pd.testing.assert_frame_equal(fast_res.records, slow_res.records, check_exact=True)
    assert fast_res.stats["fast_forward_steps"] > 0.5 * fast_res.stats["steps"]


@pytest.mark.parametrize("policy", ["lars", "sarathi"])
def test_fold_keeps_the_running_order_under_a_stall_free_policy(policy):
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


def test_fold_declines_a_plan_out_of_running_order_but_folds_in_order():
    """Sarathi with two partial prefills: the plan [1, 2, 0] is out of running order [1, 0, 2]
    (not folded), with no partial-prefill limit the same workload folds; both exact."""
    w = Workload.from_requests([Request(0, 0.0, 300, 20), Request(1, 0.001, 10, 30), Request(2, 0.002, 20, 30)])
    folded = {}
    for mp in (None, 2):
        spec = make_spec(max_num_batched_tokens=64, max_num_partial_prefills=mp, max_long_partial_prefills=mp or 1)
        folded[mp] = three_way(w, [spec], policy="sarathi")
    assert folded == {None: 1, 2: 0}


def test_fold_runs_through_a_decode_finishing_at_the_step_end():
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
    res, _ = run_cluster(build(rows), [spec])
    r = res.records.set_index("request_id")
    assert r.loc[0, "finish_s"] == r.loc[2, "first_token_s"]  # A finishes at B's admission step end
    assert r.loc[0, "finish_s"] > 1.0 > r.loc[1, "first_token_s"] and r.loc[2, "finish_s"] > 2.0
    assert r.loc[1, "prefix_hit_tokens"] == 224 and r.loc[2, "first_token_s"] < r.loc[1, "finish_s"]
    assert three_way(build(rows), [spec]) == 1  # that step (the others have an arrival inside)


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
    mp = draw(hst.sampled_from([None, 1, 2, 3, 4])) if chunked else None
    spec_kw = dict(
        hbm_kv_blocks=hbm, block_size_tokens=bs, max_model_len=mml, enable_chunked_prefill=chunked,
        max_num_batched_tokens=draw(hst.sampled_from([8, 33, 64, 512])) if chunked else mml,
        max_num_seqs=draw(hst.sampled_from([1, 2, 3, 64])),
        long_prefill_token_threshold=draw(hst.sampled_from([0, 40])) if chunked else 0,
        max_num_partial_prefills=mp, max_long_partial_prefills=draw(hst.integers(1, mp or 1)),
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
                                    {"admission_preemption": "cost-gated", "admission_victim_min_tokens": 1},
                                    {"admit_while_swapped": True}]))
    return dict(rows=rows, specs=specs, policy=policy, params=params, oracle=draw(hst.booleans()),
                seg=draw(hst.sampled_from([bs, 2 * bs])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=cases())
def test_fold_is_exact_across_policies_tiers_and_instances(case):
    """Every policy (oracle lengths or not, admission preemption, admission while swapped),
    chunked or whole prefills, partial-prefill limits or none, tiny budgets and KV caches with recompute/swap/offload
    preemption, prefix caching with shared prefixes and the single free queue, one to three
    (heterogeneous) round-robin instances: fold on == fold off == one by one."""
    try:
        three_way(build(case["rows"], case["seg"]), case["specs"], policy=case["policy"], params=case["params"],
                  oracle=case["oracle"])
    except Stuck:
        reject()


def test_fold_is_exact_when_arrivals_land_on_step_ends():
    """Arrivals placed exactly at step ends of an earlier run (first-token and finish times; no
    front-end delay, so the engine sees them then): the fold must not run past such an arrival."""
    rng = np.random.default_rng(3)
    spec = make_spec(hbm_kv_blocks=150, max_num_batched_tokens=64, cost=NO_FRONT_END, cache_decode_blocks=True)
    total = 0
    for _ in range(6):
        rows = [(float(rng.integers(0, 10)) * 0.05, int(rng.integers(1, 400)), int(rng.integers(1, 40)),
                 int(rng.integers(0, 3))) for _ in range(10)]
        res, _ = run_cluster(build(rows), [spec])
        times = np.concatenate([res.records.first_token_s.to_numpy(), res.records.finish_s.to_numpy()])
        rows += [(float(t), int(rng.integers(1, 300)), int(rng.integers(2, 30)), int(rng.integers(0, 3)))
                 for t in rng.choice(times, 6)]
        rows.sort(key=lambda r: r[0])
        total += three_way(build(rows), [spec])
    assert total > 0


def test_fast_forward_identity_holds_with_pnm_resident_decodes_in_long_stretches():
    """Long decode stretches with requests on PNM and on the GPU together (the hybrid step in
    the vectorised stretch), and a request whose context crosses the threshold mid-stretch."""
    reqs = [Request(0, 0.0, 3000, 600), Request(1, 0.0, 900, 1500), Request(2, 0.5, 200, 700),
            Request(3, 1.0, 2200, 500)]
    w = Workload.from_requests(reqs)
    sp = literature_spec(hbm_kv_blocks=2000, pnm=pnm_tier(5000))
    params = dict(length_threshold_tokens=2048)
    fast = run_policy(w, sp, "pnm", params)
    slow = run_policy(w, sp, "pnm", params, ff=False)
    assert fast.stats["fast_forward_steps"] > 1000 and fast.stats["pnm_migrations"] == 3
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)


@pytest.mark.parametrize("router, mode, delay", [("rr", "recompute", 0.0), ("llm-d", "swap", 0.05),
                                                 ("dynamo", "recompute", 0.05)])
def test_shared_tier_fast_forward_identical_under_pressure(router, mode, delay):
    """A 60-block pool and 100-block instances: pool evictions, fetches and preemptions (swap or
    recompute) during fetches. Fast-forward on and off give byte-identical results, and blocks are
    conserved in every tier and the pool after every step. (Before the fix a decode stretch ran
    while a request waited for KV, although a pool write landing mid-stretch could let it in by a
    fetch.)"""
    w = _mixed_prefix_workload()
    bb = MODEL_BLOCK_BYTES
    spec = routing_spec(hbm_kv_blocks=100, max_num_batched_tokens=512, preemption_mode=mode,
                     dram_kv_bytes=200 * bb if mode == "swap" else 0)
    shared = SharedKVSpec(capacity_bytes=60 * bb)
    runs = [cluster(3, router, spec=spec, fast_forward=ff, shared_kv=shared, router_delay_s=delay).run(w)
            for ff in (True, False)]
    k = runs[0].summary["shared_kv"]
    assert k["fetches"] > 0 and k["evicted_segments"] > 0 and runs[0].stats["preemptions"] > 0
    assert runs[0].stats["fast_forward_stretches"] > 0
    assert summary_to_json(runs[0].summary) == summary_to_json(runs[1].summary)
    assert runs[0].records.equals(runs[1].records)
