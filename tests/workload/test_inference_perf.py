"""The inference-perf shared-prefix generator, and the replay of the real runs' workloads.

Tests that need ``shared/groundtruth`` skip with a message when it is absent (it is not bundled:
two of its source repositories carry no licence).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsched.runner.simulate import simulate
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig, generate, stage_of


def cfg(**kw) -> SharedPrefixConfig:
    base = dict(num_groups=3, users_per_group=2, system_prompt_len=40, question_len=50, output_len=8,
                stages=[(4.0, 5.0), (10.0, 2.0)])
    base.update(kw)
    return SharedPrefixConfig(**base)


def hashes_of(w, i):
    return w.hashes[w.hash_offsets[i]:w.hash_offsets[i + 1]].tolist()


# ------------------------------------------------------------------------------------------------
def test_constant_rate_stages_counts_and_intervals():
    c = cfg()
    w = generate(c, seed=1)
    assert len(w) == c.num_requests == 20 + 20
    a = w.arrival_s
    # fixed interval 1/rate inside each stage, stage 1 starting at the end of stage 0
    assert np.allclose(np.diff(a[:20]), 0.25) and a[0] == 0.0
    assert a[20] == 5.0 and np.allclose(np.diff(a[20:]), 0.1)
    assert stage_of(c, a).tolist() == [0] * 20 + [1] * 20
    assert (w.output_tokens == 8).all()


def test_fixed_prompts_and_prefix_hashes_follow_users_and_groups():
    c = cfg(system_prompt_len=40)  # 2 full 16-token blocks of system prompt, then the question
    w = generate(c, seed=3)
    n_users = c.num_users
    # request i goes to user i mod U: same prompt and same hashes every turn
    assert (w.prompt_tokens == 90).all()
    assert hashes_of(w, 0)[:5] == hashes_of(w, n_users)[:5]
    # the 6th block is a partial block (90 = 5*16 + 10): never shared
    assert hashes_of(w, 0)[5] != hashes_of(w, n_users)[5]
    # different users share exactly the system-prompt blocks iff they are in the same group
    same, other = [], []
    for u in range(1, n_users):
        h0, hu = hashes_of(w, 0), hashes_of(w, u)
        (same if h0[:2] == hu[:2] else other).append(u)
        assert set(h0[2:]).isdisjoint(hu[2:])  # question blocks are the user's own
    assert len(same) == c.users_per_group - 1 and len(other) == n_users - c.users_per_group


def test_prefix_sharing_system_makes_questions_unique():
    w = generate(cfg(prefix_sharing="system"), seed=3)
    n_users = 6
    h0, h1 = hashes_of(w, 0), hashes_of(w, n_users)  # same user, next turn
    assert h0[:2] == h1[:2]            # system prompt blocks shared
    assert set(h0[2:]).isdisjoint(h1[2:])  # question blocks never
    wn = generate(cfg(prefix_sharing="none"), seed=3)
    assert set(hashes_of(wn, 0)).isdisjoint(hashes_of(wn, n_users))


def test_append_history_grows_and_restarts_at_the_context_cap():
    c = cfg(history="append", system_prompt_len=10, question_len=20, output_len=30, max_context_tokens=150,
            stages=[(6.0, 3.0)])
    w = generate(c, seed=0)
    p = w.prompt_tokens.reshape(-1, c.num_users)  # row = turn, column = user
    assert (p[0] == 30).all()
    assert (p[1] == 30 + 30 + 20).all()        # previous prompt + its output + new question
    # turn 3 would need 80 + 30 + 20 = 130 prompt + 30 output = 160 > 150: new conversation
    assert (p[2] == 30).all()
    conv = w.session_id.reshape(-1, c.num_users)
    assert (conv[0] == conv[1]).all() and (conv[2] != conv[1]).all()
    # the second turn reuses every full block of the first turn's prompt
    u = 0
    assert hashes_of(w, u + c.num_users)[:1] == hashes_of(w, u)[:1]


def test_retokenisation_scale_and_jitter():
    c = cfg(num_groups=20, users_per_group=20, question_len=400, system_prompt_len=100, prompt_scale=1.05,
            prompt_jitter=0.3, stages=[(40.0, 10.0)])
    w = generate(c, seed=5)
    assert abs(w.prompt_tokens.mean() / 525.0 - 1.0) < 0.01
    sd = w.prompt_tokens[:c.num_users].std()
    assert 0.5 * 0.3 * math.sqrt(500) < sd < 1.6 * 0.3 * math.sqrt(500)


def test_determinism_and_seed():
    a, b, d = generate(cfg(), 7), generate(cfg(), 7), generate(cfg(), 8)
    assert a.content_sha256() == b.content_sha256() and a.source_sha256 == b.source_sha256
    assert a.content_sha256() != d.content_sha256()


@pytest.mark.parametrize("kw, field", [
    (dict(num_groups=0), "num_groups"), (dict(output_len=0), "output_len"),
    (dict(history="grow"), "history"), (dict(prefix_sharing="all"), "prefix_sharing"),
    (dict(stages=[]), "stages"), (dict(stages=[(0.0, 10.0)]), "rate_per_s"),
    (dict(prompt_scale=3.0), "prompt_scale"), (dict(hash_block_tokens=24), "hash_block_tokens"),
    (dict(max_context_tokens=50), "max_context_tokens"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        cfg(**kw)


def test_prefix_sharing_changes_what_the_simulator_computes():
    spec = InstanceSpec(model=get_model("Llama-2-7B"), gpu=get_gpu("H100-SXM"), max_num_batched_tokens=2048,
                        max_num_seqs=128, max_model_len=4096, cost=CostParams())
    c = cfg(system_prompt_len=100, question_len=300, output_len=20, stages=[(8.0, 5.0)])
    full = simulate(generate(c, 0), spec).records
    sysonly = simulate(generate(SharedPrefixConfig(**{**c.to_dict(), "prefix_sharing": "system"}), 0), spec).records
    users = c.num_users
    # second turn of each user: every full block but the one holding the last prompt token (vLLM
    # computes at least one token) vs the system prompt's 6 full blocks
    assert (full["prefix_hit_tokens"].iloc[users:] == (400 - 1) // 16 * 16).all()
    assert (sysonly["prefix_hit_tokens"].iloc[users:] == 100 // 16 * 16).all()
    ttft = lambda r: (r["first_token_s"] - r["arrival_s"]).iloc[users:].mean()
    assert ttft(sysonly) > ttft(full)






# ------------------------------------------------------------------------------------------------
# the real runs (need shared/groundtruth)


@pytest.fixture(scope="module")
def gt():
    from kvsched.experiments.groundtruth import GroundTruthMissing, find_groundtruth, load_experiments

    try:
        path = find_groundtruth()
    except GroundTruthMissing as e:
        pytest.skip(f"shared/groundtruth not available ({e}); set KVSCHED_GROUNDTRUTH to run these tests")
    return path, load_experiments(path)


def test_generator_reproduces_request_counts_and_prompt_lengths_of_every_run(gt):
    path, exps = gt
    checked = 0
    for e in exps:
        if e.source != "training_default_args":
            continue
        w = generate(e.workload, seed=0)
        stage = stage_of(e.workload, w.arrival_s)
        for s in e.stages:
            m = stage == s.stage
            assert int(m.sum()) == s.count, (e.exp_id, s.stage)
            # one re-tokenisation factor for every Llama-2 run reproduces each run's mean prompt
            if "llama-2" in e.model_id.lower():
                assert abs(w.prompt_tokens[m].mean() / s.prompt_len["mean"] - 1) < 0.012, e.exp_id
                lo, hi = s.prompt_len["min"], s.prompt_len["max"]
                assert lo - 0.03 * lo <= w.prompt_tokens[m].min() and w.prompt_tokens[m].max() <= hi + 0.03 * hi
                checked += 1
    assert checked >= 10  # 8 runs, 12 stages
    blis = json.loads((path / "blis" / "trained_physics_iter29_experiments.json").read_text())["experiments"]
    for e in exps:
        if e.source == "sim_to_real":
            entry = next(b for b in blis if e.exp_id.startswith(str(b["id"]) + "-"))
            assert e.workload.num_requests == entry["workload"]["num_requests"], e.exp_id
            nominal = e.workload.system_prompt_len + e.workload.question_len
            # BLIS's golden totals count nominal prompt tokens
            assert entry["expected"]["total_input_tokens"] == entry["workload"]["num_requests"] * nominal


def test_measured_itl_definition_matches_the_csv(gt):
    _, exps = gt
    e = next(x for x in exps if x.exp_id.startswith("20260217-155451"))
    for s in e.stages:
        v = s.values_ms
        assert math.isclose(v["itl_mean"], (v["e2e_mean"] - v["ttft_mean"]) / (s.output_len_mean - 1), rel_tol=1e-12)
        assert s.peers_ms["itl_mean"]["vidur"] > 0


def test_unreplayable_runs_carry_a_reason(gt):
    _, exps = gt
    reasons = {e.exp_id: e.skip_reason for e in exps if e.skip_reason}
    # every run has a model preset (mixture of experts included); only the overloaded ones skip
    assert sorted(k.split("-", 2)[2] for k in reasons) == ["llama-2-70b-hf-tp4-reasoning", "llama-2-7b-tp1-reasoning",
                                                           "mixtral-8x7b-v0-1-tp2-reasoning"]
    assert all("overloaded" in v for v in reasons.values())
    assert sum(1 for e in exps if not e.skip_reason) == 21
