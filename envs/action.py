"""Scheduling actions: what an agent decides at one scheduler decision, and the policy that
carries it out inside the simulator.

The agent acts *on top of a reference policy* (any policy of :mod:`kvsched.policies`, default
``fcfs``): whatever the agent does not decide, the reference decides, exactly as it would
alone. An action has four parts (``MultiDiscrete([K, 7, 5, 4])``):

====  ==============  ========================================================================
part  name            meaning
====  ==============  ========================================================================
0     ``slot``        which candidate (row of the observation, in the reference's order) gets
                      cache residency first; the others follow in the reference's order
1     ``chunk``       per-prefill chunk cap this step: 0 = the reference's ``chunk_limit``,
                      1-5 = 128, 256, 512, 1024, 2048 tokens, 6 = no cap
                      (:data:`CHUNK_BINS_TOKENS`; source: Sarathi-Serve chunk sizes, REFERENCE §1.3)
2     ``victim``      preemption victim if KV allocation fails this step: 0 = reference, 1 =
                      newest admitted (vLLM), 2 = least cost per freed block (REFERENCE §5.4), 3 =
                      most HBM blocks, 4 = fewest computed tokens (:data:`VICTIM_RULES`)
3     ``mode``        preemption mode: 0 = reference, 1 = recompute, 2 = swap to DRAM, 3 = offload
                      to NVMe (:data:`PREEMPTION_MODES`); masked where the tier has no capacity
====  ==============  ========================================================================

Action ``(0, 0, 0, 0)`` is always the reference policy's own decision, so a heuristic acting
through the environment reproduces its direct run exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.envs.sim.features import FeatureTable
from kvsched.policies.base import SchedulerPolicy
from kvsched.policies.victims import victim_row

#: chunk caps (tokens) of action part 1; ``REFERENCE`` = the reference policy's chunk_limit,
#: ``None`` = no cap (the step's token budget and the spec's long-prefill threshold still apply)
REFERENCE = "reference"
CHUNK_BINS_TOKENS: tuple = (REFERENCE, 128, 256, 512, 1024, 2048, None)
VICTIM_RULES: tuple[str, ...] = ("reference", "newest", "least_cost_per_block", "most_blocks", "fewest_computed")
#: The rule of :data:`kvsched.policies.victims.RULES` each victim action applies (one
#: implementation, shared with ``PolicyParams.victim_rule``).
_VICTIM_RULE_OF = {"newest": "newest", "least_cost_per_block": "least-cost-per-block", "most_blocks": "most-blocks",
                   "fewest_computed": "least-computed"}
PREEMPTION_MODES: tuple[str, ...] = ("reference", "recompute", "swap", "offload")


@dataclass(frozen=True)
class AgentDecision:
    """One decision, already resolved against the candidates it was made for.

    Attributes:
        first_request_id: request to admit (or prefill) first, or ``None`` (reference order).
        candidate_ids: request ids of the candidate table the reference order was computed on.
        reference_order: that order (rows of the candidate table), or ``None`` for table order.
        chunk_tokens: an entry of :data:`CHUNK_BINS_TOKENS`.
        victim_rule: an entry of :data:`VICTIM_RULES`.
        mode: an entry of :data:`PREEMPTION_MODES`.
    """

    first_request_id: int | None
    candidate_ids: np.ndarray
    reference_order: np.ndarray | None
    chunk_tokens: object = REFERENCE
    victim_rule: str = "reference"
    mode: str = "reference"


class AgentPolicy(SchedulerPolicy):
    """A scheduler policy that applies the agent's pending :class:`AgentDecision`.

    It mirrors ``reference`` (its parameters, token budget, stall-free batching, chunked
    prefill, completion feedback, admission and head-of-queue preemption and the output lengths
    it learns from)
    and overrides only what the decision sets. Without a pending
    decision it behaves exactly as ``reference``. ``order_is_static`` is ``False``: the
    instance then never fast-forwards past a waiting queue, so no decision point is skipped.

    Args:
        reference: the policy whose decisions the agent's default action reproduces.
    """

    order_is_static = False

    def __init__(self, reference: SchedulerPolicy) -> None:
        self.reference = reference
        self.params = reference.params
        self.name = f"agent+{reference.name}"
        self.stall_free = reference.stall_free
        self.chunked_prefill = reference.chunked_prefill
        self.preempts_for_head = reference.preempts_for_head
        self.ctx = None
        self.decision: AgentDecision | None = None

    def bind(self, ctx) -> None:
        self.ctx = ctx
        self.reference.bind(ctx)

    def token_budget(self, default: int) -> int:
        return self.reference.token_budget(default)

    def on_request_finished(self, now_s, arrival_s, first_token_s, prompt_tokens, generated_tokens) -> None:
        self.reference.on_request_finished(now_s, arrival_s, first_token_s, prompt_tokens, generated_tokens)

    @property
    def output_history(self):
        """The reference's finished output lengths (what its admission-preemption gate estimates from)."""
        return self.reference.output_history

    def choose_admission_preemption(self, *args, **kwargs):
        """The reference's decision (the agent's actions do not cover admission preemption)."""
        return self.reference.choose_admission_preemption(*args, **kwargs)

    def choose_head_preemption(self, *args, **kwargs):
        """The reference's decision (the agent's actions do not cover it either)."""
        return self.reference.choose_head_preemption(*args, **kwargs)

    # ----------------------------------------------------------------------------- ordering
    def _order(self, table: FeatureTable, reference_fn) -> np.ndarray | None:
        d = self.decision
        if d is None:
            return reference_fn(table)
        ids = table.request_id
        if len(ids) == len(d.candidate_ids) and np.array_equal(ids, d.candidate_ids):
            base = d.reference_order  # computed once for the observation, on the same table
        else:  # the candidates changed inside the step (a preemption): ask the reference again
            base = reference_fn(table)
        if d.first_request_id is None:
            return base
        order = np.arange(len(ids)) if base is None else np.asarray(base)
        hit = np.flatnonzero(ids[order] == d.first_request_id)
        if not len(hit) or hit[0] == 0:
            return base
        k = int(hit[0])
        return np.concatenate((order[k:k + 1], order[:k], order[k + 1:]))

    def order_waiting(self, table: FeatureTable) -> np.ndarray | None:
        return self._order(table, self.reference.order_waiting)

    def order_prefills(self, table: FeatureTable) -> np.ndarray | None:
        return self._order(table, self.reference.order_prefills)

    # ----------------------------------------------------------------------------- chunking
    def chunk_limit(self, prompt_tokens, computed_tokens, batch_tokens, batch_attn_pairs, batch_kv_tokens):
        d = self.decision
        if d is None or d.chunk_tokens == REFERENCE:
            return self.reference.chunk_limit(prompt_tokens, computed_tokens, batch_tokens, batch_attn_pairs,
                                              batch_kv_tokens)
        return d.chunk_tokens

    # ---------------------------------------------------------------------------- preemption
    def choose_preemption(self, table: FeatureTable, costs_s: dict[str, np.ndarray],
                          default_mode: str) -> tuple[int, str]:
        d = self.decision
        if d is None or (d.victim_rule == "reference" and d.mode == "reference"):
            return self.reference.choose_preemption(table, costs_s, default_mode)
        ref_row, ref_mode = self.reference.choose_preemption(table, costs_s, default_mode)
        rule = d.victim_rule
        row = ref_row if rule == "reference" else victim_row(_VICTIM_RULE_OF[rule], table, costs_s)
        mode = ref_mode if d.mode == "reference" else d.mode
        return row, mode


def mode_mask(dram_blocks: int, nvme_blocks: int) -> np.ndarray:
    """Allowed preemption modes (:data:`PREEMPTION_MODES`): swap needs DRAM, offload NVMe."""
    return np.array([True, True, dram_blocks > 0, nvme_blocks > 0], dtype=bool)
