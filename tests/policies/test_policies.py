"""Reference schedulers on mixed long/short traffic: the behaviour issue #4 asks for, with
stated margins (not exact numbers). Workloads: synthetic short chat on one H100 with
Llama-3.1-8B, plus long-context requests (30k-100k prompt tokens) mixed in."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.runner.simulate import simulate
from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.request import Request, Workload
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.policies.base import make_policy, policy_names
from simkit import short_only, with_longs


def mixed(fraction: float, lo: int, hi: int, seed=3):
    s = short_only()
    rng = np.random.default_rng(seed)
    n = int(fraction * len(s))
    return s, with_longs(s, np.sort(rng.uniform(5, 110, n)), rng.integers(lo, hi, n))


def spec(**kw) -> InstanceSpec:
    # the scenarios below were sized with the literature cost parameters: pin them (the calibrated
    # H100 default changes step times and with them the queueing regimes these tests rely on)
    kw.setdefault("cost", CostParams())
    return InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=get_gpu("H100-SXM"), **kw)


def ttft(res, cls, q):
    return res.summary["classes"][cls]["ttft_s"][f"p{q}"]


@pytest.fixture(scope="module")
def mix5():
    return mixed(0.05, 40_000, 100_000)


@pytest.fixture(scope="module")
def mix3():
    return mixed(0.03, 30_000, 90_000)


def test_registry_lists_the_reference_policies():
    assert {"fcfs", "priority", "sarathi", "nonpreemptive", "lars"} <= set(policy_names())
    with pytest.raises(UnknownPresetError, match="lars"):
        make_policy("lasr")
    with pytest.raises(ConfigError, match="kappa"):
        make_policy("lars", {"kappa": -1.0})
    # every LARS field is checked, whatever the type test that accepts the usual values first
    for field, bad in (("kappa", float("nan")), ("kappa", float("inf")), ("ttft_floor_s", True),
                       ("tbt_target_s", "0.05"),
                       ("eps_s", 0), ("adaptive_chunking", "yes"), ("adaptive_chunking", 1),
                       ("max_chunk_tokens", 512.0), ("min_chunk_tokens", 0), ("chunk_multiple_tokens", False),
                       ("normalize", "sum")):
        with pytest.raises(ConfigError, match=f"LARSParams.{field}"):
            make_policy("lars", {field: bad})
    assert make_policy("lars", {"kappa": 2, "ttft_floor_s": 1, "adaptive_chunking": False}).params.kappa == 2
    with pytest.raises(ConfigError, match="allowed"):
        make_policy("sarathi", {"chunk": 512})


def test_few_long_requests_multiply_short_ttft_under_nonpreemptive_fcfs(mix5):
    """5 % long prompts: short median and p99 TTFT grow many times over the short-only run."""
    short, mix = mix5
    alone = simulate(short, spec(), "nonpreemptive")
    both = simulate(mix, spec(), "nonpreemptive")
    assert ttft(both, "short", 50) > 20 * ttft(alone, "short", 50)
    assert ttft(both, "short", 99) > 20 * ttft(alone, "short", 99)


def test_naive_priority_does_not_repair_it_but_lars_does(mix3):
    """Shortest-prompt-first still leaves short requests waiting for the GPU a long prefill
    holds; chunked prefill with LARS brings short p99 TTFT back within the short SLO (LARS
    serves a request just in time for its deadline, so not down to the short-only run), and
    every long request still finishes."""
    short, mix = mix3
    alone = simulate(short, spec(), "fcfs")
    prio = simulate(mix, spec(), "priority")
    lars = simulate(mix, spec(), "lars")
    assert ttft(prio, "short", 99) > 20 * ttft(alone, "short", 99)
    assert ttft(lars, "short", 99) < 0.5 * 1.0  # half the default 1 s short TTFT SLO
    assert ttft(lars, "short", 99) < ttft(prio, "short", 99) / 10
    assert lars.summary["classes"]["short"]["slo"]["attainment"] == 1.0
    assert ttft(lars, "short", 99) < 8 * ttft(alone, "short", 99)
    long_counts = lars.summary["classes"]["long"]["counts"]
    assert long_counts["finished"] == long_counts["arrived"] > 0


def test_sjf_starves_long_requests_under_sustained_short_load_lars_does_not():
    s = short_only(rate=40.0, dur=60.0, seed=2)
    mix = with_longs(s, [5.0, 10.0], [20_000, 30_000])
    sp = spec(max_num_seqs=64)
    wait = {p: simulate(mix, sp, p).summary["classes"]["long"]["starvation"]["max_queueing_delay_s"]
            for p in ("priority", "lars")}
    assert wait["priority"] > 30.0          # waits until the short arrivals stop
    assert wait["lars"] < 10.0              # bounded by its deadline
    assert wait["priority"] > 4 * wait["lars"]


def test_lars_adaptive_chunks_shrink_as_the_prefill_context_grows():
    pol = make_policy("lars")
    from kvsched.envs.sim.cost_model import CostModel
    from kvsched.policies.base import PolicyContext

    sp = spec()
    pol.bind(PolicyContext(spec=sp, cost=CostModel(sp)))
    sizes = [pol.chunk_limit(200_000, p, 32, 32 * 1000.0, 32 * 1000) for p in (0, 20_000, 60_000, 150_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert all(s % 16 == 0 and s >= 32 for s in sizes)
    # the chosen chunk keeps the step within the TBT target
    cm = CostModel(sp)
    c, p = sizes[1], 20_000
    assert cm.step_time_s(32 + c, 32_000 + c * (p + c / 2), 32_000 + p + c) <= pol.params.tbt_target_s


def test_lars_set_params_equals_a_fresh_bind():
    """set_params (Knobs-v0's per-interval update) leaves LARS exactly as binding a new LARS with
    those parameters would: the cached chunk candidates equal a fresh np.arange (read-only,
    shared between equal keys), and chunk limits are equal; other policies re-bind."""
    import dataclasses

    from kvsched.envs.sim.cost_model import CostModel
    from kvsched.policies.base import PolicyContext

    sp = spec()
    ctx = PolicyContext(spec=sp, cost=CostModel(sp))
    pol = make_policy("lars")
    pol.bind(ctx)
    for min_c, max_c, mult in ((32, 256, 16), (40, 8192, 16), (100, 1000, 7), (32, 4096, 16), (32, 256, 16)):
        params = dataclasses.replace(pol.params, min_chunk_tokens=min_c, max_chunk_tokens=max_c,
                                     chunk_multiple_tokens=mult, tbt_target_s=0.03)
        pol.set_params(params)
        fresh = make_policy("lars", dataclasses.asdict(params))
        fresh.bind(ctx)
        lo = max(mult, (min_c // mult) * mult)
        expected = np.arange(lo, max_c + 1, mult, dtype=np.float64)
        assert pol.params is params and pol._candidates.dtype == np.float64
        assert np.array_equal(pol._candidates, expected) and np.array_equal(fresh._candidates, expected)
        assert not pol._candidates.flags.writeable and pol._candidates is fresh._candidates
        for done in (0, 5_000, 60_000):
            assert pol.chunk_limit(100_000, done, 32, 32_000.0, 32_000) == \
                fresh.chunk_limit(100_000, done, 32, 32_000.0, 32_000)
    fcfs = make_policy("fcfs")
    fcfs.bind(ctx)
    new = dataclasses.replace(fcfs.params, prefetch=True)
    fcfs.set_params(new)
    assert fcfs.params is new and fcfs.ctx is ctx


def test_smaller_token_budget_lowers_p99_itl_and_raises_long_ttft(mix3):
    _, mix = mix3
    small = simulate(mix, spec(), "sarathi", )
    from kvsched.envs.sim.cluster import Cluster
    big = Cluster([spec()], lambda: make_policy("sarathi", {"token_budget": 4096})).run(mix)
    itl = lambda r: r.summary["classes"]["all"]["itl_s"]["p99"]  # noqa: E731
    assert itl(small) < itl(big)
    assert ttft(small, "long", 50) > ttft(big, "long", 50)


def test_several_partial_prefills_or_a_threshold_restore_short_ttft():
    """One very long prompt under a small budget with one partial prefill at a time stalls
    short requests behind it; several partial prefills (vLLM then caps each at 4 % of
    max_model_len) or a long-prefill threshold restore their TTFT."""
    s = short_only(rate=4.0, dur=40.0)
    mix = with_longs(s, [2.0], [100_000])
    base = dict(max_num_batched_tokens=2048)
    one = simulate(mix, spec(**base), "fcfs")
    several = simulate(mix, spec(**base, max_num_partial_prefills=4), "fcfs")
    thresh = simulate(mix, spec(**base, long_prefill_token_threshold=512), "fcfs")
    assert ttft(one, "short", 99) > 10 * ttft(several, "short", 99)
    assert ttft(one, "short", 99) > 10 * ttft(thresh, "short", 99)


def test_under_fcfs_every_length_waits_about_the_same_absolute_time():
    """In an overloaded FCFS queue, short and long prompts wait alike, so short requests wait
    many times their own service time."""
    w = short_only(rate=60.0, dur=20.0, seed=5)
    res = simulate(w, spec(max_num_seqs=32), "fcfs")
    rec = res.records
    q = rec.first_scheduled_s - rec.arrival_s
    lo = rec.prompt_tokens <= rec.prompt_tokens.quantile(0.25)
    hi = rec.prompt_tokens >= rec.prompt_tokens.quantile(0.75)
    ratio = q[lo].mean() / q[hi].mean()
    assert 0.7 < ratio < 1.4
    from kvsched.envs.sim.cost_model import CostModel

    service = CostModel(spec()).prefill_time_s(rec.prompt_tokens[lo].to_numpy())
    assert float(np.median(q[lo].to_numpy() / service)) > 10


def test_tier_aware_costs_make_recompute_cheaper_for_short_and_offload_for_long_contexts():
    """REFERENCE §5.4: recompute grows quadratically with context, an NVMe round trip linearly,
    so the simulator must not hard-code either: short victims recompute, long ones offload."""
    from kvsched.envs.sim.cluster import Cluster

    sp = spec(hbm_kv_blocks=20_000, nvme_kv_bytes=200 * 2**30)
    inst = Cluster([sp], lambda: make_policy("fcfs", {"tier_aware_preemption": True})).instances[0]
    from kvsched.envs.sim.request import RequestState

    states = []
    for rid, ctx in ((0, 1_000), (1, 120_000)):
        st = RequestState(Request(rid, 0.0, ctx + 1, 10), 16, 0)
        st.computed = ctx
        st.private_blocks = -(-ctx // 16)
        states.append(st)
    costs = inst.preemptor.costs(states)
    assert set(costs) == {"recompute", "offload"}
    assert costs["recompute"][0] < costs["offload"][0]
    assert costs["offload"][1] < costs["recompute"][1]


def test_preemption_pays_with_a_dram_tier():
    """Long contexts on a small KV cache: recompute preemption throws away long prefills; with
    a DRAM tier, tier-aware preemption swaps instead (PCIe is ~10x cheaper per token than
    recompute on an H100), so nothing is recomputed and long requests finish sooner."""
    s = short_only(rate=3.0, dur=60.0)
    rng = np.random.default_rng(11)
    mix = with_longs(s, np.sort(rng.uniform(2, 50, 8)), rng.integers(20_000, 40_000, 8), out=400)
    small = dict(hbm_kv_blocks=5_000)  # 80k tokens of KV
    recompute = simulate(mix, spec(**small), "fcfs")
    from kvsched.envs.sim.cluster import Cluster

    swap = Cluster([spec(**small, dram_kv_bytes=64 * 2**30)],
                   lambda: make_policy("fcfs", {"tier_aware_preemption": True})).run(mix)
    rc, sw = recompute.summary["classes"]["all"], swap.summary["classes"]["all"]
    assert rc["preemptions"]["total"] > 0 and rc["preemptions"]["recomputed_tokens"] > 50_000
    assert sw["preemptions"]["recomputed_tokens"] == 0 and sw["bytes_moved"]["hbm_to_dram"] > 0
    assert swap.summary["classes"]["long"]["e2e_s"]["mean"] < recompute.summary["classes"]["long"]["e2e_s"]["mean"]


def test_prefetch_cuts_the_stall_of_swapped_in_requests():
    """Reload on demand (vLLM V0) makes every running request wait for a swap-in copy; with
    prefetch the copy runs behind the steps' compute, so the inter-token stalls shrink."""
    s = short_only(rate=3.0, dur=60.0)
    rng = np.random.default_rng(11)
    mix = with_longs(s, np.sort(rng.uniform(2, 50, 8)), rng.integers(20_000, 40_000, 8), out=400)
    from kvsched.envs.sim.cluster import Cluster

    sp = spec(hbm_kv_blocks=5_000, dram_kv_bytes=64 * 2**30, preemption_mode="swap")
    on_demand = Cluster([sp], lambda: make_policy("fcfs")).run(mix)
    prefetch = Cluster([sp], lambda: make_policy("fcfs", {"prefetch": True})).run(mix)
    a, b = on_demand.summary["classes"]["all"], prefetch.summary["classes"]["all"]
    assert a["bytes_moved"]["dram_to_hbm"] > 0 and b["bytes_moved"]["dram_to_hbm"] > 0
    assert b["itl_s"]["p99"] < 0.5 * a["itl_s"]["p99"]   # measured 31 ms vs 163 ms
    assert b["itl_s"]["mean"] < a["itl_s"]["mean"]


def test_admitting_while_swapped_fills_host_memory_and_still_finishes():
    """Swap preemption that keeps admitting new prompts while others are swapped out (vLLM V0
    with chunked prefill) pushes ever more KV to the host until DRAM is full (then it falls back
    to recompute); the run still makes progress, also with a request that alone needs most of
    HBM."""
    s = short_only(rate=6.0, dur=40.0)
    mix = with_longs(s, [1.0, 3.0, 6.0, 9.0], [30_000, 60_000, 70_000, 75_000], out=300)
    from kvsched.envs.sim.cluster import Cluster

    sp = spec(hbm_kv_blocks=5_000, dram_kv_bytes=5 * 2**30, preemption_mode="swap")  # 2,560 DRAM blocks
    keep = Cluster([sp], lambda: make_policy("fcfs", {"admit_while_swapped": True})).run(mix)
    v0 = Cluster([sp], lambda: make_policy("fcfs")).run(mix)
    for res in (keep, v0):
        assert (res.records.status == "finished").all()
    dram_keep = keep.summary["kv_occupancy"]["tiers"]["dram"]
    dram_v0 = v0.summary["kv_occupancy"]["tiers"]["dram"]
    assert dram_keep["max_capacity_blocks"] == 2560
    assert dram_keep["max_utilization"] > 0.99 and dram_v0["max_utilization"] <= 1.0
    pk, pv = keep.summary["classes"]["all"]["preemptions"], v0.summary["classes"]["all"]["preemptions"]
    # DRAM (40,960 tokens) holds none of the 60k-75k-token requests: once new prompts have taken the
    # HBM a swap-out freed, victims fall back to recompute (measured 2.10M vs 41k tokens; the
    # request count is about the same, 41 vs 42: see the sustained-arrivals test below for it)
    assert pk["recomputed_tokens"] > 10 * pv["recomputed_tokens"]


def _sustained_short(rate=4.0, dur=20.0):
    """Poisson arrivals of equal requests (500 prompt, 600 output tokens): their decodes keep
    outgrowing a small HBM while new ones keep arriving."""
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.exponential(1 / rate, int(2 * rate * dur)))
    return Workload.from_requests([Request(i, float(a), 500, 600) for i, a in enumerate(t[t < dur])])


def test_admitting_while_swapped_lets_new_prompts_beat_swapped_ones_back_until_dram_is_full():
    """The case vLLM V0 users reported: with chunked prefill, V0 admits new prompts into the HBM
    a swap-out just freed (``_schedule_chunked_prefill`` runs ``_schedule_prefills`` after any
    running pass, ``_schedule_swapped`` only after one without preemption), so under sustained
    arrivals ever more requests wait swapped out until host memory is full (V0 then aborts,
    "lack of CPU swap space"; kvsched falls back to recompute). The default holds admission
    while anyone is swapped out. Measured: DRAM peak 588 vs 183 of 600 blocks, 54 vs 40
    requests swapped, 2,864 vs 0 recomputed tokens."""
    from kvsched.envs.sim.cluster import Cluster
    from simkit import BLOCK_BYTES, make_spec

    w = _sustained_short()
    sp = make_spec(hbm_kv_blocks=300, dram_kv_bytes=600 * BLOCK_BYTES, preemption_mode="swap",
                   max_num_batched_tokens=2048)
    v0 = Cluster([sp], lambda: make_policy("fcfs", {"admit_while_swapped": True,
                                                     "admit_in_preemption_step": True})).run(w)
    held = Cluster([sp], lambda: make_policy("fcfs")).run(w)
    for res in (v0, held):
        assert (res.records.status == "finished").all()
    dram_v0 = v0.summary["kv_occupancy"]["tiers"]["dram"]["max_used_blocks"]
    dram_held = held.summary["kv_occupancy"]["tiers"]["dram"]["max_used_blocks"]
    assert dram_v0 >= 0.95 * 600 and dram_held < 0.5 * 600
    swapped_v0 = int((v0.records.bytes_hbm_to_dram > 0).sum())
    swapped_held = int((held.records.bytes_hbm_to_dram > 0).sum())
    assert swapped_v0 > swapped_held
    # DRAM full: further victims fall back to recompute
    assert v0.records.recomputed_tokens.sum() > 0 == held.records.recomputed_tokens.sum()


def test_admitting_while_swapped_changes_nothing_without_a_dram_tier():
    """Recompute preemption only (no lower tier): nobody is ever swapped out, so the flag leaves
    the run byte-identical under the same sustained pressure (47,735 recomputed tokens)."""
    from kvsched.envs.sim.cluster import Cluster
    from simkit import assert_identical, make_spec

    w = _sustained_short()
    sp = make_spec(hbm_kv_blocks=300, max_num_batched_tokens=2048)
    on = Cluster([sp], lambda: make_policy("fcfs", {"admit_while_swapped": True,
                                                     "admit_in_preemption_step": True})).run(w)
    off = Cluster([sp], lambda: make_policy("fcfs")).run(w)
    assert off.records.recomputed_tokens.sum() > 0  # preemption happened
    assert_identical(on, off)


# --------------------------------------------------------------------------------------------
# Admission preemption: does pushing a long request out of HBM for blocked short ones pay?

def _burst(long_prompt=100_000, long_out=600, n_short=20, at_s=8.0):
    """One long-context request decoding in a nearly full HBM when a burst of short ones arrives."""
    rng = np.random.default_rng(5)
    reqs = [Request(0, 0.0, long_prompt, long_out)] + [
        Request(1 + i, at_s + 0.05 * i, int(rng.integers(200, 600)), int(rng.integers(50, 150)))
        for i in range(n_short)]
    return Workload.from_requests(reqs, name="burst")


def _run_admission(w, sp, mode, **kw):
    from kvsched.envs.sim.cluster import Cluster

    return Cluster([sp], lambda: make_policy("fcfs", dict(admission_preemption=mode, **kw))).run(w)


@pytest.fixture(scope="module")
def admission_runs():
    w = _burst()
    small = dict(hbm_kv_blocks=6_400)  # 102k tokens: the 100k request leaves room for ~4 short ones
    out = {}
    for tier, extra in (("none", {}), ("dram", dict(dram_kv_bytes=64 * 2**30, preemption_mode="swap"))):
        sp = spec(**small, **extra)
        out[tier] = {m: _run_admission(w, sp, m) for m in ("never", "always", "cost-gated")}
    return out


def _mean_e2e(res, cls="all"):
    return res.summary["classes"][cls]["e2e_s"]["mean"]


def test_preempting_a_long_victim_without_a_lower_tier_does_not_pay(admission_runs):
    """No DRAM: the only way out of HBM is recompute, and re-prefilling 100k tokens (~7 s on the
    H100) costs more than the ~3 s the burst would wait; the re-admitted request is then vLLM's
    newest victim again. Measured: mean E2E 3.5 s (never) vs 30 s (always)."""
    runs = admission_runs["none"]
    never, always, gated = runs["never"], runs["always"], runs["cost-gated"]
    assert always.stats["admission_preemptions"] >= 1
    assert always.summary["classes"]["all"]["preemptions"]["recomputed_tokens"] >= 100_000
    assert _mean_e2e(always) > 3 * _mean_e2e(never)
    assert ttft(always, "short", 50) > 3 * ttft(never, "short", 50)
    # the cost gate sees recompute > delay removed and keeps waiting: the same run as never
    assert gated.stats["admission_preemptions"] == 0
    assert gated.summary == never.summary


def test_preempting_a_long_victim_with_a_dram_tier_pays(admission_runs):
    """With DRAM the victim's 100k tokens go out and back over PCIe in ~0.26 s, far less than the
    burst's wait: the gate preempts, short requests stop waiting for the long one, and the long
    request pays about the burst's service time. Measured: short TTFT p99 4.0 s -> 1.3 s, mean
    E2E 3.5 s -> 2.5 s, long E2E 15.1 s -> 16.6 s."""
    runs = admission_runs["dram"]
    never, gated = runs["never"], runs["cost-gated"]
    assert never.stats["admission_preemptions"] == 0
    assert gated.stats["admission_preemptions"] == 1
    all_g = gated.summary["classes"]["all"]
    assert all_g["bytes_moved"]["hbm_to_dram"] >= 100_000 * 0.9 * spec().kv_bytes_per_token
    assert all_g["preemptions"]["recomputed_tokens"] == 0
    assert _mean_e2e(gated) < 0.8 * _mean_e2e(never)
    assert ttft(gated, "short", 99) < 0.5 * ttft(never, "short", 99)
    assert _mean_e2e(never, "long") < _mean_e2e(gated, "long") < _mean_e2e(never, "long") + 3.0
    assert (gated.records.status == "finished").all()


def test_the_cost_gate_prefers_the_tier_that_makes_preemption_cheap(admission_runs):
    """Same workload, same gate: it preempts with DRAM (swap is cheap) and not without (recompute is
    not); the naive rule preempts in both."""
    n = {t: {m: r.stats["admission_preemptions"] for m, r in runs.items()} for t, runs in admission_runs.items()}
    assert n["none"]["cost-gated"] == 0 < n["dram"]["cost-gated"]
    assert n["none"]["always"] >= 1 and n["dram"]["always"] >= 1


def test_admission_preemption_uses_an_extra_tiers_mode_as_it_uses_dram():
    """An extra tier holding swapped blocks is a preemption target under its own mode for admission
    preemption too: with the spec's mode naming it, the victim swaps there (no recompute), priced
    by its round trip (it used to be ignored: the victim was recomputed and the gate priced a
    re-prefill), and a tier-aware policy offers it."""
    from kvsched.envs.sim.specs import LinkSpec, TierSpec

    w = _burst()
    pcie = spec().pcie_link  # the same link as DRAM's: the same costs, the same decisions
    cxl = TierSpec("cxl", 64 * 2**30, ("swapped",), "hbm", pcie, pcie)
    dram_runs = admission_runs_for(w, dict(dram_kv_bytes=64 * 2**30, preemption_mode="swap"))
    cxl_runs = admission_runs_for(w, dict(extra_tiers=(cxl,), preemption_mode="cxl"))
    for m in ("always", "cost-gated"):
        d, c = dram_runs[m], cxl_runs[m]
        assert c.stats["admission_preemptions"] == d.stats["admission_preemptions"] >= 1
        assert c.summary["classes"]["all"]["preemptions"]["recomputed_tokens"] == 0
        assert c.stats["link_bytes"]["cxl_write"] == d.stats["link_bytes"]["pcie_d2h"] > 0
    tier_aware = _run_admission(w, spec(hbm_kv_blocks=6_400, extra_tiers=(cxl,)), "always",
                                tier_aware_preemption=True)
    assert tier_aware.stats["admission_preemptions"] >= 1 and tier_aware.stats["link_bytes"]["cxl_write"] > 0
    assert tier_aware.summary["classes"]["all"]["preemptions"]["recomputed_tokens"] == 0


def test_admission_preemption_falls_back_in_the_instances_tier_order():
    from kvsched.policies.preemption import _fallback_chain

    modes = ["recompute", "swap", "offload", "cxl", "far"]
    assert _fallback_chain("swap", modes) == ("swap", "offload", "cxl", "far", "recompute")
    assert _fallback_chain("offload", modes) == ("offload", "cxl", "far", "recompute")
    assert _fallback_chain("cxl", modes) == ("cxl", "far", "recompute")
    assert _fallback_chain("recompute", modes) == ("recompute",)
    # a tier without capacity is not offered: its mode starts at the next tier
    assert _fallback_chain("swap", ["recompute", "offload"]) == ("offload", "recompute")
    assert _fallback_chain("offload", ["recompute", "swap", "cxl"]) == ("cxl", "recompute")


def admission_runs_for(w, tier_kw):
    sp = spec(hbm_kv_blocks=6_400, **tier_kw)
    return {m: _run_admission(w, sp, m) for m in ("always", "cost-gated")}


def test_admission_preemption_is_deterministic_and_fast_forward_exact():
    from kvsched.envs.sim.cluster import Cluster
    from kvsched.envs.sim.instance import InstanceOptions

    w = _burst(long_out=300)
    sp = spec(hbm_kv_blocks=6_400, dram_kv_bytes=64 * 2**30, preemption_mode="swap")
    res = [Cluster([sp], lambda: make_policy("fcfs", {"admission_preemption": "cost-gated"}),
                   options=InstanceOptions(fast_forward=ff, check_invariants=True)).run(w)
           for ff in (True, False, True)]
    assert res[0].stats["admission_preemptions"] == 1
    assert res[0].summary == res[1].summary == res[2].summary
    assert res[0].records.equals(res[1].records)


def test_admission_preemption_parameters_are_validated():
    with pytest.raises(ConfigError, match="admission_preemption"):
        make_policy("fcfs", {"admission_preemption": "sometimes"})
    with pytest.raises(ConfigError, match="max_admission_preemptions"):
        make_policy("lars", {"max_admission_preemptions": 0})
    with pytest.raises(ConfigError, match="prefetch"):
        make_policy("sarathi", {"prefetch": "yes"})


def test_expected_remaining_output_is_the_mean_residual_of_finished_lengths():
    from kvsched.policies.preemption import OutputLengthHistory

    h = OutputLengthHistory(window=3)
    assert h.expected_remaining(np.array([0, 5])).tolist() == [1.0, 5.0]  # no history: max(g, 1)
    for n in (10, 100, 20, 40):  # the window keeps 100, 20, 40
        h.add(n)
    # g=0: mean 53.3; g=30: mean of {100, 40} - 30 = 40; g=100: none above -> g itself
    np.testing.assert_allclose(h.expected_remaining(np.array([0, 30, 100])), [160 / 3, 40.0, 100.0])


def test_prefetch_policy_is_fcfs_with_prefetch_and_tier_aware_preemption():
    """``prefetch`` (the issue's compare name) = FCFS with both options on, and differs from plain FCFS
    where there is something to prefetch."""
    from kvsched.envs.sim.cluster import Cluster

    s = short_only(rate=3.0, dur=60.0)
    rng = np.random.default_rng(11)
    mix = with_longs(s, np.sort(rng.uniform(2, 50, 8)), rng.integers(20_000, 40_000, 8), out=400)
    sp = spec(hbm_kv_blocks=5_000, dram_kv_bytes=64 * 2**30, preemption_mode="swap")
    named = Cluster([sp], lambda: make_policy("prefetch")).run(mix)
    flags = Cluster([sp], lambda: make_policy("fcfs", {"prefetch": True, "tier_aware_preemption": True})).run(mix)
    plain = Cluster([sp], lambda: make_policy("fcfs")).run(mix)
    assert named.summary == flags.summary
    assert named.summary["classes"]["all"]["bytes_moved"]["dram_to_hbm"] > 0
    assert named.summary["classes"]["all"]["itl_s"]["p99"] < plain.summary["classes"]["all"]["itl_s"]["p99"]
    assert make_policy("prefetch", {"prefetch": False}).params.prefetch is False


def test_admit_in_preemption_step_without_admit_while_swapped_is_refused_not_ignored():
    from kvsched.envs.sim.errors import ConfigError

    with pytest.raises(ConfigError, match="admit_in_preemption_step"):
        make_policy("fcfs", {"admit_in_preemption_step": True})
    make_policy("fcfs", {"admit_in_preemption_step": True, "admit_while_swapped": True})
