"""The event loop (envs/sim/cluster.py): the API front end in front of the engine, the resumable
loop (decision points, time points, bad calls), request state living only while in flight, and
more load meaning longer waits."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.envs.workload import traces
from kvsched.policies.base import make_policy
from kvsched.runner.simulate import simulate
from simkit import GPU, MODEL, make_spec

H100 = get_gpu("H100-SXM")
L7 = get_model("Llama-2-7B")


def test_front_end_overheads_shift_ttft_and_e2e_but_not_token_gaps():
    base = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)
    over = dataclasses.replace(base, request_overhead_s=0.012, prompt_token_overhead_s=5e-6,
                               output_token_overhead_s=0.002)
    wl = Workload.from_requests([Request(0, 1.0, 300, 5)])
    r0 = simulate(wl, InstanceSpec(model=L7, gpu=H100, cost=base)).records.iloc[0]
    r1 = simulate(wl, InstanceSpec(model=L7, gpu=H100, cost=over)).records.iloc[0]
    delay = 0.012 + 5e-6 * 300
    assert r1["arrival_s"] == 1.0  # the client's send time is kept
    assert math.isclose(r1["first_scheduled_s"] - r0["first_scheduled_s"], delay, rel_tol=1e-9)
    assert math.isclose((r1["first_token_s"] - r1["arrival_s"]) - (r0["first_token_s"] - r0["arrival_s"]),
                        delay + 0.002, rel_tol=1e-9)
    assert math.isclose(r1["finish_s"] - r1["first_token_s"], r0["finish_s"] - r0["first_token_s"], rel_tol=1e-12)
    # the engine itself is unchanged: the lone prefill still takes one step of the cost model
    step = CostModel(InstanceSpec(model=L7, gpu=H100, cost=over)).chunk_time_s(300, 0)
    assert math.isclose(r1["first_token_s"] - 0.002 - r1["first_scheduled_s"], step, rel_tol=1e-9)


def test_per_token_delay_can_reorder_arrivals():
    cost = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=1e-4, output_token_overhead_s=0.0)
    # the long prompt is sent first but reaches the engine 0.1 s after the short one
    wl = Workload.from_requests([Request(0, 0.0, 1001, 2), Request(1, 0.001, 1, 2)])
    r = simulate(wl, InstanceSpec(model=L7, gpu=H100, cost=cost)).records.set_index("request_id")
    assert r.loc[1, "first_scheduled_s"] < r.loc[0, "first_scheduled_s"]
    assert math.isclose(r.loc[0, "first_scheduled_s"], 0.1001, rel_tol=1e-9)


def test_cluster_instances_must_share_the_front_end():
    from kvsched.envs.sim.cluster import Cluster

    a = InstanceSpec(model=L7, gpu=H100, cost=CostParams(request_overhead_s=0.01))
    b = InstanceSpec(model=L7, gpu=H100, cost=CostParams(request_overhead_s=0.02))
    with pytest.raises(ConfigError, match="request_overhead_s"):
        Cluster([a, b], lambda: None)


def test_request_state_lives_only_while_in_flight(monkeypatch):
    """Memory stays proportional to requests in flight plus records (issue #8): a request's
    simulation state is created at its arrival and dropped once its record is written. Counted
    with a RequestState subclass: the most alive at once never exceeds the most in flight by the
    records (arrival to recorded finish), far below the 1,000 requests, and none is left."""
    import gc

    from kvsched.envs.sim import cluster as cluster_mod
    from kvsched.envs.sim.request import RequestState
    from kvsched.experiments.bench import fixed_length_poisson

    class Counted(RequestState):
        live = peak = made = 0

        def __init__(self, *a):
            super().__init__(*a)
            Counted.live += 1
            Counted.made += 1
            Counted.peak = max(Counted.peak, Counted.live)

        def __del__(self):
            Counted.live -= 1

    monkeypatch.setattr(cluster_mod, "RequestState", Counted)
    w = fixed_length_poisson(1_000, 10.0, 800, 400, seed=0, name="blis-1k")
    recs = simulate(w, make_spec(), "fcfs").records
    gc.collect()
    assert Counted.made == 1_000 and Counted.live == 0
    # the most requests between arrival and recorded finish at once (an arrival at the same
    # instant as a finish counts both: an upper bound on the states the simulator must hold)
    t = np.concatenate([recs["arrival_s"].to_numpy(), recs["finish_s"].to_numpy()])
    step = np.concatenate([np.ones(len(recs)), -np.ones(len(recs))])
    order = np.lexsort((-step, t))
    max_in_flight = int(np.cumsum(step[order]).max())
    assert Counted.peak <= max_in_flight < 200


def test_more_load_means_higher_ttft_and_no_better_attainment():
    """The same 300 Azure requests compressed 30x in time (a 30x higher request rate) must
    wait longer: mean and p90 TTFT rise, SLO attainment does not improve."""
    w = traces.head(traces.load_trace("azure-conv-2023"), 300)
    spec = InstanceSpec(MODEL, GPU)
    base = simulate(w, spec).summary["classes"]["all"]
    loaded = simulate(traces.scale_rate(w, 30.0), spec).summary["classes"]["all"]
    assert loaded["ttft_s"]["mean"] > base["ttft_s"]["mean"]
    assert loaded["ttft_s"]["p90"] > base["ttft_s"]["p90"]
    assert loaded["slo"]["attainment"] <= base["slo"]["attainment"]


def two_instances():
    return Cluster([make_spec()] * 2, lambda: make_policy("fcfs"))


def small_workload(n=6):
    return Workload.from_requests([Request(i, 0.1 * i, 50 + i, 4) for i in range(n)])


def test_bad_calls_of_the_resumable_loop_are_clear_errors():
    with pytest.raises(ConfigError, match="at least one InstanceSpec"):
        Cluster([], lambda: make_policy("fcfs"))
    c = two_instances()
    with pytest.raises(RuntimeError, match="call Cluster.start"):
        c.run_until_decision()
    with pytest.raises(RuntimeError, match="call Cluster.start"):
        c.result()
    c.start(small_workload())
    with pytest.raises(RuntimeError, match="no decision is pending"):
        c.apply()
    with pytest.raises(RuntimeError, match="already served a workload"):
        c.start(small_workload())


@pytest.mark.parametrize("field, kwargs", [
    ("specs", {"specs": [{"model": MODEL, "gpu": GPU}]}),
    ("metrics", {"metrics": {"long_prompt_tokens": 8192}}),
    ("options", {"options": {"fast_forward": False}}),
])
def test_a_cluster_given_a_dict_for_a_config_object_names_the_field(field, kwargs):
    args = {"specs": [make_spec()], **kwargs}
    with pytest.raises(ConfigError, match=f"^{field}"):
        Cluster(args.pop("specs"), lambda: make_policy("fcfs"), **args)


def test_route_points_let_the_caller_place_each_arrival():
    w = small_workload()
    c = two_instances()
    c.start(w, DecisionWatch(route=True))
    placed = []
    while (point := c.run_until_decision()) is not None:
        assert point.kind == "route" and point.request is not None and c.arrived == point.request.rid + 1
        with pytest.raises(RuntimeError, match="a decision is pending"):
            c.run_until_decision()
        for bad in (2, -1, True, 1.0):
            with pytest.raises(ValueError, match="route_to="):
                c.apply(route_to=bad)
        c.apply(route_to=1)
        placed.append(point.request.rid)
    res = c.result()
    assert placed == list(range(len(w))) and c.done
    assert res.records["instance_id"].tolist() == [1] * len(w) and res.stats["routed_requests"] == [0, len(w)]


def test_schedule_points_stop_at_the_watched_instance_only():
    c = two_instances()
    c.start(small_workload(), DecisionWatch(schedule_instance=0))
    kinds = set()
    while (point := c.run_until_decision()) is not None:
        assert point.kind == "schedule" and point.instance_id == 0 and not c.instances[0].busy
        with pytest.raises(ValueError, match="only allowed at a 'route'"):
            c.apply(route_to=0)
        c.apply()
        kinds.add(point.kind)
    assert kinds == {"schedule"} and len(c.result().records) == 6


def test_time_points_stop_before_later_events_and_the_run_resumes():
    w = small_workload()
    c = two_instances()
    c.start(w)
    point = c.run_until_decision(until_s=0.25)
    assert point.kind == "time" and point.time_s == 0.25 and c.now_s <= 0.25 and 1 <= c.arrived <= 3
    assert c.run_until_decision() is None
    res = c.result()
    assert res.summary == Cluster([make_spec()] * 2, lambda: make_policy("fcfs")).run(w).summary


def test_result_names_requests_neither_finished_nor_rejected():
    c = two_instances()
    c.start(small_workload())
    c.run_until_decision(until_s=0.15)
    with pytest.raises(RuntimeError, match="requests neither finished nor were rejected"):
        c.result()


def test_a_router_returning_a_huge_value_is_named_in_a_bounded_message():
    """The router's wrong answer (and a router without a ``name``, shown by its repr) is bounded in
    the message (errors.bounded_repr), as every value a message prints."""

    class Huge:
        def __repr__(self) -> str:
            return "Huge" + "!" * 1_000_000

        def bind(self, n_instances, seed=0):
            pass

        def route(self, table):
            return list(range(100_000))

    w = Workload.from_requests([Request(0, 0.0, 10, 2)])
    c = Cluster([make_spec()] * 2, lambda: make_policy("fcfs"), router=Huge())
    with pytest.raises(ConfigError, match="returned \\[0, 1, 2") as info:
        c.run(w)
    assert len(str(info.value)) < 500
