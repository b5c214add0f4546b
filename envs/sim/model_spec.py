"""Model specs: the architecture numbers the cost model and KV sizing need, and model presets.

Sources (cited per number): REFERENCE = ``shared/design/REFERENCE.md`` §5.1 (model table);
HF = the model's Hugging Face ``config.json`` (parameter counts computed from the config:
embeddings + per-layer attention/MLP/norm weights + untied ``lm_head``, equal to the
safetensors totals the model cards report).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import require
from .registry import Registry
from .spec_validation import int_at_least, real_in, string

DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
"""Bytes per element of the weight / KV dtypes we model (vLLM ``--dtype``, ``--kv-cache-dtype``)."""

WEIGHT_DTYPES = ("bf16", "fp16", "fp8")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a dense decoder-only transformer (what the cost model and KV sizing need).

    Attributes:
        name: preset / display name.
        n_layers: decoder layers (HF ``num_hidden_layers``).
        hidden_size: residual width (HF ``hidden_size``).
        n_heads: query heads (HF ``num_attention_heads``).
        n_kv_heads: K/V heads (HF ``num_key_value_heads``; = n_heads for MHA). Must divide n_heads.
        head_dim: per-head width (HF ``head_dim``, else hidden_size / n_heads). It need not
            equal hidden_size / n_heads (Mistral-Nemo: 32 x 128 = 4096 < 5120).
        intermediate_size: MLP width (HF ``intermediate_size``).
        vocab_size: vocabulary size (HF ``vocab_size``).
        n_params: total parameters including the input embedding and an untied lm_head.
        max_context_tokens: longest context the model supports (HF ``max_position_embeddings``
            unless the preset docstring says otherwise); vLLM's default ``max_model_len``.
        source: where the numbers come from.

    Raises:
        ConfigError: a non-positive size, n_heads not a multiple of n_kv_heads, or n_params not
            larger than the embedding table.
    """

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    n_params: float
    max_context_tokens: int
    source: str = ""

    def __post_init__(self) -> None:
        owner = f"ModelSpec({self.name!r})"
        string("ModelSpec", "name", self.name)
        require(bool(self.name), "ModelSpec.name", self.name, "a non-empty string")
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_context_tokens"):
            int_at_least(owner, name, getattr(self, name), 1)
        require(self.n_heads % self.n_kv_heads == 0, f"{owner}.n_kv_heads", self.n_kv_heads,
                f"a divisor of n_heads={self.n_heads} (grouped-query attention)")
        real_in(owner, "n_params", self.n_params, lambda x: x > self.vocab_size * self.hidden_size,
              f"a number > vocab_size*hidden_size = {self.vocab_size * self.hidden_size:.4g} "
              "(the input embedding alone)")
        string(owner, "source", self.source)

    @property
    def matmul_params(self) -> float:
        """Parameters used in matmuls per token: all but the input embedding (lm_head included).

        REFERENCE §5.1: per-token forward matmul FLOPs ≈ 2 · matmul_params.
        """
        return float(self.n_params) - float(self.vocab_size) * float(self.hidden_size)

    def weight_bytes(self, dtype_bytes: float = 2.0) -> float:
        """Bytes of all weights at ``dtype_bytes`` per parameter (whole model, all TP ranks)."""
        return float(self.n_params) * float(dtype_bytes)

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """KV bytes of one token over all layers: 2 · n_layers · n_kv_heads · head_dim · bytes.

        REFERENCE §5.1 ("KV/token"), whole model (all TP ranks together).
        """
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * float(kv_dtype_bytes)

    @property
    def attn_flops_per_pair(self) -> float:
        """Attention FLOPs per (query token, context token) pair: 4 · n_layers · n_heads · head_dim.

        QK^T and AV each cost 2 FLOPs per multiply-add (REFERENCE §5.1/§5.3).
        """
        return 4.0 * self.n_layers * self.n_heads * self.head_dim


_HF_COUNT = "n_params computed from HF config.json (equals the safetensors total)"

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, 6_738_415_616, 4096,
                  "HF meta-llama/Llama-2-7b-hf config.json (MHA, ctx 4096); " + _HF_COUNT),
        ModelSpec("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000, 68_976_648_192, 4096,
                  "HF meta-llama/Llama-2-70b-hf config.json (GQA 8, ctx 4096); " + _HF_COUNT),
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8_030_261_248, 131072,
                  "REFERENCE §5.1 (8.03 B); HF meta-llama/Llama-3.1-8B config.json; " + _HF_COUNT),
        ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, 70_553_706_496, 131072,
                  "REFERENCE §5.1 (70.6 B); HF meta-llama/Llama-3.1-70B config.json; " + _HF_COUNT),
        ModelSpec("Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256, 405_853_388_800, 131072,
                  "REFERENCE §5.1 (405.9 B); HF meta-llama/Llama-3.1-405B config.json; " + _HF_COUNT),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, 7_615_616_512, 32768,
                  "REFERENCE §5.1 (7.62 B); HF Qwen/Qwen2.5-7B-Instruct config.json; ctx = "
                  "max_position_embeddings 32768 (131072 only with YaRN rope scaling, not modelled); "
                  + _HF_COUNT + " (QKV bias included)"),
        ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, 72_706_203_648, 32768,
                  "REFERENCE §5.1 (72.7 B); HF Qwen/Qwen2.5-72B-Instruct config.json; ctx 32768 "
                  "(131072 only with YaRN, not modelled); " + _HF_COUNT + " (QKV bias included)"),
        ModelSpec("Mistral-Nemo-12B", 40, 5120, 32, 8, 128, 14336, 131072, 12_247_782_400, 131072,
                  "HF mistralai/Mistral-Nemo-Instruct-2407 config.json (head_dim 128 != 5120/32); "
                  "ctx = the model card's 128k window (config max_position_embeddings is 1024000); "
                  + _HF_COUNT),
        ModelSpec("Yi-34B", 60, 7168, 56, 8, 128, 20480, 64000, 34_388_917_248, 4096,
                  "HF 01-ai/Yi-34B config.json (ctx 4096); " + _HF_COUNT),
    )
}
"""Model presets. Sources: each spec's ``source`` (REFERENCE §5.1 and HF config.json)."""

MODEL_ALIASES: dict[str, str] = {
    "meta-llama/llama-2-7b-hf": "Llama-2-7B",
    "meta-llama/llama-2-7b-chat-hf": "Llama-2-7B",
    "llama-2-7b-hf": "Llama-2-7B",
    "meta-llama/llama-2-70b-hf": "Llama-2-70B",
    "meta-llama/llama-2-70b-chat-hf": "Llama-2-70B",
    "llama-2-70b-hf": "Llama-2-70B",
    "meta-llama/llama-3.1-8b": "Llama-3.1-8B",
    "meta-llama/llama-3.1-8b-instruct": "Llama-3.1-8B",
    "meta-llama/llama-3.1-70b": "Llama-3.1-70B",
    "meta-llama/llama-3.1-70b-instruct": "Llama-3.1-70B",
    "meta-llama/llama-3.1-405b": "Llama-3.1-405B",
    "meta-llama/llama-3.1-405b-instruct": "Llama-3.1-405B",
    "qwen/qwen2.5-7b": "Qwen2.5-7B",
    "qwen/qwen2.5-7b-instruct": "Qwen2.5-7B",
    "qwen/qwen2.5-72b": "Qwen2.5-72B",
    "qwen/qwen2.5-72b-instruct": "Qwen2.5-72B",
    "mistralai/mistral-nemo-instruct-2407": "Mistral-Nemo-12B",
    "mistralai/mistral-nemo-base-2407": "Mistral-Nemo-12B",
    "01-ai/yi-34b": "Yi-34B",
}
"""Hugging Face repo ids (lower-case) accepted by :func:`get_model` (as named in GT files)."""

MODELS: Registry[ModelSpec] = Registry("model", MODEL_PRESETS, MODEL_ALIASES)
"""The model presets by name (case-insensitive) and Hugging Face repo id."""


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive; HF repo ids of :data:`MODEL_ALIASES` too).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return MODELS.get(name)
