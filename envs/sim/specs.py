"""Hardware and serving-configuration specs: models, GPUs, links, cost efficiencies, instances.

Everything here is an immutable (frozen) dataclass validated in ``__post_init__``; a bad value
raises :class:`~kvsched.envs.sim.errors.ConfigError` naming the field, the value and what is
allowed. Named presets cover the models, GPUs and links of the design reference, and an
:class:`InstanceSpec` can be written to / read from a self-contained YAML file.

Sources (cited per number below):

- REFERENCE = ``shared/design/REFERENCE.md`` (§5.1 model table, §5.2 hardware and links,
  §5.3 cost model, §4.1 vLLM defaults).
- HF = the model's Hugging Face ``config.json``. Parameter counts are computed from the config
  (embeddings + per-layer attention/MLP/norm weights + untied ``lm_head``) and equal the
  safetensors totals the model cards report.
- GT = ``shared/groundtruth/`` (real vLLM runs on H100; ``total_kv_blocks`` from vLLM logs).
- vLLM = the flag or config class named next to the number.

Conventions: bytes are SI (1 GB = 1e9 B) unless written GiB; times in seconds; rates per second.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import yaml

from .errors import ConfigError, UnknownPresetError, require

GiB = 2**30
"""Bytes in one GiB."""

DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
"""Bytes per element of the weight / KV dtypes we model (vLLM ``--dtype``, ``--kv-cache-dtype``)."""

WEIGHT_DTYPES = ("bf16", "fp16", "fp8")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8")
PREEMPTION_MODES = ("recompute", "swap", "offload")
TP_DEGREES = (1, 2, 4, 8)

DEFAULT_LINK_LATENCY_S = 10e-6
"""Per-operation latency of a host link (cudaMemcpy launch ~5–10 µs, REFERENCE §5.2)."""


# --------------------------------------------------------------------------------------------
# small validation helpers


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: object) -> bool:
    return (
        isinstance(v, (int, float, np.integer, np.floating))
        and not isinstance(v, (bool, np.bool_))
        and math.isfinite(float(v))
    )


def _int_at_least(owner: str, name: str, value: object, minimum: int) -> None:
    require(_is_int(value) and int(value) >= minimum, f"{owner}.{name}", value, f"an integer >= {minimum}")


def _real(owner: str, name: str, value: object, ok: Callable[[float], bool], allowed: str) -> None:
    require(_is_real(value) and ok(float(value)), f"{owner}.{name}", value, allowed)


def _positive(owner: str, name: str, value: object) -> None:
    _real(owner, name, value, lambda x: x > 0, "a finite number > 0")


def _non_negative(owner: str, name: str, value: object) -> None:
    _real(owner, name, value, lambda x: x >= 0, "a finite number >= 0")


def _string(owner: str, name: str, value: object) -> None:
    require(isinstance(value, str), f"{owner}.{name}", value, "a string")


# --------------------------------------------------------------------------------------------
# ModelSpec


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
        _string("ModelSpec", "name", self.name)
        require(bool(self.name), "ModelSpec.name", self.name, "a non-empty string")
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_context_tokens"):
            _int_at_least(owner, name, getattr(self, name), 1)
        require(self.n_heads % self.n_kv_heads == 0, f"{owner}.n_kv_heads", self.n_kv_heads,
                f"a divisor of n_heads={self.n_heads} (grouped-query attention)")
        _real(owner, "n_params", self.n_params, lambda x: x > self.vocab_size * self.hidden_size,
              f"a number > vocab_size*hidden_size = {self.vocab_size * self.hidden_size:.4g} "
              "(the input embedding alone)")
        _string(owner, "source", self.source)

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


# --------------------------------------------------------------------------------------------
# GPUSpec


@dataclass(frozen=True)
class GPUSpec:
    """One GPU: memory size, bandwidths and dense peak FLOP/s.

    Attributes:
        name: preset / display name. vLLM's batch defaults treat names containing "A100"
            specially (see :attr:`InstanceSpec.token_budget`).
        hbm_bytes: device memory in bytes (see each preset for GB vs GiB).
        hbm_bytes_per_s: peak memory bandwidth, bytes/s.
        bf16_flops_per_s: dense BF16 tensor peak, FLOP/s (never the "with sparsity" figure).
        fp8_flops_per_s: dense FP8 tensor peak, FLOP/s. GPUs without FP8 tensor cores carry
            their BF16 peak here: vLLM runs FP8 checkpoints there as weight-only FP8 (W8A16,
            Marlin), so the math runs at the 16-bit rate.
        nvlink_bytes_per_s: achievable GPU-GPU bandwidth per direction, bytes/s (used for TP
            all-reduce). GPUs without NVLink carry their PCIe number.
        pcie_bytes_per_s: achievable host-link bandwidth per direction (pinned H2D/D2H), bytes/s.
        source: where the numbers come from.

    Raises:
        ConfigError: a non-positive number.
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _string("GPUSpec", "name", self.name)
        require(bool(self.name), "GPUSpec.name", self.name, "a non-empty string")
        owner = f"GPUSpec({self.name!r})"
        for name in ("hbm_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s",
                     "nvlink_bytes_per_s", "pcie_bytes_per_s"):
            _positive(owner, name, getattr(self, name))
        _string(owner, "source", self.source)


GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 312e12, 240e9, 25e9,
                "REFERENCE §5.2 A100 SXM 80GB: 2.04 TB/s (2.039 in GT blis/hardware_config.json), "
                "312 TFLOPS BF16 dense; no FP8 tensor cores -> fp8 = bf16 peak (weight-only FP8); "
                "HBM 80 GiB (81920 MiB, as BLIS MemoryGiB 80); NVLink3 300 GB/s per direction "
                "nominal -> 240e9 achievable [inferred, same ~0.8 ratio as NVLink4]; PCIe 4 "
                "x16 ~25 GB/s achievable (§5.2)"),
        GPUSpec("H100-SXM", 80 * GiB, 3.35e12, 989e12, 1979e12, 375e9, 50e9,
                "REFERENCE §5.2 H100 SXM: 3.35 TB/s, 989 TFLOPS BF16 / 1979 FP8 dense; HBM 80 GiB "
                "as in GT blis/hardware_config.json (the device reports ~79.2 GiB usable to vLLM; "
                "the gap is absorbed by activation_reserve_bytes); NVLink4 ~350-400 GB/s p2p -> "
                "375e9; PCIe 5 x16 ~50 GB/s achievable"),
        GPUSpec("H200", 141e9, 4.8e12, 989e12, 1979e12, 375e9, 50e9,
                "REFERENCE §5.2 H200 SXM: 141 GB HBM3e (SI GB as sold), 4.8 TB/s, 989/1979 TFLOPS; "
                "NVLink4 ~350-400 GB/s p2p -> 375e9; PCIe 5 ~50 GB/s"),
        GPUSpec("B200", 180e9, 8e12, 2.25e15, 4.5e15, 700e9, 50e9,
                "REFERENCE §5.2 B200 (HGX): 180 GB usable HBM3e (192 GB physical; SI GB), 8 TB/s, "
                "~2250 TFLOPS BF16 / ~4500 FP8 dense; NVLink5 ~700 GB/s p2p per direction; host "
                "link taken as PCIe 5 (~50 GB/s), §5.2 says PCIe 5/6"),
        GPUSpec("L40S", 48e9, 0.864e12, 362e12, 733e12, 25e9, 25e9,
                "L40S datasheet [mem]: 48 GB GDDR6 (SI GB), 864 GB/s, 362 TFLOPS BF16 / 733 FP8 "
                "dense (BF16 and BW match GT blis/hardware_config.json); no NVLink -> GPU-GPU "
                "traffic over PCIe 4 (~25 GB/s, §5.2); host link PCIe 4 x16 ~25 GB/s"),
    )
}
"""GPU presets (dense peaks; achievable per-direction link rates). Sources: each ``source``."""

GPU_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a100-80": "A100-80GB",
    "a100-sxm": "A100-80GB",
    "a100-sxm-80gb": "A100-80GB",
    "h100": "H100-SXM",
    "h100-80gb": "H100-SXM",
    "h100 sxm": "H100-SXM",
    "h200-sxm": "H200",
    "b200-hgx": "B200",
}
"""Other names (lower-case) accepted by :func:`get_gpu`, e.g. the ``hardware`` column of GT."""


# --------------------------------------------------------------------------------------------
# LinkSpec


@dataclass(frozen=True)
class LinkSpec:
    """A data path with a bandwidth and a per-operation latency: ``t = latency + bytes/bandwidth``.

    Attributes:
        name: preset / display name.
        bytes_per_s: achievable bandwidth in bytes/s (> 0), one direction.
        latency_s: fixed cost of one transfer operation in seconds (>= 0).

    Source: REFERENCE §5.2 ("Model these as t = t_lat + bytes/BW").
    """

    name: str
    bytes_per_s: float
    latency_s: float = DEFAULT_LINK_LATENCY_S

    def __post_init__(self) -> None:
        _string("LinkSpec", "name", self.name)
        require(bool(self.name), "LinkSpec.name", self.name, "a non-empty string")
        owner = f"LinkSpec({self.name!r})"
        _positive(owner, "bytes_per_s", self.bytes_per_s)
        _non_negative(owner, "latency_s", self.latency_s)

    def transfer_time_s(self, n_bytes: Any) -> Any:
        """Seconds to move ``n_bytes`` (scalar or NumPy array) over this link, one operation each.

        Returns ``latency_s + n_bytes / bytes_per_s`` elementwise, and exactly 0.0 where
        ``n_bytes == 0`` (no operation is issued). Scalar in -> NumPy float64 scalar out.

        Raises:
            ValueError: a negative or NaN byte count.
        """
        b = np.asarray(n_bytes, dtype=np.float64)
        if not np.all(b >= 0):
            raise ValueError(f"n_bytes must be >= 0, got {n_bytes!r}")
        t = np.where(b > 0, self.latency_s + b / self.bytes_per_s, 0.0)
        return t[()]


LINK_PRESETS: dict[str, LinkSpec] = {
    lk.name: lk
    for lk in (
        LinkSpec("pcie4", 25e9, 10e-6),  # §5.2 PCIe 4.0 x16 ~25 GB/s pinned; cudaMemcpy ~5-10 µs
        LinkSpec("pcie5", 50e9, 10e-6),  # §5.2 PCIe 5.0 x16 ~50-55 GB/s pinned
        LinkSpec("nvme_gen4_read", 6e9, 80e-6),  # §5.2 NVMe Gen4 5-6 GB/s read; IO ~50-100 µs
        LinkSpec("nvme_gen4_write", 4e9, 80e-6),  # §5.2 NVMe Gen4 ~4 GB/s write
        LinkSpec("nvme_gen5_read", 10e9, 80e-6),  # §5.2 NVMe Gen5 10 GB/s read
        LinkSpec("nvme_gen5_write", 8e9, 80e-6),  # §5.2 NVMe Gen5 8 GB/s write
    )
}
"""Link presets: achievable per-drive / per-direction rates and latency floors of REFERENCE §5.2."""


# --------------------------------------------------------------------------------------------
# PNMSpec


@dataclass(frozen=True)
class PNMSpec:
    """A processing-near-memory (PNM) KV tier: memory with its own attention compute.

    Long-context requests' KV can live here; their decode attention then runs near memory
    while the GPU keeps the linear (FC/MLP) layers (hybrid execution, REFERENCE §3.2,
    after CXL-PNM arXiv 2511.00321 and L3 arXiv 2504.17584). KV moves GPU->PNM over ``link``
    by DMA, without the host CPU on the path (REFERENCE §3.2 ``"dma"`` interconnect).

    Attributes:
        name: preset / display name.
        n_devices: PNM devices (cards) attached to the instance, >= 1. A request's KV is striped
            over all of them (kvsched's choice **[inferred]**: it makes the §3.2 term
            ``max over devices of kv_bytes_on_dev / (BW·MBU)`` equal ``kv_bytes / (n·BW·MBU)``).
        capacity_bytes: KV capacity per device, bytes (> 0).
        mem_bytes_per_s: memory bandwidth per device, bytes/s (> 0), the attention read rate.
        attn_flops_per_s: attention compute per device (vector/matrix engines), FLOP/s (> 0).
        mbu: achieved share of ``mem_bytes_per_s`` in decode attention, in (0, 1]; 0.7
            (REFERENCE §3.2 ``MBU_pnm = 0.7`` **[inferred]**).
        link: GPU<->PNM link of each TP rank (``t = latency + bytes/bandwidth``), used for KV
            migration and for the per-step q/k/v/o activation traffic.
        rpc_latency_s: one request/response doorbell between GPU and PNM, s (>= 0); a step with
            PNM-resident decodes pays ``2·rpc_latency_s`` (REFERENCE §3.2 ``t_rpc`` = 5-20 µs,
            **[inferred]**).

    Raises:
        ConfigError: a non-positive capacity, bandwidth or FLOP rate, ``mbu`` outside (0, 1], a
            negative latency, ``n_devices`` < 1 or a ``link`` that is not a LinkSpec.
    """

    name: str
    capacity_bytes: float
    mem_bytes_per_s: float
    attn_flops_per_s: float
    link: LinkSpec
    n_devices: int = 1
    mbu: float = 0.7
    rpc_latency_s: float = 10e-6
    source: str = ""

    def __post_init__(self) -> None:
        _string("PNMSpec", "name", self.name)
        require(bool(self.name), "PNMSpec.name", self.name, "a non-empty string")
        owner = f"PNMSpec({self.name!r})"
        for name in ("capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s"):
            _positive(owner, name, getattr(self, name))
        _int_at_least(owner, "n_devices", self.n_devices, 1)
        _real(owner, "mbu", self.mbu, lambda x: 0 < x <= 1, "a number in (0, 1]")
        _non_negative(owner, "rpc_latency_s", self.rpc_latency_s)
        require(isinstance(self.link, LinkSpec), f"{owner}.link", self.link, "a LinkSpec")
        _string(owner, "source", self.source)

    @property
    def total_capacity_bytes(self) -> float:
        """KV capacity of all devices, bytes: ``n_devices · capacity_bytes``."""
        return self.n_devices * self.capacity_bytes


CXL_LINK = LinkSpec("cxl-x16-pcie5", 50e9, 10e-6)
"""GPU<->PNM link: a CXL 2.0/3.x x16 port on a PCIe 5 PHY, ~64 GB/s per direction nominal
(REFERENCE §3.1 [mem]); 50 GB/s achievable as for PCIe 5 pinned copies (§5.2), 10 µs per
operation (the §5.2 RPC / cudaMemcpy floor)."""

PNM_PRESETS: dict[str, PNMSpec] = {
    p.name: p
    for p in (
        PNMSpec("cxl-pnm-ocp2025", 4e12, 200e9, 2e12, CXL_LINK, 1, 0.7, 10e-6,
                "REFERENCE §3.1: Samsung CXL-PNM card shown at OCP 2025: 200 GB/s memory bandwidth, "
                "4 TB per card [src: Samsung MAG post]; attention FLOP/s not published -> 2 TFLOP/s "
                "[inferred], enough to keep GQA decode attention (~4 FLOP/byte for Llama-3) "
                "memory-bound; link CXL x16 PCIe 5 ~50 GB/s; mbu 0.7 and t_rpc 10 µs §3.2 [inferred]"),
        PNMSpec("cxl-pnm-ocp2025-x10", 4e12, 200e9, 2e12, CXL_LINK, 10, 0.7, 10e-6,
                "REFERENCE §3.1: the OCP 2025 system, 10 cards -> 2 TB/s and 40 TB [src: Samsung MAG "
                "post]; per-card numbers as cxl-pnm-ocp2025 ([inferred] FLOP/s, mbu, t_rpc)"),
        PNMSpec("cxl-pnm-2023", 512e9, 1.1e12, 8e12, CXL_LINK, 1, 0.7, 10e-6,
                "REFERENCE §3.1: Samsung CXL-PNM prototype 2023, 512 GB LPDDR5X, ~1.1 TB/s internal "
                "[mem, unconfirmed]; FLOP/s 8 TFLOP/s [inferred, memory-bound at GQA ratios]; link, "
                "mbu, t_rpc as cxl-pnm-ocp2025"),
    )
}
"""PNM device presets (REFERENCE §3.1; every number's status in its ``source``)."""


# --------------------------------------------------------------------------------------------
# CostParams


@dataclass(frozen=True)
class CostParams:
    """Efficiency parameters of the roofline step-time model (REFERENCE §5.2, §5.3) and the
    front-end overheads a client measures on top of the engine's steps.

    The defaults below are the literature values; :func:`default_cost_params` replaces them by a
    calibration file where one exists for the GPU (``envs/sim/calibration/``, written by
    ``kvsched calibrate``).

    Attributes:
        mfu_max: asymptotic model-FLOPs utilisation, 0 < mfu_max <= 1 (§5.2: ≈ 0.6).
        mfu_half_tokens: tokens in a step at which MFU reaches half of mfu_max, >= 0; the model is
            ``MFU(n) = mfu_max · n / (n + mfu_half_tokens)`` (§5.2: c_half ≈ 64). 0 = constant MFU.
        mbu: memory-bandwidth utilisation, 0 < mbu <= 1 (§5.2: 0.75 for decode).
        step_overhead_s: fixed CPU/launch cost per step, >= 0 (§5.2: 0.5-2 ms with CUDA graphs).
        allreduce_latency_s: fixed latency of one all-reduce under TP, >= 0 (§5.3: ~10 µs).
        allreduce_bw_efficiency: achieved share of ``GPUSpec.nvlink_bytes_per_s`` in the TP
            all-reduces of a step, 0 < η <= 1. Default 1.0 (REFERENCE §5.3 uses the link rate
            as is); NCCL ring all-reduces of the 0.1-10 MB activations of a serving step reach
            well below the link's peak, which a calibration measures.
        request_overhead_s: per-request front-end delay before the engine sees a request, s, >= 0:
            HTTP handling, request validation and hand-off from the API-server process to the
            engine core (vLLM V1 ``AsyncLLM`` -> ZMQ -> ``EngineCore``). Default 10 ms: the
            "10-15 ms of API/queueing per request" of the groundtruth README (replaying, step 4),
            close to the α0 fitted by the inference-sim/training repo (9.3 ms, ``pre_queueing``)
            and BLIS's blackbox α0 for Llama-3.1-8B/H100/vLLM 0.11 (10.3 ms).
        prompt_token_overhead_s: per prompt token of the same delay (tokenisation), s, >= 0.
            Default 4.2 µs: median of the α1 (queueing time per input token) of BLIS's 99 H100
            blackbox coefficient sets (groundtruth ``blis/defaults_blackbox_coeffs_at_90522ded_
            parent.yaml``; inter-quartile range 1.7-8.1 µs).
        output_token_overhead_s: delay between the end of the step that produced a token and
            the client receiving it (engine-core output -> API server detokenisation -> streamed
            chunk), s, >= 0. It shifts the first and last token times (TTFT, E2E), not the gaps
            between tokens: the API server processes outputs while the engine runs the next step.
            Default 45.9 µs: BLIS trained-physics α2 (groundtruth README §3).
        first_chunk_delay_tokens: how many inter-token gaps after its first token a streaming
            client sees its first text, >= 0 (the recorder adds this many of the request's mean
            gaps, ``(finish − first token)/(tokens − 1)``, to its first-token time; E2E is
            unchanged). Default 0 (the client sees the first token at once). The real H100 runs
            need about one gap: their TTFT exceeds front-end delay + wait + prefill by about one
            decode step for every model and TP degree. Streaming detokenisation explains such a
            delay (vLLM's incremental detokeniser sends no text for a token that ends inside a
            multi-byte character, and the runs generate random-token text); a calibration measures it.

    The front-end overheads are latencies, not GPU time: the engine is not busy during them
    (:class:`~kvsched.envs.sim.cluster.Cluster` delays arrivals, the recorder shifts token times).

    Raises:
        ConfigError: a value outside the ranges above.
    """

    mfu_max: float = 0.6
    mfu_half_tokens: float = 64.0
    mbu: float = 0.75
    step_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    allreduce_bw_efficiency: float = 1.0
    request_overhead_s: float = 10e-3
    prompt_token_overhead_s: float = 4.2e-6
    output_token_overhead_s: float = 45.9e-6
    first_chunk_delay_tokens: float = 0.0

    def __post_init__(self) -> None:
        _real("CostParams", "mfu_max", self.mfu_max, lambda x: 0 < x <= 1, "a number in (0, 1]")
        _non_negative("CostParams", "mfu_half_tokens", self.mfu_half_tokens)
        _real("CostParams", "mbu", self.mbu, lambda x: 0 < x <= 1, "a number in (0, 1]")
        _non_negative("CostParams", "step_overhead_s", self.step_overhead_s)
        _non_negative("CostParams", "allreduce_latency_s", self.allreduce_latency_s)
        _real("CostParams", "allreduce_bw_efficiency", self.allreduce_bw_efficiency, lambda x: 0 < x <= 1,
              "a number in (0, 1]")
        _non_negative("CostParams", "request_overhead_s", self.request_overhead_s)
        _non_negative("CostParams", "prompt_token_overhead_s", self.prompt_token_overhead_s)
        _non_negative("CostParams", "output_token_overhead_s", self.output_token_overhead_s)
        _non_negative("CostParams", "first_chunk_delay_tokens", self.first_chunk_delay_tokens)

    def server_delay_s(self, prompt_tokens: Any) -> Any:
        """Front-end delay (s) from the client's send to the engine seeing the request:
        ``request_overhead_s + prompt_token_overhead_s · prompt_tokens`` (scalar or array)."""
        return self.request_overhead_s + self.prompt_token_overhead_s * np.asarray(prompt_tokens, dtype=np.float64)


def default_cost_params(gpu: GPUSpec | str) -> CostParams:
    """The GPU's default :class:`CostParams`: its calibration file if kvsched ships one
    (``envs/sim/calibration/``, see :mod:`kvsched.envs.sim.calibration`), else the literature
    defaults of :class:`CostParams`.

    Raises:
        ConfigError: a shipped calibration file that does not parse or validate.
    """
    from .calibration import calibrated_cost_params  # lazy: calibration imports this module

    name = gpu.name if isinstance(gpu, GPUSpec) else str(gpu)
    return calibrated_cost_params(name) or CostParams()


# --------------------------------------------------------------------------------------------
# InstanceSpec


def _vllm_batch_defaults(gpu: GPUSpec) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks for the OpenAI API server.

    vLLM ``EngineArgs.get_batch_defaults`` (REFERENCE §0, §4.1): 8192 / 1024 when the device has
    >= 70 GiB and its name does not contain "a100", else 2048 / 256.
    """
    if gpu.hbm_bytes >= 70 * GiB and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


@dataclass(frozen=True)
class InstanceSpec:
    """One serving instance: a model on ``tp`` GPUs with vLLM-like engine settings and KV tiers.

    Attributes (defaults and their sources):
        model, gpu: the model and the GPU type (one GPU per TP rank).
        tp: tensor-parallel degree in {1, 2, 4, 8}; n_heads must be divisible by tp, and
            n_kv_heads divisible by tp or tp by n_kv_heads (vLLM's head-sharding rules).
        weight_dtype: "bf16" (default, model checkpoints' dtype), "fp16" or "fp8".
        kv_dtype: vLLM ``--kv-cache-dtype``: "auto" (default, vLLM ``cache_dtype="auto"``: the
            model's activation dtype, i.e. the weight dtype for bf16/fp16 and bf16 for fp8
            checkpoints, whose config dtype stays bfloat16), "bf16", "fp16" or "fp8" (1 byte:
            half the KV bytes per token).
        block_size_tokens: tokens per KV block, 16 (vLLM ``CacheConfig.DEFAULT_BLOCK_SIZE``,
            REFERENCE §0).
        gpu_memory_utilization: share of device memory vLLM may use, 0.9 (vLLM
            ``--gpu-memory-utilization``: 0.9 in the releases of the GT runs, 0.92 in the current
            tree, REFERENCE §4.1).
        activation_reserve_bytes: per-GPU bytes inside the utilisation budget that hold neither
            weights nor KV (peak activations, CUDA graphs, NCCL, allocator slack), 1.5 GiB.
            Fitted to GT ``total_kv_blocks`` on H100 at 0.9: Llama-2-7B TP1 has 7463 blocks
            (residual ≈ 1.15 GiB), Qwen2.5-7B TP1 has 65352 (≈ 1.97 GiB); 1.5 GiB lies between.
        hbm_kv_blocks: explicit HBM KV block count (vLLM ``--num-gpu-blocks-override``); None
            derives it from memory (see :attr:`num_hbm_blocks`).
        dram_kv_bytes, nvme_kv_bytes: KV capacity of the host-DRAM and NVMe tiers for the whole
            instance, bytes, 0 = tier absent.
        pcie: GPU<->host link of each rank. None (default) means
            ``LinkSpec(f"{gpu.name}-pcie", gpu.pcie_bytes_per_s, 10e-6)``; after construction
            the field always holds a LinkSpec.
        nvme_read, nvme_write: host<->NVMe links, default the Gen4 presets (REFERENCE §5.2).
        max_num_batched_tokens: vLLM ``--max-num-batched-tokens``; None = vLLM default (see
            :attr:`token_budget`).
        max_num_seqs: vLLM ``--max-num-seqs``; None = vLLM default (see :attr:`max_seqs`).
        max_model_len: vLLM ``--max-model-len``; None = see :attr:`model_len_limit`.
        long_prefill_token_threshold: vLLM ``--long-prefill-token-threshold``, 0 = off
            (REFERENCE §4.1; vLLM sets it to 4 % of max_model_len when
            max_num_partial_prefills > 1 and it is 0 -- left to the scheduler).
        max_num_partial_prefills, max_long_partial_prefills: vLLM flags of the same names, 1 and
            1 (REFERENCE §4.1); 1 <= long <= partial.
        enable_chunked_prefill, enable_prefix_caching: True, True (vLLM V1 defaults, §4.1).
        cache_decode_blocks: with prefix caching, whether a request's decode-phase blocks stay
            cached after it finishes and age in the same LRU free queue as its prompt blocks,
            default False. vLLM V1 hashes every full block, generated tokens included
            (``KVCacheManager.allocate_slots`` -> ``cache_blocks`` up to the computed tokens),
            and ``BlockPool.free_blocks`` appends every freed block of a finished request, in
            reverse order, to the tail of one LRU free queue (vLLM <= 0.23; the GT runs used
            0.8-0.11). So never-reused output blocks push cached prompts towards eviction. False
            keeps kvsched's simpler pool, where a request's private blocks return to a free pool
            used before any cached segment is evicted.
        preemption_mode: "recompute" (vLLM V1, §4.1), "swap" (to DRAM; needs dram_kv_bytes > 0)
            or "offload" (to NVMe; needs nvme_kv_bytes > 0).
        pnm: an optional processing-near-memory KV tier (:class:`PNMSpec`), None (default) =
            absent. Its blocks are sized like the other tiers (whole-instance KV bytes per block).
        cost: efficiency parameters of the cost model. None (default) means
            :func:`default_cost_params` of the GPU (the calibration file where one exists, else
            the literature defaults); after construction the field always holds a CostParams.

    Raises:
        ConfigError: any value out of range, weights that do not fit in
            ``gpu_memory_utilization`` of a GPU, KV capacity below one block, ``max_model_len``
            above the KV capacity or the model's context, or (chunked prefill off) a token budget
            below the model length.
    """

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"
    block_size_tokens: int = 16
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 1.5 * GiB
    hbm_kv_blocks: int | None = None
    dram_kv_bytes: float = 0
    nvme_kv_bytes: float = 0
    pcie: LinkSpec | None = None
    nvme_read: LinkSpec = LINK_PRESETS["nvme_gen4_read"]
    nvme_write: LinkSpec = LINK_PRESETS["nvme_gen4_write"]
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    cache_decode_blocks: bool = False
    preemption_mode: str = "recompute"
    cost: CostParams | None = None
    pnm: PNMSpec | None = None

    # derived in __post_init__ (not init arguments, not compared)
    _pcie_auto: bool = field(init=False, repr=False, compare=False)
    _cost_auto: bool = field(init=False, repr=False, compare=False)
    _weight_dtype_bytes: float = field(init=False, repr=False, compare=False)
    _kv_dtype_bytes: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_token: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_block: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_block_per_gpu: float = field(init=False, repr=False, compare=False)
    _weight_bytes_per_gpu: float = field(init=False, repr=False, compare=False)
    _num_hbm_blocks: int = field(init=False, repr=False, compare=False)
    _num_dram_blocks: int = field(init=False, repr=False, compare=False)
    _num_nvme_blocks: int = field(init=False, repr=False, compare=False)
    _num_pnm_blocks: int = field(init=False, repr=False, compare=False)
    _token_budget: int = field(init=False, repr=False, compare=False)
    _max_seqs: int = field(init=False, repr=False, compare=False)
    _model_len_limit: int = field(init=False, repr=False, compare=False)

    # ---------------------------------------------------------------- validation + derivation

    def __post_init__(self) -> None:
        o = "InstanceSpec"

        def set_(name: str, value: object) -> None:  # frozen dataclass: derived fields set once here
            object.__setattr__(self, name, value)

        require(isinstance(self.model, ModelSpec), f"{o}.model", self.model, "a ModelSpec")
        require(isinstance(self.gpu, GPUSpec), f"{o}.gpu", self.gpu, "a GPUSpec")
        m, g = self.model, self.gpu

        require(_is_int(self.tp) and self.tp in TP_DEGREES, f"{o}.tp", self.tp, f"one of {TP_DEGREES}")
        require(self.tp <= m.n_heads and m.n_heads % self.tp == 0, f"{o}.tp", self.tp,
                f"a divisor of {m.name}'s n_heads={m.n_heads}")
        require(m.n_kv_heads % self.tp == 0 or self.tp % m.n_kv_heads == 0, f"{o}.tp", self.tp,
                f"a divisor or multiple of {m.name}'s n_kv_heads={m.n_kv_heads}")
        require(self.weight_dtype in WEIGHT_DTYPES, f"{o}.weight_dtype", self.weight_dtype,
                f"one of {', '.join(WEIGHT_DTYPES)}")
        require(self.kv_dtype in KV_DTYPES, f"{o}.kv_dtype", self.kv_dtype, f"one of {', '.join(KV_DTYPES)}")
        _int_at_least(o, "block_size_tokens", self.block_size_tokens, 1)
        _real(o, "gpu_memory_utilization", self.gpu_memory_utilization, lambda x: 0 < x <= 1,
              "a number in (0, 1]")
        _non_negative(o, "activation_reserve_bytes", self.activation_reserve_bytes)
        if self.hbm_kv_blocks is not None:
            _int_at_least(o, "hbm_kv_blocks", self.hbm_kv_blocks, 1)
        _non_negative(o, "dram_kv_bytes", self.dram_kv_bytes)
        _non_negative(o, "nvme_kv_bytes", self.nvme_kv_bytes)
        for name in ("pcie", "nvme_read", "nvme_write"):
            value = getattr(self, name)
            ok = isinstance(value, LinkSpec) or (name == "pcie" and value is None)
            require(ok, f"{o}.{name}", value, "a LinkSpec" + (" or None" if name == "pcie" else ""))
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) is not None:
                _int_at_least(o, name, getattr(self, name), 1)
        _int_at_least(o, "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _int_at_least(o, "max_num_partial_prefills", self.max_num_partial_prefills, 1)
        _int_at_least(o, "max_long_partial_prefills", self.max_long_partial_prefills, 1)
        require(self.max_long_partial_prefills <= self.max_num_partial_prefills,
                f"{o}.max_long_partial_prefills", self.max_long_partial_prefills,
                f"<= max_num_partial_prefills={self.max_num_partial_prefills}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cache_decode_blocks"):
            require(isinstance(getattr(self, name), bool), f"{o}.{name}", getattr(self, name), "true or false")
        require(self.preemption_mode in PREEMPTION_MODES, f"{o}.preemption_mode", self.preemption_mode,
                f"one of {', '.join(PREEMPTION_MODES)}")
        require(self.preemption_mode != "swap" or self.dram_kv_bytes > 0, f"{o}.preemption_mode",
                self.preemption_mode, "'swap' only with a DRAM tier: set dram_kv_bytes > 0")
        require(self.preemption_mode != "offload" or self.nvme_kv_bytes > 0, f"{o}.preemption_mode",
                self.preemption_mode, "'offload' only with an NVMe tier: set nvme_kv_bytes > 0")
        require(self.pnm is None or isinstance(self.pnm, PNMSpec), f"{o}.pnm", self.pnm,
                "a PNMSpec or None (no PNM tier)")
        require(self.cost is None or isinstance(self.cost, CostParams), f"{o}.cost", self.cost,
                "a CostParams or None (the GPU's default)")
        set_("_cost_auto", self.cost is None)
        if self.cost is None:
            set_("cost", default_cost_params(g))

        set_("_pcie_auto", self.pcie is None)
        if self.pcie is None:
            set_("pcie", LinkSpec(f"{g.name}-pcie", g.pcie_bytes_per_s, DEFAULT_LINK_LATENCY_S))

        # bytes per element
        w_bytes = DTYPE_BYTES[self.weight_dtype]
        if self.kv_dtype == "auto":
            kv_bytes = 2.0 if self.weight_dtype == "fp8" else w_bytes
        else:
            kv_bytes = DTYPE_BYTES[self.kv_dtype]
        set_("_weight_dtype_bytes", w_bytes)
        set_("_kv_dtype_bytes", kv_bytes)

        # KV sizes: KV heads shard over TP ranks; with tp > n_kv_heads each rank holds one head
        kv_tok = m.kv_bytes_per_token(kv_bytes)
        kv_block = kv_tok * self.block_size_tokens
        heads_per_gpu = max(1, m.n_kv_heads // self.tp)
        set_("_kv_bytes_per_token", kv_tok)
        set_("_kv_bytes_per_block", kv_block)
        set_("_kv_bytes_per_block_per_gpu", kv_block / m.n_kv_heads * heads_per_gpu)
        set_("_weight_bytes_per_gpu", m.weight_bytes(w_bytes) / self.tp)

        set_("_num_hbm_blocks", self._derive_hbm_blocks())
        set_("_num_dram_blocks", int(math.floor(self.dram_kv_bytes / kv_block)))
        set_("_num_nvme_blocks", int(math.floor(self.nvme_kv_bytes / kv_block)))
        set_("_num_pnm_blocks", 0 if self.pnm is None
             else int(math.floor(self.pnm.total_capacity_bytes / kv_block)))
        if self.pnm is not None:
            require(self._num_pnm_blocks >= 1, f"{o}.pnm.capacity_bytes", self.pnm.capacity_bytes,
                    f"at least one KV block ({kv_block:.0f} bytes over {self.pnm.n_devices} device(s))")

        capacity_tokens = self._num_hbm_blocks * self.block_size_tokens
        if self.max_model_len is not None:
            if self.max_model_len > m.max_context_tokens:
                raise ConfigError(
                    f"{o}.max_model_len={self.max_model_len} is not allowed: {m.name} supports at most "
                    f"{m.max_context_tokens} tokens (vLLM refuses a longer max_model_len); lower "
                    "max_model_len or give an inline model with a larger max_context_tokens")
            if self.max_model_len > capacity_tokens:
                raise ConfigError(
                    f"{o}.max_model_len={self.max_model_len} is not allowed: the KV cache can hold only "
                    f"{capacity_tokens} tokens ({self._num_hbm_blocks} blocks x {self.block_size_tokens}) "
                    f"for {m.name} on {self.tp}x {g.name}, and vLLM refuses to start; lower max_model_len, "
                    "raise gpu_memory_utilization or tp, or use kv_dtype='fp8'")
            model_len = int(self.max_model_len)
        else:
            model_len = min(m.max_context_tokens, capacity_tokens)
        set_("_model_len_limit", model_len)

        default_tokens, default_seqs = _vllm_batch_defaults(g)
        if self.max_num_batched_tokens is not None:
            budget = int(self.max_num_batched_tokens)
            if not self.enable_chunked_prefill and budget < model_len:
                raise ConfigError(
                    f"{o}.max_num_batched_tokens={budget} is not allowed with enable_chunked_prefill="
                    f"False: it must be >= the model length {model_len}, else prompts longer than the "
                    "budget could never be scheduled (vLLM's rule); raise max_num_batched_tokens, "
                    "lower max_model_len, or enable chunked prefill")
        elif not self.enable_chunked_prefill:
            budget = max(model_len, default_tokens)  # vLLM SchedulerConfig without chunked prefill
        else:
            budget = default_tokens
        set_("_token_budget", budget)
        set_("_max_seqs", int(self.max_num_seqs) if self.max_num_seqs is not None else default_seqs)

    def _derive_hbm_blocks(self) -> int:
        m, g = self.model, self.gpu
        usable = self.gpu_memory_utilization * g.hbm_bytes
        weights = self._weight_bytes_per_gpu
        where = f"{m.name} on {self.tp}x {g.name} (tp={self.tp}, weight_dtype={self.weight_dtype})"
        if weights >= usable:
            raise ConfigError(
                f"weights of {where} do not fit: {weights / 1e9:.2f} GB per GPU >= "
                f"gpu_memory_utilization x HBM = {self.gpu_memory_utilization} x {g.hbm_bytes / 1e9:.2f} GB "
                f"= {usable / 1e9:.2f} GB; raise tp, use weight_dtype='fp8', pick a GPU with more "
                "memory, or raise gpu_memory_utilization")
        if self.hbm_kv_blocks is not None:
            return int(self.hbm_kv_blocks)
        free = usable - weights - self.activation_reserve_bytes
        per_block = self._kv_bytes_per_block_per_gpu
        blocks = int(math.floor(free / per_block)) if free > 0 else 0
        if blocks < 1:
            raise ConfigError(
                f"KV capacity of {where} is below one block: {usable / 1e9:.2f} GB usable - "
                f"{weights / 1e9:.2f} GB weights - {self.activation_reserve_bytes / 1e9:.2f} GB activation "
                f"reserve = {free / 1e9:.3f} GB < {per_block / 1e9:.4f} GB per block per GPU; raise tp or "
                "gpu_memory_utilization, lower activation_reserve_bytes, or use fp8 weights / KV")
        return blocks

    # ---------------------------------------------------------------- derived, read-only

    @property
    def weight_dtype_bytes(self) -> float:
        """Bytes per weight element (bf16/fp16: 2, fp8: 1)."""
        return self._weight_dtype_bytes

    @property
    def kv_dtype_bytes(self) -> float:
        """Bytes per KV element after resolving ``kv_dtype="auto"``."""
        return self._kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token, whole model (all TP ranks): REFERENCE §5.1 KV/token."""
        return self._kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> float:
        """KV bytes of one block for the whole instance (all TP ranks): kv_bytes_per_token · block."""
        return self._kv_bytes_per_block

    @property
    def kv_bytes_per_block_per_gpu(self) -> float:
        """KV bytes one TP rank stores per block.

        ``kv_bytes_per_block / tp`` when n_kv_heads >= tp (heads are sharded). When tp >
        n_kv_heads, vLLM replicates KV heads so each rank holds exactly one head:
        ``kv_bytes_per_block / n_kv_heads`` (REFERENCE §5.1).
        """
        return self._kv_bytes_per_block_per_gpu

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weight bytes on each TP rank: model.weight_bytes(weight_dtype_bytes) / tp."""
        return self._weight_bytes_per_gpu

    @property
    def num_hbm_blocks(self) -> int:
        """HBM KV blocks of the instance (each block spans all TP ranks).

        ``hbm_kv_blocks`` if given, else
        ``floor((gpu_memory_utilization·hbm_bytes − weight_bytes_per_gpu − activation_reserve_bytes)
        / kv_bytes_per_block_per_gpu)``, as vLLM sizes its cache per GPU.
        """
        return self._num_hbm_blocks

    @property
    def num_dram_blocks(self) -> int:
        """Blocks the DRAM tier holds: floor(dram_kv_bytes / kv_bytes_per_block)."""
        return self._num_dram_blocks

    @property
    def num_nvme_blocks(self) -> int:
        """Blocks the NVMe tier holds: floor(nvme_kv_bytes / kv_bytes_per_block)."""
        return self._num_nvme_blocks

    @property
    def num_pnm_blocks(self) -> int:
        """Blocks the PNM tier holds: floor(pnm.total_capacity_bytes / kv_bytes_per_block), 0 without PNM."""
        return self._num_pnm_blocks

    @property
    def token_budget(self) -> int:
        """Tokens per step (vLLM ``max_num_batched_tokens``).

        Given value, else vLLM's API-server default (``EngineArgs.get_batch_defaults``,
        REFERENCE §0/§4.1): 8192 on GPUs with >= 70 GiB that are not A100s, else 2048. With
        chunked prefill off and no explicit value, ``max(model_len_limit, that default)`` as
        vLLM's SchedulerConfig does.
        """
        return self._token_budget

    @property
    def max_seqs(self) -> int:
        """Max running sequences (vLLM ``max_num_seqs``): given, else 1024 (>= 70 GiB non-A100) or 256."""
        return self._max_seqs

    @property
    def model_len_limit(self) -> int:
        """Longest prompt + output a request may have, tokens.

        ``max_model_len`` if given, else min(model.max_context_tokens, num_hbm_blocks ·
        block_size_tokens). (vLLM would refuse to start instead of shrinking; the simulator
        shrinks so presets with 128k contexts run on small GPUs.)
        """
        return self._model_len_limit

    def with_overrides(self, **kw: Any) -> InstanceSpec:
        """A copy with some fields replaced (``dataclasses.replace``), re-validated.

        A ``pcie`` link that was derived from the GPU is derived again from the new GPU unless
        ``pcie`` is among the overrides; likewise a ``cost`` that was the GPU's default.

        Raises:
            ConfigError: an unknown field name or an invalid resulting spec.
        """
        allowed = _INSTANCE_FIELDS
        unknown = sorted(set(kw) - set(allowed))
        if unknown:
            raise ConfigError(f"InstanceSpec has no field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        if self._pcie_auto and "pcie" not in kw:
            kw["pcie"] = None
        if self._cost_auto and "cost" not in kw:
            kw["cost"] = None  # the default of the (possibly new) GPU
        return dataclasses.replace(self, **kw)


_INSTANCE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(InstanceSpec) if f.init)


# --------------------------------------------------------------------------------------------
# lookup


def _lookup(kind: str, name: object, presets: Mapping[str, Any], aliases: Mapping[str, str]) -> Any:
    if isinstance(name, str):
        key = name.strip().lower()
        for canonical, spec in presets.items():
            if canonical.lower() == key:
                return spec
        if key in aliases:
            return presets[aliases[key]]
    raise UnknownPresetError(f"unknown {kind} {name!r}; known: {', '.join(presets)}")


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive; HF repo ids of :data:`MODEL_ALIASES` too).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return _lookup("model", name, MODEL_PRESETS, MODEL_ALIASES)


def get_gpu(name: str) -> GPUSpec:
    """The GPU preset ``name`` (case-insensitive; :data:`GPU_ALIASES` too, e.g. "H100").

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return _lookup("GPU", name, GPU_PRESETS, GPU_ALIASES)


def get_link(name: str) -> LinkSpec:
    """The link preset ``name`` (case-insensitive).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return _lookup("link", name, LINK_PRESETS, {})


# --------------------------------------------------------------------------------------------
# dict / YAML


def _plain(value: Any) -> Any:
    """NumPy scalars -> Python scalars (YAML-safe)."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def _spec_dict(spec: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init}


def instance_spec_to_dict(spec: InstanceSpec) -> dict[str, Any]:
    """Plain-type dict of ``spec``; model, gpu, links and cost are inline dicts (self-contained).

    A ``pcie`` link derived from the GPU is written as None so it stays tied to the GPU.
    """
    out: dict[str, Any] = {}
    for name in _INSTANCE_FIELDS:
        value = getattr(spec, name)
        if name == "pcie" and spec._pcie_auto:
            out[name] = None
        elif name == "pnm" and value is not None:
            out[name] = {**_spec_dict(value), "link": _spec_dict(value.link)}
        elif dataclasses.is_dataclass(value):
            out[name] = _spec_dict(value)
        else:
            out[name] = _plain(value)
    return out


_INT_FIELDS = ("tp", "block_size_tokens", "long_prefill_token_threshold", "max_num_partial_prefills",
               "max_long_partial_prefills")
_OPT_INT_FIELDS = ("hbm_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len")
_FLOAT_FIELDS = ("gpu_memory_utilization", "activation_reserve_bytes", "dram_kv_bytes", "nvme_kv_bytes")
_STR_FIELDS = ("weight_dtype", "kv_dtype", "preemption_mode")
_BOOL_FIELDS = ("enable_chunked_prefill", "enable_prefix_caching", "cache_decode_blocks")


def _as_float(value: Any, where: str) -> float:
    """A real number; numeric strings are accepted because YAML 1.1 reads ``1e9`` as a string."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if not _is_real(value):
        raise ConfigError(f"{where}={value!r} is not allowed: expected a finite number")
    return value


def _build(cls: type, d: Any, where: str) -> Any:
    """Construct dataclass ``cls`` from mapping ``d`` with key and type checks."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(fields)}")
    missing = [n for n, f in fields.items()
               if n not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if fields[k].type in ("str", str):
            if not isinstance(v, str):
                raise ConfigError(f"{where}.{k}={v!r} is not allowed: expected a string")
            kw[k] = v
        elif fields[k].type in ("int", int):
            if not _is_int(v):
                raise ConfigError(f"{where}.{k}={v!r} is not allowed: expected an integer")
            kw[k] = v
        else:
            kw[k] = _as_float(v, f"{where}.{k}")
    try:
        return cls(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _preset_or_inline(value: Any, getter: Callable[[str], Any], cls: type, where: str) -> Any:
    if isinstance(value, str):
        try:
            return getter(value)
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    return _build(cls, value, where)


def get_pnm(name: str) -> PNMSpec:
    """The PNM device preset ``name`` (case-insensitive).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return _lookup("PNM device", name, PNM_PRESETS, {})


def _pnm_from(value: Any, where: str) -> PNMSpec:
    """A PNM tier from a preset name, or an inline mapping of :class:`PNMSpec` fields.

    An inline mapping may name a ``preset`` and override some of its fields (e.g.
    ``{preset: cxl-pnm-ocp2025, n_devices: 2}``); ``link`` is a link preset name or an inline
    LinkSpec mapping (default: the preset's link, else :data:`CXL_LINK`).
    """
    if isinstance(value, str):
        try:
            return get_pnm(value)
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a PNM preset name or a mapping, got {type(value).__name__}")
    d = dict(value)
    base: dict[str, Any] = {}
    if "preset" in d:
        try:
            base = _spec_dict(get_pnm(d.pop("preset")))
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    link = d.pop("link", base.pop("link", CXL_LINK))
    if not isinstance(link, LinkSpec):
        link = _preset_or_inline(link, get_link, LinkSpec, f"{where}.link")
    merged = {**base, **d}
    merged.pop("link", None)
    allowed = {f.name for f in dataclasses.fields(PNMSpec)} - {"link"}
    unknown = [k for k in merged if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: preset, link, "
                          f"{', '.join(sorted(allowed))}")
    for k in ("capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s", "mbu", "rpc_latency_s"):
        if k in merged:
            merged[k] = _as_float(merged[k], f"{where}.{k}")
    if "n_devices" in merged and not _is_int(merged["n_devices"]):
        raise ConfigError(f"{where}.n_devices={merged['n_devices']!r} is not allowed: expected an integer")
    missing = [k for k in ("name", "capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s") if k not in merged]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)} (or give a preset)")
    try:
        return PNMSpec(link=link, **merged)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def instance_spec_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> InstanceSpec:
    """Build an :class:`InstanceSpec` from a dict (e.g. parsed YAML).

    ``model``, ``gpu``, ``pcie``, ``nvme_read`` and ``nvme_write`` may be preset names or inline
    dicts of the spec's fields; ``cost`` is a dict of :class:`CostParams` fields whose omitted keys
    take the GPU's default (:func:`default_cost_params`). Other omitted keys take the dataclass
    defaults; ``model`` and ``gpu`` are required.

    Raises:
        ConfigError: not a mapping, an unknown key (the message names the key, ``source`` and the
            allowed keys), a missing model/gpu, a value of the wrong type, or an invalid spec.
        UnknownPresetError: an unknown preset name.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: an instance spec must be a mapping, got {type(d).__name__}")
    unknown = [k for k in d if k not in _INSTANCE_FIELDS]
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}; allowed keys: {', '.join(_INSTANCE_FIELDS)}")
    for key in ("model", "gpu"):
        if key not in d:
            raise ConfigError(f"{source}: missing key {key!r} (a preset name or an inline dict)")
    kw: dict[str, Any] = {
        "model": _preset_or_inline(d["model"], get_model, ModelSpec, f"{source}: model"),
        "gpu": _preset_or_inline(d["gpu"], get_gpu, GPUSpec, f"{source}: gpu"),
    }
    for key in ("pcie", "nvme_read", "nvme_write"):
        if key in d and not (key == "pcie" and d[key] is None):
            kw[key] = _preset_or_inline(d[key], get_link, LinkSpec, f"{source}: {key}")
    if "pnm" in d and d["pnm"] is not None:
        kw["pnm"] = _pnm_from(d["pnm"], f"{source}: pnm")
    if "cost" in d and d["cost"] is not None:
        # omitted cost keys take the GPU's default (calibrated where a calibration file exists)
        given = d["cost"]
        if not isinstance(given, Mapping):
            raise ConfigError(f"{source}: cost must be a mapping of CostParams fields, got {type(given).__name__}")
        base = _spec_dict(default_cost_params(kw["gpu"]))
        unknown = [k for k in given if k not in base]
        if unknown:
            raise ConfigError(f"{source}: cost: unknown key {unknown[0]!r}; allowed keys: {', '.join(base)}")
        kw["cost"] = _build(CostParams, {**base, **given}, f"{source}: cost")
    for key in _INT_FIELDS + _OPT_INT_FIELDS:
        if key in d:
            v = d[key]
            if v is None and key in _OPT_INT_FIELDS:
                kw[key] = None
            elif not _is_int(v):
                raise ConfigError(f"{source}: {key}={v!r} is not allowed: expected an integer"
                                  + (" or null" if key in _OPT_INT_FIELDS else ""))
            else:
                kw[key] = int(v)
    for key in _FLOAT_FIELDS:
        if key in d:
            kw[key] = _as_float(d[key], f"{source}: {key}")
    for key in _STR_FIELDS:
        if key in d:
            if not isinstance(d[key], str):
                raise ConfigError(f"{source}: {key}={d[key]!r} is not allowed: expected a string")
            kw[key] = d[key]
    for key in _BOOL_FIELDS:
        if key in d:
            if not isinstance(d[key], bool):
                raise ConfigError(f"{source}: {key}={d[key]!r} is not allowed: expected true or false")
            kw[key] = d[key]
    try:
        return InstanceSpec(**kw)
    except ConfigError as e:
        if isinstance(e, UnknownPresetError):
            raise
        raise ConfigError(f"{source}: {e}") from None


def load_instance_spec(path: str | Path) -> InstanceSpec:
    """Read an :class:`InstanceSpec` from a YAML file.

    Raises:
        ConfigError: invalid YAML or spec (the message names the file).
        OSError: the file cannot be read.
    """
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    return instance_spec_from_dict(data, source=str(p))


def save_instance_spec(spec: InstanceSpec, path: str | Path) -> None:
    """Write ``spec`` as a self-contained YAML file (see :func:`instance_spec_to_dict`)."""
    text = yaml.safe_dump(instance_spec_to_dict(spec), sort_keys=False, default_flow_style=False,
                          allow_unicode=True)
    Path(path).write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# table rows


def presets_rows() -> dict[str, list[dict[str, Any]]]:
    """Rows for a presets table: ``{"models": [...], "gpus": [...], "links": [...], "pnm": [...]}``.

    Model rows carry KV bytes/token at bf16 (REFERENCE §5.1 column) and bf16 weights in GB.
    """
    models = [
        {
            "name": m.name,
            "layers": m.n_layers,
            "hidden": m.hidden_size,
            "heads": m.n_heads,
            "kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "params_B": round(m.n_params / 1e9, 2),
            "weights_GB_bf16": round(m.weight_bytes(2.0) / 1e9, 1),
            "kv_bytes_per_token_bf16": int(m.kv_bytes_per_token(2.0)),
            "max_context_tokens": m.max_context_tokens,
        }
        for m in MODEL_PRESETS.values()
    ]
    gpus = [
        {
            "name": g.name,
            "hbm_GB": round(g.hbm_bytes / 1e9, 1),
            "hbm_TB_per_s": round(g.hbm_bytes_per_s / 1e12, 3),
            "bf16_TFLOPS": round(g.bf16_flops_per_s / 1e12, 1),
            "fp8_TFLOPS": round(g.fp8_flops_per_s / 1e12, 1),
            "nvlink_GB_per_s": round(g.nvlink_bytes_per_s / 1e9, 1),
            "pcie_GB_per_s": round(g.pcie_bytes_per_s / 1e9, 1),
        }
        for g in GPU_PRESETS.values()
    ]
    links = [
        {"name": lk.name, "GB_per_s": round(lk.bytes_per_s / 1e9, 2), "latency_us": round(lk.latency_s * 1e6, 1)}
        for lk in LINK_PRESETS.values()
    ]
    pnm = [
        {"name": p.name, "devices": p.n_devices, "capacity_TB": round(p.total_capacity_bytes / 1e12, 2),
         "mem_TB_per_s": round(p.n_devices * p.mem_bytes_per_s / 1e12, 3),
         "attn_TFLOPS": round(p.n_devices * p.attn_flops_per_s / 1e12, 1),
         "link_GB_per_s": round(p.link.bytes_per_s / 1e9, 1)}
        for p in PNM_PRESETS.values()
    ]
    return {"models": models, "gpus": gpus, "links": links, "pnm": pnm}
