"""Model specs: the architecture numbers the cost model and KV sizing need, and model presets.

Sources (cited per number): REFERENCE = ``shared/design/REFERENCE.md`` §5.1 (model table);
HF = the model's Hugging Face ``config.json`` (parameter counts computed from the config:
embeddings + per-layer attention/MLP/norm weights + the ``lm_head`` unless it is tied to the
embedding, equal to the safetensors totals the model cards report; :mod:`.hf_config` computes them
from a config.json).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from .errors import UnknownPresetError, require
from .registry import Registry
from .spec_validation import int_at_least, int_in, real_in, string

DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "nvfp4": 0.5625, "int8": 1.0,
                                  "int4": 0.515625}
"""Bytes per element of the weight / KV dtypes we model (vLLM ``--dtype``, ``--kv-cache-dtype``,
quantized checkpoints). NVFP4: a 4-bit E2M1 value per element plus one FP8 (E4M3) scale per
16-element block = 4.5 bits (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision
Inference", developer blog, June 2025; the per-tensor FP32 scale is negligible). int8: W8A8
checkpoints (one int8 per weight, per-channel scales negligible; LLM Compressor's ``W8A8`` scheme,
vLLM's compressed-tensors ``CompressedTensorsW8A8Int8``). int4: W4A16 checkpoints, a 4-bit weight
plus one 16-bit scale per group of 128 = 4.125 bits (LLM Compressor's ``W4A16`` scheme, symmetric,
group size 128; vLLM ``CompressedTensorsWNA16`` with the Marlin kernels)."""

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "nvfp4", "int8", "int4")
"""Weight dtypes of :class:`ModelSpec` (the checkpoint's) and ``InstanceSpec.weight_dtype``."""
KV_DTYPES = ("auto", "bf16", "fp16", "fp8")
QUANTIZED_WEIGHTS = ("all", "mlp", "linear")
"""Which weights a quantized checkpoint stores in its ``weight_dtype`` (:attr:`ModelSpec.quantized_weights`)."""
MAX_MODEL_SIZE = 1 << 40
"""Largest value of a :class:`ModelSpec` size field (layers, widths, heads, vocabulary, context
length): 2**40, far above any model (a 10M-token context is 2**23.3) and small enough that the
products the cost model forms stay exact-ish float64 numbers instead of overflowing."""
MAX_EXPERTS = 1024
"""Most routed experts :attr:`ModelSpec.n_experts` accepts (the largest presets have 256,
DeepSeek-V3; Kimi-K2 has 384). The skewed-routing table costs O(n_experts x 65536) once per
model (about 4 s at 1024 with a steep skew), so the bound also keeps a typo from hanging a run."""
MAX_ROUTING_SKEW = 8.0
"""Largest Zipf exponent accepted for :attr:`ModelSpec.routing_skew`."""

_TABLE_CAP = 1 << 16
"""Longest expected-distinct-experts table: steps of more tokens use its last entry (within
2**-40 of the limit for every preset, whose tables saturate below 2,000 tokens)."""


def routing_shares(n_experts: int, skew: float) -> np.ndarray:
    """Routing shares p_i of ``n_experts`` experts under a Zipf law of exponent ``skew``:
    p_i ∝ (i + 1)^-skew, i = 0..E−1, summing to 1, largest first (``skew = 0``: uniform 1/E)."""
    w = np.arange(1, n_experts + 1, dtype=np.float64) ** -float(skew)
    return w / w.sum()


@functools.lru_cache(maxsize=64)
def distinct_experts_table(n_experts: int, experts_per_token: int, skew: float) -> np.ndarray:
    """D(n) for n = 0, 1, ..., N (:meth:`ModelSpec.expected_distinct_experts`), a read-only float64
    array; N is where D(n) reaches its limit to within 2**-40 (relative), at most
    :data:`_TABLE_CAP`. Computed once per (E, k, skew) and shared."""
    E, k = int(n_experts), int(experts_per_token)
    if skew == 0:
        q = np.array([k / E])
        counts = np.array([float(E)])
    else:
        q = np.minimum(k * routing_shares(E, skew), 1.0)
        counts = np.ones(E)
    q_min = float(q.min())
    n_max = 1 if q_min >= 1.0 else min(_TABLE_CAP, int(math.ceil(40.0 * math.log(2.0) / -math.log1p(-q_min))) + 1)
    n = np.arange(n_max + 1, dtype=np.float64)
    table = np.zeros(n_max + 1)
    for qi, c in zip(q, counts):
        table += c * (1.0 - np.power(1.0 - qi, n))
    table.setflags(write=False)
    return table


def moe_layer_count(n_layers: int, first_dense_layers: int, moe_layer_step: int) -> int:
    """MoE layers among ``n_layers``: layers i >= first_dense_layers with (i + 1) % moe_layer_step
    == 0 (:attr:`ModelSpec.n_moe_layers`), i.e. the multiples of the step among layer numbers
    i + 1 in [first_dense_layers + 1, n_layers]."""
    return max(0, n_layers // moe_layer_step - first_dense_layers // moe_layer_step)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, dense or mixture-of-experts (what the cost
    model and KV sizing need).

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
        n_params: total parameters including the input embedding and the lm_head (counted once
            when ``tied_embeddings``).
        max_context_tokens: longest context the model supports (HF ``max_position_embeddings``
            unless the preset docstring says otherwise); vLLM's default ``max_model_len``.
        source: where the numbers come from.

    Mixture of experts (all 0 = a dense model; HF names per family in brackets):
        n_experts: routed experts per MoE layer, E (``num_local_experts`` Mixtral/Llama-4,
            ``num_experts`` Qwen-MoE, ``n_routed_experts`` DeepSeek). 0 = dense; at most
            :data:`MAX_EXPERTS`.
        experts_per_token: routed experts each token activates, top-k (``num_experts_per_tok``),
            1 <= k <= E.
        expert_intermediate_size: width of one expert's gated MLP (``moe_intermediate_size``;
            Mixtral and Llama-4 ``intermediate_size``). One expert holds 3·hidden·width weights.
        n_shared_experts: experts every token runs besides its top-k (``n_shared_experts``
            DeepSeek; Llama-4 1; Qwen1.5-MoE ``shared_expert_intermediate_size`` / width), each
            ``expert_intermediate_size`` wide.
        first_dense_layers: leading layers with a dense MLP of ``intermediate_size``
            (DeepSeek ``first_k_dense_replace``), 0 <= it < n_layers.
        moe_layer_step: after those, every ``moe_layer_step``-th layer is MoE and the others dense
            (Llama-4 ``interleave_moe_layer_step``: layer i is MoE when (i + 1) % step == 0,
            vLLM ``llama4.py``; 1 = all). :attr:`n_moe_layers` counts them.
        routing_skew: Zipf exponent s of the routing distribution (expert i, 0-based, receives a
            share proportional to (i + 1)^-s of the routed token slots); 0 (default) = uniform
            routing. Used only for the expected number of distinct experts a step reads
            (:meth:`expected_distinct_experts`); needs k·(largest share) <= 1.

    Attention and precision:
        kv_lora_rank, qk_rope_head_dim: multi-head latent attention (DeepSeek-V2/V3 MLA): each
            token caches one latent vector of ``kv_lora_rank`` plus one shared RoPE key of
            ``qk_rope_head_dim`` per layer instead of per-head K and V (DeepSeek-V3 technical
            report, arXiv 2412.19437, §2.1.1; vLLM's MLA cache holds exactly these
            ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, replicated on every
            TP rank). 0, 0 = standard (grouped-query) attention.
        weight_dtype: the checkpoint's dtype for its quantized weights (one of
            :data:`WEIGHT_DTYPES`; "bf16" for an unquantized checkpoint). vLLM loads a quantized
            checkpoint as it is stored; ``InstanceSpec.weight_dtype = "auto"`` takes this value.
        quantized_weights: which weights are stored in ``weight_dtype``: "all" (every parameter,
            the approximation for natively quantized checkpoints), "mlp" (the dense MLPs and
            experts only; attention projections, router, embeddings and lm_head stay bf16, e.g.
            RedHatAI's Llama-4 FP8-dynamic ``quantization_config.ignore`` list) or "linear" (every
            Linear layer of the decoder; the input embedding and lm_head stay bf16: LLM
            Compressor's recipes, ``ignore: ["lm_head"]``, as in RedHatAI's ``-FP8-dynamic``,
            ``-quantized.w8a8`` and ``-quantized.w4a16`` checkpoints).
        tied_embeddings: the lm_head is the input embedding's table (HF ``tie_word_embeddings``:
            Granite-3.x, Qwen2.5 up to 3B, Llama-3.2 1B/3B, Gemma): the table is stored once (in
            ``n_params`` and the weight bytes once) and still read as the lm_head's matmul every
            step (vLLM ``ParallelLMHead.tie_weights``: the lm_head shares the embedding's tensor).

    Every integer size is at most :data:`MAX_MODEL_SIZE` (2**40).

    Raises:
        ConfigError: a non-positive or too large size, n_heads not a multiple of n_kv_heads, n_params not
            larger than the embedding table (plus the routed experts), MoE fields on a dense
            model or out of range, a RoPE dimension without a latent rank, an unknown dtype.
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
    n_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    moe_layer_step: int = 1
    routing_skew: float = 0.0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    weight_dtype: str = "bf16"
    quantized_weights: str = "all"
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        owner = f"ModelSpec({self.name!r})"
        string("ModelSpec", "name", self.name)
        require(bool(self.name), "ModelSpec.name", self.name, "a non-empty string")
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_context_tokens"):
            int_in(owner, name, getattr(self, name), 1, MAX_MODEL_SIZE, "2**40")
        require(self.n_heads % self.n_kv_heads == 0, f"{owner}.n_kv_heads", self.n_kv_heads,
                f"a divisor of n_heads={self.n_heads} (grouped-query attention)")
        self._check_moe(owner)
        floor = self.vocab_size * self.hidden_size + self.routed_expert_params
        real_in(owner, "n_params", self.n_params, lambda x: x > floor,
                f"a number > {floor:.4g} (the input embedding"
                + (" plus the routed experts)" if self.n_experts else " alone)"))
        string(owner, "source", self.source)
        require(isinstance(self.tied_embeddings, bool), f"{owner}.tied_embeddings", self.tied_embeddings,
                "true or false")
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            int_in(owner, name, getattr(self, name), 0, MAX_MODEL_SIZE, "2**40")
        require(self.qk_rope_head_dim == 0 or self.kv_lora_rank > 0, f"{owner}.qk_rope_head_dim",
                self.qk_rope_head_dim, "0 unless kv_lora_rank > 0 (a latent-attention RoPE key)")
        require(self.weight_dtype in WEIGHT_DTYPES, f"{owner}.weight_dtype", self.weight_dtype,
                f"one of {', '.join(WEIGHT_DTYPES)}")
        require(self.quantized_weights in QUANTIZED_WEIGHTS, f"{owner}.quantized_weights",
                self.quantized_weights, f"one of {', '.join(QUANTIZED_WEIGHTS)}")
        if self.quantized_weights != "all":  # the quantized share is part of the matmul weights
            q, matmul = self.quantized_params, self.matmul_params
            require(0 < q <= matmul, f"{owner}.n_params", self.n_params,
                    f"a count whose {self.quantized_weights!r}-quantized weights ({q:.4g}) lie in (0, "
                    f"{matmul:.4g}], the weights but the input embedding"
                    + (f" (n_params > {1 if self.tied_embeddings else 2} x vocab_size x hidden_size: "
                       "embedding and lm_head stay bf16)" if self.quantized_weights == "linear" else ""))

    def _check_moe(self, owner: str) -> None:
        """The mixture-of-experts fields: all neutral on a dense model, in range on an MoE one."""
        moe_ints = ("n_experts", "experts_per_token", "expert_intermediate_size", "n_shared_experts",
                    "first_dense_layers")
        int_in(owner, "n_experts", self.n_experts, 0, MAX_EXPERTS, "the most experts kvsched models")
        for name in moe_ints[1:]:
            int_in(owner, name, getattr(self, name), 0, MAX_MODEL_SIZE, "2**40")
        int_in(owner, "moe_layer_step", self.moe_layer_step, 1, MAX_MODEL_SIZE, "2**40")
        real_in(owner, "routing_skew", self.routing_skew, lambda x: 0 <= x <= MAX_ROUTING_SKEW,
                f"a number in [0, {MAX_ROUTING_SKEW:g}] (Zipf exponent; 0 = uniform routing)")
        if self.n_experts == 0:
            for name in moe_ints[1:]:
                require(getattr(self, name) == 0, f"{owner}.{name}", getattr(self, name),
                        "0 on a dense model (set n_experts > 0 for mixture of experts)")
            require(self.moe_layer_step == 1, f"{owner}.moe_layer_step", self.moe_layer_step,
                    "1 on a dense model (set n_experts > 0 for mixture of experts)")
            require(self.routing_skew == 0, f"{owner}.routing_skew", self.routing_skew,
                    "0 on a dense model (set n_experts > 0 for mixture of experts)")
            return
        require(1 <= self.experts_per_token <= self.n_experts, f"{owner}.experts_per_token",
                self.experts_per_token, f"an integer in [1, n_experts={self.n_experts}]")
        int_at_least(owner, "expert_intermediate_size", self.expert_intermediate_size, 1)
        require(self.first_dense_layers < self.n_layers, f"{owner}.first_dense_layers", self.first_dense_layers,
                f"an integer in [0, n_layers={self.n_layers}) (at least one MoE layer)")
        require(self.n_moe_layers >= 1, f"{owner}.moe_layer_step", self.moe_layer_step,
                f"a step leaving at least one MoE layer among layers {self.first_dense_layers}..{self.n_layers - 1}")
        top = self.experts_per_token * float(routing_shares(self.n_experts, float(self.routing_skew))[0])
        require(top <= 1.0 + 1e-12, f"{owner}.routing_skew", self.routing_skew,
                f"a skew whose busiest expert gets <= 1/k of the token slots (k={self.experts_per_token}; "
                f"this one: {top:.3g}/k)")

    # ------------------------------------------------------------------ mixture of experts

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model (``n_experts > 0``)."""
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE layers: layers i >= first_dense_layers with (i + 1) % moe_layer_step == 0
        (0 for a dense model). Llama-4 convention (vLLM ``llama4.py``); step 1 = every layer."""
        if not self.n_experts:
            return 0
        return moe_layer_count(self.n_layers, self.first_dense_layers, self.moe_layer_step)

    @property
    def expert_params(self) -> float:
        """Weights of one expert in one layer: gate, up and down projections, 3·hidden·width."""
        return 3.0 * self.hidden_size * self.expert_intermediate_size

    @property
    def routed_expert_params(self) -> float:
        """Weights of all routed experts of all MoE layers: n_moe_layers · E · expert_params."""
        return float(self.n_moe_layers) * self.n_experts * self.expert_params

    @property
    def mlp_params(self) -> float:
        """Weights of all MLPs: dense layers' gated MLPs (3·hidden·intermediate_size) plus every
        MoE layer's routed and shared experts."""
        n_dense = self.n_layers - self.n_moe_layers
        return (n_dense * 3.0 * self.hidden_size * self.intermediate_size
                + self.n_moe_layers * (self.n_experts + self.n_shared_experts) * self.expert_params)

    @property
    def active_matmul_params(self) -> float:
        """Matmul weights one token uses: :attr:`matmul_params` less the routed experts it does
        not activate, n_moe_layers · (E − k) · expert_params (= matmul_params for dense models)."""
        return self.matmul_params - float(self.n_moe_layers) * (self.n_experts - self.experts_per_token) \
            * self.expert_params

    def expected_distinct_experts(self, n_tokens: int) -> float:
        """Expected number of distinct routed experts ``n_tokens`` tokens activate in one MoE layer.

        Uniform routing (``routing_skew == 0``), each token choosing a uniformly random set of k of
        the E experts independently: expert i is missed by one token with probability 1 − k/E, by
        all n with (1 − k/E)^n, so by linearity of expectation (the occupancy problem; Feller,
        *An Introduction to Probability Theory*, vol. 1, ch. IV)

            D(n) = E · (1 − (1 − k/E)^n),          D(1) = k,   D(n) -> E as n -> inf.

        With a skew, expert i is chosen by a token with probability q_i = k·p_i (p_i the Zipf
        shares of :func:`routing_shares`) and D(n) = Σ_i (1 − (1 − q_i)^n) (the same argument,
        treating a token's k picks as independent draws of each expert). 0 for a dense model.

        Raises:
            ConfigError: ``n_tokens`` not an integer >= 0.
        """
        int_at_least(f"ModelSpec({self.name!r})", "expected_distinct_experts(n_tokens)", n_tokens, 0)
        if not self.n_experts:
            return 0.0
        table = distinct_experts_table(self.n_experts, self.experts_per_token, float(self.routing_skew))
        return float(table[min(int(n_tokens), len(table) - 1)])

    @property
    def matmul_params(self) -> float:
        """Parameters used in matmuls per token: all but the input embedding (lm_head included;
        a tied lm_head is the embedding's table, so then all of ``n_params``).

        REFERENCE §5.1: per-token forward matmul FLOPs ≈ 2 · matmul_params.
        """
        if self.tied_embeddings:
            return float(self.n_params)
        return float(self.n_params) - float(self.vocab_size) * float(self.hidden_size)

    @property
    def active_params(self) -> float:
        """Parameters one token touches: :attr:`active_matmul_params` plus the input embedding's
        table unless the lm_head (already counted) is tied to it."""
        embedding = 0.0 if self.tied_embeddings else float(self.vocab_size) * float(self.hidden_size)
        return self.active_matmul_params + embedding

    @property
    def lm_head_params(self) -> float:
        """Weights the lm_head reads, vocab_size · hidden_size (the embedding's table when tied)."""
        return float(self.vocab_size) * float(self.hidden_size)

    @property
    def quantized_params(self) -> float:
        """Weights stored in :attr:`weight_dtype`: all of them ("all"), :attr:`mlp_params` ("mlp"),
        or every decoder Linear layer, n_params less the input embedding and the lm_head ("linear")."""
        if self.quantized_weights == "mlp":
            return self.mlp_params
        if self.quantized_weights == "linear":
            return self.matmul_params - self.lm_head_params
        return float(self.n_params)

    def weight_bytes(self, dtype_bytes: float = 2.0) -> float:
        """Bytes of all weights (whole model, all TP ranks) when the quantized weights take
        ``dtype_bytes`` per parameter: n_params · dtype_bytes with ``quantized_weights == "all"``;
        otherwise :attr:`quantized_params` · dtype_bytes + the rest at 2 bytes (bf16)."""
        if self.quantized_weights != "all":
            q = self.quantized_params
            return (float(self.n_params) - q) * 2.0 + q * float(dtype_bytes)
        return float(self.n_params) * float(dtype_bytes)

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """KV bytes of one token over all layers, whole model (all TP ranks together).

        Grouped-query attention: 2 · n_layers · n_kv_heads · head_dim · bytes (REFERENCE §5.1,
        "KV/token"). Latent attention (MLA): n_layers · (kv_lora_rank + qk_rope_head_dim) · bytes,
        the compressed latent and the shared RoPE key (DeepSeek-V3 report §2.1.1; vLLM MLA
        backends' ``head_size = kv_lora_rank + qk_rope_head_dim``, one per token and layer).
        """
        if self.kv_lora_rank:
            return float(self.n_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * float(kv_dtype_bytes)
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * float(kv_dtype_bytes)

    @property
    def attn_flops_per_pair(self) -> float:
        """Attention FLOPs per (query token, context token) pair: 4 · n_layers · n_heads · head_dim.

        QK^T and AV each cost 2 FLOPs per multiply-add (REFERENCE §5.1/§5.3).
        """
        return 4.0 * self.n_layers * self.n_heads * self.head_dim


_HF_COUNT = "n_params computed from HF config.json (equals the safetensors total)"

_LLAMA4_SCOUT = ModelSpec(
    "Llama-4-Scout-17B-16E", 48, 5120, 40, 8, 128, 16384, 202048, 107_769_861_120, 10485760,
    "HF meta-llama/Llama-4-Scout-17B-16E-Instruct config.json text_config (16 experts of "
    "8192 + 1 shared, top-1, interleave_moe_layer_step 1; intermediate_size_mlp 16384 for "
    "dense layers, none here; chunked local attention of 8192 tokens on 3 of 4 layers is "
    "not modelled: same KV as full attention below 8192 tokens); text model only (the "
    "vision encoder is not run for text prompts); " + _HF_COUNT + " (107.8 B; 109 B "
    "with the vision encoder)",
    n_experts=16, experts_per_token=1, expert_intermediate_size=8192, n_shared_experts=1)
_LLAMA4_MAVERICK = ModelSpec(
    "Llama-4-Maverick-17B-128E", 48, 5120, 40, 8, 128, 16384, 202048, 400_711_848_960, 1048576,
    "HF meta-llama/Llama-4-Maverick-17B-128E-Instruct config.json text_config (128 experts of "
    "8192 + 1 shared, top-1, interleave_moe_layer_step 2: layers 1, 3, ..., 47 are MoE, the "
    "others dense with intermediate_size_mlp 16384; chunked local attention of 8192 tokens on 3 "
    "of 4 layers not modelled, as for Scout); text model only; " + _HF_COUNT + " (400.7 B, 17.2 B "
    "active; published 400 B / 17 B)",
    n_experts=128, experts_per_token=1, expert_intermediate_size=8192, n_shared_experts=1, moe_layer_step=2)
"""The Llama-4 text models; their FP8 checkpoints below are these with FP8 MLP/expert weights."""

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
        ModelSpec("CodeLlama-34B", 48, 8192, 64, 8, 128, 22016, 32000, 33_743_970_304, 16384,
                  "HF codellama/CodeLlama-34b-Instruct-hf config.json (GQA 8, rope_theta 1e6, ctx = "
                  "max_position_embeddings 16384; copy in inference-sim/inference-sim@f90a1e3a "
                  "model_configs/codellama-34b-instruct-hf); n_params computed from the config (33.7 B published)"),
        ModelSpec("Qwen3-14B", 40, 5120, 40, 8, 128, 17408, 151936, 14_768_307_200, 40960,
                  "HF Qwen/Qwen3-14B config.json (GQA 8, head_dim 128, QK-norm, no QKV bias, untied "
                  "lm_head, ctx 40960 without YaRN; copy in inference-sim/inference-sim@f90a1e3a "
                  "model_configs/qwen3-14b); n_params computed from the config, QK-norm weights included (14.8 B "
                  "published)"),
        ModelSpec("Phi-4", 40, 5120, 40, 10, 128, 17920, 100352, 14_659_507_200, 16384,
                  "HF microsoft/phi-4 config.json (Phi3ForCausalLM: fused qkv and gate_up projections, "
                  "GQA 10, head_dim 128, ctx 16384, untied lm_head); n_params computed from the config "
                  "(14.7 B published)"),
        ModelSpec("Mistral-Small-24B", 40, 5120, 32, 8, 128, 32768, 131072, 23_572_403_200, 32768,
                  "HF mistralai/Mistral-Small-24B-Instruct-2501 config.json (GQA 8, head_dim 128 != "
                  "5120/32, ctx 32768, untied lm_head); n_params computed from the config: 23,572,403,200, "
                  "the text model's published count (24 B with Mistral-Small-3.1's vision encoder)"),
        ModelSpec("Mistral-Small-3.1-24B", 40, 5120, 32, 8, 128, 32768, 131072, 23_572_403_200, 131072,
                  "HF mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json text_config (the text "
                  "model of Mistral-Small-24B with a 131072-token context; the 0.44 B vision encoder is "
                  "not run for text prompts and its profiling before KV sizing is not modelled)"),
        ModelSpec("Granite-3.1-8B", 40, 4096, 32, 8, 128, 12800, 49155, 8_170_848_256, 131072,
                  "HF ibm-granite/granite-3.1-8b-instruct config.json (GraniteForCausalLM: GQA 8, head_dim "
                  "128, no biases, tie_word_embeddings true, ctx 131072; its embedding/attention/residual/"
                  "logits multipliers are scalars, no weights); n_params computed from the config, the "
                  "embedding counted once (8.17 B published)", tied_embeddings=True),
        ModelSpec("Qwen2.5-3B", 36, 2048, 16, 2, 128, 11008, 151936, 3_085_938_688, 32768,
                  "HF Qwen/Qwen2.5-3B-Instruct config.json (GQA 2, QKV bias, tie_word_embeddings true, ctx "
                  "32768, use_sliding_window false); n_params computed from the config, the embedding counted "
                  "once (3.09 B total, 2.77 B without the embedding, Qwen2.5 technical report Table 1)",
                  tied_embeddings=True),
        ModelSpec("SmolLM3-3B", 36, 2048, 16, 4, 128, 11008, 128256, 3_075_098_624, 65536,
                  "HF HuggingFaceTB/SmolLM3-3B config.json (SmolLM3ForCausalLM, a Llama block: GQA with 4 "
                  "KV heads, head_dim 128, no biases, tie_word_embeddings true, ctx 65536; its NoPE layers "
                  "(no RoPE on every 4th layer) change no weight or cost); n_params computed from the config, "
                  "the embedding counted once (3.08 B published)", tied_embeddings=True),
        # ---- mixture of experts (n_params: every expert counted; intermediate_size = the dense
        # layers' MLP width, unused where every layer is MoE)
        ModelSpec("Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, 46_702_792_704, 32768,
                  "HF mistralai/Mixtral-8x7B-v0.1 config.json (8 experts of 14336, top-2, every layer "
                  "MoE, GQA 8, no sliding window; also in GT's source repo inference-sim/inference-sim "
                  "model_configs/mixtral-8x7b-v0.1); " + _HF_COUNT + " (46.7 B)",
                  n_experts=8, experts_per_token=2, expert_intermediate_size=14336),
        ModelSpec("Mixtral-8x22B", 56, 6144, 48, 8, 128, 16384, 32000, 140_620_634_112, 65536,
                  "HF mistralai/Mixtral-8x22B-v0.1 config.json (8 experts of 16384, top-2, GQA 8, "
                  "vocab 32000; the Instruct repo has 32768); " + _HF_COUNT + " (140.6 B)",
                  n_experts=8, experts_per_token=2, expert_intermediate_size=16384),
        ModelSpec("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 6144, 151936, 30_532_122_624, 40960,
                  "HF Qwen/Qwen3-30B-A3B config.json (128 experts of 768, top-8, decoder_sparse_step 1, "
                  "no shared expert, head_dim 128 != 2048/32, QK-norm; also inference-sim/inference-sim "
                  "model_configs/qwen3-30b-a3b); " + _HF_COUNT + " (30.5 B, 3.3 B active)",
                  n_experts=128, experts_per_token=8, expert_intermediate_size=768),
        _LLAMA4_SCOUT,
        dataclasses.replace(
            _LLAMA4_SCOUT, name="Llama-4-Scout-17B-16E-FP8", weight_dtype="fp8", quantized_weights="mlp",
            source="HF RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic config.json (copy in "
                   "inference-sim/inference-sim model_configs/llama-4-scout-17b-16e-instruct-fp8-dynamic): "
                   "Llama-4-Scout-17B-16E with FP8 weights (per channel) and dynamic per-token FP8 "
                   "activations on the MLP/expert Linear layers; quantization_config.ignore keeps "
                   "attention q/k/v/o, routers, lm_head (and the vision model) in bf16"),
        _LLAMA4_MAVERICK,
        dataclasses.replace(
            _LLAMA4_MAVERICK, name="Llama-4-Maverick-17B-128E-FP8", weight_dtype="fp8", quantized_weights="mlp",
            source="HF meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8: Llama-4-Maverick-17B-128E with FP8 "
                   "weights on the MLP/expert Linear layers, attention, routers and lm_head bf16, modelled as "
                   "RedHatAI's Scout FP8-dynamic checkpoint (quantized_weights 'mlp'; the checkpoint's own module "
                   "list was not at hand: read its config.json with kvsched.envs.sim.hf_config for it)"),
        ModelSpec("DeepSeek-V2-Lite", 27, 2048, 16, 16, 192, 10944, 102400, 15_706_484_224, 163840,
                  "HF deepseek-ai/DeepSeek-V2-Lite config.json (copy in inference-sim/inference-sim@f90a1e3a "
                  "model_configs/deepseek-v2-lite): 64 experts of 1408 + 2 shared, top-6, "
                  "first_k_dense_replace 1 (dense MLP 10944), MLA kv_lora_rank 512 + qk_rope_head_dim 64, "
                  "no q_lora (q_proj direct), head_dim = qk_nope 128 + rope 64 = 192 for the attention "
                  "FLOPs, value head 128; ctx = max_position_embeddings 163840 (YaRN); n_params computed "
                  "from the config (15.7 B total, 2.4 B active published)",
                  n_experts=64, experts_per_token=6, expert_intermediate_size=1408, n_shared_experts=2,
                  first_dense_layers=1, kv_lora_rank=512, qk_rope_head_dim=64),
        ModelSpec("DeepSeek-V3", 61, 7168, 128, 128, 192, 18432, 129280, 671_026_419_200, 163840,
                  "HF deepseek-ai/DeepSeek-V3 config.json (256 experts of 2048 + 1 shared, top-8, "
                  "first_k_dense_replace 3, MLA kv_lora_rank 512 + qk_rope_head_dim 64, q_lora_rank "
                  "1536; head_dim = qk_nope 128 + rope 64 = 192 for the attention FLOPs (MHA form, the "
                  "value head is 128); FP8 block-quantized checkpoint, all weights counted at 1 byte "
                  "(embeddings and lm_head are bf16 in it: 0.3 % of the bytes); the multi-token-"
                  "prediction module (14 B) is not loaded); " + _HF_COUNT + " (671.0 B)",
                  n_experts=256, experts_per_token=8, expert_intermediate_size=2048, n_shared_experts=1,
                  first_dense_layers=3, kv_lora_rank=512, qk_rope_head_dim=64, weight_dtype="fp8"),
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
    "meta-llama/meta-llama-3.1-8b-instruct": "Llama-3.1-8B",  # the repo's name at release
    "meta-llama/llama-3.1-70b": "Llama-3.1-70B",
    "meta-llama/llama-3.1-70b-instruct": "Llama-3.1-70B",
    "meta-llama/meta-llama-3.1-70b-instruct": "Llama-3.1-70B",
    "meta-llama/llama-3.1-405b": "Llama-3.1-405B",
    "meta-llama/llama-3.1-405b-instruct": "Llama-3.1-405B",
    "qwen/qwen2.5-7b": "Qwen2.5-7B",
    "qwen/qwen2.5-7b-instruct": "Qwen2.5-7B",
    "qwen/qwen2.5-72b": "Qwen2.5-72B",
    "qwen/qwen2.5-72b-instruct": "Qwen2.5-72B",
    "mistralai/mistral-nemo-instruct-2407": "Mistral-Nemo-12B",
    "mistralai/mistral-nemo-base-2407": "Mistral-Nemo-12B",
    "01-ai/yi-34b": "Yi-34B",
    "mistralai/mixtral-8x7b-v0.1": "Mixtral-8x7B",
    "mistralai/mixtral-8x7b-instruct-v0.1": "Mixtral-8x7B",
    "mistralai/mixtral-8x22b-v0.1": "Mixtral-8x22B",
    "qwen/qwen3-30b-a3b": "Qwen3-30B-A3B",
    "qwen/qwen3-30b-a3b-base": "Qwen3-30B-A3B",
    "meta-llama/llama-4-scout-17b-16e": "Llama-4-Scout-17B-16E",
    "meta-llama/llama-4-scout-17b-16e-instruct": "Llama-4-Scout-17B-16E",
    "redhatai/llama-4-scout-17b-16e-instruct-fp8-dynamic": "Llama-4-Scout-17B-16E-FP8",
    "codellama/codellama-34b-instruct-hf": "CodeLlama-34B",
    "codellama/codellama-34b-hf": "CodeLlama-34B",
    "codellama-34b-instruct-hf": "CodeLlama-34B",
    "qwen/qwen3-14b": "Qwen3-14B",
    "qwen/qwen3-14b-base": "Qwen3-14B",
    "deepseek-ai/deepseek-v2-lite": "DeepSeek-V2-Lite",
    "deepseek-ai/deepseek-v2-lite-chat": "DeepSeek-V2-Lite",
    # fine-tunes of the Llama-3.1-70B architecture (same config.json shape: 80 layers, 8192 hidden,
    # GQA 8, 28672 MLP, vocab 128256): Meta's Llama-3.3-70B-Instruct (its model card compares it
    # with Llama 3.1 70B as the same-size model) and NVIDIA's Llama-3.1-Nemotron-70B-Instruct
    # ("built on Llama-3.1-70B-Instruct", its model card)
    "meta-llama/llama-3.3-70b-instruct": "Llama-3.1-70B",
    "nvidia/llama-3.1-nemotron-70b-instruct-hf": "Llama-3.1-70B",
    "microsoft/phi-4": "Phi-4",
    "huggingfacetb/smollm3-3b": "SmolLM3-3B",
    "huggingfacetb/smollm3-3b-base": "SmolLM3-3B",
    "meta-llama/llama-4-maverick-17b-128e": "Llama-4-Maverick-17B-128E",
    "meta-llama/llama-4-maverick-17b-128e-instruct": "Llama-4-Maverick-17B-128E",
    "meta-llama/llama-4-maverick-17b-128e-instruct-fp8": "Llama-4-Maverick-17B-128E-FP8",
    "ibm-granite/granite-3.1-8b-instruct": "Granite-3.1-8B",
    "ibm-granite/granite-3.1-8b-base": "Granite-3.1-8B",
    "qwen/qwen2.5-3b-instruct": "Qwen2.5-3B",
    "qwen/qwen2.5-3b": "Qwen2.5-3B",
    "mistralai/mistral-small-24b-instruct-2501": "Mistral-Small-24B",
    "mistralai/mistral-small-24b-base-2501": "Mistral-Small-24B",
    "mistralai/mistral-small-3.1-24b-instruct-2503": "Mistral-Small-3.1-24B",
    "mistralai/mistral-small-3.1-24b-base-2503": "Mistral-Small-3.1-24B",
    "deepseek-ai/deepseek-v3": "DeepSeek-V3",
    "deepseek-ai/deepseek-v3-base": "DeepSeek-V3",
    "deepseek-ai/deepseek-v3-0324": "DeepSeek-V3",
}
"""Hugging Face repo ids (lower-case) accepted by :func:`get_model` (as named in GT files)."""

MODELS: Registry[ModelSpec] = Registry("model", MODEL_PRESETS, MODEL_ALIASES)
"""The model presets by name (case-insensitive) and Hugging Face repo id."""


QUANTIZED_CHECKPOINT_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("-fp8-dynamic", "fp8"), ("-fp8", "fp8"), ("-quantized.w8a8", "int8"), ("-quantized.w4a16", "int4"),
    ("-w8a8", "int8"), ("-w4a16", "int4"), ("-int8", "int8"), ("-int4", "int4"),
)
"""Hugging Face id suffixes of LLM Compressor checkpoints (RedHatAI / neuralmagic naming) and the
weight dtype each stores, and the ``-FP8`` / ``-INT8`` / ``-INT4`` names :func:`get_model` gives
them (so a resolved name resolves again); longest first where one is a suffix of another."""


def _quantized_checkpoint(name: str) -> ModelSpec | None:
    """The preset of a quantized checkpoint of a 16-bit preset, by its Hugging Face id: the id
    less a suffix of :data:`QUANTIZED_CHECKPOINT_SUFFIXES` (or just its repo name, since the
    quantized copies are published under another organisation) resolves to a bf16/fp16 preset;
    that preset with the suffix's weight dtype on every decoder Linear layer ("linear"). None when
    the id is not of that form."""
    lower = str(name).strip().lower()
    for suffix, dtype in QUANTIZED_CHECKPOINT_SUFFIXES:
        if not lower.endswith(suffix):
            continue
        base_id = lower[: -len(suffix)]
        repo = base_id.rsplit("/", 1)[-1]
        names = {MODEL_ALIASES[a] for a in MODEL_ALIASES if a == base_id or a.rsplit("/", 1)[-1] == repo}
        names |= {n for n in MODEL_PRESETS if n.lower() in (base_id, repo)}
        if len(names) != 1:
            return None
        base = MODEL_PRESETS[names.pop()]
        if base.weight_dtype not in ("bf16", "fp16") or base.quantized_weights != "all":
            return None
        return quantized_checkpoint(base, dtype)
    return None


def quantized_checkpoint(base: ModelSpec, dtype: str) -> ModelSpec:
    """``base`` (a 16-bit model, preset or read from a config.json) as an LLM Compressor checkpoint
    with ``dtype`` weights on every decoder Linear layer, embedding and lm_head bf16 ("linear"),
    named ``<base>-<DTYPE>``; for a preset, the preset of that name when one exists (e.g. which
    weights it leaves in bf16)."""
    name = f"{base.name}-{dtype.upper()}"
    if MODEL_PRESETS.get(base.name) == base and name in MODELS:
        return MODELS.get(name)
    return dataclasses.replace(
        base, name=name, weight_dtype=dtype, quantized_weights="linear",
        source=f"{base.source}; a quantized checkpoint of it: {dtype} on every decoder Linear layer, "
               "embedding and lm_head bf16 (LLM Compressor's ignore: [lm_head])")


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive; HF repo ids of :data:`MODEL_ALIASES` too),
    or a quantized checkpoint of one (:func:`_quantized_checkpoint`: e.g.
    ``RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8`` is Qwen2.5-7B with int8 weights).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    try:
        return MODELS.get(name)
    except UnknownPresetError as e:
        quantized = _quantized_checkpoint(name) if isinstance(name, str) else None
        if quantized is None:
            suffixes = ", ".join(f"{sfx} ({dtype})" for sfx, dtype in QUANTIZED_CHECKPOINT_SUFFIXES[:4])
            raise UnknownPresetError(f"{e}; or their Hugging Face ids (docs/cli.md#presets-and-traces), or a "
                                     f"quantized checkpoint of a 16-bit one by its id's suffix: {suffixes}, ...; "
                                     "another model is the path of its Hugging Face config.json or an inline model: "
                                     "mapping in a scenario") from None
        return quantized
