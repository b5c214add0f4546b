"""``vllm-priority``: vLLM's ``--scheduling-policy priority`` (policies/vllm_priority.py; issue #21
item 4). Waiting requests go by ``(priority, arrival_s)`` (V1 ``PriorityRequestQueue``), the KV
victim is the largest ``(priority, arrival_s)`` (V1 ``Scheduler.schedule``), and with
``priority_preemption`` a blocked high-priority head preempts lower-priority running requests
for a seat or for KV blocks (V0 ``_schedule_priority_preemption``); V1 lets it wait."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import Request, RequestState, Workload
from kvsched.policies.base import make_policy
from kvsched.policies.priority import ShortestPromptFirst
from simkit import assert_identical, make_spec


def table(rows) -> FeatureTable:
    """rows: (request_id, arrival_s, priority)."""
    return FeatureTable([RequestState(Request(rid, arr, 100, 10, priority=p), 16, 0) for rid, arr, p in rows], 9.0)


def run(w, spec, params=None, ff=True):
    return Cluster([spec], lambda: make_policy("vllm-priority", params),
                   options=InstanceOptions(check_invariants=True, fast_forward=ff)).run(w)


def by_id(res, col):
    return dict(zip(res.records.request_id.tolist(), res.records[col].tolist()))


def test_waiting_requests_go_by_priority_then_arrival_then_id():
    t = table([(0, 3.0, 1), (1, 1.0, 2), (2, 2.0, 1), (3, 0.5, 2), (4, 2.0, 1), (5, 9.0, -4)])
    order = make_policy("vllm-priority").order_waiting(t)
    assert t.request_id[order].tolist() == [5, 2, 4, 0, 3, 1]


def test_the_kv_victim_is_the_largest_priority_then_latest_arrival():
    p = make_policy("vllm-priority")
    assert p.choose_victim(table([(0, 0.0, 3), (1, 1.0, 7), (2, 2.0, 7), (3, 3.0, 0)])) == 2
    # not the newest admitted (fcfs's victim): the admission order does not matter
    assert p.choose_victim(table([(0, 5.0, 9), (1, 1.0, 0), (2, 2.0, 1)])) == 0
    assert p.choose_preemption(table([(0, 5.0, 9), (1, 1.0, 0)]), {"recompute": np.ones(2)},
                               "recompute") == (0, "recompute")


def test_the_shortest_prompt_first_policy_keeps_its_name():
    assert isinstance(make_policy("priority"), ShortestPromptFirst)
    assert make_policy("vllm-priority").name == "vllm-priority"


def test_parameters_are_validated():
    with pytest.raises(ConfigError, match=r"VLLMPriorityParams.priority_preemption='yes' is not allowed"):
        make_policy("vllm-priority", {"priority_preemption": "yes"})
    with pytest.raises(ConfigError, match=r"VLLMPriorityParams.admission_preemption='always' is not allowed"):
        make_policy("vllm-priority", {"priority_preemption": True, "admission_preemption": "always"})
    assert make_policy("vllm-priority", {"admission_preemption": "cost-gated"}).preempts_for_head is False
    assert make_policy("vllm-priority", {"priority_preemption": True}).preempts_for_head is True


def seats_workload() -> Workload:
    # two low-priority requests fill both seats and decode for ~3 s; a high-priority one arrives at 0.5 s
    return Workload.from_requests([Request(0, 0.0, 100, 400, priority=5), Request(1, 0.0, 100, 400, priority=5),
                                   Request(2, 0.5, 100, 10, priority=0)])


def test_with_seats_full_a_high_priority_arrival_waits_under_v1_and_preempts_with_priority_preemption():
    spec = make_spec(max_num_seqs=2)
    v1 = run(seats_workload(), spec)
    v0 = run(seats_workload(), spec, {"priority_preemption": True})
    first_v1, first_v0 = by_id(v1, "first_scheduled_s"), by_id(v0, "first_scheduled_s")
    assert first_v1[2] > 2.0 and v1.stats["preemptions"] == 0  # waits until a seat frees
    assert 0.5 <= first_v0[2] < 0.52  # admitted at the first step after its arrival
    assert v0.stats["admission_preemptions"] == 1 and by_id(v0, "preemptions") == {0: 0, 1: 1, 2: 0}
    assert (v0.records.status == "finished").all()


def test_no_preemption_without_a_priority_inversion():
    w = Workload.from_requests([Request(0, 0.0, 100, 400, priority=1), Request(1, 0.0, 100, 400, priority=1),
                                Request(2, 0.5, 100, 10, priority=1), Request(3, 0.6, 100, 10, priority=2)])
    res = run(w, make_spec(max_num_seqs=2), {"priority_preemption": True})
    assert res.stats["preemptions"] == 0 and by_id(res, "first_scheduled_s")[2] > 2.0


def test_with_kv_full_a_high_priority_arrival_preempts_for_blocks():
    # 96 blocks: two low-priority requests of 600 + 150 tokens (47 blocks each at the end) fit
    # together and finish at ~1.1 s; at 0.5 s they hold ~84 and the high-priority 400-token prompt
    # (25 blocks) cannot get in
    w = Workload.from_requests([Request(0, 0.0, 600, 150, priority=3), Request(1, 0.0, 600, 150, priority=4),
                                Request(2, 0.5, 400, 10, priority=0)])
    spec = make_spec(hbm_kv_blocks=96, enable_prefix_caching=False, max_num_batched_tokens=2048)
    v1 = run(w, spec)
    v0 = run(w, spec, {"priority_preemption": True})
    assert by_id(v1, "first_scheduled_s")[2] > 1.0  # when the two finish
    assert 0.5 <= by_id(v0, "first_scheduled_s")[2] < 0.52
    assert v1.stats["preemptions"] == 0
    assert v0.stats["admission_preemptions"] == 1 and by_id(v0, "preemptions") == {0: 0, 1: 1, 2: 0}


def test_the_kv_victim_in_a_simulation_is_the_largest_priority_not_the_newest():
    # three decoders outgrow 60 blocks; request 0, the oldest, has the lowest priority (largest value)
    w = Workload.from_requests([Request(0, 0.0, 200, 500, priority=9), Request(1, 0.01, 200, 500, priority=0),
                                Request(2, 0.02, 200, 500, priority=1)])
    spec = make_spec(hbm_kv_blocks=60, enable_prefix_caching=False)
    pre = by_id(run(w, spec), "preemptions")
    assert pre[0] >= 1 and pre[1] == 0
    fcfs = Cluster([spec], lambda: make_policy("fcfs")).run(w)
    assert by_id(fcfs, "preemptions")[0] == 0  # vLLM fcfs preempts the newest instead


def test_a_request_that_preempts_itself_ends_the_running_pass_as_in_vllm_v1():
    """vLLM V1 ``Scheduler.schedule``: when the request being scheduled is its own victim
    (``preempted_req == request``) the running loop breaks, so the running requests after it get
    no tokens in that step although its freed blocks would fit them (seen by ``kvsched parity``
    case priority-kv-victims)."""
    from simkit import make_instance, place_running, state

    inst = make_instance(make_spec(hbm_kv_blocks=6, enable_prefix_caching=False), "vllm-priority")
    a, b, c = (state(rid, 16, 50) for rid in range(3))
    a.priority, b.priority, c.priority = 0, 9, 1  # b, in the middle, has the lowest priority
    place_running(inst, a, 20, generated=5)     # 2 blocks, room for its next token
    place_running(inst, b, 32, generated=17)    # 2 blocks, full: its next token needs a third
    place_running(inst, c, 32, generated=17)    # likewise
    assert inst.kv.hbm.available_blocks == 0
    inst.schedule(0.0)
    assert [(st.rid, n) for st, n in inst._plan] == [(0, 1)]  # c waits for the next step
    assert b.status != 1 and c.status == 1 and b.preemptions == 1 and c.preemptions == 0


@pytest.mark.parametrize("params", [{}, {"priority_preemption": True}])
def test_runs_are_deterministic_and_fast_forward_exact(params):
    from simkit import short_only

    w = short_only(rate=12.0, dur=20.0, seed=4)
    prio = np.where(w.prompt_tokens > 500, 3, 0)
    object.__setattr__(w, "priority", prio.astype(np.int64))
    spec = make_spec(hbm_kv_blocks=300, max_num_seqs=8, enable_prefix_caching=False)
    a = run(w, spec, params)
    assert_identical(a, run(w, spec, params))
    assert_identical(a, run(w, spec, params, ff=False))
    if params:
        assert a.stats["admission_preemptions"] > 0
