"""First-come-first-served admission, as vLLM's default ``--scheduling-policy fcfs``.

Source: vLLM V1 scheduler (``vllm/v1/core/sched/scheduler.py``; REFERENCE.md §4.1): running
requests are scheduled first in order; waiting requests are admitted in arrival order, with
recompute-preempted requests put back at the front; on allocation failure the most recently
admitted running request is preempted.
"""

from __future__ import annotations

from .base import SchedulerPolicy, register


@register("fcfs")
class FCFS(SchedulerPolicy):
    """vLLM FCFS: queue order for admission, latest-admitted running request as victim."""

    order_is_static = True
