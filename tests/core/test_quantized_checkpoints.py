"""INT8 (W8A8) and INT4 (W4A16) weights, Linear-only quantization, and quantized checkpoints of a
16-bit preset resolved by their Hugging Face id (envs/sim/model_spec.py, hardware.py, cost_model.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model

H100, A100 = get_gpu("H100-SXM"), get_gpu("A100-80GB")
COST = CostParams(step_overhead_s=0.0)


@pytest.mark.parametrize("model_id, preset, dtype", [
    ("RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8", "Qwen2.5-7B-INT8", "int8"),
    ("RedHatAI/Qwen2.5-7B-Instruct-quantized.w4a16", "Qwen2.5-7B-INT4", "int4"),
    ("RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic", "Qwen2.5-7B-FP8", "fp8"),
    ("RedHatAI/phi-4-FP8-dynamic", "Phi-4-FP8", "fp8"),
    ("RedHatAI/Llama-3.3-70B-Instruct-quantized.w8a8", "Llama-3.1-70B-INT8", "int8"),
    ("RedHatAI/Mistral-Small-3.1-24B-Instruct-2503-quantized.w4a16", "Mistral-Small-3.1-24B-INT4", "int4"),
])
def test_a_quantized_checkpoint_id_resolves_to_its_16_bit_preset_with_linear_layers_quantized(model_id, preset,
                                                                                                dtype):
    m = get_model(model_id)
    base = get_model(preset.rsplit("-", 1)[0])
    assert (m.name, m.weight_dtype, m.quantized_weights) == (preset, dtype, "linear")
    assert get_model(m.name) == m  # the resolved name resolves again
    assert dataclasses.replace(m, name=base.name, weight_dtype=base.weight_dtype, quantized_weights="all",
                               source=base.source) == base
    # the embedding and lm_head stay 16-bit: 2 x vocab x hidden parameters at 2 bytes
    lm = 2 * m.vocab_size * m.hidden_size
    assert m.weight_bytes(1.0) == pytest.approx((m.n_params - lm) * 1.0 + lm * 2.0)


def test_ids_that_are_not_a_quantized_16_bit_preset_stay_unknown():
    for bad in ("RedHatAI/Unknown-7B-quantized.w8a8", "RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic-int8",
                "acme/model-w4a16"):
        with pytest.raises(UnknownPresetError):
            get_model(bad)
    # a checkpoint that is itself quantized is not quantized again (DeepSeek-V3 is FP8)
    with pytest.raises(UnknownPresetError):
        get_model("deepseek-ai/DeepSeek-V3-quantized.w4a16")


def test_int8_runs_at_twice_the_bf16_peak_and_int4_at_the_bf16_peak_with_quarter_bytes():
    assert H100.peak_flops_per_s("int8") == 2 * H100.bf16_flops_per_s
    assert A100.peak_flops_per_s("int8") == 624e12  # A100 datasheet, INT8 dense
    assert H100.peak_flops_per_s("int4") == H100.bf16_flops_per_s
    m = get_model("Llama-3.1-8B")
    bf16 = InstanceSpec(model=m, gpu=H100, hbm_kv_blocks=1024, cost=COST)
    w8 = InstanceSpec(model=get_model("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8"),
                      gpu=H100, hbm_kv_blocks=1024, cost=COST)
    w4 = bf16.with_overrides(model=get_model("Llama-3.1-8B-INT4"))
    assert w8.kv_bytes_per_block == bf16.kv_bytes_per_block  # KV stays 16-bit (kv_dtype auto)
    # a batch-1 decode step reads the weights: int8 about half the bytes, int4 about a quarter (+ scales)
    step = {s.model.name: float(CostModel(s).decode_step_time_s(1, 512)) for s in (bf16, w8, w4)}
    assert 0.5 < step["Llama-3.1-8B-INT8"] / step["Llama-3.1-8B"] < 0.62
    assert 0.28 < step["Llama-3.1-8B-INT4"] / step["Llama-3.1-8B"] < 0.4
    # a long prefill is compute-bound: int8 runs its decoder Linear layers at the INT8 peak
    prefill = {s.model.name: float(CostModel(s).chunk_time_s(4096, 0)) for s in (bf16, w8, w4)}
    assert prefill["Llama-3.1-8B-INT8"] < 0.7 * prefill["Llama-3.1-8B"]
    # int4 computes at the BF16 peak: a long prefill is as slow, but for the smaller ramp floor
    assert prefill["Llama-3.1-8B-INT4"] == pytest.approx(prefill["Llama-3.1-8B"], rel=0.03)
    assert prefill["Llama-3.1-8B-INT4"] <= prefill["Llama-3.1-8B"]


def test_linear_quantization_of_a_16_bit_dtype_prices_the_step_like_the_unquantized_model():
    """With bf16 weights the Linear-only mode changes neither the bytes nor the FLOPs."""
    m = get_model("Qwen2.5-7B")
    lin = dataclasses.replace(m, quantized_weights="linear")
    a, b = (CostModel(InstanceSpec(model=x, gpu=H100, hbm_kv_blocks=1024, cost=COST)) for x in (m, lin))
    for n, pairs, kv in ((1, 500, 500), (64, 64 * 900, 64 * 900), (2048, 2048 * 1024, 2048)):
        assert float(b.step_time_s(n, pairs, kv)) == pytest.approx(float(a.step_time_s(n, pairs, kv)), rel=1e-12)


def test_a_bad_weight_dtype_or_quantized_layer_set_names_the_field():
    m = get_model("Qwen2.5-7B")
    with pytest.raises(ConfigError, match="quantized_weights"):
        dataclasses.replace(m, quantized_weights="attention")
    with pytest.raises(ConfigError, match="weight_dtype.*int8, int4"):
        InstanceSpec(model=m, gpu=H100, weight_dtype="int3")


def test_every_quantized_checkpoint_id_names_a_model_that_resolves_to_the_same_spec():
    """A resolved name is written into specs, scenarios and results and read back by name: it must
    give the same model. Llama-4-Scout's FP8 checkpoints once resolved to a Linear-quantized
    "Llama-4-Scout-17B-16E-FP8" whose name is the MLP-quantized preset's."""
    from kvsched.envs.sim.model_spec import MODEL_ALIASES, MODEL_PRESETS, QUANTIZED_CHECKPOINT_SUFFIXES

    resolved = 0
    for base in (*MODEL_PRESETS, *MODEL_ALIASES):
        for suffix, _ in QUANTIZED_CHECKPOINT_SUFFIXES:
            try:
                m = get_model(base + suffix)
            except UnknownPresetError:
                continue
            resolved += 1
            assert get_model(m.name) == m, base + suffix
    assert resolved > 100
    assert get_model("meta-llama/Llama-4-Scout-17B-16E-Instruct-FP8") == get_model("Llama-4-Scout-17B-16E-FP8")


@pytest.mark.parametrize("quantized_weights, match", [
    ("linear", r"'linear'-quantized weights \(-5\.8e\+04\) lie in \(0, 6000\]"),
    ("mlp", r"'mlp'-quantized weights \(4\.915e\+04\) lie in \(0, 6000\]"),
])
def test_a_quantized_share_outside_the_matmul_weights_is_refused_naming_n_params(quantized_weights, match):
    """n_params just above the embedding passes the embedding floor, but leaves the lm_head
    ("linear") or the MLPs ("mlp") more weights than the model has: int8 weights then weighed
    more than bf16 ones."""
    from kvsched.envs.sim.specs import ModelSpec

    with pytest.raises(ConfigError, match=r"ModelSpec\('tiny'\)\.n_params=70000 is not allowed: .*" + match) as e:
        ModelSpec("tiny", 2, 64, 4, 4, 16, 128, 1000, 70000, 512, "test", weight_dtype="int8",
                  quantized_weights=quantized_weights)
    assert "\n" not in str(e.value)


def test_an_unknown_model_error_says_hugging_face_ids_and_quantized_suffixes_are_names_too():
    """`RedHatAI/...-quantized.w8a16` (weight-only int8, not modelled) listed only the preset names,
    leaving a user to guess that Hugging Face ids and -quantized.w8a8 / .w4a16 ids resolve."""
    with pytest.raises(UnknownPresetError) as e:
        get_model("RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a16")
    msg = str(e.value)
    assert "known: " in msg and "Qwen2.5-7B" in msg and "Hugging Face ids" in msg
    assert "-quantized.w8a8 (int8)" in msg and "-quantized.w4a16 (int4)" in msg and "\n" not in msg


def test_weight_only_int4_streams_its_smaller_weights_at_small_batches_like_marlin():
    """The MFU ramp's floor scales with the bytes per weight for weight-only dtypes, so on the A100
    calibration an int4 GEMM step is memory-bound at a few tokens: ~3.9x faster than bf16 up to 16
    tokens and ~1.5x at 128 (Marlin's measured speedup shape, PPoPP 2025); W8A8 dtypes and 16-bit
    weights keep the calibrated ramp."""
    m = get_model("Llama-3.1-8B")
    bf16 = InstanceSpec(model=m, gpu=A100, hbm_kv_blocks=1024)  # the shipped A100 calibration
    w4 = bf16.with_overrides(weight_dtype="int4")  # every weight int4: the GEMM ratio alone

    def kernel_s(spec, n):
        b = CostModel(spec).step_breakdown(n, 0, 0)
        return max(float(b["compute_s"]), float(b["memory_s"]))

    assert 3.5 < kernel_s(bf16, 1) / kernel_s(w4, 1) < 4.0
    assert 3.5 < kernel_s(bf16, 16) / kernel_s(w4, 16) < 4.0
    assert 1.3 < kernel_s(bf16, 128) / kernel_s(w4, 128) < 1.7
    for dtype, gpu in (("bf16", A100), ("int8", A100), ("fp8", H100), ("int8", H100)):
        assert CostModel(bf16.with_overrides(gpu=gpu, weight_dtype=dtype, cost=bf16.cost_params))._ramp_discount == 0
    # fp8 on the A100 (no FP8 tensor cores) is weight-only too: its floor is half the bf16 one
    assert 1.8 < kernel_s(bf16, 16) / kernel_s(bf16.with_overrides(weight_dtype="fp8"), 16) <= 2.0


def test_weight_only_ramp_scaling_reaches_only_the_quantized_weights():
    """Scaling the ramp's half-point by bytes/2 stands for streaming fewer bytes per weight: it
    applies to the quantized weights only. A "linear" int4 checkpoint's bf16 lm_head and the
    attention's query x context FLOPs keep the calibrated h (the docs: the bf16 lm_head does not
    run faster); the routed experts of an int4 MoE take h·bytes/2."""
    w4 = InstanceSpec(model=get_model("Llama-3.1-8B-INT4"), gpu=A100, hbm_kv_blocks=1024)
    cm, m = CostModel(w4), w4.model
    h, eff = w4.cost_params.mfu_half_tokens, A100.bf16_flops_per_s * w4.cost_params.mfu_max
    hq = h * w4.weight_dtype_bytes / 2  # int4 with its group scales: ~h/4
    p16 = m.lm_head_params
    pq = m.matmul_params - p16
    for n in (1.0, 16.0, 128.0):
        want = (2 * pq * (n + hq) + 2 * p16 * (n + h)) / eff
        assert float(cm.step_breakdown(n, 0, 0)["compute_s"]) == pytest.approx(want, rel=1e-12)
    every = CostModel(w4.with_overrides(model=get_model("Llama-3.1-8B"), weight_dtype="int4"))
    n, pairs = 8.0, 8 * 4000.0
    attn = every.step_breakdown(n, pairs, 0)["compute_s"] - every.step_breakdown(n, 0, 0)["compute_s"]
    assert float(attn) == pytest.approx(every.attn_flops_per_pair_per_gpu * pairs * (n + h) / (eff * n), rel=1e-9)
    moe = InstanceSpec(model=get_model("Mixtral-8x7B"), gpu=A100, tp=2, weight_dtype="int4", hbm_kv_blocks=1024)
    mcm = CostModel(moe)
    g, d = 8.0, mcm.distinct_experts(8.0)
    x_compute, _ = mcm._moe_extra(8.0)
    k, hq = moe.model.experts_per_token, h * moe.weight_dtype_bytes / 2
    assert x_compute == pytest.approx(mcm._expert_flops_coef * (k * g + hq * d) / mcm._expert_eff_flops, rel=1e-12)


def _weight_only_specs() -> list[InstanceSpec]:
    from kvsched.envs.sim.parallelism import ParallelSpec
    from kvsched.envs.sim.specs import get_pnm

    dense = InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=A100, hbm_kv_blocks=1024)
    return [
        dense.with_overrides(model=get_model("Llama-3.1-8B-INT4")),  # linear: bf16 lm_head
        dense.with_overrides(weight_dtype="fp8"),  # weight-only fp8 on the A100
        dense.with_overrides(weight_dtype="int4", pnm=get_pnm("cxl-pnm-ocp2025")),
        dense.with_overrides(weight_dtype="int4", parallel=ParallelSpec(pp_stages=2, kvp_groups=2)),
        InstanceSpec(model=get_model("Mixtral-8x7B"), gpu=A100, tp=2, weight_dtype="int4", hbm_kv_blocks=1024),
        InstanceSpec(model=get_model("Mixtral-8x7B"), gpu=A100, tp=2, weight_dtype="int4", hbm_kv_blocks=1024,
                     expert_parallel=True),
    ]


@pytest.mark.parametrize("i", range(6))
def test_weight_only_step_prices_stay_bitwise_equal_across_paths_and_monotone(i):
    """Every step path prices a weight-only quantized step alike, to the bit (the simulator's
    fast-forward relies on it), and a batch of like decodes costs no less with more of them."""
    import numpy as np

    spec = _weight_only_specs()[i]
    cm = CostModel(spec)
    rng = np.random.default_rng(i)
    n = rng.integers(1, 4096, 200).astype(float)
    pairs = rng.integers(0, 10**8, 200) / 2.0
    kv = rng.integers(0, 10**6, 200).astype(float)
    ref = cm.step_time_s(n, pairs, kv)
    assert np.array_equal(ref, [cm.step_time_fast(a, b, c) for a, b, c in zip(n, pairs, kv)])
    assert np.array_equal(ref, cm.step_times_fast(n, pairs, kv))
    for b, c0 in ((1, 0), (37, 123_457), (256, 2_000_000)):
        ctx = c0 + b * np.arange(30, dtype=float)
        steps = cm.decode_step_times_fast(b, ctx)
        if cm.parallel is None:
            assert np.array_equal(steps, cm.step_time_s(np.full(30, float(b)), ctx, ctx, n_seqs=float(b)))
            assert np.array_equal(steps, [cm.plan_step_time_s(b, int(c), []) for c in ctx])
        e, ends = 0.5, []
        for s in steps:
            e += float(s)
            ends.append(e)
        assert cm.decode_step_ends(0.5, b, c0, 30) == ends
    if spec.pnm is not None:
        pk, npnm = rng.integers(0, 10**6, 200).astype(float), rng.integers(0, 50, 200).astype(float)
        arr = cm.pnm_step_times_fast(n, pairs, kv, pk, npnm)
        assert np.array_equal(arr, [cm.pnm_step_time_fast(*v) for v in zip(n, pairs, kv, pk, npnm)])
    like = [float(cm.decode_step_times_fast(b, np.array([b * 3000.0]))[0]) for b in range(1, 300)]
    assert all(x <= y for x, y in zip(like, like[1:]))


def test_the_weight_only_scaling_leaves_16_bit_and_w8a8_step_prices_unchanged_to_the_bit():
    """bf16, W8A8 int8 and fp8 on a GPU with FP8 tensor cores price a step with the calibrated ramp
    exactly as before the weight-only scaling: FLOPs·(n + h)/(F·mfu_max·n)."""
    for spec in (InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=A100, hbm_kv_blocks=1024),
                 InstanceSpec(model=get_model("Llama-3.1-8B-INT8"), gpu=A100, hbm_kv_blocks=1024),
                 InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=H100, weight_dtype="fp8", hbm_kv_blocks=1024)):
        cm = CostModel(spec)
        h = spec.cost_params.mfu_half_tokens
        for n, pairs in ((1.0, 4000.0), (100.0, 3e5), (2048.0, 2e6)):
            flops = cm._lin_flops_per_token * n + cm.attn_flops_per_pair_per_gpu * pairs
            assert cm.step_breakdown(n, pairs, 0)["compute_s"] == flops * (n + h) / (cm._eff_flops * n)
