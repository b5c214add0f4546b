"""Packing and prefetch: FCFS with tier-aware preemption and KV prefetch on.

Source: "Architecting Long-Context LLM Acceleration with Packing-Prefetch Scheduler and
Ultra-Large Capacity On-Chip Memories" (arXiv 2508.08457; REFERENCE.md §9.1; the mapping onto a
tiered-KV serving engine is **[inferred]**). *Packing* puts prefill chunks and decodes into the
same step (vLLM's chunked prefill, which every instance does by default). *Prefetch* copies the
KV of swapped-out requests back into HBM asynchronously on the host-to-device link while steps
compute, instead of reloading on demand (vLLM V0), where the step waits for the copy and every
running request stalls. With a lower tier to prefetch from, preemption swaps or offloads rather
than recomputes, choosing the victim and mode by cost (``tier_aware_preemption``, REFERENCE.md
§5.4). Without a DRAM or NVMe tier in the spec nothing is prefetched, but tier-aware
preemption still picks the victim of least recompute cost per freed block instead of vLLM's
newest request, so the policy differs from FCFS whenever KV runs out (measured on
``tests/invariants/test_preemption_progress.py``'s tiny-HBM workload without DRAM: 26 vs 22 preemptions).

Registered as ``prefetch`` so that ``kvsched compare --policies ...,prefetch`` sets both options
at once; the same behaviour is ``fcfs`` with ``{prefetch: true, tier_aware_preemption: true}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import PolicyParams, register
from .fcfs import FCFS


@dataclass(frozen=True)
class PrefetchParams(PolicyParams):
    """:class:`PolicyParams` with ``prefetch`` and ``tier_aware_preemption`` on by default."""

    tier_aware_preemption: bool = True
    prefetch: bool = True


@register("prefetch")
class PackingPrefetch(FCFS):
    """vLLM FCFS order and packing, KV prefetched behind compute, tier-aware preemption."""

    params_cls = PrefetchParams
