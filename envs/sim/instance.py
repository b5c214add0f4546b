"""One serving instance: a vLLM-V1-like step loop over a paged, tiered KV cache.

Each step (one scheduler iteration, vLLM ``Scheduler.schedule``; REFERENCE.md §4.1):

1. **Running requests first**, in admission order. A decode gets one token; an unfinished
   (chunked) prefill gets ``min(remaining, long_prefill_token_threshold if > 0, budget)``
   tokens. KV blocks for the new tokens are allocated all-or-nothing; when that fails the
   policy picks a victim (vLLM: the most recently admitted) and it is **preempted** by
   recompute (vLLM V1 default), swap to DRAM or offload to NVMe (``preemption_mode``), until
   the allocation succeeds or the request preempts itself.
2. **Swapped requests resume** (their blocks are copied back to HBM over PCIe; a request cannot
   run until its copy lands) and, only when nothing was preempted this step and nobody is
   swapped out (vLLM V0 rule), **waiting requests are admitted** in the policy's order until the
   token budget (``max_num_batched_tokens``), ``max_num_seqs`` or the KV cache runs out.
   A prefix-cache lookup reduces the tokens to compute.
3. The step's time comes from the cost model; at its end every request that finished its
   pending tokens emits one output token.

Partial prefills (vLLM ``--max-num-partial-prefills`` / ``--max-long-partial-prefills``, V0
``PartialPrefillMetadata``): only when ``max_num_partial_prefills = k > 1``, each prefill gets at
most ``budget // min(m, k)`` tokens (``m`` prefills could run), at most ``k`` requests may be
left with an unfinished prefill by one step, and at most ``max_long_partial_prefills`` of them
*long* (prompt above ``long_prefill_token_threshold``, which defaults to 4 % of
``max_model_len`` then). Requests whose whole prefill fits in the step do not count. With
``k = 1`` nothing is limited, so a running long prefill takes whatever budget the decodes
leave, and short prompts wait behind it (the stall the threshold or ``k > 1`` removes).

**PNM tier** (REFERENCE §3; only with ``spec.pnm``; every PNM line below is marked ``# PNM``).
A PNM-resident request (``on_pnm``) keeps its KV in the PNM pool, grows it there, and its decode
attention runs near memory (``CostModel.pnm_step_time_fast``). It gets there two ways: (a) the
policy's ``choose_migrations`` (checked at the start of every step, over GPU-resident decodes)
starts a background GPU->PNM copy over the PNM link; the request keeps its HBM blocks and does not
decode until the copy lands (``TRANSFER_EVENT``), then frees them; (b) tier-aware preemption picks
mode ``"migrate"``: its HBM blocks are freed at once and the step waits for the copy, as a V0
swap-out does. A PNM-resident request that cannot grow in a full PNM pool is preempted by
recompute.

**Fast-forward.** When a step's batch is all decodes, nobody is loading, swapped or
preempted, and the waiting queue cannot be admitted by a static-order policy, the next steps
repeat the same batch until a request finishes, the KV cache cannot grow, or the next arrival
lands. That stretch of K steps is advanced at once with NumPy: step times as one vectorised
cost-model call, end times by a sequential cumulative sum from ``now`` (the same float
additions as stepping one by one, so results are byte-identical to ``fast_forward=False``),
block growth from each request's position inside its block. With a cluster KV tier
(:mod:`kvsched.envs.sim.shared_kv`) no stretch runs while requests wait: a waiting request's
admission then depends on time (a pool write lands, link queues drain), so it may change at any
step boundary inside the stretch.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

import numpy as np

from .cost_model import CostModel
from .features import FeatureTable
from .policy_api import PolicyContext
from .kv_cache import BlockPool, LinkQueue
from .request import FINISHED, REJECTED, RUNNING, SWAPPED, WAITING, RequestState
from .instance_spec import InstanceSpec

TRANSFER_EVENT = "transfer"
_ADMITTED, _SKIP, _STOP = 0, 1, 2


class _StepBuild:
    """Mutable state while one step's batch is composed."""

    __slots__ = ("budget", "plan", "planned", "partial", "long_partial", "preempted", "n_tokens", "attn2",
                 "kv_tokens", "prefill_slot", "admission_order", "displaced")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.prefill_slot = budget
        self.plan: list[tuple[RequestState, int]] = []
        self.planned: set[int] = set()
        self.partial = 0
        self.long_partial = 0
        self.preempted = False
        self.n_tokens = 0  # the batch so far, in the cost model's terms (attn2 = 2 x pairs)
        self.attn2 = 0
        self.kv_tokens = 0
        self.admission_order: list[RequestState] = []  # waiting candidates in admission order
        self.displaced: list[RequestState] = []  # preempted for a blocked waiting request (recompute)


@dataclass(frozen=True)
class InstanceOptions:
    """Simulation options of an instance (not part of the served system's configuration).

    Attributes:
        fast_forward: advance unchanged decode stretches at once (results are identical).
        check_invariants: verify block conservation and holdings after every step (slow; tests).
        oracle_lengths: show true output lengths to the policy (scenario flag).
    """

    fast_forward: bool = True
    check_invariants: bool = False
    oracle_lengths: bool = False


class Instance:
    """A serving instance (one model replica, ``tp`` GPUs) driven by an event loop.

    The cluster calls :meth:`add_request` at arrivals, :meth:`schedule` when the instance is
    idle (returns the end time of the planned step or stretch, or ``None``), then
    :meth:`complete_step` at that time, and :meth:`complete_transfer` when a swap-in lands.

    Args:
        spec: the served system (model, GPU, TP, KV tiers, scheduler limits, cost params).
        policy: a :class:`kvsched.policies.base.SchedulerPolicy`.
        recorder: collects finished records, ITL samples and occupancy.
        instance_id: index within the cluster.
        options: simulation options.
    """

    def __init__(self, spec: InstanceSpec, policy, recorder, instance_id: int = 0,
                 options: InstanceOptions = InstanceOptions()) -> None:
        self.spec = spec
        self.policy = policy
        self.recorder = recorder
        self.instance_id = instance_id
        self.options = options
        self.cost = CostModel(spec)
        self.bs = spec.block_size_tokens
        self.hbm = BlockPool("hbm", spec.num_hbm_blocks, spec.enable_prefix_caching,
                             single_free_queue=spec.cache_decode_blocks)
        self.dram = BlockPool("dram", spec.num_dram_blocks)
        self.nvme = BlockPool("nvme", spec.num_nvme_blocks)
        self.pnm = BlockPool("pnm", spec.num_pnm_blocks)  # PNM: capacity 0 without spec.pnm
        self.pools = {"hbm": self.hbm, "dram": self.dram, "nvme": self.nvme, "pnm": self.pnm}
        self.links = {name: LinkQueue(name) for name in ("pcie_d2h", "pcie_h2d", "nvme_write", "nvme_read",
                                                          "pnm_link")}
        self.block_bytes = int(round(spec.kv_bytes_per_block))
        self.long_threshold = self.effective_long_prefill_threshold(spec)
        policy.bind(PolicyContext(spec=spec, cost=self.cost, instance_id=instance_id))
        self.budget = int(policy.token_budget(spec.token_budget))
        if self.budget < 1:
            raise ValueError(f"policy {policy.name!r} gave token_budget={self.budget}; must be >= 1")
        self.prefetch = bool(getattr(policy.params, "prefetch", False))
        self.admit_while_swapped = bool(getattr(policy.params, "admit_while_swapped", False))
        # may a blocked waiting request preempt a running one (kvsched.policies.preemption)?
        self.admission_preemption = getattr(policy.params, "admission_preemption", "never") != "never"
        self.admission_preemptions = 0
        self.chunked = spec.enable_chunked_prefill if policy.chunked_prefill is None else bool(policy.chunked_prefill)
        if not self.chunked:
            self.long_threshold = 0
            if self.budget < spec.model_len_limit:
                raise ValueError(
                    f"without chunked prefill the token budget ({self.budget}) must cover max_model_len "
                    f"({spec.model_len_limit}), as vLLM requires; raise max_num_batched_tokens")
        recorder.occupancy.register(instance_id, (self.hbm.capacity_blocks, self.dram.capacity_blocks,
                                                  self.nvme.capacity_blocks, self.pnm.capacity_blocks))
        # PNM: the policy decides run-time migrations only if it says so and the spec has a PNM tier
        self.pnm_policy = bool(getattr(policy, "uses_pnm", False)) and self.pnm.capacity_blocks > 0
        self.pnm_migrations = 0
        self._stretch_pnm_reserved = 0
        self._stretch_pnm_used: np.ndarray | None = None
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.swapped: deque[RequestState] = deque()
        self.busy = False
        self.schedule_pending = False
        self.pending_events: list[tuple[float, str, RequestState]] = []
        self.shared_kv = None  # the cluster KV tier (kvsched.envs.sim.shared_kv), set by the cluster
        # plan of the step or stretch in flight
        self._plan: list[tuple[RequestState, int]] = []
        self._stretch_ends: np.ndarray | None = None
        self._single_decodes = 0  # the planned single step starts with this many known decodes
        # steps each plan member runs in a stretch that continues through completions (None: all
        # run the whole stretch), and HBM blocks in use at each step end after its frees
        self._stretch_steps: list[int] | None = None
        self._stretch_end_used: np.ndarray | None = None
        # trailing plan members of a folded stretch (:meth:`_fold_into_stretch`) that emitted
        # their first token at its first step end (their first step is already applied)
        self._stretch_joined = 0
        #: Set by the cluster when nothing outside this instance can observe it between its own
        #: events (one instance, or round-robin look-ahead; no watched decision points, no shared
        #: KV tier): a fast-forwarded stretch may then run through completions while nothing waits,
        #: and a single step that completes prompts may be folded into the stretch after it.
        self.stretch_through_finishes = False
        # counters
        self._stretch_reserved = 0
        self._stretch_used: np.ndarray | None = None
        self.steps = 0
        self.stretches = 0
        self.stretch_steps = 0
        self.folded_steps = 0  # single steps folded into the stretch after them
        self.preemptions = 0
        self.busy_s = 0.0
        self.sum_batch = 0

    @staticmethod
    def effective_long_prefill_threshold(spec: InstanceSpec) -> int:
        """Per-step chunk cap of one prefill, as vLLM applies it.

        ``long_prefill_token_threshold`` when > 0; when it is 0 and
        ``max_num_partial_prefills > 1``, vLLM sets it to 4 % of ``max_model_len``
        (``SchedulerConfig.__post_init__``, REFERENCE.md §4.1). Without chunked prefill there is
        no per-step cap (a prompt runs whole).
        """
        if not spec.enable_chunked_prefill:
            return 0
        if spec.long_prefill_token_threshold > 0:
            return spec.long_prefill_token_threshold
        if spec.max_num_partial_prefills > 1:
            return max(1, int(spec.model_len_limit * 0.04))
        return 0

    # ------------------------------------------------------------------------------- arrivals
    def add_request(self, st: RequestState, now: float) -> bool:
        """Queue an arriving request, or reject it (recorded) if it can never be served.

        A request is rejected with ``exceeds_max_model_len`` when prompt + output tokens exceed
        the model length limit (vLLM validates ``prompt + max_tokens <= max_model_len``), and
        with ``kv_exceeds_hbm_capacity`` when its final KV needs more blocks than HBM holds.
        Returns ``True`` when queued.
        """
        st.instance_id = self.instance_id
        total = st.prompt_tokens + st.output_tokens
        if total > self.spec.model_len_limit:
            return self._reject(st, "exceeds_max_model_len")
        if -(-(total - 1) // self.bs) > self.hbm.capacity_blocks:
            return self._reject(st, "kv_exceeds_hbm_capacity")
        self.waiting.append(st)
        return True

    def _reject(self, st: RequestState, reason: str) -> bool:
        st.status = REJECTED
        st.reject_reason = reason
        self.recorder.record(st)
        return False

    # ----------------------------------------------------------------------------- scheduling
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def schedule(self, now: float, horizon_s: float = math.inf) -> float | None:
        """Plan the next step (or fast-forward stretch) at ``now``.

        Args:
            now: current simulated time (s).
            horizon_s: time of the next event that could change this instance's batch from
                outside (the next arrival); a stretch never runs past the step containing it.

        Returns:
            The end time of the planned step/stretch, or ``None`` when nothing can run.
        """
        spec = self.spec
        step = _StepBuild(self.budget)
        step.prefill_slot = self._prefill_slot_budget(now)
        self._step_ready_s = now
        self._blocked_hit_hashes = ()
        running = self.running
        waiting_blocked_static = True
        if self.pnm_policy:  # PNM: run-time migration check, every step (REFERENCE §3.2)
            self._choose_migrations(now)

        n_decodes = 0  # > 0: the plan starts with one decode of that many running requests
        if not self.policy.stall_free:
            # vLLM: running requests first, in admission order
            if running and self._schedule_decodes(running, step, now):
                n_decodes = len(running)
            else:
                for st in list(running):
                    if step.budget <= 0:
                        break
                    if st.status == RUNNING and st.ready_s <= now:  # not preempted, blocks in HBM
                        self._schedule_running(st, step, now)
            if not step.preempted:
                self._resume_swapped(now)
                if (not self.swapped or self.admit_while_swapped) and self.waiting and step.budget > 0 \
                        and len(running) < spec.max_seqs:
                    order = self.policy.order_waiting(FeatureTable(self.waiting, now, self.options.oracle_lengths))
                    cands = list(self.waiting) if order is None else [self.waiting[int(r)] for r in order]
                    step.admission_order = cands
                    self._admit_in_order(cands, step, now, keep_queue_order=order is None)
                    waiting_blocked_static = self.policy.order_is_static
        else:
            # Sarathi-Serve stall-free batching: decodes first, then prefills in policy order
            if running and self._schedule_decodes(running, step, now):
                n_decodes = len(running)
            else:
                for st in list(running):
                    if step.budget <= 0:
                        break
                    if (st.status == RUNNING and st.ready_s <= now
                            and st.computed == st.prompt_tokens + st.generated - 1 and st.generated > 0):
                        self._schedule_running(st, step, now)
            if not step.preempted:
                self._resume_swapped(now)
            partial_runs = [st for st in running if st.status == RUNNING and st.ready_s <= now
                            and st.rid not in step.planned]
            admit = not step.preempted and (not self.swapped or self.admit_while_swapped)
            waiting = list(self.waiting) if admit else []
            cands = partial_runs + waiting
            if cands and step.budget > 0:
                is_running = np.zeros(len(cands), dtype=bool)
                is_running[:len(partial_runs)] = True
                order = self.policy.order_prefills(
                    FeatureTable(cands, now, self.options.oracle_lengths, running=is_running))
                ordered = cands if order is None else [cands[int(r)] for r in order]
                if self.admission_preemption:  # the waiting candidates (partial runs are RUNNING)
                    step.admission_order = [c for c in ordered if c.status != RUNNING]
                admitted: list[RequestState] = []
                stop_admitting = False
                was_running = {id(s) for s in partial_runs}
                for st in ordered:
                    if step.budget <= 0:
                        break
                    if st.status == RUNNING:
                        if st.rid not in step.planned:
                            self._schedule_running(st, step, now)
                    elif id(st) in was_running:
                        continue  # preempted earlier in this step's loop (swapped or back to waiting): not re-admitted now
                    elif not stop_admitting:
                        r = self._try_admit(st, step, now)
                        if r == _ADMITTED:
                            admitted.append(st)
                        elif r == _STOP:
                            stop_admitting = True
                if admitted:
                    self._drop_admitted(admitted, step)
                waiting_blocked_static = self.policy.order_is_static
        if step.displaced:  # back at the head of the queue, behind the requests they made room for
            self.waiting.extendleft(reversed(step.displaced))

        plan = step.plan
        if not plan:
            self.recorder.occupancy_change(self, now)
            self._check_progress(now)
            return None

        # time the step, or a fast-forwarded stretch of identical decode steps
        start = self._step_ready_s
        self._plan = plan
        if (self.options.fast_forward and not step.preempted and not self.swapped
                and len(plan) == len(running)
                and (not self.waiting or (waiting_blocked_static and self.shared_kv is None
                                          and not self.admission_preemption))
                and all(n == 1 and st.generated > 0 and st.computed == st.prompt_tokens + st.generated - 1
                        for st, n in (plan[n_decodes:] if n_decodes else plan))):  # the decodes are known
            end = self._plan_stretch(start, horizon_s)
        else:
            if n_decodes and not step.preempted:
                # the step's counters already hold the batch (no PNM with the decode fast path)
                end = self._plan_single_counted(start, step)
                self._single_decodes = n_decodes
            else:
                end = self._plan_single(start)
            if (self.stretch_through_finishes and end < horizon_s and self.options.fast_forward
                    and not step.preempted and not self.waiting and not self.swapped and not self.pending_events
                    and not self.pnm.capacity_blocks and len(plan) == len(running) <= self.budget):
                end = self._fold_into_stretch(start, end, horizon_s, n_decodes)
        self.busy = True
        self.recorder.occupancy_change(self, now, self.hbm.used_blocks - self._stretch_reserved,
                                       self.pnm.used_blocks - self._stretch_pnm_reserved)
        if self.options.check_invariants:
            self.check()
        return end

    def _prefill_slot_budget(self, now: float) -> int:
        """Per-prefill share of the token budget with several partial prefills.

        vLLM (``Scheduler._chunk_new_tokens_to_schedule`` with
        ``partial_prefill_budget_lookup_list``): with ``max_num_partial_prefills = k > 1`` and
        ``m`` prefills that could run, each prefill gets at most ``budget // min(m, k)`` tokens,
        so a long prompt cannot take the whole budget from short ones.
        """
        k = self.spec.max_num_partial_prefills
        if k <= 1 or not self.chunked:
            return self.budget
        m = sum(1 for st in self.running
                if st.status == RUNNING and st.ready_s <= now and st.prompt_tokens + st.generated - st.computed > 1)
        m += len(self.waiting) if (not self.swapped or self.admit_while_swapped) else 0
        return max(1, self.budget // max(1, min(m, k)))

    def _chunk(self, st: RequestState, to_compute: int, step: "_StepBuild") -> int:
        """Tokens a prefill may take this step: threshold, per-prefill slot, policy limit, budget."""
        n = to_compute
        if to_compute > 1 and n > step.prefill_slot:
            n = step.prefill_slot
        if self.long_threshold > 0 and n > self.long_threshold:
            n = self.long_threshold
        if to_compute > 1:
            lim = self.policy.chunk_limit(st.prompt_tokens, st.computed, step.n_tokens, step.attn2 / 2.0, step.kv_tokens)
            if lim is not None and n > lim:
                n = max(1, int(lim))
        if n > step.budget:
            n = step.budget
        return n

    def _partial_blocked(self, st: RequestState, leaves_partial: bool, step: "_StepBuild") -> bool:
        if not leaves_partial:
            return False
        if not self.chunked:
            return True  # an unchunked prefill runs whole or not at all
        if self.spec.max_num_partial_prefills <= 1:
            return False  # concurrent partial prefills are only limited when enabled (> 1)
        is_long = self.long_threshold > 0 and st.prompt_tokens > self.long_threshold
        return (step.partial >= self.spec.max_num_partial_prefills
                or (is_long and step.long_partial >= self.spec.max_long_partial_prefills))

    def _count(self, st: RequestState, n: int, leaves_partial: bool, step: "_StepBuild") -> None:
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
            if self.long_threshold > 0 and st.prompt_tokens > self.long_threshold:
                step.long_partial += 1

    def _schedule_running(self, st: RequestState, step: "_StepBuild", now: float) -> None:
        """Give a running request its tokens for this step, preempting others if KV runs out."""
        to_compute = st.prompt_tokens + st.generated - st.computed
        n = self._chunk(st, to_compute, step)
        if n <= 0:
            return
        leaves_partial = n < to_compute
        if self._partial_blocked(st, leaves_partial, step):
            return
        if st.on_pnm:  # PNM: its KV grows in the PNM pool; a full pool preempts it (recompute)
            need = self._blocks_for(st.computed + n) - st.pnm_blocks
            if need > 0 and not self.pnm.allocate(need):
                # frees no HBM, so unlike an HBM preemption it does not stop this step's admissions
                # (the request itself may be re-admitted at once)
                self._preempt_pnm_resident(st)
                return
            if need > 0:
                st.pnm_blocks += need
            self._count(st, n, leaves_partial, step)
            return
        need = self._blocks_for(st.computed + n) - st.shared_blocks - st.private_blocks
        if need < 0:
            need = 0
        if need > 0 and not self.hbm.allocate(need):
            step.preempted = True
            survived = self._make_room(st, need, now, step.plan, step.planned)
            step.budget = self.budget - sum(n_ for _, n_ in step.plan)
            if not survived:
                return  # st preempted itself
        st.private_blocks += need
        self._count(st, n, leaves_partial, step)

    def _schedule_decodes(self, running: list[RequestState], step: "_StepBuild", now: float) -> bool:
        """Fast path of the running loop when every running request is a ready decode.

        Gives each one token at once when the token budget covers them all and HBM has the new
        blocks they need (one allocation of the sum: evicts the same LRU segments as one
        allocation per request). Returns ``False`` without changing anything otherwise, and
        :meth:`schedule` then runs the request-by-request loop (which may preempt). Same plan,
        counters and blocks as that loop: a decode's chunk is 1 token, never partial.
        """
        n = len(running)
        if n > step.budget or self.pnm.capacity_blocks:  # PNM: the per-request loop knows PNM residents
            return False
        bs = self.bs
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
            if not self.hbm.allocate(need_total):
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

    def _resume_swapped(self, now: float) -> None:
        """Swap requests back in (oldest first) while HBM has room for their blocks."""
        while self.swapped and len(self.running) < self.spec.max_seqs:
            st = self.swapped[0]
            if not self.hbm.allocate(st.lower_blocks):
                break
            self.swapped.popleft()
            self._swap_in(st, now)
            self.running.append(st)

    def _fold_into_stretch(self, start: float, end1: float, horizon_s: float, n_decodes: int) -> float:
        """Fold a single step that completes prompts into the decode stretch that follows it.

        The single step ending at ``end1`` holds decodes (the plan's first ``n_decodes`` or
        more members) and, after them, fresh prefills that compute the rest of their prompt
        and so emit their first token at ``end1``. With nothing waiting or swapped, the plan in
        running order (the stretch's order one by one) and nothing outside this instance able
        to look at it before ``end1`` (``stretch_through_finishes``: one instance or
        round-robin look-ahead, no watched decision points, no shared KV tier; ``end1`` before
        the horizon), stepping one by one would end that step (finishing the decodes that emit
        their last token there) and plan, at ``end1``, a fast-forwarded decode stretch of the
        others. This plans that stretch now, with the step as its first step:

        * the prefills' first step is applied now (computed prompt, first token at ``end1``,
          prompt segments registered in the prefix cache): the same pool operations, in the
          same order, as at ``end1``;
        * the second step's KV blocks are allocated now as one allocation, as the decode fast
          path (:meth:`_schedule_decodes`) would at ``end1``; the fold is declined when they
          cannot be had (stepping one by one would then preempt);
        * :meth:`_plan_stretch` plans the rest from ``end1`` and the first step is prepended
          to its end times and occupancy.

        Decodes that finish at ``end1`` make it a stretch through completions in which they
        run the first step only (:meth:`_plan_stretch_through`'s form: ``_stretch_steps``):
        their KV is released at the stretch's end, in the order one by one releases it, and
        HBM in use from the second step on, and at ``end1``, is lower by what they free. One by
        one those frees come before the second step's allocation and may feed the LRU (the
        single free queue, unreferenced segments), so then every block of the stretch comes
        from never-cached free blocks, as in a stretch through completions (the fold is
        declined when the second step's cannot).

        :meth:`complete_step` advances the decodes over the whole stretch and the prefills
        (``_stretch_joined``) over its steps after the first. Results are byte-identical to
        stepping one by one (checked by ``kvsched.experiments.refcheck`` and the fast-forward
        tests). Returns the stretch's end time, or ``end1`` when the step is not folded.
        """
        plan = self._plan
        n = len(plan)
        bs = self.bs
        # the decode fast path's members: one token each at KV position prompt + generated - 1
        xs = [st.computed + 1 for st, _ in plan[:n_decodes]]  # KV tokens read in the second step
        rems = [st.output_tokens - st.generated - 1 for st, _ in plan[:n_decodes]]  # left after end1
        n_join = 0
        for st, m in plan[n_decodes:]:
            c = st.computed
            g = st.generated
            if st.status != RUNNING:
                return end1
            if g > 0 and m == 1 and c == st.prompt_tokens + g - 1:  # a decode the running loop planned
                if n_join:  # a decode after a prefill
                    return end1
                xs.append(c + 1)
                rems.append(st.output_tokens - g - 1)
            elif g == 0 and c + m == st.prompt_tokens and st.output_tokens >= 2:
                n_join += 1
                xs.append(c + m)
                rems.append(st.output_tokens - 1)
            else:
                return end1  # a partial prefill or a recomputation
        if not n_join:
            return end1
        done1 = min(rems) < 1  # a decode emits its last token at end1 (the prefills have >= 1 left)
        if any(p[0] is not r for p, r in zip(plan[n_decodes:], self.running[n_decodes:])):
            # one by one, the stretch planned at end1 runs in running (admission) order; a
            # stall-free policy plans the step's prefills after its decodes, in its own order,
            # and members finishing at one step would then free their blocks (LRU) in another order.
            # (The first n_decodes are the running list as the decode fast path planned it, and
            # no request left it since: a preempting step is not folded.)
            return end1
        hbm = self.hbm
        if done1:
            # decodes finishing at end1 (``done``, plan indices) run the stretch's first step
            # only; the others (``live``) continue from end1
            done = [i for i, r in enumerate(rems) if r < 1]
            live = [i for i, r in enumerate(rems) if r >= 1]
            live_plan = [plan[i] for i in live]
            xs = [xs[i] for i in live]
            rems = [rems[i] for i in live]
            # one by one they free their KV at end1 (plan order), before the second step
            # allocates: blocks released and the segment references left after that
            freed1 = 0
            seg_refs: dict[int, int] = {}
            for i in done:
                st = plan[i][0]
                freed1 += st.private_blocks + self._unreferenced_blocks(st, seg_refs)
        else:
            live, live_plan, freed1, seg_refs = None, plan, 0, None
        # the second step's blocks: ceil((x + 1) / bs) minus those held after the first step,
        # which are at least ceil(x / bs): only a member with x a multiple of bs can need one
        grow = [(st, x // bs + 1 - st.shared_blocks - st.private_blocks)
                for (st, _), x in zip(live_plan, xs) if x % bs == 0]
        need_total = sum([nb for _, nb in grow if nb > 0])
        # with frees at end1 the stretch allocates from never-cached free blocks only: then the
        # frees (which one by one come first, and may feed the LRU) cannot change what it evicts
        if need_total > (hbm.free_blocks if done1 else hbm.free_blocks + hbm.evictable_blocks):
            return end1
        # the prefills' first step, as complete_step applies it at end1
        for st, m in plan[n - n_join:]:
            st.computed += m
            if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= st.computed:
                self._register_segments(st, end1)
            st.generated = 1
            st.first_token_s = end1
            st.last_token_s = end1
        self._single_decodes = 0
        used1 = hbm.used_blocks
        self.busy_s += end1 - start  # the first step's busy time, added when stepping ends it
        if need_total:
            hbm.allocate(need_total)
            for st, nb in grow:
                if nb > 0:
                    st.private_blocks += nb
        # the others' stretch from end1, planned as one by one would plan it there (their plan
        # alone; the finished requests' blocks are still held, so HBM in use from step 2 on is
        # lower by ``freed1``), then the first step prepended
        self._plan = live_plan
        end = self._plan_stretch(end1, horizon_s, xs, rems, free_only=done1, seg_refs=seg_refs)
        self._plan = plan
        used = self._stretch_used - freed1 if freed1 else self._stretch_used
        self._stretch_used = np.concatenate(([used1], used))
        live_steps = self._stretch_steps
        if done1 or live_steps is not None:  # members run different numbers of steps
            end_used = used if self._stretch_end_used is None else self._stretch_end_used - freed1
            self._stretch_end_used = np.concatenate(([used1 - freed1], end_used))
            if done1:
                k_live = len(self._stretch_ends)
                steps = [1] * n  # those finishing at end1: the first step only
                for j, i in enumerate(live):
                    steps[i] = (live_steps[j] if live_steps is not None else k_live) + 1
            else:
                steps = [ki + 1 for ki in live_steps]
            self._stretch_steps = steps
        self._stretch_joined = n_join
        self.folded_steps += 1
        self._stretch_ends = np.concatenate(([end1], self._stretch_ends))
        self._stretch_reserved += need_total
        return end

    def _plan_single_counted(self, start: float, step: "_StepBuild") -> float:
        """:meth:`_plan_single` from the counters :meth:`_count` and :meth:`_schedule_decodes`
        kept while the step was built (the same integer sums: no request's computed tokens
        change between its counting and the plan, and no PNM resident is in the plan)."""
        dt = self.cost.step_time_fast(float(step.n_tokens), step.attn2 / 2.0, float(step.kv_tokens))
        return self._single_step_end(start, dt)

    def _plan_single(self, start: float) -> float:
        n_tokens = 0
        attn2 = 0  # twice the attention work: integers stay exact
        kv = 0
        n_pnm = 0
        kv_pnm = 0
        for st, n in self._plan:
            p = st.computed
            n_tokens += n
            if st.on_pnm:  # PNM: decode attention near memory
                n_pnm += 1
                kv_pnm += p
            elif n == 1 and st.generated > 0 and p == st.prompt_tokens + st.generated - 1:
                attn2 += 2 * p
                kv += p
            else:
                attn2 += n * (2 * p + n)
                kv += p + n
        if n_pnm:
            dt = self.cost.pnm_step_time_fast(float(n_tokens), attn2 / 2.0, float(kv), float(kv_pnm), float(n_pnm))
        else:
            dt = self.cost.step_time_fast(float(n_tokens), attn2 / 2.0, float(kv))
        return self._single_step_end(start, dt)

    def _single_step_end(self, start: float, dt: float) -> float:
        """End time of a single (not fast-forwarded) step of ``dt`` seconds from ``start``."""
        self._stretch_ends = None
        self._stretch_steps = None
        self._stretch_reserved = 0
        self._stretch_pnm_reserved = 0
        self._step_start = start
        return start + dt

    #: Longest stretch (bound) timed one step at a time in Python rather than with NumPy.
    _SCALAR_STEPS = 24

    @staticmethod
    def _extra_blocks(x: np.ndarray, j: np.ndarray, bs: int) -> np.ndarray:
        """Blocks requests at KV positions ``x`` allocate over ``j`` more decode steps (after step 1).

        After step 1's allocation request i holds ceil((x_i+1)/bs); after step k it needs
        ceil((x_i+k)/bs). Extra after j=k-1 more steps: floor((j + s_i)/bs) with
        s_i = x_i mod bs, summed over i.
        """
        s = x % bs
        counts = np.bincount(s, minlength=bs)
        suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])  # suffix[t] = #(s >= t)
        cnt_ge = np.zeros(bs, dtype=np.int64)
        cnt_ge[1:] = suffix[bs - np.arange(1, bs)]
        return len(x) * (j // bs) + cnt_ge[j % bs]

    def _plan_stretch(self, start: float, horizon_s: float, xs: list[int] | None = None,
                      rems: list[int] | None = None, free_only: bool = False,
                      seg_refs: dict[int, int] | None = None) -> float:
        """Plan a fast-forwarded stretch of decode steps of the whole plan from ``start``.

        ``xs`` (KV tokens each plan member reads in the stretch's first step) and ``rems``
        (output tokens each has left) default to the members' current state; a folded step
        (:meth:`_fold_into_stretch`) passes them as they stand after its first step. With
        ``free_only`` the stretch allocates only never-cached free blocks (no eviction);
        ``seg_refs`` maps prefix segments to their references left once requests released
        before the stretch (still holding them) are gone (default: their current references).
        """
        if self.pnm.capacity_blocks:  # PNM: the planner that knows PNM-resident decodes and migrations
            return self._plan_stretch_pnm(start, horizon_s)
        self._stretch_pnm_used = None
        self._stretch_pnm_reserved = 0
        plan = self._plan
        n = len(plan)
        self._stretch_steps = None
        self._stretch_end_used = None
        if xs is None:
            xs = [st.computed for st, _ in plan]  # KV tokens each request reads in step 1
            rems = [st.output_tokens - st.generated for st, _ in plan]
        k_rem = min(rems)
        s0 = sum(xs)
        # 1. step end times until the first request finishes or a step reaches the horizon
        ends = self._stretch_end_times(start, horizon_s, n, s0, k_rem)
        k = len(ends)
        if (k == k_rem and ends[-1] < horizon_s and self.stretch_through_finishes and not self.waiting
                and self.shared_kv is None and k_rem < max(rems)
                and self._growth_blocks(xs, k - 1) < self.hbm.free_blocks):
            end = self._plan_stretch_through(start, horizon_s, xs, rems, ends, seg_refs)
            if end is not None:
                return end
        # 2. KV blocks of steps 2..k. After step 1's allocation request i holds
        # ceil((x_i+1)/bs); after j more steps it needs floor((j + s_i)/bs) more, s_i = x_i mod bs.
        # Summed: extra(j) = n*(j // bs) + #(s_i >= bs - j mod bs). The stretch stops before the
        # step whose blocks the cache cannot give (or that would evict a blocked head's prefix).
        # Same result as limiting first and cutting at the horizon after: extra is monotone.
        bs = self.bs
        extra: list[int] = []
        if k > 1:
            counts = [0] * bs
            for c in xs:
                counts[c % bs] += 1
            cnt_ge = [0] * bs
            acc_ge = 0
            for t in range(1, bs):
                acc_ge += counts[bs - t]
                cnt_ge[t] = acc_ge
            extra = [n * (j // bs) + cnt_ge[j % bs] for j in range(1, k)]
            limit = self._stretch_block_limit(extra[-1])
            if free_only and limit > self.hbm.free_blocks:
                limit = self.hbm.free_blocks
            allowed = bisect_right(extra, limit)
            if allowed + 1 < k:
                k = allowed + 1
                del ends[k:]
        # allocate the blocks of steps 2..k now (nothing else allocates during the stretch)
        used0 = self.hbm.used_blocks
        self._stretch_used = np.array([used0] + [used0 + e for e in extra[:k - 1]], dtype=np.int64)
        total_new = extra[k - 2] if k > 1 else 0
        self._stretch_reserved = total_new
        if total_new:
            ok = self.hbm.allocate(total_new)
            assert ok, "stretch block reservation failed"
            km1 = k - 1
            for (st, _), c in zip(plan, xs):
                st.private_blocks += (c + km1) // bs - c // bs  # ceil((c+k)/bs) - ceil((c+1)/bs)
        self._stretch_ends = np.array(ends, dtype=np.float64)
        self._step_start = start
        return ends[-1]

    def _growth_blocks(self, xs: list[int], steps: int) -> int:
        """KV blocks requests at KV positions ``xs`` allocate over ``steps`` more decode steps."""
        bs = self.bs
        return sum([(c + steps) // bs - c // bs for c in xs])

    def _plan_stretch_through(self, start: float, horizon_s: float, xs: list[int], rems: list[int],
                              ends_first: list[float], seg_refs: dict[int, int] | None = None) -> float | None:
        """A decode stretch that continues through completions while nothing waits.

        One-by-one stepping would end the step in which a request emits its last token, free
        its KV, and (nothing waiting, nothing swapped, every other request a ready decode) plan
        the same decode batch without it. Here the batch shrinks inside the stretch instead: a
        request with ``r`` tokens left runs the stretch's first ``r`` steps and finishes at the
        end of step ``r`` (:meth:`complete_step` records that time). Step times use the same
        float additions in the same order (one :meth:`_stretch_end_times` call per batch size),
        so results are byte-identical to ending the stretch at each completion.

        The blocks of every step are allocated now, and only from never-cached free blocks: one
        by one, the frees of finished requests come between those allocations, so an allocation
        that evicted cached segments could evict different ones. Returns ``None`` (the caller
        plans the ordinary stretch up to the first completion) when the free blocks do not cover
        the growth, or when the horizon or ``ends_first`` already end the stretch.

        Args:
            start: start of the stretch's first step (s).
            horizon_s: as in :meth:`schedule`.
            xs: KV tokens each plan member reads in step 1 (plan order).
            rems: output tokens each plan member has left (plan order).
            ends_first: step end times up to the first completion (``min(rems)`` steps).
            seg_refs: as in :meth:`_plan_stretch` (not changed).
        """
        plan = self._plan
        bs = self.bs
        ends = list(ends_first)
        j = len(ends)  # steps planned so far
        # members by steps left: those from index ``p`` on still run in step j + 1
        by_rem = sorted(zip(rems, xs))
        n = len(by_rem)
        p = 0
        x_alive = sum(xs)  # their KV tokens in step 1
        while p < n and by_rem[p][0] <= j:
            x_alive -= by_rem[p][1]
            p += 1
        while p < n:
            nxt = by_rem[p][0]
            n_alive = n - p
            s0 = x_alive + j * n_alive  # KV tokens read in step j + 1
            seg = self._stretch_end_times(ends[-1], horizon_s, n_alive, s0, nxt - j)
            ends.extend(seg)
            j += len(seg)
            if j < nxt or seg[-1] >= horizon_s:
                break
            while p < n and by_rem[p][0] <= j:
                x_alive -= by_rem[p][1]
                p += 1
        k = j
        steps = [r if r < k else k for r in rems]  # steps each request runs
        # blocks each request allocates for its steps 2..k_i (step 1's are held already)
        new_blocks = [(x + ki - 1) // bs - x // bs for x, ki in zip(xs, steps)]
        total_new = sum(new_blocks)
        hbm = self.hbm
        if total_new > hbm.free_blocks:
            return None
        # HBM in use during each step and at each step end (after that step's frees): request i
        # holds (x_i + min(t, k_i - 1)) // bs - x_i // bs more blocks in step t + 1 than in
        # step 1, until it finishes and frees what it held (shared segments once unreferenced)
        x = np.array(xs, dtype=np.int64)
        t_idx = np.minimum(np.arange(k, dtype=np.int64), np.array(steps, dtype=np.int64)[:, None] - 1)
        grown = ((x[:, None] + t_idx) // bs).sum(axis=0) - int((x // bs).sum())
        freed_at = np.zeros(k + 1, dtype=np.int64)  # freed_at[t]: blocks freed at the end of step t
        seg_refs = {} if seg_refs is None else dict(seg_refs)
        early = sorted((ki, i) for i, ki in enumerate(steps) if ki < k)
        for ki, i in early:  # release order: by finish step, then plan order (as one by one)
            st = plan[i][0]
            freed_at[ki] += st.private_blocks + new_blocks[i] + self._unreferenced_blocks(st, seg_refs)
        used0 = hbm.used_blocks
        cum_freed = np.cumsum(freed_at[:k])  # blocks freed before step t + 1 (t = 0..k-1)
        used = used0 + grown - cum_freed
        if total_new:
            ok = hbm.allocate(total_new)
            assert ok, "stretch block reservation failed"
            for (st, _), nb in zip(plan, new_blocks):
                st.private_blocks += nb
        self._stretch_used = used
        self._stretch_end_used = used - freed_at[1:]
        self._stretch_reserved = total_new
        self._stretch_steps = steps
        self._stretch_ends = np.array(ends, dtype=np.float64)
        self._step_start = start
        return ends[-1]

    def _unreferenced_blocks(self, st: RequestState, seg_refs: dict[int, int]) -> int:
        """HBM blocks of the prefix segments ``st`` holds the last reference to, as if it were
        released now after the releases already counted in ``seg_refs`` (segment -> references
        left; updated with ``st``'s). Nothing is released."""
        freed = 0
        segments = self.hbm.segments
        for h in st.shared:
            left = seg_refs.get(h, segments[h].refs) - 1
            seg_refs[h] = left
            if left == 0:
                freed += segments[h].n_blocks
        return freed

    def _plan_stretch_pnm(self, start: float, horizon_s: float) -> float:
        """:meth:`_plan_stretch` on an instance with a PNM tier (NumPy form; PNM-resident decodes
        grow in the PNM pool, and the stretch stops before the policy's next migration)."""
        plan = self._plan
        n = len(plan)
        x = np.fromiter((st.computed for st, _ in plan), np.int64, count=n)  # KV tokens read in step 1
        remaining = np.fromiter((st.output_tokens - st.generated for st, _ in plan), np.int64, count=n)
        k_max = int(remaining.min())
        # PNM: PNM-resident decodes grow in the PNM pool and read their KV near memory
        on_pnm = (np.fromiter((st.on_pnm for st, _ in plan), bool, count=n)
                  if self.pnm.capacity_blocks else None)
        has_pnm = on_pnm is not None and bool(on_pnm.any())
        x_gpu = x[~on_pnm] if has_pnm else x
        bs = self.bs
        extra = extra_pnm = None
        if k_max > 1:
            j = np.arange(1, k_max, dtype=np.int64)
            extra = self._extra_blocks(x_gpu, j, bs)
            allowed = int(np.searchsorted(extra, self._stretch_block_limit(int(extra[-1])), side="right"))
            if has_pnm:  # PNM: the PNM pool must hold the PNM-resident decodes' growth
                extra_pnm = self._extra_blocks(x[on_pnm], j, bs)
                allowed = min(allowed, int(np.searchsorted(extra_pnm, self.pnm.available_blocks, side="right")))
            if self.pnm_policy and allowed > 0:
                # PNM: stop before the first step at which the policy would start a migration
                # (one-by-one stepping asks it at every step; byte-identical fast-forward)
                hbm_avail = self.hbm.available_blocks - np.concatenate([[0], extra[:allowed - 1]])
                free = int(self.policy.migration_free_steps(x_gpu + 1, hbm_avail, self.pnm.available_blocks,
                                                            self.hbm.capacity_blocks, bs))
                allowed = min(allowed, max(0, free))
            k_max = 1 + allowed
        ks = np.arange(k_max, dtype=np.int64)
        if has_pnm:  # PNM: GPU part without the PNM-resident decodes' attention, plus PNM attention
            s0 = int(x_gpu.sum())
            n_gpu = len(x_gpu)
            p0 = int(x[on_pnm].sum())
            n_p = n - n_gpu
            ctx = (s0 + n_gpu * ks).astype(np.float64)
            dts = self.cost.pnm_step_times_fast(np.full(k_max, float(n)), (2 * (s0 + n_gpu * ks)) / 2.0, ctx,
                                                (p0 + n_p * ks).astype(np.float64), np.full(k_max, float(n_p)))
        else:
            s0 = int(x.sum())
            ctx = (s0 + n * ks).astype(np.float64)
            dts = self.cost.step_times_fast(np.full(k_max, float(n)), (2 * (s0 + n * ks)) / 2.0, ctx)
        acc = np.empty(k_max + 1, dtype=np.float64)
        acc[0] = start
        acc[1:] = dts
        ends = np.cumsum(acc)[1:]
        if horizon_s < ends[-1]:
            k_max = int(np.searchsorted(ends, horizon_s, side="left")) + 1
            ends = ends[:k_max]
        k = k_max
        # allocate the blocks of steps 2..K now (nothing else allocates during the stretch)
        new_blocks = -(-(x + k) // bs) - (-(-(x + 1) // bs))
        total_new = int(new_blocks[~on_pnm].sum()) if has_pnm else int(new_blocks.sum())
        self._stretch_used = self._reserve_stretch(self.hbm, extra, k, total_new)  # HBM in use per step
        self._stretch_reserved = total_new
        self._stretch_pnm_used = None
        self._stretch_pnm_reserved = 0
        if has_pnm:  # PNM: same for the PNM pool
            pnm_new = int(new_blocks[on_pnm].sum())
            self._stretch_pnm_used = self._reserve_stretch(self.pnm, extra_pnm, k, pnm_new)
            self._stretch_pnm_reserved = pnm_new
        if total_new or has_pnm:
            for (st, _), nb in zip(plan, new_blocks.tolist()):
                if st.on_pnm:
                    st.pnm_blocks += nb
                else:
                    st.private_blocks += nb
        self._stretch_ends = ends
        self._step_start = start
        return float(ends[-1])

    @staticmethod
    def _reserve_stretch(pool: BlockPool, extra: np.ndarray | None, k: int, n_new: int) -> np.ndarray:
        """Allocate a stretch's ``n_new`` blocks in ``pool`` now; returns the blocks in use during
        each of its ``k`` steps (``extra[j-1]``: blocks added by step ``j+1``)."""
        used0 = pool.used_blocks
        used = np.empty(k, dtype=np.int64)
        used[0] = used0
        if k > 1:
            used[1:] = used0 + extra[:k - 1]
        if n_new:
            ok = pool.allocate(n_new)
            assert ok, f"stretch block reservation in {pool.name} failed"
        return used

    def _stretch_end_times(self, start: float, horizon_s: float, n: int, s0: int, k_rem: int) -> list[float]:
        """End times of up to ``k_rem`` decode steps of ``n`` requests reading ``s0`` KV tokens
        in the first step (one more each per step), from ``start``, stopping at the first step
        that ends at or after ``horizon_s``.

        Sequential float additions (as stepping one by one). Step times never decrease, so at
        most ``(horizon_s - start) / dt_1 + 1`` steps reach the horizon: when that bound (or
        ``k_rem``) is at most :attr:`_SCALAR_STEPS`, the steps are timed one by one in
        :meth:`CostModel.decode_step_ends` (:meth:`CostModel.step_time_fast`'s operations),
        otherwise in chunks with one
        :meth:`CostModel.decode_step_times_fast` call and a cumulative sum each (bitwise the
        same values).
        """
        nf = float(n)
        dt = self.cost.step_time_fast(nf, float(s0), float(s0))
        k_end = k_rem
        if horizon_s < math.inf and dt > 0.0:
            bound = (horizon_s - start) / dt + 3.0
            if bound < k_end:
                k_end = int(bound)
        if k_end <= self._SCALAR_STEPS:
            return self.cost.decode_step_ends(start, n, s0, k_rem, horizon_s)
        ends = []
        e = start
        k = 0
        decode_times = self.cost.decode_step_times_fast
        while True:  # normally one chunk: the bound holds up to float rounding
            ctxs = (s0 + n * np.arange(k, k_end, dtype=np.int64)).astype(np.float64)
            acc = np.empty(len(ctxs) + 1, dtype=np.float64)
            acc[0] = e
            acc[1:] = decode_times(nf, ctxs)
            more = np.cumsum(acc)[1:]
            if horizon_s <= more[-1]:
                ends.extend(more[:int(np.searchsorted(more, horizon_s, side="left")) + 1].tolist())
                return ends
            ends.extend(more.tolist())
            if k_end >= k_rem:
                return ends
            e = ends[-1]
            k = k_end
            k_end = min(k_rem, 2 * k_end)

    def _stretch_block_limit(self, wanted: int) -> int:
        """Blocks a stretch may allocate without changing the blocked waiting head's outcome.

        While a waiting request is blocked on KV, allocations only shrink what is available,
        so it stays blocked -- unless an eviction removes one of its own cached prefix
        segments (its hit shrinks, and with it the blocks it needs). The stretch therefore
        stops before evicting the first such segment in LRU order.
        """
        hbm = self.hbm
        protect = self._blocked_hit_hashes
        if not protect:
            return hbm.available_blocks
        protected = set(protect)
        limit = hbm.free_blocks
        for h, nb in hbm._lru.items():
            if h in protected or limit >= wanted:
                break
            limit += nb
        return limit

    # ------------------------------------------------------------------------------ admission
    def _admit_in_order(self, cands: list, step: "_StepBuild", now: float, keep_queue_order: bool) -> None:
        """Admit waiting requests in the given order until budget, seats or KV run out."""
        admitted: list[RequestState] = []
        for st in cands:
            if step.budget <= 0 or len(self.running) >= self.spec.max_seqs:
                break
            r = self._try_admit(st, step, now)
            if r == _ADMITTED:
                admitted.append(st)
            elif r == _STOP:
                break
        if admitted:
            if keep_queue_order and all(a is b for a, b in zip(admitted, self.waiting)):
                for _ in admitted:
                    self.waiting.popleft()
            else:
                self._drop_admitted(admitted, step)

    def _drop_admitted(self, admitted: list[RequestState], step: "_StepBuild") -> None:
        """Take this step's admitted requests out of the waiting queue.

        One that was preempted again later in the same step (recompute puts it back at the queue
        head) stays there once; admission-preemption victims come back via ``step.displaced``.
        """
        gone = {id(a) for a in admitted}
        shown = {id(d) for d in step.displaced}
        requeued = [a for a in admitted if a.status == WAITING and id(a) not in shown]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        if requeued:
            self.waiting.extendleft(reversed(requeued))

    def _try_admit(self, st: RequestState, step: "_StepBuild", now: float) -> int:
        """Try to give a waiting request cache residency and its first chunk.

        Returns ``_ADMITTED``, ``_SKIP`` (not now; later requests may go) or ``_STOP``
        (allocation failed: vLLM stops admitting, head-of-line).
        """
        if len(self.running) >= self.spec.max_seqs or step.budget <= 0:
            return _STOP
        hbm = self.hbm
        total_tokens = st.prompt_tokens + st.generated
        # prefix-cache lookup: full cached segments, leaving >= 1 token to compute
        hit = 0
        if st.n_cacheable_segments and hbm.prefix_caching:
            max_seg = min(st.n_cacheable_segments, (total_tokens - 1) // st.seg_tokens)
            hit = hbm.cached_prefix_segments(st.hashes, max_seg)
            if self.shared_kv is not None and self.shared_kv.try_fetch_admit(self, st, hit, max_seg, now):
                return _ADMITTED  # the rest of the prefix comes from the cluster KV tier
        hit_tokens = hit * st.seg_tokens
        to_compute = total_tokens - hit_tokens
        st_computed = st.computed
        st.computed = hit_tokens  # chunk_limit sees the tokens already cached
        n = self._chunk(st, to_compute, step)
        st.computed = st_computed
        if n <= 0:
            return _STOP
        leaves_partial = n < to_compute
        if self._partial_blocked(st, leaves_partial, step):
            return _SKIP
        hit_hashes = st.hashes[:hit]
        hit_blocks = hit * (st.seg_tokens // self.bs) if hit else 0
        evictable_hit = sum(hbm.segments[h].n_blocks for h in hit_hashes if hbm.segments[h].refs == 0)
        need = self._blocks_for(hit_tokens + n) - hit_blocks
        if need > hbm.available_blocks - evictable_hit:
            if self.admission_preemption and self._preempt_for_admission(st, n, evictable_hit, step, now):
                # the victim may have released segments of this request's own hit: they are
                # evictable now, but it pins them, so they are no room for it
                evictable_hit = sum(hbm.segments[h].n_blocks for h in hit_hashes if hbm.segments[h].refs == 0)
            if need > hbm.available_blocks - evictable_hit:
                self._blocked_hit_hashes = hit_hashes
                return _STOP
        first_admission = st.admissions == 0
        for h in hit_hashes:
            seg_creator = hbm.segments[h].creator_id
            hbm.acquire_segment(h)
            # reuse across requests counts once, at first admission; what a preempted
            # request finds again when it returns is its own work restored, not a hit
            if first_admission and seg_creator != st.rid:
                st.prefix_hit_tokens += st.seg_tokens
            else:
                st.self_hit_tokens += st.seg_tokens
        hbm.allocate(need)
        self._take_residency(st, hit_hashes, hit_blocks, need, hit, hit_tokens, now)
        self._count(st, n, leaves_partial, step)
        return _ADMITTED

    def _take_residency(self, st: RequestState, hit_hashes, shared_blocks: int, private_blocks: int, next_seg: int,
                        computed_tokens: int, now: float) -> None:
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
        self.running.append(st)

    # ----------------------------------------------------------------------------- preemption
    def _make_room(self, st: RequestState, need: int, now: float, plan: list, planned: set) -> bool:
        """Preempt victims until ``need`` blocks can be allocated for ``st``.

        Returns ``False`` when ``st`` itself was preempted, or when it waits: requests whose
        blocks are still being copied in are not chosen while others exist, and when ``st`` is
        the only other one it skips this step instead of preempting itself. vLLM swaps in
        synchronously, so the request being swapped in would be the newest running request
        and its victim; preempting ``st`` instead let two requests swap each other out and in
        forever (a livelock the fold breaker found with LARS, swap and a small HBM).
        """
        while True:
            # PNM: requests on PNM (or moving there) hold no HBM that preempting them would free
            in_hbm = [r for r in self.running if not (r.on_pnm or r.pnm_migrating)]
            candidates = [r for r in in_hbm if r.ready_s <= now]
            if len(candidates) == 1 and candidates[0] is st and len(in_hbm) > 1:
                return False  # another is being copied in: wait for it to land (the step goes on without st)
            candidates = candidates or in_hbm
            table = FeatureTable(candidates, now, self.options.oracle_lengths)
            row, mode = self.policy.choose_preemption(table, self._preemption_costs(candidates),
                                                      self.spec.preemption_mode)
            victim = candidates[row]
            if victim.rid in planned:
                for k, (s_, _) in enumerate(plan):
                    if s_ is victim:
                        del plan[k]
                        break
                planned.discard(victim.rid)
            self._preempt(victim, now, mode)
            if victim is st:
                return False
            if self.hbm.allocate(need):
                return True

    def _preempt_for_admission(self, head: RequestState, head_chunk: int, evictable_hit: int,
                               step: "_StepBuild", now: float) -> bool:
        """Ask the policy whether blocked ``head`` may preempt a running request; do it if so.

        Candidates: running requests in HBM and not loading (nor on PNM), preempted this way
        fewer than ``max_admission_preemptions`` times, longer (prompt + generated tokens) than the
        head and at least ``admission_victim_min_tokens`` long. The policy sees the head (whose
        chunk this step is ``head_chunk`` tokens) and the waiting requests behind it that the
        step's remaining token budget could still admit. A victim planned in this step
        leaves the plan. A victim that goes back to waiting (recompute) re-enters the queue head
        after this step's admissions, so the requests it made room for go first.

        Returns whether one was preempted. Raises ``ValueError`` if the policy names a row that
        is not eligible.
        """
        running = self.running
        params = self.policy.params
        limit = params.max_admission_preemptions
        head_len = max(head.prompt_tokens + head.generated, params.admission_victim_min_tokens - 1)
        eligible = np.fromiter(
            (r.status == RUNNING and r.ready_s <= now and not (r.on_pnm or r.pnm_migrating) and not r.lower_blocks
             and r.admission_preemptions < limit and r.prompt_tokens + r.generated > head_len
             for r in running), bool, count=len(running))
        if not eligible.any():
            return False
        hbm = self.hbm
        # a victim frees at most the blocks it holds: if none could make room for the head's
        # prompt, the policy's answer is no (the gate requires that room) -- skip the work
        head_blocks = self._blocks_for(head.prompt_tokens + head.generated + 1)
        room = hbm.available_blocks - evictable_hit
        if not any(ok and r.shared_blocks + r.private_blocks + room >= head_blocks
                   for ok, r in zip(eligible.tolist(), running)):
            return False
        freed = np.fromiter((r.private_blocks + sum(hbm.segments[h].n_blocks for h in r.shared
                                                    if hbm.segments[h].refs == 1) for r in running),
                            np.int64, count=len(running))
        queue = step.admission_order
        k0 = next((i for i, c in enumerate(queue) if c is head), None)
        waiting_states = [head]
        # only those this step can still admit count: the head takes its chunk, the others the
        # token budget left (a later one would wait behind the victim, which re-enters the queue
        # head or, swapped, closes admission until it returns)
        budget = step.budget - head_chunk
        for c in (queue[k0 + 1:] if k0 is not None else ()):
            if budget <= 0 or len(waiting_states) >= self.spec.max_seqs:
                break
            if c.status != WAITING:
                continue
            tokens = c.prompt_tokens + c.generated
            if not self.chunked and tokens > budget:
                break
            waiting_states.append(c)
            budget -= min(tokens, step.prefill_slot, self.long_threshold or tokens)
        waiting_blocks = np.fromiter((self._blocks_for(c.prompt_tokens + c.generated + 1) for c in waiting_states),
                                     np.int64, count=len(waiting_states))
        costs = self._preemption_costs(running)
        costs.pop("migrate", None)
        oracle = self.options.oracle_lengths
        choice = self.policy.choose_admission_preemption(
            FeatureTable(running, now, oracle), eligible, freed, FeatureTable(waiting_states, now, oracle),
            waiting_blocks, hbm.available_blocks - evictable_hit, self.spec.max_seqs - len(running), costs,
            self.spec.preemption_mode)
        if choice is None:
            return False
        row, mode = choice
        if not (0 <= row < len(running)) or not eligible[row]:
            raise ValueError(f"policy {self.policy.name!r} chose row {row} for admission preemption; "
                             f"allowed: eligible rows {np.flatnonzero(eligible).tolist()}")
        victim = running[row]
        if victim.rid in step.planned:
            for k, (s_, _) in enumerate(step.plan):
                if s_ is victim:
                    del step.plan[k]
                    break
            step.planned.discard(victim.rid)
            self._recount(step)
        victim.admission_preemptions += 1
        self.admission_preemptions += 1
        step.preempted = True
        self._preempt(victim, now, mode)
        if victim.status == WAITING:  # recompute: not re-admitted before the requests it made room for
            self.waiting.remove(victim)
            step.displaced.append(victim)
        return True

    def _recount(self, step: "_StepBuild") -> None:
        """Recompute a step's budget and batch counters from its plan (after a victim left it)."""
        plan = step.plan
        step.plan, step.planned = [], set()
        step.budget = self.budget
        step.partial = step.long_partial = step.n_tokens = step.attn2 = step.kv_tokens = 0
        for st, n in plan:
            to_compute = st.prompt_tokens + st.generated - st.computed
            self._count(st, n, n < to_compute, step)

    def _preemption_costs(self, candidates: list[RequestState]) -> dict[str, np.ndarray]:
        """Seconds each preemption mode would cost each candidate (REFERENCE.md §5.4).

        recompute: predicted prefill of the tokens it holds; swap: PCIe out and back in;
        offload: PCIe plus NVMe write and read; migrate (PNM tier only): the one-way copy over the
        GPU<->PNM link of a decoding request, which is never reloaded (it decodes near memory,
        REFERENCE §3.2). ``inf`` where the lower tier has no room (or, for migrate, for a request
        still in prefill: only decode attention runs near memory).
        """
        blocks = np.fromiter((c.shared_blocks + c.private_blocks for c in candidates), np.int64,
                             count=len(candidates))
        tokens = np.fromiter((c.computed for c in candidates), np.int64, count=len(candidates))
        costs = {"recompute": np.asarray(self.cost.prefill_time_s(tokens), dtype=np.float64)}
        pcie = 2.0 * (self.spec.pcie.latency_s + blocks * self.cost.kv_bytes_per_token_per_gpu * self.bs
                      / self.spec.pcie.bytes_per_s)
        if self.dram.capacity_blocks:
            costs["swap"] = np.where(blocks <= self.dram.available_blocks, pcie, np.inf)
        if self.nvme.capacity_blocks:
            nv = (pcie + self.spec.nvme_write.latency_s + self.spec.nvme_read.latency_s
                  + blocks * self.cost.kv_bytes_per_token_per_gpu * self.bs
                  * (1.0 / self.spec.nvme_write.bytes_per_s + 1.0 / self.spec.nvme_read.bytes_per_s))
            costs["offload"] = np.where(blocks <= self.nvme.available_blocks, nv, np.inf)
        if self.pnm.capacity_blocks:  # PNM: one-way copy over the PNM link; decodes only (§3.2)
            decoding = np.fromiter((c.generated > 0 and c.computed == c.prompt_tokens + c.generated - 1
                                    for c in candidates), bool, count=len(candidates))
            need = -(-tokens // self.bs)
            room = -(-(tokens + 1) // self.bs)  # as _migrate_to_pnm: its next token must fit too
            link = self.spec.pnm.link
            mig = link.latency_s + need * self.cost.kv_bytes_per_token_per_gpu * self.bs / link.bytes_per_s
            costs["migrate"] = np.where(decoding & (need >= 1) & (room <= self.pnm.available_blocks), mig, np.inf)
        return costs

    def _preempt(self, victim: RequestState, now: float, mode: str | None = None) -> None:
        """Preempt ``victim`` by swap (DRAM), offload (NVMe) or recompute.

        ``mode`` defaults to the spec's ``preemption_mode``. Swap/offload copy its blocks
        device-to-host over PCIe before the step runs (vLLM V0 swaps out synchronously); when
        the target tier is full, swap falls back to NVMe, then to recompute. Source:
        REFERENCE.md §4.1 and §5.4. Mode ``"migrate"`` moves it to the PNM tier instead (it stays
        running; :meth:`_migrate_to_pnm`).
        """
        if mode == "migrate":  # PNM
            victim.preemptions += 1
            self.preemptions += 1
            self._migrate_to_pnm(victim, now, background=False)
            return
        self.running.remove(victim)
        if victim.lower_blocks:
            # preempted while its swap-in copy is in flight (its lower-tier blocks are freed only
            # when the copy lands): that lower-tier copy is intact and current (a loading request
            # runs no step), so it goes back to swapped with no copy out, whatever the mode, and
            # the landing event becomes stale (complete_transfer ignores it)
            victim.preemptions += 1
            self.preemptions += 1
            self._release_hbm(victim)
            victim.swap_in_end_s = -1.0
            victim.ready_s = now
            victim.tier = victim.lower_tier
            victim.status = SWAPPED
            self.swapped.append(victim)
            return
        excess = victim.shared_blocks + victim.private_blocks - self._blocks_for(victim.computed)
        if excess > 0 and victim.private_blocks >= excess:  # blocks allocated for a step it loses
            self.hbm.release_private(excess)
            victim.private_blocks -= excess
        victim.preemptions += 1
        self.preemptions += 1
        n_blocks = victim.shared_blocks + victim.private_blocks
        mode = mode or self.spec.preemption_mode
        target = ""
        if mode == "swap" and n_blocks and self.dram.allocate(n_blocks):
            target = "dram"
        elif mode in ("swap", "offload") and n_blocks and self.nvme.capacity_blocks and self.nvme.allocate(n_blocks):
            target = "nvme"
        self._release_hbm(victim)
        if target:
            nbytes = n_blocks * self.block_bytes
            t = self.cost.transfer_time_s(n_blocks, self.spec.pcie)
            _, end = self.links["pcie_d2h"].reserve(now, t, nbytes)
            if end > self._step_ready_s:
                self._step_ready_s = end  # the step waits for the swap-out copy
            victim.ready_s = end  # its copy is complete (in DRAM) from here on
            if target == "nvme":
                tw = self.cost.transfer_time_s(n_blocks, self.spec.nvme_write)
                _, victim.ready_s = self.links["nvme_write"].reserve(end, tw, nbytes)
                victim.bytes_hbm_to_nvme += nbytes
            else:
                victim.bytes_hbm_to_dram += nbytes
            victim.lower_tier = target
            victim.lower_blocks = n_blocks
            victim.tier = target
            victim.status = SWAPPED
            self.swapped.append(victim)
        else:
            victim.lost_tokens = victim.computed
            victim.computed = 0
            victim.next_seg = 0
            victim.status = WAITING
            self.waiting.appendleft(victim)

    def _swap_in(self, st: RequestState, now: float) -> None:
        """Copy a swapped request's blocks back to HBM (already allocated there).

        Reload on demand (default, vLLM V0 ``swap_in`` before the model runs): the step waits
        for the copy. With ``prefetch`` the copy runs behind the steps and only this request
        waits for it.
        """
        n_blocks = st.lower_blocks
        nbytes = n_blocks * self.block_bytes
        ready = now if now > st.ready_s else st.ready_s  # the swap-out copy must have landed
        if st.lower_tier == "nvme":
            tr = self.cost.transfer_time_s(n_blocks, self.spec.nvme_read)
            _, ready = self.links["nvme_read"].reserve(ready, tr, nbytes)
            st.bytes_nvme_to_hbm += nbytes
        else:
            st.bytes_dram_to_hbm += nbytes
        t = self.cost.transfer_time_s(n_blocks, self.spec.pcie)
        _, end = self.links["pcie_h2d"].reserve(ready, t, nbytes)
        st.private_blocks = n_blocks
        st.shared = []
        st.shared_blocks = 0
        st.next_seg = st.n_cacheable_segments  # swapped-in blocks are private copies
        st.ready_s = end
        st.swap_in_end_s = end
        st.status = RUNNING
        st.tier = "hbm"
        if not self.prefetch and end > self._step_ready_s:
            self._step_ready_s = end  # the whole step waits for the reload
        self.pending_events.append((end, TRANSFER_EVENT, st))

    def complete_transfer(self, st: RequestState, now: float) -> None:
        """A swap-in copy landed: free the request's lower-tier blocks. A background GPU->PNM
        migration landed: the request now decodes on PNM; free its HBM blocks."""
        if st.pnm_migrating:  # PNM
            st.pnm_migrating = False
            st.on_pnm = True
            st.tier = "pnm"
            self._release_hbm(st)
            self.recorder.occupancy_change(self, now)
            return
        if st.lower_blocks:
            if st.status != RUNNING or now != st.swap_in_end_s:
                return  # stale: preempted again while loading (see _preempt)
            st.swap_in_end_s = -1.0
            self.pools[st.lower_tier].release_private(st.lower_blocks)
            st.lower_blocks = 0
            st.lower_tier = ""
            self.recorder.occupancy_change(self, now)

    # ------------------------------------------------------------------------------------ PNM
    def _choose_migrations(self, now: float) -> None:
        """PNM: ask the policy which GPU-resident decodes to move to PNM now, and start the copies.

        Candidates: running, ready (KV in HBM), decoding (prefill done), not on PNM. The policy
        sees them as a FeatureTable plus the free HBM and PNM blocks (REFERENCE §3.2 triggers);
        copies start in its order while the PNM pool has room.
        """
        cands = [st for st in self.running
                 if st.status == RUNNING and st.ready_s <= now and not st.on_pnm and not st.pnm_migrating
                 and st.generated > 0 and st.computed == st.prompt_tokens + st.generated - 1]
        if not cands:
            return
        rows = self.policy.choose_migrations(FeatureTable(cands, now, self.options.oracle_lengths),
                                             self.hbm.available_blocks, self.hbm.capacity_blocks,
                                             self.pnm.available_blocks)
        if rows is None:
            return
        for r in rows:
            if not self._migrate_to_pnm(cands[int(r)], now, background=True):
                break

    def _migrate_to_pnm(self, st: RequestState, now: float, background: bool) -> bool:
        """PNM: copy ``st``'s KV GPU->PNM over the PNM link (DMA, no CPU on the path, §3.2).

        ``background`` (policy migration): ``st`` keeps its HBM blocks and does not decode until
        the copy lands (``complete_transfer`` frees them). Otherwise (preemption mode
        ``"migrate"``): its HBM blocks are freed now and the step waits for the copy, as a V0
        swap-out. Time: ``link.latency_s + per-rank bytes / link.bytes_per_s``, queued FIFO on
        the instance's PNM link. Returns ``False`` (nothing changed) when the PNM pool is full.
        """
        n_blocks = self._blocks_for(st.computed)
        # the pool must also hold its next token, else it is preempted there before emitting one
        if n_blocks < 1 or self.pnm.available_blocks < self._blocks_for(st.computed + 1) \
                or not self.pnm.allocate(n_blocks):
            return False
        nbytes = n_blocks * self.block_bytes
        t = self.cost.transfer_time_s(n_blocks, self.spec.pnm.link)
        _, end = self.links["pnm_link"].reserve(now, t, nbytes)
        st.bytes_hbm_to_pnm += nbytes
        st.pnm_blocks = n_blocks
        st.ready_s = end
        self.pnm_migrations += 1
        if background:
            st.pnm_migrating = True
            self.pending_events.append((end, TRANSFER_EVENT, st))
        else:
            self._release_hbm(st)
            st.on_pnm = True
            st.tier = "pnm"
            if end > self._step_ready_s:
                self._step_ready_s = end  # the step waits for the copy (its HBM blocks are reused)
        return True

    def _preempt_pnm_resident(self, st: RequestState) -> None:
        """PNM: the PNM pool cannot hold ``st``'s next token: recompute preemption (back to waiting,
        its KV dropped), as vLLM V1 preempts when its own pool is full (REFERENCE §4.1)."""
        self.running.remove(st)
        self._release_pnm(st)
        st.preemptions += 1
        self.preemptions += 1
        st.lost_tokens = st.computed
        st.computed = 0
        st.next_seg = 0
        st.status = WAITING
        self.waiting.appendleft(st)

    def _release_pnm(self, st: RequestState) -> None:
        """PNM: free ``st``'s PNM blocks; it is GPU-resident again (if it runs again)."""
        if st.pnm_blocks:
            self.pnm.release_private(st.pnm_blocks)
        st.pnm_blocks = 0
        st.on_pnm = False
        st.pnm_migrating = False
        st.tier = "hbm"

    def _release_hbm(self, st: RequestState) -> None:
        if self.hbm.single_free_queue:
            # vLLM V1 frees a request's blocks in reverse order (tail first): its private
            # (decode / partial) blocks age oldest, its root prefix segment youngest
            if st.private_blocks:
                self.hbm.release_private(st.private_blocks)
            for h in reversed(st.shared):
                self.hbm.release_segment(h)
            st.shared = []
            st.shared_blocks = 0
            st.private_blocks = 0
            return
        for h in st.shared:
            self.hbm.release_segment(h)
        if st.private_blocks:
            self.hbm.release_private(st.private_blocks)
        st.shared = []
        st.shared_blocks = 0
        st.private_blocks = 0

    def _check_progress(self, now: float) -> None:
        """Guard against a stuck instance: work queued but nothing runnable or in flight."""
        if self.running or not (self.waiting or self.swapped):
            return
        raise RuntimeError(
            f"instance {self.instance_id} cannot make progress at t={now:.6f}s: "
            f"{len(self.waiting)} waiting, {len(self.swapped)} swapped, HBM free "
            f"{self.hbm.available_blocks}/{self.hbm.capacity_blocks} blocks")

    # ------------------------------------------------------------------------------ step end
    def complete_step(self, now: float) -> None:
        """Apply the planned step (or stretch) that ends at ``now``."""
        self.busy = False
        rec = self.recorder
        plan = self._plan
        self._plan = []
        self.busy_s += now - self._step_start
        finished: list[RequestState] = []
        if self._stretch_ends is not None:
            ends = self._stretch_ends
            k = len(ends)
            self.steps += k
            self.stretches += 1
            self.stretch_steps += k
            self.sum_batch += k * len(plan)
            gaps = ends[1:] - ends[:-1]  # np.diff, without its overhead on short arrays
            max_gap = float(gaps.max()) if k > 1 else -1.0
            first_end = float(ends[0])
            steps = self._stretch_steps
            n_join = self._stretch_joined  # a folded stretch: its last n_join members joined at ends[0]
            self._stretch_joined = 0
            if steps is not None:  # a stretch through completions: some ran fewer steps
                self.sum_batch += sum(steps) - k * len(plan)
                early = self._finish_early(plan, steps, ends, gaps, n_join)
                plan = [p for p, ki in zip(plan, steps) if ki == k]
                if n_join:
                    n_join = sum(1 for ki in steps[len(steps) - n_join:] if ki == k)
            if n_join:  # steps 2..k for the joined: first gap ends[1] - ends[0], then gaps[1:]
                cut = len(plan) - n_join
                joined = plan[cut:]
                self._advance_members(plan[:cut], first_end, k, gaps, max_gap, now, finished)
                self._advance_members(joined, float(ends[1]), k - 1, gaps[1:],
                                      float(gaps[1:].max()) if k > 2 else -1.0, now, finished)
            else:
                self._advance_members(plan, first_end, k, gaps, max_gap, now, finished)
            rec.occupancy.stretch(self.instance_id, ends, self._stretch_used, self._stretch_pnm_used,
                                  self._stretch_end_used if steps is not None else None)
            if steps is not None:
                finished = early + finished
                self._stretch_steps = None
                self._stretch_end_used = None
            self._stretch_ends = None
        else:
            self.steps += 1
            self.sum_batch += len(plan)
            gap_vals: tuple[list[float], list[float]] = ([], [])  # per length class
            nd = self._single_decodes
            if nd:  # decodes known at planning (1 token at KV position prompt + generated - 1)
                self._single_decodes = 0
                for st, _ in plan[:nd]:
                    if st.status != RUNNING:
                        continue
                    c = st.computed + 1
                    st.computed = c
                    if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= c:
                        self._register_segments(st, now)
                    gen = st.generated + 1
                    st.generated = gen
                    g = now - st.last_token_s
                    gap_vals[st.length_class].append(g)
                    if not (st.max_itl_s >= g):
                        st.max_itl_s = g
                    st.last_token_s = now
                    if gen >= st.output_tokens:
                        finished.append(st)
                plan = plan[nd:]
            for st, n in plan:
                if st.status != RUNNING:
                    continue
                st.computed += n
                # register newly completed prefix segments in the prefix cache
                if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= st.computed:
                    self._register_segments(st, now)
                if st.computed == st.prompt_tokens + st.generated:
                    st.generated += 1
                    if st.generated == 1:
                        st.first_token_s = now
                    else:
                        g = now - st.last_token_s
                        gap_vals[st.length_class].append(g)
                        if not (st.max_itl_s >= g):
                            st.max_itl_s = g
                    st.last_token_s = now
                    if st.generated >= st.output_tokens:
                        finished.append(st)
            if gap_vals[0] or gap_vals[1]:
                rec.add_itl_by_class(gap_vals, None)
        for st in finished:
            self.running.remove(st)
            self._release_hbm(st)
            if st.pnm_blocks:  # PNM
                self._release_pnm(st)
            st.status = FINISHED
            st.finish_s = st.last_token_s  # = now, or earlier inside a stretch through completions
            rec.record(st)
            self.policy.on_request_finished(st.finish_s, st.arrival_s, st.first_token_s, st.prompt_tokens,
                                            st.generated)
            if self.admission_preemption:
                self.policy.output_history.add(st.generated)
        rec.occupancy_change(self, now)
        if self.options.check_invariants:
            self.check()

    def _advance_members(self, members: list, first_end: float, k: int, shared_gaps: np.ndarray, max_shared: float,
                         now: float, finished: list) -> None:
        """Advance stretch members that ran its last ``k`` steps (the first ending at
        ``first_end``, the last at ``now``) by ``k`` tokens each: their gap to ``first_end``
        and ``shared_gaps`` (shape ``(k - 1,)``, largest ``max_shared``, -1.0 when empty) go
        to the ITL histograms and their max ITL; those done join ``finished`` (plan order)."""
        first_gaps: tuple[list[float], list[float]] = ([], [])  # per length class, plan order
        for st, _ in members:
            g = first_end - st.last_token_s
            first_gaps[st.length_class].append(g)
            m = g if g > max_shared else max_shared
            if not (st.max_itl_s >= m):
                st.max_itl_s = m
            st.computed += k
            gen = st.generated + k
            st.generated = gen
            st.last_token_s = now
            if gen >= st.output_tokens:
                finished.append(st)
        self.recorder.add_itl_by_class(first_gaps, shared_gaps)

    def _finish_early(self, plan: list, steps: list[int], ends: np.ndarray, gaps: np.ndarray,
                      n_join: int = 0) -> list[RequestState]:
        """Advance the requests of a stretch through completions that finished before its last
        step (``steps[i] < len(ends)`` steps each, ending at ``ends[steps[i] - 1]``); returns
        them in the order one-by-one stepping finishes them (by finish step, then plan order).
        The last ``n_join`` members of a folded stretch joined at ``ends[0]`` (their first step
        is applied): they advance over steps 2..``steps[i]`` only."""
        k = len(ends)
        run_max = np.maximum.accumulate(gaps).tolist() if k > 1 else []
        ends_l = ends.tolist()
        early: list[tuple[int, int, RequestState]] = []
        rec = self.recorder
        cut = len(plan) - n_join
        for idx, ((st, _), ki) in enumerate(zip(plan, steps)):
            if ki == k:
                continue
            o = 1 if idx >= cut else 0  # the member's first step in this stretch (0-based)
            g = ends_l[o] - st.last_token_s
            max_gap = run_max[ki - 2] if ki > 1 + o else -1.0
            m = g if g > max_gap else max_gap
            if not (st.max_itl_s >= m):
                st.max_itl_s = m
            cls_gaps: tuple[list[float], list[float]] = ([], [])
            cls_gaps[st.length_class].append(g)
            rec.add_itl_by_class(cls_gaps, gaps[o:ki - 1] if ki > 1 + o else None)
            st.computed += ki - o
            st.generated += ki - o
            st.last_token_s = ends_l[ki - 1]
            early.append((ki, idx, st))
        early.sort(key=lambda e: (e[0], e[1]))
        return [st for _, _, st in early]

    def _register_segments(self, st: RequestState, now: float) -> None:
        seg_blocks = st.seg_tokens // self.bs
        while st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= st.computed:
            h = st.hashes[st.next_seg]
            if st.private_blocks >= seg_blocks and self.hbm.register_segment(h, seg_blocks, st.rid):
                st.private_blocks -= seg_blocks
                st.shared.append(h)
                st.shared_blocks += seg_blocks
                if self.shared_kv is not None:  # write-through to the cluster KV tier
                    self.shared_kv.publish(self, h, seg_blocks, st.rid, now)
            st.next_seg += 1

    # ---------------------------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify block conservation per tier (PNM included) and that holdings add up (tests, debugging)."""
        for pool in self.pools.values():
            pool.check()
        seg_used = sum(seg.n_blocks for seg in self.hbm.segments.values() if seg.refs > 0)
        private = sum(s.private_blocks for s in self.running)
        if private + seg_used != self.hbm.used_blocks:
            raise AssertionError(f"HBM used {self.hbm.used_blocks} != private {private} + "
                                 f"referenced segments {seg_used}")
        refs = sum(seg.refs for seg in self.hbm.segments.values())
        if refs != sum(len(s.shared) for s in self.running):
            raise AssertionError("segment reference counts do not match holders")
        lower = {"dram": 0, "nvme": 0}
        for s in list(self.running) + list(self.swapped):
            if s.lower_blocks:
                lower[s.lower_tier] += s.lower_blocks
        for t in ("dram", "nvme"):
            if lower[t] != self.pools[t].used_blocks:
                raise AssertionError(f"{t} used {self.pools[t].used_blocks} != held {lower[t]}")
        pnm_held = sum(s.pnm_blocks for s in self.running)  # PNM
        if pnm_held != self.pnm.used_blocks or any(s.pnm_blocks for s in self.waiting) \
                or any(s.pnm_blocks for s in self.swapped):
            raise AssertionError(f"pnm used {self.pnm.used_blocks} != held by running {pnm_held}")
        for s in self.running:
            if s.on_pnm:
                if s.hbm_blocks or s.pnm_blocks < self._blocks_for(s.computed):
                    raise AssertionError(f"{s} on PNM holds HBM blocks or too few PNM blocks")
                continue
            if s.hbm_blocks < self._blocks_for(s.computed):
                raise AssertionError(f"{s} holds fewer blocks than its KV tokens need")
