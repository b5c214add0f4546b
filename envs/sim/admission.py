"""Admission: waiting requests given cache residency and their first chunk, in the policy's order.

vLLM V1 ``Scheduler.schedule`` (REFERENCE §4.1): waiting requests are taken in order while the
token budget, ``max_num_seqs`` and the KV cache last; the prefix cache is looked up first
(``KVCacheManager.get_computed_blocks``: the leading cached blocks, at least one token left to
compute), then the instance's lower prefix tiers (:mod:`.prefix_offload`) and the cluster tier
(:mod:`.shared_kv`), and the rest is allocated all-or-nothing (``allocate_slots``). When a request cannot
get its blocks, admission stops (head-of-line: later requests do not jump it), unless the
policy lets it preempt a running request (:meth:`~.preemption.Preemptor.preempt_for_admission`,
:meth:`~.preemption.Preemptor.preempt_for_head`). When ``max_num_seqs`` requests run, admission
stops too (vLLM V1 breaks out of its waiting loop), unless the policy preempts for the head
(``preempts_for_head``: vLLM V0's priority preemption, which also frees seats).
A request whose chunk would leave one partial prefill too many is skipped for this step and
later ones may go. Without chunked prefill, so is a prompt longer than the token budget left
(vLLM V1 up to 0.11); with ``InstanceSpec.unchunked_overflow`` "stop" admission stops there
instead (vLLM 0.32, :meth:`Admitter.try_admit`).

Children of a parallel-sampling request (``n > 1``, :meth:`~.request.Request.children`) admitted in
the step a sibling is scheduled find the sibling's full prompt blocks already cached, as in vLLM
V1: ``KVCacheManager.allocate_slots`` (``vllm/v1/core/kv_cache_manager.py``) caches the blocks of
the tokens it schedules (``coordinator.cache_blocks(request, num_tokens_to_cache)``, computed +
new tokens) when it allocates them, so the next child's ``get_computed_blocks`` in the same
``Scheduler.schedule`` waiting loop hits them and only one child computes the prompt (the KV is
written in the same forward pass, before attention reads it). kvsched otherwise caches a segment
when the step that computed it ends (:meth:`~.kv_manager.KVManager.register_segments`); for
siblings it caches the planned segments at the child's admission
(:meth:`~.kv_manager.KVManager.register_scheduled_segments`). Between unrelated requests sharing
a prefix and admitted in the same step kvsched keeps its own rule (each computes the prefix), so
results without parallel sampling are unchanged.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .request import RUNNING, WAITING, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance
    from .step_plan import StepBuild

#: outcomes of :meth:`Admitter.try_admit`
ADMITTED, SKIP, STOP = 0, 1, 2


class Admitter:
    """Admits waiting requests of one instance (see the module docstring).

    Args:
        inst: the :class:`~.instance.Instance` (queues, KV manager, composer, preemptor).
    """

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.stop_at_unchunked_overflow = inst.spec.unchunked_overflow == "stop"

    def admit_in_order(self, cands: list, step: StepBuild, now: float, keep_queue_order: bool) -> None:
        """Admit waiting requests in the given order until budget, seats or KV run out."""
        inst = self.inst
        admitted: list[RequestState] = []
        for st in cands:
            if step.budget <= 0 or (len(inst.running) >= inst.spec.max_seqs and not inst.head_preemption):
                break
            r = self.try_admit(st, step, now)
            if r == ADMITTED:
                admitted.append(st)
            elif r == STOP:
                break
        if admitted:
            if keep_queue_order and all(a is b for a, b in zip(admitted, inst.waiting)):
                for _ in admitted:
                    inst.waiting.popleft()
            else:
                self.drop_admitted(admitted, step)

    def admit_prefills(self, ordered: list, was_running: set, step: StepBuild, now: float) -> None:
        """Stall-free batching's prefill pass: running partial prefills get their next chunk and
        waiting requests are admitted, in one order (``was_running``: ids of the partial runs)."""
        inst = self.inst
        admitted: list[RequestState] = []
        stop_admitting = False
        for st in ordered:
            if step.budget <= 0:
                break
            if st.status == RUNNING:
                if st.rid not in step.planned:
                    inst.composer.schedule_running(st, step, now)
            elif id(st) in was_running:
                continue  # preempted earlier in this step's loop (swapped or back to waiting): not re-admitted now
            elif not stop_admitting:
                r = self.try_admit(st, step, now)
                if r == ADMITTED:
                    admitted.append(st)
                elif r == STOP:
                    stop_admitting = True
        if admitted:
            self.drop_admitted(admitted, step)

    def drop_admitted(self, admitted: list[RequestState], step: StepBuild) -> None:
        """Take this step's admitted requests out of the waiting queue.

        One that was preempted again later in the same step (recompute puts it back at the queue
        head) stays there once; admission-preemption victims come back via ``step.displaced``.
        """
        inst = self.inst
        gone = {id(a) for a in admitted}
        shown = {id(d) for d in step.displaced}
        requeued = [a for a in admitted if a.status == WAITING and id(a) not in shown]
        inst.waiting = deque(s for s in inst.waiting if id(s) not in gone)
        if requeued:
            inst.waiting.extendleft(reversed(requeued))

    def try_admit(self, st: RequestState, step: StepBuild, now: float) -> int:
        """Try to give a waiting request cache residency and its first chunk.

        Returns ``ADMITTED``, ``SKIP`` (not now; later requests may go) or ``STOP`` (allocation
        failed: vLLM stops admitting, head-of-line). With no seat left, a policy that preempts for
        the head is asked for a victim first (cause ``"seats"``).

        Without chunked prefill, a request whose tokens to compute exceed the budget left is
        ``SKIP`` under ``InstanceSpec.unchunked_overflow`` "skip" (vLLM V1 up to 0.11:
        ``skipped_waiting_requests.appendleft(request); continue``) and ``STOP`` under "stop"
        (vLLM 0.32, ``vllm/v1/core/sched/scheduler.py`` lines 1158-1167: ``if not
        enable_chunked_prefill and num_new_tokens > request_token_budget: break``).
        """
        inst = self.inst
        if step.budget <= 0:
            return STOP
        while len(inst.running) >= inst.spec.max_seqs:
            if not (inst.head_preemption and inst.preemptor.preempt_for_head(st, "seats", step, now)):
                return STOP
        if inst.remote_kv is not None:  # prefill/decode disaggregation: a request whose KV comes from another instance
            received = inst.remote_kv.try_admit(inst, st, now)
            if received is not None:
                return ADMITTED if received else STOP
        kv = inst.kv
        total_tokens = st.prompt_tokens + st.generated
        hit, max_seg = kv.cached_prefix(st, total_tokens)
        if hit < max_seg and st.req.parent_id >= 0 and self._cache_planned_siblings(st, step, now):
            hit, max_seg = kv.cached_prefix(st, total_tokens)
        # a load or fetch leaves the request an unfinished prefill (it computes nothing this step):
        # only when the partial-prefill limit lets one more stay unfinished (chunked prefill; an
        # unchunked instance prefills the rest whole once the copy lands)
        if hit < max_seg and (kv.prefix_tiers is not None or inst.shared_kv is not None) \
                and not (inst.chunked and inst.composer.partial_blocked(st, True, step, admitting=True)):
            if kv.prefix_tiers is not None and kv.prefix_tiers.try_load_admit(inst, st, hit, max_seg, now):
                return ADMITTED  # the next segments load from the instance's lower tiers
            if inst.shared_kv is not None and inst.shared_kv.try_fetch_admit(inst, st, hit, max_seg, now):
                return ADMITTED  # the rest of the prefix comes from the cluster KV tier
        hit_tokens = hit * st.seg_tokens
        to_compute = total_tokens - hit_tokens
        st_computed = st.computed
        st.computed = hit_tokens  # chunk_limit sees the tokens already cached
        n = inst.composer.chunk(st, to_compute, step)
        st.computed = st_computed
        if n <= 0:
            return STOP
        leaves_partial = n < to_compute
        if inst.composer.partial_blocked(st, leaves_partial, step, admitting=True):
            if self.stop_at_unchunked_overflow and not inst.chunked and to_compute > step.budget:
                return STOP  # vLLM 0.32: admission ends at a prompt over the budget left
            return SKIP
        hit_hashes = st.hashes[:hit]
        hit_blocks = hit * (st.seg_tokens // kv.bs) if hit else 0
        need = -(-(hit_tokens + n) // kv.bs) - hit_blocks
        if need > kv.hbm.free_blocks + kv.hbm.evictable_blocks - (kv.evictable_hit_blocks(hit_hashes) if hit else 0) \
                and not self._room_for(st, need, hit_hashes, n, step, now):
            inst._blocked_hit_hashes = hit_hashes
            return STOP
        if hit:
            kv.acquire_prefix(st, hit_hashes)
        kv.allocate(need)
        self.take_residency(st, hit_hashes, hit_blocks, need, hit, hit_tokens, now)
        inst.composer.count(st, n, leaves_partial, step)
        return ADMITTED

    def _cache_planned_siblings(self, st: RequestState, step: StepBuild, now: float) -> bool:
        """Cache the prompt segments this step's plan schedules for siblings of ``st`` (children of
        the same parallel-sampling parent), as vLLM V1 caches blocks when it schedules them (the
        module docstring); returns whether any plan entry was a sibling. Cost: one pass over the
        plan, for children only."""
        pid = st.req.parent_id
        kv = self.inst.kv
        found = False
        for sib, tokens in step.plan:
            if sib.req.parent_id == pid and sib is not st and sib.status == RUNNING:
                kv.register_scheduled_segments(sib, tokens, now)
                found = True
        return found

    def _room_for(self, st: RequestState, need: int, hit_hashes, chunk: int, step: StepBuild, now: float) -> bool:
        """Whether ``need`` new HBM blocks can be had for ``st`` (its own cached hits pinned),
        preempting a running request for it when the policy allows (admission preemption; then,
        with ``preempts_for_head``, as many as the policy names, cause ``"blocks"``)."""
        inst = self.inst
        kv = inst.kv
        evictable_hit = kv.evictable_hit_blocks(hit_hashes)
        if need <= kv.hbm.available_blocks - evictable_hit:
            return True
        if inst.admission_preemption and inst.preemptor.preempt_for_admission(st, chunk, evictable_hit, step, now):
            # the victim may have released segments of this request's own hit: they are
            # evictable now, but it pins them, so they are no room for it
            evictable_hit = kv.evictable_hit_blocks(hit_hashes)
        if inst.head_preemption:
            while need > kv.hbm.available_blocks - evictable_hit \
                    and inst.preemptor.preempt_for_head(st, "blocks", step, now):
                evictable_hit = kv.evictable_hit_blocks(hit_hashes)  # as above
        return need <= kv.hbm.available_blocks - evictable_hit

    def take_residency(self, st: RequestState, hit_hashes, shared_blocks: int, private_blocks: int,
                       next_seg: int, computed_tokens: int, now: float) -> None:
        """Make admitted ``st`` a running HBM resident holding ``hit_hashes`` (``shared_blocks``)
        and ``private_blocks``, with ``computed_tokens`` already in its KV (blocks already
        allocated by the caller). Recompute after a preemption is counted here: what it lost
        beyond the tokens found again."""
        st.shared = list(hit_hashes)
        st.shared_blocks = shared_blocks
        st.private_blocks = private_blocks
        st.next_seg = next_seg
        st.computed = computed_tokens
        st.tier = "hbm"
        if st.lost_tokens:
            st.recomputed_tokens += max(0, st.lost_tokens - computed_tokens)
            st.lost_tokens = 0
        if st.first_scheduled_s != st.first_scheduled_s:  # NaN: first admission
            st.first_scheduled_s = now
        st.admissions += 1
        st.status = RUNNING
        self.inst.running.append(st)
