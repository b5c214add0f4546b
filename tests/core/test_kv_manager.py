"""The KV manager of an instance (envs/sim/kv_manager.py): the HBM prefix cache (lookup, hits
across requests vs a request's own work, registration), frees in vLLM V1's order, swaps between
tiers over the right links with their byte counters, and the round-trip costs of each tier."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError, KvschedError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.kv_manager import KVManager
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import SharedPrefixConfig, generate
from kvsched.runner.simulate import simulate
from simkit import BLOCK_BYTES, make_spec, routing_spec, run, state


def cfg(**kw) -> SharedPrefixConfig:
    base = dict(num_groups=3, users_per_group=2, system_prompt_len=40, question_len=50, output_len=8,
                stages=[(4.0, 5.0), (10.0, 2.0)])
    base.update(kw)
    return SharedPrefixConfig(**base)


def manager(**kw) -> KVManager:
    spec = make_spec(**kw)
    return KVManager(spec, CostModel(spec))


def resident(kv: KVManager, rid: int, prompt: int, hashes=(), seg=32):
    """A request that computed its whole prompt in HBM, its full segments registered."""
    st = state(rid, prompt, hashes=hashes, seg=seg if hashes else 0)
    need = kv.blocks_for(prompt)
    assert kv.allocate(need)
    st.private_blocks = need
    st.computed = prompt
    kv.register_segments(st, 0.0)
    return st


def test_prefix_cache_hits_across_requests_not_self():
    seg = 512
    shared = tuple(range(4))  # 4 x 512 tokens of shared system prompt
    reqs = [
        Request(0, 0.0, 4 * seg + 100, 5, prefix_hashes=shared + (99,), hash_block_tokens=seg),
        Request(1, 10.0, 4 * seg + 300, 5, prefix_hashes=shared + (77,), hash_block_tokens=seg),
    ]
    res = run(Workload.from_requests(reqs), make_spec())
    r = res.records.set_index("request_id")
    assert r.loc[0, "prefix_hit_tokens"] == 0
    assert r.loc[1, "prefix_hit_tokens"] == 4 * seg
    # caching off: no hits
    res_off = run(Workload.from_requests(reqs), make_spec(enable_prefix_caching=False))
    assert res_off.records.prefix_hit_tokens.sum() == 0
    # the hit shortens request 1's prefill, so its TTFT drops
    assert r.loc[1, "first_token_s"] - 10.0 < res_off.records.set_index("request_id").loc[1, "first_token_s"] - 10.0


def test_prefix_cache_hit_needs_the_same_position():
    """Prefix hashes mean "equal hashes at equal positions mean reusable KV" (Request docs).

    Defect (envs/sim/kv_cache.py ``cached_prefix_segments``): the lookup only asks whether
    the hash is cached anywhere. Request B's *first* 512 tokens carry hash 6, which request A
    registered for its *second* 512 tokens; B gets a 512-token hit on KV computed for a
    different position (and a shorter TTFT it should not get).

    Expected: B's first segment matches nothing at position 0, so B has 0 prefix-hit tokens
    (or the inconsistent workload is rejected with a clear error).
    """
    w = Workload.from_requests([
        Request(0, 0.0, 1024, 2, prefix_hashes=(5, 6), hash_block_tokens=512),
        Request(1, 10.0, 1100, 2, prefix_hashes=(6, 9, 10), hash_block_tokens=512),
    ])
    try:
        res = run(w, make_spec(max_num_batched_tokens=2048))
    except KvschedError:
        return
    r = res.records.set_index("request_id")
    assert r.loc[1, "prefix_hit_tokens"] == 0


def test_prefix_hits_are_counted_once_not_at_every_readmission():
    """Six requests share a 320-token prefix on a 60-block cache, so they get preempted
    (recompute) and re-admitted.

    Defect (envs/sim/instance.py ``_admit``: ``st.prefix_hit_tokens += st.seg_tokens`` on
    every admission): a request that is re-admitted after a preemption counts its hit again,
    so requests report 640 prefix-hit tokens out of a 340-token prompt and the summary's
    ``prefix.hit_rate`` is 1.41 (141 % of prompt tokens came from the cache).

    Expected: a request's prefix-hit tokens never exceed its prompt, and the hit rate is a
    fraction in [0, 1] (either count a request's hit once, or divide by all prefilled tokens).
    """
    seg = 32
    shared = tuple(range(10))
    reqs = [Request(i, 0.0, 10 * seg + 20, 150, prefix_hashes=shared, hash_block_tokens=seg)
            for i in range(6)]
    res = run(Workload.from_requests(reqs), make_spec(hbm_kv_blocks=60, max_num_batched_tokens=2048))
    rec = res.records
    assert (rec.status == "finished").all()
    assert rec.preemptions.sum() > 0  # the scenario does exercise re-admission
    assert (rec.prefix_hit_tokens <= rec.prompt_tokens).all(), rec[["prompt_tokens", "prefix_hit_tokens"]]
    assert 0.0 <= res.summary["classes"]["all"]["prefix"]["hit_rate"] <= 1.0


def test_prefix_hit_rate_counts_only_reuse_across_requests():
    """Two requests with their own prefixes on a 60-block cache: B (admitted second) is preempted by
    recompute, its registered segments stay cached, and at re-admission it finds them again. That
    is its own work restored: its recomputed tokens drop by the 320 cached tokens, but it is not a
    prefix hit. Request C, later, reuses A's prefix: a hit, counted once."""
    seg = 32
    reqs = [Request(0, 0.0, 10 * seg, 300, prefix_hashes=tuple(range(10)), hash_block_tokens=seg),
            Request(1, 0.001, 10 * seg, 300, prefix_hashes=tuple(range(100, 110)), hash_block_tokens=seg),
            Request(2, 100.0, 10 * seg + 20, 5, prefix_hashes=tuple(range(10)) + (55,), hash_block_tokens=seg)]
    w = Workload.from_requests(reqs)
    out = {}
    for caching in (True, False):
        spec = routing_spec(hbm_kv_blocks=60, max_num_batched_tokens=512, enable_prefix_caching=caching)
        out[caching] = simulate(w, spec, options=InstanceOptions(check_invariants=True))
    on = out[True].records.set_index("request_id")
    off = out[False].records.set_index("request_id")
    assert on.loc[1, "preemptions"] >= 1 and off.loc[1, "preemptions"] == on.loc[1, "preemptions"]
    assert on.loc[1, "recomputed_tokens"] == off.loc[1, "recomputed_tokens"] - 10 * seg  # found its own blocks
    assert on.loc[1, "prefix_hit_tokens"] == 0 and on.loc[0, "prefix_hit_tokens"] == 0
    assert on.loc[2, "prefix_hit_tokens"] == 10 * seg
    total_prompt = int(on["prompt_tokens"].sum())
    assert out[True].summary["classes"]["all"]["prefix"]["hit_rate"] == pytest.approx(10 * seg / total_prompt)


def test_cached_decode_blocks_evict_round_robin_prompts_from_a_small_cache():
    # 8 prompts of 100 + 300 tokens sent round-robin, 320 output tokens each, 260 KV blocks
    c = cfg(num_groups=4, users_per_group=2, system_prompt_len=100, question_len=300, output_len=320,
            stages=[(2.0, 12.0)])

    def second_round_hits(cache_decode_blocks: bool, blocks: int) -> set:
        spec = InstanceSpec(model=get_model("Llama-2-7B"), gpu=get_gpu("H100-SXM"), max_num_batched_tokens=2048,
                            max_num_seqs=128, max_model_len=1024, hbm_kv_blocks=blocks, cost=CostParams(),
                            cache_decode_blocks=cache_decode_blocks)
        return set(simulate(generate(c, 0), spec).records["prefix_hit_tokens"].iloc[c.num_users:])

    # simple pool: every repeat hits all full blocks but the last (399 // 16 * 16)
    assert second_round_hits(False, 260) == {384}
    # vLLM V1: finished requests' output blocks age with the prompts and push the questions out;
    # only the system prompts (6 blocks, shared by the two users of a group) survive
    assert second_round_hits(True, 260) == {96}
    # with room for prompts and outputs both modes hit everything
    assert second_round_hits(True, 300) == {384}
    with pytest.raises(ConfigError, match="cache_decode_blocks"):
        InstanceSpec(model=get_model("Llama-2-7B"), gpu=get_gpu("H100-SXM"), cache_decode_blocks="yes")


def test_free_with_the_single_free_queue_releases_the_tail_first():
    """vLLM V1 frees a request's blocks in reverse: its private (partial) block ages oldest, then
    its prefix segments from the last to the root, so the root segment is evicted last."""
    kv = manager(hbm_kv_blocks=12, cache_decode_blocks=True)
    st = resident(kv, 0, 100, hashes=(1, 2, 3))  # 7 blocks: 3 segments of 2 + 1 private
    h0, h1, h2 = st.hashes
    assert st.shared == [h0, h1, h2] and st.private_blocks == 1 and kv.hbm.free_blocks == 5
    kv.free(st)
    assert st.shared == [] and st.shared_blocks == 0 and st.private_blocks == 0
    assert kv.hbm.used_blocks == 0 and kv.hbm.evictable_blocks == 7
    assert kv.allocate(5) and kv.allocate(1)  # the free blocks, then the private block's run
    assert set(kv.hbm.segments) == {h0, h1, h2}
    assert kv.allocate(1) and set(kv.hbm.segments) == {h0, h1}  # the last segment goes first
    assert kv.allocate(2) and set(kv.hbm.segments) == {h0}
    kv.hbm.check()


def test_free_without_the_single_free_queue_releases_the_tail_first_by_default():
    """vLLM V1's order in kvsched's separate free pool too: the root segment, which a follow-up
    sharing the prompt needs first, is evicted last (a public report's follow-up hit 0 tokens)."""
    kv = manager(hbm_kv_blocks=12, cache_decode_blocks=False)
    st = resident(kv, 0, 100, hashes=(1, 2, 3))
    h0, h1, h2 = st.hashes
    kv.free(st)
    assert kv.hbm.free_blocks == 6 and kv.hbm.evictable_blocks == 6  # the private block is free at once
    assert kv.allocate(6) and kv.allocate(1)
    assert set(kv.hbm.segments) == {h0, h1}  # the last segment was released first: evicted first
    assert kv.cached_prefix(st, 100)[0] == 2  # a follow-up still hits the two leading segments


def test_head_first_freeing_reproduces_kvsched_0_1_where_a_follow_up_hits_nothing():
    kv = manager(hbm_kv_blocks=12, cache_decode_blocks=False, kv_free_order="head_first")
    st = resident(kv, 0, 100, hashes=(1, 2, 3))
    h0, h1, h2 = st.hashes
    kv.free(st)
    assert kv.allocate(6) and kv.allocate(1)
    assert set(kv.hbm.segments) == {h1, h2}  # the root segment was released first: evicted first
    assert kv.cached_prefix(st, 100)[0] == 0  # the leading run is broken: 0 tokens hit
    with pytest.raises(ConfigError, match="kv_free_order"):
        manager(hbm_kv_blocks=12, kv_free_order="random")


def test_swap_to_dram_crosses_pcie_both_ways_and_counts_bytes():
    kv = manager(hbm_kv_blocks=64, dram_kv_bytes=32 * BLOCK_BYTES, preemption_mode="swap")
    st = resident(kv, 0, 80)  # 5 private blocks
    pcie = kv.spec.pcie_link
    out = kv.cost.transfer_time_s(5, pcie)
    tier, first_end = kv.swap_out(st, 5, "swap", 1.0)
    assert tier.name == "dram" and first_end == st.ready_s == 1.0 + out
    assert kv.hbm.used_blocks == 0 and kv.by_name["dram"].pool.used_blocks == 5
    assert (st.lower_tier, st.lower_blocks, st.tier) == ("dram", 5, "dram")
    assert st.tier_bytes == {"hbm_to_dram": 5 * BLOCK_BYTES}
    assert kv.links["pcie_d2h"].bytes_moved == 5 * BLOCK_BYTES and kv.links["pcie_h2d"].bytes_moved == 0
    assert kv.allocate(5)  # the caller allocates the HBM blocks first
    landed = kv.swap_in(st, 1.0)  # the copy out has not landed yet: the copy back waits for it
    assert landed == st.ready_s + kv.cost.transfer_time_s(5, pcie)
    assert st.tier_bytes == {"hbm_to_dram": 5 * BLOCK_BYTES, "dram_to_hbm": 5 * BLOCK_BYTES}
    assert kv.links["pcie_h2d"].bytes_moved == 5 * BLOCK_BYTES
    kv.release_lower(st)
    assert kv.by_name["dram"].pool.used_blocks == 0 and (st.lower_blocks, st.lower_tier) == (0, "")


def test_swap_falls_back_to_nvme_through_dram_and_back_over_the_read_links():
    kv = manager(hbm_kv_blocks=64, dram_kv_bytes=2 * BLOCK_BYTES, nvme_kv_bytes=32 * BLOCK_BYTES,
                 preemption_mode="swap")
    assert [t.name for t in kv.swap_tiers("swap")] == ["dram", "nvme"]
    assert [t.name for t in kv.swap_tiers("offload")] == ["nvme"] and kv.swap_tiers("recompute") == []
    st = resident(kv, 0, 80)
    spec = kv.spec
    hop1 = kv.cost.transfer_time_s(5, spec.pcie_link)
    hop2 = kv.cost.transfer_time_s(5, spec.nvme_write)
    tier, first_end = kv.swap_out(st, 5, "swap", 0.0)  # DRAM holds 2 blocks: NVMe takes the 5
    assert tier.name == "nvme" and kv.by_name["dram"].pool.used_blocks == 0
    assert first_end == hop1 and st.ready_s == hop1 + hop2  # the step waits for the first hop only
    nb = 5 * BLOCK_BYTES
    assert kv.links["pcie_d2h"].bytes_moved == nb and kv.links["nvme_write"].bytes_moved == nb
    assert st.tier_bytes == {"hbm_to_nvme": nb}
    assert kv.allocate(5)
    landed = kv.swap_in(st, 10.0)
    assert landed == 10.0 + kv.cost.transfer_time_s(5, spec.nvme_read) + kv.cost.transfer_time_s(5, spec.pcie_link)
    assert kv.links["nvme_read"].bytes_moved == nb and kv.links["pcie_h2d"].bytes_moved == nb
    assert st.tier_bytes["nvme_to_hbm"] == nb


def test_swap_out_with_no_room_anywhere_frees_hbm_and_moves_nothing():
    kv = manager(hbm_kv_blocks=64, dram_kv_bytes=2 * BLOCK_BYTES, preemption_mode="swap")
    st = resident(kv, 0, 80)
    assert kv.swap_out(st, 5, "swap", 3.0) == (None, 3.0)
    assert kv.hbm.used_blocks == 0 and st.lower_blocks == 0 and st.tier_bytes is None
    assert all(q.bytes_moved == 0 for q in kv.links.values())


def test_round_trip_costs_per_tier_with_room():
    kv = manager(hbm_kv_blocks=64, dram_kv_bytes=10 * BLOCK_BYTES, nvme_kv_bytes=100 * BLOCK_BYTES,
                 preemption_mode="swap")
    spec = kv.spec
    b = kv.cost.kv_bytes_per_token_per_gpu * kv.bs  # per-rank bytes of one block
    blocks = np.array([4, 50])
    costs = kv.round_trip_costs(blocks)
    assert list(costs) == ["swap", "offload"]
    pcie, w, r = spec.pcie_link, spec.nvme_write, spec.nvme_read
    dram = 2.0 * (pcie.latency_s + 4 * b / pcie.bytes_per_s)
    assert costs["swap"][0] == pytest.approx(dram, rel=1e-12) and costs["swap"][1] == math.inf  # 50 > 10 blocks
    nvme = [2.0 * (pcie.latency_s + n * b / pcie.bytes_per_s) + w.latency_s + r.latency_s
            + n * b * (1 / w.bytes_per_s + 1 / r.bytes_per_s) for n in (4, 50)]
    assert costs["offload"].tolist() == pytest.approx(nvme, rel=1e-12)
    assert manager(hbm_kv_blocks=64).round_trip_costs(blocks) == {}  # no lower tier with capacity


def test_cached_prefix_leaves_at_least_one_token_to_compute():
    kv = manager(hbm_kv_blocks=64)
    a = resident(kv, 0, 64, hashes=(1, 2))  # exactly two 32-token segments, both cached
    b = state(1, 64, hashes=(1, 2), seg=32)
    assert kv.cached_prefix(b, 64) == (1, 1)  # the second would leave nothing to compute
    c = state(2, 65, hashes=(1, 2), seg=32)
    assert kv.cached_prefix(c, 65) == (2, 2)
    assert kv.cached_prefix(state(3, 65), 65) == (0, 0)  # no hashes
    off = manager(hbm_kv_blocks=64, enable_prefix_caching=False)
    assert kv.blocks_for(17) == 2 and off.cached_prefix(c, 65) == (0, 0)
    assert a.shared_blocks == 4


def test_acquired_prefix_counts_reuse_once_and_own_work_as_self_hits():
    kv = manager(hbm_kv_blocks=64)
    a = resident(kv, 0, 64, hashes=(1, 2))
    b = state(1, 100, hashes=(1, 2), seg=32)
    kv.acquire_prefix(b, b.hashes[:2])
    assert b.prefix_hit_tokens == 64 and b.self_hit_tokens == 0 and kv.hbm.segment_refs(a.hashes[0]) == 2
    b.admissions = 1  # re-admitted after a preemption: what it finds again is not reuse
    kv.acquire_prefix(b, b.hashes[:1])
    assert b.prefix_hit_tokens == 64 and b.self_hit_tokens == 32
    a.admissions = 0
    kv.acquire_prefix(a, a.hashes[:1])  # its own segment, even at the first admission
    assert a.prefix_hit_tokens == 0 and a.self_hit_tokens == 32


def test_a_segment_cached_by_another_request_stays_a_private_copy():
    kv = manager(hbm_kv_blocks=64)
    resident(kv, 0, 64, hashes=(1, 2))
    twin = resident(kv, 1, 64, hashes=(1, 2))  # computed the same prefix itself
    assert twin.shared == [] and twin.private_blocks == 4 and twin.next_seg == 2
    published = []
    kv.publish = lambda key, n, creator, now: published.append((key, n, creator))
    third = resident(kv, 2, 40, hashes=(5,))
    assert third.shared == list(third.hashes) and published == [(third.hashes[0], 2, 2)]


def test_manager_lists_tiers_links_and_codes_in_order():
    kv = manager(hbm_kv_blocks=64, dram_kv_bytes=8 * BLOCK_BYTES, preemption_mode="swap")
    assert [t.name for t in kv.tiers] == ["hbm", "dram", "nvme", "pnm"]
    assert kv.capacity_blocks() == (64, 8, 0, 0) and kv.used_blocks() == (0, 0, 0, 0)
    assert list(kv.links) == ["pcie_d2h", "pcie_h2d", "nvme_write", "nvme_read", "pnm_link"]
    assert kv.tier_codes == {"hbm": 0, "dram": 1, "nvme": 2, "pnm": 3, "": -1}
    assert [t.name for t in kv.by_name["nvme"].path] == ["dram", "nvme"] and kv.tiers[0].path == []
    assert kv.block_bytes == BLOCK_BYTES
