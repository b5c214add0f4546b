"""Time of the tensor-parallel all-reduces of one step: the α-β ring, or vLLM's algorithm choice.

``CostParams.allreduce_algorithm`` selects how :class:`~.cost_model.CostModel` prices the
all-reduce of each layer's activations (``bytes = n_tokens · hidden · 2 B`` per all-reduce):

- ``"ring"`` (default): every all-reduce is a ring (NCCL's large-message algorithm; Thakur,
  Rabenseifner & Gropp, IJHPCA 2005): ``lat + 2(tp−1)·hop + 2(tp−1)/tp · bytes / link``.
- ``"vllm"``: the algorithm vLLM picks for the message (below). ``lat`` and ``hop`` keep their
  meaning of a fixed per-call latency and a latency per sequential communication stage.

vLLM's choice on one NVLink/NVSwitch node (sources: vLLM 0.32 as installed, and the
``vllm-project/vllm`` repository):

1. ``CudaCommunicator.all_reduce`` (``vllm/distributed/device_communicators/cuda_communicator.py``)
   tries, in order: NCCL symmetric memory (``VLLM_USE_NCCL_SYMM_MEM``, default 0: off), QuickReduce
   (ROCm only), FlashInfer (``VLLM_ALLREDUCE_USE_FLASHINFER``, default 1, but only when the
   ``flashinfer`` package is importable: 0.32 feature, not modelled), then vLLM's **custom
   all-reduce** (``CustomAllreduce.should_custom_ar``), then torch symmetric memory
   (``SymmMemCommunicator.should_use_symm_mem``), then NCCL (``PyNcclCommunicator.all_reduce``).
2. ``CustomAllreduce`` (``custom_all_reduce.py``) exists for world sizes 2, 4, 6, 8
   (``_SUPPORTED_WORLD_SIZES``; ``should_custom_ar`` refuses ``world_size > 8``) and takes a
   message when ``inp_size < self.max_size``; ``max_size`` defaults to 8 MiB
   (``CustomAllreduce.__init__(max_size=8192 * 1024)``). With torch symmetric memory on
   (``VLLM_ALLREDUCE_USE_SYMM_MEM``, default 1 in 0.32) it is lowered to
   ``CUSTOM_ALL_REDUCE_MAX_SIZES`` (``all_reduce_utils.py``; Hopper "9.0": 64/32 MiB at TP 2/4,
   i.e. still 8 MiB, but 512/256 KiB at TP 6/8) and larger messages go to torch symmetric memory
   (``SYMM_MEM_ALL_REDUCE_MAX_SIZES``, multimem at TP 4/6/8 on Hopper). That path is **not
   modelled**: this module follows the releases the H100 ground-truth runs used (vLLM V1
   0.8.4-0.11, ``shared/groundtruth/README.md``), custom all-reduce up to 8 MiB then NCCL, which
   0.32 still does at TP 2 and 4.
3. The kernel (``csrc/custom_all_reduce.cuh``, ``CustomAllreduce::allreduce``, ``REDUCE_CASE``):
   ``world_size_ == 2`` -> ``cross_device_reduce_1stage``; with full NVLink
   ``(world_size_ <= 4 && bytes < 512 * 1024) || (world_size_ <= 8 && bytes < 256 * 1024)`` ->
   ``cross_device_reduce_1stage``, else ``cross_device_reduce_2stage``.

   - **one-shot** (``cross_device_reduce_1stage``): every rank reads the whole message from every
     peer and reduces it: ``lat + 1·hop + (tp−1) · bytes / link``.
   - **two-shot** (``cross_device_reduce_2stage``): reduce-scatter then all-gather through the
     peers' buffers, two stages: ``lat + 2·hop + 2(tp−1)/tp · bytes / link``.
4. Above the custom all-reduce (``bytes >= 8 MiB``) or at a TP degree it does not support: NCCL,
   priced as the ring.

**Monotonicity.** With one link efficiency for every kernel, the one-shot price at vLLM's
switch point exceeds the two-shot one (TP4 at 512 KiB: 3 against 1.5 message transfers). vLLM
placed its thresholds where it measured the two kernels to cross, so the gap is an artefact of
the α-β shapes, not a faster large message: each regime's price is floored at the price of the
largest message of the regimes below it (:class:`PiecewiseComm`), which keeps a step's time
non-decreasing in its tokens. The ring above 8 MiB costs more than the two-shot (more hops) and
needs no floor. Every price is a few affine pieces in the step's tokens: O(1) per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ALLREDUCE_ALGORITHMS: tuple[str, ...] = ("ring", "vllm")
"""Allowed values of ``CostParams.allreduce_algorithm``."""

CUSTOM_ALLREDUCE_MAX_BYTES = 8192 * 1024
"""Largest message (exclusive) vLLM's custom all-reduce takes: ``CustomAllreduce.__init__``
``max_size=8192 * 1024`` and ``should_custom_ar``'s ``inp_size < self.max_size``."""

CUSTOM_ALLREDUCE_WORLD_SIZES: tuple[int, ...] = (2, 4, 6, 8)
"""TP degrees vLLM's custom all-reduce runs at (``CustomAllreduce._SUPPORTED_WORLD_SIZES`` less 16,
which ``should_custom_ar`` refuses: ``world_size > 8``)."""


def one_shot_max_bytes(tp: int) -> int:
    """Message size (bytes, exclusive) below which vLLM's custom all-reduce runs its one-shot
    kernel at ``tp`` GPUs with full NVLink (``csrc/custom_all_reduce.cuh``, ``REDUCE_CASE``):
    every size at TP 2, 512 KiB at TP <= 4, 256 KiB at TP <= 8; 0 (never) elsewhere."""
    if tp == 2:
        return CUSTOM_ALLREDUCE_MAX_BYTES
    if tp <= 4:
        return 512 * 1024
    if tp <= 8:
        return 256 * 1024
    return 0


def vllm_allreduce_kernel(tp: int, message_bytes: float) -> str:
    """The all-reduce vLLM runs for a message of ``message_bytes`` bytes at ``tp`` GPUs (module
    docstring): ``"none"`` at tp = 1, ``"one_shot"`` or ``"two_shot"`` (custom all-reduce) or
    ``"ring"`` (NCCL)."""
    if tp <= 1:
        return "none"
    if tp not in CUSTOM_ALLREDUCE_WORLD_SIZES or message_bytes >= CUSTOM_ALLREDUCE_MAX_BYTES:
        return "ring"
    return "one_shot" if message_bytes < one_shot_max_bytes(tp) else "two_shot"


@dataclass(frozen=True)
class PiecewiseComm:
    """Seconds of a step's all-reduces as a function of its tokens ``n``: piece ``i`` applies
    for ``bounds[i-1] <= n < bounds[i]`` (the last piece for every larger ``n``) and costs
    ``max(per_token[i]·n + fixed[i], floor[i])``.

    :meth:`at` (Python floats) and :meth:`over` (float64 arrays) do the same IEEE operations,
    so they agree bitwise.
    """

    bounds: tuple[float, ...]
    per_token: tuple[float, ...]
    fixed: tuple[float, ...]
    floor: tuple[float, ...]

    def at(self, n: float) -> float:
        """Seconds for a step of ``n`` tokens (Python float)."""
        i = 0
        for b in self.bounds:
            if n < b:
                break
            i += 1
        v = self.per_token[i] * n + self.fixed[i]
        f = self.floor[i]
        return v if v >= f else f

    def over(self, n: Any) -> Any:
        """:meth:`at` elementwise over a float64 array or scalar (same operations)."""
        out = np.maximum(self.per_token[-1] * n + self.fixed[-1], self.floor[-1])
        for i in range(len(self.bounds) - 1, -1, -1):
            out = np.where(n < self.bounds[i], np.maximum(self.per_token[i] * n + self.fixed[i], self.floor[i]), out)
        return out

    def scaled(self, k: float) -> "PiecewiseComm":
        """The same pieces with every cost multiplied by ``k`` (a pipeline stage's share of the layers)."""
        return PiecewiseComm(self.bounds, tuple(p * k for p in self.per_token), tuple(c * k for c in self.fixed),
                             tuple(f * k for f in self.floor))

    @property
    def largest_coefficient(self) -> float:
        """The largest per-token or fixed coefficient (for finiteness checks)."""
        return max(self.per_token + self.fixed)


def vllm_allreduce_price(tp: int, n_allreduce: float, bytes_per_token: float, link_bytes_per_s: float,
                         latency_s: float, stage_latency_s: float) -> PiecewiseComm:
    """:class:`PiecewiseComm` of ``n_allreduce`` all-reduces of ``bytes_per_token`` bytes per token
    each over a link of ``link_bytes_per_s`` (achieved rate), as vLLM chooses them (module
    docstring). ``tp >= 2``; ``latency_s`` is the fixed latency of a call, ``stage_latency_s``
    that of one sequential stage (a one-shot kernel has 1, a two-shot 2, a ring 2(tp−1)).

    The pieces, in tokens: one-shot below ``one_shot_max_bytes(tp) / bytes_per_token``, two-shot
    below ``CUSTOM_ALLREDUCE_MAX_BYTES / bytes_per_token``, ring above; TP degrees without
    custom all-reduce are one ring piece."""
    ring_per_token = n_allreduce * (2.0 * (tp - 1) / tp) * bytes_per_token / link_bytes_per_s
    ring_fixed = n_allreduce * (latency_s + 2.0 * (tp - 1) * stage_latency_s)
    if tp not in CUSTOM_ALLREDUCE_WORLD_SIZES:
        return PiecewiseComm((), (ring_per_token,), (ring_fixed,), (0.0,))
    one_per_token = n_allreduce * float(tp - 1) * bytes_per_token / link_bytes_per_s
    one_fixed = n_allreduce * (latency_s + stage_latency_s)
    custom_end = CUSTOM_ALLREDUCE_MAX_BYTES / bytes_per_token
    if tp == 2:  # one-shot up to the custom all-reduce's limit
        ends = [custom_end]
        per_token, fixed = [one_per_token, ring_per_token], [one_fixed, ring_fixed]
    else:
        two_per_token = n_allreduce * (2.0 * (tp - 1) / tp) * bytes_per_token / link_bytes_per_s
        two_fixed = n_allreduce * (latency_s + 2.0 * stage_latency_s)
        ends = [one_shot_max_bytes(tp) / bytes_per_token, custom_end]
        per_token, fixed = [one_per_token, two_per_token, ring_per_token], [one_fixed, two_fixed, ring_fixed]
    floors = [0.0]
    for i, end in enumerate(ends):  # the price of the largest message of the pieces below
        floors.append(max(floors[-1], per_token[i] * end + fixed[i]))
    return PiecewiseComm(tuple(float(e) for e in ends), tuple(per_token), tuple(fixed), tuple(floors))
