"""ModelSpec (envs/sim/model_spec.py): architecture numbers against REFERENCE §5.1 and the HF
configs, the derived sizes (parameters, KV bytes per token, attention FLOPs per pair) and bad input."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.model_spec import MODEL_PRESETS, ModelSpec, get_model


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
    # embedding and lm_head + final norm (+ QKV bias for Qwen2.5, q/k RMS-norm weights for Qwen3)
    for m in (p for p in MODEL_PRESETS.values() if not p.is_moe):  # MoE presets: tests/core/test_moe.py
        q, k = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        bias = (q + 2 * k) if m.name.startswith("Qwen2.5") else 0
        bias += 2 * m.head_dim if m.name.startswith("Qwen3") else 0
        layer = 2 * m.hidden_size * q + 2 * m.hidden_size * k + bias + 3 * m.hidden_size * m.intermediate_size
        tables = 1 if m.tied_embeddings else 2  # a tied lm_head is the embedding's table
        total = m.n_layers * (layer + 2 * m.hidden_size) + tables * m.vocab_size * m.hidden_size + m.hidden_size
        assert m.n_params == total, m.name
        assert m.matmul_params == m.n_params - (tables - 1) * m.vocab_size * m.hidden_size


@pytest.mark.parametrize(("model_id", "preset", "published_params"), [
    ("codellama/CodeLlama-34b-Instruct-hf", "CodeLlama-34B", 33.7e9),
    ("Qwen/Qwen3-14B", "Qwen3-14B", 14.8e9),
    ("microsoft/phi-4", "Phi-4", 14.7e9),
    ("mistralai/Mistral-Small-24B-Instruct-2501", "Mistral-Small-24B", 23.57e9),
    ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", "Mistral-Small-3.1-24B", 23.57e9),
    ("deepseek-ai/DeepSeek-V2-Lite", "DeepSeek-V2-Lite", 15.7e9),
    ("meta-llama/Llama-3.3-70B-Instruct", "Llama-3.1-70B", 70.6e9),
    ("nvidia/Llama-3.1-Nemotron-70B-Instruct-HF", "Llama-3.1-70B", 70.6e9),
    ("ibm-granite/granite-3.1-8b-instruct", "Granite-3.1-8B", 8.17e9),
    ("Qwen/Qwen2.5-3B-Instruct", "Qwen2.5-3B", 3.09e9),
])
def test_served_models_of_the_llm_d_runs_resolve_to_presets_of_their_published_size(model_id, preset,
                                                                                    published_params) -> None:
    """The Hugging Face ids of inference-sim's model_configs and BLIS coefficient sets resolve, and
    the parameter count computed from each config rounds to the published one."""
    m = get_model(model_id)
    assert m.name == preset
    assert m.n_params == pytest.approx(published_params, abs=0.05e9)  # published to 3 digits


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


def test_model_spec_bad_sizes_name_the_field_and_value() -> None:
    ok = dict(name="tiny", n_layers=4, hidden_size=1024, n_heads=16, n_kv_heads=2, head_dim=64,
              intermediate_size=4096, vocab_size=1000, n_params=60e6, max_context_tokens=2048)
    ModelSpec(**ok)
    for field, bad, match in (("n_layers", 0, "n_layers=0"), ("head_dim", 1.5, "head_dim=1.5"),
                              ("n_kv_heads", 3, "n_kv_heads=3 .*divisor of n_heads=16"),
                              ("n_params", 1000 * 1024, "n_params"), ("name", "", "ModelSpec.name")):
        with pytest.raises(ConfigError, match=match):
            ModelSpec(**{**ok, field: bad})


def test_weight_and_kv_bytes_scale_with_the_dtype() -> None:
    m = get_model("Llama-3.1-8B")
    assert m.weight_bytes(1.0) * 2 == m.weight_bytes() == m.n_params * 2
    assert m.kv_bytes_per_token(2.0) == 2 * m.n_layers * m.n_kv_heads * m.head_dim * 2
    assert m.attn_flops_per_pair == 4 * m.n_layers * m.n_heads * m.head_dim
