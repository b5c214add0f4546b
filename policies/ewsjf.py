"""EWSJF: length-partitioned admission queues, density-weighted scores, Bayesian meta-tuning.

Source: Sidik, Levi, Kampeas, "EWSJF: An Adaptive Scheduler with Hybrid Partitioning for
Mixed-Workload LLM Inference", KDD 2026, arXiv 2601.21758 (abstract), and the vLLM fork it
links (``vllm/v1/core/sched/ewsjf_scheduler/scheduler.py``, ``scoring.py``,
``waiting_queue.py``), as summarised in REFERENCE.md §2.1-2.3. EWSJF is a *request-level*
scheduler upstream of vLLM's iteration-level batching: running requests are still scheduled
first with vLLM's token budget (the instance does that); EWSJF only decides which waiting
requests are offered cache residency, and in which order, through
:meth:`EWSJF.order_waiting`.

Mechanisms (each with its source):

* **Queues by prompt length** [src code, REFERENCE §2.2]. Waiting requests live in FIFO
  queues, each covering a closed range ``[lo, hi]`` of prompt lengths (tokens). Start:
  ``initial_queues`` non-removable queues of ``initial_queue_width`` tokens,
  ``[0, w-1], [w, 2w-1], ...`` (the code's ``initialize_queues``). A prompt length that falls
  in no queue creates one (``WaitingQueue._add_queue``): as wide as the queue below it,
  centred on the length where possible, and clipped so that it overlaps neither neighbour.
  (The code's fallback "ensure minimum range" can overlap a neighbour; REFERENCE §2.2 says
  clipped, which we follow.) A removable queue that was empty for ``empty_queue_threshold``
  consecutive scoring cycles is deleted while more than one queue remains
  (``_update_scores``).
* **FIFO inside a queue; preempted requests at its front** (``prepend_request``) [src code].
* **Score** of a queue = score of its head request [src code; cost term inferred]::

      partial = (1 + w * ln(L + 1)) * step / (floor(L / step) + 1)      # scoring.py
      score   = wait / normalized_cost * partial
      normalized_cost = T_hat(head) / median(T_hat of recent heads)     # [inferred]

  with ``L`` the head's prompt tokens, ``wait = now - arrival`` (s), ``T_hat`` the cost
  model's predicted prefill time of the tokens the head must compute
  (:meth:`~kvsched.envs.sim.cost_model.CostModel.prefill_time_s`, s), and "recent heads" the
  last :data:`HEAD_HISTORY` requests that became the head of a queue. The public code uses a
  1.0 placeholder for ``normalized_cost``; the paper calls the score *density-weighted*;
  REFERENCE §2.3 proposes this ratio [inferred]. Within one cycle the median is common to all
  queues, so it scales scores over time and does not reorder queues; the ``T_hat(head)``
  factor adds a second, cost-based size penalty on top of the bucketed SJF term. The
  ``wait`` factor is linear ageing: every head's score grows without bound, so a long request
  is eventually admitted however short the competition.
* **Admission** [src code, extended]. The best queue (highest score; ties to the queue of
  shorter prompts, as the code's strict ``>`` over queues sorted by lower bound) is offered
  first, in FIFO order. The code stops there, even when the token budget is not used up; we
  then offer the other non-empty queues, by descending score, each in FIFO order, so that
  the budget and free KV are not wasted on an idle step. The instance admits in this order
  until the budget, ``max_num_seqs`` or KV runs out (vLLM stops at the first request whose KV
  allocation fails, as the code's ``new_blocks is None: break``).
* **Scoring cycle.** The code rescores every ``schedule()`` call; here every
  :meth:`order_waiting` call is one cycle (the instance calls it at each step that may
  admit, i.e. when requests are waiting). Empty-queue counts advance only in cycles.
* **Bayesian meta-optimisation** [inferred, REFERENCE §2.3; paper abstract component 4].
  Every ``meta_window_s`` of simulated time (the clock is the ``now`` of
  :meth:`order_waiting` and :meth:`on_request_finished`; no wall clock), an Optuna ask/tell
  study (``TPESampler(seed=params.seed)``) is told the closing window's objective::

      objective = completed / meta_window_s  -  meta_lambda * mean_TTFT_short    # req/s

  (completed requests in the window; mean TTFT over requests with prompt
  ``< meta_short_prompt_tokens`` that completed in it, 0 when there were none) and proposes
  the next ``(w, step_size)``: ``w`` in [0, 2], ``step_size`` in {50, 100, 200, 400, 800}
  (REFERENCE §2.3 tuning ranges; ``params.step_size`` is added to the choices if absent).
  The first window runs with the configured ``(weighting_factor, step_size)`` (enqueued as
  trial 0). A window in which nothing completed carries no information and is told as a
  failed trial. Windows start at the first time the policy sees; a stretch of several windows
  without any call closes the current window and starts the one containing the new ``now``.
  Optuna's own log is lowered to WARNING (``optuna.logging.set_verbosity``), a process-wide
  setting, so that every trial does not print.

Policies read only the :class:`~kvsched.envs.sim.features.FeatureTable` (request id,
arrival, prompt, tokens to compute, preemptions), never the hidden output length.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Mapping

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable

from .base import PolicyParams, SchedulerPolicy, SearchDim, register

#: Meta-optimisation search space (REFERENCE §2.3 "Tuning ranges for Optuna").
W_RANGE: tuple[float, float] = (0.0, 2.0)
STEP_CHOICES: tuple[int, ...] = (50, 100, 200, 400, 800)
#: How many recent queue heads the median prefill time is taken over [inferred].
HEAD_HISTORY = 256
_EPS_S = 1e-9  # floor of predicted prefill times (s), guards a division by zero


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
        and math.isfinite(float(v))


@dataclass(frozen=True)
class EWSJFParams(PolicyParams):
    """Parameters of EWSJF (validated at construction).

    Attributes:
        weighting_factor: ``w`` of the fairness term ``1 + w ln(L+1)``; >= 0. Default 0.5:
            ``SimpleScoreCalculator(weighting_factor=0.5)`` in the fork's ``scoring.py``
            (REFERENCE §2.2).
        step_size: bucket width (tokens) of the SJF term ``step / (floor(L/step) + 1)``;
            integer >= 1. Default 200: the fork's scheduler default (REFERENCE §2.2).
        initial_queues: number of initial, non-removable queues; integer >= 1. Default 10:
            ``initialize_queues(num_queues=10)`` (REFERENCE §2.2).
        initial_queue_width: prompt tokens per initial queue; integer >= 1. Default 100: the
            method's default ``step_size`` (REFERENCE §2.2; the Ascend variant of the fork
            passes the scheduler's step_size, 200, instead).
        empty_queue_threshold: consecutive empty scoring cycles before a removable queue is
            deleted; integer >= 1. Default 20 (REFERENCE §2.2; one variant of the fork uses 30).
        meta_optimize: re-tune ``(w, step_size)`` online with Optuna (REFERENCE §2.3,
            [inferred]).
        meta_window_s: simulated seconds per meta-optimisation window; > 0. Default 30 s
            [inferred] (REFERENCE §2.3: "every N completions (or T seconds)").
        meta_lambda: weight of the short-request mean TTFT (s) against throughput (req/s) in
            the objective, in (req/s)/s; >= 0. Default 1.0 [inferred].
        meta_short_prompt_tokens: requests with fewer prompt tokens count as short in the
            objective; integer >= 1. Default 8192, kvsched's length-class boundary
            (``MetricsConfig.long_prompt_tokens``).
        seed: seed of Optuna's ``TPESampler``; integer in [0, 2**32). ``kvsched compare``
            sets it to the run's scenario seed unless given explicitly.

    Raises:
        ConfigError: a field out of range (naming the field, the value and what is allowed).
    """

    #: ``kvsched tune`` space: REFERENCE §2.3 "Tuning ranges for Optuna" (w in [0, 2], step in
    #: {50, ..., 800}, empty_queue_threshold in [5, 100], initial queues in [2, 20]); the
    #: online meta-optimiser's on/off switch, window and lambda (kvsched choice).
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "weighting_factor": SearchDim("float", W_RANGE[0], W_RANGE[1], source="REFERENCE §2.3"),
        "step_size": SearchDim("categorical", choices=STEP_CHOICES, source="REFERENCE §2.3"),
        "empty_queue_threshold": SearchDim("int", 5, 100, source="REFERENCE §2.3"),
        "initial_queues": SearchDim("int", 2, 20, source="REFERENCE §2.3"),
        "meta_optimize": SearchDim("categorical", choices=(True, False), source="kvsched choice"),
        "meta_window_s": SearchDim("float", 10.0, 120.0, log=True, source="kvsched choice"),
        "meta_lambda": SearchDim("float", 0.0, 5.0, source="kvsched choice"),
    }

    weighting_factor: float = 0.5
    step_size: int = 200
    initial_queues: int = 10
    initial_queue_width: int = 100
    empty_queue_threshold: int = 20
    meta_optimize: bool = True
    meta_window_s: float = 30.0
    meta_lambda: float = 1.0
    meta_short_prompt_tokens: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(_is_num(self.weighting_factor) and self.weighting_factor >= 0,
                "EWSJFParams.weighting_factor", self.weighting_factor, "a finite number >= 0")
        for name in ("step_size", "initial_queues", "initial_queue_width", "empty_queue_threshold",
                     "meta_short_prompt_tokens"):
            v = getattr(self, name)
            require(_is_int(v) and v >= 1, f"EWSJFParams.{name}", v, "an integer >= 1")
        require(isinstance(self.meta_optimize, bool), "EWSJFParams.meta_optimize", self.meta_optimize,
                "true or false")
        require(_is_num(self.meta_window_s) and self.meta_window_s > 0, "EWSJFParams.meta_window_s",
                self.meta_window_s, "a finite number > 0 (simulated seconds)")
        require(_is_num(self.meta_lambda) and self.meta_lambda >= 0, "EWSJFParams.meta_lambda",
                self.meta_lambda, "a finite number >= 0")
        require(_is_int(self.seed) and 0 <= self.seed < 2 ** 32, "EWSJFParams.seed", self.seed,
                "an integer in [0, 2**32)")


class LengthQueue:
    """One FIFO queue of waiting request ids covering prompt lengths ``[lo, hi]`` (tokens).

    Attributes:
        lo, hi: inclusive bounds (tokens).
        removable: ``False`` for the initial queues (never pruned).
        items: request ids, head first.
        empty_cycles: consecutive scoring cycles in which the queue was empty.
        score: the head's score in the last cycle (0.0 when empty).
    """

    __slots__ = ("lo", "hi", "removable", "items", "empty_cycles", "score")

    def __init__(self, lo: int, hi: int, removable: bool) -> None:
        self.lo, self.hi, self.removable = int(lo), int(hi), removable
        self.items: deque[int] = deque()
        self.empty_cycles = 0
        self.score = 0.0

    def __repr__(self) -> str:
        return f"LengthQueue([{self.lo}, {self.hi}], n={len(self.items)}, score={self.score:.3g})"


@dataclass(frozen=True)
class MetaWindow:
    """One closed meta-optimisation window (all times in simulated seconds).

    Attributes:
        start_s, end_s: the window ``[start_s, end_s)``.
        weighting_factor, step_size: the parameters used during it.
        completed: requests that completed in it.
        short_completed: short ones among them.
        short_mean_ttft_s: their mean TTFT (s), ``None`` when there were none.
        objective: the value told to Optuna (``None``: told as a failed trial).
    """

    start_s: float
    end_s: float
    weighting_factor: float
    step_size: int
    completed: int
    short_completed: int
    short_mean_ttft_s: float | None
    objective: float | None


@register("ewsjf")
class EWSJF(SchedulerPolicy):
    """Length-partitioned FIFO queues, best-score queue first, online (w, step) tuning."""

    params_cls = EWSJFParams
    order_is_static = False  # scores grow with waiting time

    def __init__(self, params: EWSJFParams | None = None) -> None:
        super().__init__(params)
        p: EWSJFParams = self.params
        #: parameters in force (changed by the meta-optimiser)
        self.weighting_factor = float(p.weighting_factor)
        self.step_size = int(p.step_size)
        width = p.initial_queue_width
        self.queues: list[LengthQueue] = [LengthQueue(i * width, (i + 1) * width - 1, False)
                                          for i in range(p.initial_queues)]
        self._los = [q.lo for q in self.queues]
        self._queue_of: dict[int, LengthQueue] = {}  # request id -> its queue
        self._cost_s: dict[int, float] = {}  # request id -> predicted prefill time (s)
        self._in_history: set[int] = set()  # request ids already counted as recent heads
        self._head_costs: deque[float] = deque()  # the last HEAD_HISTORY head costs (s), oldest first
        self._head_sorted: list[float] = []  # the same values, sorted (for the median)
        self._prefill_memo: dict[int, float] = {}
        self.cycles = 0
        self.queues_created = 0
        self.queues_pruned = 0
        # meta-optimisation state
        self.meta_history: list[MetaWindow] = []
        self._study = None
        self._trial = None
        self._window_start: float | None = None
        self._window_end = math.inf
        self._done = 0
        self._short_done = 0
        self._short_ttft_sum = 0.0

    # ------------------------------------------------------------------------------ set-up
    def bind(self, ctx) -> None:
        super().bind(ctx)
        if self.params.meta_optimize and self._study is None:
            self._start_study()

    def _start_study(self) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        p: EWSJFParams = self.params
        self._steps = tuple(sorted(set(STEP_CHOICES) | {p.step_size}))
        iid = getattr(self.ctx, "instance_id", 0) if self.ctx is not None else 0
        self._study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.TPESampler(seed=p.seed),
            study_name=f"ewsjf-meta-instance{iid}")
        self._study.enqueue_trial({"weighting_factor": min(max(p.weighting_factor, W_RANGE[0]), W_RANGE[1]),
                                   "step_size": p.step_size})
        self._ask()
        # the configured w is used as given even if it lies outside the search range
        self.weighting_factor = float(p.weighting_factor)

    def _ask(self) -> None:
        self._trial = self._study.ask()
        self.weighting_factor = float(self._trial.suggest_float("weighting_factor", *W_RANGE))
        self.step_size = int(self._trial.suggest_categorical("step_size", self._steps))

    # ------------------------------------------------------------------------------ queues
    def queue_bounds(self) -> list[tuple[int, int]]:
        """``[(lo, hi), ...]`` of the current queues in ascending order (tokens)."""
        return [(q.lo, q.hi) for q in self.queues]

    def queue_of_length(self, prompt_tokens: int) -> LengthQueue:
        """The queue covering ``prompt_tokens``, created if none does (see module docstring)."""
        L = int(prompt_tokens)
        k = bisect_right(self._los, L) - 1
        if k >= 0 and self.queues[k].hi >= L:
            return self.queues[k]
        prev = self.queues[k] if k >= 0 else None
        nxt = self.queues[k + 1] if k + 1 < len(self.queues) else None
        width = (prev.hi - prev.lo + 1) if prev is not None else self.params.initial_queue_width
        lo = L - width // 2
        if prev is not None:
            lo = max(prev.hi + 1, lo)
        lo = max(0, lo)
        hi = lo + width - 1
        if nxt is not None:
            hi = min(nxt.lo - 1, hi)
        q = LengthQueue(lo, hi, True)
        self.queues.insert(k + 1, q)
        self._los.insert(k + 1, lo)
        self.queues_created += 1
        return q

    def _remove_queue(self, q: LengthQueue) -> None:
        i = self.queues.index(q)
        del self.queues[i]
        del self._los[i]
        self.queues_pruned += 1

    def _sync(self, table: FeatureTable) -> dict[int, int]:
        """Bring the queues in line with the waiting set in ``table``; returns id -> row."""
        rids = table.request_id.tolist()
        row_of = {rid: i for i, rid in enumerate(rids)}
        if len(row_of) != len(rids):
            raise ValueError("EWSJF: the waiting FeatureTable holds a request id twice")
        gone = [rid for rid in self._queue_of if rid not in row_of]
        for rid in gone:  # admitted since the last cycle
            self._queue_of.pop(rid).items.remove(rid)
            del self._cost_s[rid]
            self._in_history.discard(rid)
        new = [i for i, rid in enumerate(rids) if rid not in self._queue_of]
        if new:
            prompt = table.prompt_tokens
            pre = table.preemptions
            todo = table.to_compute_tokens
            # preempted requests go to the front of their queue, keeping their relative order
            for i in reversed([i for i in new if pre[i] > 0]):
                q = self.queue_of_length(prompt[i])
                q.items.appendleft(rids[i])
                self._queue_of[rids[i]] = q
            for i in new:
                if pre[i] == 0:
                    q = self.queue_of_length(prompt[i])
                    q.items.append(rids[i])
                    self._queue_of[rids[i]] = q
            for i, t in zip(new, self.predicted_prefill_s(todo[new])):
                self._cost_s[rids[i]] = t
        return row_of

    def predicted_prefill_s(self, tokens: np.ndarray) -> list[float]:
        """T_hat: predicted seconds of a lone prefill of each ``tokens`` entry (cost model; memoised).

        Args:
            tokens: 1-D integer array of tokens to compute (prompt + generated - computed).

        Raises:
            RuntimeError: the policy was not bound to an instance (no cost model).
        """
        if self.ctx is None:
            raise RuntimeError("EWSJF: bind(PolicyContext) before scheduling (the cost model predicts "
                               "prefill times)")
        memo = self._prefill_memo
        keys = [int(t) for t in tokens]
        missing = sorted({k for k in keys if k not in memo})
        if missing:
            times = np.atleast_1d(self.ctx.cost.prefill_time_s(np.asarray(missing, dtype=np.int64)))
            if len(memo) > 100_000:  # bound memory on very long runs
                memo.clear()
            memo.update(zip(missing, (float(t) for t in times)))
        return [memo[k] for k in keys]

    # ------------------------------------------------------------------------------ score
    def partial_score(self, prompt_tokens: int) -> float:
        """``(1 + w ln(L+1)) * step / (floor(L/step) + 1)`` with the parameters in force."""
        L = int(prompt_tokens)
        return (1.0 + self.weighting_factor * math.log(L + 1)) * self.step_size / (L // self.step_size + 1)

    def score(self, prompt_tokens: int, wait_s: float, normalized_cost: float = 1.0) -> float:
        """EWSJF score ``wait / normalized_cost * partial`` (dimension 1/s * tokens; only ratios matter)."""
        return wait_s / normalized_cost * self.partial_score(prompt_tokens)

    def _remember_head_cost(self, cost_s: float) -> None:
        if len(self._head_costs) == HEAD_HISTORY:
            old = self._head_costs.popleft()
            del self._head_sorted[bisect_left(self._head_sorted, old)]
        self._head_costs.append(cost_s)
        insort(self._head_sorted, cost_s)

    def median_head_cost_s(self) -> float:
        """Median predicted prefill time (s) of the last :data:`HEAD_HISTORY` queue heads (>= 1e-9)."""
        v, n = self._head_sorted, len(self._head_sorted)
        if not n:
            return 1.0
        m = v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
        return max(m, _EPS_S)

    def _score_cycle(self, table: FeatureTable, row_of: dict[int, int]) -> list[LengthQueue]:
        """Score every queue head, prune long-empty queues; returns non-empty queues, best first."""
        self.cycles += 1
        thr = self.params.empty_queue_threshold
        wait = table.wait_s
        prompt = table.prompt_tokens
        live: list[LengthQueue] = []
        for q in list(self.queues):
            if not q.items:
                q.score = 0.0
                if q.removable:
                    q.empty_cycles += 1
                    if q.empty_cycles >= thr and len(self.queues) > 1:
                        self._remove_queue(q)
                continue
            q.empty_cycles = 0
            head = q.items[0]
            if head not in self._in_history:
                self._in_history.add(head)
                self._remember_head_cost(self._cost_s[head])
            live.append(q)
        median = self.median_head_cost_s()
        for q in live:
            head = q.items[0]
            i = row_of[head]
            norm = max(self._cost_s[head], _EPS_S) / median
            q.score = self.score(int(prompt[i]), float(wait[i]), norm)
        # highest score first; ties to the queue of shorter prompts (code: strict > in lo order)
        live.sort(key=lambda q: -q.score)
        return live

    def order_waiting(self, table: FeatureTable) -> np.ndarray:
        """Admission order: best queue FIFO, then the other queues by score, each FIFO.

        One scoring cycle: drop requests that left the waiting set (admitted), route new ones
        to their queue (creating queues as needed; preempted ones to the front), score every
        head at ``table.now_s``, prune long-empty queues, and advance the meta-optimisation
        clock.

        Args:
            table: the waiting requests (rows in the instance's queue order).

        Returns:
            int64 array of shape ``(len(table),)``: a permutation of the rows.

        Raises:
            ValueError: a request id appears twice in ``table``.
            RuntimeError: called before :meth:`bind`.
        """
        self._tick(table.now_s)
        row_of = self._sync(table)
        order = [row_of[rid] for q in self._score_cycle(table, row_of) for rid in q.items]
        return np.asarray(order, dtype=np.int64)

    # ------------------------------------------------------------------------------ meta
    def on_request_finished(self, now_s: float, arrival_s: float, first_token_s: float,
                            prompt_tokens: int, generated_tokens: int) -> None:
        """Count a completion in the current meta window (TTFT = first_token_s - arrival_s)."""
        if not self.params.meta_optimize:
            return
        self._tick(now_s)
        self._done += 1
        if prompt_tokens < self.params.meta_short_prompt_tokens:
            self._short_done += 1
            self._short_ttft_sum += first_token_s - arrival_s

    def _tick(self, now: float) -> None:
        if not self.params.meta_optimize:
            return
        if self._study is None:  # used without bind (unit tests)
            self._start_study()
        W = float(self.params.meta_window_s)
        if self._window_start is None:
            self._window_start, self._window_end = now, now + W
            return
        if now < self._window_end:
            return
        self._close_window()
        skipped = math.floor((now - self._window_end) / W)
        self._window_start = self._window_end + skipped * W
        self._window_end = self._window_start + W
        if self._window_end <= now:  # float rounding at a boundary
            self._window_start, self._window_end = now, now + W

    def _close_window(self) -> None:
        from optuna.trial import TrialState

        p: EWSJFParams = self.params
        short_mean = self._short_ttft_sum / self._short_done if self._short_done else None
        if self._done:
            value = self._done / p.meta_window_s - p.meta_lambda * (short_mean or 0.0)
            self._study.tell(self._trial, value)
        else:
            value = None
            self._study.tell(self._trial, state=TrialState.FAIL)
        self.meta_history.append(MetaWindow(
            start_s=float(self._window_start), end_s=float(self._window_end),
            weighting_factor=self.weighting_factor, step_size=self.step_size, completed=self._done,
            short_completed=self._short_done, short_mean_ttft_s=short_mean, objective=value))
        self._done = self._short_done = 0
        self._short_ttft_sum = 0.0
        self._ask()
