"""Prefill/decode disaggregation (kvsched.envs.sim.disagg): roles, the KV hand-off over a link,
decode-side admission, fast-forward equivalence, TTFT arithmetic and bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.disagg import (DISAGG_LINK_PRESETS, DisaggRuntime, DisaggSpec, cluster_layout_from_dict,
                                     parse_layout_label)
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.hardware import LinkSpec
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import Request, Workload
from kvsched.policies.base import make_policy
from simkit import NO_FRONT_END, make_spec

INFINITE_LINK = LinkSpec("infinite", 1e30, 0.0)


def run_pd(w, roles, specs=None, ff=True, check=True, observer=None, prefill_router=None, **kw):
    specs = specs or [make_spec(cost=NO_FRONT_END)] * len(roles)
    c = Cluster(specs, lambda: make_policy("fcfs"), options=InstanceOptions(fast_forward=ff, check_invariants=check),
                disagg=DisaggSpec(tuple(roles), **kw), observer=observer, prefill_router=prefill_router)
    return c.run(w), c


def workload(seed=0, n=40, rate=20.0, prompt=(64, 1500), out=(2, 120), groups=0, seg=32):
    rng = np.random.default_rng(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(1.0 / rate))
        p = int(rng.integers(*prompt))
        g = int(rng.integers(0, groups + 1)) if groups else 0
        hashes = tuple(1000 * g + k for k in range(p // seg)) if g else ()
        reqs.append(Request(i, t, p, int(rng.integers(*out)), prefix_hashes=hashes,
                            hash_block_tokens=seg if hashes else 0))
    return Workload.from_requests(reqs)


def assert_same(a, b):
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=True)
    assert summary_to_json(a.summary) == summary_to_json(b.summary)
    pd.testing.assert_frame_equal(a.occupancy, b.occupancy, check_exact=True)


# ----------------------------------------------------------------------------- conservation
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=hst.integers(0, 10_000), transfer=hst.sampled_from(["whole", "layerwise"]),
       no_room=hst.sampled_from(["wait", "recompute", "reject"]), decode_blocks=hst.sampled_from([120, 400, 4096]),
       layout=hst.sampled_from([("prefill", "decode"), ("prefill", "prefill", "decode"),
                                ("prefill", "decode", "mixed")]))
def test_blocks_conserved_across_instances_at_every_event_during_transfers(seed, transfer, no_room, decode_blocks,
                                                                           layout):
    """Every instance's pools conserve their blocks and its holdings add up (the prefill side's
    sending copies included) after every event of the run (check_invariants checks all instances
    at every event with roles); every request ends finished or rejected; transfers happened."""
    specs = [make_spec(cost=NO_FRONT_END, hbm_kv_blocks=4096 if r == "prefill" else decode_blocks) for r in layout]
    w = workload(seed, n=30, groups=3)
    res, c = run_pd(w, layout, specs=specs, transfer=transfer, on_no_room=no_room)
    assert len(res.records) == len(w)
    assert res.summary["disaggregation"]["remote_prefills"] > 0
    for inst in c.instances:  # at the end nothing is held for a transfer
        assert not inst.sending and inst.kv.hbm.used_blocks == 0
    rt = c.disagg
    assert not rt.by_pst and not rt.landing and not rt.by_dst


def test_decode_never_starts_before_its_blocks_land(monkeypatch):
    """No step of a decode instance computes a remotely prefilled request before its KV landed;
    its first token comes after the landing (whole and layerwise transfers)."""
    for transfer in ("whole", "layerwise"):
        landed: dict[int, float] = {}
        orig = DisaggRuntime.on_landed

        def spy(self, st, now, _orig=orig, _landed=landed):
            p = _orig(self, st, now)
            if p is not None:
                _landed[st.rid] = now
            return p

        monkeypatch.setattr(DisaggRuntime, "on_landed", spy)

        class Steps:
            def __init__(self):
                self.first: dict[int, float] = {}

            def on_step(self, ev):
                if ev.instance_id == 1:
                    for b in ev.batch:
                        self.first.setdefault(b.request_id, ev.start_s)

            def on_preemption(self, ev):
                pass

            def on_transfer(self, ev):
                pass

            def on_route(self, ev):
                pass

        obs = Steps()
        w = workload(3, n=30)
        res, c = run_pd(w, ("prefill", "decode"), observer=obs, transfer=transfer)
        assert c.disagg.counters.preempted_receiving == 0
        assert len(landed) == len(w)
        rec = res.records.set_index("request_id")
        for rid, t_land in landed.items():
            assert obs.first[rid] >= t_land
            assert rec.loc[rid, "first_token_s"] > t_land


def test_ttft_of_a_disaggregated_request_is_prefill_plus_transfer_plus_first_decode_step():
    """One 400-token request on 1P1D, whole transfer over InfiniBand NDR: TTFT = the prefill step
    (400 tokens alone) + latency + 399 tokens' KV bytes / bandwidth + one step computing the
    last prompt token after 399 cached tokens (the cost model's arithmetic; no front end)."""
    spec = make_spec(cost=NO_FRONT_END)
    w = Workload.from_requests([Request(0, 0.0, 400, 3)])
    res, _ = run_pd(w, ("prefill", "decode"), specs=[spec, spec])
    cm = CostModel(spec)
    link = DISAGG_LINK_PRESETS["ib_ndr_400g"]
    nbytes = int(round(399 * spec.kv_bytes_per_block / spec.block_size_tokens))
    prefill = float(cm.chunk_time_s(400, 0))
    transfer = link.latency_s + nbytes / link.bytes_per_s
    first_decode = float(cm.chunk_time_s(1, 399))
    ttft = float(res.records["first_token_s"][0] - res.records["arrival_s"][0])
    assert ttft == pytest.approx(prefill + transfer + first_decode, rel=1e-12)
    assert res.summary["disaggregation"]["bytes_moved"] == nbytes


def test_infinitely_fast_link_disaggregated_itl_no_worse_than_mixed():
    """Equal capacity (two H100s): 1 prefill + 1 decode instance with an infinitely fast link vs
    two mixed instances: decode steps no longer carry prefill chunks, so the inter-token
    latency (TPOT mean and p99, worst gap) is no worse."""
    w = workload(5, n=60, rate=8.0, prompt=(500, 3000), out=(40, 200))
    spec = make_spec(cost=NO_FRONT_END)
    pd_res, _ = run_pd(w, ("prefill", "decode"), check=False, link=INFINITE_LINK)
    mixed, _ = run_pd(w, ("mixed", "mixed"), check=False)
    a, b = pd_res.summary["classes"]["all"], mixed.summary["classes"]["all"]
    assert a["tpot_s"]["mean"] <= b["tpot_s"]["mean"]
    assert a["tpot_s"]["p99"] <= b["tpot_s"]["p99"]
    assert pd_res.records["max_itl_s"].max() <= mixed.records["max_itl_s"].max()
    assert spec.tp == 1  # equal GPU count: two instances of one GPU each


@pytest.mark.parametrize("transfer", ["whole", "layerwise"])
@pytest.mark.parametrize("roles", [("prefill", "decode"), ("prefill", "decode", "decode", "mixed")])
def test_fast_forward_equals_step_by_step(transfer, roles):
    w = workload(11, n=40, rate=6.0, out=(20, 300), groups=2)
    fast, _ = run_pd(w, roles, ff=True, check=False, transfer=transfer, max_local_prefill_tokens=300)
    slow, _ = run_pd(w, roles, ff=False, check=False, transfer=transfer, max_local_prefill_tokens=300)
    assert_same(fast, slow)
    assert fast.stats["fast_forward_steps"] > 0  # stretches did run on the decode side


@pytest.mark.parametrize("no_room", ["wait", "recompute", "reject"])
def test_fast_forward_equals_step_by_step_when_the_decode_side_runs_out_of_blocks(no_room):
    """A small decode instance (blocked heads, preemptions, the no-room options): still exact."""
    w = workload(12, n=30, rate=30.0, prompt=(800, 2500), out=(50, 300))
    specs = [make_spec(cost=NO_FRONT_END), make_spec(cost=NO_FRONT_END, hbm_kv_blocks=300)]
    fast, c = run_pd(w, ("prefill", "decode"), specs=specs, ff=True, check=False, on_no_room=no_room)
    slow, _ = run_pd(w, ("prefill", "decode"), specs=specs, ff=False, check=False, on_no_room=no_room)
    assert_same(fast, slow)
    assert c.disagg.counters.waits_for_room + c.disagg.counters.recomputed + c.disagg.counters.rejected > 0


# ------------------------------------------------------------------- decisions and options
def test_dynamo_threshold_prefills_short_prompts_locally():
    """max_local_prefill_tokens (Dynamo's max_local_prefill_length): prompts whose uncached part is
    at most the threshold prefill on the decode instance, longer ones remotely."""
    w = workload(2, n=30, prompt=(100, 2000))
    res, c = run_pd(w, ("prefill", "decode"), max_local_prefill_tokens=1000)
    long = int((w.prompt_tokens > 1000).sum())
    assert c.disagg.counters.remote_prefills == long
    assert c.disagg.counters.local_prefills == len(w) - long


def test_no_room_options_wait_recompute_reject():
    """A decode instance too small for the received KV of several requests at once: ``wait`` serves
    everything later, ``recompute`` drops remote KV and prefills there, ``reject`` rejects."""
    w = workload(4, n=20, rate=200.0, prompt=(1500, 3000), out=(200, 400))
    small = [make_spec(cost=NO_FRONT_END), make_spec(cost=NO_FRONT_END, hbm_kv_blocks=260)]
    res, c = run_pd(w, ("prefill", "decode"), specs=small, on_no_room="wait")
    assert (res.records["status"] == "finished").all() and c.disagg.counters.waits_for_room > 0
    res, c = run_pd(w, ("prefill", "decode"), specs=small, on_no_room="recompute")
    assert (res.records["status"] == "finished").all() and c.disagg.counters.recomputed > 0
    res, c = run_pd(w, ("prefill", "decode"), specs=small, on_no_room="reject")
    rej = res.records[res.records["status"] == "rejected"]
    assert len(rej) == c.disagg.counters.rejected > 0
    assert set(rej["reject_reason"]) == {"decode_kv_no_room"}


def test_received_prefix_populates_decode_prefix_cache():
    """Two requests with the same 1,024-token prefix, one after the other, to one decode instance:
    the second's KV transfer skips the prefix the decode side cached from the first, unless
    decode_prefix_cache is off."""
    seg = 32
    h = tuple(range(32))
    w = Workload.from_requests([Request(0, 0.0, 1100, 4, prefix_hashes=h, hash_block_tokens=seg),
                                Request(1, 5.0, 1100, 4, prefix_hashes=h, hash_block_tokens=seg)])
    on, _ = run_pd(w, ("prefill", "decode"))
    off, _ = run_pd(w, ("prefill", "decode"), decode_prefix_cache=False)
    assert on.summary["disaggregation"]["decode_hit_tokens"] == 1024
    assert off.summary["disaggregation"]["decode_hit_tokens"] == 0
    assert on.summary["disaggregation"]["bytes_moved"] < off.summary["disaggregation"]["bytes_moved"]
    # the record's prefix hits are the prefill instance's (it cached the prefix from the first request)
    assert on.records["prefix_hit_tokens"].tolist() == [0, 1024]


def test_tp_ports_and_heterogeneous_roles():
    """A TP-2 prefill instance feeding a TP-2 decode instance moves KV over two ports (half the
    byte time); roles may use different GPUs."""
    w = Workload.from_requests([Request(0, 0.0, 2000, 2)])
    one, _ = run_pd(w, ("prefill", "decode"), specs=[make_spec(cost=NO_FRONT_END, tp=2),
                                                     make_spec(cost=NO_FRONT_END)])
    two, _ = run_pd(w, ("prefill", "decode"), specs=[make_spec(cost=NO_FRONT_END, tp=2),
                                                     make_spec(cost=NO_FRONT_END, tp=2)])
    t1 = one.summary["disaggregation"]["transfer_s"]["mean"]
    t2 = two.summary["disaggregation"]["transfer_s"]["mean"]
    lat = DISAGG_LINK_PRESETS["ib_ndr_400g"].latency_s
    assert t2 - lat == pytest.approx((t1 - lat) / 2, rel=1e-9)


def test_kv_aware_prefill_router_sees_prefill_instances_only():
    """The prefill router's table has the prefill instances' rows; a KV-aware router sends a
    repeated prefix to the prefill instance that cached it."""
    from kvsched.policies.routing import make_router

    seg = 32
    h = tuple(range(40))
    reqs = [Request(i, 2.0 * i, 1300, 2, prefix_hashes=h, hash_block_tokens=seg) for i in range(4)]
    res, c = run_pd(Workload.from_requests(reqs), ("prefill", "prefill", "decode"),
                    prefill_router=make_router("cache-affinity"))
    assert res.records["prefix_hit_tokens"].tolist() == [0, 1280, 1280, 1280]


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, field", [
    ({"roles": ("prefill", "decoder")}, "roles"),
    ({"roles": ("prefill",)}, "roles"),
    ({"roles": ()}, "roles"),
    ({"roles": ("decode",), "transfer": "pipelined"}, "transfer"),
    ({"roles": ("decode",), "on_no_room": "drop"}, "on_no_room"),
    ({"roles": ("decode",), "max_local_prefill_tokens": -1}, "max_local_prefill_tokens"),
    ({"roles": ("decode",), "max_local_prefill_tokens": True}, "max_local_prefill_tokens"),
    ({"roles": ("decode",), "link": "ib"}, "link"),
])
def test_bad_disagg_spec_is_a_one_line_error(kw, field):
    with pytest.raises(ConfigError) as e:
        DisaggSpec(**kw)
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("d, needle", [
    ({"prefill": {"count": 1}, "decode": {"count": 1}, "link": "infiniband"}, "infiniband"),
    ({"prefill": {"count": -1}, "decode": {"count": 1}}, "prefill.count"),
    ({"prefill": {"count": 1}, "decode": {"count": True}}, "decode.count"),
    ({"prefill": {"count": 2}}, "at least one decode or mixed"),
    ({"prefill": {"count": 1}, "decode": {"count": 1, "gpu": "H100-SXM"}}, "'gpu'"),
    ({"prefill": {"count": 1}, "decode": {"cnt": 1}}, "'cnt'"),
    ({"prefill": {"count": 1}, "decode": {"count": 1}, "links": "pcie5"}, "'links'"),
    ({"prefill": 2, "decode": {"count": 1}}, "prefill must be a mapping"),
    ({"decode": {"count": 1}, "transfer": "streamed"}, "transfer"),
    ("2P2D", "must be a mapping"),
    ({"prefill": {"count": 1}, "decode": {"count": 100_000}}, "decode.count=100000 must be an integer in [0, 9999]"),
    ({"mixed": {"count": 10 ** 400}}, "mixed.count="),
    ({"decode": {"count": 1, "instance": []}}, "decode.instance must be a mapping"),
    ({"decode": {"count": 1, "instance": 0}}, "decode.instance must be a mapping"),
    ({"decode": {"count": 1}, "prefill_router_params": []}, "prefill_router_params=[] must be a mapping"),
    ({"decode": {"count": 1}, "prefill_router_params": ""}, "prefill_router_params='' must be a mapping"),
])
def test_bad_cluster_section_is_a_one_line_error(d, needle):
    with pytest.raises(ConfigError) as e:
        cluster_layout_from_dict(d, "scenario x.yaml: cluster")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and len(msg) < 400


@pytest.mark.parametrize("label", ["2P2", "P2D", "2X2D", "2P2D2P", "4P", "", "2P 2D", "9" * 40 + "D", "10000D",
                                   "1P" + "9" * 5000 + "D"])
def test_bad_layout_label_is_a_one_line_error(label):
    with pytest.raises(ConfigError) as e:
        parse_layout_label(label)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_huge_role_counts_are_refused_in_labels_and_sections_alike():
    """A role count above MAX_ROLE_INSTANCES is refused naming the bound (a 100,000-instance cluster
    ran for a minute in 1.2 GB), in an xPyD label and a cluster: section; the bound itself is allowed."""
    from kvsched.envs.sim.disagg import MAX_ROLE_INSTANCES

    assert parse_layout_label(f"1P{MAX_ROLE_INSTANCES}D")["decode"] == MAX_ROLE_INSTANCES
    for bad in (lambda: parse_layout_label(f"1P{MAX_ROLE_INSTANCES + 1}D"),
                lambda: cluster_layout_from_dict({"decode": {"count": MAX_ROLE_INSTANCES + 1}})):
        with pytest.raises(ConfigError, match=rf"\[0, {MAX_ROLE_INSTANCES}\]"):
            bad()


def test_layout_labels():
    assert parse_layout_label("2P2D") == {"prefill": 2, "decode": 2, "mixed": 0}
    assert parse_layout_label("4m") == {"prefill": 0, "decode": 0, "mixed": 4}
    assert parse_layout_label("1P2D1M") == {"prefill": 1, "decode": 2, "mixed": 1}


def test_cluster_rejects_roles_of_the_wrong_length_and_stray_prefill_router():
    from kvsched.envs.sim.routing import RoundRobinPlacement

    spec = make_spec()
    with pytest.raises(ConfigError, match="3 roles for 2 instances"):
        Cluster([spec, spec], lambda: make_policy("fcfs"), disagg=DisaggSpec(("prefill", "decode", "decode")))
    with pytest.raises(ConfigError, match="prefill_router needs disagg"):
        Cluster([spec, spec], lambda: make_policy("fcfs"), prefill_router=RoundRobinPlacement())
    with pytest.raises(ConfigError, match="router_delay_s"):
        Cluster([spec, spec], lambda: make_policy("fcfs"), disagg=DisaggSpec(("prefill", "decode")),
                router_delay_s=0.5)
