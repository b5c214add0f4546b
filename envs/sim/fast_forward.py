"""Timing the planned step, or a fast-forwarded stretch of identical decode steps at once.

Cost grows with events, not tokens. When a step's batch is all decodes, nobody is loading,
swapped or preempted, and the waiting queue cannot be admitted by a static-order policy, the next
steps repeat the same batch until a request finishes, the KV cache cannot grow, or the next
arrival lands. That stretch of K steps is planned at once:

- **step end times** by a sequential cumulative sum from ``now`` of the step times of one
  vectorised cost-model call (the same float additions as stepping one by one, so results are
  byte-identical to ``fast_forward=False``; :meth:`StretchPlanner.stretch_end_times`);
- **block growth** from each request's position inside its block, allocated up front
  (nothing else allocates during a stretch); the stretch stops before the step whose blocks the
  cache cannot give, or that would evict a blocked waiting head's cached prefix;
- **through completions** (:meth:`StretchPlanner.plan_stretch_through`): with nothing waiting and
  nothing outside the instance able to observe it, a request that finishes inside the stretch
  leaves the batch at its exact step instead of ending the stretch;
- **folding the admission step** (:meth:`StretchPlanner.fold`): the single step that completes
  prompts is planned as the stretch's first step;
- **PNM** (:meth:`StretchPlanner.plan_stretch_pnm`): PNM-resident decodes grow in the PNM pool and
  the stretch stops before the policy's next migration.

With a cluster KV tier no stretch runs while requests wait (a waiting request's admission then
depends on time). :meth:`StretchPlanner.apply` applies a stretch at its end: every member's
tokens, ITL samples (first gap per request plus the shared gaps), and those that finished.
Checked by ``kvsched.experiments.refcheck`` and the fast-forward equivalence tests.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import TYPE_CHECKING

import numpy as np

from .kv_cache import BlockPool
from .request import RUNNING, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance
    from .step_plan import StepBuild


class StretchPlanner:
    """Times an instance's planned step or stretch and applies a stretch when it ends.

    Attributes (the stretch in flight; ``ends`` is None for a single step):
        ends: step end times, shape ``(K,)``.
        steps: steps each plan member runs (a stretch through completions), or None (all K).
        used, end_used: HBM blocks in use during each step / at each step end after its frees.
        pnm_used: PNM blocks in use during each step (PNM-resident decodes), or None.
        reserved, pnm_reserved: blocks allocated ahead for steps 2..K (not in use yet).
        joined: trailing plan members of a folded stretch that joined at its first step end.
        stretches, stretch_steps, folded_steps: counters.
    """

    #: Longest stretch (bound) timed one step at a time in Python rather than with NumPy.
    SCALAR_STEPS = 24

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.ends: np.ndarray | None = None
        self.steps: list[int] | None = None
        self.used: np.ndarray | None = None
        self.end_used: np.ndarray | None = None
        self.pnm_used: np.ndarray | None = None
        self.reserved = 0
        self.pnm_reserved = 0
        self.joined = 0
        self.stretches = 0
        self.stretch_steps = 0
        self.folded_steps = 0
        #: longest stage time of the SPP chunks earlier steps left in the pipeline (long-context
        #: parallelism, :meth:`~.parallelism.ParallelCost.step_with_carry`); 0 when it drained. No
        #: stretch is planned while it is > 0 (a stretch's steps are priced with an empty pipeline).
        self.pipe_carry_s = 0.0

    # ------------------------------------------------------------------ the planned step
    def time_step(self, step: StepBuild, n_decodes: int, blocked_static: bool, horizon_s: float) -> float:
        """End time of the step just composed, or of the stretch it starts (see the module doc)."""
        inst = self.inst
        plan = step.plan
        running = inst.running
        start = inst._step_ready_s
        inst._plan = plan
        if (inst.options.fast_forward and not step.preempted and not inst.swapped and not self.pipe_carry_s
                and len(plan) == len(running)
                and (not inst.waiting or (blocked_static and inst._shared_kv is None and inst._prefix_tiers is None
                                          and not inst.admission_preemption and not inst.head_preemption))
                and all(n == 1 and st.generated > 0 and st.computed == st.prompt_tokens + st.generated - 1
                        for st, n in (plan[n_decodes:] if n_decodes else plan))):  # the decodes are known
            return self.plan_stretch(start, horizon_s)
        if n_decodes and not step.preempted and inst.cost.parallel is None:
            # the step's counters already hold the batch (no PNM with the decode fast path)
            end = self.single_step_end(start, inst.cost.step_time_fast(float(step.n_tokens), step.attn2 / 2.0,
                                                                       float(step.kv_tokens), float(len(plan))))
            inst._single_decodes = n_decodes
        else:
            end = self.plan_single(start)
        if (inst.stretch_through_finishes and end < horizon_s and inst.options.fast_forward
                and not self.pipe_carry_s
                and not step.preempted and not inst.waiting and not inst.swapped and not inst.pending_events
                and not inst.kv.pnm.capacity_blocks and len(plan) == len(running) <= inst.budget):
            end = self.fold(start, end, horizon_s, n_decodes)
        return end

    def in_use_now(self) -> tuple[int, ...]:
        """Blocks in use per tier at the step's start (blocks reserved ahead for a stretch are
        not in use yet)."""
        used = self.inst.kv.used_blocks()
        if not (self.reserved or self.pnm_reserved):
            return used
        out = list(used)
        out[0] -= self.reserved
        out[-1] -= self.pnm_reserved  # PNM is the last tier
        return tuple(out)

    def plan_single(self, start: float) -> float:
        """End time of a single step of ``inst._plan`` (PNM residents' attention near memory)."""
        inst = self.inst
        if inst.cost.parallel is not None:  # long-context parallelism: priced from the batch's parts
            return self.single_step_end(start, self._parallel_step_s())
        n_tokens = 0
        attn2 = 0  # twice the attention work: integers stay exact
        kv = 0
        n_pnm = 0
        kv_pnm = 0
        for st, n in inst._plan:
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
            dt = inst.cost.pnm_step_time_fast(float(n_tokens), attn2 / 2.0, float(kv), float(kv_pnm), float(n_pnm),
                                              float(len(inst._plan)))
        else:
            dt = inst.cost.step_time_fast(float(n_tokens), attn2 / 2.0, float(kv), float(len(inst._plan)))
        return self.single_step_end(start, dt)

    def _parallel_step_s(self) -> float:
        """Seconds of the planned step under ``spec.parallel``: its decodes (count, context) and its
        prefill chunks (tokens, cached before, whether the chunk completes the prompt) in plan order
        (:meth:`~.parallelism.ParallelCost.step_with_carry`, behind the chunks earlier steps left in
        the pipeline)."""
        n_dec = 0
        ctx = 0
        chunks: list[tuple[int, int, bool]] = []
        for st, n in self.inst._plan:
            p = st.computed
            todo = st.prompt_tokens + st.generated
            if n == 1 and st.generated > 0 and p == todo - 1:
                n_dec += 1
                ctx += p
            else:
                chunks.append((n, p, p + n == todo))
        par = self.inst.cost.parallel
        assert par is not None
        dt, self.pipe_carry_s = par.step_with_carry(n_dec, ctx, chunks, self.pipe_carry_s)
        return dt

    def single_step_end(self, start: float, dt: float) -> float:
        """End time of a single (not fast-forwarded) step of ``dt`` seconds from ``start``; a
        step that runs (``dt > 0``) takes the instance's step noise when it has one
        (:mod:`.step_noise`)."""
        noise = self.inst.step_noise
        if noise is not None and dt > 0.0:
            dt = noise.apply(dt)
        self.ends = None
        self.steps = None
        self.reserved = 0
        self.pnm_reserved = 0
        self.inst._step_start = start
        return start + dt

    # ------------------------------------------------------------- the plain stretch
    def plan_stretch(self, start: float, horizon_s: float, xs: list[int] | None = None,
                     rems: list[int] | None = None, free_only: bool = False,
                     seg_refs: dict[int, int] | None = None) -> float:
        """Plan a fast-forwarded stretch of decode steps of the whole plan from ``start``.

        ``xs`` (KV tokens each plan member reads in the stretch's first step) and ``rems``
        (output tokens each has left) default to the members' current state; a folded step
        (:meth:`fold`) passes them as they stand after its first step. With ``free_only`` the
        stretch allocates only never-cached free blocks (no eviction); ``seg_refs`` maps prefix
        segments to their references left once requests released before the stretch (still
        holding them) are gone (default: their current references).
        """
        inst = self.inst
        if inst.kv.pnm.capacity_blocks:  # PNM: the planner that knows PNM-resident decodes and migrations
            return self.plan_stretch_pnm(start, horizon_s)
        self.pnm_used = None
        self.pnm_reserved = 0
        plan = inst._plan
        self.steps = None
        self.end_used = None
        if xs is None or rems is None:
            xs = [st.computed for st, _ in plan]  # KV tokens each request reads in step 1
            rems = [st.output_tokens - st.generated for st, _ in plan]
        k_rem = min(rems)
        # 1. step end times until the first request finishes or a step reaches the horizon
        ends = self.stretch_end_times(start, horizon_s, len(plan), sum(xs), k_rem)
        k = len(ends)
        if (k == k_rem and ends[-1] < horizon_s and inst.stretch_through_finishes and not inst.waiting
                and inst._shared_kv is None and k_rem < max(rems)
                and self.growth_blocks(xs, k - 1) < inst.kv.hbm.free_blocks):
            end = self.plan_stretch_through(start, horizon_s, xs, rems, ends, seg_refs)
            if end is not None:
                return end
        # 2. KV blocks of steps 2..k; the stretch stops before the step the cache cannot give
        extra = self._cut_to_blocks(xs, ends, free_only) if k > 1 else []
        k = len(ends)
        self._reserve_growth(plan, xs, extra, k)
        self.ends = np.array(ends, dtype=np.float64)
        inst._step_start = start
        return ends[-1]

    def _cut_to_blocks(self, xs: list[int], ends: list[float], free_only: bool) -> list[int]:
        """Blocks added by each step 2..k (``extra[j-1]`` for step ``j+1``), cutting ``ends`` (in
        place) before the first step the cache cannot give.

        After step 1's allocation request i holds ``ceil((x_i+1)/bs)``; after j more steps it
        needs ``floor((j + s_i)/bs)`` more, ``s_i = x_i mod bs``. Summed: ``extra(j) = n*(j // bs)
        + #(s_i >= bs - j mod bs)``. Monotone, so limiting first and cutting at the horizon after
        gives the same result.
        """
        inst = self.inst
        bs = inst.bs
        n = len(xs)
        k = len(ends)
        counts = [0] * bs
        for c in xs:
            counts[c % bs] += 1
        cnt_ge = [0] * bs
        acc_ge = 0
        for t in range(1, bs):
            acc_ge += counts[bs - t]
            cnt_ge[t] = acc_ge
        extra = [n * (j // bs) + cnt_ge[j % bs] for j in range(1, k)]
        limit = self.block_limit(extra[-1])
        # a stretch allocates every step's blocks now: free blocks only when evictions have
        # step-time side effects or kept segments' order may change (KVManager.stretch_evicts_nothing)
        if (free_only or inst.kv.stretch_evicts_nothing) and limit > inst.kv.hbm.free_blocks:
            limit = inst.kv.hbm.free_blocks
        allowed = bisect_right(extra, limit)
        if allowed + 1 < k:
            del ends[allowed + 1:]
        return extra

    def _reserve_growth(self, plan: list, xs: list[int], extra: list[int], k: int) -> None:
        """Allocate the blocks of steps 2..k now and record HBM in use during each step."""
        hbm = self.inst.kv.hbm
        bs = self.inst.bs
        used0 = hbm.used_blocks
        self.used = np.array([used0] + [used0 + e for e in extra[:k - 1]], dtype=np.int64)
        total_new = extra[k - 2] if k > 1 else 0
        self.reserved = total_new
        if total_new:
            ok = hbm.allocate(total_new)
            assert ok, "stretch block reservation failed"
            km1 = k - 1
            for (st, _), c in zip(plan, xs):
                st.private_blocks += (c + km1) // bs - c // bs  # ceil((c+k)/bs) - ceil((c+1)/bs)

    def growth_blocks(self, xs: list[int], steps: int) -> int:
        """KV blocks requests at KV positions ``xs`` allocate over ``steps`` more decode steps."""
        bs = self.inst.bs
        return sum([(c + steps) // bs - c // bs for c in xs])

    def block_limit(self, wanted: int) -> int:
        """Blocks a stretch may allocate without changing the blocked waiting head's outcome.

        While a waiting request is blocked on KV, allocations only shrink what is available,
        so it stays blocked -- unless an eviction removes one of its own cached prefix
        segments (its hit shrinks, and with it the blocks it needs). The stretch therefore
        stops before evicting the first such segment in LRU order.
        """
        protect = self.inst._blocked_hit_hashes
        if not protect:
            return self.inst.kv.hbm.available_blocks
        return self.inst.kv.block_limit_protecting(protect, wanted)

    def stretch_end_times(self, start: float, horizon_s: float, n: int, s0: int, k_rem: int) -> list[float]:
        """End times of up to ``k_rem`` decode steps of ``n`` requests reading ``s0`` KV tokens
        in the first step (one more each per step), from ``start``, stopping at the first step
        that ends at or after ``horizon_s``.

        Sequential float additions (as stepping one by one). Step times never decrease, so at
        most ``(horizon_s - start) / dt_1 + 1`` steps reach the horizon: when that bound (or
        ``k_rem``) is at most :attr:`SCALAR_STEPS`, the steps are timed one by one in
        :meth:`CostModel.decode_step_ends`, otherwise in chunks with one
        :meth:`CostModel.decode_step_times_fast` call and a cumulative sum each (bitwise the
        same values).
        """
        cost = self.inst.cost
        nf = float(n)
        dt = cost.step_time_fast(nf, float(s0), float(s0), nf)
        k_end = k_rem
        if horizon_s < math.inf and dt > 0.0:
            bound = (horizon_s - start) / dt + 3.0
            if bound < k_end:
                k_end = int(bound)
        if k_end <= self.SCALAR_STEPS:
            return cost.decode_step_ends(start, n, s0, k_rem, horizon_s)
        ends: list[float] = []
        e = start
        k = 0
        decode_times = cost.decode_step_times_fast
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

    # ------------------------------------------------------ stretch through completions
    def plan_stretch_through(self, start: float, horizon_s: float, xs: list[int], rems: list[int],
                             ends_first: list[float], seg_refs: dict[int, int] | None = None) -> float | None:
        """A decode stretch that continues through completions while nothing waits.

        One-by-one stepping would end the step in which a request emits its last token, free
        its KV, and (nothing waiting, nothing swapped, every other request a ready decode) plan
        the same decode batch without it. Here the batch shrinks inside the stretch instead: a
        request with ``r`` tokens left runs the stretch's first ``r`` steps and finishes at the
        end of step ``r`` (:meth:`apply` records that time). Step times use the same float
        additions in the same order (one :meth:`stretch_end_times` call per batch size).

        The blocks of every step are allocated now, and only from never-cached free blocks: one
        by one, the frees of finished requests come between those allocations, so an allocation
        that evicted cached segments could evict different ones. Returns ``None`` (the caller
        plans the ordinary stretch up to the first completion) when the free blocks do not cover
        the growth.

        Args:
            start: start of the stretch's first step (s).
            horizon_s: as in :meth:`~.instance.Instance.schedule`.
            xs: KV tokens each plan member reads in step 1 (plan order).
            rems: output tokens each plan member has left (plan order).
            ends_first: step end times up to the first completion (``min(rems)`` steps).
            seg_refs: as in :meth:`plan_stretch` (not changed).
        """
        inst = self.inst
        bs = inst.bs
        ends = self._through_end_times(horizon_s, xs, rems, ends_first)
        k = len(ends)
        steps = [r if r < k else k for r in rems]  # steps each request runs
        # blocks each request allocates for its steps 2..k_i (step 1's are held already)
        new_blocks = [(x + ki - 1) // bs - x // bs for x, ki in zip(xs, steps)]
        total_new = sum(new_blocks)
        hbm = inst.kv.hbm
        if total_new > hbm.free_blocks:
            return None
        used, freed_at = self._through_usage(xs, steps, new_blocks, seg_refs)
        if total_new:
            ok = hbm.allocate(total_new)
            assert ok, "stretch block reservation failed"
            for (st, _), nb in zip(inst._plan, new_blocks):
                st.private_blocks += nb
        self.used = used
        self.end_used = used - freed_at[1:]
        self.reserved = total_new
        self.steps = steps
        self.ends = np.array(ends, dtype=np.float64)
        inst._step_start = start
        return ends[-1]

    def _through_end_times(self, horizon_s: float, xs: list[int], rems: list[int],
                           ends_first: list[float]) -> list[float]:
        """Step end times of a stretch through completions: after each completion the batch
        (and the KV tokens it reads) shrinks, up to the last request or the horizon."""
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
            seg = self.stretch_end_times(ends[-1], horizon_s, n_alive, s0, nxt - j)
            ends.extend(seg)
            j += len(seg)
            if j < nxt or seg[-1] >= horizon_s:
                break
            while p < n and by_rem[p][0] <= j:
                x_alive -= by_rem[p][1]
                p += 1
        return ends

    def _through_usage(self, xs: list[int], steps: list[int], new_blocks: list[int],
                       seg_refs: dict[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
        """HBM blocks in use during each step, and blocks freed at each step end (index = step).

        Request i holds ``(x_i + min(t, k_i - 1)) // bs - x_i // bs`` more blocks in step t + 1
        than in step 1, until it finishes and frees what it held (shared segments once
        unreferenced), in the order one by one releases them (finish step, then plan order).
        """
        inst = self.inst
        bs = inst.bs
        plan = inst._plan
        k = max(steps)
        x = np.array(xs, dtype=np.int64)
        t_idx = np.minimum(np.arange(k, dtype=np.int64), np.array(steps, dtype=np.int64)[:, None] - 1)
        grown = ((x[:, None] + t_idx) // bs).sum(axis=0) - int((x // bs).sum())
        freed_at = np.zeros(k + 1, dtype=np.int64)  # freed_at[t]: blocks freed at the end of step t
        seg_refs = {} if seg_refs is None else dict(seg_refs)
        early = sorted((ki, i) for i, ki in enumerate(steps) if ki < k)
        for ki, i in early:  # release order: by finish step, then plan order (as one by one)
            st = plan[i][0]
            freed_at[ki] += st.private_blocks + new_blocks[i] + inst.kv.unreferenced_blocks(st, seg_refs)
        cum_freed = np.cumsum(freed_at[:k])  # blocks freed before step t + 1 (t = 0..k-1)
        return inst.kv.hbm.used_blocks + grown - cum_freed, freed_at

    # ----------------------------------------------------------- folding the admission step
    def fold(self, start: float, end1: float, horizon_s: float, n_decodes: int) -> float:
        """Fold a single step that completes prompts into the decode stretch that follows it.

        The single step ending at ``end1`` holds decodes (the plan's first ``n_decodes`` or more
        members) and, after them, fresh prefills that compute the rest of their prompt and so
        emit their first token at ``end1``. With nothing waiting or swapped, the plan in running
        order and nothing outside this instance able to look at it before ``end1``, stepping one
        by one would end that step (finishing the decodes that emit their last token there) and
        plan, at ``end1``, a fast-forwarded decode stretch of the others. This plans that stretch
        now, with the step as its first step:

        * the prefills' first step is applied now (computed prompt, first token at ``end1``,
          prompt segments registered in the prefix cache): the same pool operations, in the same
          order, as at ``end1``;
        * the second step's KV blocks are allocated now as one allocation, as the decode fast
          path would at ``end1``; the fold is declined when they cannot be had;
        * :meth:`plan_stretch` plans the rest from ``end1`` and the first step is prepended.

        Decodes that finish at ``end1`` run the first step only (a stretch through completions):
        then every block of the stretch comes from never-cached free blocks. Returns the
        stretch's end time, or ``end1`` when the step is not folded.
        """
        inst = self.inst
        plan = inst._plan
        members = self._fold_members(plan, n_decodes)
        if members is None:
            return end1
        xs, rems, n_join = members
        done1 = min(rems) < 1  # a decode emits its last token at end1 (the prefills have >= 1 left)
        if done1:
            live, xs, rems, freed1, seg_refs = self._fold_finishing_first(plan, xs, rems)
            live_plan = [plan[i] for i in live]
        else:
            live, live_plan, freed1, seg_refs = None, plan, 0, None
        hbm = inst.kv.hbm
        # the second step's blocks: ceil((x + 1) / bs) minus those held after the first step,
        # which are at least ceil(x / bs): only a member with x a multiple of bs can need one
        bs = inst.bs
        grow = [(st, x // bs + 1 - st.shared_blocks - st.private_blocks)
                for (st, _), x in zip(live_plan, xs) if x % bs == 0]
        need_total = sum([nb for _, nb in grow if nb > 0])
        # with frees at end1 the stretch allocates from never-cached free blocks only
        if need_total > (hbm.free_blocks if done1 or inst.kv.stretch_evicts_nothing
                         else hbm.free_blocks + hbm.evictable_blocks):
            return end1
        self._apply_first_step(plan[len(plan) - n_join:], end1)
        used1 = hbm.used_blocks
        inst.busy_s += end1 - start  # the first step's busy time, added when stepping ends it
        if need_total:
            hbm.allocate(need_total)
            for st, nb in grow:
                if nb > 0:
                    st.private_blocks += nb
        # the others' stretch from end1, planned as one by one would plan it there
        inst._plan = live_plan
        end = self.plan_stretch(end1, horizon_s, xs, rems, free_only=done1, seg_refs=seg_refs)
        inst._plan = plan
        self._prepend_first_step(end1, used1, freed1, live, len(plan), n_join)
        self.reserved += need_total
        return end

    def _fold_members(self, plan: list, n_decodes: int) -> tuple[list[int], list[int], int] | None:
        """``(xs, rems, n_join)`` of a foldable step (KV tokens read in step 2, tokens left after
        ``end1``, prefills joining), or None when the step cannot be folded."""
        inst = self.inst
        xs = [st.computed + 1 for st, _ in plan[:n_decodes]]
        rems = [st.output_tokens - st.generated - 1 for st, _ in plan[:n_decodes]]
        n_join = 0
        for st, m in plan[n_decodes:]:
            c = st.computed
            g = st.generated
            if st.status != RUNNING:
                return None
            if g > 0 and m == 1 and c == st.prompt_tokens + g - 1:  # a decode the running loop planned
                if n_join:  # a decode after a prefill
                    return None
                xs.append(c + 1)
                rems.append(st.output_tokens - g - 1)
            elif g == 0 and c + m == st.prompt_tokens and st.output_tokens >= 2:
                n_join += 1
                xs.append(c + m)
                rems.append(st.output_tokens - 1)
            else:
                return None  # a partial prefill or a recomputation
        if not n_join:
            return None
        # one by one, the stretch planned at end1 runs in running (admission) order; a stall-free
        # policy plans the step's prefills after its decodes, in its own order, and members
        # finishing at one step would then free their blocks (LRU) in another order
        if any(p[0] is not r for p, r in zip(plan[n_decodes:], inst.running[n_decodes:])):
            return None
        return xs, rems, n_join

    def _fold_finishing_first(self, plan: list, xs: list[int], rems: list[int]):
        """Decodes finishing at ``end1`` run the first step only: ``(live, xs, rems, freed1,
        seg_refs)`` of the others, the blocks the finishing ones free at ``end1`` (plan order,
        before the second step allocates) and the segment references left after that."""
        done = [i for i, r in enumerate(rems) if r < 1]
        live = [i for i, r in enumerate(rems) if r >= 1]
        freed1 = 0
        seg_refs: dict[int, int] = {}
        kv = self.inst.kv
        for i in done:
            st = plan[i][0]
            freed1 += st.private_blocks + kv.unreferenced_blocks(st, seg_refs)
        return live, [xs[i] for i in live], [rems[i] for i in live], freed1, seg_refs

    def _apply_first_step(self, prefills: list, end1: float) -> None:
        """The joining prefills' first step, as :meth:`~.instance.Instance.complete_step` applies it
        at ``end1``: prompt computed, prompt segments registered, first token."""
        inst = self.inst
        for st, m in prefills:
            st.computed += m
            if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= st.computed:
                inst.kv.register_segments(st, end1)
            st.generated = 1
            st.first_token_s = end1
            st.last_token_s = end1
        inst._single_decodes = 0

    def _prepend_first_step(self, end1: float, used1: int, freed1: int, live: list[int] | None, n: int,
                            n_join: int) -> None:
        """Make the folded step the stretch's first: its end time, occupancy, and the steps of
        members that finish at ``end1`` (one) or later (one more than planned)."""
        live_steps = self.steps
        assert self.used is not None and self.ends is not None  # plan_stretch just set them
        used = self.used - freed1 if freed1 else self.used
        self.used = np.concatenate(([used1], used))
        if live is not None or live_steps is not None:  # members run different numbers of steps
            end_used = used if self.end_used is None else self.end_used - freed1
            self.end_used = np.concatenate(([used1 - freed1], end_used))
            if live is not None:
                k_live = len(self.ends)
                steps = [1] * n  # those finishing at end1: the first step only
                for j, i in enumerate(live):
                    steps[i] = (live_steps[j] if live_steps is not None else k_live) + 1
            else:
                assert live_steps is not None
                steps = [ki + 1 for ki in live_steps]
            self.steps = steps
        self.joined = n_join
        self.folded_steps += 1
        self.ends = np.concatenate(([end1], self.ends))

    # --------------------------------------------------------------------------- PNM
    def plan_stretch_pnm(self, start: float, horizon_s: float) -> float:
        """:meth:`plan_stretch` on an instance with a PNM tier (NumPy form; PNM-resident decodes
        grow in the PNM pool, and the stretch stops before the policy's next migration)."""
        inst = self.inst
        plan = inst._plan
        n = len(plan)
        x = np.fromiter((st.computed for st, _ in plan), np.int64, count=n)  # KV tokens read in step 1
        remaining = np.fromiter((st.output_tokens - st.generated for st, _ in plan), np.int64, count=n)
        on_pnm = np.fromiter((st.on_pnm for st, _ in plan), bool, count=n)
        has_pnm = bool(on_pnm.any())
        x_gpu = x[~on_pnm] if has_pnm else x
        k_max, extra, extra_pnm = self._pnm_allowed_steps(x, x_gpu, on_pnm, has_pnm, int(remaining.min()))
        ends = self._pnm_end_times(start, horizon_s, x, x_gpu, on_pnm, has_pnm, k_max)
        k = len(ends)
        # allocate the blocks of steps 2..K now (nothing else allocates during the stretch)
        bs = inst.bs
        new_blocks = -(-(x + k) // bs) - (-(-(x + 1) // bs))
        total_new = int(new_blocks[~on_pnm].sum()) if has_pnm else int(new_blocks.sum())
        self.used = self._reserve(inst.kv.hbm, extra, k, total_new)  # HBM in use per step
        self.reserved = total_new
        self.pnm_used = None
        self.pnm_reserved = 0
        self.steps = None
        self.end_used = None
        if has_pnm:  # PNM: same for the PNM pool
            pnm_new = int(new_blocks[on_pnm].sum())
            self.pnm_used = self._reserve(inst.kv.pnm, extra_pnm, k, pnm_new)
            self.pnm_reserved = pnm_new
        if total_new or has_pnm:
            for (st, _), nb in zip(plan, new_blocks.tolist()):
                if st.on_pnm:
                    st.pnm_blocks += nb
                else:
                    st.private_blocks += nb
        self.ends = ends
        inst._step_start = start
        return float(ends[-1])

    def _pnm_allowed_steps(self, x: np.ndarray, x_gpu: np.ndarray, on_pnm: np.ndarray, has_pnm: bool,
                           k_max: int) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """Steps the HBM and PNM pools can grow for, and before the policy's next migration;
        returns ``(k_max, extra, extra_pnm)`` (blocks added by each step 2..k, per pool)."""
        inst = self.inst
        kv = inst.kv
        bs = inst.bs
        extra = extra_pnm = None
        if k_max > 1:
            j = np.arange(1, k_max, dtype=np.int64)
            extra = _extra_blocks(x_gpu, j, bs)
            limit = self.block_limit(int(extra[-1]))
            # as _cut_to_blocks (KVManager.stretch_evicts_nothing)
            if kv.stretch_evicts_nothing and limit > kv.hbm.free_blocks:
                limit = kv.hbm.free_blocks
            allowed = int(np.searchsorted(extra, limit, side="right"))
            if has_pnm:  # PNM: the PNM pool must hold the PNM-resident decodes' growth
                extra_pnm = _extra_blocks(x[on_pnm], j, bs)
                allowed = min(allowed, int(np.searchsorted(extra_pnm, kv.pnm.available_blocks, side="right")))
            if inst.pnm_policy and allowed > 0:
                # PNM: stop before the first step at which the policy would start a migration
                # (one-by-one stepping asks it at every step; byte-identical fast-forward)
                hbm_avail = kv.hbm.available_blocks - np.concatenate([[0], extra[:allowed - 1]])
                free = int(inst.policy.migration_free_steps(x_gpu + 1, hbm_avail, kv.pnm.available_blocks,
                                                            kv.hbm.capacity_blocks, bs))
                allowed = min(allowed, max(0, free))
            k_max = 1 + allowed
        return k_max, extra, extra_pnm

    def _pnm_end_times(self, start: float, horizon_s: float, x: np.ndarray, x_gpu: np.ndarray,
                       on_pnm: np.ndarray, has_pnm: bool, k_max: int) -> np.ndarray:
        """Step end times of a PNM stretch of at most ``k_max`` steps, cut at the horizon."""
        cost = self.inst.cost
        n = len(x)
        ks = np.arange(k_max, dtype=np.int64)
        if has_pnm:  # PNM: GPU part without the PNM-resident decodes' attention, plus PNM attention
            s0 = int(x_gpu.sum())
            n_gpu = len(x_gpu)
            p0 = int(x[on_pnm].sum())
            n_p = n - n_gpu
            ctx = (s0 + n_gpu * ks).astype(np.float64)
            dts = cost.pnm_step_times_fast(np.full(k_max, float(n)), (2 * (s0 + n_gpu * ks)) / 2.0, ctx,
                                           (p0 + n_p * ks).astype(np.float64), np.full(k_max, float(n_p)), float(n))
        else:
            s0 = int(x.sum())
            ctx = (s0 + n * ks).astype(np.float64)
            dts = cost.step_times_fast(np.full(k_max, float(n)), (2 * (s0 + n * ks)) / 2.0, ctx, float(n))
        acc = np.empty(k_max + 1, dtype=np.float64)
        acc[0] = start
        acc[1:] = dts
        ends = np.cumsum(acc)[1:]
        if horizon_s < ends[-1]:
            ends = ends[:int(np.searchsorted(ends, horizon_s, side="left")) + 1]
        return ends

    @staticmethod
    def _reserve(pool: BlockPool, extra: np.ndarray | None, k: int, n_new: int) -> np.ndarray:
        """Allocate a stretch's ``n_new`` blocks in ``pool`` now; returns the blocks in use during
        each of its ``k`` steps (``extra[j-1]``: blocks added by step ``j+1``)."""
        used0 = pool.used_blocks
        used = np.empty(k, dtype=np.int64)
        used[0] = used0
        if k > 1:
            assert extra is not None  # computed for every stretch of more than one step
            used[1:] = used0 + extra[:k - 1]
        if n_new:
            ok = pool.allocate(n_new)
            assert ok, f"stretch block reservation in {pool.name} failed"
        return used

    # ----------------------------------------------------------------- at the stretch's end
    def apply(self, plan: list, now: float) -> list[RequestState]:
        """Apply the stretch ending at ``now`` to its members; returns those that finished, in
        the order stepping one by one finishes them."""
        inst = self.inst
        ends = self.ends
        assert ends is not None and self.used is not None  # a stretch is in flight
        k = len(ends)
        inst.steps += k
        self.stretches += 1
        self.stretch_steps += k
        inst.sum_batch += k * len(plan)
        gaps = ends[1:] - ends[:-1]  # np.diff, without its overhead on short arrays
        max_gap = float(gaps.max()) if k > 1 else -1.0
        first_end = float(ends[0])
        steps = self.steps
        n_join = self.joined  # a folded stretch: its last n_join members joined at ends[0]
        self.joined = 0
        finished: list[RequestState] = []
        early: list[RequestState] = []
        if steps is not None:  # a stretch through completions: some ran fewer steps
            inst.sum_batch += sum(steps) - k * len(plan)
            early = self._finish_early(plan, steps, ends, gaps, n_join)
            plan = [p for p, ki in zip(plan, steps) if ki == k]
            if n_join:
                n_join = sum(1 for ki in steps[len(steps) - n_join:] if ki == k)
        if n_join:  # steps 2..k for the joined: first gap ends[1] - ends[0], then gaps[1:]
            cut = len(plan) - n_join
            self._advance(plan[:cut], first_end, k, gaps, max_gap, now, finished)
            self._advance(plan[cut:], float(ends[1]), k - 1, gaps[1:],
                          float(gaps[1:].max()) if k > 2 else -1.0, now, finished)
        else:
            self._advance(plan, first_end, k, gaps, max_gap, now, finished)
        inst.recorder.occupancy.stretch(inst.instance_id, ends, self.used, self.pnm_used,
                                        self.end_used if steps is not None else None)
        self.steps = None
        self.end_used = None
        self.ends = None
        return early + finished if steps is not None else finished

    def _advance(self, members: list, first_end: float, k: int, shared_gaps: np.ndarray, max_shared: float,
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
        self.inst.recorder.add_itl_by_class(first_gaps, shared_gaps)

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
        rec = self.inst.recorder
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


def _extra_blocks(x: np.ndarray, j: np.ndarray, bs: int) -> np.ndarray:
    """Blocks requests at KV positions ``x`` allocate over ``j`` more decode steps (after step 1).

    After step 1's allocation request i holds ceil((x_i+1)/bs); after step k it needs
    ceil((x_i+k)/bs). Extra after j=k-1 more steps: floor((j + s_i)/bs) with s_i = x_i mod bs,
    summed over i.
    """
    s = x % bs
    counts = np.bincount(s, minlength=bs)
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])  # suffix[t] = #(s >= t)
    cnt_ge = np.zeros(bs, dtype=np.int64)
    cnt_ge[1:] = suffix[bs - np.arange(1, bs)]
    return len(x) * (j // bs) + cnt_ge[j % bs]
