"""Mixture of experts, latent attention and quantized weights (envs/sim/model_spec.py,
cost_model.py, hardware.py): the MoE presets against their HF configs, the expected number of
distinct experts a step reads, the MoE step cost (tensor- and expert-parallel), FP8/NVFP4 peaks
and bytes, that dense predictions did not change, and bad MoE input."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvsched.envs.sim.cost_model import ACTIVATION_BYTES, CostModel
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.model_spec import MODEL_PRESETS, ModelSpec, get_model
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu

COST = CostParams(mfu_max=0.7, mfu_half_tokens=64.0, mbu=0.8, step_overhead_s=7e-4, allreduce_latency_s=1e-5,
                  allreduce_bw_efficiency=0.3)
MOE_PRESETS = [m for m in MODEL_PRESETS.values() if m.is_moe]


def _cm(model: str, tp: int = 1, gpu: str = "H100-SXM", cost: CostParams = COST, **kw: object) -> CostModel:
    return CostModel(InstanceSpec(get_model(model), get_gpu(gpu), tp=tp, cost=cost, **kw))


# ---------------------------------------------------------------------------------- presets

def _gqa_attention(m: ModelSpec) -> int:
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return 2 * m.hidden_size * q + 2 * m.hidden_size * kv


def test_moe_preset_parameter_counts_follow_from_their_configs() -> None:
    # per layer: attention + router (hidden x E) + (E + shared) experts of 3·hidden·width + 2 norms
    # (+ Qwen3's per-head q/k RMSNorm); untied embedding and lm_head; final norm
    for name, extra in (("Mixtral-8x7B", 0), ("Mixtral-8x22B", 0), ("Qwen3-30B-A3B", 2 * 128),
                        ("Llama-4-Scout-17B-16E", 0), ("Llama-4-Scout-17B-16E-FP8", 0)):
        m = get_model(name)
        assert m.n_moe_layers == m.n_layers
        layer = (_gqa_attention(m) + extra + m.hidden_size * m.n_experts
                 + (m.n_experts + m.n_shared_experts) * m.expert_params + 2 * m.hidden_size)
        assert m.n_params == m.n_layers * layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size, name
    # DeepSeek-V3: MLA (q_lora 1536, kv_lora 512 + rope 64, 128 heads of 128+64 / v 128), 3 dense layers
    h = 7168
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    dense = attn + 3 * h * 18432 + 2 * h
    moe = attn + 257 * 3 * h * 2048 + 256 * h + 256 + 2 * h
    ds = get_model("DeepSeek-V3")
    assert ds.n_params == 3 * dense + 58 * moe + 2 * 129280 * h + h
    assert ds.n_moe_layers == 58


@pytest.mark.parametrize(("name", "total", "active"), [
    # the model cards' totals and active parameters per token (embedding included)
    ("Mixtral-8x7B", 46.7e9, 12.9e9), ("Mixtral-8x22B", 140.6e9, 39.1e9), ("Qwen3-30B-A3B", 30.5e9, 3.3e9),
    ("Llama-4-Scout-17B-16E", 107.8e9, 17.2e9), ("DeepSeek-V3", 671e9, 37.5e9)])
def test_moe_presets_match_published_total_and_active_parameters(name: str, total: float, active: float) -> None:
    m = get_model(name)
    assert m.n_params == pytest.approx(total, rel=2e-3)
    assert m.active_matmul_params + m.vocab_size * m.hidden_size == pytest.approx(active, rel=2e-2)  # cards round


@pytest.mark.parametrize(("hf_id", "preset"), [
    ("mistralai/Mixtral-8x7B-v0.1", "Mixtral-8x7B"),
    ("RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic", "Llama-4-Scout-17B-16E-FP8"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "Llama-4-Scout-17B-16E"),
    ("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B"), ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3"),
    ("mistralai/Mixtral-8x22B-v0.1", "Mixtral-8x22B")])
def test_ground_truth_model_ids_resolve_to_the_moe_presets(hf_id: str, preset: str) -> None:
    assert get_model(hf_id).name == preset


def test_latent_attention_caches_the_latent_and_rope_key_replicated_on_every_rank() -> None:
    ds = get_model("DeepSeek-V3")
    assert ds.kv_bytes_per_token(2.0) == 61 * (512 + 64) * 2  # DeepSeek-V3 report §2.1.1
    spec = InstanceSpec(ds, get_gpu("H200"), tp=8)
    assert spec.kv_bytes_per_block_per_gpu == spec.kv_bytes_per_block  # not sharded over TP


def test_llama4_fp8_dynamic_keeps_attention_and_lm_head_in_bf16() -> None:
    fp8, bf16 = get_model("Llama-4-Scout-17B-16E-FP8"), get_model("Llama-4-Scout-17B-16E")
    mlp = fp8.n_layers * 17 * fp8.expert_params
    assert fp8.mlp_params == mlp
    assert fp8.weight_bytes(1.0) == (fp8.n_params - mlp) * 2 + mlp
    spec = InstanceSpec(fp8, get_gpu("H100-SXM"), tp=2)  # weight_dtype "auto" -> the checkpoint's fp8
    assert spec.effective_weight_dtype == "fp8" and spec.kv_dtype_bytes == 2.0
    assert spec.weight_bytes_per_gpu == fp8.weight_bytes(1.0) / 2
    assert InstanceSpec(bf16, get_gpu("H100-SXM"), tp=4).effective_weight_dtype == "bf16"


# ------------------------------------------------------------------- distinct experts D(n)

@pytest.mark.parametrize("name", [m.name for m in MOE_PRESETS])
def test_expected_distinct_experts_is_k_for_one_token_and_tends_to_all_experts(name: str) -> None:
    m = get_model(name)
    E, k = m.n_experts, m.experts_per_token
    assert m.expected_distinct_experts(0) == 0.0
    assert m.expected_distinct_experts(1) == pytest.approx(k, rel=1e-12)
    assert m.expected_distinct_experts(10**7) == pytest.approx(E, rel=1e-9)
    d = [m.expected_distinct_experts(n) for n in range(0, 3000, 7)]
    assert all(b >= a for a, b in zip(d, d[1:])) and max(d) <= E
    for n in (2, 5, 17, 100):
        assert m.expected_distinct_experts(n) == pytest.approx(E * (1 - (1 - k / E) ** n), rel=1e-12)


def test_routing_skew_activates_fewer_distinct_experts_with_the_same_limits() -> None:
    base = get_model("Mixtral-8x7B")
    skewed = ModelSpec(**{**base.__dict__, "name": "skewed", "routing_skew": 1.0})
    assert skewed.expected_distinct_experts(1) == pytest.approx(2.0, rel=1e-12)
    for n in (2, 4, 10, 30):
        assert skewed.expected_distinct_experts(n) < base.expected_distinct_experts(n)
    assert skewed.expected_distinct_experts(10**6) == pytest.approx(8.0, rel=1e-9)


# ------------------------------------------------------------------------------ step cost

def test_dense_step_times_are_unchanged_to_the_bit() -> None:
    # sha256 of these dense predictions computed by kvsched before mixture of experts was modelled
    # (commit 298c037); any change to a dense model's step time changes it
    cases = (("Llama-2-7B", "H100-SXM", 1, {}), ("Llama-2-70B", "H100-SXM", 4, {}), ("Yi-34B", "H100-SXM", 2, {}),
             ("Qwen2.5-7B", "A100-80GB", 1, {}), ("Llama-3.1-70B", "H100-SXM", 8, {"weight_dtype": "fp8"}),
             ("Mistral-Nemo-12B", "L40S", 2, {"kv_dtype": "fp8"}))
    h = hashlib.sha256()
    n = np.arange(1.0, 4097.0, 7.0)
    pairs, kv = n * 517.0 + 3.0, n * 31.0 + 800.0
    for model, gpu, tp, kw in cases:
        cm = _cm(model, tp, gpu, **kw)
        h.update(np.asarray(cm.step_time_s(n, pairs, kv)).tobytes())
        h.update(np.asarray(cm.decode_step_ends(0.0, 13, 9000, 40)).tobytes())
        h.update(np.asarray(cm.prefill_time_s(np.array([33.0, 1000.0, 5000.0]), 0)).tobytes())
        h.update(np.float64(cm.step_time_fast(301.0, 4.4e5, 9.1e3)).tobytes())
    assert h.hexdigest() == "863a13ef16432c69a76671efe06e4aee76365a40d6a322c8a32e2da353bdc848"


@pytest.mark.parametrize(("model", "tp", "ep"), [("Mixtral-8x7B", 2, False), ("Llama-4-Scout-17B-16E-FP8", 2, True),
                                                 ("Qwen3-30B-A3B", 1, False)])
def test_moe_scalar_array_and_decode_paths_agree_bitwise(model: str, tp: int, ep: bool) -> None:
    cm = _cm(model, tp, expert_parallel=ep)
    rng = np.random.default_rng(3)
    n = np.concatenate([rng.integers(1, 3000, 100).astype(np.float64), [1.0, 2.5, 7.25, 1e6]])
    pairs, kv = rng.uniform(0, 5e7, n.size), rng.uniform(0, 2e5, n.size)
    arr = cm.step_times_fast(n, pairs, kv)
    assert [cm.step_time_fast(a, b, c) for a, b, c in zip(n, pairs, kv)] == list(arr)
    assert list(np.asarray(cm.step_time_s(n, pairs, kv))) == list(arr)
    ctx = 5000.0 + 9.0 * np.arange(30)
    times = cm.decode_step_times_fast(9.0, ctx)
    assert list(times) == [cm.step_time_fast(9.0, c, c) for c in ctx]
    ends = cm.decode_step_ends(0.0, 9, 5000, 30)
    e, expect = 0.0, []
    for c in ctx:
        e += cm.step_time_fast(9.0, c, c)
        expect.append(e)
    assert ends == expect


def test_a_decode_step_reads_the_weights_of_the_experts_it_activates() -> None:
    free = CostParams(mfu_max=1.0, mfu_half_tokens=0.0, mbu=1.0, step_overhead_s=0.0, allreduce_latency_s=0.0)
    spec = InstanceSpec(get_model("Mixtral-8x7B"), get_gpu("H100-SXM"), tp=2, cost=free)
    cm, m = CostModel(spec), spec.model
    expert_bytes = m.n_moe_layers * m.expert_params * 2.0 / 2  # bf16, one expert of every layer, per rank
    static = spec.weight_bytes_per_gpu - m.n_experts * expert_bytes
    # tokens as run: padded to the next CUDA-graph size up to 512 tokens (1, 2, 4, multiples of 8)
    for n, run in ((1, 1), (3, 4), (20, 24), (5000, 5000)):
        hbm = cm.step_breakdown(float(n), 0.0, 0.0)["hbm_bytes"]
        assert hbm == pytest.approx(static + m.expected_distinct_experts(run) * expert_bytes, rel=1e-12)
    # all experts once a step has enough tokens: the dense model's bytes
    assert cm.step_breakdown(5000.0, 0.0, 0.0)["hbm_bytes"] == pytest.approx(spec.weight_bytes_per_gpu, rel=1e-9)


def test_steps_run_padded_to_the_next_cuda_graph_size_and_padded_tokens_reach_experts() -> None:
    from kvsched.envs.sim.cost_model import _cuda_graph_tokens_array, cuda_graph_tokens

    n = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 11.0, 255.5, 256.0, 505.0, 512.0, 513.0, 4096.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 256.0, 256.0, 512.0, 512.0, 513.0, 4096.0]
    assert [cuda_graph_tokens(float(x)) for x in n] == want == list(_cuda_graph_tokens_array(n))
    scout = _cm("Llama-4-Scout-17B-16E-FP8", 2)
    # 11 decodes run as 16 tokens: the weights of D(16) experts, not D(11)
    b11, b16 = scout.step_breakdown(11.0, 0.0, 0.0), scout.step_breakdown(16.0, 0.0, 0.0)
    assert b11["hbm_bytes"] == b16["hbm_bytes"]
    dense = _cm("Llama-2-7B")  # dense steps: unpadded (their weights are read whole anyway)
    assert dense.step_breakdown(11.0, 0.0, 0.0)["flops"] < dense.step_breakdown(16.0, 0.0, 0.0)["flops"]


def test_moe_compute_counts_the_active_experts_with_a_per_expert_mfu_ramp() -> None:
    cost = CostParams(mfu_max=0.5, mfu_half_tokens=64.0, mbu=1.0, step_overhead_s=0.0, allreduce_latency_s=0.0)
    spec = InstanceSpec(get_model("Mixtral-8x7B"), get_gpu("H100-SXM"), tp=2, cost=cost)
    cm, m = CostModel(spec), spec.model
    n = 2048.0
    d = m.expected_distinct_experts(2048)
    per_expert = 2 * m.n_moe_layers * m.expert_params / 2  # FLOPs per token per active expert, per rank
    dense = 2 * (m.matmul_params - m.routed_expert_params) / 2 * n
    m_e = n * m.experts_per_token / d  # tokens per activated expert
    expect = (dense * (n + 64) / n + m.experts_per_token * n * per_expert * (m_e + 64) / m_e) / (989e12 * 0.5)
    assert cm.step_breakdown(n, 0.0, 0.0)["compute_s"] == pytest.approx(expect, rel=1e-12)
    # the FLOPs of a token: the k active experts, not all E
    assert 2 * m.active_matmul_params / 2 == pytest.approx(dense / n + m.experts_per_token * per_expert, rel=1e-12)


def test_moe_efficiency_slows_only_the_expert_terms() -> None:
    half = CostParams(**{**COST.__dict__, "moe_efficiency": 0.5})
    fast, slow = _cm("Mixtral-8x7B", 2), _cm("Mixtral-8x7B", 2, cost=half)
    assert slow.step_time_fast(20.0, 1e4, 1e4) > fast.step_time_fast(20.0, 1e4, 1e4)
    dense = _cm("Llama-2-70B", 4)
    assert _cm("Llama-2-70B", 4, cost=half).step_time_fast(20.0, 1e4, 1e4) == dense.step_time_fast(20.0, 1e4, 1e4)


def test_expert_parallel_swaps_the_moe_all_reduces_for_all_to_all() -> None:
    tp, ep = _cm("Mixtral-8x7B", 4), _cm("Mixtral-8x7B", 4, expert_parallel=True)
    m = get_model("Mixtral-8x7B")
    for n in (1.0, 64.0, 2048.0):
        a, b = tp.step_breakdown(n, 1e4, 1e4), ep.step_breakdown(n, 1e4, 1e4)
        assert (a["compute_s"], a["memory_s"]) == (b["compute_s"], b["memory_s"])  # same mean bytes/FLOPs
        link = get_gpu("H100-SXM").nvlink_bytes_per_s * COST.allreduce_bw_efficiency
        per_layer_ar = 2 * 3 / 4 * n * m.hidden_size * ACTIVATION_BYTES / link + COST.allreduce_latency_s
        a2a = 2 * 2 * 3 / 16 * n * m.hidden_size * ACTIVATION_BYTES / link + 2 * COST.allreduce_latency_s
        assert a["comm_s"] == pytest.approx(2 * 32 * per_layer_ar, rel=1e-12)
        assert b["comm_s"] == pytest.approx(32 * per_layer_ar + 32 * a2a, rel=1e-12)


# ------------------------------------------------------------------------------ precision

def test_fp8_runs_at_twice_the_bf16_peak_on_h100_and_nvfp4_at_the_fp4_peak_on_b200() -> None:
    h100, b200 = get_gpu("H100-SXM"), get_gpu("B200")
    # H100 SXM datasheet: 1,979 TFLOPS FP8 / 989 BF16 dense (989.4 / 1,978.9 unrounded)
    assert h100.peak_flops_per_s("fp8") == pytest.approx(2 * h100.peak_flops_per_s("bf16"), rel=1e-3)
    assert b200.peak_flops_per_s("nvfp4") == 2 * b200.peak_flops_per_s("fp8") == 9e15
    assert h100.peak_flops_per_s("nvfp4") == h100.bf16_flops_per_s  # no FP4 tensor cores: W4A16
    spec = InstanceSpec(get_model("Llama-3.1-70B"), b200, tp=2, weight_dtype="nvfp4")
    assert spec.weight_bytes_per_gpu == get_model("Llama-3.1-70B").n_params * 0.5625 / 2
    assert CostModel(spec).peak_flops_per_s == 9e15


def test_mlp_only_fp8_runs_attention_matmuls_at_the_bf16_peak() -> None:
    free = CostParams(mfu_max=1.0, mfu_half_tokens=0.0, mbu=1.0, step_overhead_s=0.0, allreduce_latency_s=0.0)
    fp8 = InstanceSpec(get_model("Llama-4-Scout-17B-16E-FP8"), get_gpu("H100-SXM"), tp=2, cost=free)
    m, n = fp8.model, 4096.0
    non_mlp = m.matmul_params - m.mlp_params  # attention projections, routers, lm_head: bf16
    shared = m.mlp_params - m.routed_expert_params
    dense_s = (2 * non_mlp / 2 * n) / 989e12 + (2 * shared / 2 * n) / 1979e12
    expert_s = m.experts_per_token * n * 2 * m.n_moe_layers * m.expert_params / 2 / 1979e12
    assert CostModel(fp8).step_breakdown(n, 0.0, 0.0)["compute_s"] == pytest.approx(dense_s + expert_s, rel=1e-12)


# ------------------------------------------------------------------------------ bad input

_MOE_OK = dict(name="tiny-moe", n_layers=4, hidden_size=256, n_heads=8, n_kv_heads=2, head_dim=32,
               intermediate_size=512, vocab_size=1000, n_params=20e6, max_context_tokens=2048,
               n_experts=8, experts_per_token=2, expert_intermediate_size=128)


@pytest.mark.parametrize(("change", "match"), [
    ({"experts_per_token": 9}, r"experts_per_token=9 .*\[1, n_experts=8\]"),
    ({"experts_per_token": 0}, r"experts_per_token=0"),
    ({"expert_intermediate_size": 0}, r"expert_intermediate_size=0"),
    ({"n_experts": -1}, r"n_experts=-1"),
    ({"n_experts": 0, "experts_per_token": 0, "expert_intermediate_size": 128},
     r"expert_intermediate_size=128 .*dense"),
    ({"n_experts": 0, "experts_per_token": 0, "expert_intermediate_size": 0, "routing_skew": 0.5},
     r"routing_skew=0.5"),
    ({"first_dense_layers": 4}, r"first_dense_layers=4 .*n_layers=4"),
    ({"moe_layer_step": 5}, r"moe_layer_step=5 .*at least one MoE layer"),
    ({"moe_layer_step": 0}, r"moe_layer_step=0"),
    ({"routing_skew": -0.1}, r"routing_skew=-0.1"),
    ({"routing_skew": float("nan")}, r"routing_skew=nan"),
    ({"experts_per_token": 8, "routing_skew": 1.0}, r"routing_skew=1.0 .*busiest expert"),
    ({"qk_rope_head_dim": 64}, r"qk_rope_head_dim=64 .*kv_lora_rank"),
    ({"kv_lora_rank": -2}, r"kv_lora_rank=-2"),
    ({"weight_dtype": "int3"}, r"weight_dtype='int3' .*bf16, fp16, fp8, nvfp4, int8, int4"),
    ({"quantized_weights": "attn"}, r"quantized_weights='attn' .*all, mlp"),
    ({"n_params": 1e6}, r"n_params=.*routed experts"),
])
def test_bad_moe_spec_input_is_a_one_line_error_naming_field_and_value(change: dict, match: str) -> None:
    ModelSpec(**_MOE_OK)
    with pytest.raises(ConfigError, match=match) as e:
        ModelSpec(**{**_MOE_OK, **change})
    assert "\n" not in str(e.value)


def test_expert_parallel_on_a_dense_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"expert_parallel=True .*dense model") as e:
        InstanceSpec(get_model("Llama-2-7B"), get_gpu("H100-SXM"), expert_parallel=True)
    assert "\n" not in str(e.value)
    tiny = ModelSpec(**{**_MOE_OK, "n_experts": 2, "experts_per_token": 1})
    with pytest.raises(ConfigError, match=r"expert_parallel=True .*tp=4 .*2 experts") as e:
        InstanceSpec(tiny, get_gpu("H100-SXM"), tp=4, expert_parallel=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"weight_dtype='int3'"):
        InstanceSpec(get_model("Mixtral-8x7B"), get_gpu("H100-SXM"), tp=2, weight_dtype="int3")


# ------------------------------------------------------------------------------ calibration

@pytest.mark.parametrize(("model", "tp"), [("Mixtral-8x7B", 2), ("Llama-4-Scout-17B-16E-FP8", 2)])
def test_calibration_recovers_known_moe_parameters_from_synthetic_step_times(model: str, tp: int) -> None:
    """Step times generated with a known expert efficiency, MBU and MFU (decode batches of 1-128 and
    prefill chunks, as a step trace would give them) are fitted back by the project's least-squares
    calibration (``fit_cost_params``) from the literature defaults."""
    from kvsched.envs.sim.calibration import FitParam, fit_cost_params

    truth = CostParams(mfu_max=0.55, mbu=0.81, moe_efficiency=0.62, step_overhead_s=7e-4)
    batches = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128], dtype=np.float64)
    chunks = np.array([256, 512, 1024, 2048], dtype=np.float64)
    n = np.concatenate([batches, chunks])
    pairs = np.concatenate([batches * 800.0, chunks * (300.0 + chunks / 2.0)])
    kv = np.concatenate([batches * 800.0, chunks + 300.0])
    measured = _cm(model, tp, cost=truth).step_times_fast(n, pairs, kv)

    def residuals(c: CostParams) -> np.ndarray:
        return np.log(_cm(model, tp, cost=c).step_times_fast(n, pairs, kv) / measured)

    start = CostParams(step_overhead_s=7e-4)  # mfu_max 0.6, mbu 0.75, moe_efficiency 1.0
    fit = fit_cost_params(residuals, start, (FitParam("mfu_max", 0.15, 1.0), FitParam("mbu", 0.3, 1.0),
                                             FitParam("moe_efficiency", 0.1, 1.0)),
                          max_nfev=60, loss="linear", diff_step=1e-4, xtol=1e-10, ftol=1e-12)
    for name in ("mfu_max", "mbu", "moe_efficiency"):
        assert fit.values[name] == pytest.approx(getattr(truth, name), rel=1e-3), (name, fit.values)


def test_moe_instance_specs_round_trip_through_dicts_with_inline_models() -> None:
    from kvsched.envs.sim.specs import instance_spec_from_dict, instance_spec_to_dict

    spec = InstanceSpec(get_model("Llama-4-Scout-17B-16E-FP8"), get_gpu("H100-SXM"), tp=2, expert_parallel=True)
    d = instance_spec_to_dict(spec)
    assert d["model"]["n_experts"] == 16 and d["model"]["weight_dtype"] == "fp8" and d["expert_parallel"] is True
    back = instance_spec_from_dict(d)
    assert back == spec
    assert CostModel(back).step_time_fast(9.0, 9e3, 9e3) == CostModel(spec).step_time_fast(9.0, 9e3, 9e3)
    with pytest.raises(ConfigError, match=r"expert_parallel='yes' .*true or false"):
        instance_spec_from_dict({**d, "expert_parallel": "yes"})
    with pytest.raises(ConfigError, match=r"routing_skew"):
        instance_spec_from_dict({**d, "model": {**d["model"], "routing_skew": "lots"}})


@pytest.mark.parametrize("model, tp, quantize_hint", [("DeepSeek-V3", 8, False), ("Llama-3.1-70B", 1, True)])
def test_weights_that_do_not_fit_suggest_fp8_only_for_16_bit_weights(model, tp, quantize_hint):
    """DeepSeek-V3's checkpoint is already FP8: the refusal must not tell the user to use FP8."""
    with pytest.raises(ConfigError, match="do not fit") as e:
        InstanceSpec(model=get_model(model), gpu=get_gpu("H100-SXM"), tp=tp)
    msg = str(e.value)
    assert "\n" not in msg and ("weight_dtype='fp8'" in msg) == quantize_hint and "raise tp" in msg
