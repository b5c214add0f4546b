"""Admission preemption: may a blocked waiting request push a running one out of HBM?

When the head of the admission order cannot get KV blocks, vLLM V1 stops admitting and waits
(``schedule()`` breaks out of its waiting loop; REFERENCE.md §4.1). vLLM V0 under
``--scheduling-policy priority`` instead preempts lower-priority running requests for it
(``Scheduler._schedule_priority_preemption``, vllm/core/scheduler.py, v0.6). The project's brief
(§ "Preemption and the KV cache eviction cost it is meant to avoid") states when that pays: only
if reloading or recomputing the evicted blocks costs less than the delay the victim was causing
by sitting in HBM; at long contexts without a lower tier it stops paying. Three modes
(``PolicyParams.admission_preemption``):

* ``"never"``: vLLM V1 (the default everywhere).
* ``"always"``: the ordering instinct. The blocked head preempts the running request holding
  the most HBM blocks among the long ones (``admission_victim_min_tokens``) longer than it whose
  blocks make it fit.
* ``"cost-gated"`` (kvsched's rule, **[inferred]** from the brief and REFERENCE.md §5.4): the same
  candidates, but a victim is preempted only when the predicted delay removed exceeds the
  predicted delay added, both in request-seconds:

  - delay removed = sum over the waiting requests the victim's blocks would admit now
    (admission order, while blocks and seats last; the instance shows only those the step's
    token budget can still admit) of the time each would otherwise wait for
    blocks: the running requests' predicted remaining times, sorted, until the blocks they
    free cover that request's shortfall;
  - delay added = the victim's displacement (until the admitted requests finish: the longest
    of their predicted service times) + its reload cost (recompute = predicted re-prefill;
    swap/offload = copy out and back in, REFERENCE.md §5.4) + the reload cost borne by others:
    a recompute adds its prefill to the GPU's work, so every other running and waiting request
    is delayed by it; a swap-out is synchronous (the step waits for it, vLLM V0), and so is a
    swap-in without prefetch, each delaying the other running requests.

A request's remaining time is its remaining prefill (``CostModel.prefill_time_s``) plus its
expected remaining output times the current decode step time (``CostModel.decode_step_time_s``
of the running batch). The expected remaining output is exact under oracle lengths; otherwise
it is the mean residual life of the output lengths of the last ``window`` finished requests,
``E[O - g | O > g]`` (kvsched's choice), and ``g`` itself (the request has decoded ``g`` tokens:
as many again) while no finished request was longer, at least one token. Each request can be
preempted this way at most ``max_admission_preemptions`` times, so a long request cannot be
pushed out forever and preemptions cannot cascade.
"""

from __future__ import annotations

from kvsched.envs.sim.errors import bounded_repr

from collections import deque

import numpy as np

from kvsched.envs.sim.features import FeatureTable

#: Values of ``PolicyParams.admission_preemption``.
ADMISSION_PREEMPTION_MODES = ("never", "always", "cost-gated")
#: The standard preemption modes (an extra tier adds its own, ``TierSpec.preemption_mode``);
#: migration to PNM is the ``pnm`` policy's, never an admission preemption's.
_MODES = ("recompute", "swap", "offload")


class OutputLengthHistory:
    """Output lengths (tokens) of the last ``window`` finished requests of one instance.

    What a real scheduler can know about output lengths: those of requests that have finished.
    """

    def __init__(self, window: int = 4096) -> None:
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={bounded_repr(window)} must be an int >= 1")
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: np.ndarray | None = None
        self._suffix: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, output_tokens: int) -> None:
        """Record one finished request's output length (tokens)."""
        self._recent.append(int(output_tokens))
        self._sorted = None

    def expected_remaining(self, generated_tokens: np.ndarray) -> np.ndarray:
        """Expected remaining output tokens, ``E[O - g | O > g]``, per entry of ``g``.

        Args:
            generated_tokens: tokens each request has decoded so far, shape ``(n,)``, int.

        Returns:
            float64 array of shape ``(n,)``, each >= 1: the mean residual over recorded lengths
            above ``g``, or ``max(g, 1)`` when none is above ``g``.
        """
        g = np.asarray(generated_tokens, dtype=np.float64)
        if self._sorted is None and self._recent:
            self._sorted = np.sort(np.fromiter(self._recent, np.float64, count=len(self._recent)))
            self._suffix = np.concatenate([np.cumsum(self._sorted[::-1])[::-1], [0.0]])
        fallback = np.maximum(g, 1.0)
        if self._sorted is None:
            return fallback
        idx = np.searchsorted(self._sorted, g, side="right")
        above = self._sorted.size - idx
        with np.errstate(invalid="ignore", divide="ignore"):
            residual = self._suffix[idx] / above - g
        return np.where(above > 0, np.maximum(residual, 1.0), fallback)


def remaining_time_s(cost, total_tokens: np.ndarray, computed_tokens: np.ndarray, remaining_output: np.ndarray,
                     decode_step_s: float) -> np.ndarray:
    """Predicted seconds until each request finishes: remaining prefill + decode.

    Args:
        cost: the instance's :class:`~kvsched.envs.sim.cost_model.CostModel`.
        total_tokens: prompt + generated tokens per request, shape ``(n,)``.
        computed_tokens: tokens already in its KV cache, shape ``(n,)``.
        remaining_output: expected output tokens still to decode, shape ``(n,)``.
        decode_step_s: seconds of one decode step of the current batch.

    Returns:
        float64 array of shape ``(n,)``. Only requests with more than one token left to
        compute pay a prefill (``CostModel.prefill_time_s``, element by element).
    """
    done = np.minimum(computed_tokens, total_tokens)
    pending = total_tokens - done > 1
    prefill = np.zeros(len(total_tokens))
    if pending.any():
        prefill[pending] = cost.prefill_time_s(total_tokens[pending], done[pending])
    return prefill + remaining_output * decode_step_s


def choose_admission_preemption(policy, running: FeatureTable, eligible: np.ndarray, freed_blocks: np.ndarray,
                                waiting: FeatureTable, waiting_blocks: np.ndarray, available_blocks: int,
                                seats: int, costs_s: dict[str, np.ndarray],
                                default_mode: str) -> tuple[int, str] | None:
    """The victim row of ``running`` and the mode, or ``None`` (keep waiting); see the module doc.

    Args:
        policy: the deciding :class:`~kvsched.policies.base.SchedulerPolicy` (its ``params``,
            ``ctx.cost`` and ``output_history``).
        running: every running request (admission order).
        eligible: bool, shape ``(len(running),)``: rows that may be preempted (in HBM, not
            loading, below ``max_admission_preemptions``, longer than the blocked head).
        freed_blocks: HBM blocks each row would make available, shape ``(len(running),)``.
        waiting: the blocked head and the waiting requests behind it that the step's remaining
            token budget could still admit, in admission order.
        waiting_blocks: HBM blocks each waiting row needs for its prompt, shape ``(len(waiting),)``.
        available_blocks: HBM blocks available now (free + evictable) for the head.
        seats: running slots left (``max_num_seqs`` minus running).
        costs_s: seconds per mode and row, as for ``choose_preemption`` (``inf``: infeasible).
        default_mode: the spec's ``preemption_mode``.
    """
    p = policy.params
    rows = np.flatnonzero(eligible & (freed_blocks + available_blocks >= waiting_blocks[0]))
    if rows.size == 0:
        return None
    mode_of, reload_s = _reload_modes(p.tier_aware_preemption, rows, len(running), costs_s, default_mode)
    if p.admission_preemption == "always":
        r = int(rows[np.argmax(freed_blocks[rows])])  # the largest holder: frees the most
        return r, mode_of[r]

    # the waiting requests each candidate's blocks would admit now (admission order)
    cum = np.cumsum(waiting_blocks)
    ks = np.minimum(np.searchsorted(cum, available_blocks + freed_blocks[rows], side="right"), seats + 1)
    kmax = int(ks.max())
    if kmax == 0:
        return None
    t_run, t_wait = _remaining_times(policy, running, waiting, kmax)
    n_running, n_waiting = len(running), len(waiting)
    best, best_gain = None, 0.0
    for r, k in zip(rows.tolist(), ks.tolist()):
        if k == 0:
            continue
        removed = _delay_removed(r, t_run, freed_blocks, cum[:k] - available_blocks)
        added = _delay_added(mode_of[r], reload_s[r], float(t_wait[:k].max()), n_running, n_waiting,
                             p.prefetch)
        gain = removed - added
        if gain > best_gain:
            best, best_gain = int(r), gain
    return None if best is None else (best, mode_of[best])


def _reload_modes(tier_aware: bool, rows: np.ndarray, n_running: int, costs_s: dict[str, np.ndarray],
                  default_mode: str) -> tuple:
    """How each candidate row would be preempted and what bringing it back costs.

    Args:
        tier_aware: ``PolicyParams.tier_aware_preemption``: the cheapest mode per row; otherwise
            ``default_mode`` with the instance's fallbacks (:func:`_fallback_chain`: a swap
            that finds no room falls back to NVMe and the later tiers, then to recompute).
        rows: candidate rows of ``running``, int array.
        n_running: rows of ``running``.
        costs_s: seconds per mode and row (``inf``: infeasible), each of shape ``(n_running,)``.
        default_mode: the spec's ``preemption_mode``.

    Returns:
        ``(mode_of, reload_s)``: the mode of row ``r`` is ``mode_of[r]`` (a list over every row
        when tier-aware, else a dict over the candidates) and its reload cost ``reload_s[r]``
        (s, float64 array of shape ``(n_running,)``, set for the candidates).
    """
    modes = [m for m in costs_s if m != "migrate"]  # recompute, then each lower tier's mode in tier order
    if tier_aware:
        cost = np.vstack([costs_s[m] for m in modes])
        pick = np.argmin(cost, axis=0)
        return [modes[int(k)] for k in pick], cost[pick, np.arange(cost.shape[1])]
    chain = _fallback_chain(default_mode, modes)
    mode_of, reload_s = {}, np.empty(n_running)
    for r in rows.tolist():  # only the candidates' modes are ever used
        m = next(m for m in chain if m in costs_s and np.isfinite(costs_s[m][r]))
        mode_of[r] = m
        reload_s[r] = costs_s[m][r]
    return mode_of, reload_s


def _fallback_chain(default_mode: str, modes: list[str]) -> tuple[str, ...]:
    """The modes a preemption in ``default_mode`` ends up in, in the order the instance tries them
    (``KVManager.swap_tiers``): its own tier, then every later tier holding swapped blocks (tier
    order, as the keys of ``costs_s``; a tier without capacity is absent), then recompute.

    A default mode whose tier has no capacity is absent from ``modes``: swap then starts at NVMe,
    offload at the extra tiers, an extra tier's mode at recompute.
    """
    lower = [m for m in modes if m != "recompute"]
    if default_mode in lower:
        later = lower[lower.index(default_mode):]
    elif default_mode in _MODES[1:]:  # swap / offload without room in their tier's capacity
        later = lower if default_mode == "swap" else [m for m in lower if m != "swap"]
    else:
        later = []
    return (*later, "recompute")


def _remaining_times(policy, running: FeatureTable, waiting: FeatureTable,
                     kmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds until each running request and each of the first ``kmax`` waiting
    requests finishes (:func:`remaining_time_s` at the current batch's decode step time).

    Remaining output is exact under oracle lengths (at least one token for a waiting request),
    else the policy's :class:`OutputLengthHistory` estimate.

    Returns:
        ``(t_run, t_wait)``: float64 arrays of shapes ``(len(running),)`` and ``(kmax,)``.
    """
    cost_model = policy.ctx.cost
    history = policy.output_history
    w_total = (waiting.prompt_tokens + waiting.generated_tokens)[:kmax]
    w_generated = waiting.generated_tokens[:kmax]
    if running.oracle_lengths:
        rem_run = np.maximum(running.output_tokens - running.generated_tokens, 0).astype(np.float64)
        rem_wait = np.maximum(waiting.output_tokens[:kmax] - w_generated, 1).astype(np.float64)
    else:
        rem_run = history.expected_remaining(running.generated_tokens)
        rem_wait = history.expected_remaining(w_generated)
    ctx = running.computed_tokens
    decode_step_s = float(cost_model.decode_step_time_s(len(running), int(ctx.sum())))
    t_run = remaining_time_s(cost_model, running.prompt_tokens + running.generated_tokens, ctx, rem_run,
                             decode_step_s)
    t_wait = remaining_time_s(cost_model, w_total, waiting.computed_tokens[:kmax], rem_wait, decode_step_s)
    return t_run, t_wait


def _delay_removed(r: int, t_run: np.ndarray, freed_blocks: np.ndarray, short: np.ndarray) -> float:
    """Request-seconds of waiting saved by preempting running row ``r`` now.

    Without the preemption, waiting request ``j`` waits until the other running requests,
    finishing in order of their remaining times ``t_run`` (s), have freed its shortfall
    ``short[j]`` (blocks; <= 0: it fits now), and at most until ``r`` itself finishes and frees
    its blocks (``t_run[r]``).

    Args:
        r: the candidate victim's row.
        t_run: remaining seconds of every running request, shape ``(n_running,)``.
        freed_blocks: HBM blocks each running request frees, shape ``(n_running,)``.
        short: blocks each waiting request the victim would admit still lacks, shape ``(k,)``.
    """
    others = np.delete(np.arange(len(t_run)), r)
    order = others[np.argsort(t_run[others], kind="stable")]
    freed_by = np.concatenate([[0], np.cumsum(freed_blocks[order])])
    finish_s = np.concatenate([[0.0], t_run[order]])
    idx = np.searchsorted(freed_by, short, side="left")
    wait_s = np.where(idx < freed_by.size, finish_s[np.minimum(idx, freed_by.size - 1)], np.inf)
    wait_s = np.minimum(np.where(short > 0, wait_s, 0.0), t_run[r])
    return float(wait_s.sum())


def _delay_added(mode: str, reload_s: float, displacement_s: float, n_running: int, n_waiting: int,
                 prefetch: bool) -> float:
    """Request-seconds of delay a preemption in ``mode`` adds (see the module doc).

    The victim's displacement ``displacement_s`` (the longest predicted service time of the
    requests it admits) plus its reload ``reload_s`` (s) plus the reload borne by others: a
    recompute delays every other running and waiting request by its prefill; a swap delays the
    other running requests by its copy out and, without prefetch, its copy back in (half the
    reload each).
    """
    if mode == "recompute":
        collateral = reload_s * (n_running - 1 + n_waiting)
    else:
        half = reload_s / 2.0
        collateral = half * (n_running - 1) * (1 if prefetch else 2)
    return displacement_s + reload_s + collateral
