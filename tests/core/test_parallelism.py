"""Long-context parallelism inside one instance (``InstanceSpec.parallel``, envs/sim/parallelism.py):
pipeline stages and their bubble, Medha's stream pipelining of prefill chunks (SPP), KV-parallel
groups (KVP) and LoongServe's elastic sequence parallelism (ESP), priced with their communication.

The hand-computed cases write the roofline of one stage out here (REFERENCE §5.3 on the stage's
layers) rather than calling the cost model's own helpers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.envs.sim.parallelism import IB_NDR400_LINK, ParallelSpec
from kvsched.envs.sim.policy_api import PolicyContext
from kvsched.envs.sim.spec_io import instance_spec_from_dict, instance_spec_to_dict
from kvsched.envs.sim.specs import CostParams, InstanceSpec
from kvsched.policies.base import make_policy
from kvsched.runner.simulate import simulate
from simkit import GPU, MODEL, NO_FRONT_END, assert_identical, build_workload, pnm_tier, short_only, with_longs

#: no MFU ramp, no step overhead, no front end: the hand formulas stay short
FLAT = CostParams(mfu_half_tokens=0.0, step_overhead_s=0.0, request_overhead_s=0.0, prompt_token_overhead_s=0.0,
                  output_token_overhead_s=0.0)


def spec(parallel=None, **kw) -> InstanceSpec:
    base = dict(model=MODEL, gpu=GPU, cost=FLAT, parallel=parallel)
    base.update(kw)
    return InstanceSpec(**base)


def stage_s(c: float, p: float, stages: int, groups: int = 1, lin_groups: int = 1) -> float:
    """One stage's seconds for ``c`` new tokens after ``p`` cached ones on Llama-3.1-8B, TP1, H100,
    the FLAT parameters: attention and KV over ``groups``, linear work over ``lin_groups``."""
    frac = math.ceil(32 / stages) / 32
    flops = (2 * MODEL.matmul_params * c / lin_groups + MODEL.attn_flops_per_pair * c * (p + c / 2) / groups) * frac
    compute = flops / (GPU.bf16_flops_per_s * FLAT.mfu_max)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # bytes, all layers
    memory = ((MODEL.weight_bytes(2.0) * frac + kv_per_token * frac * (p + c) / groups)
              / (GPU.hbm_bytes_per_s * FLAT.mbu))
    return max(compute, memory)


def p2p_s(c: float) -> float:
    return IB_NDR400_LINK.latency_s + c * 4096 * 2 / IB_NDR400_LINK.bytes_per_s


def lone_prefill_ttft(s: InstanceSpec, prompt: int, chunk: int) -> float:
    w = build_workload([(0.0, prompt, 1, 0)])
    r = simulate(w, s.with_overrides(max_num_batched_tokens=chunk), "fcfs",
                 options=InstanceOptions(check_invariants=True))
    return float(r.records["first_token_s"].iloc[0])


def test_spp_prefill_takes_units_plus_stages_minus_one_stage_times():
    """8,192 tokens in steps of 2,048 on 4 stages. SPP streams each step's chunk as 4 sub-chunks
    of 512 (the pipeline's 4 in-flight iterations), unit k+1 entering stage 1 as unit k leaves it:
    Σ τ(u_k) + 3·(τ(u_16) + p2p) over the 16 units, ≈ (16 + 3) stage-times of 512 tokens. Without
    SPP each chunk is one micro-batch draining the pipeline: Σ (4·τ(c_k) + 3·p2p), 16 stage-times
    of 2,048 tokens."""
    units = [stage_s(512, 512 * k, 4) for k in range(16)]
    spp = lone_prefill_ttft(spec(ParallelSpec(pp_stages=4)), 8192, 2048)
    assert spp == pytest.approx(sum(units) + 3 * (units[-1] + p2p_s(512)), rel=1e-12)
    taus = [stage_s(2048, 2048 * k, 4) for k in range(4)]
    plain = lone_prefill_ttft(spec(ParallelSpec(pp_stages=4, spp=False)), 8192, 2048)
    assert plain == pytest.approx(sum(4 * t + 3 * p2p_s(2048) for t in taus), rel=1e-12)
    # (16 + 3) units of a quarter chunk against 4 x 4 chunk-stage-times: ≈ 19/64
    assert 0.25 < spp / plain < 0.35


def test_cost_model_prefill_prediction_equals_the_simulated_lone_prefill():
    s = spec(ParallelSpec(pp_stages=4))
    assert float(CostModel(s).prefill_time_s(8192, 0, 2048)) == pytest.approx(lone_prefill_ttft(s, 8192, 2048),
                                                                              rel=1e-12)


def test_pp_bubble_of_a_decode_step_is_stages_minus_one_over_microbatches_plus_stages_minus_one():
    """8 decodes, 4 stages, 4 micro-batches of 2: (4 + 3)·τ(2 decodes) + 3·p2p; bubble 3/7."""
    s = spec(ParallelSpec(pp_stages=4))
    ctx = 8 * 1000
    tau = max(2 * MODEL.matmul_params * 2 / 4 + MODEL.attn_flops_per_pair * (ctx / 4) / 4, 0) \
        / (GPU.bf16_flops_per_s * FLAT.mfu_max)
    mem = (MODEL.weight_bytes(2.0) / 4 + 2 * 32 * 8 * 128 * 2 / 4 * (ctx / 4)) / (GPU.hbm_bytes_per_s * FLAT.mbu)
    tau = max(tau, mem)
    got = float(CostModel(s).decode_step_time_s(8, ctx))
    assert got == pytest.approx(7 * tau + 3 * p2p_s(2), rel=1e-12)
    busy = 4 * tau  # each stage works 4 micro-batches of the 7 slots
    assert 1 - busy / (got - 3 * p2p_s(2)) == pytest.approx(3 / 7, rel=1e-12)
    # 8 micro-batches of 1 decode: bubble 3/11, but memory-bound decodes re-read the stage's
    # weights once per micro-batch, so the step is longer
    s8 = spec(ParallelSpec(pp_stages=4, pp_microbatches=8))
    got8 = float(CostModel(s8).decode_step_time_s(8, ctx))
    tau8 = (MODEL.weight_bytes(2.0) / 4 + 2 * 32 * 8 * 128 * 2 / 4 * (ctx / 8)) / (GPU.hbm_bytes_per_s * FLAT.mbu)
    assert got8 == pytest.approx(11 * tau8 + 3 * p2p_s(1), rel=1e-12)
    assert got8 > got


def test_kvp_capacity_is_the_sum_of_the_groups_and_decode_attention_divides():
    one = spec(ParallelSpec(kvp_groups=1))
    four = spec(ParallelSpec(kvp_groups=4))
    assert four.num_hbm_blocks == 4 * one.num_hbm_blocks
    assert four.num_gpus == 4
    # a 1-request decode over 1M context: KV reads over 4 groups plus the per-layer combine
    ctx = 1_000_000
    mem = (MODEL.weight_bytes(2.0) + 2 * 32 * 8 * 128 * 2 * ctx / 4) / (GPU.hbm_bytes_per_s * FLAT.mbu)
    cmp_ = (2 * MODEL.matmul_params + MODEL.attn_flops_per_pair * ctx / 4) / (GPU.bf16_flops_per_s * FLAT.mfu_max)
    combine = 32 * (IB_NDR400_LINK.latency_s + 3 / 4 * 1 * 32 * 128 * 4 / IB_NDR400_LINK.bytes_per_s)
    got = float(CostModel(four).decode_step_time_s(1, ctx))
    assert got == pytest.approx(max(mem, cmp_) + combine, rel=1e-12)
    assert got < float(CostModel(one).decode_step_time_s(1, ctx)) / 2


def test_pipeline_stages_shrink_weights_and_kv_per_gpu_so_capacity_grows():
    dense = spec()
    pp = spec(ParallelSpec(pp_stages=4))
    assert pp.weight_bytes_per_gpu == pytest.approx(dense.weight_bytes_per_gpu / 4)
    assert pp.kv_bytes_per_block_per_gpu == pytest.approx(dense.kv_bytes_per_block_per_gpu / 4)
    assert pp.num_hbm_blocks > 4 * dense.num_hbm_blocks


def test_a_context_that_does_not_fit_is_refused_naming_the_limit():
    m = dataclasses.replace(MODEL, name="Llama-3-8B-10M", max_context_tokens=10_485_760)
    with pytest.raises(ConfigError) as e:
        InstanceSpec(model=m, gpu=GPU, tp=2, max_model_len=10_000_000, parallel=ParallelSpec(pp_stages=4))
    msg = str(e.value)
    assert "\n" not in msg and "max_model_len=10000000" in msg and "KV cache can hold only" in msg
    assert "PP stage" in msg and "kvp_groups" in msg
    ok = InstanceSpec(model=m, gpu=GPU, tp=2, max_model_len=10_000_000,
                      parallel=ParallelSpec(pp_stages=4, kvp_groups=4))
    assert ok.num_hbm_blocks * 16 >= 10_000_000


@pytest.mark.parametrize("kw, field", [
    ({"pp_stages": 0}, "pp_stages"), ({"kvp_groups": 1.5}, "kvp_groups"), ({"spp": "yes"}, "spp"),
    ({"pp_microbatches": 0}, "pp_microbatches"), ({"esp_groups": 4, "pp_stages": 2}, "esp_groups"),
    ({"esp_tokens_per_group": -1}, "esp_tokens_per_group"), ({"link": "carrier-pigeon"}, "link"),
    ({"link": {"name": "x", "bytes_per_s": 0}}, "bytes_per_s"), ({"stages": 2}, "stages"),
])
def test_bad_parallel_input_is_a_one_line_error_naming_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "parallel": kw}, "s.yaml")
    msg = str(e.value)
    assert "\n" not in msg and field in msg and "s.yaml" in msg


@pytest.mark.parametrize("kw, field", [
    ({"pp_stages": 2, "esp_tokens_per_group": 100}, "esp_tokens_per_group"),
    ({"kvp_groups": 4, "pp_microbatches": 2}, "pp_microbatches"),
    ({"esp_groups": 2, "pp_microbatches": 3}, "pp_microbatches"),
])
def test_a_parallel_key_the_layout_ignores_is_refused_not_dropped(kw, field):
    with pytest.raises(ConfigError) as e:
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "parallel": kw}, "s.yaml")
    msg = str(e.value)
    assert "\n" not in msg and f"{field}=" in msg and "unless" in msg and "s.yaml" in msg


def test_more_stages_than_layers_and_pnm_with_parallel_are_refused():
    with pytest.raises(ConfigError, match="n_layers=32"):
        spec(ParallelSpec(pp_stages=33))
    with pytest.raises(ConfigError, match="PNM"):
        spec(ParallelSpec(kvp_groups=2), pnm=pnm_tier())


def test_parallel_spec_round_trips_through_a_dict():
    s = spec(ParallelSpec(pp_stages=2, kvp_groups=2, spp=False, pp_microbatches=3))
    d = instance_spec_to_dict(s)
    assert d["parallel"]["pp_stages"] == 2 and d["parallel"]["link"]["name"] == "ib-ndr400"
    assert instance_spec_from_dict(d) == s


@pytest.mark.parametrize("name, bytes_per_s", [("ib_ndr_400g", 45e9), ("roce_400g", 45e9), ("nvlink5", 700e9),
                                              ("pcie5", 50e9)])
def test_parallel_link_takes_every_link_kvsched_presets_lists(name, bytes_per_s):
    """`kvsched presets` lists the links between instances; the refusal of parallel.link named those
    presets as allowed but refused them (ib_ndr_400g: the same NIC as the group default ib-ndr400)."""
    d = instance_spec_to_dict(spec(ParallelSpec(pp_stages=2)))
    d["parallel"]["link"] = name
    assert instance_spec_from_dict(d).parallel.link.bytes_per_s == bytes_per_s


def test_esp_runs_a_long_prefill_to_completion_while_a_short_request_waits():
    """LoongServe ESP is non-preemptive: a short request arriving during a long prefill gets its
    first token only after the long one; Medha's layout with LARS serves it first."""
    rows = [(0.0, 120_000, 4, 0), (0.05, 300, 4, 0)]
    esp = spec(ParallelSpec(esp_groups=4), cost=NO_FRONT_END)
    r = simulate(build_workload(rows), esp, "nonpreemptive").records.set_index("request_id")
    assert r.loc[1, "first_token_s"] > r.loc[0, "first_token_s"]
    medha = spec(ParallelSpec(pp_stages=2, kvp_groups=2), cost=NO_FRONT_END)
    r = simulate(build_workload(rows), medha, "lars").records.set_index("request_id")
    assert r.loc[1, "first_token_s"] < r.loc[0, "first_token_s"]


def test_esp_prefill_scales_over_the_instances_it_needs():
    """A prefill of 4 x esp_tokens_per_group tokens on 8 ESP instances uses 4 of them: faster than
    on one, no faster on 8 than on 4."""
    def step(groups):
        par = ParallelSpec(esp_groups=groups, esp_tokens_per_group=4096) if groups > 1 else ParallelSpec()
        c = CostModel(spec(par))
        return c.plan_step_time_s(0, 0, [(16384, 0, True)])
    assert step(4) < step(1) / 2
    assert step(8) == step(4)


def _mixed():
    return with_longs(short_only(rate=3.0, dur=20.0, seed=3), [2.0, 6.0], [60_000, 90_000], out=16)


@pytest.mark.parametrize("par, policy", [
    (ParallelSpec(pp_stages=4, kvp_groups=2), "lars"),
    (ParallelSpec(pp_stages=2, spp=False), "fcfs"),
    (ParallelSpec(esp_groups=4), "nonpreemptive"),
])
def test_fast_forward_equals_stepping_one_by_one(par, policy):
    s = spec(par, cost=NO_FRONT_END)
    w = _mixed()
    fast = simulate(w, s, policy, options=InstanceOptions(fast_forward=True, check_invariants=True))
    slow = simulate(w, s, policy, options=InstanceOptions(fast_forward=False))
    assert_identical(fast, slow)
    assert fast.stats["steps"] == slow.stats["steps"]


def test_same_seed_same_result_byte_for_byte():
    s = spec(ParallelSpec(pp_stages=4, kvp_groups=2), cost=NO_FRONT_END)
    a = simulate(_mixed(), s, "lars")
    b = simulate(_mixed(), s, "lars")
    assert summary_to_json(a.summary) == summary_to_json(b.summary)
    assert_identical(a, b)


def test_dense_spec_prices_are_unchanged_by_an_absent_parallel_layout():
    """parallel=None keeps the dense roofline (bitwise): the cost model takes its old path."""
    c = CostModel(spec())
    assert c.parallel is None
    n, pairs, kv = 300.0, 300.0 * 1200.0, 1350.0
    flops = 2 * c.matmul_params_per_gpu * n + c.attn_flops_per_pair_per_gpu * pairs
    compute = flops * (n + 0.0) / (c._eff_flops * n)
    memory = (c.weight_bytes_per_gpu + c.kv_bytes_per_token_per_gpu * kv) / c._eff_bw
    assert c.step_time_fast(n, pairs, kv) == max(compute, memory) + 0.0 + 0.0
    assert c.plan_step_time_s(100, 100_000, [(200, 1000, True)]) == c.step_time_fast(
        300.0, (2 * 100_000 + 200 * (2 * 1000 + 200)) / 2.0, 100_000.0 + 1200.0, 101.0)  # 100 decodes + a chunk


def test_lars_sees_spp_in_its_prefill_prediction_and_chunks_flow_faster():
    """LARS on top: its T_hat of a long prompt is shorter with stream pipelining, and so is the
    prompt's simulated time to first token (chunks of the same request flow through the stages)."""
    def t_hat(par):
        s = spec(par)
        pol = make_policy("lars")
        pol.bind(PolicyContext(spec=s, cost=CostModel(s), instance_id=0))
        return float(pol.predicted_prefill_s(np.array([100_000]), np.array([0]))[0])

    assert t_hat(ParallelSpec(pp_stages=4)) < t_hat(ParallelSpec(pp_stages=4, spp=False)) / 2
    w = build_workload([(0.0, 100_000, 1, 0)])

    def ttft(par):
        return float(simulate(w, spec(par), "lars").records["first_token_s"].iloc[0])

    assert ttft(ParallelSpec(pp_stages=4)) < ttft(ParallelSpec(pp_stages=4, spp=False)) / 2


def test_spp_chunks_left_in_flight_delay_the_next_steps_micro_batches():
    """A short last chunk after longer ones leaves the pipeline behind them: the prefill takes
    Σ τ + (S−1)·(max τ + p2p), the flow shop's value (REFERENCE §1.4's τ(c_last) would be too
    short here): 2 steps of 4,096 tokens (4 units of 1,024 each) and a last one of 512 (4 units of
    128) on 4 stages."""
    sizes = [1024] * 8 + [128] * 4
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    units = [stage_s(c, p, 4) for c, p in zip(sizes, starts)]
    assert units[-1] < max(units)
    got = lone_prefill_ttft(spec(ParallelSpec(pp_stages=4)), 8704, 4096)
    assert got == pytest.approx(sum(units) + 3 * (max(units) + p2p_s(128)), rel=1e-12)


def test_the_degenerate_layout_of_one_stage_and_one_group_prices_as_the_dense_instance():
    """ParallelSpec() (1 stage, 1 group) is the dense instance: same capacity, and the same step,
    decode and prefill times up to float rounding (the terms are added in another order)."""
    dense, one = spec(cost=NO_FRONT_END), spec(ParallelSpec(), cost=NO_FRONT_END)
    assert one.num_hbm_blocks == dense.num_hbm_blocks and one.num_gpus == 1
    cd, co = CostModel(dense), CostModel(one)
    assert float(co.decode_step_time_s(32, 32 * 3000)) == pytest.approx(float(cd.decode_step_time_s(32, 32 * 3000)),
                                                                        rel=1e-12)
    assert float(co.prefill_time_s(20_000, 0, 2048)) == pytest.approx(float(cd.prefill_time_s(20_000, 0, 2048)),
                                                                      rel=1e-12)
    assert co.plan_step_time_s(10, 9000, [(500, 100, True)]) == pytest.approx(
        cd.plan_step_time_s(10, 9000, [(500, 100, True)]), rel=1e-12)
    w = _mixed()
    a, b = simulate(w, dense, "lars").records, simulate(w, one, "lars").records
    assert np.allclose(a["first_token_s"], b["first_token_s"], rtol=1e-9, equal_nan=True)
