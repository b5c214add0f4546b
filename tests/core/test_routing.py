"""What a router sees (envs/sim/routing.py): the router table's columns and prefix overlap, stale
snapshots on a refresh grid, heterogeneous instances, the shared tier's overlap, round-robin by
default, and no output length ever."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import Request, RequestState, Workload, _chain
from kvsched.envs.sim.routing import RoundRobinPlacement, RouterTable, StateProvider, leading_run
from kvsched.envs.sim.shared_kv import SharedKVSpec
from kvsched.envs.sim.specs import InstanceSpec, get_gpu
from kvsched.policies.base import make_policy
from kvsched.policies.routing import Router, make_router, router_names
from simkit import MODEL, NO_FRONT_END, Recording, cluster
from simkit import mixed_prefix_workload as _mixed_prefix_workload
from simkit import routing_spec as make_spec


def test_stale_state_lets_a_burst_pile_onto_one_instance():
    """Three long requests at t=0 occupy instances 0-2; at t=10 a burst of 30 arrives. With the
    state refreshed every 10 s the whole burst sees instance 3 as the only idle one; with live
    state least-loaded spreads it."""
    reqs = [Request(i, i * 1e-3, 2000, 3000) for i in range(3)]
    reqs += [Request(3 + i, 10.0 + i * 0.01, 500, 20) for i in range(30)]
    w = Workload.from_requests(reqs)
    burst = {}
    for delay in (0.0, 10.0):
        rec = Recording(make_router("least-loaded"))
        res = cluster(4, rec, router_delay_s=delay).run(w)
        r = res.records.set_index("request_id")
        burst[delay] = np.bincount(r.loc[3:, "instance_id"].to_numpy(), minlength=4)
        assert sorted(r.loc[:2, "instance_id"]) == [0, 1, 2]
        if delay:
            assert {s["snapshot_s"] for s in rec.seen} == {0.0, 10.0}
            assert res.summary["routing"]["snapshot_refreshes"] == 2
        else:
            assert all(s["snapshot_s"] == s["now_s"] for s in rec.seen)
    assert burst[10.0].tolist() == [0, 0, 0, 30]
    assert burst[0.0].max() <= 15 and (burst[0.0] > 0).all()


def test_state_provider_refresh_grid_and_bad_delay():
    p = StateProvider(2.0)
    c = cluster(2)
    views = [p.view(c.instances, t) for t in (0.5, 1.9, 2.0, 3.99, 4.5)]
    assert views[0] is views[1] and views[2] is views[3] and views[3] is not views[4]
    assert views[2].now_s == 2.0 and p.refreshes == 3
    for bad in (-1.0, math.nan, math.inf, "1", True):
        with pytest.raises(ConfigError, match="router_delay_s"):
            StateProvider(bad)


def test_router_table_columns_and_prefix_overlap():
    seg = 512
    reqs = [Request(0, 0.0, 4 * seg + 10, 2, prefix_hashes=(1, 2, 3, 4, 5), hash_block_tokens=seg),
            Request(1, 5.0, 3 * seg + 10, 4, prefix_hashes=(1, 2, 9, 10), hash_block_tokens=seg),
            Request(2, 10.0, 100, 7)]
    rec = Recording(make_router("rr"))
    cluster(2, rec).run(Workload.from_requests(reqs))
    first, second, third = rec.seen
    assert first["overlap"].tolist() == [0, 0] and second["overlap"].tolist() == [2, 0]
    assert third["overlap"].tolist() == [0, 0]
    assert first["kv_utilization"].tolist() == [0.0, 0.0] and first["queue_len"].tolist() == [0, 0]
    # request 0's segments stay cached (evictable) on instance 0 after it finished
    assert second["free_blocks_hbm"][0] == second["capacity_blocks_hbm"][0]
    assert second["used_blocks_hbm"].tolist() == [0, 0]
    assert first["max_num_seqs"].dtype == np.int64 and first["link_backlog_s"].dtype == np.float64
    # routers never see the output length
    st = RequestState(reqs[0], 16, 0)
    c = cluster(2)
    table = RouterTable(c.state_provider.view(c.instances, 0.0), st, 0.0)
    for hidden in ("output_tokens", "max_tokens", "generated_tokens"):
        with pytest.raises(AttributeError):
            getattr(table, hidden)
    assert table.prefix_keys == _chain((1, 2, 3, 4, 5)) and table.prefix_blocks == 4


def test_round_robin_is_the_default_and_unchanged():
    w = Workload.from_requests([Request(i, i * 0.01, 50 + i, 3) for i in range(10)])
    res = cluster(3).run(w)
    assert res.records["instance_id"].tolist() == [i % 3 for i in range(10)]
    assert res.summary["routing"]["requests"] == [4, 3, 3]
    assert res.summary["routing"]["load_imbalance"] == pytest.approx(4 / (10 / 3))
    one = cluster(1).run(w)
    assert "routing" not in one.summary and "shared_kv" not in one.summary


def test_heterogeneous_instances_in_the_table():
    """An H100 with 16-token blocks beside an A100 with 32-token blocks: per-row capacities, batch
    limits and prefix overlap in each instance's own blocks."""
    seg = 512
    h100 = make_spec(hbm_kv_blocks=4096, max_num_seqs=64)
    a100 = InstanceSpec(MODEL, get_gpu("A100-80GB"), block_size_tokens=32, hbm_kv_blocks=1024, max_num_seqs=32,
                        cost=NO_FRONT_END)
    reqs = [Request(0, 0.0, 2 * seg + 10, 2, prefix_hashes=(1, 2, 3), hash_block_tokens=seg),
            Request(1, 1.0, 2 * seg + 10, 2, prefix_hashes=(7, 8, 9), hash_block_tokens=seg),
            Request(2, 2.0, 2 * seg + 10, 2, prefix_hashes=(1, 2, 4), hash_block_tokens=seg),
            Request(3, 3.0, 2 * seg + 10, 2, prefix_hashes=(7, 8, 5), hash_block_tokens=seg)]
    rec = Recording(make_router("rr"))
    c = Cluster([h100, a100], lambda: make_policy("fcfs"), router=rec,
                options=InstanceOptions(check_invariants=True))
    res = c.run(Workload.from_requests(reqs))
    assert res.records["instance_id"].tolist() == [0, 1, 0, 1]
    s2, s3 = rec.seen[2], rec.seen[3]
    assert s2["capacity_blocks_hbm"].tolist() == [4096, 1024] and s2["max_num_seqs"].tolist() == [64, 32]
    assert s2["block_size_tokens"].tolist() == [16, 32]
    assert s2["overlap"].tolist() == [2, 0] and s3["overlap"].tolist() == [0, 2]
    assert s2["overlap_blocks"].tolist() == [2 * seg // 16, 0] and s3["overlap_blocks"].tolist() == [0, 2 * seg // 32]
    assert res.records.loc[3, "prefix_hit_tokens"] == 2 * seg


def test_table_sees_the_shared_tier():
    seg = 512
    reqs = [Request(0, 0.0, 4 * seg + 10, 2, prefix_hashes=(1, 2, 3, 4, 5), hash_block_tokens=seg),
            Request(1, 30.0, 3 * seg + 10, 2, prefix_hashes=(1, 2, 9, 10), hash_block_tokens=seg)]
    seen = []

    class Spy(Router):
        def route(self, table):
            seen.append((table.shared_overlap_segments, table.prefix_overlap_segments.tolist()))
            return 1

    cluster(2, Spy(), shared_kv=SharedKVSpec(capacity_bytes=1e12)).run(Workload.from_requests(reqs))
    assert seen == [(0, [0, 0]), (2, [0, 2])]


@pytest.mark.parametrize("oracle", [False, True])
def test_routing_decisions_do_not_depend_on_the_arriving_requests_output_length(oracle):
    """Every router, with live and stale state and a shared tier: changing only the last request's
    output length leaves every routing decision and every column the routers saw unchanged --
    routers never see output lengths, also when the instance schedulers are shown them (oracle)."""
    w = _mixed_prefix_workload(n=60)
    reqs = [w.request(i) for i in range(len(w))]
    r = reqs[-1]
    alt = Workload.from_requests(reqs[:-1] + [Request(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens + 977,
                                                      prefix_hashes=r.prefix_hashes,
                                                      hash_block_tokens=r.hash_block_tokens)])
    spec = make_spec(hbm_kv_blocks=4096, max_num_batched_tokens=512)
    for name in router_names():
        for delay in (0.0, 0.03):
            seen = []
            for wl in (w, alt):
                rec = Recording(make_router(name))
                res = Cluster([spec] * 3, lambda: make_policy("fcfs"), router=rec, router_delay_s=delay,
                              options=InstanceOptions(oracle_lengths=oracle),
                              shared_kv=SharedKVSpec(capacity_bytes=1e11)).run(wl)
                seen.append((res.records.sort_values("request_id")["instance_id"].tolist(), rec.seen[-1]))
            assert seen[0][0] == seen[1][0], (name, delay)
            a, b = seen[0][1], seen[1][1]
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (name, delay)


def test_leading_run_counts_cached_keys_up_to_the_first_miss_and_the_limit():
    cached = {1, 2, 4}
    assert leading_run([1, 2, 3, 4], cached, 10) == 2
    assert leading_run([1, 2, 4], cached, 2) == 2 and leading_run([3, 1], cached, 5) == 0


def test_round_robin_tells_how_many_arrivals_come_before_an_instances_turn():
    rr = RoundRobinPlacement()
    rr.bind(3)
    assert [rr.arrivals_until(i, 3) for i in range(3)] == [0, 1, 2]
    assert rr.route([0, 1, 2]) == 0  # instance 0 took one (a table of 3 rows): instance 1 is next
    assert [rr.arrivals_until(i, 3) for i in range(3)] == [2, 0, 1]


def test_a_round_robin_placement_reused_for_another_run_routes_it_the_same():
    from kvsched.policies.base import make_policy
    from simkit import make_spec

    rr = RoundRobinPlacement()
    w = Workload.from_requests([Request(i, 0.05 * i, 64, 4) for i in range(5)])
    runs = [Cluster([make_spec()] * 3, lambda: make_policy("fcfs"), router=rr).run(w) for _ in range(2)]
    placed = [r.records.sort_values("request_id")["instance_id"].tolist() for r in runs]
    assert placed[0] == placed[1] == [0, 1, 2, 0, 1]
