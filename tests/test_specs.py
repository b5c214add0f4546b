"""Tests of model/GPU/link presets, InstanceSpec derivation and validation, and YAML round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.specs import (
    GPU_PRESETS,
    LINK_PRESETS,
    MODEL_PRESETS,
    CostParams,
    InstanceSpec,
    LinkSpec,
    ModelSpec,
    get_gpu,
    get_link,
    get_model,
    instance_spec_from_dict,
    instance_spec_to_dict,
    load_instance_spec,
    presets_rows,
    save_instance_spec,
)

GROUNDTRUTH = Path(__file__).resolve().parents[2] / "shared" / "groundtruth"


def _spec(model: str, gpu: str = "H100-SXM", **kw: object) -> InstanceSpec:
    return InstanceSpec(get_model(model), get_gpu(gpu), **kw)


# REFERENCE §5.1 "KV/token bf16" column
@pytest.mark.parametrize(
    ("model", "kv_bytes"),
    [("Llama-3.1-8B", 131_072), ("Llama-3.1-70B", 327_680), ("Llama-3.1-405B", 516_096),
     ("Qwen2.5-7B", 57_344), ("Qwen2.5-72B", 327_680)],
)
def test_kv_bytes_per_token_matches_reference_table(model: str, kv_bytes: int) -> None:
    assert get_model(model).kv_bytes_per_token(2.0) == kv_bytes
    assert get_model(model).kv_bytes_per_token(1.0) == kv_bytes / 2


# REFERENCE §5.1 params and attention FLOPs per pair
@pytest.mark.parametrize(
    ("model", "params", "attn"),
    [("Llama-3.1-8B", 8.03e9, 524_288), ("Llama-3.1-70B", 70.6e9, 2.62e6), ("Qwen2.5-7B", 7.62e9, 401_408),
     ("Qwen2.5-72B", 72.7e9, 2.62e6), ("Llama-3.1-405B", 405.9e9, 8.26e6)],
)
def test_params_and_attention_flops_match_reference(model: str, params: float, attn: float) -> None:
    m = get_model(model)
    assert m.n_params == pytest.approx(params, rel=2e-3)
    assert m.attn_flops_per_pair == pytest.approx(attn, rel=5e-3)


def test_params_consistent_with_architecture() -> None:
    # dense Llama/Qwen/Mistral/Yi block: q,o: h*(H*d); k,v: h*(kv*d); MLP 3*h*ff; 2 norms; + untied
    # embedding and lm_head + final norm (+ QKV bias for Qwen2.5)
    for m in MODEL_PRESETS.values():
        q, k = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        bias = (q + 2 * k) if m.name.startswith("Qwen") else 0
        layer = 2 * m.hidden_size * q + 2 * m.hidden_size * k + bias + 3 * m.hidden_size * m.intermediate_size
        total = m.n_layers * (layer + 2 * m.hidden_size) + 2 * m.vocab_size * m.hidden_size + m.hidden_size
        assert m.n_params == total, m.name
        assert m.matmul_params == m.n_params - m.vocab_size * m.hidden_size


def test_llama2_presets_from_brief() -> None:
    m7 = get_model("Llama-2-7B")
    assert (m7.n_layers, m7.hidden_size, m7.n_heads, m7.n_kv_heads, m7.head_dim) == (32, 4096, 32, 32, 128)
    assert (m7.intermediate_size, m7.vocab_size, m7.max_context_tokens) == (11008, 32000, 4096)
    assert m7.n_params == pytest.approx(6.74e9, rel=1e-3)
    m70 = get_model("Llama-2-70B")
    assert (m70.n_layers, m70.hidden_size, m70.n_heads, m70.n_kv_heads) == (80, 8192, 64, 8)
    assert m70.n_params == pytest.approx(68.98e9, rel=1e-3)
    assert get_model("Qwen2.5-7B").max_context_tokens == 32768
    assert get_model("Llama-3.1-70B").max_context_tokens == 131072


# Real vLLM `total_kv_blocks` (groundtruth blis/trained_physics_iter29_experiments.json), H100, 0.9
def test_hbm_blocks_llama2_7b_matches_vllm() -> None:
    blocks = _spec("Llama-2-7B").num_hbm_blocks
    assert abs(blocks - 7463) / 7463 < 0.02


def test_hbm_blocks_qwen25_7b_matches_vllm() -> None:
    blocks = _spec("Qwen2.5-7B").num_hbm_blocks
    assert abs(blocks - 65352) / 65352 < 0.03


def test_hbm_blocks_match_every_groundtruth_run_we_have_a_preset_for() -> None:
    path = GROUNDTRUTH / "blis" / "trained_physics_iter29_experiments.json"
    if not path.exists():
        pytest.skip(f"{path} not available")
    data = json.loads(path.read_text())
    exps = data.get("experiments", data) if isinstance(data, dict) else data
    checked = 0
    for e in (exps.values() if isinstance(exps, dict) else exps):
        if not isinstance(e, dict) or "total_kv_blocks" not in e:
            continue
        try:
            model = get_model(e["model"])
        except UnknownPresetError:
            continue  # e.g. Llama-4-Scout (MoE) has no preset
        spec = InstanceSpec(model, get_gpu(e["hardware"]), tp=e["tp"])
        assert abs(spec.num_hbm_blocks - e["total_kv_blocks"]) / e["total_kv_blocks"] < 0.02, e["id"]
        checked += 1
    assert checked >= 6


def test_hbm_block_formula() -> None:
    s = _spec("Llama-3.1-8B", gpu_memory_utilization=0.8, activation_reserve_bytes=2e9)
    expected = math.floor((0.8 * 80 * 2**30 - 8_030_261_248 * 2 - 2e9) / (131_072 * 16))
    assert s.num_hbm_blocks == expected
    assert _spec("Llama-3.1-8B", hbm_kv_blocks=1234).num_hbm_blocks == 1234


def test_tp_shards_kv_and_weights() -> None:
    s = _spec("Llama-3.1-70B", tp=4)
    assert s.kv_bytes_per_block == 327_680 * 16
    assert s.kv_bytes_per_block_per_gpu == 327_680 * 16 / 4
    assert s.weight_bytes_per_gpu == pytest.approx(70_553_706_496 * 2 / 4)


def test_kv_heads_replicated_when_tp_exceeds_kv_heads() -> None:
    s = _spec("Qwen2.5-72B", tp=8)  # 8 kv heads: sharded, one per rank
    assert s.kv_bytes_per_block_per_gpu == s.kv_bytes_per_block / 8
    m = ModelSpec("tiny-gqa", 4, 1024, 16, 2, 64, 4096, 1000, 60e6, 2048)
    s = InstanceSpec(m, get_gpu("H100-SXM"), tp=8)  # 2 kv heads on 8 ranks: one head each
    assert s.kv_bytes_per_block_per_gpu == s.kv_bytes_per_block / 2


def test_fp8_kv_halves_bytes() -> None:
    bf16, fp8 = _spec("Llama-3.1-8B"), _spec("Llama-3.1-8B", kv_dtype="fp8")
    assert fp8.kv_dtype_bytes == 1.0 and bf16.kv_dtype_bytes == 2.0
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    assert fp8.num_hbm_blocks == pytest.approx(2 * bf16.num_hbm_blocks, abs=1)


def test_weights_that_do_not_fit_raise_with_model_name() -> None:
    with pytest.raises(ConfigError) as info:
        _spec("Llama-3.1-70B", tp=1)
    msg = str(info.value)
    assert "Llama-3.1-70B" in msg and "H100-SXM" in msg and "tp" in msg and "GB" in msg


def test_kv_capacity_below_one_block_raises() -> None:
    # Llama-2-70B at tp=2 on H100: 69 GB of weights per GPU leave ~8.3 GB of the 77.3 GB usable
    ok = _spec("Llama-2-70B", tp=2)
    left = 0.9 * 80 * 2**30 - ok.weight_bytes_per_gpu
    one = ok.kv_bytes_per_block_per_gpu
    assert _spec("Llama-2-70B", tp=2, activation_reserve_bytes=left - 1.5 * one).num_hbm_blocks == 1
    with pytest.raises(ConfigError, match="below one block"):
        _spec("Llama-2-70B", tp=2, activation_reserve_bytes=left - 0.5 * one)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(UnknownPresetError) as info:
        get_model("llama-9b")
    msg = str(info.value)
    assert "llama-9b" in msg and all(name in msg for name in MODEL_PRESETS)
    with pytest.raises(UnknownPresetError, match="H100-SXM"):
        get_gpu("TPU-v5")
    with pytest.raises(UnknownPresetError, match="pcie5"):
        get_link("cxl")


def test_lookup_is_case_insensitive_and_knows_aliases() -> None:
    assert get_model("llama-3.1-8b") is MODEL_PRESETS["Llama-3.1-8B"]
    assert get_model("meta-llama/Llama-2-7b-hf") is MODEL_PRESETS["Llama-2-7B"]
    assert get_gpu("h100") is GPU_PRESETS["H100-SXM"]
    assert get_link("PCIE4") is LINK_PRESETS["pcie4"]


def test_yaml_round_trip(tmp_path: Path) -> None:
    spec = _spec("Qwen2.5-7B", gpu="A100-80GB", tp=2, kv_dtype="fp8", dram_kv_bytes=64e9, nvme_kv_bytes=1e12,
                 preemption_mode="swap", max_num_batched_tokens=1024, max_num_seqs=128, max_model_len=8192,
                 nvme_read=get_link("nvme_gen5_read"), cost=CostParams(mfu_max=0.5, step_overhead_s=2e-3))
    path = tmp_path / "inst.yaml"
    save_instance_spec(spec, path)
    back = load_instance_spec(path)
    assert back == spec
    assert back.num_hbm_blocks == spec.num_hbm_blocks and back.num_dram_blocks == spec.num_dram_blocks
    assert instance_spec_to_dict(back) == instance_spec_to_dict(spec)
    # the file is self-contained: the model is written inline
    assert "n_layers" in path.read_text()


def test_from_dict_accepts_preset_names_and_inline_specs() -> None:
    d = {"model": "Llama-3.1-8B", "gpu": "H100", "pcie": "pcie4"}
    s = instance_spec_from_dict(d)
    assert s.model is MODEL_PRESETS["Llama-3.1-8B"] and s.pcie == LINK_PRESETS["pcie4"]
    inline = instance_spec_to_dict(s)["model"]
    inline["name"] = "my-8b"
    s2 = instance_spec_from_dict({"model": inline, "gpu": "H100-SXM"})
    assert s2.model.name == "my-8b" and s2.kv_bytes_per_token == s.kv_bytes_per_token


def test_from_dict_unknown_key_names_key_source_and_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "tpp": 2}, source="scen.yaml")
    msg = str(info.value)
    assert "'tpp'" in msg and "scen.yaml" in msg and "max_num_seqs" in msg
    with pytest.raises(ConfigError, match="bogus"):
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "cost": {"bogus": 1}})


def test_from_dict_wrong_types_raise() -> None:
    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"}
    for key, value in [("tp", "2"), ("tp", 2.0), ("enable_prefix_caching", "yes"), ("gpu_memory_utilization", "lots"),
                       ("kv_dtype", 8), ("model", 3)]:
        with pytest.raises(ConfigError, match=key):
            instance_spec_from_dict({**base, key: value}, source="x.yaml")


def test_invalid_kv_dtype_names_field_and_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        _spec("Llama-3.1-8B", kv_dtype="int4")
    msg = str(info.value)
    assert "kv_dtype" in msg and "int4" in msg and "fp8" in msg and "auto" in msg


def test_max_model_len_over_capacity_raises() -> None:
    with pytest.raises(ConfigError, match="KV cache can hold only"):
        _spec("Llama-3.1-8B", hbm_kv_blocks=100, max_model_len=4096)
    s = _spec("Llama-3.1-8B", hbm_kv_blocks=100)
    assert s.model_len_limit == 1600
    assert _spec("Llama-3.1-8B").model_len_limit == 131072
    assert _spec("Llama-3.1-8B", max_model_len=4096).model_len_limit == 4096


def test_token_budget_and_max_seqs_defaults() -> None:
    h100 = _spec("Llama-3.1-8B")
    a100 = _spec("Llama-3.1-8B", gpu="A100-80GB")
    l40s = _spec("Llama-3.1-8B", gpu="L40S")
    assert (h100.token_budget, h100.max_seqs) == (8192, 1024)
    assert (a100.token_budget, a100.max_seqs) == (2048, 256)
    assert (l40s.token_budget, l40s.max_seqs) == (2048, 256)
    s = _spec("Llama-3.1-8B", max_num_batched_tokens=512, max_num_seqs=64)
    assert (s.token_budget, s.max_seqs) == (512, 64)


def test_chunked_prefill_off_needs_budget_at_least_model_len() -> None:
    with pytest.raises(ConfigError, match="enable_chunked_prefill"):
        _spec("Llama-2-7B", enable_chunked_prefill=False, max_num_batched_tokens=2048)
    ok = _spec("Llama-2-7B", enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert ok.token_budget == 4096
    assert _spec("Llama-2-7B", enable_chunked_prefill=False).token_budget == 8192  # max(4096, default)


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"tp": 3}, "tp"), ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
     ({"preemption_mode": "swap"}, "dram_kv_bytes"), ({"preemption_mode": "offload"}, "nvme_kv_bytes"),
     ({"preemption_mode": "drop"}, "preemption_mode"), ({"weight_dtype": "int8"}, "weight_dtype"),
     ({"max_num_partial_prefills": 1, "max_long_partial_prefills": 2}, "max_long_partial_prefills"),
     ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
     ({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size_tokens": 0}, "block_size_tokens")],
)
def test_invalid_instance_values_raise(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _spec("Llama-3.1-8B", **kw)


def test_tp_must_divide_heads() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        _spec("Qwen2.5-7B", tp=8)  # 28 heads


def test_swap_and_offload_with_tiers() -> None:
    s = _spec("Llama-3.1-8B", preemption_mode="swap", dram_kv_bytes=10 * 131_072 * 16 + 5)
    assert s.num_dram_blocks == 10 and s.num_nvme_blocks == 0
    assert _spec("Llama-3.1-8B", preemption_mode="offload", nvme_kv_bytes=1e12).num_nvme_blocks > 0


def test_cost_params_validation() -> None:
    for kw in ({"mfu_max": 0.0}, {"mfu_max": 1.5}, {"mbu": 0.0}, {"mfu_half_tokens": -1.0},
               {"step_overhead_s": -1e-3}, {"allreduce_latency_s": float("nan")}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            CostParams(**kw)


def test_link_transfer_time() -> None:
    lk = LinkSpec("x", 2e9, 5e-6)
    assert lk.transfer_time_s(4e9) == pytest.approx(5e-6 + 2.0)
    assert lk.transfer_time_s(0) == 0.0
    assert list(lk.transfer_time_s([0.0, 2e9])) == [0.0, pytest.approx(1.0 + 5e-6)]


def test_pcie_default_follows_gpu() -> None:
    h100 = _spec("Llama-3.1-8B")
    assert h100.pcie.bytes_per_s == 50e9 and h100.pcie.latency_s == 10e-6
    a100 = h100.with_overrides(gpu=get_gpu("A100-80GB"))
    assert a100.pcie.bytes_per_s == 25e9
    fixed = h100.with_overrides(pcie=get_link("pcie4")).with_overrides(gpu=get_gpu("H200"))
    assert fixed.pcie == LINK_PRESETS["pcie4"]
    with pytest.raises(ConfigError, match="tpp"):
        h100.with_overrides(tpp=2)


def test_presets_rows() -> None:
    rows = presets_rows()
    assert set(rows) == {"models", "gpus", "links", "pnm"}
    pnm = {r["name"]: r for r in rows["pnm"]}
    assert pnm["cxl-pnm-ocp2025-x10"]["mem_TB_per_s"] == 2.0 and pnm["cxl-pnm-ocp2025"]["capacity_TB"] == 4.0
    by_name = {r["name"]: r for r in rows["models"]}
    assert by_name["Llama-3.1-8B"]["kv_bytes_per_token_bf16"] == 131_072
    assert by_name["Llama-3.1-8B"]["weights_GB_bf16"] == pytest.approx(16.1)
    assert len(rows["gpus"]) == len(GPU_PRESETS) and len(rows["links"]) == len(LINK_PRESETS)
