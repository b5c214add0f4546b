"""A :class:`ModelSpec` from a Hugging Face ``config.json``: any model of a supported family, not
only the presets.

What is read, per family (``model_type``; the ``text_config`` of a multimodal wrapper such as
``mistral3`` or ``llama4``): the sizes (layers, widths, heads, vocabulary, context), the
mixture-of-experts layout, multi-head latent attention, tied embeddings, ``rope_scaling`` (which
extends the context as vLLM derives ``max_model_len``) and the checkpoint's ``quantization_config``.
``n_params`` is computed from them as the family's modelling code builds its weights (transformers
``modeling_<family>.py``, vLLM ``model_executor/models/<family>.py``):
embedding, per layer the attention projections (and their biases where the family has them, QK
norms), the MLP or experts (router, shared experts), two RMSNorms, the final norm, and the lm_head
unless ``tie_word_embeddings``. For every preset whose numbers come from a config, this count
equals the preset's (``tests/core/test_hf_config.py``) and so the safetensors total its model card
reports.

A key the family's configuration class defaults is taken from that default when absent (the
defaults below cite transformers' ``configuration_<family>.py``); a key the count needs with no
default is an error. A feature kvsched does not model is an error naming the key, never dropped:
sliding-window attention *on every layer* caps the context at the window instead (attention over
at most ``sliding_window`` tokens is full attention, exactly, and so is the KV it keeps); a window
on some layers only (Gemma-2/3, gpt-oss) or a per-layer layout (``layer_types``) is refused.

Errors are :class:`ConfigError` naming the file (or ``where``), the key, its value and what is
allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import strict_json
from .errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from .model_spec import MAX_MODEL_SIZE, ModelSpec, moe_layer_count
from .spec_validation import is_int

HF_CONFIG_SOURCE = "HF config.json read by kvsched.envs.sim.hf_config"
"""How the ``source`` of every :class:`ModelSpec` read from a config.json begins."""

MAX_CONFIG_BYTES = 4 << 20
"""Largest config.json read (4 MiB; a real one is a few KB, a multimodal one with its processor
settings under 100 KB)."""

DENSE_FAMILIES: dict[str, dict[str, Any]] = {
    # family: (defaults of the keys the count reads when the config leaves them out)
    "llama": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"tie_word_embeddings": False, "max_window_layers": 28},
    "qwen3": {"tie_word_embeddings": False, "attention_bias": False, "head_dim": 128, "max_window_layers": 28},
    "granite": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "phi3": {"tie_word_embeddings": False},
    "smollm3": {"attention_bias": False, "mlp_bias": False},  # tie_word_embeddings: the config must say
    "gemma": {"tie_word_embeddings": True, "attention_bias": False, "head_dim": 256},
}
"""Dense families read, with the defaults of their transformers configuration classes
(``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``GraniteConfig``,
``Phi3Config``, ``GemmaConfig``, ``SmolLM3Config``) for the keys the parameter count and the
attention layout read (head_dim where it is not hidden_size / heads, Mistral's 4096-token window,
Qwen's ``max_window_layers``); a key with no default here must be in the config."""

MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"tie_word_embeddings": False},
    "qwen2_moe": {"tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "max_window_layers": 28},
    "qwen3_moe": {"tie_word_embeddings": False, "attention_bias": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "max_window_layers": 28},
    "llama4_text": {"tie_word_embeddings": False, "interleave_moe_layer_step": 1, "attention_bias": False,
                    "head_dim": 128},
    "deepseek_v2": {"tie_word_embeddings": False, "moe_layer_freq": 1, "first_k_dense_replace": 0,
                    "n_shared_experts": None, "q_lora_rank": 1536},  # null in a config: no q LoRA (V2-Lite)
    "deepseek_v3": {"tie_word_embeddings": False, "moe_layer_freq": 1, "first_k_dense_replace": 3,
                    "n_shared_experts": 1, "q_lora_rank": 1536},
}
"""Mixture-of-experts (and latent-attention) families read, with their configuration classes'
defaults (``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``Llama4TextConfig``,
``DeepseekV2Config``, ``DeepseekV3Config``)."""

FAMILIES: tuple[str, ...] = tuple(DENSE_FAMILIES) + tuple(MOE_FAMILIES)
"""Every ``model_type`` :func:`model_from_hf_config` reads."""

_NOT_MODELLED: dict[str, str] = {
    "gemma2": "sliding-window attention on every other layer and logit soft-capping",
    "gemma3": "sliding-window attention on 5 of 6 layers",
    "gemma3_text": "sliding-window attention on 5 of 6 layers",
    "gpt_oss": "attention sinks, sliding-window attention on every other layer and MXFP4 experts",
    "mamba": "a state-space model keeps no per-token KV",
    "mamba2": "a state-space model keeps no per-token KV",
    "jamba": "Mamba layers keep no per-token KV",
    "falcon_h1": "Mamba layers keep no per-token KV",
    "nemotron_h": "Mamba layers keep no per-token KV",
    "granitemoehybrid": "Mamba layers keep no per-token KV",
    "qwen3_next": "linear-attention (Gated DeltaNet) layers keep no per-token KV",
}
"""Families refused with the reason (their KV or step cost is not a decoder's with full attention)."""


def _where_key(where: str, key: str) -> str:
    return f"{where}: {key}"


def _get(cfg: Mapping[str, Any], key: str, where: str, defaults: Mapping[str, Any]) -> Any:
    """``cfg[key]``, else the family's default; an error naming the key when neither exists."""
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if key in defaults:
        return defaults[key]
    if key in cfg:
        raise ConfigError(f"{_where_key(where, key)}=null is not allowed: the parameter count needs it")
    raise ConfigError(f"{where}: missing key {bounded_repr(key)} (the parameter count needs it)")


def _int(cfg: Mapping[str, Any], key: str, where: str, defaults: Mapping[str, Any], minimum: int = 1) -> int:
    value = _get(cfg, key, where, defaults)
    if isinstance(value, bool) or not is_int(value) or not minimum <= int(value) <= MAX_MODEL_SIZE:
        raise ConfigError(f"{_where_key(where, key)}={bounded_repr(value)} is not allowed: expected an integer "
                          f"in [{minimum}, 2**40]")
    return int(value)


def _bool(cfg: Mapping[str, Any], key: str, where: str, defaults: Mapping[str, Any]) -> bool:
    value = _get(cfg, key, where, defaults)
    if not isinstance(value, bool):
        raise ConfigError(f"{_where_key(where, key)}={bounded_repr(value)} is not allowed: expected true or false")
    return value


def _text_config(config: Mapping[str, Any], where: str) -> tuple[Mapping[str, Any], str]:
    """The language model's config: ``text_config`` of a multimodal wrapper, else the config itself."""
    text = config.get("text_config")
    if text is None:
        return config, where
    if not isinstance(text, Mapping):
        raise ConfigError(f"{_where_key(where, 'text_config')}={bounded_repr(text)} is not allowed: expected a mapping")
    merged = dict(text)
    if "tie_word_embeddings" not in merged and "tie_word_embeddings" in config:
        merged["tie_word_embeddings"] = config["tie_word_embeddings"]  # set on the wrapper (Mistral-Small-3.1)
    return merged, f"{where}: text_config"


_ROPE_TYPES_WITHOUT_EXTENSION = ("su", "longrope", "llama3")
"""``rope_scaling`` types whose ``max_position_embeddings`` already is the extended context (vLLM
``_get_and_verify_max_len`` leaves it unscaled for them)."""

_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "mrope") + _ROPE_TYPES_WITHOUT_EXTENSION
"""``rope_scaling`` types read (transformers ``ROPE_INIT_FUNCTIONS``, vLLM ``get_rope``; ``mrope`` is
Qwen2-VL's, read as ``default``). vLLM refuses a rope_scaling without a type
(``patch_rope_scaling_dict``), with ``rope_type`` and ``type`` disagreeing, or of a type it does not
know, so kvsched does too rather than extend the context by its factor."""


def _rope_context(cfg: Mapping[str, Any], where: str, context: int) -> tuple[int, str]:
    """The context vLLM derives from ``max_position_embeddings`` and ``rope_scaling`` (its
    ``_get_and_verify_max_len``): unchanged without a scaling or for the types of
    :data:`_ROPE_TYPES_WITHOUT_EXTENSION`; else ``factor`` (default 1) times
    ``original_max_position_embeddings`` for ``yarn`` and times ``max_position_embeddings`` for the
    others (``linear``, ``dynamic``). RoPE scaling changes no FLOP and no byte a step costs, only how
    long a context is served: e.g. Qwen2.5 with the YaRN block its model card gives, 4 x 32768 = 131072."""
    rope = cfg.get("rope_scaling")
    if rope is None:
        return context, ""
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{_where_key(where, 'rope_scaling')}={bounded_repr(rope)} is not allowed: expected null "
                          "or a mapping")
    kind = rope.get("rope_type", rope.get("type"))
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise ConfigError(f"{_where_key(where, 'rope_scaling.rope_type')}={bounded_repr(kind)} is not allowed: one of "
                          f"{', '.join(_ROPE_TYPES)} (or the older key type)")
    if "type" in rope and "rope_type" in rope and rope["type"] != kind:
        raise ConfigError(f"{_where_key(where, 'rope_scaling.type')}={bounded_repr(rope['type'])} is not allowed: "
                          f"expected rope_type {bounded_repr(kind)} or no type key")
    if kind in _ROPE_TYPES_WITHOUT_EXTENSION or kind == "default" or "factor" not in rope:
        return context, ""
    factor = rope["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1024:
        raise ConfigError(f"{_where_key(where, 'rope_scaling.factor')}={bounded_repr(factor)} is not allowed: "
                          "expected a number in [1, 1024]")
    base, base_key = context, "max_position_embeddings"
    if kind == "yarn":
        base_key = "rope_scaling.original_max_position_embeddings"
        base = rope.get("original_max_position_embeddings", context)  # transformers' fallback when absent
        if isinstance(base, bool) or not is_int(base) or not 1 <= int(base) <= MAX_MODEL_SIZE:
            raise ConfigError(f"{_where_key(where, base_key)}={bounded_repr(base)} is not allowed: expected an "
                              "integer in [1, 2**40] (yarn scales it)")
    scaled = int(int(base) * float(factor))
    if scaled == context:
        return context, ""
    return scaled, (f"; context {scaled} = {base_key} {int(base)} x rope_scaling factor {factor} ({kind}), as vLLM "
                    f"derives max_model_len (max_position_embeddings {context})")


_QWEN = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _windowed_layers(cfg: Mapping[str, Any], family: str, where: str, defaults: Mapping[str, Any],
                     n_layers: int) -> int:
    """How many layers a Qwen config's ``use_sliding_window`` windows: layers i >=
    ``max_window_layers`` (``Qwen2Config``/``Qwen3Config``; default 28), every other layer below it
    for qwen2_moe (``Qwen2MoeConfig.layer_types``)."""
    first = _int(cfg, "max_window_layers", where, {"max_window_layers": 0, **defaults}, minimum=0)
    if family == "qwen2_moe":
        return len(range(0, min(first, n_layers), 2))
    return max(0, n_layers - first)


def _check_windows(cfg: Mapping[str, Any], family: str, where: str, defaults: Mapping[str, Any], context: int,
                   n_layers: int) -> tuple[int, str]:
    """The context after a sliding window on every layer (capped at it), and a note; refuses
    per-layer layouts."""
    if cfg.get("layer_types") is not None:
        kinds = cfg["layer_types"]
        # Llama-4 writes its chunked local attention here too (read as for its presets, see below)
        allowed = ("full_attention", "chunked_attention") if family == "llama4_text" else ("full_attention",)
        if not isinstance(kinds, list) or any(k not in allowed for k in kinds):
            raise ConfigError(f"{_where_key(where, 'layer_types')}={bounded_repr(kinds)} is not allowed: a per-layer "
                              "attention layout is not modelled (every layer full_attention only)")
    window = cfg.get("sliding_window", defaults.get("sliding_window"))
    if family in _QWEN + ("smollm3",) and not _bool(cfg, "use_sliding_window", where, {"use_sliding_window": False}):
        window = None  # Qwen and SmolLM3 configs carry a window that only use_sliding_window turns on
    if window is None:
        return context, ""
    if isinstance(window, bool) or not is_int(window) or window < 1:
        raise ConfigError(f"{_where_key(where, 'sliding_window')}={bounded_repr(window)} is not allowed: expected "
                          "null or a positive integer")
    if family == "smollm3":  # SmolLM3Config.layer_types: the window on its NoPE layers only
        raise ConfigError(f"{_where_key(where, 'use_sliding_window')}=True is not allowed: a window on the NoPE "
                          "layers only is not modelled")
    if family in _QWEN:
        windowed = _windowed_layers(cfg, family, where, defaults, n_layers)
        if windowed == 0:
            return context, ""
        if windowed < n_layers:
            raise ConfigError(f"{_where_key(where, 'max_window_layers')}="
                              f"{bounded_repr(cfg.get('max_window_layers', defaults.get('max_window_layers')))} is "
                              f"not allowed with use_sliding_window: a window on {windowed} of {n_layers} layers "
                              "only is not modelled")
    if int(window) >= context:
        return context, ""
    return int(window), (f"; context capped at the sliding window of {int(window)} tokens (otherwise {context}): "
                         "full attention is exact up to it, longer contexts are not modelled")


def _dense_attention(cfg: Mapping[str, Any], family: str, where: str, defaults: Mapping[str, Any],
                     hidden: int, n_heads: int, n_kv: int, head_dim: int) -> int:
    """Weights of one layer's attention: q, k, v, o projections, their biases, QK norms."""
    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    params = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if family in ("qwen2", "qwen2_moe"):
        params += q_out + 2 * kv_out  # q/k/v biases, always (Qwen2Attention), no o_proj bias
    elif "attention_bias" in defaults and _bool(cfg, "attention_bias", where, defaults):  # llama-like
        params += q_out + 2 * kv_out + hidden  # bias on q, k, v and o (LlamaAttention & co.)
    if family in ("qwen3", "qwen3_moe"):
        params += 2 * head_dim  # q_norm, k_norm (RMSNorm over head_dim)
    return params


def _mla_attention(cfg: Mapping[str, Any], where: str, defaults: Mapping[str, Any], hidden: int,
                   n_heads: int) -> tuple[int, int, int, int]:
    """DeepSeek multi-head latent attention: (weights of one layer, kv_lora_rank, qk_rope_head_dim,
    head_dim = qk_nope + qk_rope). q_a/q_b with a q_lora_rank (its RMSNorm), else one q_proj;
    kv_a_proj_with_mqa (latent + RoPE key), its RMSNorm, kv_b_proj (to per-head nope key and value),
    o_proj from the value heads (transformers ``DeepseekV3Attention``)."""
    kv_rank = _int(cfg, "kv_lora_rank", where, defaults)
    rope = _int(cfg, "qk_rope_head_dim", where, defaults)
    nope = _int(cfg, "qk_nope_head_dim", where, defaults)
    v_dim = _int(cfg, "v_head_dim", where, defaults)
    qk_dim = nope + rope
    q_rank = cfg.get("q_lora_rank", defaults.get("q_lora_rank"))
    if q_rank is None:
        params = hidden * n_heads * qk_dim
    else:
        q_rank = _int(cfg, "q_lora_rank", where, defaults)
        params = hidden * q_rank + q_rank + q_rank * n_heads * qk_dim
    params += hidden * (kv_rank + rope) + kv_rank + kv_rank * n_heads * (nope + v_dim) + n_heads * v_dim * hidden
    return params, kv_rank, rope, qk_dim


def _moe_layout(cfg: Mapping[str, Any], family: str, where: str, defaults: Mapping[str, Any], hidden: int,
                n_layers: int) -> dict[str, Any]:
    """The ModelSpec MoE fields, the routed/shared expert widths and the extra per-MoE-layer
    weights (router, shared-expert gate, score-correction bias)."""
    if family == "mixtral":
        n_experts = _int(cfg, "num_local_experts", where, defaults)
        width = _int(cfg, "intermediate_size", where, defaults)
        return dict(n_experts=n_experts, experts_per_token=_int(cfg, "num_experts_per_tok", where, defaults),
                    expert_intermediate_size=width, n_shared_experts=0, first_dense_layers=0, moe_layer_step=1,
                    dense_width=width, extra=hidden * n_experts)
    if family in ("qwen2_moe", "qwen3_moe"):
        only = _get(cfg, "mlp_only_layers", where, defaults)
        if only:
            raise ConfigError(f"{_where_key(where, 'mlp_only_layers')}={bounded_repr(only)} is not allowed: dense "
                              "layers at listed positions are not modelled (an empty list only)")
        n_experts = _int(cfg, "num_experts", where, defaults)
        width = _int(cfg, "moe_intermediate_size", where, defaults)
        extra, shared = hidden * n_experts, 0
        if family == "qwen2_moe":
            shared_width = _int(cfg, "shared_expert_intermediate_size", where, defaults, minimum=0)
            if shared_width % width:
                raise ConfigError(f"{_where_key(where, 'shared_expert_intermediate_size')}={shared_width} is not "
                                  f"allowed: kvsched models a shared expert as whole experts of moe_intermediate_size "
                                  f"{width} (a multiple of it)")
            shared = shared_width // width
            extra += hidden if shared else 0  # shared_expert_gate: Linear(hidden, 1)
        return dict(n_experts=n_experts, experts_per_token=_int(cfg, "num_experts_per_tok", where, defaults),
                    expert_intermediate_size=width, n_shared_experts=shared, first_dense_layers=0,
                    moe_layer_step=_int(cfg, "decoder_sparse_step", where, defaults),
                    dense_width=_int(cfg, "intermediate_size", where, defaults), extra=extra)
    if family == "llama4_text":
        n_experts = _int(cfg, "num_local_experts", where, defaults)
        step = _int(cfg, "interleave_moe_layer_step", where, defaults)
        listed = cfg.get("moe_layers")  # overrides the step when set (Llama4TextConfig)
        if listed is not None and listed != list(range(step - 1, n_layers, step)):
            raise ConfigError(f"{_where_key(where, 'moe_layers')}={bounded_repr(listed)} is not allowed: MoE layers "
                              f"are modelled as every interleave_moe_layer_step={step}-th layer (layers "
                              f"{step - 1}, {2 * step - 1}, ...), or null")
        return dict(n_experts=n_experts, experts_per_token=_int(cfg, "num_experts_per_tok", where, defaults),
                    expert_intermediate_size=_int(cfg, "intermediate_size", where, defaults), n_shared_experts=1,
                    first_dense_layers=0, moe_layer_step=step,
                    dense_width=_int(cfg, "intermediate_size_mlp", where, defaults), extra=hidden * n_experts)
    # deepseek_v2 / deepseek_v3: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    freq = _int(cfg, "moe_layer_freq", where, defaults)
    if freq != 1:
        raise ConfigError(f"{_where_key(where, 'moe_layer_freq')}={freq} is not allowed: DeepSeek's every-n-th "
                          "MoE layer (i % freq == 0) is not modelled (1 only)")
    n_experts = _int(cfg, "n_routed_experts", where, defaults)
    shared = cfg.get("n_shared_experts", defaults["n_shared_experts"])
    shared = 0 if shared is None else _int(cfg, "n_shared_experts", where, defaults, minimum=0)
    first = _int(cfg, "first_k_dense_replace", where, defaults, minimum=0)
    if first >= n_layers:
        raise ConfigError(f"{_where_key(where, 'first_k_dense_replace')}={first} is not allowed: at least one MoE "
                          f"layer among num_hidden_layers={n_layers}")
    extra = hidden * n_experts
    if family == "deepseek_v3" or cfg.get("topk_method") == "noaux_tc":
        extra += n_experts  # e_score_correction_bias
    return dict(n_experts=n_experts, experts_per_token=_int(cfg, "num_experts_per_tok", where, defaults),
                expert_intermediate_size=_int(cfg, "moe_intermediate_size", where, defaults), n_shared_experts=shared,
                first_dense_layers=first, moe_layer_step=1,
                dense_width=_int(cfg, "intermediate_size", where, defaults), extra=extra)


_COMPRESSED_SCHEMES: dict[tuple[str, int, bool], str] = {
    ("float", 8, True): "fp8", ("int", 8, True): "int8", ("int", 4, False): "int4", ("float", 4, True): "nvfp4",
}
"""compressed-tensors weight schemes: (type, num_bits, activations quantized) -> weight dtype
(LLM Compressor's FP8 / FP8_DYNAMIC, W8A8, W4A16, NVFP4 presets). The weight-only float schemes
(FP8 weights without ``input_activations``, NVFP4A16) are not among them: vLLM runs them with
weight-only kernels (``CompressedTensorsW8A16Fp8``, ``CompressedTensorsW4A16Fp4``: Marlin, 16-bit
GEMMs) where kvsched's fp8 and nvfp4 price GEMMs at the GPU's FP8 / FP4 peak."""


def _ignored_weights(ignore: Any, where: str) -> str:
    """``quantized_weights`` from an ignore list: the lm_head (and routers, gates, vision and
    multimodal parts, which are not decoder Linear layers the cost model prices) -> "linear"; the
    attention projections too -> "mlp"."""
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ConfigError(f"{where}={bounded_repr(ignore)} is not allowed: expected a list of module names")
    multimodal = ("vision", "multi_modal", "mm_projector", "visual", "audio")
    attention = ("self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "attn")
    harmless = ("lm_head", "router", "gate", "embed")
    kept_attention = False
    for name in ignore:
        low = name.lower()
        if any(m in low for m in multimodal):
            continue  # not run for text prompts
        if any(a in low for a in attention):
            kept_attention = True
        elif any(m in low for m in ("gate_proj", "up_proj", "down_proj", "experts", "mlp.fc")) \
                or not any(h in low for h in harmless):
            raise ConfigError(f"{where}: {bounded_repr(name)} left unquantized is not modelled (kvsched models "
                              "the lm_head, routers, gates, multimodal parts and the attention projections "
                              "left in bf16)")
    return "mlp" if kept_attention else "linear"


def _quantization(cfg: Mapping[str, Any], where: str) -> tuple[str, str, str]:
    """(weight_dtype, quantized_weights, note) of ``quantization_config`` (absent: unquantized)."""
    q = cfg.get("quantization_config")
    if q is None:
        return "", "all", ""
    where = f"{where}: quantization_config"
    if not isinstance(q, Mapping):
        raise ConfigError(f"{where}={bounded_repr(q)} is not allowed: expected a mapping")
    method = q.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):  # block or per-tensor FP8 (DeepSeek-V3, Qwen3-*-FP8), or FBGEMM's rowwise
        # FP8 of Meta's -FP8 checkpoints (Llama-3.1-405B, Llama-4-Maverick): every decoder Linear layer but those listed
        ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ["lm_head"]
        return ("fp8", _ignored_weights(ignored, f"{where}.modules_to_not_convert"),
                f"; FP8 weights (quant_method {method})")
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, Mapping) or len(groups) != 1:
            raise ConfigError(f"{where}.config_groups={bounded_repr(groups)} is not allowed: one quantization "
                              "group is modelled (one scheme for every quantized Linear layer)")
        group = next(iter(groups.values()))
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise ConfigError(f"{where}.config_groups: a group without a weights scheme is not allowed")
        acts = group.get("input_activations")
        key = (weights.get("type"), weights.get("num_bits"), acts is not None)
        hashable = all(isinstance(k, (str, int)) for k in key)  # a list or mapping here is no scheme
        dtype = _COMPRESSED_SCHEMES.get(key) if hashable else None  # type: ignore[arg-type]
        if dtype is None and key in (("float", 8, False), ("float", 4, False)):
            raise ConfigError(f"{where}: weights type='float' num_bits={key[1]} without quantized activations "
                              f"(weight-only {'FP8' if key[1] == 8 else 'NVFP4A16'}) is not modelled: vLLM runs it "
                              "with 16-bit GEMMs, kvsched's fp8/nvfp4 at the FP8/FP4 peak (W8A8/W4A4 only)")
        if dtype is None:
            raise ConfigError(f"{where}: weights type={bounded_repr(key[0])} num_bits={bounded_repr(key[1])} "
                              f"{'with' if key[2] else 'without'} quantized activations is not modelled (FP8, "
                              "W8A8 int8, W4A16 int4, NVFP4)")
        return (dtype, _ignored_weights(q.get("ignore", []), f"{where}.ignore"),
                f"; {dtype} weights (compressed-tensors)")
    if method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise ConfigError(f"{where}: {method} with bits={bounded_repr(bits)} is not allowed: 4-bit weight-only "
                              "is modelled (int4); 8-bit weight-only (w8a16) is not")
        kept = q.get("modules_to_not_convert") or ["lm_head"]
        return "int4", _ignored_weights(kept, f"{where}.modules_to_not_convert"), f"; int4 weights ({method})"
    if method == "modelopt":
        algo = q.get("quant_algo")
        dtype = {"FP8": "fp8", "NVFP4": "nvfp4"}.get(str(algo))
        if dtype is None:
            raise ConfigError(f"{where}.quant_algo={bounded_repr(algo)} is not allowed: FP8 or NVFP4")
        kept = q.get("exclude_modules") or q.get("ignore") or ["lm_head"]
        return dtype, _ignored_weights(kept, f"{where}.exclude_modules"), f"; {dtype} weights (modelopt)"
    raise ConfigError(f"{where}.quant_method={bounded_repr(method)} is not allowed: fp8, fbgemm_fp8, "
                      "compressed-tensors, awq, gptq or modelopt")


def model_from_hf_config(config: Mapping[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face ``config.json`` (already parsed).

    Args:
        config: the config's top-level mapping.
        name: the spec's name (a Hugging Face id, say).
        where: what errors name first (the file).

    Returns:
        A ModelSpec whose ``source`` says what was read and what was assumed; ``weight_dtype``
        from ``quantization_config`` (else ``torch_dtype``/``dtype`` float16 -> fp16, else bf16).

    Raises:
        ConfigError: not a mapping, an unknown or refused ``model_type``, a missing or malformed
            key the count needs, a feature kvsched does not model (named), or sizes ModelSpec
            refuses.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}: a config.json must be a JSON object, got {type(config).__name__}")
    outer = where
    cfg, where = _text_config(config, where)
    family = cfg.get("model_type", config.get("model_type"))
    if not isinstance(family, str):
        raise ConfigError(f"{_where_key(where, 'model_type')}={bounded_repr(family)} is not allowed: expected a "
                          f"string, one of {', '.join(FAMILIES)}")
    if family in ("llama4",):  # the wrapper's model_type: its text_config is missing or names none
        raise ConfigError(f"{where}: model_type 'llama4' needs a text_config with model_type 'llama4_text'")
    if family in _NOT_MODELLED:
        raise ConfigError(f"{where}: model_type={bounded_repr(family)} is not modelled: {_NOT_MODELLED[family]}")
    if family not in FAMILIES:
        raise ConfigError(f"{where}: model_type={bounded_repr(family)} is not allowed: one of {', '.join(FAMILIES)} "
                          "(or a preset: `kvsched presets`)")
    defaults = {**DENSE_FAMILIES.get(family, {}), **MOE_FAMILIES.get(family, {})}
    n_layers = _int(cfg, "num_hidden_layers", where, defaults)
    hidden = _int(cfg, "hidden_size", where, defaults)
    n_heads = _int(cfg, "num_attention_heads", where, defaults)
    kv_defaults = {**defaults, "num_key_value_heads": n_heads}
    n_kv = _int(cfg, "num_key_value_heads", where, kv_defaults)
    vocab = _int(cfg, "vocab_size", where, defaults)
    context = _int(cfg, "max_position_embeddings", where, defaults)
    tied = _bool(cfg, "tie_word_embeddings", where, defaults)
    context, rope_note = _rope_context(cfg, where, context)
    context, note = _check_windows(cfg, family, where, defaults, context, n_layers)
    note = rope_note + note
    moe: dict[str, Any] = {}
    kv_lora = rope = 0
    if family.startswith("deepseek"):
        attention, kv_lora, rope, head_dim = _mla_attention(cfg, where, defaults, hidden, n_heads)
        n_kv = n_heads  # MHA form for the FLOPs; the cache is the latent (ModelSpec.kv_bytes_per_token)
    else:
        head_dim = _int(cfg, "head_dim", where, {**defaults, "head_dim": hidden // n_heads})
        if n_heads % n_kv:
            raise ConfigError(f"{_where_key(where, 'num_key_value_heads')}={n_kv} is not allowed: a divisor of "
                              f"num_attention_heads={n_heads}")
        attention = _dense_attention(cfg, family, where, defaults, hidden, n_heads, n_kv, head_dim)
    norms = 2 * hidden
    if family in MOE_FAMILIES:
        moe = _moe_layout(cfg, family, where, defaults, hidden, n_layers)
        dense_width, extra = moe.pop("dense_width"), moe.pop("extra")
        n_moe = moe_layer_count(n_layers, moe["first_dense_layers"], moe["moe_layer_step"])
        per_moe_layer = (moe["n_experts"] + moe["n_shared_experts"]) * 3 * hidden * moe["expert_intermediate_size"]
        mlp = (n_layers - n_moe) * 3 * hidden * dense_width + n_moe * (per_moe_layer + extra)
    else:
        dense_width = _int(cfg, "intermediate_size", where, defaults)
        mlp = n_layers * 3 * hidden * dense_width
        if family in ("llama", "granite", "smollm3") and _bool(cfg, "mlp_bias", where, defaults):
            mlp += n_layers * (2 * dense_width + hidden)
    n_params = vocab * hidden * (1 if tied else 2) + n_layers * (attention + norms) + mlp + hidden
    chunk = cfg.get("attention_chunk_size", 8192) if family == "llama4_text" else None
    if chunk is not None:
        note += (f"; chunked local attention (attention_chunk_size {bounded_repr(chunk)}) on the RoPE layers not "
                 "modelled: full attention there, as for the Llama-4 presets")
    dtype, quantized, qnote = (_quantization(cfg, where) if "quantization_config" in cfg
                               else _quantization(config, outer))
    if not dtype:
        dtype, dnote = _checkpoint_dtype(cfg, config, where)
        qnote += dnote
    q = cfg.get("quantization_config", config.get("quantization_config"))
    if isinstance(q, Mapping) and (q.get("kv_cache_scheme") or q.get("kv_cache_quant_algo")):
        qnote += ("; the checkpoint's KV-cache quantization scales are not a KV dtype: the cache takes the "
                  "instance's kv_dtype (vLLM --kv-cache-dtype, default auto)")
    source = (f"{HF_CONFIG_SOURCE} ({where}; model_type {family}); n_params "
              f"computed from it ({n_params:,}){note}{qnote}")
    try:
        return ModelSpec(name, n_layers, hidden, n_heads, n_kv, head_dim, dense_width, vocab, float(n_params), context,
                         source, kv_lora_rank=kv_lora, qk_rope_head_dim=rope, weight_dtype=dtype,
                         quantized_weights=quantized, tied_embeddings=tied, **moe)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}
"""A checkpoint's ``torch_dtype`` -> weight dtype. vLLM's ``--dtype auto`` (``_get_and_verify_dtype``)
serves a float32 checkpoint, and one whose config gives no dtype, in bfloat16 since v0.10.1 (float16
before; bf16 and fp16 cost alike)."""


def _checkpoint_dtype(cfg: Mapping[str, Any], config: Mapping[str, Any], where: str) -> tuple[str, str]:
    """(weight dtype, note) of an unquantized checkpoint from ``torch_dtype`` (newer transformers:
    ``dtype``), on the text config or its wrapper; bf16, said in the note, when none is given."""
    for c in (cfg, config):
        for key in ("torch_dtype", "dtype"):
            value = c.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or value not in _TORCH_DTYPES:
                raise ConfigError(f"{_where_key(where, key)}={bounded_repr(value)} is not allowed: one of "
                                  f"{', '.join(_TORCH_DTYPES)} (or a quantization_config)")
            return _TORCH_DTYPES[value], ""
    return "bf16", "; no torch_dtype: bf16 weights (vLLM's --dtype auto)"


def read_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """:func:`model_from_hf_config` of a ``config.json`` file, or of the ``config.json`` in a directory
    (a downloaded checkpoint). ``name`` defaults to the directory's name (:func:`_checkpoint_name`).

    Raises:
        ConfigError: no such file, larger than :data:`MAX_CONFIG_BYTES`, not UTF-8 JSON (duplicate
            keys refused), or what :func:`model_from_hf_config` raises (naming the file).
    """
    p = Path(os.path.abspath(path))  # one spelling per file: ./x and x give equal specs (symlinks kept)
    if p.is_dir():
        p = p / "config.json"
    shown = bounded_repr(str(p), MAX_PATH_CHARS)
    if not p.is_file():
        where = ("" if Path(path).is_absolute() else
                 f"; {bounded_repr(str(path), MAX_PATH_CHARS)} is relative, so taken from the working directory "
                 "(not from a scenario file's folder)")
        raise ConfigError(f"{shown}: no such file (give a Hugging Face config.json or the directory holding one"
                          f"{where})")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{shown}: {p.stat().st_size:,} bytes is too large for a config.json (at most "
                          f"{MAX_CONFIG_BYTES:,})")
    try:
        config = strict_json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{shown}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{shown}: invalid JSON: {bounded_repr(str(e) or 'nested too deeply')[1:-1]}") from None
    return model_from_hf_config(config, name or _checkpoint_name(p), shown)


def _checkpoint_name(config_file: Path) -> str:
    """The name of the checkpoint holding ``config_file``: its directory's name, symlinks not
    followed (the Hugging Face cache links ``snapshots/<revision>/config.json`` to
    ``blobs/<hash>``), or the repo name of a cache snapshot (``models--<org>--<name>/snapshots/
    <revision>/``)."""
    d = Path(os.path.abspath(config_file)).parent
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent.name.rsplit("--", 1)[-1]
    return d.name
