"""Preemption mechanics: victims, modes and their costs, swap-out and swap-in.

When a running request cannot get KV blocks, the policy picks a victim and a mode
(``choose_preemption``; vLLM V1: the most recently admitted, by recompute) until the allocation
succeeds (REFERENCE §4.1). Modes (REFERENCE §5.4):

- **recompute** (vLLM V1): the victim's KV is dropped and it goes back to the waiting queue's
  head; it re-prefills its prompt and the tokens it generated (vLLM issue #18115);
- **swap** / **offload** / an extra tier's mode: its blocks are copied to the first lower tier of
  that mode with room (swap falls back to NVMe, then recompute) before the step runs (vLLM V0
  swaps out synchronously); it comes back first, copied in over the same links (reload on demand
  stalls the step, vLLM V0; with ``prefetch`` only the request waits, REFERENCE §9.1);
- **migrate** (PNM tier): it moves to the processing-near-memory tier and keeps running
  (:mod:`.pnm_migration`).

A request whose KV is still being copied in is not chosen while others exist; when it is the
only other one, the request short of blocks waits for the copy instead of preempting itself
(vLLM swaps in synchronously, so there the loading request would be the newest and the victim;
preempting the other let two requests swap each other out and in forever).

Admission preemption (``params.admission_preemption``): the blocked head of the admission
order may preempt a running request when the policy says so
(:func:`kvsched.policies.preemption.choose_admission_preemption` decides; here is the mechanism).

Head preemption (a policy with ``preempts_for_head``, e.g. ``vllm-priority`` with
``priority_preemption``): the head of the admission order, blocked for a seat (``max_num_seqs``)
or for KV blocks, asks the policy for a victim among the running requests, again after each
preemption while it stays blocked -- the mechanism of vLLM V0's
``Scheduler._schedule_priority_preemption`` (``vllm/core/scheduler.py``), whose rule (only a
request of lower priority than the head) is the policy's. Victims are counted with the admission
preemptions.
"""

from __future__ import annotations

from .errors import bounded_repr

from typing import TYPE_CHECKING

import numpy as np

from .observer import PreemptionEvent
from .request import RUNNING, SWAPPED, WAITING, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance
    from .observer import SimObserver
    from .step_plan import StepBuild


class Preemptor:
    """Preemption mechanics of one instance (see the module docstring).

    Attributes:
        preemptions: preemptions so far (every mode, PNM-pool ones included).
        admission_preemptions: those made for a blocked waiting request.
    """

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.preemptions = 0
        self.admission_preemptions = 0
        #: told of every preemption (:class:`~.observer.SimObserver`), or None (the default)
        self.observer: SimObserver | None = None

    # ------------------------------------------------------------- running out of KV
    def make_room(self, st: RequestState, need: int, now: float, step: StepBuild) -> bool:
        """Preempt victims until ``need`` HBM blocks can be allocated for ``st``.

        Returns ``False`` when ``st`` itself was preempted, or when it waits (a request being
        copied in is the only other candidate; see the module docstring).
        """
        inst = self.inst
        while True:
            # PNM: requests on PNM (or moving there) hold no HBM that preempting them would free
            in_hbm = [r for r in inst.running if not (r.on_pnm or r.pnm_migrating)]
            candidates = [r for r in in_hbm if r.ready_s <= now]
            if len(candidates) == 1 and candidates[0] is st and len(in_hbm) > 1:
                return False  # another is being copied in: wait for it to land (the step goes on without st)
            candidates = candidates or in_hbm
            row, mode = inst.policy.choose_preemption(inst.feature_table(candidates, now), self.costs(candidates),
                                                      inst.spec.preemption_mode)
            victim = candidates[row]
            step.drop(victim)
            self.preempt(victim, now, mode, "blocks", st.rid)
            step.victims.append(victim)
            if victim is st:
                return False
            if inst.kv.allocate(need):
                return True

    def costs(self, candidates: list[RequestState]) -> dict[str, np.ndarray]:
        """Seconds each preemption mode would cost each candidate (REFERENCE.md §5.4).

        recompute: predicted prefill of the tokens it holds; each lower tier's mode: the copy out
        and back over its path (:meth:`~.kv_manager.KVManager.round_trip_costs`); migrate (PNM
        tier only, :meth:`~.pnm_migration.PNMMigrator.migration_costs`). ``inf`` where the tier has
        no room. Keys in that order (policies break ties by it).
        """
        inst = self.inst
        n = len(candidates)
        blocks = np.fromiter((c.shared_blocks + c.private_blocks for c in candidates), np.int64, count=n)
        tokens = np.fromiter((c.computed for c in candidates), np.int64, count=n)
        costs = {"recompute": np.asarray(inst.cost.prefill_time_s(tokens), dtype=np.float64)}
        costs.update(inst.kv.round_trip_costs(blocks))
        if inst.kv.pnm.capacity_blocks:
            costs["migrate"] = inst.pnm_migrator.migration_costs(candidates, tokens)
        return costs

    def preempt(self, victim: RequestState, now: float, mode: str | None = None, cause: str = "blocks",
                for_request_id: int = -1) -> None:
        """Preempt ``victim`` in ``mode`` (default: the spec's ``preemption_mode``).

        A victim whose swap-in copy is in flight goes back to swapped with no copy out (its
        lower-tier copy is intact and current; the landing event becomes stale). Otherwise the
        blocks allocated for a step it loses are returned first; then it swaps out
        (:meth:`~.kv_manager.KVManager.swap_out`) or, when no tier takes it, recomputes.
        ``cause`` and ``for_request_id`` (why, and for whom) only label it for an observer
        (:class:`~.observer.PreemptionEvent`, told after the fact with the mode the victim got).
        """
        if self.inst.remote_kv is not None:  # a victim receiving KV abandons its transfer (.disagg)
            self.inst.remote_kv.on_preempted(victim, now)
        obs = self.observer
        if obs is None:
            self._preempt(victim, now, mode)
            return
        tokens = victim.computed
        blocks = victim.shared_blocks + victim.private_blocks + victim.pnm_blocks
        got = self._preempt(victim, now, mode)
        obs.on_preemption(PreemptionEvent(self.inst.instance_id, now, victim.rid, got, cause, for_request_id,
                                          tokens, blocks))

    def _preempt(self, victim: RequestState, now: float, mode: str | None) -> str:
        """:meth:`preempt`; returns the mode the victim got (:class:`~.observer.PreemptionEvent`)."""
        inst = self.inst
        if mode == "migrate":  # PNM
            self._count(victim)
            inst.pnm_migrator.migrate(victim, now, background=False)
            return "migrate"
        inst.running.remove(victim)
        kv = inst.kv
        if victim.lower_blocks:
            self._count(victim)
            kv.free(victim)
            victim.swap_in_end_s = -1.0
            victim.ready_s = now
            victim.tier = victim.lower_tier
            victim.status = SWAPPED
            inst.swapped.append(victim)
            return "cancel_load"
        excess = victim.shared_blocks + victim.private_blocks - kv.blocks_for(victim.computed)
        if excess > 0 and victim.private_blocks >= excess:  # blocks allocated for a step it loses
            kv.hbm.release_private(excess)
            victim.private_blocks -= excess
        self._count(victim)
        n_blocks = victim.shared_blocks + victim.private_blocks
        target, first_end = kv.swap_out(victim, n_blocks, mode or inst.spec.preemption_mode, now)
        if target is not None:
            if first_end > inst._step_ready_s:
                inst._step_ready_s = first_end  # the step waits for the swap-out copy
            victim.status = SWAPPED
            inst.swapped.append(victim)
            return target.spec.preemption_mode
        self.requeue_for_recompute(victim)
        return "recompute"

    def requeue_for_recompute(self, victim: RequestState) -> None:
        """Recompute preemption's end: the victim's KV is gone (it recomputes its prompt and the
        tokens it generated, vLLM issue #18115) and it waits at the head of the queue."""
        victim.lost_tokens = victim.computed
        victim.computed = 0
        victim.next_seg = 0
        victim.status = WAITING
        self.inst.waiting.appendleft(victim)

    def _count(self, victim: RequestState) -> None:
        victim.preemptions += 1
        self.preemptions += 1

    # ------------------------------------------------------------------- swap-in
    def resume_swapped(self, now: float) -> None:
        """Swap requests back in (oldest first) while HBM has room for their blocks."""
        inst = self.inst
        kv = inst.kv
        while inst.swapped and len(inst.running) < inst.spec.max_seqs:
            st = inst.swapped[0]
            if not kv.allocate(st.lower_blocks):
                break
            inst.swapped.popleft()
            self.swap_in(st, now)
            inst.running.append(st)

    def swap_in(self, st: RequestState, now: float) -> None:
        """Copy a swapped request's blocks back to HBM (already allocated there).

        Reload on demand (default, vLLM V0 ``swap_in`` before the model runs): the step waits
        for the copy. With ``prefetch`` the copy runs behind the steps and only this request
        waits for it. Its lower-tier blocks are freed when the copy lands
        (:meth:`~.instance.Instance.complete_transfer`).
        """
        from .instance import TRANSFER_EVENT

        inst = self.inst
        end = inst.kv.swap_in(st, now)
        st.private_blocks = st.lower_blocks
        st.shared = []
        st.shared_blocks = 0
        st.next_seg = st.n_cacheable_segments  # swapped-in blocks are private copies
        st.ready_s = end
        st.swap_in_end_s = end
        st.status = RUNNING
        st.tier = "hbm"
        if not inst.prefetch and end > inst._step_ready_s:
            inst._step_ready_s = end  # the whole step waits for the reload
        inst.pending_events.append((end, TRANSFER_EVENT, st))

    # ------------------------------------------------------------ admission preemption
    def preempt_for_admission(self, head: RequestState, head_chunk: int, evictable_hit: int,
                              step: StepBuild, now: float) -> bool:
        """Ask the policy whether blocked ``head`` may preempt a running request; do it if so.

        Candidates: running requests in HBM and not loading (nor on PNM), preempted this way
        fewer than ``max_admission_preemptions`` times, longer (prompt + generated tokens) than the
        head and at least ``admission_victim_min_tokens`` long. The policy sees the head (whose
        chunk this step is ``head_chunk`` tokens) and the waiting requests behind it that the
        step's remaining token budget could still admit. A victim planned in this step leaves the
        plan; one that goes back to waiting (recompute) re-enters the queue head after this step's
        admissions, so the requests it made room for go first.

        Returns whether one was preempted. Raises ``ValueError`` if the policy names a row that
        is not eligible.
        """
        inst = self.inst
        running = inst.running
        eligible = self._admission_eligible(head, now)
        if eligible is None:
            return False
        kv = inst.kv
        room = kv.hbm.available_blocks - evictable_hit
        # a victim frees at most the blocks it holds: if none could make room for the head's
        # prompt, the policy's answer is no (the gate requires that room) -- skip the work
        head_blocks = kv.blocks_for(head.prompt_tokens + head.generated + 1)
        if not any(ok and r.shared_blocks + r.private_blocks + room >= head_blocks
                   for ok, r in zip(eligible.tolist(), running)):
            return False
        freed = np.fromiter((kv.freed_by_release(r) for r in running), np.int64, count=len(running))
        waiting_states = self._admissible_behind(head, head_chunk, step)
        waiting_blocks = np.fromiter((kv.blocks_for(c.prompt_tokens + c.generated + 1) for c in waiting_states),
                                     np.int64, count=len(waiting_states))
        costs = self.costs(running)
        costs.pop("migrate", None)
        choice = inst.policy.choose_admission_preemption(
            inst.feature_table(running, now), eligible, freed, inst.feature_table(waiting_states, now),
            waiting_blocks, room, inst.spec.max_seqs - len(running), costs, inst.spec.preemption_mode)
        if choice is None:
            return False
        self._preempt_chosen(choice, eligible, step, now, head.rid)
        return True

    def _admission_eligible(self, head: RequestState, now: float) -> np.ndarray | None:
        """Mask of running requests the head may preempt (None when there is none)."""
        inst = self.inst
        running = inst.running
        params = inst.policy.params
        limit = params.max_admission_preemptions
        head_len = max(head.prompt_tokens + head.generated, params.admission_victim_min_tokens - 1)
        eligible = np.fromiter(
            (r.status == RUNNING and r.ready_s <= now and not (r.on_pnm or r.pnm_migrating) and not r.lower_blocks
             and r.admission_preemptions < limit and r.prompt_tokens + r.generated > head_len
             for r in running), bool, count=len(running))
        return eligible if eligible.any() else None

    def _admissible_behind(self, head: RequestState, head_chunk: int, step: StepBuild) -> list[RequestState]:
        """The head and the waiting requests behind it this step could still admit (the head
        takes its chunk, the others the token budget left; a later one would wait behind the
        victim, which re-enters the queue head or, swapped, closes admission until it returns)."""
        inst = self.inst
        queue = step.admission_order
        k0 = next((i for i, c in enumerate(queue) if c is head), None)
        waiting_states = [head]
        budget = step.budget - head_chunk
        for c in (queue[k0 + 1:] if k0 is not None else ()):
            if budget <= 0 or len(waiting_states) >= inst.spec.max_seqs:
                break
            if c.status != WAITING:
                continue
            tokens = c.prompt_tokens + c.generated
            if not inst.chunked and tokens > budget:
                break
            waiting_states.append(c)
            budget -= min(tokens, step.prefill_slot, inst.long_threshold or tokens)
        return waiting_states

    def _preempt_chosen(self, choice: tuple[int, str], eligible: np.ndarray, step: StepBuild, now: float,
                        head_id: int = -1) -> None:
        """Carry out the policy's admission-preemption choice ``(row, mode)`` for the head ``head_id``."""
        inst = self.inst
        running = inst.running
        row, mode = choice
        if not (0 <= row < len(running)) or not eligible[row]:
            raise ValueError(f"policy {bounded_repr(inst.policy.name)} chose row {row} for admission preemption; "
                             f"allowed: eligible rows {np.flatnonzero(eligible).tolist()}")
        self._displace(running[row], mode, step, now, "admission", head_id)

    def preempt_for_head(self, head: RequestState, cause: str, step: StepBuild, now: float) -> bool:
        """Ask the policy (``choose_head_preemption``) which running request blocked ``head`` preempts;
        do it if it names one.

        Args:
            head: the head of the admission order, blocked.
            cause: ``"seats"`` (``max_num_seqs`` requests run) or ``"blocks"`` (its KV blocks
                cannot be allocated).

        Candidates: running requests in HBM, not loading, not on PNM (as for admission
        preemption; no length or count limit: the policy's rule decides). The victim leaves this
        step's plan; by recompute it re-enters the queue head after this step's admissions.

        Returns whether one was preempted. Raises ``ValueError`` if the policy names a row out of
        range, or a mode neither offered in the costs nor the spec's ``preemption_mode`` (which
        falls back as every preemption does when its tier is full).
        """
        inst = self.inst
        cands = [r for r in inst.running
                 if r.ready_s <= now and not (r.on_pnm or r.pnm_migrating) and not r.lower_blocks]
        if not cands:
            return False
        costs = self.costs(cands)
        costs.pop("migrate", None)
        choice = inst.policy.choose_head_preemption(inst.feature_table(cands, now), inst.feature_table([head], now),
                                                    cause, costs, inst.spec.preemption_mode)
        if choice is None:
            return False
        row, mode = choice
        if not (0 <= row < len(cands)) or not (mode in costs or mode == inst.spec.preemption_mode):
            raise ValueError(f"policy {bounded_repr(inst.policy.name)} chose (row {row}, mode {bounded_repr(mode)}) "
                             "for head preemption; "
                             f"allowed: rows 0..{len(cands) - 1}, modes {[*costs, inst.spec.preemption_mode]}")
        self._displace(cands[row], mode, step, now, "head_" + cause, head.rid)
        return True

    def _displace(self, victim: RequestState, mode: str, step: StepBuild, now: float, cause: str = "admission",
                  for_request_id: int = -1) -> None:
        """Preempt running ``victim`` in ``mode`` for a blocked waiting request (see
        :meth:`preempt_for_admission`)."""
        inst = self.inst
        if step.drop(victim):
            inst.composer.recount(step)
        victim.admission_preemptions += 1
        self.admission_preemptions += 1
        step.preempted = True
        self.preempt(victim, now, mode, cause, for_request_id)
        if victim.status == WAITING:  # recompute: not re-admitted before the requests it made room for
            inst.waiting.remove(victim)
            step.displaced.append(victim)
