"""Preemption victim rules: which running request goes when KV blocks run out.

One implementation of each rule, shared by ``PolicyParams.victim_rule`` (every policy,
:meth:`kvsched.policies.base.SchedulerPolicy.choose_preemption`) and the Scheduling-v0
environment's victim actions (:data:`kvsched.envs.action.VICTIM_RULES`). Each rule maps a
:class:`~kvsched.envs.sim.features.FeatureTable` of the preemption candidates (running requests
in admission order, oldest first) and the seconds each preemption mode would cost each of them
(``costs_s``, as ``choose_preemption`` receives them) to a row of the table:

========================  =====================================================================
rule                      victim (ties: the earliest row, i.e. the earliest admitted, unless said)
========================  =====================================================================
``newest``                the last row, the most recently admitted: vLLM V1 under
                          ``--scheduling-policy fcfs`` (``self.running.pop()`` in
                          ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``)
``oldest``                row 0, the earliest admitted
``least-computed``        fewest tokens in its KV cache (``computed_tokens``): the least work lost
``most-computed``         most tokens in its KV cache
``priority``              the largest ``(priority, arrival_s)``: vLLM V1 under
                          ``--scheduling-policy priority`` (``max(self.running, key=lambda r:
                          (r.priority, r.arrival_time))`` in ``Scheduler.schedule``; Python's
                          ``max`` keeps the first of equal keys, so ties go to the earliest row)
``most-blocks``           most HBM blocks held (frees the most)
``least-cost-per-block``  least seconds per HBM block freed, each row at its cheapest mode
========================  =====================================================================

Progress: a rule whose order between two requests is fixed (``newest``, ``oldest``,
``priority``) never preempts the request it ranks safest while others run, so that one always
advances. ``least-computed`` never preempts the request with the most progress while another has
less. ``most-computed``, ``most-blocks`` and ``least-cost-per-block`` rank by state that changes as
requests run: two long prefills that cannot fit together may preempt each other in turn (the
livelock ``tier_aware_preemption`` guards against by never choosing row 0).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvsched.envs.sim.features import FeatureTable


def _newest(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return len(table) - 1


def _oldest(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return 0


def _least_computed(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return int(np.argmin(table.computed_tokens))


def _most_computed(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return int(np.argmax(table.computed_tokens))


def _most_blocks(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return int(np.argmax(table.hbm_blocks))


def _least_cost_per_block(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    if not costs_s:
        raise ValueError("victim rule 'least-cost-per-block' needs the preemption costs (costs_s)")
    cost = np.min(np.vstack([costs_s[m] for m in costs_s]), axis=0)
    return int(np.argmin(cost / np.maximum(table.hbm_blocks, 1)))


def max_priority_row(table: FeatureTable, last: bool = False) -> int:
    """The row with the largest ``(priority, arrival_s)`` (the least important, latest arrival).

    Args:
        table: candidate rows (at least one).
        last: among rows with equal keys, the last one (vLLM V0: ``running_queue[-1]`` of the
            running queue ``sorted`` by ``(priority, arrival_time)``, a stable sort, in
            ``vllm/core/scheduler.py`` ``Scheduler._schedule_priority_preemption``) instead of the
            first (vLLM V1: Python's ``max``).
    """
    p = table.priority
    top = p == p.max()
    a = np.where(top, table.arrival_s, -np.inf)
    rows = np.flatnonzero(a == a.max())
    return int(rows[-1] if last else rows[0])


def _priority(table: FeatureTable, costs_s: dict[str, np.ndarray] | None) -> int:
    return max_priority_row(table)


#: Victim rules by name (see the module docstring): ``rule(table, costs_s) -> row``.
RULES: dict[str, Callable[[FeatureTable, dict[str, np.ndarray] | None], int]] = {
    "newest": _newest,
    "oldest": _oldest,
    "least-computed": _least_computed,
    "most-computed": _most_computed,
    "priority": _priority,
    "most-blocks": _most_blocks,
    "least-cost-per-block": _least_cost_per_block,
}

#: Values of ``PolicyParams.victim_rule``: ``"policy"`` (the policy's own ``choose_victim``) or a
#: rule of :data:`RULES` named in issue #21 (the engines' and the plain ones).
PARAM_VICTIM_RULES: tuple[str, ...] = ("policy", "newest", "oldest", "least-computed", "most-computed", "priority")


def victim_row(rule: str, table: FeatureTable, costs_s: dict[str, np.ndarray] | None = None) -> int:
    """The row of ``table`` (preemption candidates, admission order) that ``rule`` preempts.

    Raises:
        KeyError: ``rule`` is not in :data:`RULES` (callers validate it first).
    """
    return RULES[rule](table, costs_s)
