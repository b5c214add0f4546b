"""The batch of one step: which requests run how many tokens under the token budget.

In the spirit of vLLM V1's ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``): a
:class:`StepBuild` collects ``(request, tokens)`` pairs and the batch totals the cost model
prices (tokens, attention pairs, KV tokens read); :class:`StepComposer` fills it the way
``Scheduler.schedule`` does (REFERENCE §4.1):

- running requests first, in admission order (vLLM), or decodes first and then every prefill
  in the policy's order (Sarathi-Serve's stall-free batching, OSDI '24 §4);
- a prefill's chunk is capped by ``long_prefill_token_threshold``, the per-prefill share of the
  budget with several partial prefills (``partial_prefill_budget_lookup_list``), the policy's
  ``chunk_limit`` and the budget left; with ``InstanceSpec.long_prefill_threshold_alone`` "lift"
  the threshold caps nothing in a step that starts with one request running, waiting or swapped
  out (vLLM 0.32, :meth:`StepComposer.long_cap_lifted`);
- with a partial-prefill limit ``max_num_partial_prefills = k`` at most ``k`` requests
  (``max_long_partial_prefills`` long ones) may be left with an unfinished prefill by one step
  (vLLM V0 ``PartialPrefillMetadata``); ``None`` limits nothing (vLLM V1);
- KV blocks for the new tokens are allocated all-or-nothing; when HBM runs out the
  :mod:`.preemption` mechanism makes room; a running request that ends up the victim itself
  ends the running pass: the running requests after it get nothing this step (vLLM V1
  ``Scheduler.schedule``: ``if new_blocks is None: break`` after ``preempted_req == request``;
  under fcfs the victim is the last running request, so only a victim rule that picks from the
  middle -- priority scheduling -- leaves requests behind it; ``InstanceSpec.self_preemption``
  "continues" keeps kvsched <= 0.2's pass, for results computed with it);
- waiting requests are admitted only when the step preempted nobody and nobody is swapped out
  (vLLM V1 admits nobody after a preemption, ``Scheduler.schedule``; vLLM V0's
  ``Scheduler._schedule_default`` schedules no prefill while ``self.swapped`` is not empty). With
  the policy's ``admit_while_swapped`` they are admitted while requests are swapped out and, with
  ``admit_in_preemption_step``, also in a step whose preemptions swapped requests out: vLLM V0's
  ``_schedule_chunked_prefill``
  (``vllm/core/scheduler.py``, V0 up to 0.10) calls ``_schedule_swapped`` only when the running
  pass preempted nobody, and ``_schedule_prefills`` whatever happened, so new prompts take the
  HBM a swap-out freed before the swapped request can come back, and under sustained load
  host memory fills (:meth:`StepComposer.open_admission`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from .request import RUNNING, WAITING, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance


def is_unfinished_prefill(st: RequestState) -> bool:
    """Whether ``st`` (holding KV) still has prompt (or, after a recompute, generated) tokens to
    prefill: more than the one token of a decode left to compute."""
    left = st.prompt_tokens + st.generated - st.computed
    return left > 1 or (left == 1 and st.generated == 0)


class StepBuild:
    """Mutable state while one step's batch is composed.

    Attributes:
        budget: tokens left in the step's token budget.
        prefill_slot: the most tokens one prefill may take (per-prefill share of the budget).
        long_cap_lifted: the long-prefill threshold caps no chunk in this step (a request alone
            under ``long_prefill_threshold_alone`` "lift": :meth:`StepComposer.long_cap_lifted`).
        plan: ``(request, tokens)`` in batch order; ``planned``: their request ids.
        partial, long_partial: requests (long ones) this step leaves with an unfinished prefill.
        preempted: a running request was preempted while composing (vLLM then admits nobody).
        n_tokens, attn2, kv_tokens: the batch so far in the cost model's terms (``attn2`` is twice
            the attention pairs, so integers stay exact).
        admission_order: waiting candidates in admission order (for admission preemption).
        displaced: requests preempted for a blocked waiting one (recompute), or (admission while
            swapped) preempted by recompute in this step's running pass: they re-enter the queue
            head after this step's admissions.
        victims: requests preempted in this step's running pass (for lack of KV blocks).
    """

    __slots__ = ("budget", "long_cap_lifted", "plan", "planned", "partial", "long_partial", "preempted", "n_tokens",
                 "attn2", "kv_tokens", "prefill_slot", "admission_order", "displaced", "victims")

    def __init__(self, budget: int, long_cap_lifted: bool = False) -> None:
        self.budget = budget
        self.long_cap_lifted = long_cap_lifted
        self.prefill_slot = budget
        self.plan: list[tuple[RequestState, int]] = []
        self.planned: set[int] = set()
        self.partial = 0
        self.long_partial = 0
        self.preempted = False
        self.n_tokens = 0
        self.attn2 = 0
        self.kv_tokens = 0
        self.admission_order: list[RequestState] = []
        self.displaced: list[RequestState] = []
        self.victims: list[RequestState] = []

    def drop(self, victim: RequestState) -> bool:
        """Take ``victim`` out of the plan (a preemption); returns whether it was planned."""
        if victim.rid not in self.planned:
            return False
        for k, (s_, _) in enumerate(self.plan):
            if s_ is victim:
                del self.plan[k]
                break
        self.planned.discard(victim.rid)
        return True


class StepComposer:
    """Fills a :class:`StepBuild` for one instance (see the module docstring).

    Args:
        inst: the :class:`~.instance.Instance` whose queues, KV manager and policy it uses.
    """

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.self_preemption_ends_pass = inst.spec.self_preemption == "ends_pass"
        self.lift_long_cap_alone = inst.spec.long_prefill_threshold_alone == "lift"

    def long_cap_lifted(self) -> bool:
        """Whether the instance's long-prefill threshold caps no chunk in the step about to be
        planned.

        With ``InstanceSpec.long_prefill_threshold_alone`` "lift": when at most one request is
        running, waiting or swapped out at the step's start: vLLM 0.32 ``Scheduler.schedule``
        (``vllm/v1/core/sched/scheduler.py`` lines 640-649) applies the threshold only ``if
        num_eligible_reqs > 1``, ``num_eligible_reqs`` being its running plus waiting requests
        counted before the running pass ("nobody to starve"); vLLM V1 up to 0.11 capped every
        chunk ("cap", the default). kvsched's swapped-out requests count as waiting ones (vLLM
        0.32 has no swapping; a preempted request waits).
        """
        inst = self.inst
        return self.lift_long_cap_alone and len(inst.running) + len(inst.waiting) + len(inst.swapped) <= 1

    # --------------------------------------------------------------------- whole step
    def compose(self, step: StepBuild, now: float) -> tuple[int, bool]:
        """vLLM order: running requests, then swapped ones resume (only when nothing was
        preempted), then waiting ones are admitted (when :meth:`open_admission`).

        Returns ``(n_decodes, waiting_blocked_static)``: ``n_decodes > 0`` when the plan starts
        with one decode of every running request (the fast path); whether a waiting queue left
        behind stays blocked while the batch does not change (the policy's order is static).
        """
        inst = self.inst
        running = inst.running
        n_decodes = 0
        blocked_static = True
        if running and self.schedule_decodes(running, step, now):
            n_decodes = len(running)
        else:
            for st in list(running):
                if step.budget <= 0:
                    break
                if st.status == RUNNING and st.ready_s <= now:  # not preempted, blocks in HBM
                    self.schedule_running(st, step, now)
                    if step.victims and step.victims[-1] is st and self.self_preemption_ends_pass:
                        break  # it preempted itself: the running pass ends (below)
        if not step.preempted:
            inst.preemptor.resume_swapped(now)
        if self.open_admission(step) and inst.waiting and step.budget > 0 \
                and (len(running) < inst.spec.max_seqs or inst.head_preemption):
            order = inst.policy.order_waiting(inst.feature_table(inst.waiting, now))
            cands = list(inst.waiting) if order is None else [inst.waiting[int(r)] for r in order]
            step.admission_order = cands
            inst.admitter.admit_in_order(cands, step, now, keep_queue_order=order is None)
            blocked_static = inst.policy.order_is_static
        return n_decodes, blocked_static

    def open_admission(self, step: StepBuild) -> bool:
        """Whether waiting requests may be admitted after this step's running pass (and, when
        they may right after a preemption, the pass's recompute victims set aside).

        Default: only when the pass preempted nobody (vLLM V1 ``Scheduler.schedule``: no
        admission after a preemption) and nobody is swapped out (vLLM V0
        ``Scheduler._schedule_default``: "If any requests are swapped, prioritized swapped
        requests"). With ``admit_while_swapped`` and requests swapped out, after a pass without
        preemption; with ``admit_in_preemption_step`` too, always -- also right after this
        step's preemptions -- as vLLM V0's ``Scheduler._schedule_chunked_prefill``
        (``vllm/core/scheduler.py``, V0 up to 0.10), whose ``_schedule_prefills`` runs whatever
        the running pass did; the requests that pass preempted by recompute are not candidates
        (V0 puts them back in ``waiting`` only after ``_schedule_prefills``): they leave the
        queue for the step and re-enter its head after the admissions (``step.displaced``).
        Without requests swapped out the flag changes nothing.
        """
        inst = self.inst
        if not inst.swapped:
            return not step.preempted
        if not inst.admit_while_swapped or (step.preempted and not inst.admit_in_preemption_step):
            return False
        if step.preempted and step.victims:
            requeued = {id(v) for v in step.victims if v.status == WAITING}
            if requeued:
                step.displaced.extend(s for s in inst.waiting if id(s) in requeued)
                inst.waiting = deque(s for s in inst.waiting if id(s) not in requeued)
        return True

    def compose_stall_free(self, step: StepBuild, now: float) -> tuple[int, bool]:
        """Sarathi-Serve stall-free batching: running decodes first, then every prefill (running
        partial ones and waiting ones together) in the policy's ``order_prefills``. Returns as
        :meth:`compose`."""
        inst = self.inst
        running = inst.running
        n_decodes = 0
        if running and self.schedule_decodes(running, step, now):
            n_decodes = len(running)
        else:
            for st in list(running):
                if step.budget <= 0:
                    break
                if (st.status == RUNNING and st.ready_s <= now
                        and st.computed == st.prompt_tokens + st.generated - 1 and st.generated > 0):
                    self.schedule_running(st, step, now)
                    if step.victims and step.victims[-1] is st and self.self_preemption_ends_pass:
                        break  # it preempted itself: the running pass ends (compose)
        if not step.preempted:
            inst.preemptor.resume_swapped(now)
        partial_runs = [st for st in running if st.status == RUNNING and st.ready_s <= now
                        and st.rid not in step.planned]
        admit = self.open_admission(step)
        cands = partial_runs + (list(inst.waiting) if admit else [])
        if cands and step.budget > 0:
            is_running = np.zeros(len(cands), dtype=bool)
            is_running[:len(partial_runs)] = True
            order = inst.policy.order_prefills(inst.feature_table(cands, now, running=is_running))
            ordered = cands if order is None else [cands[int(r)] for r in order]
            if inst.admission_preemption:  # the waiting candidates (partial runs are RUNNING)
                step.admission_order = [c for c in ordered if c.status != RUNNING]
            inst.admitter.admit_prefills(ordered, {id(s) for s in partial_runs}, step, now)
            return n_decodes, inst.policy.order_is_static
        return n_decodes, True

    # ---------------------------------------------------------------- chunking rules
    def prefill_slot_budget(self, now: float) -> int:
        """Per-prefill share of the token budget with several partial prefills.

        vLLM V0 (``Scheduler._chunk_new_tokens_to_schedule`` with
        ``partial_prefill_budget_lookup_list``): with a limit ``max_num_partial_prefills = k`` and
        ``m`` prefills that could run, each prefill gets at most ``budget // min(m, k)`` tokens,
        so a long prompt cannot take the whole budget from short ones (``k = 1``: the whole
        budget, V0's ``lookup[1] = max_num_batched_tokens``). No limit (None): the whole budget.
        """
        inst = self.inst
        k = inst.spec.max_num_partial_prefills
        if k is None or k <= 1 or not inst.chunked:
            return inst.budget
        m = sum(1 for st in inst.running
                if st.status == RUNNING and st.ready_s <= now and st.prompt_tokens + st.generated - st.computed > 1)
        m += len(inst.waiting) if (not inst.swapped or inst.admit_while_swapped) else 0
        return max(1, inst.budget // max(1, min(m, k)))

    def chunk(self, st: RequestState, to_compute: int, step: StepBuild) -> int:
        """Tokens a prefill may take this step: threshold, per-prefill slot, policy limit, budget."""
        n = to_compute
        if to_compute > 1 and n > step.prefill_slot:
            n = step.prefill_slot
        long_threshold = self.inst.long_threshold
        if long_threshold > 0 and n > long_threshold and not step.long_cap_lifted:
            n = long_threshold
        if to_compute > 1:
            lim = self.inst.policy.chunk_limit(st.prompt_tokens, st.computed, step.n_tokens, step.attn2 / 2.0,
                                               step.kv_tokens)
            if lim is not None and n > lim:
                n = max(1, int(lim))
        if n > step.budget:
            n = step.budget
        return n

    def partial_blocked(self, st: RequestState, leaves_partial: bool, step: StepBuild, admitting: bool = False) -> bool:
        """Whether a chunk that leaves ``st``'s prefill unfinished is refused this step.

        Under a partial-prefill limit ``k`` the step may leave at most ``k`` prefills unfinished
        (``max_long_partial_prefills`` of them long). A waiting request being admitted
        (``admitting``) also counts the running requests this step leaves with an unfinished
        prefill without a chunk (resumed from a lower tier, still loading, or later in a
        stall-free order): they stay partial whatever it does.
        """
        if not leaves_partial:
            return False
        inst = self.inst
        if not inst.chunked:
            return True  # an unchunked prefill runs whole or not at all
        spec = inst.spec
        k = spec.max_num_partial_prefills
        if k is None:
            return False  # no partial-prefill limit (vLLM V1)
        long_threshold = inst.long_threshold
        is_long = long_threshold > 0 and st.prompt_tokens > long_threshold
        partial, long_partial = step.partial, step.long_partial
        if admitting:
            planned = step.planned
            for r in inst.running:
                if r.rid not in planned and r.status == RUNNING and is_unfinished_prefill(r):
                    partial += 1
                    if long_threshold > 0 and r.prompt_tokens > long_threshold:
                        long_partial += 1
        return partial >= k or (is_long and long_partial >= spec.max_long_partial_prefills)

    def count(self, st: RequestState, n: int, leaves_partial: bool, step: StepBuild) -> None:
        """Add ``(st, n)`` to the plan and the batch totals."""
        step.plan.append((st, n))
        step.planned.add(st.rid)
        step.budget -= n
        p = st.computed
        step.n_tokens += n
        if st.on_pnm:
            pass  # PNM: its attention runs near memory, not in the GPU step's attention terms
        elif n == 1 and st.generated > 0 and p == st.prompt_tokens + st.generated - 1:
            step.attn2 += 2 * p
            step.kv_tokens += p
        else:
            step.attn2 += n * (2 * p + n)
            step.kv_tokens += p + n
        if leaves_partial:
            step.partial += 1
            long_threshold = self.inst.long_threshold
            if long_threshold > 0 and st.prompt_tokens > long_threshold:
                step.long_partial += 1

    def recount(self, step: StepBuild) -> None:
        """Recompute a step's budget and batch counters from its plan (after a victim left it)."""
        plan = step.plan
        step.plan, step.planned = [], set()
        step.budget = self.inst.budget
        step.partial = step.long_partial = step.n_tokens = step.attn2 = step.kv_tokens = 0
        for st, n in plan:
            to_compute = st.prompt_tokens + st.generated - st.computed
            self.count(st, n, n < to_compute, step)

    # -------------------------------------------------------------- running requests
    def schedule_running(self, st: RequestState, step: StepBuild, now: float) -> None:
        """Give a running request its tokens for this step, preempting others if KV runs out."""
        to_compute = st.prompt_tokens + st.generated - st.computed
        n = self.chunk(st, to_compute, step)
        if n <= 0:
            return
        leaves_partial = n < to_compute
        if self.partial_blocked(st, leaves_partial, step):
            return
        inst = self.inst
        kv = inst.kv
        if st.on_pnm:  # PNM: its KV grows in the PNM pool; a full pool preempts it (recompute)
            need = kv.blocks_for(st.computed + n) - st.pnm_blocks
            if need > 0 and not kv.pnm.allocate(need):
                # frees no HBM, so unlike an HBM preemption it does not stop this step's admissions
                # (the request itself may be re-admitted at once)
                inst.pnm_migrator.preempt_resident(st, now)
                return
            if need > 0:
                st.pnm_blocks += need
            self.count(st, n, leaves_partial, step)
            return
        need = kv.blocks_for(st.computed + n) - st.shared_blocks - st.private_blocks
        if need < 0:
            need = 0
        if need > 0 and not kv.allocate(need):
            step.preempted = True
            survived = inst.preemptor.make_room(st, need, now, step)
            step.budget = inst.budget - sum(n_ for _, n_ in step.plan)
            if not survived:
                return  # st preempted itself
        st.private_blocks += need
        self.count(st, n, leaves_partial, step)

    def schedule_decodes(self, running: list[RequestState], step: StepBuild, now: float) -> bool:
        """Fast path of the running loop when every running request is a ready decode.

        Gives each one token at once when the token budget covers them all and HBM has the new
        blocks they need (one allocation of the sum: evicts the same LRU segments as one
        allocation per request). Returns ``False`` without changing anything otherwise, and the
        caller runs the request-by-request loop (which may preempt). Same plan, counters and
        blocks as that loop: a decode's chunk is 1 token, never partial.
        """
        n = len(running)
        kv = self.inst.kv
        if n > step.budget or kv.pnm.capacity_blocks:  # PNM: the per-request loop knows PNM residents
            return False
        bs = kv.bs
        need_total = 0
        ctx_total = 0
        needy = []  # (request, new blocks) of those that need any
        running_status = RUNNING
        for st in running:
            c = st.computed
            g = st.generated
            if st.status != running_status or st.ready_s > now or g <= 0 or c != st.prompt_tokens + g - 1:
                return False
            if not c % bs:  # it holds >= ceil(c / bs) blocks: only at a block boundary can it need one
                need = c // bs + 1 - st.shared_blocks - st.private_blocks  # ceil((c + 1) / bs) - held
                if need > 0:
                    needy.append((st, need))
                    need_total += need
            ctx_total += c
        if need_total:
            if not kv.allocate(need_total):
                return False
            for st, need in needy:
                st.private_blocks += need
        step.plan.extend([(st, 1) for st in running])
        step.planned.update([st.rid for st in running])
        step.budget -= n
        step.n_tokens += n
        step.attn2 += 2 * ctx_total
        step.kv_tokens += ctx_total
        return True
