"""Admission (envs/sim/admission.py): waiting requests get residency in the policy's order until
the budget, the seats or the KV cache run out; a request that cannot get its blocks stops
admission (head-of-line), one refused for its partial prefill is skipped; the admitted request's
state; and the room check after an admission preemption pins the request's own prefix hit."""

from __future__ import annotations

import numpy as np

from kvsched.envs.sim.admission import ADMITTED, SKIP, STOP
from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import RUNNING, Request, Workload
from kvsched.envs.sim.step_plan import StepBuild
from kvsched.policies.fcfs import FCFS
from simkit import literature_spec, make_instance, make_spec, place_running, state


class _WaitingFirstNamesFirstEligible(FCFS):
    """Stall-free FCFS that orders waiting prefills before running ones and, when the head is
    blocked, preempts the first eligible running request (a legal choice of the policy hook)."""

    stall_free = True

    def order_prefills(self, table):
        return np.argsort(table.running, kind="stable")

    def choose_admission_preemption(self, running, eligible, *args):
        rows = np.flatnonzero(eligible)
        return (int(rows[0]), "recompute") if rows.size else None


def test_admission_recheck_pins_the_heads_own_prefix_hit_freed_by_the_victim():
    """After the policy's victim is preempted the instance re-checks that the blocked head now
    fits, but with the head's evictable prefix-hit blocks counted *before* the preemption: when
    the victim held (alone) the cached prefix the head hits, those segments become evictable,
    the stale check counts them as room, the head then pins them, and ``hbm.allocate`` fails
    with its result ignored: the head holds 32 blocks nobody allocated (``check()``:
    "HBM used 121 != private 89 + referenced segments 64"). The built-in gate does not pick such
    a victim (it asks for the head's whole prompt), but any policy may name an eligible row;
    the instance must re-count and keep the head waiting when it still does not fit."""
    from kvsched.policies.base import PolicyParams

    p = tuple(range(1000, 1016))  # a 1,024-token prefix (16 segments of 64 tokens)
    reqs = [Request(0, 0.0, 900, 500),  # fills HBM while it decodes
            # the victim: its first 1,024-token chunk is exactly the prefix (cached, held by it alone)
            Request(1, 0.0001, 2180, 10, prefix_hashes=p + tuple(range(2000, 2010)), hash_block_tokens=64),
            # the head: hits the prefix, needs 32 more blocks; 21 are free
            Request(2, 0.05, 1524, 20, prefix_hashes=p + tuple(range(3000, 3007)), hash_block_tokens=64)]
    w = Workload.from_requests(reqs, name="shared-prefix")
    sp = literature_spec(hbm_kv_blocks=142, max_model_len=2200, long_prefill_token_threshold=1024)
    params = PolicyParams(admission_preemption="always", admission_victim_min_tokens=1)
    res = Cluster([sp], lambda: _WaitingFirstNamesFirstEligible(params),
                  options=InstanceOptions(check_invariants=True)).run(w)  # check(): blocks add up
    assert res.stats["admission_preemptions"] >= 1  # the case under test happened
    assert (res.records.status == "finished").all()


def test_a_request_that_cannot_get_its_blocks_stops_admission_head_of_line():
    inst = make_instance(make_spec(hbm_kv_blocks=20))
    place_running(inst, state(9, 240), 240)  # 15 of 20 blocks
    big, small = state(0, 120), state(1, 30)  # 8 blocks (only 5 free), then 2 blocks
    inst.waiting.extend([big, small])
    step = StepBuild(inst.budget)
    assert inst.admitter.try_admit(big, step, 0.0) == STOP
    inst.admitter.admit_in_order([big, small], step, 0.0, keep_queue_order=True)
    assert list(inst.waiting) == [big, small] and step.plan == []  # the small one did not jump it
    assert inst.admitter.try_admit(small, StepBuild(inst.budget), 0.0) == ADMITTED  # it fits alone


def test_a_request_refused_for_a_partial_prefill_is_skipped_and_later_ones_go():
    spec = make_spec(max_num_batched_tokens=2048, long_prefill_token_threshold=600,
                     max_num_partial_prefills=2, max_long_partial_prefills=1)
    inst = make_instance(spec)
    a, b, c = state(0, 1000), state(1, 1000), state(2, 100)
    step = StepBuild(inst.budget)
    assert inst.admitter.try_admit(a, step, 0.0) == ADMITTED  # 600 tokens, partial and long
    assert inst.admitter.try_admit(b, step, 0.0) == SKIP  # a second long partial prefill
    assert b.status != RUNNING and b.computed == 0 and b.hbm_blocks == 0  # nothing taken
    assert inst.admitter.try_admit(c, step, 0.0) == ADMITTED


def test_admission_stops_when_the_seats_or_the_budget_are_taken():
    inst = make_instance(make_spec(max_num_seqs=1))
    place_running(inst, state(9, 10), 10)
    assert inst.admitter.try_admit(state(0, 10), StepBuild(inst.budget), 0.0) == STOP
    inst = make_instance(make_spec())
    step = StepBuild(inst.budget)
    step.budget = 0
    assert inst.admitter.try_admit(state(0, 10), step, 0.0) == STOP


def test_an_admitted_request_holds_its_blocks_and_counts_what_it_recomputes():
    inst = make_instance(make_spec(hbm_kv_blocks=64))
    st = state(0, 100)
    st.lost_tokens = 150  # preempted earlier by recompute after 150 tokens
    step = StepBuild(inst.budget)
    assert inst.admitter.try_admit(st, step, 2.5) == ADMITTED
    assert st.status == RUNNING and st.tier == "hbm" and st in inst.running and st.admissions == 1
    assert st.first_scheduled_s == 2.5 and st.private_blocks == 7 and inst.kv.hbm.used_blocks == 7
    assert st.recomputed_tokens == 150 and st.lost_tokens == 0  # nothing of it was found again
    assert [(s.rid, n) for s, n in step.plan] == [(0, 100)]
    again = state(1, 100)
    inst.admitter.take_residency(again, (), 0, 0, 0, 40, 3.0)
    assert again.recomputed_tokens == 0 and again.first_scheduled_s == 3.0
    again.lost_tokens = 100
    inst.admitter.take_residency(again, (), 0, 0, 0, 40, 4.0)
    assert again.recomputed_tokens == 60 and again.first_scheduled_s == 3.0 and again.admissions == 2


def test_admitted_requests_leave_the_queue_in_order():
    inst = make_instance(make_spec(hbm_kv_blocks=64))
    reqs = [state(i, 50) for i in range(4)]
    inst.waiting.extend(reqs)
    inst.policy.order_waiting = lambda table: np.array([2, 0, 3, 1])
    inst.policy.order_is_static = False
    step = StepBuild(inst.budget)
    step.budget = 150  # three admitted in the policy's order
    inst.admitter.admit_in_order([reqs[2], reqs[0], reqs[3], reqs[1]], step, 0.0, keep_queue_order=False)
    assert [s.rid for s in inst.running] == [2, 0, 3] and list(inst.waiting) == [reqs[1]]
