"""Roofline step-time model and KV transfer times of one serving instance (pure functions).

Implements REFERENCE §5.3 (``shared/design/REFERENCE.md``) per TP rank:

```
FLOPs  = 2·P_m·n_tokens + A·attn_pairs                 P_m = matmul params / tp, A = 4·L·n_h·d_h / tp
Bytes  = W + kvt·kv_tokens                             W = weight bytes / tp, kvt = KV bytes/token/GPU
MFU(n) = mfu_max · n / (n + mfu_half_tokens)           (REFERENCE §5.2)
t_step = max(FLOPs / (F·MFU(n)), Bytes / (B·mbu)) + step_overhead_s + t_comm(n) + t_host
t_comm = 2·L·(2·(tp−1)/tp · n·hidden·2 B / (nvlink·η) + allreduce_latency_s
              + 2·(tp−1)·allreduce_hop_latency_s)                             (0 at tp = 1)
t_host = seq_overhead_s · n_seqs + step_token_overhead_s · n_tokens
```

``t_comm`` is the ring all-reduce of the α-β model (Thakur, Rabenseifner & Gropp, IJHPCA 2005):
each of the two all-reduces per layer (after the attention output projection and after the MLP
down projection, vLLM's ``RowParallelLinear`` with ``reduce_results``) moves ``2(tp−1)/tp`` of the
``n·hidden`` bf16 activations per rank over the per-direction link rate ``GPUSpec.nvlink_bytes_per_s``,
and pays a fixed latency plus one hop latency per ring step (``2(tp−1)`` steps). That is
``CostParams.allreduce_algorithm = "ring"`` (the default); under ``"vllm"`` each all-reduce is
priced as the kernel vLLM picks for its ``n·hidden·2 B`` message -- one-shot or two-shot custom
all-reduce below 8 MiB (``csrc/custom_all_reduce.cuh``), NCCL's ring above -- a few affine pieces
in ``n`` (:mod:`~kvsched.envs.sim.allreduce`, which cites the vLLM source and explains the floor
that keeps the price non-decreasing in ``n``).
``t_host`` is the engine core's per-request and per-token CPU work, serial with the GPU in vLLM
V1's ``EngineCore.step`` (:class:`~kvsched.envs.sim.cost_params.CostParams`); ``n_seqs`` is the
number of sequences scheduled in the step (decodes + prefill chunks; 1 when a caller gives none).

with F the dense peak for the weight dtype (FP8 peak for fp8 weights), B the HBM bandwidth and
η = ``allreduce_bw_efficiency`` the achieved share of the GPU-GPU link in TP all-reduces.
A batch with prefill chunks ``{(c_j, p_j)}`` (c_j new tokens after p_j cached ones) and decodes with
cached contexts ``{ctx_k}`` is summarised by three numbers:

- ``n_tokens   = Σ_j c_j + (number of decodes)``
- ``attn_pairs = Σ_j c_j·(p_j + c_j/2) + Σ_k ctx_k``
- ``kv_tokens  = Σ_j (p_j + c_j) + Σ_k ctx_k``

**PNM-resident decodes** (REFERENCE §3.2, hybrid execution; specs ``PNMSpec``): their linear layers
stay in the GPU step (they count in ``n_tokens``) but their attention reads happen near memory, so
their contexts are left out of ``attn_pairs`` and ``kv_tokens`` and summed in ``pnm_kv_tokens``:

```
t_pnm  = max( kvt_all·pnm_kv_tokens / (n_dev·BW_pnm·MBU_pnm), A_all·pnm_kv_tokens / (n_dev·F_pnm) )
t_step = max( max(FLOPs/(F·MFU(n)), Bytes/(B·mbu)), t_pnm ) + step_overhead_s + t_comm(n)
         + 2·t_rpc + n_pnm · (4·L·n_h·d_h·2 B / tp) / BW_link
```

(``kvt_all``, ``A_all``: whole-model KV bytes per token and attention FLOPs per pair; the KV is
striped over the ``n_dev`` devices.) GPU work and PNM attention **overlap** (the ``max``), as the
§3.2 formula has it: per layer the GPU runs the GPU-resident requests' attention and the FC/MLP
while the PNM devices run the PNM-resident requests' attention (L3, arXiv 2504.17584, coordinates
GPU and DIMM-PIM this way). What cannot overlap is **serial**: one RPC round trip (``2·t_rpc``) and
the q/k/v/o activations of each PNM-resident decode token crossing the GPU<->PNM link (per TP rank,
its heads only). The per-step (not per-layer) RPC count follows §3.2 as written [inferred].

**Mixture of experts** (``model.n_experts > 0``). A token runs the attention, dense-layer MLPs
and shared experts of every layer plus its top-k routed experts in each of the L_moe MoE layers,
and a step reads the weights of every *distinct* expert its n tokens activate. With P_e =
3·hidden·expert_width the weights of one expert in one layer, D(n) the expected number of distinct
experts n tokens activate (``ModelSpec.expected_distinct_experts``: E·(1 − (1 − k/E)^n) under
uniform routing -- D(1) = k, D(n) -> E), η_moe = ``moe_efficiency`` and h = ``mfu_half_tokens``:

```
FLOPs_dense = 2·P_d·n + A·attn_pairs                          P_d = (matmul params − all routed experts) / tp
t_compute   = FLOPs_dense·(n + h)/(F·mfu_max·n)  +  c_e·(k·n + h·D(n)) / (F·mfu_max·η_moe)
Bytes       = W_d + w_e·D(n)/η_moe + kvt·kv_tokens            W_d = weight bytes / tp less all routed experts
```

with ``c_e = 2·L_moe·P_e/tp`` and ``w_e = L_moe·P_e·bytes/tp``, n here being the step's tokens
after CUDA-graph padding (:func:`cuda_graph_tokens`: vLLM V1 runs a step of up to 512 tokens padded
to its next capture size, 1, 2, 4 or a multiple of 8, and the padded slots, holding stale token
ids, are routed to experts too; the dense part keeps the unpadded n, where padding changes nothing
that a memory-bound decode step would show). The expert term is the MFU ramp
applied per expert: n tokens put m = k·n/D(n) tokens on each activated expert, and
2·k·n·L_moe·P_e/tp FLOPs at MFU(m) = mfu_max·m/(m + h) is the term above. **Tensor parallel**
(default; vLLM's default): every expert is sharded over the tp ranks, each rank reads 1/tp of
each activated expert, and the MoE layers end in the usual all-reduce. **Expert parallel**
(``InstanceSpec.expert_parallel``, vLLM ``--enable-expert-parallel``): each rank holds E/tp whole
experts; under uniform routing it reads D(n)/tp of them on average, the same bytes and FLOPs as
TP (the slowest rank's excess under imbalance is not modelled). Its MoE layers exchange tokens
instead of all-reducing: each rank dispatches its n/tp tokens' k expert copies to the ranks that
hold them and combines the results back (all-to-all, as vLLM's all2all backends / DeepEP with
the tokens split over the ranks), 2·k·n·(tp−1)/tp²·hidden·2 B per rank per MoE layer over the
link at ``allreduce_bw_efficiency``, two latencies. Dense models take none of these terms (their
step times are unchanged to the bit).

**Weight-only quantization** (int4; fp8 or nvfp4 on a GPU without tensor cores for them, whose
peak for the dtype is its BF16 peak): the MFU ramp's half-point ``h`` of the quantized weights is
scaled by the weight's bytes / 2 (the routed experts' ``h`` in the expert term; the step's compute
time less ``2·P_q·h·(1 − bytes/2)/(F·mfu_max)``, P_q the quantized matmul parameters per GPU,
which leaves the same IEEE operations, less 0.0, to every other instance). The 16-bit weights of a
partly quantized checkpoint (a "linear" one's lm_head, an "mlp" one's attention projections) and
the attention keep ``h``. The ramp makes a step's compute time ``FLOPs/(F·mfu_max) +
2·P·h/(F·mfu_max) + A·pairs·h/(F·mfu_max·n)``: a floor proportional to the weights, the cost of
streaming them through the tensor cores while too few rows fill them. W8A8 dtypes halve it
through their doubled peak; a weight-only kernel (vLLM's Marlin: 4-bit or 8-bit weights
dequantized to 16 bits inside the GEMM) streams fewer bytes per weight at the 16-bit peak, so
without the scaling a small-batch int4 decode step would come out compute-bound at the floor
instead of reading its quarter-size weights. With it the int4 layers
of a step of up to ~16 tokens run ~3.9x faster than bf16 and those of a 128-token step ~1.5x
(A100 calibration; the bf16 embedding and lm_head of a "linear" checkpoint do not), the shape
of Marlin's measured speedups (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel
Inference on Large Language Models", PPoPP 2025: close to the ideal 4x up to batch 16-32, falling
towards 1.5-2x at 128).

**Precision.** F is the GPU's dense peak for the weight dtype (``GPUSpec.peak_flops_per_s``:
fp8 -> FP8 peak, W8A8; nvfp4 -> FP4 peak on GPUs that have one, else BF16). When only the MLPs are
quantized (``ModelSpec.quantized_weights == "mlp"``) the other matmuls and the attention run at the
BF16 peak: their FLOPs are scaled by F/F_bf16 into the quantized-peak budget.

**Long-context parallelism** (``InstanceSpec.parallel``: pipeline stages with Medha's stream
pipelining, KV-parallel groups, LoongServe's elastic sequence parallelism): the step, decode and
prefill prices come from :class:`~.parallelism.ParallelCost` (``CostModel.parallel``, None for a
dense instance, whose prices are unchanged); the totals-only methods (:meth:`CostModel.step_time_s`
and its fast variants) then price the batch as one pass through every stage
(:meth:`~.parallelism.ParallelCost.one_pass_s`), the simulator's steps use
:meth:`CostModel.plan_step_time_s` with the batch's decodes and chunks.

All step functions accept scalars or equal-length float64 NumPy arrays and are computed once,
elementwise, with +, −, ×, ÷ and ``np.maximum`` only, so a scalar call is bitwise identical to
the same element of an array call. Scalar inputs return NumPy float64 scalars.
"""

from __future__ import annotations

from .errors import ConfigError, bounded_repr

import math
from typing import Any

import numpy as np

from .allreduce import PiecewiseComm, vllm_allreduce_price
from .hardware import LinkSpec
from .instance_spec import InstanceSpec
from .model_spec import distinct_experts_table
from .parallelism import ParallelCost

ACTIVATION_BYTES = 2.0
"""Bytes per activation element in TP all-reduces (bf16 activations, also with fp8 weights)."""

CUDA_GRAPH_MAX_TOKENS = 512
"""Largest step vLLM V1 runs as a captured CUDA graph: its default capture sizes are 1, 2, 4 and
the multiples of 8 up to 512 (``CompilationConfig.cudagraph_capture_sizes``, vLLM 0.8-0.9; 0.10+
steps by 16 above 256 and stops at 2·max_num_seqs, which changes no expert count below)."""


def cuda_graph_tokens(n_tokens: float) -> float:
    """Tokens a vLLM V1 step of ``n_tokens`` actually runs through the model: padded up to the next
    CUDA-graph capture size (1, 2, 4, then multiples of 8) when ``n_tokens <=``
    :data:`CUDA_GRAPH_MAX_TOKENS`, else unchanged. vLLM ``GPUModelRunner``:
    ``num_input_tokens = vllm_config.pad_for_cudagraph(num_scheduled_tokens)``, run on the
    persistent ``input_ids`` buffer, whose padded slots hold earlier steps' tokens, so they are
    routed to experts like real ones. 0 stays 0."""
    if n_tokens <= 0.0 or n_tokens > CUDA_GRAPH_MAX_TOKENS:
        return n_tokens
    if n_tokens <= 4.0:
        return 1.0 if n_tokens <= 1.0 else (2.0 if n_tokens <= 2.0 else 4.0)
    return math.ceil(n_tokens / 8.0) * 8.0


def _cuda_graph_tokens_array(n: np.ndarray) -> np.ndarray:
    """:func:`cuda_graph_tokens` elementwise (same IEEE operations)."""
    small = np.where(n <= 1.0, 1.0, np.where(n <= 2.0, 2.0, 4.0))
    padded = np.where(n <= 4.0, small, np.ceil(n / 8.0) * 8.0)
    return np.where((n <= 0.0) | (n > CUDA_GRAPH_MAX_TOKENS), n, padded)


def _all_nonneg(a: np.ndarray) -> bool:
    """True if every element is >= 0 (NaN is not); cheap for 0-d arrays (the per-step hot path)."""
    return bool(a >= 0) if a.ndim == 0 else bool((a >= 0).all())


def _nonneg(name: str, value: Any) -> np.ndarray:
    a = np.asarray(value, dtype=np.float64)
    if not _all_nonneg(a):
        raise ValueError(f"{name} must be >= 0 (and not NaN), got {bounded_repr(value)}")
    return a


class CostModel:
    """Step and transfer times of one :class:`InstanceSpec` (REFERENCE §5.3, numbers of §5.2).

    Per-GPU coefficients (read-only attributes, computed once):

    - ``matmul_params_per_gpu`` P_m = model.matmul_params / tp (lm_head included, input embedding
      excluded). KV-projection weights replicated when tp > n_kv_heads are not counted twice.
      Mixture of experts: the matmul parameters less all routed experts (P_d of the module docstring).
    - ``weight_bytes_per_gpu`` W = spec.weight_bytes_per_gpu (read once per step; embeddings included,
      as in the §5.3 worked example). Mixture of experts: less all routed experts (W_d); a step adds
      the experts it activates.
    - ``kv_bytes_per_token_per_gpu`` kvt = spec.kv_bytes_per_block_per_gpu / block_size_tokens.
    - ``attn_flops_per_pair_per_gpu`` A = model.attn_flops_per_pair / tp.
    - ``peak_flops_per_s`` F = gpu.fp8_flops_per_s for fp8 weights, else gpu.bf16_flops_per_s.
    - ``hbm_bytes_per_s`` B = gpu.hbm_bytes_per_s.
    """

    def __init__(self, spec: InstanceSpec) -> None:
        m, g, c, tp = spec.model, spec.gpu, spec.cost_params, spec.tp
        self.spec = spec
        self.matmul_params_per_gpu = m.matmul_params / tp
        self.weight_bytes_per_gpu = spec.weight_bytes_per_gpu
        self.kv_bytes_per_token_per_gpu = spec.kv_bytes_per_block_per_gpu / spec.block_size_tokens
        self.attn_flops_per_pair_per_gpu = m.attn_flops_per_pair / tp
        self.peak_flops_per_s = g.peak_flops_per_s(spec.effective_weight_dtype)
        self.hbm_bytes_per_s = g.hbm_bytes_per_s

        self._lin_flops_per_token = 2.0 * self.matmul_params_per_gpu
        self._mfu_half = float(c.mfu_half_tokens)
        #: the half-point of the routed experts' ramp (h, or h·bytes/2 for weight-only quantization)
        self._expert_half = self._mfu_half
        #: seconds per step taken off the ramp floor of weight-only quantized weights (0.0 otherwise)
        self._ramp_discount = 0.0
        #: matmul parameters per GPU whose weights are quantized (the routed experts excluded)
        self._quantized_matmul_per_gpu = self.matmul_params_per_gpu
        self._eff_flops = self.peak_flops_per_s * c.mfu_max
        self._eff_bw = self.hbm_bytes_per_s * c.mbu
        self._overhead = float(c.step_overhead_s)
        self._seq_overhead = float(c.seq_overhead_s)
        self._tok_overhead = float(c.step_token_overhead_s)
        self._moe = m.is_moe
        if m.is_moe or m.quantized_weights != "all":
            self._init_moe_and_mixed_precision(spec)
        w_bytes = float(spec.weight_dtype_bytes)
        if w_bytes < 2.0 and self.peak_flops_per_s == g.bf16_flops_per_s:
            # weight-only quantization (int4; fp8/nvfp4 where the GPU has no tensor cores for them):
            # the ramp's floor of a quantized weight, 2·h/(F·mfu_max) per parameter and step, is a
            # cost per weight streamed through the 16-bit tensor cores, so it scales with the bytes
            # each weight takes; 16-bit weights and the attention keep h (module docstring)
            h_q = self._mfu_half * w_bytes / 2.0
            self._expert_half = h_q
            self._ramp_discount = 2.0 * self._quantized_matmul_per_gpu * (self._mfu_half - h_q) / self._eff_flops
        self._pnm = spec.pnm is not None
        if spec.pnm is not None:
            pnm = spec.pnm
            self._pnm_kv_per_s = pnm.n_devices * pnm.mem_bytes_per_s * pnm.mbu
            self._pnm_flops_per_s = pnm.n_devices * pnm.attn_flops_per_s
            self._pnm_kv_bytes_per_token = spec.kv_bytes_per_token  # whole model: all TP ranks' KV
            self._pnm_attn_flops_per_pair = m.attn_flops_per_pair
            self._pnm_rpc_s = 2.0 * pnm.rpc_latency_s
            # q, k, v and attention output per token per layer, bf16, this rank's heads
            self._pnm_act_s_per_token = (4.0 * m.n_layers * m.n_heads * m.head_dim * ACTIVATION_BYTES / tp
                                         / pnm.link.bytes_per_s)
        #: all-reduce price under ``allreduce_algorithm = "vllm"`` (added to the affine comm term);
        #: None under "ring", whose all-reduces are in ``_comm_per_token`` and ``_comm_fixed``
        self._allreduce: PiecewiseComm | None = None
        if tp > 1 and spec.expert_parallel:
            self._init_expert_parallel_comm(spec)
        elif tp > 1 and c.allreduce_algorithm == "vllm":
            self._comm_per_token = 0.0
            self._comm_fixed = 0.0
            link = g.nvlink_bytes_per_s * c.allreduce_bw_efficiency
            self._allreduce = vllm_allreduce_price(tp, 2.0 * m.n_layers, m.hidden_size * ACTIVATION_BYTES, link,
                                                   c.allreduce_latency_s, c.allreduce_hop_latency_s)
        elif tp > 1:
            ring = 2.0 * (tp - 1) / tp  # ring all-reduce moves 2(T-1)/T of the payload per rank
            self._comm_per_token = (2.0 * m.n_layers * ring * m.hidden_size * ACTIVATION_BYTES
                                    / (g.nvlink_bytes_per_s * c.allreduce_bw_efficiency))
            self._comm_fixed = 2.0 * m.n_layers * (c.allreduce_latency_s
                                                   + 2.0 * (tp - 1) * c.allreduce_hop_latency_s)
        else:
            self._comm_per_token = 0.0
            self._comm_fixed = 0.0
        self._check_finite(spec)
        #: prices of a long-context parallel layout (``spec.parallel``), None for one TP group
        self.parallel: ParallelCost | None = None if spec.parallel is None else ParallelCost(self)

    def _check_finite(self, spec: InstanceSpec) -> None:
        """Every per-GPU coefficient is a finite number and every rate is > 0.

        Each :class:`CostParams` field and spec size is finite on its own, but their products and
        quotients can overflow (``moe_efficiency = 1e-300`` divides the expert bytes into inf, and
        inf·0 then makes an idle step NaN) or underflow (a rate of 0): the step times would be
        inf or NaN and the simulation clock with them.

        Raises:
            ConfigError: naming the first non-finite coefficient and the fields it comes from.
        """
        checks: list[tuple[str, float, bool, str]] = [
            ("linear FLOPs per token", self._lin_flops_per_token, False, "model sizes"),
            ("attention FLOPs per pair", self.attn_flops_per_pair_per_gpu, False, "model sizes"),
            ("weight bytes per GPU", self.weight_bytes_per_gpu, False, "n_params, weight_dtype"),
            ("KV bytes per token", self.kv_bytes_per_token_per_gpu, False, "model sizes, kv_dtype"),
            ("effective FLOP/s", self._eff_flops, True, "cost.mfu_max x the GPU's peak"),
            ("effective HBM bytes/s", self._eff_bw, True, "cost.mbu x the GPU's HBM bandwidth"),
            ("all-reduce time per token", self._comm_per_token, False,
             "cost.allreduce_bw_efficiency, the GPU's NVLink rate"),
            ("all-reduce time per step", self._comm_fixed, False, "cost.allreduce_*latency_s"),
            ("all-reduce coefficient (vllm algorithm)",
             0.0 if self._allreduce is None else self._allreduce.largest_coefficient, False,
             "cost.allreduce_bw_efficiency, cost.allreduce_*latency_s, the GPU's NVLink rate"),
            ("step overhead", self._overhead + self._seq_overhead + self._tok_overhead, False,
             "cost.step_overhead_s, seq_overhead_s, step_token_overhead_s"),
        ]
        if self._moe:
            checks += [
                ("expert FLOP/s", self._expert_eff_flops, True, "cost.moe_efficiency x mfu_max x peak"),
                ("expert FLOPs per token", self._expert_flops_coef / self._expert_eff_flops, False,
                 "cost.moe_efficiency, expert sizes"),
                ("expert bytes per distinct expert", self._expert_bytes_per_distinct, False,
                 "cost.moe_efficiency, expert sizes"),
            ]
        for what, value, rate, source in checks:
            v = float(value)
            if not math.isfinite(v) or (rate and v <= 0.0):
                raise ConfigError(
                    f"cost model of {spec.model.name} on {spec.gpu.name} (tp={spec.tp}): {what} = {v:.4g} is not "
                    f"allowed: expected a finite number{' > 0' if rate else ''}; it comes from {source} "
                    "(a value too large or too small for float64)")

    # ------------------------------------------------------------------ mixture of experts

    def _init_moe_and_mixed_precision(self, spec: InstanceSpec) -> None:
        """Per-GPU coefficients of the MoE terms and of MLP-only or Linear-only quantization (module
        docstring)."""
        m, g, c, tp = spec.model, spec.gpu, spec.cost_params, spec.tp
        routed = m.routed_expert_params
        dense_matmul = m.matmul_params - routed
        scale16 = 1.0
        if m.quantized_weights != "all":
            scale16 = self.peak_flops_per_s / g.bf16_flops_per_s  # 1.0 when the model is not quantized
        if m.quantized_weights == "linear":
            quant_dense = dense_matmul - m.lm_head_params  # every decoder Linear layer but the routed experts
        else:
            quant_dense = m.mlp_params - routed  # dense-layer MLPs and shared experts
        self.matmul_params_per_gpu = dense_matmul / tp
        self._quantized_matmul_per_gpu = (dense_matmul if m.quantized_weights == "all" else quant_dense) / tp
        self._lin_flops_per_token = 2.0 * (quant_dense + (dense_matmul - quant_dense) * scale16) / tp
        self.attn_flops_per_pair_per_gpu = m.attn_flops_per_pair * scale16 / tp
        if not m.is_moe:
            return
        eff = float(c.moe_efficiency)
        expert_bytes = m.expert_params * float(spec.weight_dtype_bytes)
        self.weight_bytes_per_gpu = spec.weight_bytes_per_gpu - m.n_moe_layers * m.n_experts * expert_bytes / tp
        self._experts_per_token = float(m.experts_per_token)
        # c_e·(k·n + h·D(n)) / (F·mfu_max·η): expert FLOPs with the per-expert MFU ramp
        self._expert_flops_coef = 2.0 * m.n_moe_layers * m.expert_params / tp
        self._expert_eff_flops = self._eff_flops * eff
        # w_e·D(n)/η: weight bytes of the distinct experts a step activates
        self._expert_bytes_per_distinct = m.n_moe_layers * expert_bytes / tp / eff
        table = distinct_experts_table(m.n_experts, m.experts_per_token, float(m.routing_skew))
        self._distinct = table
        self._distinct_list = [float(x) for x in table]
        self._distinct_step = [float(x) for x in np.diff(table)] + [0.0]
        self._distinct_step_arr = np.asarray(self._distinct_step)
        self._distinct_last = len(table) - 1

    def _init_expert_parallel_comm(self, spec: InstanceSpec) -> None:
        """TP all-reduces after attention (every layer) and after dense MLPs; all-to-all dispatch +
        combine on the MoE layers (module docstring)."""
        m, g, c, tp = spec.model, spec.gpu, spec.cost_params, spec.tp
        link = g.nvlink_bytes_per_s * c.allreduce_bw_efficiency
        ring = 2.0 * (tp - 1) / tp
        n_allreduce = 2 * m.n_layers - m.n_moe_layers
        a2a = 2.0 * m.experts_per_token * (tp - 1) / (tp * tp)  # dispatch + combine, per token
        hop = c.allreduce_hop_latency_s
        if c.allreduce_algorithm == "vllm":  # the all-reduces as vLLM picks them; the all-to-alls as below
            self._allreduce = vllm_allreduce_price(tp, float(n_allreduce), m.hidden_size * ACTIVATION_BYTES, link,
                                                   c.allreduce_latency_s, hop)
            self._comm_per_token = m.n_moe_layers * a2a * m.hidden_size * ACTIVATION_BYTES / link
            self._comm_fixed = 2 * m.n_moe_layers * (c.allreduce_latency_s + (tp - 1) * hop)
            return
        self._comm_per_token = ((n_allreduce * ring + m.n_moe_layers * a2a) * m.hidden_size * ACTIVATION_BYTES
                                / link)
        # a ring all-reduce takes 2(tp-1) hops, a pairwise all-to-all tp-1 (CostParams.allreduce_hop_latency_s)
        self._comm_fixed = (n_allreduce * (c.allreduce_latency_s + 2.0 * (tp - 1) * hop)
                            + 2 * m.n_moe_layers * (c.allreduce_latency_s + (tp - 1) * hop))

    def distinct_experts(self, n_tokens: float) -> float:
        """D(n) of the model for a step of ``n_tokens`` tokens (0.0 for dense models): the table of
        ``ModelSpec.expected_distinct_experts``, linear between integers (a fractional token
        count interpolates), its last entry beyond it. Python float arithmetic; bitwise equal to
        :meth:`_distinct_array`."""
        if not self._moe:
            return 0.0
        i = math.floor(n_tokens)
        if i >= self._distinct_last:
            return self._distinct_list[self._distinct_last]
        return self._distinct_list[i] + (n_tokens - i) * self._distinct_step[i]

    def _distinct_array(self, n: np.ndarray) -> np.ndarray:
        """:meth:`distinct_experts` elementwise over a float64 array (same IEEE operations)."""
        fl = np.floor(n)
        big = fl >= self._distinct_last
        i = np.where(big, 0.0, fl).astype(np.int64)
        step = self._distinct_step_arr[i]
        d = self._distinct[i] + (n - i) * step
        return np.where(big, self._distinct[self._distinct_last], d)

    def _moe_extra(self, n: float) -> tuple[float, float]:
        """(extra compute s, extra HBM bytes) of the routed experts for a step of ``n`` tokens, run
        as ``g = cuda_graph_tokens(n)`` tokens (the padded ones are routed too)."""
        g = cuda_graph_tokens(n)
        d = self.distinct_experts(g)
        work = self._experts_per_token * g + self._expert_half * d
        return (self._expert_flops_coef * work / self._expert_eff_flops,
                self._expert_bytes_per_distinct * d)

    def _moe_extra_array(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_moe_extra` elementwise (same IEEE operations)."""
        g = _cuda_graph_tokens_array(n)
        d = self._distinct_array(g)
        work = self._experts_per_token * g + self._expert_half * d
        return (self._expert_flops_coef * work / self._expert_eff_flops,
                self._expert_bytes_per_distinct * d)

    # ------------------------------------------------------------------ step time

    @staticmethod
    def _inputs(n_tokens: Any, attn_pairs: Any, kv_tokens: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = np.asarray(n_tokens, dtype=np.float64)
        pairs = np.asarray(attn_pairs, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        if not (_all_nonneg(n) and _all_nonneg(pairs) and _all_nonneg(kv)):
            for name, raw in (("n_tokens", n_tokens), ("attn_pairs", attn_pairs), ("kv_tokens", kv_tokens)):
                _nonneg(name, raw)  # raises naming the offending argument
        return n, pairs, kv

    def _step(self, n: np.ndarray, pairs: np.ndarray, kv: np.ndarray, seqs: Any = 1.0) -> dict[str, np.ndarray]:
        """Unmasked step parts (garbage where n == 0; callers mask with n > 0)."""
        n_safe = np.where(n > 0, n, 1.0)
        flops = self._lin_flops_per_token * n + self.attn_flops_per_pair_per_gpu * pairs
        # FLOPs / (F · mfu_max · n/(n + half)), written without a nested division
        compute = flops * (n + self._mfu_half) / (self._eff_flops * n_safe) - self._ramp_discount
        hbm_bytes = self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv
        if self._moe:
            x_compute, x_bytes = self._moe_extra_array(n)
            compute = compute + x_compute
            hbm_bytes = hbm_bytes + x_bytes
        memory = hbm_bytes / self._eff_bw
        comm = self._comm_per_token * n + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.over(n)
        host = self._seq_overhead * seqs + self._tok_overhead * n
        step = np.maximum(compute, memory) + self._overhead + comm + host
        return {"flops": flops, "hbm_bytes": hbm_bytes, "compute_s": compute, "memory_s": memory,
                "comm_s": comm, "host_s": host + 0.0 * n, "step_s": step}

    def step_time_s(self, n_tokens: Any, attn_pairs: Any, kv_tokens: Any, n_seqs: Any = 1.0) -> Any:
        """Seconds of one scheduler step (forward pass) per REFERENCE §5.3.

        Args:
            n_tokens: tokens computed in the step, Σ prefill-chunk tokens + number of decodes.
            attn_pairs: Σ_j c_j·(p_j + c_j/2) + Σ_k ctx_k (query × context pairs).
            kv_tokens: Σ_j (p_j + c_j) + Σ_k ctx_k (tokens whose KV is read or written).
            n_seqs: sequences scheduled in the step (decodes + prefill chunks) for the
                per-sequence host term; default 1 (a lone prefill chunk).
            Each is a scalar or a float64 array; arrays must broadcast (equal lengths).

        Returns:
            Seconds, same shape as the inputs (float64 scalar for scalars). 0.0 where
            ``n_tokens == 0`` (an idle step costs nothing).

        Note: with ``mfu_half_tokens > 0`` the MFU ramp applies to all FLOPs, so raising
        ``n_tokens`` while *holding* ``attn_pairs`` fixed can shorten the compute term. When pairs
        grow with the tokens (a batch of like requests: b decodes of context c give b·c pairs) the
        time is monotone; it is always monotone in ``attn_pairs`` and ``kv_tokens``, and in all
        three with ``mfu_half_tokens = 0``.

        Raises:
            ValueError: a negative or NaN input.
        """
        n, pairs, kv = self._inputs(n_tokens, attn_pairs, kv_tokens)
        seqs = _nonneg("n_seqs", n_seqs)
        if self.parallel is not None:
            return self.parallel.one_pass_s(n, pairs, kv)
        return np.where(n > 0, self._step(n, pairs, kv, seqs)["step_s"], 0.0)[()]

    def step_time_fast(self, n_tokens: float, attn_pairs: float, kv_tokens: float, n_seqs: float = 1.0) -> float:
        """:meth:`step_time_s` for one step, on Python floats, without input checks.

        The simulator's per-step hot path. Same IEEE operations in the same order as the array
        path, so the result is bitwise equal to ``step_time_s`` (a test checks it). Callers
        guarantee non-negative inputs.
        """
        if n_tokens <= 0.0:
            return 0.0
        if self.parallel is not None:
            return float(self.parallel.one_pass_s(n_tokens, attn_pairs, kv_tokens))
        flops = self._lin_flops_per_token * n_tokens + self.attn_flops_per_pair_per_gpu * attn_pairs
        compute = flops * (n_tokens + self._mfu_half) / (self._eff_flops * n_tokens) - self._ramp_discount
        if self._moe:
            x_compute, x_bytes = self._moe_extra(n_tokens)
            compute = compute + x_compute
            hbm = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) + x_bytes
            memory = hbm / self._eff_bw
        else:
            memory = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) / self._eff_bw
        comm = self._comm_per_token * n_tokens + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.at(n_tokens)
        return ((compute if compute >= memory else memory) + self._overhead + comm
                + (self._seq_overhead * n_seqs + self._tok_overhead * n_tokens))

    def plan_step_time_s(self, n_decodes: int, decode_ctx_tokens: int,
                         chunks: list[tuple[int, int, bool]]) -> float:
        """Seconds of one step from its parts: ``n_decodes`` decodes reading ``decode_ctx_tokens``
        context tokens in all and prefill ``chunks`` as ``(tokens, cached tokens before, completes
        the prompt)`` in plan order. With ``spec.parallel`` the pipeline, SPP, KVP or ESP price
        (:meth:`~.parallelism.ParallelCost.step_s`); otherwise :meth:`step_time_fast` of the totals,
        with one sequence per decode and per chunk for the per-sequence host term.
        """
        if self.parallel is not None:
            return self.parallel.step_s(n_decodes, decode_ctx_tokens, chunks)
        n = n_decodes
        attn2 = 2 * decode_ctx_tokens
        kv = decode_ctx_tokens
        for c, p, _ in chunks:
            n += c
            attn2 += c * (2 * p + c)
            kv += p + c
        return self.step_time_fast(float(n), attn2 / 2.0, float(kv), float(n_decodes + len(chunks)))

    def pnm_step_time_fast(self, n_tokens: float, attn_pairs: float, kv_tokens: float,
                           pnm_kv_tokens: float, n_pnm: float, n_seqs: float = 1.0) -> float:
        """One step with PNM-resident decodes (module docstring formula), Python floats, unchecked.

        Args:
            n_tokens, attn_pairs, kv_tokens: as :meth:`step_time_s`, with the PNM-resident
                decodes counted in ``n_tokens`` only.
            pnm_kv_tokens: Σ context tokens of the PNM-resident decodes (their KV read near memory).
            n_pnm: number of PNM-resident decodes in the step.

        Returns seconds, bitwise equal to the same element of :meth:`pnm_step_times_fast`.
        Source: REFERENCE §3.2 hybrid execution; requires ``spec.pnm``.
        """
        flops = self._lin_flops_per_token * n_tokens + self.attn_flops_per_pair_per_gpu * attn_pairs
        compute = flops * (n_tokens + self._mfu_half) / (self._eff_flops * n_tokens) - self._ramp_discount
        if self._moe:
            x_compute, x_bytes = self._moe_extra(n_tokens)
            compute = compute + x_compute
            hbm = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) + x_bytes
            memory = hbm / self._eff_bw
        else:
            memory = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) / self._eff_bw
        gpu = compute if compute >= memory else memory
        pnm_mem = self._pnm_kv_bytes_per_token * pnm_kv_tokens / self._pnm_kv_per_s
        pnm_cmp = self._pnm_attn_flops_per_pair * pnm_kv_tokens / self._pnm_flops_per_s
        pnm = pnm_cmp if pnm_cmp >= pnm_mem else pnm_mem
        core = gpu if gpu >= pnm else pnm
        comm = self._comm_per_token * n_tokens + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.at(n_tokens)
        return (core + self._overhead + comm
                + (self._seq_overhead * n_seqs + self._tok_overhead * n_tokens)
                + (self._pnm_rpc_s + self._pnm_act_s_per_token * n_pnm))

    def pnm_step_times_fast(self, n_tokens: np.ndarray, attn_pairs: np.ndarray, kv_tokens: np.ndarray,
                            pnm_kv_tokens: np.ndarray, n_pnm: np.ndarray, n_seqs: Any = 1.0) -> np.ndarray:
        """:meth:`pnm_step_time_fast` over float64 arrays (``n_tokens > 0``), same operations in order."""
        flops = self._lin_flops_per_token * n_tokens + self.attn_flops_per_pair_per_gpu * attn_pairs
        compute = flops * (n_tokens + self._mfu_half) / (self._eff_flops * n_tokens) - self._ramp_discount
        if self._moe:
            x_compute, x_bytes = self._moe_extra_array(n_tokens)
            compute = compute + x_compute
            hbm = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) + x_bytes
            memory = hbm / self._eff_bw
        else:
            memory = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * kv_tokens) / self._eff_bw
        gpu = np.maximum(compute, memory)
        pnm_mem = self._pnm_kv_bytes_per_token * pnm_kv_tokens / self._pnm_kv_per_s
        pnm_cmp = self._pnm_attn_flops_per_pair * pnm_kv_tokens / self._pnm_flops_per_s
        core = np.maximum(gpu, np.maximum(pnm_cmp, pnm_mem))
        comm = self._comm_per_token * n_tokens + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.over(n_tokens)
        return (core + self._overhead + comm
                + (self._seq_overhead * n_seqs + self._tok_overhead * n_tokens)
                + (self._pnm_rpc_s + self._pnm_act_s_per_token * n_pnm))

    def pnm_attention_time_s(self, pnm_kv_tokens: Any) -> Any:
        """Seconds the PNM devices spend on decode attention over ``pnm_kv_tokens`` context tokens.

        ``max(kvt_all·ctx/(n_dev·BW·MBU), A_all·ctx/(n_dev·F))`` (REFERENCE §3.2); vectorised.

        Raises:
            ValueError: no PNM tier in the spec, or a negative input.
        """
        if not self._pnm:
            raise ValueError("the instance spec has no PNM tier (InstanceSpec.pnm is None)")
        ctx = _nonneg("pnm_kv_tokens", pnm_kv_tokens)
        return np.maximum(self._pnm_kv_bytes_per_token * ctx / self._pnm_kv_per_s,
                          self._pnm_attn_flops_per_pair * ctx / self._pnm_flops_per_s)[()]

    def step_times_fast(self, n_tokens: np.ndarray, attn_pairs: np.ndarray, kv_tokens: np.ndarray,
                        n_seqs: Any = 1.0) -> np.ndarray:
        """:meth:`step_time_s` over float64 arrays with ``n_tokens > 0``, without input checks."""
        if self.parallel is not None:
            return self.parallel.one_pass_s(n_tokens, attn_pairs, kv_tokens)
        return self._step(n_tokens, attn_pairs, kv_tokens, n_seqs)["step_s"]

    def decode_step_ends(self, start_s: float, n_decodes: int, ctx0_tokens: int, max_steps: int,
                         horizon_s: float = math.inf) -> list[float]:
        """End times (s) of up to ``max_steps`` consecutive decode-only steps, one Python loop.

        Step ``j`` (0-based) decodes ``n_decodes`` requests reading ``ctx0_tokens + j *
        n_decodes`` KV tokens in all; the steps run back to back from ``start_s``, and the loop
        stops after the first step that ends at or after ``horizon_s``. Each end is the
        previous one plus :meth:`step_time_fast` ``(n, ctx, ctx, n)``, with that method's IEEE
        operations in the same order (the per-call constants hoisted), so the ends are bitwise
        equal to adding its results one by one (a test checks it). ``n_decodes >= 1``.
        """
        if self.parallel is not None:  # the parallel decode price, added one step at a time
            ends_p: list[float] = []
            e_p = start_s
            ctx_p = ctx0_tokens
            for _ in range(max_steps):
                e_p += float(self.parallel.decode_step_s(float(n_decodes), float(ctx_p)))
                ends_p.append(e_p)
                if e_p >= horizon_s:
                    break
                ctx_p += n_decodes
            return ends_p
        n = float(n_decodes)
        lin = self._lin_flops_per_token * n
        attn = self.attn_flops_per_pair_per_gpu
        ramp = n + self._mfu_half
        peak = self._eff_flops * n
        discount = self._ramp_discount
        weights = self.weight_bytes_per_gpu
        kv_bytes = self.kv_bytes_per_token_per_gpu
        bw = self._eff_bw
        overhead = self._overhead
        comm = self._comm_per_token * n + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.at(n)
        host = self._seq_overhead * n + self._tok_overhead * n
        ends: list[float] = []
        e = start_s
        ctx = ctx0_tokens
        if self._moe:
            x_compute, x_bytes = self._moe_extra(n)
            for _ in range(max_steps):
                c = float(ctx)
                compute = (lin + attn * c) * ramp / peak - discount + x_compute
                memory = ((weights + kv_bytes * c) + x_bytes) / bw
                e += (compute if compute >= memory else memory) + overhead + comm + host
                ends.append(e)
                if e >= horizon_s:
                    break
                ctx += n_decodes
            return ends
        for _ in range(max_steps):
            c = float(ctx)
            compute = (lin + attn * c) * ramp / peak - discount
            memory = (weights + kv_bytes * c) / bw
            e += (compute if compute >= memory else memory) + overhead + comm + host
            ends.append(e)
            if e >= horizon_s:
                break
            ctx += n_decodes
        return ends

    def decode_step_times_fast(self, n_decodes: float, ctx_tokens: np.ndarray) -> np.ndarray:
        """Step times of decode-only steps of ``n_decodes`` requests reading ``ctx_tokens`` KV
        tokens in all (shape ``(K,)``, float64, one per step), without input checks.

        A decode-only step has ``n_tokens = n_decodes`` and ``attn_pairs = kv_tokens = ctx``
        (REFERENCE §5.3). Same IEEE operations in the same order as :meth:`step_times_fast` and
        :meth:`step_time_fast` with those inputs, so bitwise equal to them (a test checks it);
        only the per-step arrays of the breakdown are not built. ``n_decodes > 0``.
        """
        if self.parallel is not None:
            return self.parallel.decode_step_s(float(n_decodes), ctx_tokens)
        n = float(n_decodes)
        flops = self._lin_flops_per_token * n + self.attn_flops_per_pair_per_gpu * ctx_tokens
        compute = flops * (n + self._mfu_half) / (self._eff_flops * n) - self._ramp_discount
        if self._moe:
            x_compute, x_bytes = self._moe_extra(n)
            compute = compute + x_compute
            hbm_ctx = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * ctx_tokens) + x_bytes
            memory = hbm_ctx / self._eff_bw
        else:
            memory = (self.weight_bytes_per_gpu + self.kv_bytes_per_token_per_gpu * ctx_tokens) / self._eff_bw
        comm = self._comm_per_token * n + self._comm_fixed
        if self._allreduce is not None:
            comm = comm + self._allreduce.at(n)
        return (np.maximum(compute, memory) + self._overhead + comm
                + (self._seq_overhead * n + self._tok_overhead * n))

    def step_breakdown(self, n_tokens: Any, attn_pairs: Any, kv_tokens: Any, n_seqs: Any = 1.0) -> dict[str, Any]:
        """The parts of :meth:`step_time_s` (same arguments).

        Returns:
            dict with ``compute_s`` (FLOPs/(F·MFU)), ``memory_s`` (Bytes/(B·mbu)), ``comm_s``,
            ``overhead_s``, ``host_s`` (the per-sequence and per-token host terms), ``step_s``
            (seconds), ``flops`` and ``hbm_bytes`` per GPU, ``bound``
            ("compute" if compute_s >= memory_s else "memory"; "idle" when n_tokens == 0) and
            ``idle_hbm_bytes`` = step_s·B − hbm_bytes: HBM bandwidth the step leaves unused, which a
            prefetch could fill (REFERENCE §9.1). Scalars for scalar input, arrays otherwise.
        """
        n, pairs, kv = self._inputs(n_tokens, attn_pairs, kv_tokens)
        active = n > 0
        parts = self._step(n, pairs, kv, _nonneg("n_seqs", n_seqs))
        c = {k: np.where(active, v, 0.0) for k, v in parts.items()}
        c["overhead_s"] = np.where(active, self._overhead, 0.0)
        bound = np.where(active, np.where(c["compute_s"] >= c["memory_s"], "compute", "memory"), "idle")
        idle = c["step_s"] * self.hbm_bytes_per_s - c["hbm_bytes"]
        out: dict[str, Any] = {k: c[k][()] for k in ("compute_s", "memory_s", "comm_s", "overhead_s", "host_s",
                                                     "step_s", "flops", "hbm_bytes")}
        out["bound"] = str(bound[()]) if bound.ndim == 0 else bound
        out["idle_hbm_bytes"] = idle[()]
        return out

    def prefill_pass_time_s(self, prompt_tokens: Any, done_tokens: Any) -> Any:
        """Predicted seconds of the remaining prefill ``prompt − done`` as one pass (vectorised;
        LARS's T_hat before its per-chunk overheads): ``step_time_s(n, n·(p + n/2), p + n)``. With
        ``spec.parallel`` under SPP the pass streams through the stages: one stage's time of the
        whole plus the drain of the last sub-chunk (``token_budget / S`` tokens, REFERENCE §1.4);
        without SPP (or S = 1) :meth:`step_time_s`'s one pass."""
        n = np.maximum(np.asarray(prompt_tokens, dtype=np.float64) - np.asarray(done_tokens, dtype=np.float64), 0.0)
        p = np.asarray(done_tokens, dtype=np.float64)
        par = self.parallel
        if par is None or not par.spp:
            return self.step_time_s(n, n * (p + n / 2.0), p + n)
        G = float(par.G)
        safe = np.where(n > 0, n, 1.0)
        last = np.maximum(np.minimum(safe, float(self.spec.token_budget)) / par.S, 1.0)  # the last sub-chunk
        p_last = p + safe - last
        t = (par.stage_time(safe, safe * (p + safe / 2.0) / G, (p + safe) / G)
             + (par.S - 1) * (par.stage_time(last, last * (p_last + last / 2.0) / G, (p_last + last) / G)
                              + par.p2p_s(last))
             + par.overhead + par.combine_s(safe))
        return np.where(n > 0, t, 0.0)[()]

    def chunk_time_s(self, chunk_tokens: Any, cached_tokens: Any) -> Any:
        """Seconds of a step running one prefill chunk alone (vectorised).

        ``step_time_s(c, c·(p + c/2), p + c)`` for ``c = chunk_tokens`` new tokens after
        ``p = cached_tokens`` tokens already in the cache (REFERENCE §5.3).
        """
        c = _nonneg("chunk_tokens", chunk_tokens)
        p = _nonneg("cached_tokens", cached_tokens)
        return self.step_time_s(c, c * (p + c / 2.0), p + c)

    def prefill_time_s(self, prompt_tokens: Any, cached_tokens: Any = 0, chunk_tokens: int | None = None) -> Any:
        """Predicted seconds of a lone prefill of ``prompt_tokens`` done in chunks (T̂_prefill, §1.2).

        The uncached tokens ``prompt_tokens − cached_tokens`` run in chunks of ``chunk_tokens``
        (default: ``spec.token_budget``, capped by ``spec.long_prefill_token_threshold`` when that
        is > 0); the last chunk takes the remainder. The result is the sum of
        :meth:`chunk_time_s` over the chunks, in chunk order. Zero uncached tokens cost 0.0 (vLLM
        recomputes the last prompt token on a full prefix hit: pass ``cached_tokens = prompt − 1``).

        Args:
            prompt_tokens: prompt length(s), scalar or 1-D array.
            cached_tokens: tokens already in the KV cache (prefix hit or progress), scalar or array.
            chunk_tokens: chunk size, >= 1.

        Returns:
            Seconds; float64 scalar for scalar inputs, else an array of the broadcast shape.

        Raises:
            ValueError: negative inputs, cached_tokens > prompt_tokens, or chunk_tokens < 1.
        """
        if chunk_tokens is None:
            chunk_tokens = self.spec.token_budget
            if self.spec.long_prefill_token_threshold > 0:
                chunk_tokens = min(chunk_tokens, self.spec.long_prefill_token_threshold)
        if not chunk_tokens >= 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {bounded_repr(chunk_tokens)}")
        prompt, cached = np.broadcast_arrays(_nonneg("prompt_tokens", prompt_tokens),
                                             _nonneg("cached_tokens", cached_tokens))
        if np.any(cached > prompt):
            raise ValueError("cached_tokens must be <= prompt_tokens")
        if self.parallel is not None:  # step by step as the simulator prices a lone prefill (SPP)
            par = self.parallel
            out = np.array([par.prefill_s(int(a), int(b), int(chunk_tokens))
                            for a, b in zip(prompt.ravel(), cached.ravel())], dtype=np.float64)
            return out.reshape(prompt.shape)[()]
        shape = prompt.shape
        prompt, cached = prompt.ravel(), cached.ravel()
        chunk = float(chunk_tokens)
        n_chunks = np.ceil((prompt - cached) / chunk).astype(np.int64)
        owner = np.repeat(np.arange(prompt.size), n_chunks)
        first = np.cumsum(n_chunks) - n_chunks  # index of each request's first chunk
        k = np.arange(owner.size) - first[owner]  # chunk number within its request
        starts = cached[owner] + k * chunk
        sizes = np.minimum(chunk, prompt[owner] - starts)
        times = self.chunk_time_s(sizes, starts)
        # bincount adds in index order, so a scalar and an array call agree bitwise
        total = np.bincount(owner, weights=np.atleast_1d(times), minlength=prompt.size)
        return total.reshape(shape)[()]

    def decode_step_time_s(self, batch: Any, total_context_tokens: Any) -> Any:
        """Seconds of a pure-decode step of ``batch`` requests holding ``total_context_tokens`` in cache.

        ``step_time_s(batch, ctx, ctx, batch)`` (REFERENCE §5.3, "Pure decode step"); with
        ``spec.parallel`` the parallel decode price (:meth:`~.parallelism.ParallelCost.decode_step_s`).
        """
        if self.parallel is not None:
            b = _nonneg("batch", batch)
            ctx = _nonneg("total_context_tokens", total_context_tokens)
            return np.where(b > 0, self.parallel.decode_step_s(np.where(b > 0, b, 1.0), ctx), 0.0)[()]
        return self.step_time_s(batch, total_context_tokens, total_context_tokens, batch)

    # ------------------------------------------------------------------ transfers

    def transfer_time_s(self, n_blocks: Any, link: LinkSpec) -> Any:
        """Seconds to move ``n_blocks`` KV blocks over ``link`` (REFERENCE §5.2, §5.4).

        Every TP rank moves its own share (``kv_bytes_per_block_per_gpu`` per block) over its own
        link in parallel, so the time is ``link.latency_s + n_blocks·kv_bytes_per_block_per_gpu /
        link.bytes_per_s``; 0.0 where ``n_blocks == 0``. Scalar or array ``n_blocks``.

        Raises:
            ValueError: a negative or NaN block count.
        """
        blocks = _nonneg("n_blocks", n_blocks)
        return link.transfer_time_s(blocks * self.spec.kv_bytes_per_block_per_gpu)

    def transfer_bytes(self, n_blocks: Any) -> Any:
        """Bytes moved for ``n_blocks`` blocks, whole instance (all TP ranks), for accounting."""
        return (_nonneg("n_blocks", n_blocks) * self.spec.kv_bytes_per_block)[()]
