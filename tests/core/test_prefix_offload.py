"""Lower tiers as prefix caches (kvsched.envs.sim.prefix_offload): a returning prompt finds its
prefix below HBM, write-through with no reuse only costs link time, blocks are conserved with
prefixes and swapped blocks mixed, fast-forward equals stepping, Belady bounds the policies, the
spec refuses what cannot work."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from simkit import assert_identical, build_workload, growing_sessions, make_spec, run

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.prefix_offload import EVICTION_POLICIES, WRITE_POLICIES, PrefixOffloadSpec
from kvsched.envs.sim.specs import instance_spec_from_dict, instance_spec_to_dict
from kvsched.runner.simulate import simulate

SEG = 32  # tokens per prefix segment (2 blocks of 16)
DRAM = 2.0e9


def _returning_turn(prompt=2048, fillers=4, back_at=20.0):
    """A prompt at t=0, ``fillers`` unrelated prompts that push it out of a small HBM, then the same
    prompt plus 64 tokens (its next turn) at ``back_at``, alone on the instance."""
    rows = [(0.0, prompt, 4, 1)]
    rows += [(1.0 + 2.0 * i, prompt, 4, 2 + i) for i in range(fillers)]
    rows.append((back_at, prompt + 64, 4, 1))
    return build_workload(rows, seg_tokens=SEG)


def _spec(**kw):
    return make_spec(hbm_kv_blocks=400, max_num_batched_tokens=8192, dram_kv_bytes=DRAM, **kw)


def test_a_returning_turn_loads_its_prefix_from_dram_and_its_ttft_falls_by_the_recompute_avoided():
    w = _returning_turn()
    plain = run(w, _spec())
    cached = run(w, _spec(prefix_offload=PrefixOffloadSpec(tiers=("dram",))))
    last = lambda r: r.records.set_index("request_id").loc[len(w) - 1]  # noqa: E731
    assert last(plain)["prefix_hit_tokens"] == 0  # HBM evicted the first turn's blocks
    dram = cached.summary["prefix_tiers"]["tiers"]["dram"]
    assert dram["hit_tokens"] == 2048 and dram["loads"] == 1
    ttft = lambda r: last(r)["first_token_s"] - last(r)["arrival_s"]  # noqa: E731
    # what it saves: the prefill of 2,112 tokens minus (loading 2,048 + prefilling 64); both runs
    # start the turn on an idle instance, so the difference is the model's own figures
    inst_cost = _cost(_spec())
    blocks = 2048 // 16
    load_s = float(inst_cost.transfer_time_s(blocks, _spec().pcie_link))
    expected = float(inst_cost.prefill_time_s(2112, 0)) - load_s - float(inst_cost.prefill_time_s(2112, 2048))
    assert expected > 0
    assert ttft(plain) - ttft(cached) == pytest.approx(expected, rel=0.02)


def _cost(spec):
    from kvsched.envs.sim.cost_model import CostModel

    return CostModel(spec)


def test_write_through_to_a_tier_nobody_reads_costs_link_time_and_never_improves_ttft():
    """No prompt is ever reused: every segment is written down (PCIe bytes, tier capacity), none
    is loaded, and every request is served exactly as without the tier (writes are asynchronous)."""
    rows = [(0.2 * i, 1024, 16, 10 + i) for i in range(40)]
    w = build_workload(rows, seg_tokens=SEG)
    plain = run(w, _spec())
    cached = run(w, _spec(prefix_offload=PrefixOffloadSpec(tiers=("dram",))))
    dram = cached.summary["prefix_tiers"]["tiers"]["dram"]
    assert dram["bytes_written"] > 0 and dram["loads"] == 0 and dram["hit_tokens"] == 0
    assert cached.stats["link_bytes"]["pcie_d2h"] == dram["bytes_written"]
    cols = ["request_id", "first_token_s", "finish_s"]
    assert plain.records[cols].equals(cached.records[cols])


def test_decode_blocks_are_written_too_when_not_prompt_only_and_never_hit():
    w = _returning_turn()
    prompt_only = run(w, _spec(prefix_offload=PrefixOffloadSpec()))
    with_decode = run(w, _spec(prefix_offload=PrefixOffloadSpec(offload_prompt_only=False)))
    a, b = (r.summary["prefix_tiers"]["tiers"]["dram"] for r in (prompt_only, with_decode))
    assert b["bytes_written"] > a["bytes_written"] and b["hit_tokens"] == a["hit_tokens"]


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_every_write_policy_lets_the_returning_turn_hit_below_hbm(write_policy):
    w = _returning_turn(back_at=25.0)
    # selective: the first turn's prefix must be used twice; a second turn before the fillers does it
    if write_policy == "write_through_selective":
        w = build_workload([(0.0, 2048, 4, 1), (0.5, 2048 + 32, 4, 1)]
                           + [(1.0 + 2.0 * i, 2048, 4, 2 + i) for i in range(4)] + [(25.0, 2112, 4, 1)], SEG)
    r = run(w, _spec(prefix_offload=PrefixOffloadSpec(write_policy=write_policy)))
    assert r.summary["prefix_tiers"]["tiers"]["dram"]["hit_tokens"] >= 2048


def test_a_selective_write_waits_for_the_second_use():
    w = _returning_turn()  # the first turn's prefix is used once before HBM evicts it
    r = run(w, _spec(prefix_offload=PrefixOffloadSpec(write_policy="write_through_selective")))
    dram = r.summary["prefix_tiers"]["tiers"]["dram"]
    assert dram["writes"] == 0 and dram["hit_tokens"] == 0


def test_a_swap_takes_room_from_cached_prefixes_never_the_reverse():
    """DRAM full of cached prefixes; preemptions swap out there anyway (evicting prefixes)."""
    rows = [(0.05 * i, 1500, 300, 1 + i) for i in range(60)]
    w = build_workload(rows, seg_tokens=SEG)
    spec = make_spec(hbm_kv_blocks=600, max_num_batched_tokens=2048, dram_kv_bytes=400 * 16 * 131072,
                     preemption_mode="swap", prefix_offload=PrefixOffloadSpec())
    r = run(w, spec)
    dram = r.summary["prefix_tiers"]["tiers"]["dram"]
    assert r.stats["preemptions"] > 0 and dram["evicted_segments"] > 0
    assert r.records["preemptions"].sum() == r.stats["preemptions"]


POLICIES = hst.builds(
    PrefixOffloadSpec,
    tiers=hst.sampled_from([("dram",), ("dram", "nvme"), ("nvme",)]),
    write_policy=hst.sampled_from(WRITE_POLICIES),
    eviction=hst.sampled_from(EVICTION_POLICIES),
    load_policy=hst.sampled_from(("cost", "always")),
    offload_prompt_only=hst.booleans(),
)




@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(po=POLICIES, seed=hst.integers(0, 10_000), mode=hst.sampled_from(("recompute", "swap", "offload")))
def test_blocks_are_conserved_in_every_tier_with_prefixes_and_swapped_blocks_mixed(po, seed, mode):
    """Every event: each tier's free + cached + used blocks equal its capacity, the cached blocks
    are the store's, the swapped ones are the requests' (check_invariants); and the run ends."""
    spec = make_spec(hbm_kv_blocks=260, max_num_batched_tokens=512, dram_kv_bytes=120 * 16 * 131072,
                     nvme_kv_bytes=300 * 16 * 131072, preemption_mode=mode, prefix_offload=po)
    r = run(growing_sessions(seed), spec, check=True)
    assert len(r.records) == 40


@pytest.mark.parametrize("po", [PrefixOffloadSpec(), PrefixOffloadSpec(write_policy="write_back"),
                                PrefixOffloadSpec(tiers=("dram", "nvme"), eviction=("session", "clairvoyant"),
                                                  write_policy="write_back"),
                                PrefixOffloadSpec(tiers=("dram", "nvme"), eviction="lfu",
                                                  write_policy="write_through_selective")],
                         ids=["through", "back", "back-two-tiers", "selective-lfu"])
def test_fast_forward_equals_stepping_with_tiers_caching(po):
    spec = make_spec(hbm_kv_blocks=260, max_num_batched_tokens=512, dram_kv_bytes=60 * 16 * 131072,
                     nvme_kv_bytes=200 * 16 * 131072, prefix_offload=po)
    w = growing_sessions(7, n=60)
    assert_identical(run(w, spec, fast_forward=True), run(w, spec, fast_forward=False))


def test_the_clairvoyant_order_evicts_the_farthest_next_use_first():
    """Belady's rule as implemented: the entry whose next arrival is farthest (never: first) goes
    first, the earliest stored among equals, and a next use that has passed is looked up again."""
    from kvsched.envs.sim.prefix_offload import _Clairvoyant

    future = {10: [5.0], 11: [5.0], 12: [9.0], 13: [], 14: [1.0, 20.0]}

    def next_use(key, now):
        later = [t for t in future[key] if t > now]
        return later[0] if later else float("inf")

    order = _Clairvoyant(next_use)
    entries = {}
    for k in future:
        order.add(k, None, 0.0)
        entries[k] = None
    victims = []
    for _ in range(5):
        v = order.victim(entries, 2.0)  # at 2 s, key 14's use at 1 s has passed: next is 20 s
        order.remove(v)
        del entries[v]
        victims.append(v)
    assert victims == [13, 14, 12, 10, 11]


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    (dict(tiers=()), "tiers"), (dict(tiers=("dram", "dram")), "tiers"), (dict(tiers=("hbm",)), "tiers"),
    (dict(write_policy="later"), "write_policy"), (dict(eviction="mru"), "eviction"),
    (dict(tiers=("dram", "nvme"), eviction=("lru",)), "eviction"), (dict(write_threshold=0), "write_threshold"),
    (dict(load_policy="never"), "load_policy"), (dict(session_keep_s=0), "session_keep_s"),
    (dict(offload_prompt_only="yes"), "offload_prompt_only"),
])
def test_a_bad_prefix_offload_spec_is_refused_naming_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        PrefixOffloadSpec(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(prefix_offload=PrefixOffloadSpec(tiers=("nvme",))), "capacity"),           # no NVMe tier
    (dict(dram_kv_bytes=DRAM, nvme_kv_bytes=DRAM, prefix_offload=PrefixOffloadSpec(tiers=("nvme", "dram"))),
     "top down"),
    (dict(dram_kv_bytes=DRAM, enable_prefix_caching=False, prefix_offload=PrefixOffloadSpec()), "prefix_caching"),
    (dict(dram_kv_bytes=DRAM, prefix_offload=PrefixOffloadSpec(tiers=("cxl",))), "a tier of this instance"),
])
def test_an_instance_refuses_prefix_tiers_it_cannot_have(kw, match):
    with pytest.raises(ConfigError, match=match):
        make_spec(**kw)


def test_prefix_offload_round_trips_through_yaml_and_refuses_unknown_keys():
    spec = _spec(prefix_offload=PrefixOffloadSpec(tiers=("dram",), eviction="session", write_policy="write_back"))
    d = instance_spec_to_dict(spec)
    assert instance_spec_from_dict(d).prefix_offload == spec.prefix_offload
    d["prefix_offload"] = {"tiers": ["dram"], "evict": "lru"}
    with pytest.raises(ConfigError, match="unknown key 'evict'"):
        instance_spec_from_dict(d)


def test_without_prefix_offload_nothing_changes_and_no_summary_block_appears():
    w = _returning_turn()
    a = run(w, _spec())
    b = simulate(w, dataclasses.replace(_spec(), prefix_offload=None), options=InstanceOptions(check_invariants=True))
    assert_identical(a, b)
    assert "prefix_tiers" not in a.summary


def _returning_storm(n=8, p=1024, extra=4096):
    """n prompts, then all n return at once with a longer prompt (the breaker's storm)."""
    rows = [(0.5 * i, p, 4, i + 1) for i in range(n)] + [(40.0, p + extra, 64, i + 1) for i in range(n)]
    return build_workload(rows, seg_tokens=SEG)


@pytest.mark.parametrize("limit", [1, 2])
def test_loads_respect_the_partial_prefill_limit(limit):
    """A load leaves its request an unfinished prefill: admitting it counts against
    max_num_partial_prefills like a chunk that leaves the prompt unfinished."""
    from kvsched.envs.sim.step_plan import is_unfinished_prefill
    from kvsched.runner.simulate import build_cluster

    spec = make_spec(hbm_kv_blocks=2000, max_num_batched_tokens=512, dram_kv_bytes=4000 * 2**21,
                     prefix_offload=PrefixOffloadSpec(load_policy="always"), max_num_partial_prefills=limit)
    c = build_cluster([spec], "fcfs", {}, options=InstanceOptions(fast_forward=False, check_invariants=True))
    inst = c.instances[0]
    most = [0]
    orig = inst.complete_step

    def counting(t):
        r = orig(t)
        most[0] = max(most[0], sum(1 for s in inst.running if s.status == 1 and is_unfinished_prefill(s)))
        return r

    inst.complete_step = counting
    c.start(_returning_storm())
    assert c.run_until_decision(until_s=1000) is None  # served
    assert 1 <= most[0] <= limit
    assert c.result().summary["prefix_tiers"]["tiers"]["dram"]["loads"] > 0


def test_a_loaded_prefix_counts_in_its_requests_bytes_moved():
    w = _returning_turn()
    r = run(w, _spec(prefix_offload=PrefixOffloadSpec()))
    dram = r.summary["prefix_tiers"]["tiers"]["dram"]
    assert dram["bytes_loaded"] > 0
    assert r.records["bytes_dram_to_hbm"].sum() == dram["bytes_loaded"]
    assert r.summary["classes"]["all"]["bytes_moved"]["dram_to_hbm"] == dram["bytes_loaded"]


@pytest.mark.parametrize("kw, match", [
    (dict(write_policy="write_through", write_threshold=5), "write_threshold"),
    (dict(write_policy="write_through_selective", write_threshold=10**30), "write_threshold"),
])
def test_a_write_threshold_nobody_reads_or_out_of_range_is_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        PrefixOffloadSpec(**kw)


def test_an_extra_tier_without_capacity_is_named_by_its_own_field():
    from kvsched.envs.sim.hardware import CXL_LINK
    from kvsched.envs.sim.tiers import TierSpec

    tier = TierSpec("cxl", 0.0, ("prefix",), "hbm", CXL_LINK, CXL_LINK)
    with pytest.raises(ConfigError, match=r"extra_tiers\[cxl\]\.capacity_bytes"):
        make_spec(extra_tiers=(tier,), prefix_offload=PrefixOffloadSpec(tiers=("cxl",)))
