"""Cluster routers (policies/routing.py, issue #5): cache affinity against round-robin on Mooncake,
prefix matching piling up and the load guards that spread it, Dynamo's cost and llm-d's scores,
session affinity, seeded sampling, and bad router input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import InstanceSpec
from kvsched.envs.workload.traces import load_trace, window
from kvsched.policies.routing import Router, make_router, router_names
from kvsched.runner.simulate import build_cluster, simulate
from simkit import GPU, MODEL, Recording, cluster
from simkit import routing_spec as make_spec


@pytest.fixture(scope="module")
def mooncake_200s():
    return window(load_trace("mooncake-conversation"), 0.0, 200.0)


def test_cache_affinity_raises_prefix_hits_and_lowers_ttft_vs_round_robin_on_mooncake(mooncake_200s):
    """8 H100s, the first 200 s of the Mooncake conversation trace (599 requests). The p99 (the
    6th-worst request) is not compared: with vLLM's tail-first freeing round-robin keeps more of
    each conversation's head cached too (hit rate 5.6 % -> 6.4 %) and its p99 on this window fell
    below cache-affinity's (5.06 vs 5.49 s; head-first: 5.54 vs 5.49)."""
    spec = InstanceSpec(MODEL, GPU)
    rr = simulate(mooncake_200s, spec, n_instances=8, router="rr").summary
    ca = simulate(mooncake_200s, spec, n_instances=8, router="cache-affinity").summary
    hit_rr, hit_ca = (s["classes"]["all"]["prefix"]["hit_rate"] for s in (rr, ca))
    assert hit_ca > 1.5 * hit_rr > 0
    for stat in ("mean", "p50"):
        assert ca["classes"]["all"]["ttft_s"][stat] < rr["classes"]["all"]["ttft_s"][stat], stat
    n = len(mooncake_200s)
    assert rr["routing"]["load_imbalance"] == pytest.approx(math.ceil(n / 8) / (n / 8))


def shared_system_prompt(n=400, rate_per_s=100.0, seg=512):
    """Every request: one 2048-token system prompt (4 shared segments) + its own 512 tokens."""
    reqs = [Request(i, i / rate_per_s, 5 * seg, 64, prefix_hashes=(1, 2, 3, 4, 10_000 + i), hash_block_tokens=seg)
            for i in range(n)]
    return Workload.from_requests(reqs)


def shares(res) -> np.ndarray:
    return np.sort(np.asarray(res.summary["routing"]["load_share"]))[::-1]


def test_pure_prefix_matching_piles_onto_one_instance_the_load_guard_and_llmd_spread():
    w = shared_system_prompt()
    spec = make_spec(max_num_batched_tokens=2048)
    res = {r: simulate(w, spec, n_instances=4, router=r) for r in ("prefix", "cache-affinity", "llm-d", "rr")}
    top = shares(res["prefix"])
    assert top[:2].sum() >= 0.95  # one or two instances take almost everything
    assert res["prefix"].summary["routing"]["load_imbalance"] > 3.5
    ca, llmd = shares(res["cache-affinity"]), shares(res["llm-d"])
    assert ca[0] <= 0.5 and ca[-1] >= 0.1, ca          # the load guard spreads over all four
    assert llmd[0] <= 0.75 and llmd[1] >= 0.2, llmd    # llm-d's queue/kv weights move load to a second one
    p99 = {r: res[r].summary["classes"]["all"]["ttft_s"]["p99"] for r in res}
    assert p99["cache-affinity"] < p99["llm-d"] < p99["prefix"]
    for r in ("prefix", "cache-affinity", "llm-d"):
        # spreading keeps the prefix hits: each instance computes the system prompt about once
        assert res[r].summary["classes"]["all"]["prefix"]["hit_rate"] > 0.75


def test_dynamo_cost_and_llmd_scores():
    """While request 0 (a 4096-token prompt) prefills on instance 0, request 1 arrives with the
    same first two 512-token segments... which are not cached yet; the Dynamo cost counts
    instance 0's pending prefill and used blocks."""
    seg = 512
    reqs = [Request(0, 0.0, 8 * seg, 50, prefix_hashes=tuple(range(8)), hash_block_tokens=seg),
            Request(1, 0.002, 2 * seg, 5, prefix_hashes=(0, 1), hash_block_tokens=seg)]
    spec = make_spec(hbm_kv_blocks=8192, max_num_batched_tokens=512)
    rec = Recording(make_router("dynamo"))
    res = cluster(2, rec, spec=spec).run(Workload.from_requests(reqs))
    s = rec.seen[1]
    bs = 16
    expected = (s["pending_prefill_tokens"] + 2 * seg - s["overlap"] * seg) / bs + s["used_blocks_hbm"]
    # request 0's first 512-token chunk is in flight: its blocks are allocated, its tokens not yet computed
    assert s["pending_prefill_tokens"].tolist() == [8 * seg, 0] and s["used_blocks_hbm"].tolist() == [512 // bs, 0]
    assert res.records.loc[1, "instance_id"] == int(np.argmin(expected)) == 1


def test_session_affinity_explicit_and_derived_sessions():
    seg = 512
    # explicit sessions: 6 sessions x 3 turns, interleaved
    reqs = [Request(10 * t + s, t * 5.0 + s * 0.1, 300, 5, session_id=s) for t in range(3) for s in range(6)]
    res = cluster(4, "session-affinity").run(Workload.from_requests(reqs))
    r = res.records
    by = r.groupby(r.request_id % 10)["instance_id"].nunique()
    assert (by == 1).all()
    # derived: turn 2 extends turn 1's full blocks; a branch off turn 1 starts a new session
    t1 = (1, 2, 3)           # 3 blocks, the last partial: key = chain of (1, 2)
    t2 = (1, 2, 4, 5)        # continues t1
    branch = (1, 2, 6, 7)    # also extends t1, which is no longer its session's latest turn
    t3 = (1, 2, 4, 5, 8)     # continues t2
    wl = Workload.from_requests([
        Request(0, 0.0, 2 * seg + 100, 5, prefix_hashes=t1, hash_block_tokens=seg),
        Request(1, 1.0, 4 * seg, 5, prefix_hashes=(50, 51, 52, 53), hash_block_tokens=seg),
        Request(2, 2.0, 3 * seg + 100, 5, prefix_hashes=t2, hash_block_tokens=seg),
        Request(3, 3.0, 3 * seg + 100, 5, prefix_hashes=branch, hash_block_tokens=seg),
        Request(4, 4.0, 4 * seg + 100, 5, prefix_hashes=t3, hash_block_tokens=seg),
    ])
    router = make_router("session-affinity")
    res = cluster(4, router).run(wl)
    inst = res.records.set_index("request_id")["instance_id"]
    assert inst[0] == inst[2] == inst[4]
    assert router.derived_sessions == 3 and router.continued == 2
    # a session that outlived its ttl is routed afresh (least-loaded: the idle rotation moves on)
    router = make_router("session-affinity", {"ttl_s": 0.5})
    res = cluster(4, router).run(wl)
    inst = res.records.set_index("request_id")["instance_id"]
    assert len({inst[0], inst[2], inst[4]}) > 1


def test_dynamo_temperature_sampling_is_seeded():
    w = shared_system_prompt(n=60, rate_per_s=200.0)
    spec = make_spec(max_num_batched_tokens=2048)
    runs = [simulate(w, spec, n_instances=4, router="dynamo", router_params={"router_temperature": 0.5, "seed": s})
            for s in (1, 1, 2)]
    a, b, c = (r.records["instance_id"].tolist() for r in runs)
    assert a == b and a != c


def test_bad_router_input():
    with pytest.raises(UnknownPresetError, match="unknown router 'nope'; known: .*cache-affinity"):
        make_router("nope")
    with pytest.raises(ConfigError, match=r"unknown parameters \['treshold'\]"):
        make_router("cache-affinity", {"treshold": 0.5})
    with pytest.raises(ConfigError, match="cache_threshold=1.5.*in \\[0, 1\\)"):
        make_router("cache-affinity", {"cache_threshold": 1.5})
    with pytest.raises(ConfigError, match="ttl_s"):
        make_router("session-affinity", {"ttl_s": 0})
    with pytest.raises(ConfigError, match="overlap_score_weight"):
        make_router("dynamo", {"overlap_score_weight": -1})
    with pytest.raises(ConfigError, match="LeastLoadedParams.queue_weight"):
        make_router("least-loaded", {"queue_weight": 0, "kv_weight": 0})
    with pytest.raises(ConfigError, match="router="):
        make_router(3)
    assert "rr" not in router_names() and make_router("rr").name == "round-robin"

    class Bad(Router):
        def route(self, table):
            return 7

    w = Workload.from_requests([Request(0, 0.0, 10, 2)])
    with pytest.raises(ConfigError, match="returned 7 for request 0; expected an instance row 0..1"):
        cluster(2, Bad()).run(w)
    with pytest.raises(ConfigError, match="router_params only apply"):
        build_cluster([make_spec()] * 2, router=make_router("rr"), router_params={})
    with pytest.raises(ConfigError, match="expected an object with"):
        cluster(2, object())
