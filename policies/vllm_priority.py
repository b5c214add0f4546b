"""vLLM's ``--scheduling-policy priority``: per-request priorities, lower served first.

Sources (vLLM 0.32, V1 engine):

- ``vllm/config/scheduler.py`` ``SchedulerConfig.policy``: ``"priority"`` means requests are
  handled by their given priority (lower value means earlier handling), ties by arrival time.
- ``vllm/v1/request.py``: ``Request.priority`` (``priority: int = 0``) and ``Request.__lt__``,
  which orders by ``(priority, arrival_time, request_id)``.
- ``vllm/v1/core/sched/request_queue.py`` ``PriorityRequestQueue``: the waiting queue is a heap
  in that order; ``prepend_request`` of a preempted request re-inserts it by the same order (there
  is no front of the queue).
- ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``: when a running request cannot get
  KV blocks, the victim is ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``
  (under ``fcfs``: ``self.running[-1]``), preempted by recompute; the waiting loop stops at the
  first request that cannot get its blocks and as soon as ``len(running) >= max_num_active_reqs``
  (``max_num_seqs``): V1 never preempts a running request for a waiting one.

Option ``priority_preemption`` (off by default, as in V1) adds vLLM V0's
``Scheduler._schedule_priority_preemption`` (``vllm/core/scheduler.py``, removed from vLLM
with V0): the head of the waiting queue, sorted by ``(priority, arrival_time)``, that cannot be
scheduled for lack of KV blocks or of a seat (``budget.can_schedule`` with ``max_num_seqs``)
preempts the running request with the largest ``(priority, arrival_time)`` -- the last of the
running queue sorted by it -- as long as that key is larger than the head's ("only preempt if
priority inversion exists"), one after another until the head fits. V0 ran it only in steps
that scheduled no prefill and admitted the head at the next step; kvsched asks inside the
admission pass (the core's head-preemption hook, ``Preemptor.preempt_for_head``), so the head is
admitted in the same step, and for every head in turn while inversions remain. The victims are
preempted in the spec's ``preemption_mode`` (the cheapest with ``tier_aware_preemption``) and
counted in ``stats["admission_preemptions"]``.

Priorities come from the workload (a trace's ``priority`` column, or per SLO class in a
synthetic workload); 0 for every request when it has none, vLLM's default, and then this
policy is FCFS by arrival time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable

from .base import PolicyParams, SchedulerPolicy, register
from .victims import max_priority_row


@dataclass(frozen=True)
class VLLMPriorityParams(PolicyParams):
    """Parameters of ``vllm-priority`` (and every policy's, :class:`PolicyParams`).

    Attributes:
        priority_preemption: vLLM V0's priority preemption (see the module docstring): a
            blocked head of the waiting queue preempts running requests of lower priority
            (larger ``(priority, arrival_s)``) when no seat (``max_num_seqs``) or no KV blocks
            are left. ``False`` (default): vLLM V1, which never does.

    Raises:
        ConfigError: ``priority_preemption`` is not a bool, or is on together with an
            ``admission_preemption`` other than ``"never"`` (both would decide who a blocked head
            pushes out).
    """

    priority_preemption: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.priority_preemption, bool):
            require(False, "VLLMPriorityParams.priority_preemption", self.priority_preemption, "true or false")
        if self.priority_preemption and self.admission_preemption != "never":
            require(False, "VLLMPriorityParams.admission_preemption", self.admission_preemption,
                    "'never' with priority_preemption on (both decide who a blocked head preempts; choose one)")


@register("vllm-priority")
class VLLMPriority(SchedulerPolicy):
    """Waiting by ``(priority, arrival_s)``; KV victim the largest ``(priority, arrival_s)``."""

    params_cls = VLLMPriorityParams
    params: VLLMPriorityParams
    order_is_static = True  # priorities and arrivals never change

    @property
    def preempts_for_head(self) -> bool:
        """The core asks :meth:`choose_head_preemption` only with ``priority_preemption``."""
        return bool(getattr(self.params, "priority_preemption", False))

    def order_waiting(self, table: FeatureTable) -> np.ndarray:
        """``PriorityRequestQueue`` order: ``(priority, arrival_s, request_id)`` ascending
        (``Request.__lt__``; vLLM compares string request ids last, kvsched its integer ids)."""
        return np.lexsort((table.request_id, table.arrival_s, table.priority))

    def choose_victim(self, table: FeatureTable) -> int:
        """The largest ``(priority, arrival_s)``, the earliest admitted among equal keys (V1's
        ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``)."""
        return max_priority_row(table)

    def choose_head_preemption(self, running: FeatureTable, head: FeatureTable, cause: str,
                               costs_s: dict[str, np.ndarray], default_mode: str) -> tuple[int, str] | None:
        """V0's rule: the running request with the largest ``(priority, arrival_s)`` (the last of
        equal keys, as V0's stable sort leaves it), if that key is larger than the head's;
        else ``None``. Its mode: ``default_mode``, or the cheapest with ``tier_aware_preemption``.
        The same rule for both causes (V0 checks blocks and seats together)."""
        row = max_priority_row(running, last=True)
        victim = (int(running.priority[row]), float(running.arrival_s[row]))
        if victim <= (int(head.priority[0]), float(head.arrival_s[0])):
            return None  # no priority inversion
        if not self.params.tier_aware_preemption:
            return row, default_mode
        modes = list(costs_s)
        return row, modes[int(np.argmin([costs_s[m][row] for m in modes]))]
