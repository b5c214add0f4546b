"""The scheduler-policy interface and the policy registry.

An instance (``kvsched.envs.sim.instance``) runs a vLLM-V1-like step loop; a policy makes its
decisions there, reading only a :class:`~kvsched.envs.sim.features.FeatureTable` (never the
hidden output length unless the scenario enables oracle lengths) and the served system's
spec and cost model, handed over once by :meth:`SchedulerPolicy.bind`.

Decisions (each has a vLLM-faithful default):

1. ``order_waiting(table)``: the order in which waiting requests are offered cache residency
   (admission order). ``None`` keeps queue order (FCFS).
2. ``choose_victim(table)``: which running request to preempt when KV allocation fails
   (``params.victim_rule`` may replace it by a named rule, :mod:`kvsched.policies.victims`).
3. ``token_budget(default)``: tokens per step (``max_num_batched_tokens``).
4. ``stall_free`` and ``order_prefills(table)``: with ``stall_free`` (Sarathi-Serve), running
   decodes are scheduled first, then every prefill -- unfinished (running) ones and waiting
   ones together -- in the order ``order_prefills`` gives, so a waiting request can go before
   a paused partial prefill. Without it (vLLM), running requests go first in admission order.
5. ``chunk_limit(prompt_tokens, computed_tokens, batch_tokens, batch_attn_pairs, batch_kv_tokens)``:
   a cap on one prefill's chunk given the batch planned so far (adaptive chunking), or ``None``.
6. ``chunked_prefill``: ``False`` makes every prefill run whole in one step (non-preemptive).
7. ``on_request_finished(now_s, ...)``: feedback when a request completes (for online tuning).
   Output lengths of finished requests also go to ``output_history``.
8. ``choose_migrations(table, ...)`` (only with ``uses_pnm`` and a PNM tier in the spec): which
   GPU-resident decodes to move to the processing-near-memory tier now (REFERENCE.md §3.2), and
   ``migration_free_steps(...)``: how many identical decode steps ahead it would move nobody (so
   fast-forwarded stretches stop where one-by-one stepping would migrate).
9. ``choose_admission_preemption(...)`` (only with ``params.admission_preemption`` set): whether
   the head of the admission order, blocked for KV blocks, preempts a running request
   (:mod:`kvsched.policies.preemption`).
10. ``choose_head_preemption(running, head, cause, ...)`` (only when ``preempts_for_head``): which
    running request the head of the admission order, blocked for a seat (``max_num_seqs``) or
    for KV blocks, preempts -- vLLM V0's priority preemption (:mod:`kvsched.policies.vllm_priority`).

``order_is_static`` declares that the admission order cannot change while the batch is
unchanged (no arrival, completion or transfer); the simulator only fast-forwards stretches
of steps past a blocked waiting queue when it is ``True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.policy_api import PolicyContext
from kvsched.envs.sim.registry import Registry

from .preemption import ADMISSION_PREEMPTION_MODES
from .victims import PARAM_VICTIM_RULES, victim_row


@dataclass(frozen=True)
class SearchDim:
    """One tunable parameter of a search space (``kvsched tune``, :mod:`kvsched.experiments.tune`).

    Attributes:
        kind: "float", "int" or "categorical" (Optuna's ``suggest_float`` / ``suggest_int`` /
            ``suggest_categorical``).
        low, high: inclusive bounds for "float" and "int".
        log: sample on a log scale ("float" and "int"; then ``low > 0``).
        step: grid step for "int" (tokens, e.g. 16 for block multiples); ``None`` = 1.
        choices: the values of a "categorical" dimension.
        source: where the range comes from (paper, REFERENCE section or "kvsched choice").

    Raises:
        ConfigError: an unknown kind, ``low > high``, a log scale with ``low <= 0``, or an empty
            choice list.
    """

    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: int | None = None
    choices: tuple = ()
    source: str = ""

    def __post_init__(self) -> None:
        require(self.kind in ("float", "int", "categorical"), "SearchDim.kind", self.kind,
                "'float', 'int' or 'categorical'")
        if self.kind == "categorical":
            require(len(self.choices) >= 1, "SearchDim.choices", self.choices, "at least one value")
        else:
            require(self.low is not None and self.high is not None and self.low <= self.high,
                    "SearchDim.low/high", (self.low, self.high), "two numbers with low <= high")
            require(not self.log or self.low > 0, "SearchDim.low", self.low, "> 0 on a log scale")

    def suggest(self, trial: Any, name: str) -> Any:
        """The value of parameter ``name`` an Optuna ``trial`` suggests in this dimension (any object
        with Optuna's ``suggest_float`` / ``suggest_int`` / ``suggest_categorical``; the policies
        do not import Optuna)."""
        if self.kind == "float":
            return trial.suggest_float(name, self.low, self.high, log=self.log)
        if self.kind == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), step=self.step or 1, log=self.log)
        return trial.suggest_categorical(name, list(self.choices))

    def contains(self, value: Any) -> bool:
        """Whether ``value`` lies in this dimension (a published default outside it is noted)."""
        if self.kind == "categorical":
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high


@dataclass(frozen=True)
class PolicyParams:
    """Base of every policy's frozen parameter dataclass.

    Attributes:
        tier_aware_preemption: choose the preemption victim and mode (recompute, swap to DRAM,
            offload to NVMe) from where its blocks can go and what reload or recompute would
            cost (REFERENCE.md §5.4), instead of vLLM's newest-victim and the spec's fixed
            mode. Available to every policy.
        prefetch: copy swapped-out KV back into HBM asynchronously, behind the running steps'
            compute (packing-prefetch, arXiv 2508.08457; REFERENCE.md §9.1, mapping [inferred]),
            instead of reloading on demand the way vLLM V0 does (the step waits for the
            swap-in copy, stalling every running request). Available to every policy.
        admit_while_swapped: keep admitting new prompts while requests are swapped out (in steps
            without a preemption; with ``admit_in_preemption_step`` also in the step whose
            preemptions swapped them out). Default False: no admission while anyone is swapped
            out (V0 without chunked prefill, ``_schedule_default``) nor after a preemption (vLLM
            V1). Changes nothing without a lower tier.
        admit_in_preemption_step: with ``admit_while_swapped`` and requests swapped out, admit new
            prompts also in a step whose running pass preempted: vLLM V0 with chunked prefill
            (``Scheduler._schedule_chunked_prefill`` in ``vllm/core/scheduler.py``: swapped
            requests resume only after a running pass without preemption and only while the
            oldest fits, ``_schedule_swapped``; new prompts are admitted after every pass,
            ``_schedule_prefills``), so new arrivals take the HBM a swap-out freed and push more
            requests out until host memory fills (then preemption falls back to NVMe, then
            recompute; V0 aborted there, "lack of CPU swap space"). Both true reproduce V0.
            Default False (kvsched 0.1's ``admit_while_swapped``, which kvsched bench v1's tuned
            heuristics were computed with: its admission waited for a step without preemption).
        admission_preemption: may the head of the admission order, blocked for KV blocks,
            preempt a running request? ``"never"`` (vLLM V1, default), ``"always"`` (vLLM V0
            priority preemption: the largest longer holder goes) or ``"cost-gated"`` (only when
            the predicted delay removed exceeds the reload or recompute cost and the victim's
            displacement; :mod:`kvsched.policies.preemption`). Available to every policy.
        admission_victim_min_tokens: only requests with at least this many tokens (prompt +
            generated) may be preempted that way; 8192 (kvsched's choice: the long-prompt class
            boundary of the metrics; pushing out a short request frees little and cascades).
        max_admission_preemptions: how often one request may be preempted that way; 1
            (kvsched's choice: bounds the displacement of a long request, no cascades).
        output_history_window: finished requests whose output lengths the cost gate's expected
            remaining output is estimated from; 4096 (kvsched's choice).
        victim_rule: who is preempted when a running request cannot get KV blocks:
            ``"policy"`` (default: the policy's own :meth:`SchedulerPolicy.choose_victim`, so
            nothing changes), ``"newest"`` (vLLM V1 fcfs, ``running[-1]``), ``"oldest"``,
            ``"least-computed"``, ``"most-computed"`` or ``"priority"`` (the largest ``(priority,
            arrival_s)``, vLLM V1 ``--scheduling-policy priority``); the rules and their sources
            in :mod:`kvsched.policies.victims`. With ``tier_aware_preemption`` a named rule picks
            the victim and tier-aware preemption only its mode (the cheapest feasible one for that
            row, REFERENCE.md §5.4); ``"policy"`` keeps tier-aware preemption's own victim (least
            cost per freed block, never the oldest). It does not change who admission preemption
            pushes out (``admission_preemption``). Available to every policy.
    """

    #: What ``kvsched tune`` may vary: parameter name -> :class:`SearchDim`. Empty here;
    #: each policy declares its own next to its parameters.
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {}

    #: The KV-residency knobs every policy has (above), which ``kvsched tune --tune-residency``
    #: adds to the policy's own space: where a victim's blocks go, whether swapped KV comes back
    #: ahead of need, whether admission continues while requests are swapped out, and whether the
    #: head of the queue may preempt. The issue that built kvsched bench (#19) measured these
    #: closing most of tuned LARS's gap on KV-constrained bursty traffic.
    RESIDENCY_SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "tier_aware_preemption": SearchDim("categorical", choices=(False, True), source="REFERENCE.md §5.4"),
        "prefetch": SearchDim("categorical", choices=(False, True), source="arXiv 2508.08457; REFERENCE.md §9.1"),
        "admit_while_swapped": SearchDim("categorical", choices=(False, True),
                                         source="vLLM V0 _schedule_default (False), _schedule_chunked_prefill (True)"),
        "admission_preemption": SearchDim("categorical", choices=("never", "always", "cost-gated"),
                                          source="vLLM V1 (never), V0 priority (always), kvsched (cost-gated)"),
    }

    tier_aware_preemption: bool = False
    prefetch: bool = False
    admit_while_swapped: bool = False
    admit_in_preemption_step: bool = False
    admission_preemption: str = "never"
    admission_victim_min_tokens: int = 8192
    max_admission_preemptions: int = 1
    output_history_window: int = 4096
    victim_rule: str = "policy"

    def __post_init__(self) -> None:
        # messages are built only on failure: the Knobs-v0 environment builds parameters every step
        for name in ("tier_aware_preemption", "prefetch", "admit_while_swapped", "admit_in_preemption_step"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                require(False, f"PolicyParams.{name}", v, "true or false")
        if self.admit_in_preemption_step and not self.admit_while_swapped:
            require(False, "PolicyParams.admit_in_preemption_step", True,
                    "false unless admit_while_swapped is true (it extends that flag's admission)")
        if self.admission_preemption not in ADMISSION_PREEMPTION_MODES:
            require(False, "PolicyParams.admission_preemption", self.admission_preemption,
                    "one of " + ", ".join(ADMISSION_PREEMPTION_MODES))
        for name in ("admission_victim_min_tokens", "max_admission_preemptions", "output_history_window"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                require(False, f"PolicyParams.{name}", v, "an integer >= 1")
        if self.victim_rule not in PARAM_VICTIM_RULES:
            require(False, "PolicyParams.victim_rule", self.victim_rule, "one of " + ", ".join(PARAM_VICTIM_RULES))

    @classmethod
    def validator_for(cls, changed: frozenset):
        """The check of an instance built from a validated one's fields with those named in
        ``changed`` replaced (``kvsched/Knobs-v0`` builds one every interval, with the same
        ``changed``: :class:`kvsched.envs.knob_env.ParamsBuilder` asks once). Default: the full
        ``__post_init__``; a subclass whose own checks cover every field of ``changed`` (and
        every relation involving them) may return only those.

        Returns:
            a function of the instance; it raises ``ConfigError`` on a value the full validation
            would reject.
        """
        return cls.__post_init__


class SchedulerPolicy:
    """Base class: FCFS admission, vLLM's default preemption victim, no other changes.

    Implements the core's :class:`kvsched.envs.sim.policy_api.SchedulerPolicy` protocol with
    vLLM V1's behaviour at every decision; a reference policy overrides the decisions it changes.
    """

    name = "base"
    params_cls: type = PolicyParams
    order_is_static = True
    stall_free = False
    chunked_prefill: bool | None = None  # None: as the spec says
    uses_pnm = False  # True: the instance asks choose_migrations every step (needs spec.pnm)
    #: True: the instance asks :meth:`choose_head_preemption` when the head of the admission order
    #: is blocked for a seat or KV blocks (read once, when the instance is built)
    preempts_for_head = False

    def __init__(self, params: PolicyParams | None = None) -> None:
        from .preemption import OutputLengthHistory

        self.params = params if params is not None else self.params_cls()
        self.ctx: PolicyContext | None = None
        #: output lengths of this instance's finished requests (what the cost gate estimates from)
        self.output_history = OutputLengthHistory(getattr(self.params, "output_history_window", 4096))

    def bind(self, ctx: PolicyContext) -> None:
        """Called once by the instance before the first decision."""
        self.ctx = ctx

    def set_params(self, params: PolicyParams) -> None:
        """Replace the parameters between two decisions (``kvsched/Knobs-v0`` does, every
        interval); whatever the policy derives from them follows.

        ``params`` must already be validated (a :class:`PolicyParams` validates itself at
        construction). Default: store them and ``bind`` again to the same context, which
        re-derives everything; a policy whose derived state is cheap to update overrides this.
        """
        self.params = params
        self.bind(self.ctx)

    def order_waiting(self, table: FeatureTable) -> np.ndarray | None:
        """Admission order over ``table`` rows, or ``None`` for queue order."""
        return None

    def order_prefills(self, table: FeatureTable) -> np.ndarray | None:
        """With ``stall_free``: order over prefill candidates (running partial + waiting).

        ``table.running`` tells which rows are already running. Default: running partial
        prefills first (in admission order), then waiting in ``order_waiting`` order.
        """
        return None

    def choose_victim(self, table: FeatureTable) -> int:
        """Row of ``table`` (running requests in admission order) to preempt.

        Default: the last row, i.e. the most recently admitted request, as vLLM V1 under
        ``--scheduling-policy fcfs`` (``self.running.pop()``, REFERENCE.md §4.1).
        """
        return len(table) - 1

    def choose_preemption(self, table: FeatureTable, costs_s: dict[str, np.ndarray],
                          default_mode: str) -> tuple[int, str]:
        """Victim row and mode when KV allocation fails.

        Args:
            table: running candidates (admission order).
            costs_s: for each feasible mode ("recompute", "swap", "offload", "migrate"), the
                seconds it would cost each row: recompute = predicted re-prefill of its tokens;
                swap = copy out and back over PCIe; offload = PCIe plus NVMe write and read
                (REFERENCE.md §5.4); migrate (only with a PNM tier) = the one-way copy to PNM over
                its link, for decoding rows (REFERENCE.md §3.2). Modes whose tier cannot take a
                row's blocks are ``inf`` for that row.
            default_mode: the spec's ``preemption_mode``.

        Returns:
            ``(row, mode)``. Default: :meth:`choose_victim` (or the named ``params.victim_rule``,
            :mod:`kvsched.policies.victims`) and ``default_mode``; with
            ``params.tier_aware_preemption`` the row and mode of least cost per freed block,
            never row 0 (the oldest candidate) while there are others: like vLLM's
            newest-victim rule, this guarantees progress. Without it two long prefills that
            cannot fit together could each preempt the other forever (a livelock the fold
            breaker found: each chose the request with more computed tokens, itself). With both,
            the named rule's row in its cheapest mode.
        """
        rule = getattr(self.params, "victim_rule", "policy")
        if not getattr(self.params, "tier_aware_preemption", False):
            row = self.choose_victim(table) if rule == "policy" else victim_row(rule, table, costs_s)
            return row, default_mode
        modes = list(costs_s)
        cost = np.vstack([costs_s[m] for m in modes])           # (modes, rows)
        best_mode = np.argmin(cost, axis=0)
        if rule != "policy":  # the rule says who, tier-aware preemption how
            row = victim_row(rule, table, costs_s)
            return row, modes[int(best_mode[row])]
        best_cost = cost[best_mode, np.arange(cost.shape[1])]
        per_block = best_cost / np.maximum(table.hbm_blocks, 1)
        if len(per_block) > 1:
            per_block[0] = np.inf  # the oldest goes on (recompute is always finite for the others)
        row = int(np.argmin(per_block))
        return row, modes[int(best_mode[row])]

    def choose_admission_preemption(self, running: FeatureTable, eligible: np.ndarray, freed_blocks: np.ndarray,
                                    waiting: FeatureTable, waiting_blocks: np.ndarray, available_blocks: int,
                                    seats: int, costs_s: dict[str, np.ndarray],
                                    default_mode: str) -> tuple[int, str] | None:
        """Victim row of ``running`` and mode to make room for the blocked head of ``waiting``.

        Asked only when ``params.admission_preemption`` is not ``"never"``, the head of the
        admission order cannot get its KV blocks, and some eligible victim holds enough blocks to
        make room for the head's prompt. Returns ``None`` to keep waiting (vLLM V1).
        Arguments and rules: :func:`kvsched.policies.preemption.choose_admission_preemption`.
        """
        from .preemption import choose_admission_preemption

        return choose_admission_preemption(self, running, eligible, freed_blocks, waiting, waiting_blocks,
                                           available_blocks, seats, costs_s, default_mode)

    def choose_head_preemption(self, running: FeatureTable, head: FeatureTable, cause: str,
                               costs_s: dict[str, np.ndarray], default_mode: str) -> tuple[int, str] | None:
        """Victim row of ``running`` and mode so that the blocked head of the admission order can
        be admitted, or ``None`` (it waits).

        Asked only when :attr:`preempts_for_head` is true (the core's hook,
        :meth:`kvsched.envs.sim.preemption.Preemptor.preempt_for_head`), again after each
        preemption while the head stays blocked.

        Args:
            running: the candidates: running requests in HBM, not loading, not on PNM, in
                admission order.
            head: one row, the blocked head of the admission order.
            cause: ``"seats"`` (``max_num_seqs`` requests run) or ``"blocks"`` (its KV blocks
                cannot be allocated).
            costs_s: seconds per mode and candidate, as for :meth:`choose_preemption`.
            default_mode: the spec's ``preemption_mode``.

        Default: ``None`` (vLLM V1 never preempts for a waiting request).
        """
        return None

    def token_budget(self, default: int) -> int:
        """Tokens per step; default the spec's ``max_num_batched_tokens``."""
        return default

    def chunk_limit(self, prompt_tokens: int, computed_tokens: int, batch_tokens: int,
                    batch_attn_pairs: float, batch_kv_tokens: int) -> int | None:
        """Largest chunk for one prefill this step (``None``: no policy limit).

        Args:
            prompt_tokens: the request's prompt length.
            computed_tokens: tokens already in its KV cache.
            batch_tokens, batch_attn_pairs, batch_kv_tokens: the step planned so far (decodes
                and earlier chunks), in the cost model's terms (``CostModel.step_time_s``).
        """
        return None

    def choose_migrations(self, table: FeatureTable, hbm_available_blocks: int, hbm_capacity_blocks: int,
                          pnm_available_blocks: int) -> np.ndarray | None:
        """Rows of ``table`` (GPU-resident decoding requests) to migrate to PNM now, in order.

        Called at the start of every step when ``uses_pnm`` and the spec has a PNM tier. The
        instance starts the copies in the given order while the PNM pool has room. Default: none.
        """
        return None

    def migration_free_steps(self, ctx_tokens: np.ndarray, hbm_available_blocks: np.ndarray,
                             pnm_available_blocks: int, hbm_capacity_blocks: int, block_size_tokens: int) -> int:
        """How many of the next identical decode steps :meth:`choose_migrations` would move nobody.

        Args:
            ctx_tokens: KV tokens of the GPU-resident decodes at the start of the next step; they
                grow by one per step.
            hbm_available_blocks: free + evictable HBM blocks at the start of each next step,
                shape ``(k,)`` (only the first ``k`` steps are asked about).
            pnm_available_blocks: free PNM blocks now (it only shrinks during such steps).
            hbm_capacity_blocks, block_size_tokens: the HBM pool's size and the block size.

        Returns an int ``m`` in ``[0, k]``: a lower bound is always safe (the stretch is only
        shorter). Default: ``k`` (a policy that never migrates).
        """
        return len(hbm_available_blocks)

    def on_request_finished(self, now_s: float, arrival_s: float, first_token_s: float,
                            prompt_tokens: int, generated_tokens: int) -> None:
        """Feedback when a request completes (times in s)."""


POLICIES: Registry[type] = Registry("policy", sort_names=True)
"""The registered scheduler policies by name (filled when :mod:`kvsched.policies` is imported)."""


def register(name: str) -> Callable[[type], type]:
    """Class decorator adding a policy to :data:`POLICIES` under ``name``."""
    return POLICIES.register(name)


def make_policy(name: str, params: PolicyParams | dict | None = None) -> SchedulerPolicy:
    """Instantiate the registered policy ``name`` (``params`` as its dataclass or a dict).

    Raises:
        UnknownPresetError: if ``name`` is not registered (the message lists known names).
        ConfigError: if a params dict has unknown keys or invalid values.
    """
    from kvsched import policies as _p  # noqa: F401  (registers the built-in policies)

    name = POLICIES.canonical(name)  # messages name the registered policy, not what was typed
    cls = POLICIES.get(name)
    if isinstance(params, dict):
        from dataclasses import fields

        pcls = getattr(cls, "params_cls", PolicyParams)
        allowed = {f.name for f in fields(pcls)}
        unknown = set(params) - allowed
        if unknown:
            raise ConfigError(f"policy {bounded_repr(name)}: unknown parameters "
                              f"{bounded_repr(sorted(unknown, key=str))}; "
                              f"allowed: {sorted(allowed)}")
        params = pcls(**params)
    return cls(params)


def policy_names() -> list[str]:
    """Names of the registered policies."""
    from kvsched import policies as _p  # noqa: F401

    return POLICIES.names()
