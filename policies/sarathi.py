"""Sarathi-Serve: chunked prefills with a fixed chunk and stall-free batching.

Source: Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024 (arXiv 2403.02310), §4: every step first takes all running decodes,
then the unfinished (partial) prefills, then new prefills, until the token budget is used;
prefills are cut into chunks so a step never exceeds the budget. The budget is the chunk size
(512 for strict TBT SLOs, 2048 relaxed, §5; REFERENCE.md §4.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.envs.sim.errors import require

from .base import PolicyParams, SchedulerPolicy, register


@dataclass(frozen=True)
class SarathiParams(PolicyParams):
    """Parameters of Sarathi-Serve.

    Attributes:
        token_budget: tokens per step = the prefill chunk cap (Sarathi-Serve §4.3; 512 in the
            strict-SLO evaluation). Integer >= 16.
    """

    token_budget: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.token_budget, int) and not isinstance(self.token_budget, bool)
                and self.token_budget >= 16, "SarathiParams.token_budget", self.token_budget,
                "an integer >= 16 (tokens per step)")


@register("sarathi")
class Sarathi(SchedulerPolicy):
    """Decodes first, then partial prefills, then new prefills, under a fixed token budget."""

    params_cls = SarathiParams
    stall_free = True
    order_is_static = True

    def token_budget(self, default: int) -> int:
        return self.params.token_budget
