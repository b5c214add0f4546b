"""The processing-near-memory tier's mechanism (envs/sim/pnm_migration.py): background and
preemption migrations over the PNM link, the request waiting for its KV, a full PNM pool, a
PNM resident preempted by recompute, and the one-way migration cost."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.instance import TRANSFER_EVENT, InstanceOptions
from kvsched.envs.sim.request import WAITING, Request, RequestState, Workload
from kvsched.envs.sim.specs import CostParams, get_pnm
from kvsched.policies.base import make_policy
from kvsched.runner.simulate import simulate
from simkit import BLOCK_BYTES, make_instance, place_running, pnm_tier, short_only, state, with_longs
from simkit import literature_spec as spec


def pnm_instance(pnm_blocks=50):
    return make_instance(spec(hbm_kv_blocks=200, pnm=pnm_tier(pnm_blocks)), policy="pnm")


def decode(inst, rid, computed):
    """A ready decode holding its KV in HBM (prompt ``computed``, one token out)."""
    return place_running(inst, state(rid, computed, output=50), computed, generated=1)


def test_migration_takes_link_time_and_the_request_waits_for_its_kv():
    """A 40k-token prompt (threshold 32k) goes to PNM once its prefill is done: its KV crosses
    the CXL link (2,500 blocks), it emits no token until the copy lands, then it decodes at
    the hybrid step time."""
    no_fe = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)
    sp = spec(pnm=get_pnm("cxl-pnm-ocp2025"), cost=no_fe)
    w = Workload.from_requests([Request(0, 0.0, 40_000, 4)])
    res = simulate(w, sp, "pnm", options=InstanceOptions(check_invariants=True))
    r = res.records.iloc[0]
    cm = CostModel(sp)
    t_link = 10e-6 + 2500 * BLOCK_BYTES / 50e9
    assert r.bytes_hbm_to_pnm == 2500 * BLOCK_BYTES
    assert res.stats["pnm_migrations"] == 1 and res.stats["link_bytes"]["pnm_link"] == 2500 * BLOCK_BYTES
    # token 2 comes one link copy plus one hybrid step after token 1
    first_gap = t_link + cm.pnm_step_time_fast(1.0, 0.0, 0.0, 40_000.0, 1.0)
    assert r.max_itl_s == pytest.approx(first_gap, rel=1e-9)
    later = [cm.pnm_step_time_fast(1.0, 0.0, 0.0, 40_000.0 + k, 1.0) for k in (1, 2)]
    assert r.finish_s - r.first_token_s == pytest.approx(first_gap + sum(later), rel=1e-9)
    # GPU-only: no link, no gap
    gpu = simulate(w, spec(cost=no_fe), "fcfs").records.iloc[0]
    assert gpu.bytes_hbm_to_pnm == 0 and gpu.max_itl_s < t_link / 5
    occ = res.summary["kv_occupancy"]["tiers"]["pnm"]
    assert occ["max_used_blocks"] == 2501  # grown by one block on PNM (40,003 tokens)


def test_tier_aware_preemption_migrates_long_decoding_victims_to_pnm():
    """With a PNM tier, tier-aware preemption prices "migrate" (a one-way link copy, for a
    decoding request) against recompute: long decoding victims go to PNM instead of being
    recomputed; a request still in prefill cannot (only decode attention runs near memory)."""
    sp = spec(hbm_kv_blocks=20_000, pnm=get_pnm("cxl-pnm-ocp2025-x10"))
    inst = Cluster([sp], lambda: make_policy("fcfs", {"tier_aware_preemption": True})).instances[0]
    states = []
    for rid, ctx, gen in ((0, 1_000, 0), (1, 120_000, 5), (2, 120_000, 0)):
        st = RequestState(Request(rid, 0.0, ctx + 1 - gen, 10), 16, 0)
        st.computed = ctx
        st.generated = gen
        st.private_blocks = -(-ctx // 16)
        states.append(st)
    costs = inst.preemptor.costs(states)
    assert set(costs) == {"recompute", "migrate"}
    assert np.isinf(costs["migrate"][[0, 2]]).all()  # prefill-phase rows
    assert costs["migrate"][1] < costs["recompute"][1] / 10
    from kvsched.envs.sim.features import FeatureTable

    row, mode = inst.policy.choose_preemption(FeatureTable(states, 0.0), costs, "recompute")
    assert (row, mode) == (1, "migrate")

    s = short_only(rate=3.0, dur=40.0)
    rng = np.random.default_rng(11)
    mix = with_longs(s, np.sort(rng.uniform(2, 30, 6)), rng.integers(20_000, 40_000, 6), out=400)
    small = dict(hbm_kv_blocks=5_000)
    recompute = simulate(mix, spec(**small), "fcfs")
    migrate = Cluster([spec(**small, pnm=get_pnm("cxl-pnm-ocp2025-x10"))],
                      lambda: make_policy("fcfs", {"tier_aware_preemption": True}),
                      options=InstanceOptions(check_invariants=True)).run(mix)
    rc, mg = recompute.summary["classes"]["all"], migrate.summary["classes"]["all"]
    assert (migrate.records.status == "finished").all()
    assert mg["bytes_moved"]["hbm_to_pnm"] > 0 and migrate.stats["pnm_migrations"] > 0
    assert mg["preemptions"]["recomputed_tokens"] < rc["preemptions"]["recomputed_tokens"] / 10
    assert migrate.summary["classes"]["long"]["e2e_s"]["mean"] < recompute.summary["classes"]["long"]["e2e_s"]["mean"]


def test_background_migration_keeps_the_hbm_blocks_until_the_copy_lands():
    inst = pnm_instance()
    st = decode(inst, 0, 100)  # 7 blocks
    link = inst.kv.by_name["pnm"].links()[0]
    assert inst.pnm_migrator.migrate(st, 1.0, background=True)
    end = 1.0 + inst.cost.transfer_time_s(7, link)
    assert st.ready_s == end and st.pnm_migrating and not st.on_pnm and st.pnm_blocks == 7
    assert st.hbm_blocks == 7 and inst.kv.hbm.used_blocks == 7 and inst.kv.pnm.used_blocks == 7
    assert inst.pending_events == [(end, TRANSFER_EVENT, st)] and inst.pnm_migrations == 1
    assert st.tier_bytes == {"hbm_to_pnm": 7 * BLOCK_BYTES} and inst.links["pnm_link"].bytes_moved == 7 * BLOCK_BYTES
    inst.check()
    inst.complete_transfer(st, end)  # landed: it decodes near memory, its HBM blocks go
    assert st.on_pnm and not st.pnm_migrating and st.tier == "pnm" and st.hbm_blocks == 0
    assert inst.kv.hbm.used_blocks == 0
    inst.check()


def test_migrate_mode_preemption_frees_hbm_at_once_and_the_step_waits():
    inst = pnm_instance()
    st = decode(inst, 0, 100)
    inst._step_ready_s = 1.0
    inst.preemptor.preempt(st, 1.0, "migrate")
    assert st.on_pnm and st.hbm_blocks == 0 and inst.kv.hbm.used_blocks == 0 and st in inst.running
    assert inst._step_ready_s == st.ready_s > 1.0 and st.preemptions == 1 and inst.preemptions == 1
    inst.check()


def test_no_migration_when_the_pool_cannot_hold_the_next_token_too():
    inst = pnm_instance(pnm_blocks=7)
    st = decode(inst, 0, 112)  # 7 full blocks: its next token needs an 8th
    assert not inst.pnm_migrator.migrate(st, 0.0, background=True)
    assert st.pnm_blocks == 0 and inst.kv.pnm.used_blocks == 0 and inst.pnm_migrations == 0
    ok = decode(inst, 1, 100)  # 7 blocks with room for its next token
    assert inst.pnm_migrator.migrate(ok, 0.0, background=True)


def test_a_resident_that_cannot_grow_in_a_full_pool_is_recomputed():
    inst = pnm_instance(pnm_blocks=7)
    st = decode(inst, 0, 100)
    inst.preemptor.preempt(st, 0.0, "migrate")
    queued = state(5, 10)
    inst.waiting.append(queued)
    inst.pnm_migrator.preempt_resident(st)
    assert st.status == WAITING and list(inst.waiting) == [st, queued] and st not in inst.running
    assert (st.computed, st.lost_tokens, st.pnm_blocks, st.on_pnm, st.tier) == (0, 100, 0, False, "hbm")
    assert inst.kv.pnm.used_blocks == 0 and st.preemptions == 2 and inst.preemptions == 2
    inst.check()


def test_migration_cost_is_the_one_way_link_copy_of_a_decode_and_inf_otherwise():
    inst = pnm_instance(pnm_blocks=10)
    d = decode(inst, 0, 100)
    p = place_running(inst, state(1, 300), 100)  # still in prefill
    big = decode(inst, 2, 200)  # 13 blocks: more than the pool holds
    tokens = np.array([100, 100, 200])
    costs = inst.pnm_migrator.migration_costs([d, p, big], tokens)
    link = inst.kv.by_name["pnm"].links()[0]
    want = link.latency_s + 7 * inst.cost.kv_bytes_per_token_per_gpu * 16 / link.bytes_per_s
    assert costs[0] == pytest.approx(want, rel=1e-12) and np.isinf(costs[1:]).all()
