"""One serving instance: a vLLM-V1-like step loop over a paged, tiered KV cache.

Each step (one scheduler iteration, vLLM ``Scheduler.schedule``; REFERENCE.md §4.1):

1. **Running requests first**, in admission order. A decode gets one token; an unfinished
   (chunked) prefill gets ``min(remaining, long_prefill_token_threshold if > 0, budget)``
   tokens. KV blocks for the new tokens are allocated all-or-nothing; when that fails the
   policy picks a victim (vLLM: the most recently admitted) and it is **preempted** by
   recompute (vLLM V1 default), swap to DRAM or offload to NVMe (``preemption_mode``), until
   the allocation succeeds or the request preempts itself.
2. **Swapped requests resume** when nothing was preempted this step (their blocks are copied
   back to HBM over PCIe; a request cannot run until its copy lands) and, only when nothing was
   preempted and nobody is swapped out (vLLM V1; V0's ``_schedule_default``), **waiting requests
   are admitted** in the policy's order until the token budget (``max_num_batched_tokens``),
   ``max_num_seqs`` or the KV cache runs out. With the policy's ``admit_while_swapped`` they are
   admitted while requests are swapped out, also after this step's swap-outs (V0's
   ``_schedule_chunked_prefill``; :meth:`.step_plan.StepComposer.open_admission`). A prefix-cache
   lookup reduces the tokens to compute.
3. The step's time comes from the cost model; at its end every request that finished its
   pending tokens emits one output token.

The instance is the loop; each mechanism is a collaborator in its own file:

- :mod:`.kv_manager` -- block residency over the tiers, prefix lookup, frees, swaps, links;
- :mod:`.step_plan` -- the batch of one step under the token budget (chunks, partial prefills,
  running requests, the all-decodes fast path);
- :mod:`.admission` -- waiting requests given cache residency in the policy's order;
- :mod:`.preemption` -- victims, modes and their costs, swap-out and swap-in;
- :mod:`.fast_forward` -- timing the step, or a stretch of identical decode steps at once;
- :mod:`.pnm_migration` -- the processing-near-memory tier's migrations (REFERENCE §3);
- :mod:`.invariants` -- block conservation and holdings, checked after every step in tests.

Partial prefills (vLLM V0 ``--max-num-partial-prefills`` / ``--max-long-partial-prefills``,
``PartialPrefillMetadata``): with a limit ``max_num_partial_prefills = k``, each prefill gets at
most ``budget // min(m, k)`` tokens (``m`` prefills could run), at most ``k`` requests may be
left with an unfinished prefill by one step, and at most ``max_long_partial_prefills`` of them
*long* (prompt above ``long_prefill_token_threshold``, which defaults to 4 % of
``max_model_len`` when ``k > 1``). ``k = 1`` is V0's default (one unfinished prefill at a time);
``None`` (the default) limits nothing, as vLLM V1 (:mod:`.step_plan`).

**Fast-forward** (:mod:`.fast_forward`): when a step's batch is all decodes, nobody is loading,
swapped or preempted, and the waiting queue cannot be admitted by a static-order policy, the
next steps repeat the same batch until a request finishes, the KV cache cannot grow, or the
next arrival lands; that stretch is advanced at once, byte-identical to stepping one by one.
"""

from __future__ import annotations

import math
from collections import deque
import dataclasses
from dataclasses import dataclass

import numpy as np

from .admission import Admitter
from .cost_model import CostModel
from .errors import ConfigError, bounded_repr
from .fast_forward import StretchPlanner
from .features import FeatureTable
from .instance_spec import InstanceSpec
from .invariants import check_instance
from .kv_manager import KVManager
from .observer import BatchEntry, LinkWatch, SimObserver, StepEvent
from .pnm_migration import PNMMigrator
from .policy_api import PolicyContext
from .preemption import Preemptor
from .request import FINISHED, REJECTED, RUNNING, RequestState
from .step_noise import step_noise_for
from .step_plan import StepBuild, StepComposer

TRANSFER_EVENT = "transfer"


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


def batch_entries(plan: list[tuple[RequestState, int]]) -> tuple[BatchEntry, ...]:
    """A planned batch as :class:`~.observer.BatchEntry` values (read before the step is applied:
    a decode computes the one token at KV position ``prompt + generated - 1``)."""
    out = []
    for st, n in plan:
        g = st.generated
        if n == 1 and g > 0 and st.computed == st.prompt_tokens + g - 1:
            phase = "decode"
        else:
            phase = "prefill" if g == 0 else "recompute"
        out.append(BatchEntry(st.rid, n, phase))
    return tuple(out)


def effective_long_prefill_threshold(spec: InstanceSpec) -> int:
    """Per-step chunk cap of one prefill, as vLLM applies it.

    ``long_prefill_token_threshold`` when > 0; when it is 0 and ``max_num_partial_prefills > 1``,
    vLLM sets it to 4 % of ``max_model_len`` (``SchedulerConfig.__post_init__``, REFERENCE.md
    §4.1; not for a limit of 1 nor without a limit). Without chunked prefill there is no
    per-step cap (a prompt runs whole).
    """
    if not spec.enable_chunked_prefill:
        return 0
    if spec.long_prefill_token_threshold > 0:
        return spec.long_prefill_token_threshold
    if spec.max_num_partial_prefills is not None and spec.max_num_partial_prefills > 1:
        return max(1, int(spec.model_len_limit * 0.04))
    return 0


class Instance:
    """A serving instance (one model replica, ``tp`` GPUs) driven by an event loop.

    The cluster calls :meth:`add_request` at arrivals, :meth:`schedule` when the instance is
    idle (returns the end time of the planned step or stretch, or ``None``), then
    :meth:`complete_step` at that time, and :meth:`complete_transfer` when a copy lands.

    Args:
        spec: the served system (model, GPU, TP, KV tiers, scheduler limits, cost params).
        policy: an object implementing :class:`~.policy_api.SchedulerPolicy` (injected; e.g.
            :func:`kvsched.policies.base.make_policy`).
        recorder: collects finished records, ITL samples and occupancy.
        instance_id: index within the cluster.
        options: simulation options.
        seed: the simulation seed; seeds the instance's step-time noise (:mod:`.step_noise`,
            with ``instance_id``) when its cost parameters turn noise on; unused otherwise.

    Raises:
        ConfigError: the policy gives a token budget below 1, or (chunked prefill off) one below
            the model length.
    """

    effective_long_prefill_threshold = staticmethod(effective_long_prefill_threshold)

    def __init__(self, spec: InstanceSpec, policy, recorder, instance_id: int = 0,
                 options: InstanceOptions = InstanceOptions(), seed: int = 0) -> None:
        self.spec = spec
        self.policy = policy
        self.recorder = recorder
        self.instance_id = instance_id
        #: per-step time noise and hiccups (:mod:`.step_noise`), or None (deterministic steps)
        self.step_noise = step_noise_for(spec.cost_params, seed, instance_id)
        if self.step_noise is not None and options.fast_forward:
            # stretches assume deterministic, non-decreasing step times: step one by one
            # (the results fast-forward would give; see kvsched.envs.sim.step_noise)
            options = dataclasses.replace(options, fast_forward=False)
        self.options = options
        self.cost = CostModel(spec)
        self.bs = spec.block_size_tokens
        self.kv = KVManager(spec, self.cost)
        self._prefix_tiers = self.kv.prefix_tiers  # lower tiers caching prefixes, or None
        if self._prefix_tiers is not None and self._prefix_tiers.fragment_s > 0.0 and self.options.fast_forward:
            # a step's start waits for the copies the one before submitted, which a stretch does
            # not see: step one by one (copy_fragment_s, kvsched.envs.sim.prefix_offload)
            self.options = dataclasses.replace(self.options, fast_forward=False)
        #: the HBM and PNM :class:`~.kv_cache.BlockPool` and the link queues (the KV manager's)
        self.hbm = self.kv.hbm
        self.pnm = self.kv.pnm
        self.links = self.kv.links
        self.long_threshold = effective_long_prefill_threshold(spec)
        self._prefix_lookup = self.kv.cached_prefix_tokens  # the FeatureTable's cached_prefix_tokens
        policy.bind(PolicyContext(spec=spec, cost=self.cost, instance_id=instance_id))
        self._configure_from_policy(policy, spec)
        recorder.register_instance(instance_id, [t.name for t in self.kv.tiers], self.kv.capacity_blocks())
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.swapped: deque[RequestState] = deque()
        self.busy = False
        self.schedule_pending = False
        self.pending_events: list[tuple[float, str, RequestState]] = []
        self._shared_kv = None  # the cluster KV tier (kvsched.envs.sim.shared_kv), set by the cluster
        #: prefill/decode disaggregation (:class:`~.disagg.DisaggRuntime`), set by the cluster; None: off
        self.remote_kv = None
        #: prefill-phase copies that produced their token and keep their KV blocks until the decode
        #: instance has read them (:mod:`.disagg`); empty without disaggregation
        self.sending: list[RequestState] = []
        # the step (or stretch) in flight: its plan, when it started, when it may start (copies),
        # how many known decodes lead it, and a blocked waiting head's cached prefix
        self._plan: list[tuple[RequestState, int]] = []
        self._step_start = 0.0
        self._step_ready_s = 0.0
        self._single_decodes = 0
        self._blocked_hit_hashes: tuple = ()
        #: Set by the cluster when nothing outside this instance can observe it between its own
        #: events (one instance, or round-robin look-ahead; no watched decision points, no shared
        #: KV tier): a fast-forwarded stretch may then run through completions while nothing waits,
        #: and a single step that completes prompts may be folded into the stretch after it.
        self.stretch_through_finishes = False
        # collaborators (one mechanism each)
        self.composer = StepComposer(self)
        self.admitter = Admitter(self)
        self.preemptor = Preemptor(self)
        self.stretch = StretchPlanner(self)
        self.pnm_migrator = PNMMigrator(self)
        # counters
        self.steps = 0
        self.busy_s = 0.0
        self.sum_batch = 0
        #: told of every planned step (:class:`~.observer.SimObserver`), or None (the default);
        #: set with :meth:`attach_observer`
        self.observer: SimObserver | None = None

    def attach_observer(self, observer: SimObserver | None) -> None:
        """Tell ``observer`` (None: nobody) of this instance's steps, preemptions and link copies
        (:mod:`.observer`)."""
        self.observer = observer
        self.preemptor.observer = observer
        for q in self.links.values():
            q.watch = None if observer is None else LinkWatch(observer, self.instance_id)

    def _configure_from_policy(self, policy, spec: InstanceSpec) -> None:
        """Token budget, chunking and the options every policy may set (``PolicyParams``)."""
        self.budget = int(policy.token_budget(spec.token_budget))
        if self.budget < 1:
            raise ConfigError(f"policy {bounded_repr(policy.name)} gave token_budget={self.budget}; must be >= 1")
        params = getattr(policy, "params", None)
        self.prefetch = bool(getattr(params, "prefetch", False))
        self.admit_while_swapped = bool(getattr(params, "admit_while_swapped", False))
        self.admit_in_preemption_step = bool(getattr(params, "admit_in_preemption_step", False))
        # may a blocked waiting request preempt a running one (kvsched.policies.preemption)?
        self.admission_preemption = getattr(params, "admission_preemption", "never") != "never"
        # may the head of the admission order, blocked for a seat or KV blocks, ask the policy for
        # a victim (choose_head_preemption; vLLM V0 priority preemption)? Optional in the protocol.
        self.head_preemption = bool(getattr(policy, "preempts_for_head", False))
        self.chunked = spec.enable_chunked_prefill if policy.chunked_prefill is None else bool(policy.chunked_prefill)
        if not self.chunked:
            self.long_threshold = 0
            if self.budget < spec.model_len_limit:
                raise ConfigError(
                    f"without chunked prefill the token budget ({self.budget}) must cover max_model_len "
                    f"({spec.model_len_limit}), as vLLM requires; raise max_num_batched_tokens")
        # PNM: the policy decides run-time migrations only if it says so and the spec has a PNM tier
        self.pnm_policy = bool(getattr(policy, "uses_pnm", False)) and spec.num_pnm_blocks > 0

    # ----------------------------------------------------------------------- shared state
    @property
    def shared_kv(self):
        """The cluster KV tier (:class:`~.shared_kv.SharedKVPool`) or None."""
        return self._shared_kv

    @shared_kv.setter
    def shared_kv(self, pool) -> None:
        self._shared_kv = pool
        self.kv.publish = None if pool is None else (
            lambda key, n_blocks, creator, now: pool.publish(self, key, n_blocks, creator, now))

    @property
    def preemptions(self) -> int:
        """Preemptions so far (every mode, PNM-pool ones included)."""
        return self.preemptor.preemptions

    @property
    def admission_preemptions(self) -> int:
        """Preemptions made for a blocked waiting request (:mod:`kvsched.policies.preemption`)."""
        return self.preemptor.admission_preemptions

    @property
    def pnm_migrations(self) -> int:
        """GPU->PNM migrations started."""
        return self.pnm_migrator.migrations

    @property
    def stretches(self) -> int:
        """Fast-forwarded stretches planned."""
        return self.stretch.stretches

    @property
    def stretch_steps(self) -> int:
        """Steps advanced inside fast-forwarded stretches."""
        return self.stretch.stretch_steps

    @property
    def folded_steps(self) -> int:
        """Single steps folded into the stretch after them."""
        return self.stretch.folded_steps

    def feature_table(self, states, now: float, running: np.ndarray | None = None) -> FeatureTable:
        """A :class:`FeatureTable` of ``states`` at ``now`` as this instance's policy may see it
        (its ``cached_prefix_tokens`` looked up in this instance's HBM prefix cache)."""
        return FeatureTable(states, now, self.options.oracle_lengths, running=running,
                            tier_codes=self.kv.tier_codes, prefix_lookup=self._prefix_lookup)

    # ----------------------------------------------------------------------------- arrivals
    def add_request(self, st: RequestState, now: float) -> bool:
        """Queue an arriving request, or reject it (recorded) if it can never be served.

        A request is rejected with ``exceeds_max_model_len`` when prompt + output tokens exceed
        the model length limit (vLLM validates ``prompt + max_tokens <= max_model_len``), and
        with ``kv_exceeds_hbm_capacity`` when its final KV needs more blocks than HBM holds.
        Returns ``True`` when queued.
        """
        st.instance_id = self.instance_id
        reason = self.reject_reason(st)
        if reason:
            return self._reject(st, reason)
        self.waiting.append(st)
        return True

    def reject_reason(self, st: RequestState) -> str:
        """Why this instance can never serve ``st`` (:meth:`add_request`'s reasons), or ``""``."""
        total = st.prompt_tokens + st.output_tokens
        if total > self.spec.model_len_limit:
            return "exceeds_max_model_len"
        if -(-(total - 1) // self.bs) > self.kv.hbm.capacity_blocks:
            return "kv_exceeds_hbm_capacity"
        return ""

    def _reject(self, st: RequestState, reason: str) -> bool:
        st.status = REJECTED
        st.reject_reason = reason
        self.recorder.record(st)
        return False

    # ---------------------------------------------------------------------------- scheduling
    def schedule(self, now: float, horizon_s: float = math.inf) -> float | None:
        """Plan the next step (or fast-forward stretch) at ``now``.

        Args:
            now: current simulated time (s).
            horizon_s: time of the next event that could change this instance's batch from
                outside (the next arrival); a stretch never runs past the step containing it.

        Returns:
            The end time of the planned step/stretch, or ``None`` when nothing can run.
        """
        if self._prefix_tiers is not None:
            self._prefix_tiers.now_s = now  # HBM evictions written back and demotions happen now
            self._prefix_tiers.fence_s = 0.0
            self.kv.hbm.expire_kept(now)  # HBM keeps of retention decisions (kvsched/Residency-v0)
        step = StepBuild(self.budget, self.composer.long_cap_lifted())
        step.prefill_slot = self.composer.prefill_slot_budget(now)
        self._step_ready_s = now
        submit_s = 0.0 if self._prefix_tiers is None else self._prefix_tiers.take_submit_s()
        self._blocked_hit_hashes = ()
        if self.pnm_policy:  # PNM: run-time migration check, every step (REFERENCE §3.2)
            self.pnm_migrator.choose_migrations(now)
        if self.policy.stall_free:
            n_decodes, blocked_static = self.composer.compose_stall_free(step, now)
        else:
            n_decodes, blocked_static = self.composer.compose(step, now)
        if self._prefix_tiers is not None and self._prefix_tiers.fence_s > self._step_ready_s:
            self._step_ready_s = self._prefix_tiers.fence_s  # reused blocks wait for their pending writes
        tiers = self._prefix_tiers
        if tiers is not None:
            submit_s += tiers.take_load_submit_s()
            # the copies the last step's writes and this pass's loads submit come first; with nothing
            # to run they are submitted now all the same (vLLM runs a step without a forward pass for
            # pending connector work), keeping the host busy that long
            busy_until = max(now + submit_s, tiers.host_busy_until_s)
            if step.plan:
                self._step_ready_s = max(self._step_ready_s, busy_until)
            elif submit_s > 0.0:
                tiers.host_busy_until_s = busy_until
        if step.displaced:  # back at the head of the queue, behind the requests they made room for
            self.waiting.extendleft(reversed(step.displaced))
        if not step.plan:
            if step.victims and self.running and self.spec.self_preemption == "ends_pass":
                return self._empty_step(now)
            self.stretch.pipe_carry_s = 0.0  # idle: the pipeline drains (long-context parallelism)
            self.recorder.occupancy_change(self, now)
            self._check_progress(now)
            return None
        obs = self.observer
        batch = None if obs is None else batch_entries(step.plan)
        end = self.stretch.time_step(step, n_decodes, blocked_static, horizon_s)
        if obs is not None:  # the step starts at _step_ready_s (a folded stretch moves _step_start)
            self._observe_step(obs, self._step_ready_s, batch, end)
        self.busy = True
        self.recorder.occupancy_change(self, now, self.stretch.in_use_now())
        if self.options.check_invariants:
            check_instance(self)
        return end

    def _empty_step(self, now: float) -> float:
        """A step that schedules nothing because the first running request it tried preempted
        itself (the running pass ends there, :mod:`.step_plan`): vLLM V1 returns an empty
        ``SchedulerOutput``, its engine runs no forward pass for it, and the next ``schedule()``
        call follows at once. Here: a step of zero duration (the end of this step's swap-out
        copies, if any), so the instance plans the next one right after."""
        self._plan = []
        end = self.stretch.single_step_end(self._step_ready_s, 0.0)
        if self.observer is not None:
            self._observe_step(self.observer, self._step_ready_s, (), end)
        self.busy = True
        self.recorder.occupancy_change(self, now)
        if self.options.check_invariants:
            check_instance(self)
        return end

    def _observe_step(self, obs: SimObserver, start: float, batch, end: float) -> None:
        """Tell ``obs`` of the step (or stretch) just planned, from ``start`` to ``end``."""
        sp = self.stretch
        if sp.ends is None:
            obs.on_step(StepEvent(self.instance_id, start, (end,), batch))
        else:
            steps = sp.steps
            obs.on_step(StepEvent(self.instance_id, start, sp.ends, batch,
                                  None if steps is None else tuple(steps), sp.joined > 0))

    def _check_progress(self, now: float) -> None:
        """Guard against a stuck instance: work queued but nothing runnable or in flight."""
        if self.running or self.sending or not (self.waiting or self.swapped):
            return  # (sending: blocks held for a decode instance's read free up when it lands, .disagg)
        hbm = self.kv.hbm
        raise RuntimeError(
            f"instance {self.instance_id} cannot make progress at t={now:.6f}s: "
            f"{len(self.waiting)} waiting, {len(self.swapped)} swapped, HBM free "
            f"{hbm.available_blocks}/{hbm.capacity_blocks} blocks")

    # ------------------------------------------------------------------------------ step end
    def complete_step(self, now: float) -> None:
        """Apply the planned step (or stretch) that ends at ``now``: tokens, first tokens,
        prefix segments, ITL samples, and the requests that finished."""
        self.busy = False
        plan = self._plan
        self._plan = []
        self.busy_s += now - self._step_start
        if self.stretch.ends is not None:
            finished = self.stretch.apply(plan, now)
        else:
            finished = self._apply_single(plan, now)
        if finished:
            self._finish(finished)
        self.recorder.occupancy_change(self, now)
        if self.options.check_invariants:
            check_instance(self)

    def _apply_single(self, plan: list, now: float) -> list[RequestState]:
        """Apply one (not fast-forwarded) step; returns the requests that finished, plan order."""
        self.steps += 1
        self.sum_batch += len(plan)
        finished: list[RequestState] = []
        gap_vals: tuple[list[float], list[float]] = ([], [])  # per length class
        nd = self._single_decodes
        if nd:  # decodes known at planning (1 token at KV position prompt + generated - 1)
            self._single_decodes = 0
            self._apply_known_decodes(plan[:nd], now, gap_vals, finished)
            plan = plan[nd:]
        register = self.kv.register_segments
        for st, n in plan:
            if st.status != RUNNING:
                continue
            st.computed += n
            # register newly completed prefix segments in the prefix cache
            if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= st.computed:
                register(st, now)
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
            self.recorder.add_itl_by_class(gap_vals, None)
        return finished

    def _apply_known_decodes(self, decodes: list, now: float, gap_vals: tuple, finished: list) -> None:
        """The decode fast path's members: one token each at KV position prompt + generated - 1."""
        register = self.kv.register_segments
        for st, _ in decodes:
            if st.status != RUNNING:
                continue
            c = st.computed + 1
            st.computed = c
            if st.next_seg < st.n_cacheable_segments and (st.next_seg + 1) * st.seg_tokens <= c:
                register(st, now)
            gen = st.generated + 1
            st.generated = gen
            g = now - st.last_token_s
            gap_vals[st.length_class].append(g)
            if not (st.max_itl_s >= g):
                st.max_itl_s = g
            st.last_token_s = now
            if gen >= st.output_tokens:
                finished.append(st)

    def _finish(self, finished: list[RequestState]) -> None:
        """Release the KV of the requests that emitted their last token, record them, and give the
        policy its feedback."""
        rec = self.recorder
        kv = self.kv
        policy = self.policy
        remote = self.remote_kv
        for st in finished:
            self.running.remove(st)
            if remote is not None and remote.is_prefill_copy(st):
                # a prefill-phase copy (disaggregation): its token is not the client's; its KV
                # blocks stay held until the decode instance has read them (.disagg)
                st.status = FINISHED
                st.finish_s = st.last_token_s
                remote.on_prefilled(self, st, self._step_start)
                continue
            kv.free(st)
            if self._prefix_tiers is not None:
                self._prefix_tiers.on_finished(st, st.last_token_s)
            if st.pnm_blocks:  # PNM
                self.pnm_migrator.release(st)
            st.status = FINISHED
            st.finish_s = st.last_token_s  # = now, or earlier inside a stretch through completions
            rec.record(st)
            policy.on_request_finished(st.finish_s, st.arrival_s, st.first_token_s, st.prompt_tokens,
                                       st.generated)
            if self.admission_preemption:
                policy.output_history.add(st.generated)

    def complete_transfer(self, st: RequestState, now: float) -> None:
        """A swap-in copy landed: free the request's lower-tier blocks. A background GPU->PNM
        migration landed: the request now decodes on PNM; free its HBM blocks."""
        if st.pnm_migrating:  # PNM
            self.pnm_migrator.landed(st)
            self.recorder.occupancy_change(self, now)
            return
        if st.lower_blocks:
            if st.status != RUNNING or now != st.swap_in_end_s:
                return  # stale: preempted again while loading (see Preemptor.preempt)
            st.swap_in_end_s = -1.0
            self.kv.release_lower(st)
            self.recorder.occupancy_change(self, now)

    def check(self) -> None:
        """Verify block conservation per tier and that holdings add up (:mod:`.invariants`)."""
        check_instance(self)
