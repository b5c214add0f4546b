"""The core's head-preemption hook (envs/sim/admission.py, Preemptor.preempt_for_head): a policy
with ``preempts_for_head`` is asked, for the blocked head of the admission order, which running
request to preempt when no seat (``max_num_seqs``) or no KV blocks are left; a policy without it
is never asked, and a policy that always declines changes nothing."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import Request, Workload
from kvsched.policies.base import SchedulerPolicy, make_policy
from simkit import assert_identical, make_spec


class Asked(SchedulerPolicy):
    """FCFS that records every head-preemption question and declines (or answers ``answer``)."""

    preempts_for_head = True
    answer: tuple[int, str] | None = None

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self.asked: list[tuple[str, list[int], int]] = []

    def choose_head_preemption(self, running, head, cause, costs_s, default_mode):
        self.asked.append((cause, running.request_id.tolist(), int(head.request_id[0])))
        assert set(costs_s) >= {"recompute"} and default_mode == "recompute"
        return self.answer


class NeverAsked(SchedulerPolicy):
    def choose_head_preemption(self, *args):
        raise AssertionError("asked without preempts_for_head")


def run(w, spec, factory, ff=True):
    pols = []

    def make():
        pols.append(factory())
        return pols[-1]

    res = Cluster([spec], make, options=InstanceOptions(check_invariants=True, fast_forward=ff)).run(w)
    return res, pols[0]


SEATS = Workload.from_requests([Request(0, 0.0, 100, 200), Request(1, 0.0, 100, 200), Request(2, 0.5, 100, 5)])
BLOCKS = Workload.from_requests([Request(0, 0.0, 600, 150), Request(1, 0.0, 600, 150), Request(2, 0.5, 400, 5)])
BLOCKS_SPEC = dict(hbm_kv_blocks=96, enable_prefix_caching=False, max_num_batched_tokens=2048)


@pytest.mark.parametrize("w,spec_kw,cause", [(SEATS, dict(max_num_seqs=2), "seats"), (BLOCKS, BLOCKS_SPEC, "blocks")])
def test_the_blocked_head_is_asked_with_its_cause_and_a_declining_policy_changes_nothing(w, spec_kw, cause):
    spec = make_spec(**spec_kw)
    res, pol = run(w, spec, Asked)
    assert pol.asked and {a[0] for a in pol.asked} == {cause}
    assert all(running == [0, 1] and head == 2 for _, running, head in pol.asked)
    fcfs = Cluster([spec], lambda: make_policy("fcfs")).run(w)
    assert_identical(res, fcfs)
    assert_identical(res, run(w, spec, Asked, ff=False)[0])  # no stretch skips a question
    run(w, spec, NeverAsked)  # without preempts_for_head: never asked


def test_the_named_victim_is_preempted_and_a_bad_answer_is_refused():
    class TakeFirst(Asked):
        answer = (0, "recompute")

    res, pol = run(SEATS, make_spec(max_num_seqs=2), TakeFirst)
    assert res.stats["admission_preemptions"] >= 1
    first = dict(zip(res.records.request_id.tolist(), res.records.first_scheduled_s.tolist()))
    assert first[2] < 0.52 and dict(zip(res.records.request_id.tolist(), res.records.preemptions.tolist()))[0] >= 1

    class OutOfRange(Asked):
        answer = (5, "recompute")

    with pytest.raises(ValueError, match=r"chose \(row 5, mode 'recompute'\) for head preemption; allowed: rows 0..1"):
        run(SEATS, make_spec(max_num_seqs=2), OutOfRange)

    class BadMode(Asked):
        answer = (0, "teleport")

    with pytest.raises(ValueError, match="head preemption"):
        run(SEATS, make_spec(max_num_seqs=2), BadMode)
