"""A ModelSpec from a Hugging Face config.json (envs/sim/hf_config.py) and tied embeddings.

The parameter count of every preset was computed by hand from its model's config and checked
against the published total; the loader must reproduce it from the same config keys, family by
family (biases, QK norms, tied embeddings, routers, shared experts, latent attention). Features
kvsched does not model are refused by name, never dropped.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.envs.sim.hf_config import FAMILIES, MAX_CONFIG_BYTES, model_from_hf_config, read_hf_config
from kvsched.envs.sim.model_spec import MODEL_PRESETS, ModelSpec, get_model

FAMILY_OF = {
    "Llama-2-7B": "llama", "Llama-2-70B": "llama", "Llama-3.1-8B": "llama", "Llama-3.1-70B": "llama",
    "Llama-3.1-405B": "llama", "Yi-34B": "llama", "CodeLlama-34B": "llama", "Qwen2.5-7B": "qwen2",
    "Qwen2.5-72B": "qwen2", "Qwen2.5-3B": "qwen2", "Mistral-Nemo-12B": "mistral", "Mistral-Small-24B": "mistral",
    "Mistral-Small-3.1-24B": "mistral", "Qwen3-14B": "qwen3", "Phi-4": "phi3", "Granite-3.1-8B": "granite",
    "SmolLM3-3B": "smollm3", "Llama-4-Maverick-17B-128E": "llama4_text", "Llama-4-Maverick-17B-128E-FP8": "llama4_text",
    "Mixtral-8x7B": "mixtral", "Mixtral-8x22B": "mixtral", "Qwen3-30B-A3B": "qwen3_moe",
    "Llama-4-Scout-17B-16E": "llama4_text", "Llama-4-Scout-17B-16E-FP8": "llama4_text",
    "DeepSeek-V2-Lite": "deepseek_v2", "DeepSeek-V3": "deepseek_v3",
}


def config_of(m: ModelSpec) -> dict:
    """The config.json keys of preset ``m`` (its model's published config, as the preset records it)."""
    family = FAMILY_OF[m.name]
    cfg = {"model_type": family, "hidden_size": m.hidden_size, "num_hidden_layers": m.n_layers,
           "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
           "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
           "max_position_embeddings": m.max_context_tokens, "tie_word_embeddings": m.tied_embeddings,
           "torch_dtype": "bfloat16"}
    if family == "mistral":
        cfg.update(sliding_window=None)  # their configs say null (MistralConfig's default is 4096)
    if family in ("mixtral",):
        cfg.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token)
    if family == "qwen3_moe":
        cfg.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.expert_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "llama4_text":
        cfg.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                   intermediate_size=m.expert_intermediate_size, intermediate_size_mlp=m.intermediate_size,
                   interleave_moe_layer_step=m.moe_layer_step)
        cfg = {"model_type": "llama4", "text_config": cfg}
    if family.startswith("deepseek"):
        del cfg["head_dim"]
        cfg.update(n_routed_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                   moe_intermediate_size=m.expert_intermediate_size, n_shared_experts=m.n_shared_experts,
                   first_k_dense_replace=m.first_dense_layers, moe_layer_freq=1, kv_lora_rank=m.kv_lora_rank,
                   qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=128, v_head_dim=128,
                   q_lora_rank=1536 if family == "deepseek_v3" else None)
    return cfg


ARCHITECTURE = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                "n_params", "max_context_tokens", "n_experts", "experts_per_token", "expert_intermediate_size",
                "n_shared_experts", "first_dense_layers", "moe_layer_step", "kv_lora_rank", "qk_rope_head_dim",
                "tied_embeddings")


@pytest.mark.parametrize("name", sorted(FAMILY_OF))
def test_the_config_of_every_preset_gives_its_hand_checked_parameter_count(name):
    preset = MODEL_PRESETS[name]
    m = model_from_hf_config(config_of(preset), name)
    assert {f: getattr(m, f) for f in ARCHITECTURE} == {f: getattr(preset, f) for f in ARCHITECTURE}
    assert m.kv_bytes_per_token(2) == preset.kv_bytes_per_token(2)
    assert m.active_params == pytest.approx(preset.active_params, rel=0, abs=0)


def test_every_preset_is_covered_by_the_loader_check():
    assert set(FAMILY_OF) == set(MODEL_PRESETS)


def test_a_tied_lm_head_is_stored_once_and_still_read_as_a_matmul():
    granite = get_model("ibm-granite/granite-3.1-8b-instruct")
    untied = dataclasses.replace(granite, tied_embeddings=False,
                                 n_params=granite.n_params + granite.vocab_size * granite.hidden_size)
    assert granite.matmul_params == untied.matmul_params == granite.n_params  # the lm_head matmul stays
    assert untied.weight_bytes(2.0) - granite.weight_bytes(2.0) == 2.0 * granite.vocab_size * granite.hidden_size
    assert granite.active_params == granite.n_params  # 8.17 B, the published total
    assert get_model("Qwen/Qwen2.5-3B-Instruct").n_params == 3_085_938_688  # 3.09 B (2.77 B without embedding)
    with pytest.raises(ConfigError, match="tied_embeddings"):
        dataclasses.replace(granite, tied_embeddings=1)


def test_quantized_checkpoints_of_tied_presets_keep_the_shared_table_in_bf16():
    int4 = get_model("RedHatAI/granite-3.1-8b-instruct-quantized.w4a16")
    base = get_model("Granite-3.1-8B")
    table = base.vocab_size * base.hidden_size
    assert int4.quantized_params == base.n_params - table
    assert int4.weight_bytes(0.515625) == pytest.approx(table * 2 + (base.n_params - table) * 0.515625)


def test_bias_norm_and_tie_keys_change_the_count_as_the_families_build_their_weights():
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    plain = model_from_hf_config(base, "t").n_params
    q_out, kv_out = 64, 32
    assert model_from_hf_config({**base, "attention_bias": True}, "t").n_params == plain + 2 * (q_out + 2 * kv_out + 64)
    assert model_from_hf_config({**base, "mlp_bias": True}, "t").n_params == plain + 2 * (2 * 128 + 64)
    assert model_from_hf_config({**base, "tie_word_embeddings": True}, "t").n_params == plain - 100 * 64
    qwen2 = model_from_hf_config({**base, "model_type": "qwen2"}, "t").n_params
    assert qwen2 == plain + 2 * (q_out + 2 * kv_out)  # q/k/v biases, no o_proj bias
    qwen3 = model_from_hf_config({**base, "model_type": "qwen3"}, "t").n_params
    assert qwen3 == plain + 2 * 2 * 16  # q_norm and k_norm over head_dim 16
    gemma = model_from_hf_config({**base, "model_type": "gemma"}, "t")
    assert gemma.tied_embeddings and gemma.n_params == plain - 100 * 64  # GemmaConfig ties by default
    assert model_from_hf_config({k: v for k, v in base.items() if k != "num_key_value_heads"}, "t").n_kv_heads == 4


def test_qwen2_moe_shared_expert_and_sparse_step_are_read():
    cfg = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 100, "max_position_embeddings": 512,
           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 64, "decoder_sparse_step": 2}
    m = model_from_hf_config(cfg, "qmoe")
    assert (m.n_experts, m.n_shared_experts, m.moe_layer_step, m.n_moe_layers) == (8, 2, 2, 2)
    attention = 4 * 64 * 64 + 3 * 64  # q, k, v, o + q/k/v biases
    moe_layer = 10 * 3 * 64 * 32 + 64 * 8 + 64  # experts + shared, router, shared_expert_gate
    dense_layer = 3 * 64 * 256
    assert m.n_params == 2 * 100 * 64 + 4 * (attention + 128) + 2 * moe_layer + 2 * dense_layer + 64
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=48"):
        model_from_hf_config({**cfg, "shared_expert_intermediate_size": 48}, "q")
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        model_from_hf_config({**cfg, "mlp_only_layers": [0]}, "q")


LLAMA4_FP8_QUANT = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
    "ignore": ["vision_model.model.layers.0.self_attn.q_proj", "multi_modal_projector.linear_1",
               "language_model.model.layers.0.self_attn.q_proj", "language_model.model.layers.0.feed_forward.router",
               "language_model.lm_head"],
}


def _llm_compressor(weights: dict, acts: dict | None, ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": list(ignore)}


@pytest.mark.parametrize("quant, dtype, which", [
    (LLAMA4_FP8_QUANT, "fp8", "mlp"),
    (_llm_compressor({"num_bits": 8, "type": "float"}, {"num_bits": 8, "type": "float"}), "fp8", "linear"),
    (_llm_compressor({"num_bits": 8, "type": "int"}, {"num_bits": 8, "type": "int"}), "int8", "linear"),
    (_llm_compressor({"num_bits": 4, "type": "int", "group_size": 128}, None), "int4", "linear"),
    (_llm_compressor({"num_bits": 4, "type": "float", "group_size": 16}, {"num_bits": 4, "type": "float"}),
     "nvfp4", "linear"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", "linear"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,  # Meta's -FP8 checkpoints
      "modules_to_not_convert": ["language_model.model.layers.0.self_attn", "language_model.lm_head",
                                 "language_model.model.layers.1.feed_forward.router", "vision_model"]}, "fp8", "mlp"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4", "linear"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "nvfp4", "linear"),
])
def test_quantization_config_sets_the_weight_dtype_and_which_weights_it_covers(quant, dtype, which):
    cfg = {**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": quant}
    m = model_from_hf_config(cfg, "q")
    assert (m.weight_dtype, m.quantized_weights) == (dtype, which)


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 8}, "8-bit weight-only"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    (_llm_compressor({"num_bits": 8, "type": "int"}, None), "without quantized activations"),
    (_llm_compressor({"num_bits": 8, "type": "float"}, {"num_bits": 8, "type": "float"},
                     ignore=["model.layers.0.mlp.down_proj"]), "down_proj"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "one quantization group"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo"),
    # weight-only float schemes run 16-bit GEMMs in vLLM (Marlin); fp8/nvfp4 would price them at the FP8/FP4 peak
    (_llm_compressor({"num_bits": 8, "type": "float"}, None), "weight-only FP8"),
    (_llm_compressor({"num_bits": 4, "type": "float", "group_size": 16}, None), "weight-only NVFP4A16"),
])
def test_quantization_kvsched_does_not_model_is_refused_by_name(quant, match):
    with pytest.raises(ConfigError, match=match):
        model_from_hf_config({**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": quant}, "q")


def test_a_sliding_window_on_every_layer_caps_the_context_and_partial_windows_are_refused():
    mistral = {**config_of(MODEL_PRESETS["Mistral-Nemo-12B"]), "sliding_window": 4096}
    m = model_from_hf_config(mistral, "w")
    assert m.max_context_tokens == 4096 and "sliding window" in m.source
    qwen = {**config_of(MODEL_PRESETS["Qwen2.5-7B"]), "sliding_window": 4096, "use_sliding_window": False}
    assert model_from_hf_config(qwen, "q").max_context_tokens == 32768  # the flag is off
    with pytest.raises(ConfigError, match="max_window_layers"):
        model_from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 14}, "q")
    with pytest.raises(ConfigError, match="layer_types"):
        model_from_hf_config({**mistral, "layer_types": ["sliding_attention", "full_attention"]}, "w")


@pytest.mark.parametrize("rope, context", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen2.5's card
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # the older key
    ({"type": "linear", "factor": 2.0}, 65536),
    ({"rope_type": "dynamic", "factor": 2.0}, 65536),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 32768),  # already extended
    ({"rope_type": "longrope", "factor": 4.0}, 32768),
    ({"rope_type": "default"}, 32768),
    (None, 32768),
])
def test_rope_scaling_extends_the_context_as_vllm_derives_max_model_len(rope, context):
    cfg = {**config_of(MODEL_PRESETS["Qwen2.5-7B"]), "rope_scaling": rope}
    m = model_from_hf_config(cfg, "q")
    assert m.max_context_tokens == context
    assert ("rope_scaling factor" in m.source) == (context != 32768)


def test_rope_scaling_of_the_deepseek_presets_leaves_their_context_unchanged():
    for name in ("DeepSeek-V3", "DeepSeek-V2-Lite"):  # yarn x40 of 4096 = max_position_embeddings 163840
        cfg = {**config_of(MODEL_PRESETS[name]),
               "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}}
        assert model_from_hf_config(cfg, name).max_context_tokens == MODEL_PRESETS[name].max_context_tokens


@pytest.mark.parametrize("rope, match", [
    ("yarn", "rope_scaling='yarn' is not allowed: expected null or a mapping"),
    ({"rope_type": "linear", "factor": 0.5}, r"rope_scaling.factor=0.5 is not allowed"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": "32k"},
     "original_max_position_embeddings='32k'"),
    # an unknown, unnamed or non-string type extended the context by its factor as if linear (vLLM refuses them:
    # patch_rope_scaling_dict wants a type, get_rope knows its types)
    ({"rope_type": "weird", "factor": 4.0}, "rope_scaling.rope_type='weird' is not allowed: one of default, linear"),
    ({"factor": 4.0}, "rope_scaling.rope_type=None is not allowed: one of default"),
    ({"type": ["yarn"], "factor": 4.0}, r"rope_scaling.rope_type=\['yarn'\] is not allowed"),
    ({"rope_type": "yarn", "type": "linear", "factor": 4.0}, "rope_scaling.type='linear' is not allowed: .*'yarn'"),
])
def test_a_malformed_rope_scaling_is_named(rope, match):
    with pytest.raises(ConfigError, match=match):
        model_from_hf_config({**config_of(MODEL_PRESETS["Qwen2.5-7B"]), "rope_scaling": rope}, "q")


@pytest.mark.parametrize("edit, match", [
    ({"model_type": "bert"}, "model_type='bert' is not allowed: one of llama"),
    ({"model_type": "gpt_oss"}, "attention sinks"),
    ({"model_type": "gemma3_text"}, "sliding-window"),
    ({"hidden_size": None}, "hidden_size=null"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers='32' is not allowed: expected an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({"text_config": [1]}, "text_config"),
])
def test_a_malformed_or_unmodelled_config_names_the_key_and_value(edit, match):
    cfg = {**config_of(MODEL_PRESETS["Llama-3.1-8B"]), **edit}
    with pytest.raises(ConfigError, match=match):
        model_from_hf_config(cfg, "x", "f/config.json")


def test_a_missing_key_without_a_family_default_is_named():
    cfg = config_of(MODEL_PRESETS["Llama-3.1-8B"])
    del cfg["vocab_size"]
    with pytest.raises(ConfigError, match="missing key 'vocab_size'"):
        model_from_hf_config(cfg, "x")
    assert set(FAMILIES) >= {"llama", "qwen3_moe", "deepseek_v3", "llama4_text"}


def test_read_hf_config_takes_a_file_or_its_directory_and_refuses_bad_files(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_of(MODEL_PRESETS["Qwen2.5-3B"])))
    m = read_hf_config(d)
    assert m.name == "my-model" and m.n_params == MODEL_PRESETS["Qwen2.5-3B"].n_params
    assert read_hf_config(d / "config.json", name="other").name == "other"
    with pytest.raises(ConfigError, match="no such file"):
        read_hf_config(tmp_path / "nope")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "model_type": "qwen2"}')
    with pytest.raises(ConfigError, match="appears twice"):
        read_hf_config(bad)
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_hf_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        read_hf_config(bad)
    bad.write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="too large"):
        read_hf_config(bad)


def test_a_scenario_model_may_be_a_config_path_or_a_config_with_overrides(tmp_path):
    from kvsched.envs.sim.spec_io import instance_spec_from_dict, model_from

    d = tmp_path / "granite"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_of(MODEL_PRESETS["Granite-3.1-8B"])))
    spec = instance_spec_from_dict({"model": str(d), "gpu": "H100-SXM"}, "test")
    assert spec.model.tied_embeddings and spec.model.n_params == MODEL_PRESETS["Granite-3.1-8B"].n_params
    m = model_from({"hf_config": str(d / "config.json"), "name": "g", "max_context_tokens": 8192}, "test")
    assert (m.name, m.max_context_tokens) == ("g", 8192)
    with pytest.raises(ConfigError, match="test: model: .*no such file"):
        instance_spec_from_dict({"model": str(tmp_path / "missing" / "config.json"), "gpu": "H100-SXM"}, "test")
    with pytest.raises(ConfigError, match="hf_config=3"):
        model_from({"hf_config": 3}, "test")
    with pytest.raises(ConfigError, match="unknown key 'n_expert'"):
        model_from({"hf_config": str(d), "n_expert": 2}, "test")
    with pytest.raises(UnknownPresetError, match="config.json"):
        model_from("Granite-9000", "test")
    assert model_from("Granite-3.1-8B", "test") is MODEL_PRESETS["Granite-3.1-8B"]


def test_an_inline_model_round_trips_with_its_tied_flag(tmp_path):
    from kvsched.envs.sim.spec_io import load_instance_spec, save_instance_spec
    from kvsched.envs.sim.specs import InstanceSpec, get_gpu

    spec = InstanceSpec(get_model("Qwen2.5-3B"), get_gpu("H100-SXM"))
    save_instance_spec(spec, tmp_path / "s.yaml")
    assert load_instance_spec(tmp_path / "s.yaml").model == spec.model


@pytest.mark.parametrize("cfg, match", [
    ({"model_type": ["llama"]}, r"model_type=\['llama'\] is not allowed: expected a string"),
    ({"model_type": "llama4", "text_config": {"model_type": {"a": 1}}}, r"text_config: model_type=\{'a': 1\}"),
    ({**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": _llm_compressor(
        {"num_bits": 8, "type": ["float"]}, None)}, r"weights type=\['float'\] num_bits=8"),
    ({**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": _llm_compressor(
        {"num_bits": {}, "type": "float"}, None)}, r"num_bits=\{\}"),
])
def test_unhashable_values_where_a_name_is_looked_up_are_refused_by_name(cfg, match):
    with pytest.raises(ConfigError, match=match):  # was TypeError: unhashable type
        model_from_hf_config(cfg, "x")


def test_qwen_sliding_windows_follow_the_flag_and_max_window_layers_as_transformers_does():
    qwen = {**config_of(MODEL_PRESETS["Qwen2.5-7B"]), "sliding_window": 4096}  # 28 layers
    with pytest.raises(ConfigError, match="use_sliding_window='false' is not allowed: expected true or false"):
        model_from_hf_config({**qwen, "use_sliding_window": "false"}, "q")  # was read as on (truthy)
    # Qwen2Config: layers i >= max_window_layers (default 28) are windowed: none here, all with 0
    assert model_from_hf_config({**qwen, "use_sliding_window": True}, "q").max_context_tokens == 32768
    assert model_from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 0},
                                "q").max_context_tokens == 4096
    with pytest.raises(ConfigError, match="a window on 14 of 28 layers"):
        model_from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 14}, "q")
    moe = {**config_of(MODEL_PRESETS["Qwen3-30B-A3B"]), "model_type": "qwen2_moe",
           "shared_expert_intermediate_size": 0, "sliding_window": 4096, "use_sliding_window": True}
    with pytest.raises(ConfigError, match="max_window_layers"):  # Qwen2MoeConfig: every other layer below 28
        model_from_hf_config(moe, "m")
    qwen3_moe = {**moe, "model_type": "qwen3_moe"}  # 48 layers; Qwen3MoeConfig.max_window_layers = 28 too
    with pytest.raises(ConfigError, match="a window on 20 of 48 layers"):  # was read as 0: every layer, capped
        model_from_hf_config(qwen3_moe, "m")
    assert model_from_hf_config({**qwen3_moe, "max_window_layers": 0}, "m").max_context_tokens == 4096


def test_keys_left_out_take_the_family_configuration_class_default():
    nemo = config_of(MODEL_PRESETS["Mistral-Nemo-12B"])
    del nemo["sliding_window"]
    assert model_from_hf_config(nemo, "n").max_context_tokens == 4096  # MistralConfig.sliding_window = 4096
    gemma = {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 8,
             "num_key_value_heads": 1, "intermediate_size": 16384, "vocab_size": 256000,
             "max_position_embeddings": 8192}
    m = model_from_hf_config(gemma, "gemma-2b")  # GemmaConfig.head_dim = 256, not 2048 // 8
    assert m.head_dim == 256 and m.n_params == 2_506_172_416  # google/gemma-2b's published total
    qwen3 = config_of(MODEL_PRESETS["Qwen3-14B"])
    del qwen3["head_dim"]
    assert model_from_hf_config(qwen3, "q").head_dim == 128  # Qwen3Config.head_dim = 128


def test_llama4_moe_layers_and_chunked_attention_are_read_not_dropped():
    cfg = config_of(MODEL_PRESETS["Llama-4-Maverick-17B-128E"])
    text = cfg["text_config"]
    listed = {**text, "moe_layers": list(range(1, 48, 2))}
    assert model_from_hf_config({**cfg, "text_config": listed}, "m").n_params == \
        MODEL_PRESETS["Llama-4-Maverick-17B-128E"].n_params
    with pytest.raises(ConfigError, match=r"moe_layers=\[0, 1, 2\] is not allowed"):  # overrides the step
        model_from_hf_config({**cfg, "text_config": {**text, "moe_layers": [0, 1, 2]}}, "m")
    kinds = ["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"] * 12
    m = model_from_hf_config({**cfg, "text_config": {**text, "layer_types": kinds, "attention_chunk_size": 8192}},
                             "m")
    assert "chunked local attention (attention_chunk_size 8192)" in m.source
    assert "attention_chunk_size" in model_from_hf_config(cfg, "m").source  # Llama4TextConfig default 8192


@pytest.mark.parametrize("quant, which", [
    ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]},
     "mlp"),
    ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["gate", "visual"]}, "linear"),
])
def test_modelopt_and_awq_lists_of_unquantized_modules_are_read(quant, which):
    cfg = {**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": quant}
    assert model_from_hf_config(cfg, "q").quantized_weights == which
    key = "exclude_modules" if quant["quant_method"] == "modelopt" else "modules_to_not_convert"
    with pytest.raises(ConfigError, match=f"{key}: 'model.layers.0.mlp.down_proj' left unquantized"):
        model_from_hf_config({**cfg, "quantization_config": {**quant, key: ["model.layers.0.mlp.down_proj"]}}, "q")


def test_a_wrappers_quantization_config_is_named_where_it_is():
    cfg = {**config_of(MODEL_PRESETS["Llama-4-Scout-17B-16E"]), "quantization_config": {"quant_method": "x"}}
    with pytest.raises(ConfigError, match=r"^f\.json: quantization_config\.quant_method='x'"):
        model_from_hf_config(cfg, "s", "f.json")


def test_a_hugging_face_cache_snapshot_is_named_by_its_repo_not_by_the_blob_it_links_to(tmp_path):
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-3B-Instruct"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "9f1e").write_text(json.dumps(config_of(MODEL_PRESETS["Qwen2.5-3B"])))
    snap = repo / "snapshots" / "aa11bb"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/9f1e")
    assert read_hf_config(snap).name == "Qwen2.5-3B-Instruct"  # was "blobs"
    linked = tmp_path / "my-qwen"
    linked.mkdir()
    (linked / "config.json").symlink_to(repo / "blobs" / "9f1e")
    assert read_hf_config(linked / "config.json").name == "my-qwen"


def test_deepseek_v2_without_q_lora_rank_takes_the_config_class_default_and_null_means_none():
    v2 = {"model_type": "deepseek_v2", "hidden_size": 5120, "num_hidden_layers": 60, "num_attention_heads": 128,
          "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2,
          "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840}
    # DeepseekV2Config.q_lora_rank = 1536: deepseek-ai/DeepSeek-V2's 235,741,434,880 parameters
    assert model_from_hf_config(v2, "v2").n_params == 235_741_434_880
    assert model_from_hf_config({**v2, "q_lora_rank": 1536}, "v2").n_params == 235_741_434_880
    no_lora = model_from_hf_config({**v2, "q_lora_rank": None}, "v2").n_params  # q_proj from hidden
    assert no_lora - 235_741_434_880 == 60 * (5120 * 128 * 192 - (5120 * 1536 + 1536 + 1536 * 128 * 192))


def test_smollm3_windows_only_with_its_flag_and_then_on_some_layers_so_refused():
    smol = {**config_of(MODEL_PRESETS["SmolLM3-3B"]), "sliding_window": 4096}
    assert model_from_hf_config(smol, "s").max_context_tokens == 65536  # use_sliding_window off (default)
    assert model_from_hf_config({**smol, "use_sliding_window": False}, "s").max_context_tokens == 65536
    with pytest.raises(ConfigError, match="use_sliding_window=True is not allowed: a window on the NoPE layers"):
        model_from_hf_config({**smol, "use_sliding_window": True}, "s")


def test_the_checkpoint_dtype_is_read_and_an_unknown_one_refused():
    cfg = config_of(MODEL_PRESETS["Llama-3.1-8B"])
    assert model_from_hf_config({**cfg, "torch_dtype": "float16"}, "x").weight_dtype == "fp16"
    assert model_from_hf_config({**cfg, "torch_dtype": "float32"}, "x").weight_dtype == "bf16"
    no_dtype = model_from_hf_config({k: v for k, v in cfg.items() if k != "torch_dtype"}, "x")
    assert no_dtype.weight_dtype == "bf16" and "no torch_dtype" in no_dtype.source
    assert model_from_hf_config({**cfg, "torch_dtype": None, "dtype": "float16"}, "x").weight_dtype == "fp16"
    for bad in ("int8", 16, ["bfloat16"]):
        with pytest.raises(ConfigError, match="torch_dtype=.* is not allowed: one of bfloat16"):
            model_from_hf_config({**cfg, "torch_dtype": bad}, "x")


def test_a_checkpoints_kv_cache_scales_do_not_set_the_kv_dtype_and_say_so():
    quant = {**_llm_compressor({"num_bits": 8, "type": "float"}, {"num_bits": 8, "type": "float"}),
             "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    m = model_from_hf_config({**config_of(MODEL_PRESETS["Llama-3.1-8B"]), "quantization_config": quant}, "x")
    assert "kv_dtype" in m.source and m.kv_bytes_per_token(2) == MODEL_PRESETS["Llama-3.1-8B"].kv_bytes_per_token(2)


def test_one_config_file_read_by_two_spellings_gives_one_spec(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_of(MODEL_PRESETS["Qwen2.5-3B"])))
    monkeypatch.chdir(tmp_path)
    assert read_hf_config("m") == read_hf_config("./m") == read_hf_config(d / "config.json")


def test_fields_overridden_over_a_config_are_said_in_the_models_source(tmp_path):
    """``{hf_config: PATH, <field>: value}`` kept the config's source, which says the numbers were
    read or computed from the file ("n_params computed from it (8,170,848,256)", "context capped at
    the sliding window"): run.json and the console note then described a model the run did not use."""
    from kvsched.envs.sim.spec_io import model_from

    (tmp_path / "config.json").write_text(json.dumps({**config_of(MODEL_PRESETS["Mistral-Nemo-12B"]),
                                                      "sliding_window": 4096}))
    base = model_from({"hf_config": str(tmp_path)}, "test")
    m = model_from({"hf_config": str(tmp_path), "max_context_tokens": 32768, "n_params": 1.2e10}, "test")
    assert m.source.startswith(base.source)
    assert m.source.endswith("; overridden in the scenario: max_context_tokens 32768 (read: 4096), n_params "
                             "12000000000 (read: 12247782400)")
    same = model_from({"hf_config": str(tmp_path), "max_context_tokens": 4096}, "test")
    assert same == base  # an override equal to what was read changes nothing
    own = model_from({"hf_config": str(tmp_path), "n_layers": 20, "source": "my notes"}, "test")
    assert own.source == "my notes"  # a source given is the user's word


def test_a_folder_named_like_a_presets_id_whose_config_differs_is_read_not_replaced(tmp_path, monkeypatch):
    """``--model Qwen/Qwen2.5-7B-Instruct`` where that folder exists (a download) gave the preset even
    when its config.json says otherwise: with the YaRN block Qwen2.5's model card has users add,
    the preset's 32,768-token context was served instead of 131,072 (vLLM, like transformers,
    loads a local folder of that name before the hub id). An unedited config keeps the preset."""
    from kvsched.envs.sim.spec_io import model_from

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "Qwen" / "Qwen2.5-7B-Instruct"
    folder.mkdir(parents=True)
    cfg = config_of(MODEL_PRESETS["Qwen2.5-7B"])
    (folder / "config.json").write_text(json.dumps(cfg))
    assert model_from("Qwen/Qwen2.5-7B-Instruct", "t") is MODEL_PRESETS["Qwen2.5-7B"]
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": yarn}))
    m = model_from("Qwen/Qwen2.5-7B-Instruct", "t")
    assert (m.name, m.max_context_tokens) == ("Qwen2.5-7B-Instruct", 131072)
    assert m.source.startswith("HF config.json read")
