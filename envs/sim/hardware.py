"""Hardware specs and presets: GPUs, links (PCIe, NVMe, CXL) and processing-near-memory devices.

Every class is a frozen dataclass validated in ``__post_init__``. Sources (cited per number):
REFERENCE = ``shared/design/REFERENCE.md`` §5.2 (hardware and links) and §3 (PNM); GT =
``shared/groundtruth/`` (``blis/hardware_config.json``). Bytes are SI (1 GB = 1e9 B) unless
written GiB; times in seconds; rates per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import require, bounded_repr
from .registry import Registry
from .spec_validation import int_at_least, non_negative, positive, real_in, string

GiB = 2**30
"""Bytes in one GiB."""

DEFAULT_LINK_LATENCY_S = 10e-6
"""Per-operation latency of a host link (cudaMemcpy launch ~5–10 µs, REFERENCE §5.2)."""


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
        fp4_flops_per_s: dense FP4 tensor peak, FLOP/s (NVFP4 weights and activations, W4A4);
            0 (default) = no FP4 tensor cores: vLLM then runs NVFP4 checkpoints as weight-only
            4-bit (W4A16, the FP4 Marlin kernels), so the math runs at the BF16 peak.

    Raises:
        ConfigError: a non-positive number (a negative ``fp4_flops_per_s``).
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    source: str = ""
    fp4_flops_per_s: float = 0.0

    def __post_init__(self) -> None:
        string("GPUSpec", "name", self.name)
        require(bool(self.name), "GPUSpec.name", self.name, "a non-empty string")
        owner = f"GPUSpec({self.name!r})"
        for name in ("hbm_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s",
                     "nvlink_bytes_per_s", "pcie_bytes_per_s"):
            positive(owner, name, getattr(self, name))
        string(owner, "source", self.source)
        non_negative(owner, "fp4_flops_per_s", self.fp4_flops_per_s)

    def peak_flops_per_s(self, weight_dtype: str) -> float:
        """Dense tensor peak (FLOP/s) the GEMMs of ``weight_dtype`` weights run at: bf16/fp16 ->
        ``bf16_flops_per_s``; fp8 -> ``fp8_flops_per_s`` (FP8 weights and activations, W8A8:
        vLLM's FP8 path quantizes activations dynamically per token on GPUs with FP8 tensor cores;
        where there are none the preset carries its BF16 peak there); nvfp4 ->
        ``fp4_flops_per_s`` when > 0, else ``bf16_flops_per_s`` (weight-only W4A16); int8 (W8A8,
        int8 activations quantized per token) -> twice the BF16 peak, the INT8 tensor rate of every
        preset within 1.3 % (NVIDIA datasheets, dense: A100 624 TOPS, H100/H200 1,979, B200 4,500;
        L40S 733 against 724); int4 (W4A16, weights dequantized to 16 bits in the GEMM) -> ``bf16_flops_per_s``."""
        if weight_dtype == "fp8":
            return self.fp8_flops_per_s
        if weight_dtype == "nvfp4":
            return self.fp4_flops_per_s if self.fp4_flops_per_s > 0 else self.bf16_flops_per_s
        if weight_dtype == "int8":
            return 2.0 * self.bf16_flops_per_s
        return self.bf16_flops_per_s


GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 312e12, 240e9, 25e9,
                "REFERENCE §5.2 A100 SXM 80GB: 2.04 TB/s (2.039 in GT blis/hardware_config.json), "
                "312 TFLOPS BF16 dense; no FP8 tensor cores -> fp8 = bf16 peak (weight-only FP8); "
                "HBM 80 GiB (81920 MiB, as BLIS MemoryGiB 80); NVLink3 300 GB/s per direction "
                "nominal (NVIDIA A100 datasheet: 600 GB/s GPU-GPU, both directions) -> 240e9 achievable "
                "[inferred, same ~0.8 ratio as NVLink4]; PCIe 4 "
                "x16 ~25 GB/s achievable (§5.2)"),
        # NVLink: NVIDIA H100 datasheet, 900 GB/s per GPU both directions, i.e. 450 per direction;
        # 375e9 is ~83 % of it. (The source string stays as it was: it is part of every scenario's
        # hashed resolved instance, and scenario hashes key the bench's stored results.)
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
                "link taken as PCIe 5 (~50 GB/s), §5.2 says PCIe 5/6; FP4 9 PFLOPS dense: NVIDIA "
                "DGX B200 datasheet, 144 PFLOPS FP4 / 72 PFLOPS FP8 inference with sparsity for 8 "
                "GPUs = 18 / 9 per GPU, half without sparsity (FP8 4.5 PF matches the figure above)",
                fp4_flops_per_s=9e15),
        GPUSpec("L40S", 48e9, 0.864e12, 362e12, 733e12, 25e9, 25e9,
                "L40S datasheet [mem]: 48 GB GDDR6 (SI GB), 864 GB/s, 362 TFLOPS BF16 / 733 FP8 "
                "dense (BF16 and BW match GT blis/hardware_config.json); no NVLink -> GPU-GPU "
                "traffic over PCIe 4 (L40S datasheet: PCIe Gen4 x16 64 GB/s both directions; ~25 GB/s "
                "achieved, §5.2); host link PCIe 4 x16 ~25 GB/s"),
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
        string("LinkSpec", "name", self.name)
        require(bool(self.name), "LinkSpec.name", self.name, "a non-empty string")
        owner = f"LinkSpec({self.name!r})"
        positive(owner, "bytes_per_s", self.bytes_per_s)
        non_negative(owner, "latency_s", self.latency_s)

    def transfer_time_s(self, n_bytes: Any) -> Any:
        """Seconds to move ``n_bytes`` (scalar or NumPy array) over this link, one operation each.

        Returns ``latency_s + n_bytes / bytes_per_s`` elementwise, and exactly 0.0 where
        ``n_bytes == 0`` (no operation is issued). Scalar in -> NumPy float64 scalar out.

        Raises:
            ValueError: a negative or NaN byte count.
        """
        b = np.asarray(n_bytes, dtype=np.float64)
        if not np.all(b >= 0):
            raise ValueError(f"n_bytes must be >= 0, got {bounded_repr(n_bytes)}")
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
        string("PNMSpec", "name", self.name)
        require(bool(self.name), "PNMSpec.name", self.name, "a non-empty string")
        owner = f"PNMSpec({self.name!r})"
        for name in ("capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s"):
            positive(owner, name, getattr(self, name))
        int_at_least(owner, "n_devices", self.n_devices, 1)
        real_in(owner, "mbu", self.mbu, lambda x: 0 < x <= 1, "a number in (0, 1]")
        non_negative(owner, "rpc_latency_s", self.rpc_latency_s)
        require(isinstance(self.link, LinkSpec), f"{owner}.link", self.link, "a LinkSpec")
        string(owner, "source", self.source)

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


GPUS: Registry[GPUSpec] = Registry("GPU", GPU_PRESETS, GPU_ALIASES)
"""The GPU presets by name (case-insensitive) and :data:`GPU_ALIASES`."""
LINKS: Registry[LinkSpec] = Registry("link", LINK_PRESETS)
"""The link presets by name (case-insensitive)."""
PNM_DEVICES: Registry[PNMSpec] = Registry("PNM device", PNM_PRESETS)
"""The PNM device presets by name (case-insensitive)."""


def get_gpu(name: str) -> GPUSpec:
    """The GPU preset ``name`` (case-insensitive; :data:`GPU_ALIASES` too, e.g. "H100").

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return GPUS.get(name)


def get_link(name: str) -> LinkSpec:
    """The link preset ``name`` (case-insensitive).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return LINKS.get(name)


def get_pnm(name: str) -> PNMSpec:
    """The PNM device preset ``name`` (case-insensitive).

    Raises:
        UnknownPresetError: unknown name; the message lists the known names.
    """
    return PNM_DEVICES.get(name)
