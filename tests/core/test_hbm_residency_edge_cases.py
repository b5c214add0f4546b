"""Edge cases of HBM residency and prefetch (issue #21 item 3, adversarial review): expired HBM
keeps rejoin the LRU in one order whether a pass runs per step or once after a fast-forwarded
stretch; a decision point sees the same kept HBM blocks fast-forwarded or stepped; a prefetch
whose prefix lies in two tiers below the first reads every source before writing (its writes'
demotions may evict a source); a PNM stretch evicts nothing while HBM segments are kept."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as hst
from simkit import BLOCK_BYTES, assert_identical, build_workload, growing_sessions, make_spec, pnm_tier

from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.kv_cache import BlockPool
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.retention import RetentionDecision
from kvsched.envs.sim.specs import LinkSpec, TierSpec
from kvsched.policies.base import make_policy

MENU = (RetentionDecision("keep", 3.0, hbm="keep"), RetentionDecision(hbm="evict_first"),
        RetentionDecision("keep", 0.4, hbm="keep"), RetentionDecision(), RetentionDecision("drop"),
        RetentionDecision("keep", 0.05, hbm="keep"), RetentionDecision("keep", 0.2, hbm="keep"),
        RetentionDecision("demote"), RetentionDecision("keep", 1.0), None)


@settings(max_examples=60, deadline=None)
@given(keeps=hst.lists(hst.tuples(hst.lists(hst.integers(0, 7), min_size=1, max_size=3), hst.integers(1, 6)),
                       min_size=1, max_size=8),
       passes=hst.lists(hst.integers(0, 6), max_size=6))
def test_expired_hbm_keeps_rejoin_the_lru_in_one_order_however_the_passes_split_them(keeps, passes):
    """One pass per step (stepping) or one pass after a stretch (fast-forward) leave the same
    LRU order: a later deadline ahead of an earlier one, the first kept first among equals."""
    def pool():
        p = BlockPool("hbm", 16, prefix_caching=True)
        for h in range(8):
            assert p.allocate(2) and p.register_segment(h, 2, creator_id=h)
            p.release_segment(h)
        for hs, until in keeps:
            p.keep_segments(hs, float(until))
        return p

    stepped, once = pool(), pool()
    for t in sorted(passes):
        stepped.expire_kept(float(t))
    stepped.expire_kept(6.0)
    once.expire_kept(6.0)
    stepped.check()
    assert list(stepped._lru) == list(once._lru) and stepped.kept_blocks == once.kept_blocks == 0


def _keeps_expiring_inside_a_stretch(ff: bool):
    """Conversations 1 and 2 (8 segments each) finish at once and are kept in HBM for 0.5 s and
    1 s, while a 400-token decode runs alone (one stretch to the 2 s arrival); the 2 s prompt
    evicts from the LRU head, then both conversations return."""
    rows = [(0.0, 256, 2, 1), (0.0, 256, 2, 2), (0.05, 64, 400, 0), (2.0, 320, 2, 0), (3.0, 288, 2, 1),
            (3.1, 288, 2, 2)]
    spec = make_spec(hbm_kv_blocks=64, dram_kv_bytes=60 * BLOCK_BYTES, prefix_offload=PrefixOffloadSpec())
    keep = {0: RetentionDecision("keep", 0.5, hbm="keep"), 1: RetentionDecision("keep", 1.0, hbm="keep")}
    c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(check_invariants=ff, fast_forward=ff))
    c.start(build_workload(rows), DecisionWatch(residency=True))
    while (p := c.run_until_decision()) is not None:
        if p.request.rid in keep:
            c.retain(keep[p.request.rid])
    return c.result()


def test_fast_forward_equals_stepping_when_hbm_keeps_of_two_deadlines_expire_inside_one_stretch():
    ff = _keeps_expiring_inside_a_stretch(True)
    assert_identical(ff, _keeps_expiring_inside_a_stretch(False))
    hits = ff.records.set_index("request_id")["prefix_hit_tokens"]
    assert hits[4] < 256 or hits[5] < 256  # the 2 s prompt evicted one conversation's tail


def _lockstep(spec, seed: int, n: int = 40, policy: str = "fcfs", rng_seed: int | None = None) -> int:
    """Play the same random decisions (``rng_seed``, default ``seed``) fast-forwarded and stepped
    side by side; every decision point shows the same HBM (LRU order, kept segments); returns
    the points. Then the results are identical."""
    rng = random.Random(seed if rng_seed is None else rng_seed)
    w = growing_sessions(seed, n=n)
    cs = []
    for ff in (True, False):
        c = Cluster([spec], lambda: make_policy(policy), options=InstanceOptions(check_invariants=ff, fast_forward=ff))
        c.start(w, DecisionWatch(residency=True, prefetch=True))
        cs.append(c)
    points = 0
    while True:
        ps = [c.run_until_decision() for c in cs]
        if ps[0] is None:
            assert ps[1] is None
            break
        hbm = [c.instances[0].kv.hbm for c in cs]
        assert (ps[0].kind, ps[0].time_s, ps[0].request.rid) == (ps[1].kind, ps[1].time_s, ps[1].request.rid)
        assert list(hbm[0]._lru) == list(hbm[1]._lru) and hbm[0]._kept == hbm[1]._kept, f"point {points}"
        points += 1
        if ps[0].kind == "residency":
            d = MENU[rng.randrange(len(MENU))]
            if d is not None:
                for c in cs:
                    c.retain(d)
        elif rng.random() < 0.6:
            assert cs[0].prefetch() == cs[1].prefetch()
    res = cs[0].result()
    assert_identical(res, cs[1].result())
    served = int((res.records["reject_reason"].fillna("") == "").sum())
    assert points >= served  # a residency point per served request (a rejected one has none)
    return points


def test_a_decision_point_sees_the_same_hbm_keeps_fast_forwarded_or_stepped():
    """A keep whose deadline passed during a stretch has ended by the next decision point (no
    scheduling pass ran in between fast-forwarded; one did stepping)."""
    po = PrefixOffloadSpec(tiers=("dram", "nvme"), write_policy="write_back")
    spec = make_spec(hbm_kv_blocks=140, dram_kv_bytes=30 * BLOCK_BYTES, nvme_kv_bytes=150 * BLOCK_BYTES,
                     prefix_offload=po)
    assert _lockstep(spec, 7) > 40


def test_a_prefetch_from_two_tiers_below_the_first_reads_every_source_before_writing():
    """dram / nvme / disk: a returning prefix partly in NVMe, partly on disk; copying the NVMe
    part up to DRAM demotes DRAM entries down the tiers, which evicted a disk entry still to be
    read (a KeyError)."""
    link = LinkSpec("disk-toy", 2e9, 1e-4)
    disk = TierSpec("disk", 200 * BLOCK_BYTES, ("prefix",), "nvme", link, link)
    po = PrefixOffloadSpec(tiers=("dram", "nvme", "disk"))
    spec = make_spec(hbm_kv_blocks=140, dram_kv_bytes=30 * BLOCK_BYTES, nvme_kv_bytes=40 * BLOCK_BYTES,
                     extra_tiers=(disk,), prefix_offload=po)
    for seed in (1, 3):
        assert _lockstep(spec, seed) > 40


def test_a_pnm_stretch_evicts_nothing_while_hbm_segments_are_kept():
    """The PNM stretch planner allocated a stretch's blocks by evicting the LRU while keeps were
    about to expire (one-by-one stepping evicted the expired keep instead)."""
    spec = make_spec(hbm_kv_blocks=140, dram_kv_bytes=60 * BLOCK_BYTES, nvme_kv_bytes=150 * BLOCK_BYTES,
                     pnm=pnm_tier(200), prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme")))
    assert _lockstep(spec, 3, policy="pnm") > 40


def test_a_conversation_s_default_does_not_end_another_s_hbm_keep_of_a_shared_prefix():
    """Two conversations behind one system prompt (segments 1..4) finish in the same step; the
    first keeps its prompt in HBM, the second plays the default: the shared segments stay kept
    (the listed tiers' rule: entries another conversation keeps stay kept), the second's own go
    back to the LRU; its evict_first then moves only its own segments to the LRU head."""
    from kvsched.envs.sim.request import Request, Workload

    system = tuple(range(1, 5))
    reqs = [Request(0, 0.0, 256, 4, session_id=1, prefix_hashes=system + (11, 12, 13, 14), hash_block_tokens=32),
            Request(1, 0.0, 256, 4, session_id=2, prefix_hashes=system + (21, 22, 23, 24), hash_block_tokens=32)]
    spec = make_spec(hbm_kv_blocks=200, dram_kv_bytes=60 * BLOCK_BYTES, prefix_offload=PrefixOffloadSpec())
    for second in (RetentionDecision(), RetentionDecision(hbm="evict_first")):
        c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(check_invariants=True))
        c.start(Workload.from_requests(reqs), DecisionWatch(residency=True))
        p0, p1 = c.run_until_decision(), None
        assert p0.request.rid == 0
        c.retain(RetentionDecision("keep", 60.0, hbm="keep"))
        p1 = c.run_until_decision()
        assert p1.request.rid == 1 and p1.time_s == p0.time_s  # finished in the same step
        c.retain(second)
        hbm = c.instances[0].kv.hbm
        first, own = p0.request.hashes[:8], p1.request.hashes[4:8]  # chained keys
        assert p1.request.hashes[:4] == first[:4]
        assert all(hbm.kept_until(h) == p0.time_s + 60.0 for h in first)
        assert all(hbm.kept_until(h) is None for h in own)
        if second.hbm == "evict_first":
            assert list(hbm._lru)[:4] == list(own[::-1])  # only its own, tail first
        hbm.check()


_VARIANTS = {
    "write_back": dict(prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme"), write_policy="write_back")),
    "selective": dict(prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme"), write_policy="write_through_selective")),
    "fence": dict(prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme"), fence_pending_writes=True)),
    "one_free_queue": dict(cache_decode_blocks=True, prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme"))),
    "swap": dict(preemption_mode="swap", prefix_offload=PrefixOffloadSpec(tiers=("dram", "nvme"), eviction="session")),
}


@settings(max_examples=6, deadline=None)
@given(seed=hst.integers(0, 10_000), rng_seed=hst.integers(0, 10_000), variant=hst.sampled_from(sorted(_VARIANTS)))
def test_fast_forward_equals_stepping_under_any_mix_of_hbm_keeps_and_prefetches(seed, rng_seed, variant):
    spec = make_spec(hbm_kv_blocks=120, dram_kv_bytes=40 * BLOCK_BYTES, nvme_kv_bytes=150 * BLOCK_BYTES,
                     **_VARIANTS[variant])
    assert _lockstep(spec, seed, n=30, rng_seed=rng_seed) > 0


def test_a_returning_parallel_sampling_request_gets_one_prefetch_point():
    """A request with n = 2 whose prefix was demoted to NVMe: one prefetch point (its children
    share the prompt); prefetching copies the prefix to DRAM, where its admission loads it."""
    import dataclasses

    from kvsched.envs.sim.request import Workload

    rows = [(0.0, 1024, 2, 1)] + [(0.5 + 0.3 * i, 1024, 2, 10 + i) for i in range(4)]
    rows += [(20.0, 512, 300, 50), (20.3, 1088, 2, 1)]
    reqs = list(build_workload(rows))
    reqs[-1] = dataclasses.replace(reqs[-1], n=2)
    po = PrefixOffloadSpec(tiers=("dram", "nvme"), load_policy="always")
    spec = make_spec(hbm_kv_blocks=200, max_num_seqs=1, dram_kv_bytes=128 * BLOCK_BYTES,
                     nvme_kv_bytes=2000 * BLOCK_BYTES, prefix_offload=po)
    c = Cluster([spec], lambda: make_policy("fcfs"), options=InstanceOptions(check_invariants=True))
    c.start(Workload.from_requests(reqs), DecisionWatch(residency=True, prefetch=True))
    points = []
    while (p := c.run_until_decision()) is not None:
        if p.kind == "prefetch":
            points.append(p.request.req.parent_id)
            assert c.prefetch() == 1024 // 32
    assert points == [len(rows) - 1]
    tiers = c.result().summary["prefix_tiers"]["tiers"]
    assert tiers["nvme"]["prefetches"] == 1 and tiers["dram"]["hit_tokens"] >= 1024


def test_a_pnm_stretch_evicts_nothing_under_write_back_fast_forward_equals_stepping():
    """PNM with a write-back prefix tier: the PNM stretch planner allocated a stretch's blocks by
    evicting cached segments up front, whose write-back copies were then charged at the stretch's
    start instead of at their steps (found by the adversarial review; no decisions needed)."""
    for seed in (0, 2, 5):
        for hbm in (90, 140):
            w = growing_sessions(seed)
            spec = make_spec(hbm_kv_blocks=hbm, dram_kv_bytes=120 * BLOCK_BYTES, pnm=pnm_tier(200),
                             prefix_offload=PrefixOffloadSpec(write_policy="write_back"))
            runs = [Cluster([spec], lambda: make_policy("pnm"), options=InstanceOptions(fast_forward=ff)).run(w)
                    for ff in (True, False)]
            assert_identical(*runs)
