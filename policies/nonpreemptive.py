"""Non-preemptive prefill baseline (LoongServe-like in this respect).

A prefill, once started, runs to completion in one step: chunked prefill is off, so a long
prompt occupies the GPU for its whole prefill and nothing else is scheduled meanwhile (the
head-of-line blocking of Medha's non-preemptive baselines; Medha arXiv 2409.17264 §1,
REFERENCE.md §1.1). The token budget is raised to ``max_model_len`` as vLLM requires with
``--no-enable-chunked-prefill``. Admission is FCFS.
"""

from __future__ import annotations

from .base import SchedulerPolicy, register


@register("nonpreemptive")
class NonPreemptivePrefill(SchedulerPolicy):
    """FCFS with whole (unchunked) prefills."""

    chunked_prefill = False
    order_is_static = True

    def token_budget(self, default: int) -> int:
        return max(default, self.ctx.spec.model_len_limit)
