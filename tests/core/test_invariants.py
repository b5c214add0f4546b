"""The instance invariants (envs/sim/invariants.py): a consistent instance passes, and each kind
of planted inconsistency is caught with a message naming it."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.invariants import check_instance
from simkit import BLOCK_BYTES, make_instance, make_spec, place_running, pnm_tier, state
from simkit import literature_spec as spec


def consistent():
    """Two running requests, one holding a prefix segment another references too, one swapped
    request in DRAM."""
    inst = make_instance(make_spec(hbm_kv_blocks=64, dram_kv_bytes=20 * BLOCK_BYTES, preemption_mode="swap"))
    a = place_running(inst, state(0, 64, hashes=(1, 2), seg=32), 64)
    inst.kv.register_segments(a, 0.0)
    b = state(1, 40, hashes=(1,), seg=32)  # admitted with a hit on a's first segment
    inst.kv.acquire_prefix(b, b.hashes[:1])
    assert inst.kv.allocate(1)
    inst.admitter.take_residency(b, b.hashes[:1], 2, 1, 1, 40, 0.0)
    c = place_running(inst, state(2, 80), 80)
    inst.preemptor.preempt(c, 0.0, "swap")
    check_instance(inst)
    return inst, a, b, c


def test_a_consistent_instance_passes():
    inst, a, b, c = consistent()
    assert a.shared_blocks == 4 and b.shared == [a.hashes[0]] and c.lower_blocks == 5
    inst.check()


@pytest.mark.parametrize("plant, message", [
    (lambda inst, a, b, c: setattr(inst.kv.hbm, "free_blocks", inst.kv.hbm.free_blocks - 1), "!= capacity"),
    (lambda inst, a, b, c: setattr(a, "private_blocks", a.private_blocks + 1), "HBM used .* != private"),
    (lambda inst, a, b, c: b.shared.append(a.hashes[1]), "reference counts do not match holders"),
    (lambda inst, a, b, c: setattr(c, "lower_blocks", c.lower_blocks + 1), "dram used 5 != held 6"),
    (lambda inst, a, b, c: setattr(c, "pnm_blocks", 1), "pnm used 0 != held|swapped request holds PNM blocks"),
    (lambda inst, a, b, c: setattr(a, "computed", a.computed + 100), "fewer blocks than its KV tokens need"),
], ids=["pool-count", "hbm-holdings", "segment-refs", "lower-tier", "pnm-on-swapped", "too-few-blocks"])
def test_each_planted_inconsistency_is_caught(plant, message):
    inst, a, b, c = consistent()
    plant(inst, a, b, c)
    with pytest.raises(AssertionError, match=message):
        check_instance(inst)


def test_a_waiting_request_holding_pnm_blocks_is_caught():
    inst, a, b, c = consistent()
    w = state(9, 10)
    w.pnm_blocks = 2
    inst.waiting.append(w)
    with pytest.raises(AssertionError, match="waiting or swapped request holds PNM blocks"):
        check_instance(inst)


def test_a_pnm_resident_holding_hbm_blocks_is_caught():
    inst = make_instance(spec(hbm_kv_blocks=200, pnm=pnm_tier(50)), policy="pnm")
    st = place_running(inst, state(0, 100, output=50), 100, generated=1)
    inst.pnm_migrator.migrate(st, 0.0, background=False)
    check_instance(inst)
    assert inst.kv.allocate(1)
    st.private_blocks = 1
    with pytest.raises(AssertionError, match="on PNM holds HBM blocks"):
        check_instance(inst)
