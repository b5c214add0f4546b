"""Cluster routing (issue #5): the router table, routers, stale state, the shared cluster KV tier,
prefix-hit accounting, the CLI/scenario/compare plumbing, bad input and determinism."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.runner.simulate import build_cluster, simulate
from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import Request, RequestState, Workload, _chain
from kvsched.envs.sim.routing import INSTANCE_COLUMNS, RouterTable, StateProvider
from kvsched.envs.sim.shared_kv import SharedKVPool, SharedKVSpec
from kvsched.envs.sim.specs import CostParams, InstanceSpec, LinkSpec, get_gpu, get_model
from kvsched.envs.workload.traces import load_trace, window
from kvsched.experiments.cli import main
from kvsched.experiments.compare import aggregate, run_compare
from kvsched.runner.scenario import Scenario
from kvsched.policies.base import make_policy
from kvsched.policies.routing import DynamoKV, Router, make_router, router_names

MODEL = get_model("Llama-3.1-8B")
GPU = get_gpu("H100-SXM")
MODEL_BLOCK_BYTES = InstanceSpec(MODEL, GPU).kv_bytes_per_block
NO_FRONT_END = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)


def make_spec(**kw) -> InstanceSpec:
    base = dict(model=MODEL, gpu=GPU, cost=NO_FRONT_END)
    base.update(kw)
    return InstanceSpec(**base)


def cluster(n, router="round-robin", spec=None, check=True, fast_forward=True, **kw) -> Cluster:
    spec = spec or make_spec(hbm_kv_blocks=8192, max_num_batched_tokens=2048)
    return Cluster([spec] * n, lambda: make_policy("fcfs"), router=make_router(router) if isinstance(router, str) else router,
                   options=InstanceOptions(check_invariants=check, fast_forward=fast_forward), **kw)


class Recording(Router):
    """Wraps a router and keeps copies of the columns it saw."""

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[dict] = []

    def bind(self, n_instances, seed=0):
        super().bind(n_instances, seed)
        self.inner.bind(n_instances, seed)

    def route(self, table):
        row = {c: np.array(getattr(table, c)) for c in INSTANCE_COLUMNS}
        row.update(overlap=table.prefix_overlap_segments.copy(), overlap_blocks=table.prefix_overlap_blocks.copy(),
                   rid=table.request_id, snapshot_s=table.snapshot_s,
                   now_s=table.now_s, prompt=table.prompt_tokens)
        self.seen.append(row)
        return self.inner.route(table)


# ------------------------------------------------------------------------------ Mooncake
@pytest.fixture(scope="module")
def mooncake_200s():
    return window(load_trace("mooncake-conversation"), 0.0, 200.0)


def test_cache_affinity_raises_prefix_hits_and_lowers_ttft_vs_round_robin_on_mooncake(mooncake_200s):
    """8 H100s, the first 200 s of the Mooncake conversation trace (599 requests)."""
    spec = InstanceSpec(MODEL, GPU)
    rr = simulate(mooncake_200s, spec, n_instances=8, router="rr").summary
    ca = simulate(mooncake_200s, spec, n_instances=8, router="cache-affinity").summary
    hit_rr, hit_ca = (s["classes"]["all"]["prefix"]["hit_rate"] for s in (rr, ca))
    assert hit_ca > 1.5 * hit_rr > 0
    for stat in ("mean", "p50", "p99"):
        assert ca["classes"]["all"]["ttft_s"][stat] < rr["classes"]["all"]["ttft_s"][stat], stat
    n = len(mooncake_200s)
    assert rr["routing"]["load_imbalance"] == pytest.approx(math.ceil(n / 8) / (n / 8))


# --------------------------------------------------------------------- one system prompt
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


# -------------------------------------------------------------------- prefix-hit counting
def test_prefix_hit_rate_counts_only_reuse_across_requests():
    """Two requests with their own prefixes on a 60-block cache: B (admitted second) is preempted by
    recompute, its registered segments stay cached, and at re-admission it finds them again. That
    is its own work restored: its recomputed tokens drop by the 320 cached tokens, but it is not a
    prefix hit. Request C, later, reuses A's prefix: a hit, counted once."""
    seg = 32
    reqs = [Request(0, 0.0, 10 * seg, 300, prefix_hashes=tuple(range(10)), hash_block_tokens=seg),
            Request(1, 0.001, 10 * seg, 300, prefix_hashes=tuple(range(100, 110)), hash_block_tokens=seg),
            Request(2, 100.0, 10 * seg + 20, 5, prefix_hashes=tuple(range(10)) + (55,), hash_block_tokens=seg)]
    w = Workload.from_requests(reqs)
    out = {}
    for caching in (True, False):
        spec = make_spec(hbm_kv_blocks=60, max_num_batched_tokens=512, enable_prefix_caching=caching)
        out[caching] = simulate(w, spec, options=InstanceOptions(check_invariants=True))
    on = out[True].records.set_index("request_id")
    off = out[False].records.set_index("request_id")
    assert on.loc[1, "preemptions"] >= 1 and off.loc[1, "preemptions"] == on.loc[1, "preemptions"]
    assert on.loc[1, "recomputed_tokens"] == off.loc[1, "recomputed_tokens"] - 10 * seg  # found its own blocks
    assert on.loc[1, "prefix_hit_tokens"] == 0 and on.loc[0, "prefix_hit_tokens"] == 0
    assert on.loc[2, "prefix_hit_tokens"] == 10 * seg
    total_prompt = int(on["prompt_tokens"].sum())
    assert out[True].summary["classes"]["all"]["prefix"]["hit_rate"] == pytest.approx(10 * seg / total_prompt)


# ---------------------------------------------------------------------- shared KV tier
def prefix_pair(prefix_tokens, seg=512, gap_s=30.0):
    """Request 0 computes a prefix on instance 0; request 1 (round-robin: instance 1) reuses it."""
    hashes = tuple(range(prefix_tokens // seg))
    return Workload.from_requests([
        Request(0, 0.0, prefix_tokens + 100, 2, prefix_hashes=hashes + (900,), hash_block_tokens=seg),
        Request(1, gap_s, prefix_tokens + 100, 2, prefix_hashes=hashes + (901,), hash_block_tokens=seg)])


def ttft_of(res, rid=1):
    r = res.records.set_index("request_id")
    return float(r.loc[rid, "first_token_s"] - r.loc[rid, "arrival_s"])


@pytest.mark.parametrize("prefix_tokens, fetch_wins", [(65536, True), (1024, False)])
def test_shared_tier_fetch_is_cheaper_than_recompute_for_long_prefixes_dearer_for_short(prefix_tokens, fetch_wins):
    spec = make_spec(max_num_batched_tokens=8192)
    w = prefix_pair(prefix_tokens)
    base = cluster(2, spec=spec).run(w)
    runs = {p: cluster(2, spec=spec, shared_kv=SharedKVSpec(capacity_bytes=1e12, fetch_policy=p)).run(w)
            for p in ("cost", "always")}
    assert base.records.loc[1, "instance_id"] == 1 and base.records.loc[1, "prefix_hit_tokens"] == 0
    always = runs["always"].summary["shared_kv"]
    seg_bytes = 512 * int(round(spec.kv_bytes_per_token))
    assert always["fetches"] == 1 and always["bytes_fetched"] == (prefix_tokens // 512) * seg_bytes
    assert always["hit_tokens"] == prefix_tokens
    # the fetch replaces recompute: cheaper for the long prefix, dearer for the short one
    assert (ttft_of(runs["always"]) < ttft_of(base)) == fetch_wins
    cost = runs["cost"].summary["shared_kv"]
    if fetch_wins:
        assert cost["fetches"] == 1 and cost["recompute_chosen"] == 0
        assert ttft_of(runs["cost"]) == ttft_of(runs["always"]) < 0.85 * ttft_of(base)
    else:
        assert cost["fetches"] == 0 and cost["recompute_chosen"] == 1 and cost["bytes_fetched"] == 0
        assert ttft_of(runs["cost"]) == ttft_of(base) < ttft_of(runs["always"])
    # request 0 computed the prefix, so request 1's prefix-cache hit count is unchanged by the tier
    assert runs["cost"].records.loc[1, "prefix_hit_tokens"] == 0


def test_shared_tier_cost_model_break_even():
    """The decision's predictions: fetch time is linear in bytes (plus latencies), recompute grows
    faster (attention), and a short remainder still pays a whole step."""
    spec = make_spec(max_num_batched_tokens=8192)
    c = cluster(2, spec=spec, shared_kv=SharedKVSpec(capacity_bytes=1e12))
    pool, cost = c.shared_kv, c.instances[0].cost
    kvt = spec.kv_bytes_per_token
    expected = 80e-6 + 10e-6 + 512 * kvt / 6e9 + 512 * kvt / 50e9  # NVMe Gen4 read, then 400 Gb/s
    assert pool.fetch_time_s(0, 512 * kvt, 0.0) == pytest.approx(expected)
    wins = [segs for segs in (1, 2, 3, 4, 16, 128)
            if (lambda r, f: f < r)(*pool.decide(cost, 0, segs * 512 + 100, 0, segs * 512, 0.0))]
    assert wins == [3, 4, 16, 128]
    r, f = pool.decide(cost, 0, 65536 + 100, 0, 65536, 0.0)
    assert f < 0.5 * r
    # a queued link delays the fetch: with the pool busy for 10 s, recompute wins again
    pool.pool_read.busy_until_s = 10.0
    r, f = pool.decide(cost, 0, 65536 + 100, 0, 65536, 0.0)
    assert f > r


def test_shared_pool_lru_capacity_and_conservation():
    spec = make_spec()
    seg_blocks = 32
    cap = 3 * seg_blocks * spec.kv_bytes_per_block
    c = cluster(2, spec=spec, shared_kv=SharedKVSpec(capacity_bytes=cap, max_write_backlog_s=math.inf))
    pool, inst = c.shared_kv, c.instances[0]
    assert pool.capacity_blocks == 3 * seg_blocks
    for k in (1, 2, 3):
        pool.publish(inst, k, seg_blocks, 0, 0.0)
    pool.publish(inst, 1, seg_blocks, 0, 0.0)  # repeat: refreshes 1, no second write
    assert pool.writes == 3
    pool.publish(inst, 4, seg_blocks, 0, 0.0)  # evicts 2, the least recently used
    assert pool.evicted_segments == 1 and set(pool._entries) == {1, 3, 4}
    pool.check()
    assert pool.used_blocks == pool.capacity_blocks and pool.free_blocks == 0
    pool.publish(inst, 5, 4 * seg_blocks, 0, 0.0)  # larger than the pool: not written
    assert pool.skipped_writes == 1
    # a segment is fetchable only after its write landed
    ready = pool._entries[4].ready_s
    assert ready > 0 and pool.cached_prefix_segments([4], 1, ready * 0.99) == 0
    assert pool.cached_prefix_segments([4], 1, ready) == 1


def test_shared_tier_on_mooncake_window_conserves_blocks_and_is_deterministic(mooncake_200s):
    w = window(mooncake_200s, 0.0, 60.0)
    spec = InstanceSpec(MODEL, GPU)
    big = SharedKVSpec(capacity_bytes=1e12)
    a = cluster(4, "rr", spec=spec, shared_kv=big, router_delay_s=0.5).run(w)
    b = cluster(4, "rr", spec=spec, shared_kv=big, router_delay_s=0.5, check=False, fast_forward=False).run(w)
    k = a.summary["shared_kv"]
    assert k["fetches"] >= 1 and k["recompute_chosen"] >= 1 and k["hit_tokens"] > 0
    assert k["bytes_fetched"] == k["fetched_segments"] * 512 * int(round(spec.kv_bytes_per_token))
    assert summary_to_json(a.summary) == summary_to_json(b.summary)
    assert a.records.equals(b.records)
    # a pool of ~1,500 segments fills and evicts; blocks stay conserved (checked after every step)
    small = cluster(4, "rr", spec=spec, shared_kv=SharedKVSpec(capacity_bytes=100e9)).run(w)
    k = small.summary["shared_kv"]
    assert k["evicted_segments"] > 0 and k["used_blocks"] <= k["capacity_blocks"]
    assert k["writes"] - k["evicted_segments"] == k["used_blocks"] // 32


# ------------------------------------------------------------------------ stale information
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


# --------------------------------------------------------------------------- the table
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


def test_round_robin_is_the_default_and_unchanged():
    w = Workload.from_requests([Request(i, i * 0.01, 50 + i, 3) for i in range(10)])
    res = cluster(3).run(w)
    assert res.records["instance_id"].tolist() == [i % 3 for i in range(10)]
    assert res.summary["routing"]["requests"] == [4, 3, 3]
    assert res.summary["routing"]["load_imbalance"] == pytest.approx(4 / (10 / 3))
    one = cluster(1).run(w)
    assert "routing" not in one.summary and "shared_kv" not in one.summary


def test_dynamo_temperature_sampling_is_seeded():
    w = shared_system_prompt(n=60, rate_per_s=200.0)
    spec = make_spec(max_num_batched_tokens=2048)
    runs = [simulate(w, spec, n_instances=4, router="dynamo", router_params={"router_temperature": 0.5, "seed": s})
            for s in (1, 1, 2)]
    a, b, c = (r.records["instance_id"].tolist() for r in runs)
    assert a == b and a != c


# -------------------------------------------------------------------------- bad input
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


def test_bad_shared_kv_input():
    with pytest.raises(ConfigError, match="capacity_bytes=0"):
        SharedKVSpec(capacity_bytes=0)
    with pytest.raises(ConfigError, match="fetch_policy='sometimes'.*cost, always, never"):
        SharedKVSpec(capacity_bytes=1e9, fetch_policy="sometimes")
    with pytest.raises(ConfigError, match="network"):
        SharedKVSpec(capacity_bytes=1e9, network="fast")
    with pytest.raises(ConfigError, match="holds no KV block"):
        cluster(2, shared_kv=SharedKVSpec(capacity_bytes=1000))
    other = make_spec(model=get_model("Llama-3.1-70B"), tp=4)
    with pytest.raises(ConfigError, match="cannot share KV"):
        Cluster([make_spec(), other], lambda: make_policy("fcfs"), shared_kv=SharedKVSpec(capacity_bytes=1e12))
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        cluster(2, spec=make_spec(enable_prefix_caching=False), shared_kv=SharedKVSpec(capacity_bytes=1e12))
    with pytest.raises(ConfigError, match="unknown key 'capacity'"):
        SharedKVSpec.from_dict({"capacity": 1e9})
    sk = SharedKVSpec.from_dict({"capacity_bytes": "2e12", "network": {"name": "x", "bytes_per_s": 1e11},
                                 "pool_read": "nvme_gen5_read"})
    assert sk.network == LinkSpec("x", 1e11) and sk.pool_read.bytes_per_s == 10e9


def test_scenario_router_fields_and_errors(tmp_path):
    sc = Scenario(trace="mooncake-conversation", n_instances=4, router="cache-affinity",
                  router_params={"cache_threshold": 0.5}, router_delay_s=1.0,
                  shared_kv={"capacity_bytes": 1e12})
    assert sc.shared_kv_spec().capacity_bytes == 1e12
    assert "router" in sc.to_dict() and "router" not in Scenario().to_dict()
    with pytest.raises(UnknownPresetError, match="unknown router 'nope'"):
        Scenario(router="nope")
    with pytest.raises(ConfigError, match="router_delay_s=-1"):
        Scenario(router_delay_s=-1)
    with pytest.raises(ConfigError, match="unknown parameters"):
        Scenario(router="dynamo", router_params={"temperature": 1})
    with pytest.raises(ConfigError, match="shared_kv: unknown key"):
        Scenario(shared_kv={"capacity_bytes": 1e12, "bandwidth": 5})


def test_cli_simulate_router_and_compare_routers(tmp_path, capsys):
    y = tmp_path / "s.yaml"
    y.write_text("name: t\nsynthetic: {duration_s: 20, rate_per_s: 4}\nn_instances: 3\n"
                 "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\n")
    assert main(["simulate", "--scenario", str(y), "--router", "llm-d", "--router-delay", "0.5",
                 "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["routing"]["router"] == "llm-d" and summary["run"]["router"] == "llm-d"
    assert main(["simulate", "--scenario", str(y), "--router", "nope", "--no-progress"]) == 2
    assert "router 'nope'; known:" in " ".join(capsys.readouterr().err.split())
    out = tmp_path / "cmp"
    assert main(["compare", "--scenario", str(y), "--routers", "rr,cache-affinity", "--instances", "2",
                 "--router-params", '{"cache-affinity": {"cache_threshold": 0.1}}', "--no-progress",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cache-affinity" in text and "rr" in text
    rows = (out / "compare.csv").read_text().splitlines()
    assert rows[0].startswith("router,class,seeds") and len(rows) > 2
    assert "prefix_hit_rate" in rows[0] and "load_imbalance" in rows[0]
    meta = json.loads((out / "compare.json").read_text())
    assert meta["routers"] == ["rr", "cache-affinity"] and meta["policy"] == "fcfs"
    assert main(["compare", "--scenario", str(y), "--routers", "rr,rr", "--no-progress"]) == 2
    assert main(["compare", "--scenario", str(y), "--routers", "rr", "--policies", "fcfs", "--no-progress"]) == 2


def test_run_compare_routers_rows():
    sc = Scenario(trace=None, synthetic={"duration_s": 15, "rate_per_s": 3}, n_instances=2)
    res = run_compare(sc, routers=["rr", "least-loaded"])
    assert list(res.runs.columns[:4]) == ["router", "seed", "window", "class"] and res.axis == "router"
    agg = aggregate(res.runs, res.policies)
    allrow = agg[(agg["router"] == "rr") & (agg["class"] == "all")].iloc[0]
    assert allrow["load_imbalance"] >= 1.0 and math.isnan(allrow["shared_kv_bytes_fetched"])
    with pytest.raises(ConfigError, match="either policies or routers"):
        run_compare(sc, ["fcfs"], routers=["rr"])


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


def test_cli_router_params_errors(capsys):
    assert main(["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--instances", "2",
                 "--router", "cache-affinity", "--router-params", "{bad", "--no-progress"]) == 2
    assert "--router-params: invalid JSON" in capsys.readouterr().err
    assert main(["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--instances", "2",
                 "--router", "cache-affinity", "--router-params", '{"cache_threshold": 2}', "--no-progress"]) == 2
    assert "cache_threshold=2" in " ".join(capsys.readouterr().err.split())


def test_shared_tier_refetch_of_own_work_is_not_a_hit():
    """B is preempted (recompute) while A grows and evicts B's cached segments; at re-admission B
    fetches its own published segments back from the pool: a self-hit, not a shared-tier hit."""
    seg = 32
    reqs = [Request(0, 0.0, 10 * seg, 600, prefix_hashes=tuple(range(10)), hash_block_tokens=seg),
            Request(1, 0.001, 10 * seg, 300, prefix_hashes=tuple(range(100, 110)), hash_block_tokens=seg)]
    spec = make_spec(hbm_kv_blocks=60, max_num_batched_tokens=512)
    res = cluster(1, spec=spec, shared_kv=SharedKVSpec(capacity_bytes=1e12, fetch_policy="always")).run(
        Workload.from_requests(reqs))
    r = res.records.set_index("request_id")
    k = res.summary["shared_kv"]
    assert r.loc[1, "preemptions"] >= 1 and k["fetches"] >= 1
    assert k["hit_tokens"] == 0 and k["self_hit_tokens"] == k["fetched_segments"] * seg > 0
    assert r.loc[1, "prefix_hit_tokens"] == 0


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


def _mixed_prefix_workload(seed=0, n=120, seg=64):
    """Five prompt families (1-11 shared 64-token segments each, plus a private tail), Poisson
    arrivals at 50/s, outputs of 1-199 tokens: prefixes are reused across instances and the
    100-block HBM of each instance forces preemptions."""
    rng = np.random.default_rng(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.exponential(0.02)
        fam, nseg = int(rng.integers(0, 5)), int(rng.integers(1, 12))
        hashes = tuple(fam * 1000 + j for j in range(nseg)) + (100_000 + i,)
        reqs.append(Request(i, t, nseg * seg + int(rng.integers(1, seg)), int(rng.integers(1, 200)),
                            prefix_hashes=hashes, hash_block_tokens=seg))
    return Workload.from_requests(reqs)


@pytest.mark.parametrize("router, mode, delay", [("rr", "recompute", 0.0), ("llm-d", "swap", 0.05),
                                                 ("dynamo", "recompute", 0.05)])
def test_shared_tier_fast_forward_identical_under_pressure(router, mode, delay):
    """A 60-block pool and 100-block instances: pool evictions, fetches and preemptions (swap or
    recompute) during fetches. Fast-forward on and off give byte-identical results, and blocks are
    conserved in every tier and the pool after every step. (Before the fix a decode stretch ran
    while a request waited for KV, although a pool write landing mid-stretch could let it in by a
    fetch.)"""
    w = _mixed_prefix_workload()
    bb = MODEL_BLOCK_BYTES
    spec = make_spec(hbm_kv_blocks=100, max_num_batched_tokens=512, preemption_mode=mode,
                     dram_kv_bytes=200 * bb if mode == "swap" else 0)
    shared = SharedKVSpec(capacity_bytes=60 * bb)
    runs = [cluster(3, router, spec=spec, fast_forward=ff, shared_kv=shared, router_delay_s=delay).run(w)
            for ff in (True, False)]
    k = runs[0].summary["shared_kv"]
    assert k["fetches"] > 0 and k["evicted_segments"] > 0 and runs[0].stats["preemptions"] > 0
    assert runs[0].stats["fast_forward_stretches"] > 0
    assert summary_to_json(runs[0].summary) == summary_to_json(runs[1].summary)
    assert runs[0].records.equals(runs[1].records)


def test_shared_tier_break_even_with_calibrated_h100():
    """The scenarios' calibrated H100 (no ``cost`` given): recompute is cheaper per token than the
    roofline default, so from an empty cache with idle links the fetch wins only from 26 segments
    of 512 tokens (README, shared_kv docstring)."""
    spec = InstanceSpec(MODEL, GPU, max_num_batched_tokens=8192)
    c = Cluster([spec] * 2, lambda: make_policy("fcfs"), shared_kv=SharedKVSpec(capacity_bytes=1e12))
    pool, cost = c.shared_kv, c.instances[0].cost
    wins = {s: (lambda r, f: f < r)(*pool.decide(cost, 0, s * 512 + 100, 0, s * 512, 0.0)) for s in (3, 16, 25, 26, 128)}
    assert wins == {3: False, 16: False, 25: False, 26: True, 128: True}
    r, f = pool.decide(cost, 0, 65536 + 100, 0, 65536, 0.0)
    assert r == pytest.approx(2.84, abs=0.01) and f == pytest.approx(1.62, abs=0.01)


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


def test_shared_kv_network_preset_name():
    """The default network link can be named in a scenario; unknown names list the choices."""
    spec = SharedKVSpec.from_dict({"capacity_bytes": 1e12, "network": "cmx-400g", "pool_read": "nvme_gen5_read"})
    assert spec.network == SharedKVSpec(capacity_bytes=1e12).network and spec.network.bytes_per_s == 50e9
    assert spec.pool_read.name == "nvme_gen5_read"
    with pytest.raises(UnknownPresetError, match=r"shared_kv\.network: unknown link 'foo'; known: cmx-400g, pcie4"):
        SharedKVSpec.from_dict({"capacity_bytes": 1e12, "network": "foo"})
