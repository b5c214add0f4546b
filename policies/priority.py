"""Naive priority queue: shortest prompt first (SJF by prompt length).

The instinct that treats mixed traffic as an ordering problem (the project brief): waiting
requests are admitted shortest-prompt first, ties by arrival. Running requests are never
preempted for a new arrival; on KV exhaustion the victim is the running request with the
longest prompt (vLLM ``--scheduling-policy priority`` preempts the largest
``(priority, arrival_time)``; here priority = prompt length). Source: vLLM
``vllm/v1/core/sched/scheduler.py`` priority mode (REFERENCE.md §4.1); the prompt-length
priority is the naive SJF the brief argues against.
"""

from __future__ import annotations

import numpy as np

from kvsched.envs.sim.features import FeatureTable

from .base import SchedulerPolicy, register


@register("priority")
class ShortestPromptFirst(SchedulerPolicy):
    """Admit the shortest waiting prompt first; preempt the longest running prompt."""

    order_is_static = True

    def order_waiting(self, table: FeatureTable) -> np.ndarray:
        # lexsort: last key is primary -> prompt length, then arrival
        return np.lexsort((table.arrival_s, table.prompt_tokens))

    def choose_victim(self, table: FeatureTable) -> int:
        key = np.lexsort((table.arrival_s, table.prompt_tokens))
        return int(key[-1])
