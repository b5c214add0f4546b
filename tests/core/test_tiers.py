"""Tiers as data (envs/sim/tiers.py): a new KV tier is one spec entry.

The walk-through adds a toy CXL memory-expander tier between HBM and host DRAM, reached over its
own link, as a swap target. Nothing else is written for it: the KV manager builds its pool and
link queues, preemption sends victims there under its own mode and prices the round trip, and
records, occupancy, the run's link bytes, router tables and feature tables iterate the tier list.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.routing import RouterTable, StateProvider
from kvsched.envs.sim.specs import (InstanceSpec, LinkSpec, TierSpec, get_gpu, get_model, instance_spec_from_dict,
                                    instance_spec_to_dict)
from kvsched.envs.sim.tiers import tier_path
from kvsched.policies.base import make_policy
from kvsched.runner.scenario import Scenario

BLOCK_BYTES = 131072 * 16  # Llama-3.1-8B bf16 KV per 16-token block
CXL_LINK = LinkSpec("cxl-toy", 64e9, 2e-6)


def cxl_tier(blocks: int = 400) -> TierSpec:
    return TierSpec("cxl", blocks * BLOCK_BYTES, ("swapped",), "hbm", CXL_LINK, CXL_LINK)


def spec(**kw) -> InstanceSpec:
    base = dict(model=get_model("Llama-3.1-8B"), gpu=get_gpu("H100-SXM"), hbm_kv_blocks=160,
                max_num_batched_tokens=2048, max_num_seqs=64, extra_tiers=(cxl_tier(),), preemption_mode="cxl")
    base.update(kw)
    return InstanceSpec(**base)


def workload():
    sc = Scenario(name="tiny-hbm", trace=None, seed=3,
                  synthetic={"rate_per_s": 10.0, "duration_s": 8, "prompt_median_tokens": 400,
                             "output_median_tokens": 120, "output_max_tokens": 300})
    return sc.workload()


def run(sp: InstanceSpec, fast_forward: bool = True, policy: str = "fcfs", params: dict | None = None):
    c = Cluster([sp], lambda: make_policy(policy, params), options=InstanceOptions(check_invariants=True,
                                                                                 fast_forward=fast_forward))
    return c, c.run(workload())


def test_the_tier_list_orders_standard_extra_and_pnm_tiers():
    sp = spec()
    assert [t.name for t in sp.tiers] == ["hbm", "dram", "nvme", "cxl", "pnm"]
    assert sp.tier_capacity_blocks[3] == 400 and sp.num_dram_blocks == 0
    assert [sp.tiers[i].name for i in tier_path(sp.tiers, 2)] == ["dram", "nvme"]  # NVMe is staged through DRAM
    assert [sp.tiers[i].name for i in tier_path(sp.tiers, 3)] == ["cxl"]


def test_a_toy_tier_is_a_swap_target_with_every_column_and_counter():
    c, res = run(spec())
    rec = res.records
    assert res.stats["preemptions"] > 0
    assert {"bytes_hbm_to_cxl", "bytes_cxl_to_hbm"} <= set(rec.columns)
    assert rec["bytes_hbm_to_cxl"].sum() > 0 and rec["bytes_cxl_to_hbm"].sum() > 0
    assert rec["bytes_hbm_to_dram"].sum() == 0  # its own mode goes to its own tier
    assert res.stats["link_bytes"]["cxl_write"] == rec["bytes_hbm_to_cxl"].sum()
    assert res.stats["link_bytes"]["cxl_read"] == rec["bytes_cxl_to_hbm"].sum()
    occ = res.occupancy
    assert occ["capacity_blocks_cxl"].max() == 400 and occ["used_blocks_cxl"].max() > 0
    tiers = res.summary["kv_occupancy"]["tiers"]
    assert list(tiers) == ["hbm", "dram", "nvme", "pnm", "cxl"] and tiers["cxl"]["max_used_blocks"] > 0
    assert res.summary["classes"]["all"]["bytes_moved"]["hbm_to_cxl"] == rec["bytes_hbm_to_cxl"].sum()
    assert (rec["status"] == "finished").sum() >= 70


def test_a_toy_tier_is_byte_identical_with_and_without_fast_forward():
    _, fast = run(spec())
    _, slow = run(spec(), fast_forward=False)
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)


def test_tier_aware_preemption_prices_the_toy_tier_and_feature_tables_code_it():
    c, res = run(spec(preemption_mode="recompute"), policy="fcfs", params={"tier_aware_preemption": True})
    inst = c.instances[0]
    assert res.stats["link_bytes"]["cxl_write"] > 0  # the cheapest mode per freed block was the toy tier
    st = next(iter(inst.kv.tiers))  # noqa: F841  (the list is public)
    costs = inst.kv.round_trip_costs(np.array([10, 10_000]))
    assert list(costs) == ["cxl"]  # DRAM and NVMe have no capacity: not offered
    per_block = inst.cost.kv_bytes_per_token_per_gpu * inst.bs
    assert costs["cxl"][0] == 2.0 * (CXL_LINK.latency_s + 10 * per_block / CXL_LINK.bytes_per_s)
    assert costs["cxl"][1] == np.inf  # more blocks than the tier holds
    assert inst.kv.tier_codes == {"hbm": 0, "dram": 1, "nvme": 2, "cxl": 3, "pnm": 4, "": -1}


def test_routers_see_the_toy_tiers_free_blocks():
    c, _ = run(spec())
    view = StateProvider(0.0).view(c.instances, 0.0)
    assert "free_blocks_cxl" in view.columns and view.free_blocks_cxl.tolist() == [400]
    from kvsched.envs.sim.request import Request, RequestState
    table = RouterTable(view, RequestState(Request(0, 0.0, 10, 2), 16, 0), 0.0)
    assert table.free_blocks_cxl.tolist() == [400]


def test_a_toy_tier_round_trips_through_yaml_and_bad_entries_are_named():
    sp = spec()
    d = instance_spec_to_dict(sp)
    assert d["extra_tiers"][0]["name"] == "cxl"
    assert instance_spec_from_dict(d) == sp
    d2 = {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 160,
          "extra_tiers": [{"name": "cxl", "capacity_bytes": "1e9", "write_link": "pcie5", "read_link": "pcie5"}]}
    assert instance_spec_from_dict(d2).tiers[3].write_link.name == "pcie5"
    with pytest.raises(ConfigError, match="extra_tiers\\[0\\]: missing key"):
        instance_spec_from_dict({**d2, "extra_tiers": [{"name": "cxl", "capacity_bytes": 1e9}]})
    with pytest.raises(ConfigError, match="a tier name other than the standard ones"):
        spec(extra_tiers=(TierSpec("dram", 1e9, ("swapped",), "hbm", CXL_LINK, CXL_LINK),))
    with pytest.raises(ConfigError, match="TierSpec.name"):
        TierSpec("CXL!", 1e9, ("swapped",), "hbm", CXL_LINK, CXL_LINK)
    with pytest.raises(ConfigError, match="holds"):
        TierSpec("cxl", 1e9, ("everything",), "hbm", CXL_LINK, CXL_LINK)
    with pytest.raises(ConfigError, match="parent 'nowhere'"):
        spec(extra_tiers=(TierSpec("cxl", 1e9, ("swapped",), "nowhere", CXL_LINK, CXL_LINK),))
    with pytest.raises(ConfigError, match="preemption_mode"):
        spec(extra_tiers=(cxl_tier(0),))  # its mode, but no capacity


@pytest.mark.parametrize("holds", [("prefix",), ("swapped", "prefix")])
def test_an_extra_tier_holds_prefixes_only_when_prefix_offload_lists_it(holds):
    # running / pnm_resident are refused by TierSpec itself (the next test); a declared prefix
    # content nobody fills is refused, a listed one is a prefix cache (kvsched.envs.sim.prefix_offload)
    from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec

    tier = TierSpec("cxl", 1e9, holds, "hbm", CXL_LINK, CXL_LINK)
    mode = "cxl" if "swapped" in holds else "recompute"
    with pytest.raises(ConfigError, match=r"extra_tiers\[cxl\]\.holds.*prefix_offload\.tiers"):
        spec(extra_tiers=(tier,), preemption_mode=mode)
    s = spec(extra_tiers=(tier,), preemption_mode=mode, prefix_offload=PrefixOffloadSpec(tiers=("cxl",)))
    assert "prefix" in s.tiers[3].holds


def test_a_preemption_mode_on_a_tier_that_holds_no_swapped_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"TierSpec\(.cxl.\)\.preemption_mode.*only a swap target"):
        TierSpec("cxl", 1e9, ("prefix",), "hbm", CXL_LINK, CXL_LINK, preemption_mode="cxl")


@pytest.mark.parametrize("mode", ["migrate", "recompute"])
def test_a_tier_may_not_take_a_reserved_preemption_mode(mode):
    # a tier named "migrate" took the mode "migrate" by default: preemption then called the PNM
    # migration without a PNM tier, which refused, and make_room looped forever
    named = TierSpec(mode, 400 * BLOCK_BYTES, ("swapped",), "hbm", CXL_LINK, CXL_LINK)
    with pytest.raises(ConfigError, match=f"preemption_mode '{mode}', which .* already means"):
        spec(extra_tiers=(named,), preemption_mode=mode)
    explicit = TierSpec("cxl", 400 * BLOCK_BYTES, ("swapped",), "hbm", CXL_LINK, CXL_LINK, preemption_mode=mode)
    with pytest.raises(ConfigError, match=f"preemption_mode '{mode}', which .* already means"):
        spec(extra_tiers=(explicit,), preemption_mode="recompute")
    renamed = TierSpec(mode, 400 * BLOCK_BYTES, ("swapped",), "hbm", CXL_LINK, CXL_LINK, preemption_mode="far")
    assert spec(extra_tiers=(renamed,), preemption_mode="far").tiers[3].name == mode


def test_an_extra_tier_may_not_claim_what_only_hbm_or_pnm_hold_nor_a_mode_without_swapped_blocks():
    """Accepted before, and silently nothing: an extra tier "holding" running requests or
    PNM-resident KV (only HBM computes, only the PNM tier's migrations place KV there), or a
    preemption mode on a tier that holds no swapped blocks (the spec's preemption_mode could name
    it; victims then skipped it and went to the later swap tiers, or recomputed)."""
    for holds in (("running",), ("swapped", "pnm_resident")):
        with pytest.raises(ConfigError, match="holds=.* only the '(hbm|pnm)' tier holds it"):
            TierSpec("cxl", 1e9, holds, "hbm", CXL_LINK, CXL_LINK)
    with pytest.raises(ConfigError, match="preemption_mode='cxl' is not allowed: expected '' for a tier"):
        TierSpec("cxl", 1e9, ("prefix",), "hbm", CXL_LINK, CXL_LINK, preemption_mode="cxl")
    assert TierSpec("cxl", 1e9, ("prefix",), "hbm", CXL_LINK, CXL_LINK).preemption_mode == ""
    assert [t.holds for t in spec().tiers] == [("running", "prefix"), ("swapped",), ("swapped",), ("swapped",),
                                               ("pnm_resident",)]


def test_an_extra_tier_taking_a_standard_tiers_mode_is_named_as_the_duplicate():
    tier = TierSpec("cxl", 1e9, ("swapped",), "hbm", CXL_LINK, CXL_LINK, preemption_mode="swap")
    with pytest.raises(ConfigError, match=r"extra_tiers\[cxl\]\.preemption_mode='swap'.*a mode of its own"):
        spec(extra_tiers=(tier,))


def test_a_tier_listing_a_content_twice_is_refused():
    with pytest.raises(ConfigError, match="distinct contents"):
        TierSpec("cxl", 1e9, ("prefix", "prefix"), "hbm", CXL_LINK, CXL_LINK)
