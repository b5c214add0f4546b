"""The instance step loop (envs/sim/instance.py): a schedule worked out by hand, rejections at
arrival, the effective long-prefill threshold, the policy's token budget, and the guard against
an instance that cannot make progress."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import Instance, effective_long_prefill_threshold
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.recorder import Recorder
from kvsched.envs.sim.request import FINISHED, Request, Workload
from kvsched.envs.sim.specs import CostParams
from kvsched.policies.base import make_policy
from simkit import make_instance, make_spec, run, state


def test_hand_computed_three_request_schedule():
    """Budget 64 tokens, one partial prefill at a time; the schedule worked out by hand:

    step 1: A prefill 64 of 100 (partial)                         -> budget used
    step 2: A prefill 36 (done: A token 1), B prefill 20 (done: B token 1),
            C prefill 8 of 10 (partial; A and B finish their prefill so the slot is free)
    step 3: A decode, B decode (B token 2: finished), C prefill 2 (C token 1: finished)
    step 4: A decode (A token 3: finished)
    """
    # engine schedule only: no API front-end delays (they would stagger the three arrivals)
    no_front_end = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)
    spec = make_spec(max_num_batched_tokens=64, enable_prefix_caching=False, cost=no_front_end)
    reqs = [Request(0, 0.0, 100, 3), Request(1, 0.0, 20, 2), Request(2, 0.0, 10, 1)]
    res = run(Workload.from_requests(reqs), spec)
    cm = CostModel(spec)

    def t(n, attn, kv):
        return float(cm.step_time_s(float(n), float(attn), float(kv)))

    t1 = t(64, 64 * 32, 64)
    t2 = t(36 + 20 + 8, 36 * (64 + 18) + 20 * 10 + 8 * 4, (64 + 36) + 20 + 8)
    t3 = t(1 + 1 + 2, 100 + 20 + 2 * (8 + 1), 100 + 20 + 10)
    t4 = t(1, 101, 101)
    e1 = 0.0 + t1
    e2 = e1 + t2
    e3 = e2 + t3
    e4 = e3 + t4
    r = res.records.set_index("request_id")
    assert r.loc[0, "first_token_s"] == e2 and r.loc[0, "finish_s"] == e4
    assert r.loc[1, "first_token_s"] == e2 and r.loc[1, "finish_s"] == e3
    assert r.loc[2, "first_token_s"] == e3 and r.loc[2, "finish_s"] == e3
    assert r.loc[0, "max_itl_s"] == max(t3, t4)
    assert list(r["generated_tokens"]) == [3, 2, 1]
    assert res.stats["steps"] == 4


def test_request_that_can_never_fit_is_rejected_and_counted():
    spec = make_spec(hbm_kv_blocks=64)  # 1024 tokens of KV
    reqs = [Request(0, 0.0, 2000, 10), Request(1, 0.1, 100, 10)]
    res = run(Workload.from_requests(reqs), spec)
    r = res.records.set_index("request_id")
    assert r.loc[0, "status"] == "rejected" and r.loc[0, "reject_reason"] == "exceeds_max_model_len"
    assert r.loc[1, "status"] == "finished"
    assert res.summary["classes"]["all"]["counts"]["rejected"] == 1


def test_chunked_prefill_off_serves_a_prompt_above_the_long_prefill_threshold():
    """enable_chunked_prefill=False together with long_prefill_token_threshold > 0.

    Defect (envs/sim/instance.py, ``_admit``): the threshold caps ``n`` below the prompt, so
    ``leaves_partial`` is true, and with chunked prefill off the request is skipped forever.
    The instance raises ``RuntimeError: instance 0 cannot make progress`` (a bare RuntimeError,
    so the CLI prints a traceback) on a valid spec and a one-request workload.

    Expected: either the spec combination is refused up front with a ConfigError naming the
    fields, or the request is served (vLLM caps by the threshold, then only skips a prompt
    that exceeds the token budget) and finishes with all its tokens.
    """
    try:
        spec = make_spec(enable_chunked_prefill=False, max_num_batched_tokens=None,
                         long_prefill_token_threshold=128)
    except ConfigError as e:
        assert "long_prefill_token_threshold" in str(e) or "chunked" in str(e)
        return
    w = Workload.from_requests([Request(0, 0.0, 500, 5)])
    res = run(w, spec)
    r = res.records.iloc[0]
    assert r.status == "finished" and r.generated_tokens == 5


def test_effective_long_prefill_threshold_follows_vllm():
    assert effective_long_prefill_threshold(make_spec(long_prefill_token_threshold=300)) == 300
    assert effective_long_prefill_threshold(make_spec()) == 0  # no partial-prefill limit: no cap
    assert effective_long_prefill_threshold(make_spec(max_num_partial_prefills=1)) == 0  # vLLM: only > 1
    two = make_spec(max_num_partial_prefills=2, max_model_len=10_000)
    assert effective_long_prefill_threshold(two) == 400  # 4 % of max_model_len
    off = make_spec(enable_chunked_prefill=False, max_num_batched_tokens=None, long_prefill_token_threshold=300)
    assert effective_long_prefill_threshold(off) == 0  # a prompt runs whole


def test_the_policys_token_budget_must_be_usable():
    spec = make_spec()
    small = make_policy("fcfs")
    small.token_budget = lambda default: 0
    with pytest.raises(ConfigError, match="gave token_budget=0"):
        Instance(spec, small, Recorder(MetricsConfig()))
    whole = make_policy("fcfs")
    whole.chunked_prefill = False  # runs prompts whole: the budget must cover the model length
    with pytest.raises(ConfigError, match="must cover max_model_len"):
        Instance(spec, whole, Recorder(MetricsConfig()))
    half = make_policy("fcfs")
    half.token_budget = lambda default: default // 2
    assert Instance(spec, half, Recorder(MetricsConfig())).budget == 256


def test_an_instance_with_work_and_nothing_runnable_raises_instead_of_stalling():
    inst = make_instance(make_spec(hbm_kv_blocks=8))
    inst.waiting.append(state(0, 1000))  # more than HBM holds (add_request would reject it)
    with pytest.raises(RuntimeError, match="instance 0 cannot make progress at t=0.5"):
        inst.schedule(0.5)
    assert make_instance(make_spec()).schedule(0.0) is None  # nothing to do: idle, no error


def test_a_step_emits_tokens_at_its_end_and_finishes_and_records_requests():
    inst = make_instance(make_spec(cost=CostParams()))
    finished_feedback = []
    inst.policy.on_request_finished = lambda *a: finished_feedback.append(a)
    a, b = state(0, 30, output=1), state(1, 20, output=3)
    assert inst.add_request(a, 0.0) and inst.add_request(b, 0.0)
    end = inst.schedule(0.0)
    assert end == pytest.approx(CostModel(inst.spec).step_time_s(50.0, 30 * 31 / 2 + 20 * 21 / 2, 50.0))
    inst.complete_step(end)
    assert a.status == FINISHED and a.first_token_s == a.finish_s == end and a not in inst.running
    assert b.generated == 1 and b.first_token_s == end and inst.steps == 1
    assert inst.kv.hbm.used_blocks == b.hbm_blocks == 2  # a's KV released
    assert inst.recorder.records_frame()["request_id"].tolist() == [0]
    assert finished_feedback == [(end, 0.0, end, 30, 1)]
