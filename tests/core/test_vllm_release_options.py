"""The scheduling options of later vLLM releases (InstanceSpec.unchunked_overflow,
InstanceSpec.long_prefill_threshold_alone): vLLM <= 0.11's rules by default, vLLM 0.32's on
request, both step by step and fast-forwarded; validated; left out of scenario hashes at their
defaults. (Against vLLM itself: the parity cases budget-unchunked, long-alone-threshold and their
-v0.11 copies, tests/deploy/test_vllm_engine.py.)"""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.spec_io import instance_spec_from_dict
from kvsched.runner.scenario import Scenario
from simkit import assert_identical, build_workload, make_instance, make_spec, run, state


def first_step(spec, prompts):
    """The plan ``[(request id, tokens)]`` of the first step of ``spec`` with ``prompts`` queued."""
    inst = make_instance(spec)
    for rid, p in enumerate(prompts):
        assert inst.add_request(state(rid, p), 0.0)
    assert inst.schedule(0.0) is not None
    return [(st.rid, n) for st, n in inst._plan]


def unchunked(**kw):
    return make_spec(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=1024, **kw)


# ------------------------------------------------------------------ unchunked_overflow
def test_unchunked_skip_admits_a_later_shorter_prompt_by_default():
    """vLLM <= 0.11: 600 tokens admitted, 700 > 424 left is skipped, 100 still fits."""
    assert first_step(unchunked(), [600, 700, 100]) == [(0, 600), (2, 100)]
    assert first_step(unchunked(unchunked_overflow="skip"), [600, 700, 100]) == [(0, 600), (2, 100)]


def test_unchunked_stop_admits_nobody_after_a_prompt_over_the_budget_left():
    """vLLM 0.32 (``break``): after 600 tokens, 700 > 424 left ends admission; 100 waits."""
    assert first_step(unchunked(unchunked_overflow="stop"), [600, 700, 100]) == [(0, 600)]


def test_unchunked_overflow_changes_nothing_with_chunked_prefill():
    spec = dict(max_num_batched_tokens=1024, max_model_len=1024)
    want = [(0, 600), (1, 424)]
    assert first_step(make_spec(**spec), [600, 700, 100]) == want
    assert first_step(make_spec(unchunked_overflow="stop", **spec), [600, 700, 100]) == want


# -------------------------------------------------------- long_prefill_threshold_alone
def threshold(**kw):
    return make_spec(max_num_batched_tokens=1024, max_model_len=4096, long_prefill_token_threshold=256, **kw)


def test_threshold_caps_a_request_alone_by_default():
    """vLLM <= 0.11: every chunk capped at 256 tokens."""
    assert first_step(threshold(), [2000]) == [(0, 256)]
    assert first_step(threshold(long_prefill_threshold_alone="cap"), [2000]) == [(0, 256)]


def test_threshold_lifted_for_a_request_alone_but_not_for_two():
    """vLLM 0.32 (``num_eligible_reqs > 1``): alone it takes the whole budget; with a second
    request waiting both are capped again."""
    assert first_step(threshold(long_prefill_threshold_alone="lift"), [2000]) == [(0, 1024)]
    assert first_step(threshold(long_prefill_threshold_alone="lift"), [2000, 2000]) == [(0, 256), (1, 256)]


def test_lifted_threshold_returns_when_a_second_request_arrives():
    """Alone for one step (1024 tokens), then a second request waits: both capped at 256."""
    inst = make_instance(threshold(long_prefill_threshold_alone="lift"))
    assert inst.add_request(state(0, 2000), 0.0)
    end = inst.schedule(0.0)
    assert [(st.rid, n) for st, n in inst._plan] == [(0, 1024)]
    inst.complete_step(end)
    assert inst.add_request(state(1, 2000, arrival=end), end)
    assert inst.schedule(end) is not None
    assert [(st.rid, n) for st, n in inst._plan] == [(0, 256), (1, 256)]


# ------------------------------------------------------------------ fast-forward == step by step
def _mixed_rows(n, long_every, seed=3):
    """``n`` requests 2 ms apart (a burst), every ``long_every``-th a long prompt, others short."""
    x = seed
    rows = []
    for i in range(n):
        x = (1103515245 * x + 12345) % 2**31
        p = 700 + x % 300 if i % long_every == 0 else 40 + x % 200
        rows.append((0.002 * i, p, 8 + x % 40, 0))
    return build_workload(rows)


@pytest.mark.parametrize("option, spec", [
    ("unchunked_overflow", lambda v: unchunked(unchunked_overflow=v, max_num_seqs=8)),
    ("long_prefill_threshold_alone", lambda v: threshold(long_prefill_threshold_alone=v)),
])
def test_fast_forward_equals_step_by_step_under_each_release_option(option, spec):
    w = _mixed_rows(40, 3) if option == "unchunked_overflow" else build_workload(
        [(0.4 * i, 1500 + 100 * (i % 3), 6 + i % 5, 0) for i in range(12)])
    later = {"unchunked_overflow": "stop", "long_prefill_threshold_alone": "lift"}[option]
    ff = run(w, spec(later), fast_forward=True)
    assert_identical(ff, run(w, spec(later), fast_forward=False, check=False))
    # the option matters on this workload (else the equivalence above proves nothing about it)
    assert not ff.records.equals(run(w, spec({"unchunked_overflow": "skip",
                                              "long_prefill_threshold_alone": "cap"}[option])).records)


# ------------------------------------------------------------------ validation and files
@pytest.mark.parametrize("field, bad, allowed", [
    ("unchunked_overflow", "break", "one of skip, stop"),
    ("unchunked_overflow", None, "one of skip, stop"),
    ("long_prefill_threshold_alone", "off", "one of cap, lift"),
    ("long_prefill_threshold_alone", 1, "one of cap, lift"),
])
def test_bad_option_values_are_refused_in_one_line_naming_the_field(field, bad, allowed):
    with pytest.raises(ConfigError) as e:
        make_spec(**{field: bad})
    msg = str(e.value)
    assert "\n" not in msg and f"InstanceSpec.{field}" in msg and allowed in msg


def test_options_are_read_from_a_spec_mapping_and_refuse_non_strings():
    d = {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 4096,
         "unchunked_overflow": "stop", "long_prefill_threshold_alone": "lift"}
    spec = instance_spec_from_dict(d)
    assert (spec.unchunked_overflow, spec.long_prefill_threshold_alone) == ("stop", "lift")
    with pytest.raises(ConfigError, match="unchunked_overflow"):
        instance_spec_from_dict({**d, "unchunked_overflow": ["stop"]})


def test_scenario_hash_leaves_the_options_out_at_their_defaults_only():
    """Scenarios written before the options existed keep their hash; a 0.32 option changes it."""
    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 4096}
    synthetic = {"rate_per_s": 1.0, "duration_s": 5}

    def sha(**inst):
        return Scenario(name="s", trace=None, synthetic=synthetic, seed=0, instance={**base, **inst}).sha256()

    assert sha() == sha(unchunked_overflow="skip", long_prefill_threshold_alone="cap")
    assert len({sha(), sha(unchunked_overflow="stop"), sha(long_prefill_threshold_alone="lift")}) == 3


# ------------------------------------------------------------------ the parity harness's choice
def test_parity_runs_kvsched_with_the_options_of_the_vllm_release_compared_with():
    """Up to 0.11 kvsched's defaults, after it vLLM 0.32's options; a -v0.11 case pins the
    defaults whatever the release (no vLLM needed: the spec only)."""
    from kvsched.deploy import parity

    assert parity.kvsched_options_for("0.11.2") == {} == parity.kvsched_options_for("0.8.5.post1")
    later = {"unchunked_overflow": "stop", "long_prefill_threshold_alone": "lift"}
    assert parity.kvsched_options_for("0.32.0+cpu") == later == parity.kvsched_options_for("0.12.0")
    cases = {c.name: c for c in parity.cases()}
    spec = cases["budget-unchunked"].instance_spec("0.32.0")
    assert (spec.unchunked_overflow, spec.long_prefill_threshold_alone) == ("stop", "lift")
    assert cases["budget-unchunked-v0.11"].instance_spec("0.32.0").unchunked_overflow == "skip"
    assert cases["long-alone-threshold-v0.11"].instance_spec("0.32.0").long_prefill_threshold_alone == "cap"
    with pytest.raises(ConfigError, match="vLLM version 'dev' is not allowed"):
        parity.kvsched_options_for("dev")
