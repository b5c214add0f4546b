"""Swap-based preemption keeps every tier's blocks conserved, for every policy.

Regression tests for two holes found by driving the environments with `preemption_mode: swap`:
the stall-free composer (Sarathi, LARS) re-admitted a request that an earlier candidate of the
same step had just swapped out, so the request held DRAM blocks twice and the run stalled with
requests unserved; and a request preempted while its swap-in copy was still in flight must go
back to swapped on its intact lower-tier copy, with the copy's landing event ignored."""

from __future__ import annotations

import itertools

import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import SWAPPED
from kvsched.runner.scenario import Scenario
from kvsched.policies.base import make_policy

POLICIES = ("fcfs", "priority", "sarathi", "lars", "ewsjf", "nonpreemptive")


def _scenario(mode: str) -> Scenario:
    inst = {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 160, "dram_kv_bytes": 2.0e8,
            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "preemption_mode": mode}
    if mode == "offload":
        inst["nvme_kv_bytes"] = 1e9
    return Scenario(name="tiny-hbm", trace=None, instance=inst, seed=3,
                    synthetic={"rate_per_s": 10.0, "duration_s": 8, "prompt_median_tokens": 400,
                               "output_median_tokens": 120, "output_max_tokens": 300})


def _run(sc: Scenario, policy: str, prefetch: bool, fast_forward: bool = True):
    c = Cluster([sc.instance_spec()], lambda: make_policy(policy, {"prefetch": prefetch}),
                metrics=sc.metrics_config(), options=InstanceOptions(check_invariants=True,
                                                                     fast_forward=fast_forward))
    return c.run(sc.workload())


@pytest.mark.parametrize("policy,mode,prefetch",
                         list(itertools.product(POLICIES, ("swap", "offload"), (False, True))))
def test_every_request_is_served_with_blocks_conserved(policy, mode, prefetch):
    sc = _scenario(mode)
    res = _run(sc, policy, prefetch)  # check_invariants: conservation after every step
    rec = res.records
    served = rec["status"] == "finished"
    # the only requests not served are those that can never fit (prompt + output > max_model_len)
    assert (served | (rec["reject_reason"] == "exceeds_max_model_len")).all() and served.sum() >= 70
    assert res.stats["preemptions"] > 0  # the case under test happened
    if policy in ("sarathi", "lars"):
        slow = _run(sc, policy, prefetch, fast_forward=False)
        assert res.summary == slow.summary


def test_preempted_while_loading_goes_back_on_its_lower_copy():
    sc = _scenario("swap")
    c = Cluster([sc.instance_spec()], lambda: make_policy("fcfs", {"prefetch": True}), metrics=sc.metrics_config(),
                options=InstanceOptions(check_invariants=True))
    inst = c.instances[0]
    # serve until some request is being swapped back in (running, lower-tier blocks still held)
    c.start(sc.workload())
    t, loading = 0.0, None
    while loading is None and t < 60.0:
        t += 0.01
        c.run_until_decision(until_s=t)
        loading = next((s for s in inst.running if s.lower_blocks), None)
    assert loading is not None, "no swap-in in flight: the workload no longer exercises the case"
    dram_before = inst.kv.by_name["dram"].pool.used_blocks
    landing = loading.swap_in_end_s
    assert landing >= t
    inst.preemptor.preempt(loading, t)
    assert loading.status == SWAPPED and loading in inst.swapped
    assert inst.kv.by_name["dram"].pool.used_blocks == dram_before  # no second copy out: its DRAM copy is reused
    assert loading.hbm_blocks == 0
    inst.complete_transfer(loading, landing)  # the cancelled copy lands: ignored
    assert loading.lower_blocks > 0 and inst.kv.by_name["dram"].pool.used_blocks == dram_before
    inst.check()


@pytest.mark.parametrize("policy,admission,mode",
                         list(itertools.product(POLICIES, ("always", "cost-gated"), ("swap", "recompute"))))
def test_admission_preemption_conserves_blocks_and_serves_everyone(policy, admission, mode):
    """A blocked waiting request preempting a running one (any policy, swap or recompute): blocks
    stay conserved after every step, every request is served, and fast-forward changes nothing.
    The victim floor is lowered so the tiny HBM sees many such preemptions."""
    sc = _scenario("swap" if mode == "swap" else "recompute")
    params = {"admission_preemption": admission, "admission_victim_min_tokens": 200}

    def run(ff: bool):
        c = Cluster([sc.instance_spec()], lambda: make_policy(policy, params), metrics=sc.metrics_config(),
                    options=InstanceOptions(check_invariants=True, fast_forward=ff))
        return c.run(sc.workload())

    res = run(True)
    rec = res.records
    served = rec["status"] == "finished"
    assert (served | (rec["reject_reason"] == "exceeds_max_model_len")).all() and served.sum() >= 70
    assert res.stats["admission_preemptions"] > 0  # the case under test happened (every policy and mode)
    assert res.summary == run(False).summary
