"""The batch of one step (envs/sim/step_plan.py): chunking rules (long-prefill threshold, the
per-prefill share with several partial prefills, no limit (None) limiting nothing and a limit of
one, the policy's chunk limit, the budget), partial-prefill limits, the batch totals, the
all-decodes fast path, and admission while requests are swapped out."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as hst

from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.request import RUNNING, SWAPPED, WAITING, Request, Workload
from kvsched.envs.sim.step_plan import StepBuild
from simkit import BLOCK_BYTES, build_workload, make_instance, make_spec, place_running, request_lists, run, state



def composed(inst, now=0.0):
    """Compose one step of ``inst`` (as ``Instance.schedule`` does, without timing it)."""
    step = StepBuild(inst.budget)
    step.prefill_slot = inst.composer.prefill_slot_budget(now)
    inst.composer.compose(step, now)
    return step


def planned(step):
    return [(st.rid, n) for st, n in step.plan]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=request_lists,
       hbm_blocks=hst.integers(110, 400),
       budget=hst.sampled_from([8, 64, 2048]),
       mode=hst.sampled_from(["recompute", "swap"]),
       max_seqs=hst.sampled_from([2, 64]),
       policy=hst.sampled_from(["fcfs", "sarathi"]))
# found by CI: a decode the running loop planned finishes at the end of a step that admits a
# prompt; the fold went through that finish only for the decode fast path's members
@example(rows=[(4.5, 1, 2, 0), (4.09375, 1, 59, 0)], hbm_blocks=110, budget=8, mode="recompute", max_seqs=2,
         policy="fcfs")
def test_decode_fast_path_equals_request_by_request_loop(rows, hbm_blocks, budget, mode, max_seqs, policy):
    """StepComposer.schedule_decodes (all running requests decode: one batched KV allocation) gives
    the same records, summary and occupancy as the request-by-request running loop, including
    when KV runs out (it then declines and the loop preempts), with prefix caching, and in the
    stall-free (Sarathi-Serve) composer."""
    from kvsched.envs.sim.step_plan import StepComposer as Instance

    w = build_workload(rows)
    spec = make_spec(hbm_kv_blocks=hbm_blocks, max_num_batched_tokens=budget,
                     dram_kv_bytes=60 * BLOCK_BYTES if mode == "swap" else 0,
                     preemption_mode=mode, max_num_seqs=max_seqs)
    fast = run(w, spec, check=True, policy=policy)
    calls = {"n": 0}
    orig = Instance.schedule_decodes

    def counting(self, *a):
        calls["n"] += 1
        return orig(self, *a)

    try:
        Instance.schedule_decodes = counting
        run(w, spec, fast_forward=False, check=False, policy=policy)  # every decode step planned
        Instance.schedule_decodes = lambda self, *a: False  # always the loop
        slow = run(w, spec, check=True, policy=policy)
    finally:
        Instance.schedule_decodes = orig
    if any(o >= 2 and p + o <= hbm_blocks * 16 for _, p, o, _ in rows):  # something decodes
        assert calls["n"] > 0
    pd.testing.assert_frame_equal(fast.records, slow.records, check_exact=True)
    assert summary_to_json(fast.summary) == summary_to_json(slow.summary)
    pd.testing.assert_frame_equal(fast.occupancy, slow.occupancy, check_exact=True)
    assert fast.stats == slow.stats


def test_every_prefill_chunk_gets_a_token_with_a_tiny_budget_and_several_partial_prefills():
    """Regression: budget 1 token split among partial prefills gave 0-token chunks and a step
    of zero length, forever. Each prefill must get at least one token."""
    spec = make_spec(max_num_batched_tokens=1, max_num_partial_prefills=4, max_long_partial_prefills=4)
    reqs = [Request(i, 0.0, 20, 2) for i in range(3)]
    res = run(Workload.from_requests(reqs), spec)
    assert (res.records.status == "finished").all()
    assert res.stats["steps"] >= 3 * 20


def test_long_partial_prefills_are_limited_by_vllms_default_threshold():
    """max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=0.

    The InstanceSpec docstring (and REFERENCE §4.1) say vLLM sets the threshold to 4 % of
    max_model_len when max_num_partial_prefills > 1 and it is 0, "left to the scheduler".
    Defect (envs/sim/instance.py ``schedule``/``_admit`` use the raw 0): no prefill is ever
    "long", so max_long_partial_prefills has no effect and two 5,000-token prompts are both
    prefilled in the first two steps with 8,192-token chunks.

    Expected: with max_model_len=10,000 the effective threshold is 400 tokens; each prompt
    needs ceil(5000 / 400) = 13 chunks and only one long prefill may be partial at a time,
    so the two prefills run one after the other. The second may start in the step where the
    first finishes (a prefill that completes in a step is not left partial; see
    kvsched.envs.sim.instance), hence at least 13 + 13 - 1 = 25 steps (8,192-token chunks
    would take 2).
    """
    spec = make_spec(max_model_len=10_000, max_num_batched_tokens=8192, max_num_partial_prefills=2,
                     max_long_partial_prefills=1, long_prefill_token_threshold=0,
                     enable_prefix_caching=False)
    w = Workload.from_requests([Request(0, 0.0, 5000, 1), Request(1, 0.0, 5000, 1)])
    res = run(w, spec)
    assert (res.records.status == "finished").all()
    assert res.stats["steps"] >= 2 * math.ceil(5000 / 400) - 1


def test_chunk_is_capped_by_threshold_slot_policy_limit_and_budget():
    inst = make_instance(make_spec(long_prefill_token_threshold=300))
    comp = inst.composer
    st = state(0, 1000)
    step = StepBuild(512)
    assert comp.chunk(st, 1000, step) == 300  # the long-prefill threshold
    step.prefill_slot = 200
    assert comp.chunk(st, 1000, step) == 200  # the per-prefill share
    inst.policy.chunk_limit = lambda *a: 150
    assert comp.chunk(st, 1000, step) == 150  # the policy's limit
    inst.policy.chunk_limit = lambda *a: 0.4
    assert comp.chunk(st, 1000, step) == 1  # never below one token
    inst.policy.chunk_limit = lambda *a: None
    step.budget = 7
    assert comp.chunk(st, 1000, step) == 7  # the budget left
    step.budget, step.prefill_slot = 512, 1
    inst.policy.chunk_limit = lambda *a: 0
    assert comp.chunk(st, 1, step) == 1  # a decode takes its token whatever the prefill limits


def test_policy_chunk_limit_sees_the_tokens_already_cached_and_the_batch_so_far():
    inst = make_instance(make_spec())
    seen = []
    inst.policy.chunk_limit = lambda *a: seen.append(a)
    st = state(0, 1000)
    st.computed = 96
    step = StepBuild(512)
    step.n_tokens, step.attn2, step.kv_tokens = 3, 10, 40
    inst.composer.chunk(st, 904, step)
    assert seen == [(1000, 96, 3, 5.0, 40)]


def test_prefill_slot_is_the_budget_split_over_up_to_k_prefills():
    spec = make_spec(max_num_batched_tokens=600, max_num_partial_prefills=4, max_long_partial_prefills=4)
    inst = make_instance(spec)
    comp = inst.composer
    assert comp.prefill_slot_budget(0.0) == 600  # nothing could run
    inst.waiting.extend(state(i, 100) for i in range(2))
    assert comp.prefill_slot_budget(0.0) == 300  # two prefills: half each
    inst.waiting.extend(state(10 + i, 100) for i in range(5))
    assert comp.prefill_slot_budget(0.0) == 150  # seven could run: k = 4 shares
    for k in (None, 1):  # no limit, or V0's default of one (lookup[1] = the whole budget): no share
        one = make_instance(make_spec(max_num_batched_tokens=600, max_num_partial_prefills=k))
        one.waiting.extend(state(i, 100) for i in range(7))
        assert one.composer.prefill_slot_budget(0.0) == 600


def _partial_case(k, max_long):
    """Three 1,000-token prompts (threshold 600: each leaves its prefill partial) and a 100-token
    one, a 2,048-token budget."""
    spec = make_spec(max_num_batched_tokens=2048, long_prefill_token_threshold=600,
                     max_num_partial_prefills=k, max_long_partial_prefills=max_long)
    inst = make_instance(spec)
    inst.waiting.extend([state(0, 1000), state(1, 1000), state(2, 1000), state(3, 100)])
    return inst


def test_with_k_partial_prefills_a_third_partial_is_skipped_and_a_short_prompt_goes():
    step = composed(_partial_case(k=2, max_long=2))
    assert planned(step) == [(0, 600), (1, 600), (3, 100)]
    assert step.partial == 2 and step.long_partial == 2


def test_no_partial_prefill_limit_limits_nothing():
    step = composed(_partial_case(k=None, max_long=1))
    assert planned(step) == [(0, 600), (1, 600), (2, 600), (3, 100)]


def test_a_limit_of_one_leaves_one_prefill_unfinished_and_lets_a_short_prompt_finish():
    """vLLM V0's default (``--max-num-partial-prefills 1``): one prefill left unfinished; a prompt
    that completes in the step still goes. (Before None existed, 1 meant no limit.)"""
    step = composed(_partial_case(k=1, max_long=1))
    assert planned(step) == [(0, 600), (3, 100)] and step.partial == 1


def test_long_partial_prefills_have_their_own_limit():
    step = composed(_partial_case(k=2, max_long=1))
    assert planned(step) == [(0, 600), (3, 100)] and step.long_partial == 1


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    spec = make_spec(enable_chunked_prefill=False, max_num_batched_tokens=None, hbm_kv_blocks=256)
    inst = make_instance(spec)
    inst.waiting.extend([state(0, 3000), state(1, 2000)])  # budget = model length 4,096
    step = composed(inst)
    assert planned(step) == [(0, 3000)]  # the second would be partial: refused
    assert inst.composer.partial_blocked(state(2, 10), True, step)
    assert not inst.composer.partial_blocked(state(2, 10), False, step)


def test_batch_totals_count_decodes_and_prefill_chunks():
    inst = make_instance(make_spec())
    step = StepBuild(512)
    dec = state(0, 100)
    dec.computed, dec.generated = 104, 5  # a decode reads its 104 KV tokens
    inst.composer.count(dec, 1, False, step)
    pre = state(1, 300)
    pre.computed = 64  # a 100-token chunk after 64 computed tokens
    inst.composer.count(pre, 100, True, step)
    assert step.n_tokens == 101 and step.budget == 411
    assert step.attn2 == 2 * 104 + 100 * (2 * 64 + 100)  # twice the attention pairs
    assert step.kv_tokens == 104 + 164 and step.partial == 1 and step.planned == {0, 1}
    assert step.drop(dec) and not step.drop(dec)  # planned once: dropped once
    assert planned(step) == [(1, 100)]
    inst.composer.recount(step)
    assert step.n_tokens == 100 and step.budget == 412 and step.attn2 == 100 * (2 * 64 + 100)


def test_decode_fast_path_allocates_one_block_at_each_block_boundary():
    inst = make_instance(make_spec(hbm_kv_blocks=64))
    a = place_running(inst, state(0, 31), 32, generated=2)  # at a block boundary: needs a third block
    b = place_running(inst, state(1, 20), 21, generated=2)
    step = StepBuild(inst.budget)
    assert inst.composer.schedule_decodes(inst.running, step, 0.0)
    assert (a.private_blocks, b.private_blocks) == (3, 2) and inst.kv.hbm.used_blocks == 5
    assert planned(step) == [(0, 1), (1, 1)] and step.attn2 == 2 * (32 + 21)
    c = place_running(inst, state(2, 50), 20)  # a prefill among them: the fast path declines
    assert not inst.composer.schedule_decodes(inst.running, StepBuild(inst.budget), 0.0)
    assert c.private_blocks == 2


# ------------------------------------------------------------- admission while swapped out
def _swap_pressure(flag, dram_blocks=20, swapped_first=False):
    """A 9-block HBM, full: an old decode at a block boundary (4 blocks, needs a 5th) and a newer
    one (5 blocks); a 30-token prompt waits. ``swapped_first``: a fifth request (5 blocks) was
    swapped out earlier and cannot come back this step."""
    inst = make_instance(make_spec(hbm_kv_blocks=9, dram_kv_bytes=dram_blocks * BLOCK_BYTES,
                                   preemption_mode="swap", enable_prefix_caching=False),
                         params={"admit_while_swapped": flag, "admit_in_preemption_step": flag})
    earlier = None
    if swapped_first:
        earlier = place_running(inst, state(5, 80), 80, generated=1)
        inst.preemptor.preempt(earlier, 0.0)
    old = place_running(inst, state(0, 64), 64, generated=1)
    new = place_running(inst, state(1, 70), 70, generated=1)
    waiting = state(2, 30)
    inst.waiting.append(waiting)
    return inst, old, new, waiting, earlier


def test_admit_while_swapped_admits_into_the_hbm_a_swap_out_just_freed_as_vllm_v0_chunked():
    """vLLM V0 ``_schedule_chunked_prefill``: after a running pass that swapped a request out,
    ``_schedule_swapped`` is skipped but ``_schedule_prefills`` runs, so a new prompt takes the
    freed HBM (admit_while_swapped with admit_in_preemption_step). The flag alone waits for a
    step without preemption (where the swapped request, resumed first, took its blocks back):
    new prompts never beat it back."""
    inst, old, new, waiting, _ = _swap_pressure(True)
    step = composed(inst)
    assert list(inst.swapped) == [new] and new.status == SWAPPED  # the newest went to DRAM
    assert planned(step) == [(0, 1), (2, 30)] and waiting.status == RUNNING
    assert not inst.waiting
    inst, old, new, waiting, _ = _swap_pressure(False)  # default: no admission after a preemption
    step = composed(inst)
    assert list(inst.swapped) == [new] and planned(step) == [(0, 1)] and list(inst.waiting) == [waiting]


def test_admit_while_swapped_does_not_readmit_a_request_recomputed_in_the_same_step():
    """DRAM full (an earlier request holds 5 of its 6 blocks): this step's victim falls back to
    recompute. vLLM V0 puts such victims back in ``waiting`` after ``_schedule_prefills``: the
    new prompt is admitted, the victim waits at the queue head for the next step."""
    inst, old, new, waiting, earlier = _swap_pressure(True, dram_blocks=6, swapped_first=True)
    step = composed(inst)
    assert new.status == WAITING and new.lost_tokens == 70 and list(inst.swapped) == [earlier]
    assert planned(step) == [(0, 1), (2, 30)] and step.displaced == [new] and not inst.waiting
    inst, old, new, waiting, earlier = _swap_pressure(False, dram_blocks=6, swapped_first=True)
    step = composed(inst)
    assert planned(step) == [(0, 1)] and list(inst.waiting) == [new, waiting] and not step.displaced


def test_admit_while_swapped_changes_nothing_without_requests_swapped_out():
    """Recompute-only preemption (no lower tier, nobody swapped): no admission after a
    preemption, with the flag as without (vLLM V1's rule)."""
    for flag in (False, True):
        inst = make_instance(make_spec(hbm_kv_blocks=9, enable_prefix_caching=False),
                             params={"admit_while_swapped": flag})
        place_running(inst, state(0, 64), 64, generated=1)
        new = place_running(inst, state(1, 70), 70, generated=1)
        waiting = state(2, 30)
        inst.waiting.append(waiting)
        step = composed(inst)
        assert planned(step) == [(0, 1)] and list(inst.waiting) == [new, waiting]


# ------------------------------------------------------------------ partial-prefill limit
def _unfinished_prefills_at_step_ends(spec, policy, rows):
    """The most requests left with an unfinished prefill at any step end of a run (stepping
    one by one), and the run."""
    from kvsched.envs.sim.instance import Instance
    from kvsched.envs.sim.step_plan import is_unfinished_prefill

    most = [0]
    orig = Instance.complete_step

    def complete_step(self, now):
        orig(self, now)
        most[0] = max(most[0], sum(1 for st in self.running if is_unfinished_prefill(st)))

    Instance.complete_step = complete_step
    try:
        res = run(build_workload(rows), spec, fast_forward=False, policy=policy)
    finally:
        Instance.complete_step = orig
    return most[0], res


@pytest.mark.parametrize("policy", ["fcfs", "sarathi", "lars"])
def test_with_a_limit_of_one_two_long_prompts_arriving_together_are_never_both_partial(policy):
    """Two 6,000-token prompts at once, chunks capped at 200 tokens (long_prefill_token_threshold)
    under a 2,048-token budget (Sarathi's own: 512), plus short ones behind them: with no limit both are left
    partial by the same step; with a limit of one never (the second starts when the first
    completes), in vLLM's order and in the stall-free order alike."""
    rows = [(0.0, 6000, 4, 0), (0.0, 6000, 4, 0), (0.0, 300, 4, 0), (0.05, 2000, 4, 0), (0.1, 100, 4, 0)]
    most = {}
    for limit in (None, 1):
        spec = make_spec(max_num_batched_tokens=2048, long_prefill_token_threshold=200, max_model_len=8192,
                         max_num_partial_prefills=limit)
        most[limit], res = _unfinished_prefills_at_step_ends(spec, policy, rows)
        assert (res.records.status == "finished").all()
    assert most[None] >= 2 and most[1] == 1, most


def test_admit_while_swapped_alone_waits_for_a_step_without_preemption():
    """kvsched 0.1's flag (which bench v1's tuned heuristics used), kept as the default of
    ``admit_in_preemption_step``: in the step of the swap-out nothing is admitted."""
    inst = make_instance(make_spec(hbm_kv_blocks=9, dram_kv_bytes=20 * BLOCK_BYTES, preemption_mode="swap",
                                   enable_prefix_caching=False), params={"admit_while_swapped": True})
    place_running(inst, state(0, 64), 64, generated=1)
    new = place_running(inst, state(1, 70), 70, generated=1)
    waiting = state(2, 30)
    inst.waiting.append(waiting)
    step = composed(inst)
    assert list(inst.swapped) == [new] and planned(step) == [(0, 1)] and list(inst.waiting) == [waiting]
