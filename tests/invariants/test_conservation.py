"""Block conservation: in every tier at every step ``free + evictable + used == capacity``, and the
blocks in use equal what the requests hold (``InstanceOptions(check_invariants=True)`` runs
:func:`kvsched.envs.sim.invariants.check_instance` after every planned and completed step),
across policies, preemption modes, tiers (DRAM, NVMe, an extra tier, PNM), prefix caching and
budgets; every request ends finished with all its tokens or rejected with a reason.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsched.envs.sim import instance as instance_mod
from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import KvschedError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.kv_cache import BlockPool
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import LinkSpec, TierSpec
from kvsched.policies.base import make_policy, policy_names
from simkit import (BLOCK_BYTES, build_workload, literature_spec, make_spec, pnm_tier, request_lists, run, run_policy,
                    short_only)




@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=request_lists,
       hbm_blocks=hst.integers(110, 400),
       budget=hst.sampled_from([64, 256, 2048]),
       mode=hst.sampled_from(["recompute", "swap", "offload"]),
       threshold=hst.sampled_from([0, 128]),
       partial=hst.sampled_from([None, 1, 2]),
       max_seqs=hst.sampled_from([2, 64]))
def test_blocks_and_tokens_are_conserved_across_modes_and_budgets(rows, hbm_blocks, budget, mode, threshold,
                                                                   partial, max_seqs):
    w = build_workload(rows)
    spec = make_spec(hbm_kv_blocks=hbm_blocks, max_num_batched_tokens=budget,
                     dram_kv_bytes=60 * BLOCK_BYTES if mode == "swap" else 0,
                     nvme_kv_bytes=200 * BLOCK_BYTES if mode in ("swap", "offload") else 0,
                     preemption_mode=mode, long_prefill_token_threshold=threshold,
                     max_num_partial_prefills=partial, max_long_partial_prefills=1, max_num_seqs=max_seqs)
    fast = run(w, spec, fast_forward=True, check=True)  # check=True verifies conservation every step
    rec = fast.records
    # every request either finished with all its tokens or was rejected with a reason
    assert len(rec) == len(w)
    fin = rec[rec.status == "finished"]
    rej = rec[rec.status == "rejected"]
    assert (fin.generated_tokens == fin.output_tokens).all()
    assert (rej.reject_reason != "").all()
    assert (fin.first_token_s >= fin.arrival_s).all() and (fin.finish_s >= fin.first_token_s).all()
    # a request is rejected only when prompt + output exceed what HBM can hold (max_model_len)
    too_big = (rec.prompt_tokens + rec.output_tokens) > hbm_blocks * 16
    assert (too_big == (rec.status == "rejected")).all()
    slow = run(w, spec, fast_forward=False, check=False)
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)


def test_repeated_prefix_hashes_in_one_request_keep_the_kv_covered():
    """A request whose prefix hashes repeat (``(7, 7)``) is accepted by ``Request``, the
    workload constructors and the generic/Mooncake loaders.

    Defect (envs/sim/kv_cache.py ``cached_prefix_segments`` + instance.py ``_admit``): the
    prefix cache is keyed by the hash alone. The first request registers segment 7 once (the
    second copy stays private); a later request with hashes ``(7, 7, 8)`` then "hits" both of
    its first two segments, acquires the one cached segment twice and sets ``shared_blocks``
    to 64 while only 32 blocks back it. Its 1,100 tokens of KV are held in 37 HBM blocks, and
    ``check_invariants=True`` does not notice.

    Expected: either repeated hashes are rejected up front with a clear error, or the cache
    keeps each position separately so that the blocks in use always cover the KV held
    (here >= ceil(1100 / 16) = 69 blocks while the second request runs).
    """
    try:
        w = Workload.from_requests([
            Request(0, 0.0, 1024, 2, prefix_hashes=(7, 7), hash_block_tokens=512),
            Request(1, 10.0, 1100, 2, prefix_hashes=(7, 7, 8), hash_block_tokens=512),
        ])
        res = run(w, make_spec())
    except KvschedError as e:  # rejecting repeated hashes with a clear message is a fix too
        assert "hash" in str(e)
        return
    assert (res.records.status == "finished").all()
    need = math.ceil(1100 / 16)
    assert res.summary["kv_occupancy"]["tiers"]["hbm"]["max_used_blocks"] >= need


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=hst.lists(hst.tuples(hst.floats(0, 2.0, allow_nan=False), hst.integers(1, 600),
                                 hst.integers(1, 90), hst.integers(0, 2)), min_size=1, max_size=14),
       hbm=hst.integers(40, 160), pnm_blocks=hst.integers(1, 80), threshold=hst.integers(16, 500),
       wm=hst.sampled_from([0.0, 0.1, 0.5]), min_ctx=hst.sampled_from([0, 64, 300]),
       tier_aware=hst.booleans(), budget=hst.sampled_from([32, 512]), dram=hst.sampled_from([0, 30]))
def test_pnm_pool_blocks_are_conserved_and_fast_forward_exact(rows, hbm, pnm_blocks, threshold, wm, min_ctx,
                                                              tier_aware, budget, dram):
    """Random small workloads with a small PNM pool (so it fills and PNM-resident requests are
    preempted), low thresholds and watermarks, with and without tier-aware preemption (whose
    "migrate" mode then competes with recompute and swap): every block of every tier (PNM
    included) is accounted for at every step (check_invariants), every request finishes or is
    rejected (no livelock: this test found a request that re-migrated forever at its last prefill
    token), and fast-forward gives byte-identical records, summary and occupancy."""
    reqs = []
    for i, (a, p, o, g) in enumerate(rows):
        hashes = tuple(100 * g + k for k in range(p // 32)) if g else ()
        reqs.append(Request(i, a, p, o, prefix_hashes=hashes, hash_block_tokens=32 if hashes else 0))
    w = Workload.from_requests(reqs)
    sp = literature_spec(hbm_kv_blocks=hbm, max_num_batched_tokens=budget, max_num_seqs=16, pnm=pnm_tier(pnm_blocks),
              dram_kv_bytes=dram * BLOCK_BYTES)
    params = dict(length_threshold_tokens=threshold, low_watermark_fraction=wm,
                  watermark_min_context_tokens=min_ctx, tier_aware_preemption=tier_aware)
    fast = run_policy(w, sp, "pnm", params)
    rec = fast.records
    assert len(rec) == len(w)
    fin = rec[rec.status == "finished"]
    assert (fin.generated_tokens == fin.output_tokens).all()
    assert ((rec.status == "rejected") == (rec.prompt_tokens + rec.output_tokens > sp.model_len_limit)).all()
    assert rec.bytes_hbm_to_pnm.sum() == fast.stats["link_bytes"]["pnm_link"]
    slow = run_policy(w, sp, "pnm", params, ff=False, check=False)
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / register / acquire / release sequences on one HBM pool (prefix caching,
    either free-queue mode): conservation holds after every operation, an allocation is all or
    nothing, and the pool's holdings equal what the simulated holders hold."""

    single_free_queue = False

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool("hbm", 24, prefix_caching=True, single_free_queue=self.single_free_queue)
        self.private: list[int] = []  # private runs held, blocks each
        self.refs: dict[int, int] = {}  # segment -> references we hold
        self.next_key = 0

    @rule(n=hst.integers(0, 30))
    def allocate(self, n):
        before = (self.pool.free_blocks, self.pool.evictable_blocks, self.pool.used_blocks)
        ok = self.pool.allocate(n)
        if ok:
            if n:
                self.private.append(n)
        else:
            assert n > before[0] + before[1]
            assert (self.pool.free_blocks, self.pool.evictable_blocks, self.pool.used_blocks) == before

    @precondition(lambda self: self.private)
    @rule(data=hst.data())
    def register(self, data):
        i = data.draw(hst.integers(0, len(self.private) - 1))
        n = self.private[i]
        key = self.next_key
        self.next_key += 1
        if self.pool.register_segment(key, n, creator_id=0):
            self.private.pop(i)
            self.refs[key] = 1

    @precondition(lambda self: self.private)
    @rule(data=hst.data())
    def release_private(self, data):
        self.pool.release_private(self.private.pop(data.draw(hst.integers(0, len(self.private) - 1))))

    @precondition(lambda self: self.pool.segments)
    @rule(data=hst.data())
    def acquire(self, data):
        key = data.draw(hst.sampled_from(sorted(self.pool.segments)))
        self.pool.acquire_segment(key)
        self.refs[key] = self.refs.get(key, 0) + 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=hst.data())
    def release(self, data):
        key = data.draw(hst.sampled_from(sorted(k for k, r in self.refs.items() if r)))
        self.pool.release_segment(key)
        self.refs[key] -= 1

    @invariant()
    def conserved_and_held(self):
        self.pool.check()
        held_segments = sum(self.pool.segment_blocks(k) for k, r in self.refs.items() if r and k in self.pool.segments)
        assert self.pool.used_blocks == sum(self.private) + held_segments
        assert self.pool.total_refs() == sum(r for k, r in self.refs.items() if k in self.pool.segments)


class SingleFreeQueueBlockPoolMachine(BlockPoolMachine):
    """The same with vLLM V1's single LRU free queue (released private blocks age in the LRU)."""

    single_free_queue = True

TestBlockPoolConservation = BlockPoolMachine.TestCase
TestBlockPoolConservation.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSingleFreeQueueBlockPoolConservation = SingleFreeQueueBlockPoolMachine.TestCase
TestSingleFreeQueueBlockPoolConservation.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


CXL = LinkSpec("cxl-toy", 64e9, 2e-6)


@pytest.mark.parametrize("policy", policy_names())
def test_every_step_of_every_policy_is_checked_and_conserves_blocks(policy, monkeypatch):
    """Each reference policy on a tiny HBM, the preemption mode going round recompute, swap,
    offload and an extra tier, stepping one by one: the invariants are checked after every
    planned and every completed step (counted), none fails, and the run serves every request."""
    calls = []
    orig = instance_mod.check_instance

    def counting(inst):
        calls.append(inst.steps)
        orig(inst)

    monkeypatch.setattr(instance_mod, "check_instance", counting)
    modes = ["recompute", "swap", "offload", "cxl"]
    mode = modes[policy_names().index(policy) % len(modes)]
    kw = dict(hbm_kv_blocks=160, max_num_batched_tokens=2048, max_num_seqs=64, preemption_mode=mode,
              dram_kv_bytes=2e8, nvme_kv_bytes=1e9,
              extra_tiers=(TierSpec("cxl", 300 * BLOCK_BYTES, ("swapped",), "hbm", CXL, CXL),))
    sp = make_spec(**kw)
    w = short_only(rate=10.0, dur=4.0, seed=3)
    c = Cluster([sp], lambda: make_policy(policy), options=InstanceOptions(check_invariants=True, fast_forward=False))
    res = c.run(w)
    assert (res.records.status == "finished").all()
    assert res.stats["preemptions"] > 0 or policy == "nonpreemptive"
    assert len(calls) == 2 * res.stats["steps"]  # each step: once planned, once completed
