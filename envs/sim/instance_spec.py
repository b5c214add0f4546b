"""The served system of one instance: a model on ``tp`` GPUs with vLLM-like engine settings and
KV tiers (:class:`InstanceSpec`).

A frozen dataclass validated in ``__post_init__``: a bad value raises
:class:`~kvsched.envs.sim.errors.ConfigError` naming the field, the value and what is allowed.
Derived sizes (KV bytes per block, blocks per tier, token budget, model length) follow vLLM's
rules, cited per property (REFERENCE = ``shared/design/REFERENCE.md`` §4.1 vLLM defaults, §5.1-5.2
sizes; GT = ``shared/groundtruth``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .calibration import default_cost_params
from .cost_params import CostParams
from .errors import ConfigError, require
from .hardware import CXL_LINK, DEFAULT_LINK_LATENCY_S, GiB, LINK_PRESETS, GPUSpec, LinkSpec, PNMSpec
from .model_spec import DTYPE_BYTES, KV_DTYPES, WEIGHT_DTYPES, ModelSpec
from .parallelism import ParallelSpec
from .spec_validation import int_at_least, is_int, non_negative, real_in
from .prefix_offload import PrefixOffloadSpec
from .tiers import STANDARD_TIERS, TierSpec, check_tier_list, tier_path

PREEMPTION_MODES = ("recompute", "swap", "offload")
"""Preemption modes of the standard tiers (recompute: vLLM V1; swap: to DRAM; offload: to NVMe)."""
KV_FREE_ORDERS = ("tail_first", "head_first")
"""Orders a request's HBM prefix segments become evictable in (``InstanceSpec.kv_free_order``)."""
SELF_PREEMPTION = ("ends_pass", "continues")
"""What a running request that preempts itself does to the step (``InstanceSpec.self_preemption``)."""
UNCHUNKED_OVERFLOW = ("skip", "stop")
"""What admission does at a waiting prompt longer than the budget left without chunked prefill
(``InstanceSpec.unchunked_overflow``)."""
LONG_PREFILL_THRESHOLD_ALONE = ("cap", "lift")
"""Whether ``long_prefill_token_threshold`` caps the chunk of a request that is the only one running
or waiting (``InstanceSpec.long_prefill_threshold_alone``)."""
TP_DEGREES = (1, 2, 4, 8)
#: Most KV blocks one tier may hold: 2**53 (exact as a float, fits the int64 columns of router and
#: feature tables; 2**53 blocks of the smallest KV block are far beyond any real memory).
MAX_TIER_BLOCKS = 2**53

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
        weight_dtype: "auto" (default: the checkpoint's, ``model.weight_dtype``, as vLLM loads a
            quantized checkpoint as stored), "bf16", "fp16", "fp8" (vLLM ``--quantization fp8`` on a
            16-bit checkpoint: FP8 weights and dynamic FP8 activations) or "nvfp4" (4-bit weights
            with FP8 block scales; FP4 math where ``gpu.fp4_flops_per_s > 0``). The resolved dtype
            is :attr:`effective_weight_dtype`; the model's ``quantized_weights`` says which
            weights it applies to.
        kv_dtype: vLLM ``--kv-cache-dtype``: "auto" (default, vLLM ``cache_dtype="auto"``: the
            model's activation dtype, i.e. the weight dtype for bf16/fp16 and bf16 for fp8
            checkpoints, whose config dtype stays bfloat16), "bf16", "fp16" or "fp8" (1 byte:
            half the KV bytes per token).
            For "auto" the activation dtype of a quantized (fp8/nvfp4) model is bf16.
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
        max_num_partial_prefills: at most this many requests may be left with an unfinished
            prefill by one step, each prefill's chunk at most the token budget split over up to
            this many prefills; None (default) = no limit, as vLLM V1, which never honoured the
            flag (V1's ``EngineArgs`` refused or fell back to V0 for "Concurrent Partial
            Prefill"; gone in 0.32). The limit is vLLM V0's ``--max-num-partial-prefills``
            (``SchedulerConfig``, default 1; ``PartialPrefillMetadata`` and
            ``partial_prefill_budget_lookup_list`` in ``vllm/core/scheduler.py``): with V0's
            default 1 a step chunks only the prefill that exhausts the budget, so at most one
            is left unfinished -- here ``1`` says so explicitly (before this field took None,
            1 meant no limit: files that wrote 1 for that must write null).
        max_long_partial_prefills: vLLM V0 ``--max-long-partial-prefills``, 1: how many of those
            may be *long* (prompt above the effective ``long_prefill_token_threshold``);
            1 <= long <= max_num_partial_prefills, and 1 without a partial-prefill limit.
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
        kv_free_order: the order a finished or preempted request's HBM prefix segments become
            evictable: ``"tail_first"`` (default, vLLM V1: ``KVCacheManager.free`` frees the
            request's blocks reversed, so ``BlockPool.free_blocks`` appends its last block to the
            LRU free queue first and its first block last; the head block, the one a follow-up
            sharing the prompt needs first, is evicted last) or ``"head_first"`` (kvsched <= 0.1's
            order without ``cache_decode_blocks``, kept only so results computed with it -- kvsched
            bench v1 -- reproduce exactly: the head is evicted first and a follow-up's leading-run
            lookup then hits 0 tokens even though the rest of its prompt is still cached; with
            ``cache_decode_blocks`` kvsched always freed tail first, so it changes nothing there).
        self_preemption: when a running request needs blocks and the victim rule picks the request
            itself: ``"ends_pass"`` (default, vLLM V1 ``Scheduler.schedule``: ``if new_blocks is
            None: break`` after ``preempted_req == request``; the running requests after it get
            nothing this step, and a step that scheduled nothing is an empty step) or
            ``"continues"`` (kvsched <= 0.2: the pass goes on with the next running request; kept
            only so results computed with it -- kvsched bench v1 -- reproduce exactly). Under fcfs
            the victim is the last running request, so only a victim rule that picks from the
            middle of the running list (priority scheduling, Scheduling-v0's victim actions) sees
            a difference.
        unchunked_overflow: without chunked prefill, what admission does at a waiting prompt
            whose tokens to compute exceed the token budget left in the step: ``"skip"``
            (default: it waits and later, shorter prompts may still be admitted, as vLLM V1 up to
            0.11 -- ``Scheduler.schedule`` put it in ``skipped_waiting_requests`` and went on,
            ``continue`` -- the releases of kvsched's reference runs) or ``"stop"`` (vLLM 0.32:
            ``vllm/v1/core/sched/scheduler.py`` lines 1158-1167, ``if not
            enable_chunked_prefill and num_new_tokens > request_token_budget: break``, so no later
            request is admitted in that step). Changes nothing with chunked prefill.
        long_prefill_threshold_alone: whether ``long_prefill_token_threshold`` caps the chunk of
            a request that is alone (at the step's start one request running, waiting or swapped
            out, itself): ``"cap"`` (default: every chunk is capped, as vLLM V1 up to 0.11) or
            ``"lift"`` (vLLM 0.32: ``Scheduler.schedule``, ``vllm/v1/core/sched/scheduler.py``
            lines 640-649, uses the threshold only ``if num_eligible_reqs > 1`` with
            ``num_eligible_reqs = len(running) + len(waiting)``, "nobody to starve"). Only the
            chunk cap is lifted; which prompts count as long (the partial-prefill limit) stays.
        preemption_mode: "recompute" (vLLM V1, §4.1), "swap" (to DRAM; needs dram_kv_bytes > 0)
            or "offload" (to NVMe; needs nvme_kv_bytes > 0).
        pnm: an optional processing-near-memory KV tier (:class:`PNMSpec`), None (default) =
            absent. Its blocks are sized like the other tiers (whole-instance KV bytes per block).
        prefix_offload: lower tiers that cache computed prefixes (host DRAM, NVMe, an extra tier
            holding ``prefix``), their write, eviction and load policies
            (:class:`~kvsched.envs.sim.prefix_offload.PrefixOffloadSpec`: vLLM's KV offloading,
            LMCache, SGLang HiCache); None (default): prefixes live only in HBM. Needs prefix
            caching.
        extra_tiers: further KV tiers (:class:`~kvsched.envs.sim.tiers.TierSpec`), listed after
            NVMe in :attr:`tiers` (swap fallback order), default none. A tier holding swapped
            blocks is a preemption target under its ``preemption_mode`` (default its name).
        expert_parallel: for a mixture-of-experts model, spread whole experts over the ``tp``
            ranks (expert parallelism, vLLM ``--enable-expert-parallel``) instead of sharding
            every expert over them (default False, vLLM's default); tokens then reach their experts'
            ranks by all-to-all dispatch and combine (:mod:`~kvsched.envs.sim.cost_model`).
        parallel: long-context parallelism beyond TP (:class:`~.parallelism.ParallelSpec`: pipeline
            stages with Medha's stream pipelining of prefill chunks, KV-parallel groups, or
            LoongServe's elastic sequence parallelism), None (default) = one group of ``tp`` GPUs.
            With it the instance spans ``tp × pp_stages × groups`` GPUs: weights and KV bytes per
            GPU are the largest stage's share (``ceil(L/S)/L``), and the HBM KV blocks are the
            groups' sum. Not with a PNM tier, nor with a mixture-of-experts or partly quantized
            ("mlp", "linear") model.
        cost: efficiency parameters of the cost model. None (default) means
            :func:`default_cost_params` of the GPU (the calibration file where one exists, else
            the literature defaults with the H100 calibration's host-side fields); after
            construction the field always holds a CostParams.

    Raises:
        ConfigError: any value out of range, weights that do not fit in
            ``gpu_memory_utilization`` of a GPU, KV capacity below one block, ``max_model_len``
            above the KV capacity or the model's context, or (chunked prefill off) a token budget
            below the model length.
    """

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    weight_dtype: str = "auto"
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
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    cache_decode_blocks: bool = False
    kv_free_order: str = "tail_first"
    self_preemption: str = "ends_pass"
    unchunked_overflow: str = "skip"
    long_prefill_threshold_alone: str = "cap"
    preemption_mode: str = "recompute"
    cost: CostParams | None = None
    pnm: PNMSpec | None = None
    extra_tiers: tuple[TierSpec, ...] = ()
    prefix_offload: PrefixOffloadSpec | None = None
    expert_parallel: bool = False
    parallel: ParallelSpec | None = None

    # derived in __post_init__ (not init arguments, not compared)
    _pcie_auto: bool = field(init=False, repr=False, compare=False)
    _cost_auto: bool = field(init=False, repr=False, compare=False)
    _weight_dtype: str = field(init=False, repr=False, compare=False)
    _weight_dtype_bytes: float = field(init=False, repr=False, compare=False)
    _kv_dtype_bytes: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_token: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_block: float = field(init=False, repr=False, compare=False)
    _kv_bytes_per_block_per_gpu: float = field(init=False, repr=False, compare=False)
    _weight_bytes_per_gpu: float = field(init=False, repr=False, compare=False)
    _num_hbm_blocks: int = field(init=False, repr=False, compare=False)
    _tiers: tuple[TierSpec, ...] = field(init=False, repr=False, compare=False)
    _tier_blocks: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _token_budget: int = field(init=False, repr=False, compare=False)
    _max_seqs: int = field(init=False, repr=False, compare=False)
    _model_len_limit: int = field(init=False, repr=False, compare=False)

    # ---------------------------------------------------------------- validation + derivation

    def __post_init__(self) -> None:
        self._check_types()
        self._check_limits()
        g = self.gpu
        self._set("_cost_auto", self.cost is None)
        if self.cost is None:
            self._set("cost", default_cost_params(g))
        self._set("_pcie_auto", self.pcie is None)
        if self.pcie is None:
            self._set("pcie", LinkSpec(f"{g.name}-pcie", g.pcie_bytes_per_s, DEFAULT_LINK_LATENCY_S))
        self._derive_kv_sizes()
        self._derive_tiers()
        self._derive_scheduler_limits()

    def _set(self, name: str, value: object) -> None:
        """Set a derived field once (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def _check_types(self) -> None:
        """Model, GPU, TP degree, dtypes, memory fields and links."""
        o = "InstanceSpec"
        require(isinstance(self.model, ModelSpec), f"{o}.model", self.model, "a ModelSpec")
        require(isinstance(self.gpu, GPUSpec), f"{o}.gpu", self.gpu, "a GPUSpec")
        m = self.model
        require(is_int(self.tp) and self.tp in TP_DEGREES, f"{o}.tp", self.tp, f"one of {TP_DEGREES}")
        require(self.tp <= m.n_heads and m.n_heads % self.tp == 0, f"{o}.tp", self.tp,
                f"a divisor of {m.name}'s n_heads={m.n_heads}")
        require(m.n_kv_heads % self.tp == 0 or self.tp % m.n_kv_heads == 0, f"{o}.tp", self.tp,
                f"a divisor or multiple of {m.name}'s n_kv_heads={m.n_kv_heads}")
        require(self.weight_dtype == "auto" or self.weight_dtype in WEIGHT_DTYPES, f"{o}.weight_dtype",
                self.weight_dtype, f"one of auto, {', '.join(WEIGHT_DTYPES)}")
        require(isinstance(self.expert_parallel, bool), f"{o}.expert_parallel", self.expert_parallel, "true or false")
        require(not self.expert_parallel or m.is_moe, f"{o}.expert_parallel", self.expert_parallel,
                f"false for {m.name}, a dense model (expert parallelism needs n_experts > 0)")
        require(not self.expert_parallel or m.n_experts >= self.tp, f"{o}.expert_parallel", self.expert_parallel,
                f"false at tp={self.tp} for {m.name}'s {m.n_experts} experts (each rank holds at least one)")
        require(self.kv_dtype in KV_DTYPES, f"{o}.kv_dtype", self.kv_dtype, f"one of {', '.join(KV_DTYPES)}")
        int_at_least(o, "block_size_tokens", self.block_size_tokens, 1)
        real_in(o, "gpu_memory_utilization", self.gpu_memory_utilization, lambda x: 0 < x <= 1,
                "a number in (0, 1]")
        non_negative(o, "activation_reserve_bytes", self.activation_reserve_bytes)
        if self.hbm_kv_blocks is not None:
            int_at_least(o, "hbm_kv_blocks", self.hbm_kv_blocks, 1)
        non_negative(o, "dram_kv_bytes", self.dram_kv_bytes)
        non_negative(o, "nvme_kv_bytes", self.nvme_kv_bytes)
        for name in ("pcie", "nvme_read", "nvme_write"):
            value = getattr(self, name)
            ok = isinstance(value, LinkSpec) or (name == "pcie" and value is None)
            require(ok, f"{o}.{name}", value, "a LinkSpec" + (" or None" if name == "pcie" else ""))
        require(self.pnm is None or isinstance(self.pnm, PNMSpec), f"{o}.pnm", self.pnm,
                "a PNMSpec or None (no PNM tier)")
        require(self.cost is None or isinstance(self.cost, CostParams), f"{o}.cost", self.cost,
                "a CostParams or None (the GPU's default)")
        if self.parallel is not None:
            require(isinstance(self.parallel, ParallelSpec), f"{o}.parallel", self.parallel,
                    "a ParallelSpec or None (one group of tp GPUs)")
            require(self.parallel.pp_stages <= m.n_layers, f"{o}.parallel.pp_stages", self.parallel.pp_stages,
                    f"at most {m.name}'s n_layers={m.n_layers}")
            require(self.pnm is None, f"{o}.parallel", self.parallel.describe(),
                    "None with a PNM tier (pnm): the two are not modelled together")
            require(not m.is_moe and m.quantized_weights == "all", f"{o}.parallel", self.parallel.describe(),
                    f"None for {m.name}: long-context layouts price dense models with uniformly quantized "
                    "weights only (parallelism.ParallelCost has no expert terms)")
        if isinstance(self.extra_tiers, list):
            self._set("extra_tiers", tuple(self.extra_tiers))
        require(isinstance(self.extra_tiers, tuple) and all(isinstance(t, TierSpec) for t in self.extra_tiers),
                f"{o}.extra_tiers", self.extra_tiers, "a list of TierSpec")
        for t in self.extra_tiers:
            require(t.name not in STANDARD_TIERS, f"{o}.extra_tiers", t.name,
                    f"a tier name other than the standard ones ({', '.join(STANDARD_TIERS)})")
            # the contents with a tier-generic mechanism: swapped blocks (a preemption target) and
            # cached prefixes (prefix_offload); running blocks compute in HBM, PNM residency needs
            # a device that computes (recompute and migrate are reserved modes: check_tier_list)
            require(t.preemption_mode not in ("swap", "offload"), f"{o}.extra_tiers[{t.name}].preemption_mode",
                    t.preemption_mode, "a mode of its own, not the DRAM tier's 'swap' or NVMe's 'offload'")
            require(set(t.holds) <= {"swapped", "prefix"}, f"{o}.extra_tiers[{t.name}].holds", list(t.holds),
                    "['swapped'], ['prefix'] or both on an extra tier (running: HBM only; pnm_resident: the PNM tier)")
            listed = self.prefix_offload is not None and t.name in getattr(self.prefix_offload, "tiers", ())
            require("prefix" not in t.holds or listed, f"{o}.extra_tiers[{t.name}].holds", list(t.holds),
                    f"'prefix' only on a tier listed in prefix_offload.tiers (which fills it); add {t.name!r} there "
                    "or drop 'prefix'")

    def _check_limits(self) -> None:
        """Scheduler limits, feature flags and the preemption mode."""
        o = "InstanceSpec"
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) is not None:
                int_at_least(o, name, getattr(self, name), 1)
        int_at_least(o, "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        partial = self.max_num_partial_prefills
        require(partial is None or (is_int(partial) and int(partial) >= 1), f"{o}.max_num_partial_prefills", partial,
                "None (no limit) or an integer >= 1")
        int_at_least(o, "max_long_partial_prefills", self.max_long_partial_prefills, 1)
        if partial is None:
            require(self.max_long_partial_prefills == 1, f"{o}.max_long_partial_prefills",
                    self.max_long_partial_prefills, "1 without a partial-prefill limit (max_num_partial_prefills=None)")
        else:
            require(self.max_long_partial_prefills <= partial, f"{o}.max_long_partial_prefills",
                    self.max_long_partial_prefills, f"<= max_num_partial_prefills={partial}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cache_decode_blocks"):
            require(isinstance(getattr(self, name), bool), f"{o}.{name}", getattr(self, name), "true or false")
        require(self.kv_free_order in KV_FREE_ORDERS, f"{o}.kv_free_order", self.kv_free_order,
                f"one of {', '.join(KV_FREE_ORDERS)}")
        require(self.self_preemption in SELF_PREEMPTION, f"{o}.self_preemption", self.self_preemption,
                f"one of {', '.join(SELF_PREEMPTION)}")
        require(self.unchunked_overflow in UNCHUNKED_OVERFLOW, f"{o}.unchunked_overflow", self.unchunked_overflow,
                f"one of {', '.join(UNCHUNKED_OVERFLOW)}")
        require(self.long_prefill_threshold_alone in LONG_PREFILL_THRESHOLD_ALONE, f"{o}.long_prefill_threshold_alone",
                self.long_prefill_threshold_alone, f"one of {', '.join(LONG_PREFILL_THRESHOLD_ALONE)}")
        modes = PREEMPTION_MODES + tuple(t.preemption_mode for t in self.extra_tiers if t.preemption_mode)
        require(self.preemption_mode in modes, f"{o}.preemption_mode", self.preemption_mode,
                f"one of {', '.join(modes)}")
        require(self.preemption_mode != "swap" or self.dram_kv_bytes > 0, f"{o}.preemption_mode",
                self.preemption_mode, "'swap' only with a DRAM tier: set dram_kv_bytes > 0")
        require(self.preemption_mode != "offload" or self.nvme_kv_bytes > 0, f"{o}.preemption_mode",
                self.preemption_mode, "'offload' only with an NVMe tier: set nvme_kv_bytes > 0")
        for t in self.extra_tiers:
            require(self.preemption_mode != t.preemption_mode or t.capacity_bytes > 0, f"{o}.preemption_mode",
                    self.preemption_mode, f"{t.preemption_mode!r} only with tier {t.name!r} of capacity_bytes > 0")

    def _derive_kv_sizes(self) -> None:
        """Bytes per element, KV bytes per token and block (whole instance and per TP rank)."""
        m = self.model
        w_dtype = m.weight_dtype if self.weight_dtype == "auto" else self.weight_dtype
        w_bytes = DTYPE_BYTES[w_dtype]
        self._set("_weight_dtype", w_dtype)
        if self.kv_dtype == "auto":
            kv_bytes = w_bytes if w_dtype in ("bf16", "fp16") else 2.0
        else:
            kv_bytes = DTYPE_BYTES[self.kv_dtype]
        self._set("_weight_dtype_bytes", w_bytes)
        self._set("_kv_dtype_bytes", kv_bytes)
        # KV heads shard over TP ranks; with tp > n_kv_heads each rank holds one head
        kv_tok = m.kv_bytes_per_token(kv_bytes)
        kv_block = kv_tok * self.block_size_tokens
        heads_per_gpu = max(1, m.n_kv_heads // self.tp)
        self._set("_kv_bytes_per_token", kv_tok)
        self._set("_kv_bytes_per_block", kv_block)
        if m.is_mla:  # the latent is shared by all heads: every TP rank caches all of it
            self._set("_kv_bytes_per_block_per_gpu", kv_block)
        else:
            self._set("_kv_bytes_per_block_per_gpu", kv_block / m.n_kv_heads * heads_per_gpu)
        self._set("_weight_bytes_per_gpu", m.weight_bytes(w_bytes) / self.tp)
        if self.parallel is not None:  # the largest pipeline stage's share of the layers
            frac = self.parallel.stage_fraction(m.n_layers)
            self._set("_kv_bytes_per_block_per_gpu", self._kv_bytes_per_block_per_gpu * frac)
            self._set("_weight_bytes_per_gpu", self._weight_bytes_per_gpu * frac)

    def _derive_tiers(self) -> None:
        """The ordered tier list (:mod:`kvsched.envs.sim.tiers`) and each tier's capacity in blocks."""
        o = "InstanceSpec"
        kv_block = self._kv_bytes_per_block
        hbm_blocks = self._derive_hbm_blocks()
        pcie = self.pcie_link
        cached = () if self.prefix_offload is None else self.prefix_offload.tiers
        dram_holds = ("swapped", "prefix") if "dram" in cached else ("swapped",)
        nvme_holds = ("swapped", "prefix") if "nvme" in cached else ("swapped",)
        tiers = [TierSpec("hbm", hbm_blocks * kv_block, ("running", "prefix"), ""),
                 TierSpec("dram", self.dram_kv_bytes, dram_holds, "hbm", pcie, pcie, "pcie_d2h", "pcie_h2d", "swap"),
                 TierSpec("nvme", self.nvme_kv_bytes, nvme_holds, "dram", self.nvme_write, self.nvme_read,
                          "nvme_write", "nvme_read", "offload"),
                 *self.extra_tiers]
        blocks = [hbm_blocks] + [int(math.floor(t.capacity_bytes / kv_block)) for t in tiers[1:]]
        pnm = self.pnm
        pnm_bytes = 0.0 if pnm is None else pnm.total_capacity_bytes
        pnm_link = CXL_LINK if pnm is None else pnm.link
        tiers.append(TierSpec("pnm", pnm_bytes, ("pnm_resident",), "hbm", pnm_link, pnm_link, "pnm_link", "pnm_link"))
        blocks.append(0 if pnm is None else int(math.floor(pnm_bytes / kv_block)))
        if pnm is not None:
            require(blocks[-1] >= 1, f"{o}.pnm.capacity_bytes", pnm.capacity_bytes,
                    f"at least one KV block ({kv_block:.0f} bytes over {pnm.n_devices} device(s))")
        check_tier_list(tuple(tiers), o)
        for t, n in zip(tiers, blocks):  # block counts go into int64 columns (router tables, features)
            require(n <= MAX_TIER_BLOCKS, f"{o}: blocks of tier {t.name!r}", n,
                    f"at most {MAX_TIER_BLOCKS} blocks of {kv_block:.0f} bytes (set by hbm_kv_blocks, dram_kv_bytes, "
                    "nvme_kv_bytes, pnm or extra_tiers[].capacity_bytes)")
        for t, n in zip(tiers, blocks):  # the spec's mode sends victims there: it must hold a block
            require(t.preemption_mode != self.preemption_mode or n >= 1, f"{o}.preemption_mode",
                    self.preemption_mode, f"a mode whose tier ({t.name!r}) holds at least one KV block of "
                    f"{kv_block:.0f} bytes; it holds {t.capacity_bytes:g} bytes")
        self._check_prefix_tiers(tiers, blocks)
        self._set("_tiers", tuple(tiers))
        self._set("_tier_blocks", tuple(blocks))
        self._set("_num_hbm_blocks", hbm_blocks)

    def _check_prefix_tiers(self, tiers: list[TierSpec], blocks: list[int]) -> None:
        """``prefix_offload``'s tiers exist, hold a block, may hold prefixes, and go down one path.

        Raises:
            ConfigError: naming ``InstanceSpec.prefix_offload`` and what is wrong.
        """
        po = self.prefix_offload
        if po is None:
            return
        o = "InstanceSpec.prefix_offload"
        require(isinstance(po, PrefixOffloadSpec), o, po, "a PrefixOffloadSpec (or, in YAML, a mapping of its fields)")
        require(self.enable_prefix_caching, o, po.tiers, "None unless enable_prefix_caching is true (the lower "
                "tiers cache what HBM's prefix cache computed)")
        index = {t.name: i for i, t in enumerate(tiers)}
        prev = None
        for name in po.tiers:
            i = index.get(name)
            require(i is not None, f"{o}.tiers", name, f"a tier of this instance ({', '.join(index)})")
            assert i is not None
            where = f"{name}_kv_bytes" if name in ("dram", "nvme") else f"extra_tiers[{name}].capacity_bytes"
            require(blocks[i] >= 1, f"{o}.tiers", name, f"a tier with capacity (set {where} to at least one KV block)")
            require("prefix" in tiers[i].holds, f"{o}.tiers", name, "a tier whose holds include 'prefix' (an extra "
                    "tier must declare it)")
            if prev is not None:
                require(prev in tier_path(tuple(tiers), i), f"{o}.tiers", list(po.tiers),
                        f"tiers top down along one copy path ({tiers[prev].name!r} is not above {name!r})")
            prev = i

    def _derive_scheduler_limits(self) -> None:
        """Model length limit, token budget and sequence limit (vLLM's defaults and rules)."""
        o = "InstanceSpec"
        m, g = self.model, self.gpu
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
                    f"for {m.name} on {self._gpus_text()}, and vLLM refuses to start; lower max_model_len, "
                    "raise gpu_memory_utilization or tp" + (", pp_stages or kvp_groups" if self.parallel else "")
                    + ", or use kv_dtype='fp8'")
            model_len = int(self.max_model_len)
        else:
            model_len = min(m.max_context_tokens, capacity_tokens)
        self._set("_model_len_limit", model_len)
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
        self._set("_token_budget", budget)
        self._set("_max_seqs", int(self.max_num_seqs) if self.max_num_seqs is not None else default_seqs)

    def _derive_hbm_blocks(self) -> int:
        m, g = self.model, self.gpu
        usable = self.gpu_memory_utilization * g.hbm_bytes
        weights = self._weight_bytes_per_gpu
        where = f"{m.name} on {self._gpus_text()} (tp={self.tp}, weight_dtype={self._weight_dtype})"
        if weights >= usable:
            # quantizing is a remedy only for 16-bit weights (an fp8 checkpoint, e.g. DeepSeek-V3, already is)
            quantize = "use weight_dtype='fp8', " if DTYPE_BYTES[self._weight_dtype] > DTYPE_BYTES["fp8"] else ""
            raise ConfigError(
                f"weights of {where} do not fit: {weights / 1e9:.2f} GB per GPU >= "
                f"gpu_memory_utilization x HBM = {self.gpu_memory_utilization} x {g.hbm_bytes / 1e9:.2f} GB "
                f"= {usable / 1e9:.2f} GB; raise tp, {quantize}pick a GPU with more "
                "memory, or raise gpu_memory_utilization")
        if self.hbm_kv_blocks is not None:
            return int(self.hbm_kv_blocks)
        free = usable - weights - self.activation_reserve_bytes
        per_block = self._kv_bytes_per_block_per_gpu
        blocks = int(math.floor(free / per_block)) if free > 0 else 0
        if self.parallel is not None:  # every KV group holds as many blocks (Medha KVP, LoongServe ESP)
            blocks *= self.parallel.kv_groups
        if blocks < 1:
            raise ConfigError(
                f"KV capacity of {where} is below one block: {usable / 1e9:.2f} GB usable - "
                f"{weights / 1e9:.2f} GB weights - {self.activation_reserve_bytes / 1e9:.2f} GB activation "
                f"reserve = {free / 1e9:.3f} GB < {per_block / 1e9:.4f} GB per block per GPU; raise tp or "
                "gpu_memory_utilization, lower activation_reserve_bytes, or use fp8 weights / KV")
        return blocks

    def _gpus_text(self) -> str:
        """The instance's GPUs in words, for messages ("8x H100-SXM" or with the parallel layout)."""
        if self.parallel is None:
            return f"{self.tp}x {self.gpu.name}"
        return f"{self.num_gpus}x {self.gpu.name} (TP{self.tp} x {self.parallel.describe()})"

    @property
    def num_gpus(self) -> int:
        """GPUs of the instance: ``tp``, times ``pp_stages × kv_groups`` with :attr:`parallel`."""
        if self.parallel is None:
            return self.tp
        return self.tp * self.parallel.pp_stages * self.parallel.kv_groups

    # ---------------------------------------------------------------- derived, read-only

    @property
    def effective_weight_dtype(self) -> str:
        """The weight dtype in force: ``weight_dtype``, or the model's when it is "auto"."""
        return self._weight_dtype

    @property
    def weight_dtype_bytes(self) -> float:
        """Bytes per quantized weight element (bf16/fp16: 2, fp8: 1, nvfp4: 0.5625)."""
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
        ``kv_bytes_per_block / n_kv_heads`` (REFERENCE §5.1). Latent attention (MLA): the whole
        ``kv_bytes_per_block`` on every rank (vLLM replicates the latent cache over TP ranks).
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
        return self._tier_blocks[1]

    @property
    def num_nvme_blocks(self) -> int:
        """Blocks the NVMe tier holds: floor(nvme_kv_bytes / kv_bytes_per_block)."""
        return self._tier_blocks[2]

    @property
    def num_pnm_blocks(self) -> int:
        """Blocks the PNM tier holds: floor(pnm.total_capacity_bytes / kv_bytes_per_block), 0 without PNM."""
        return self._tier_blocks[-1]

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

    @property
    def cost_params(self) -> CostParams:
        """The cost parameters in force (``cost``, or the GPU's default when it was None)."""
        assert self.cost is not None  # set in __post_init__
        return self.cost

    @property
    def cost_is_default(self) -> bool:
        """True when ``cost`` was left None, so :func:`default_cost_params` of the GPU is in force
        (``calibration.default_cost_source`` says where those come from)."""
        return self._cost_auto

    @property
    def pcie_link(self) -> LinkSpec:
        """The GPU<->host link in force (``pcie``, or the GPU's when it was None)."""
        assert self.pcie is not None  # set in __post_init__
        return self.pcie

    @property
    def tiers(self) -> tuple[TierSpec, ...]:
        """The instance's KV tiers in order: HBM, DRAM, NVMe, the extra tiers, PNM (capacity 0 when
        absent; :mod:`kvsched.envs.sim.tiers`)."""
        return self._tiers

    @property
    def tier_capacity_blocks(self) -> tuple[int, ...]:
        """KV blocks each tier of :attr:`tiers` holds (same order)."""
        return self._tier_blocks

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


