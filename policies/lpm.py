"""Longest prefix match first: SGLang's ``--schedule-policy lpm``.

Waiting requests are admitted in decreasing order of the prompt tokens whose KV is already in the
prefix cache (the ``FeatureTable.cached_prefix_tokens`` column: the hit a lookup would give if
the request were admitted now), so requests that reuse cached context go first and the cache is
used while it still holds their prefix. Mirrors SGLang's ``SchedulePolicy.calc_priority``
(``python/sglang/srt/managers/schedule_policy.py``; read at commit 00550cd of the public repo):

- ``_sort_by_longest_prefix`` sorts the waiting list in place by ``-num_matched_prefix_tokens``
  with Python's stable sort: ties keep the list's order. SGLang's list keeps the order its last
  sort left, new arrivals (and retracted requests, ``_add_request_to_queue``) joining its end; this
  policy keeps that order between decisions too (``self._rank``), so ties and the fall-back below
  follow it, not the instance's arrival-ordered queue.
- ``_determine_active_policy``: with more than 128 waiting requests, LPM turns into FCFS ("Turn
  off the expensive prefix matching and sorting when the #queue is large"), which leaves the list
  as it is (no sort): :attr:`LPMParams.fcfs_above_waiting`.
- ``_compute_prefix_matches`` (in-batch prefix caching): a request whose own cache hit is at most
  ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` (32) tokens is matched against the prompts of the
  requests before it in the list; if it shares at least
  ``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`` (32) tokens with one of them it is
  deprioritised (sorted last, key ``inf``), else its prompt joins that in-queue tree. Of several
  waiting requests with the same uncached prefix one goes first and computes it; the others
  then hit the cache. Here prompts are compared by their chained prefix-segment hashes
  (``prefix_hashes``; SGLang matches token ids), so a shared run counts whole segments.

Everything else (preemption victim, token budget, chunking) is vLLM's default, as the base class.
SGLang also counts host-cache (HiCache) hits in ``num_matched_prefix_tokens``; kvsched's lower
tiers hold no prefix cache, so the HBM hit is the whole match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable

from .base import PolicyParams, SchedulerPolicy, register


@dataclass(frozen=True)
class LPMParams(PolicyParams):
    """Parameters of :class:`LongestPrefixMatch` (SGLang's constants; ``schedule_policy.py``).

    Attributes:
        fcfs_above_waiting: with more waiting requests than this, no sort (FCFS); 128
            (``_determine_active_policy``: ``len(waiting_queue) > 128``).
        in_batch_check_tokens: requests whose cache hit is at most this many tokens are checked
            for a prefix shared with requests ahead of them; 32
            (``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD``; -1 turns the check off, as in SGLang).
        in_batch_deprioritize_tokens: a shared run of at least this many tokens sorts the request
            last; 32 (``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD``).
    """

    fcfs_above_waiting: int = 128
    in_batch_check_tokens: int = 32
    in_batch_deprioritize_tokens: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("fcfs_above_waiting", 0), ("in_batch_check_tokens", -1),
                          ("in_batch_deprioritize_tokens", 0)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                require(False, f"LPMParams.{name}", v, f"an integer >= {low}")


@register("lpm")
class LongestPrefixMatch(SchedulerPolicy):
    """Admit the waiting request with the longest cached prefix first (SGLang ``lpm``)."""

    params_cls = LPMParams
    # the order follows the prefix cache, which changes without arrivals or completions (a decode
    # allocating a block evicts an LRU segment): no fast-forward past a blocked waiting queue
    order_is_static = False

    def __init__(self, params: LPMParams | None = None) -> None:
        super().__init__(params)
        #: (request id, preemptions) -> position in the order the last decision left (SGLang's
        #: waiting list); a request preempted since then comes back as new, at the end
        self._rank: dict[tuple[int, int], int] = {}

    def order_waiting(self, table: FeatureTable) -> np.ndarray:
        n = len(table)
        keys = list(zip(table.request_id.tolist(), table.preemptions.tolist()))
        rank = self._rank
        end = len(rank)
        # SGLang's list: the last order, then requests it has not seen, in the instance's order
        pos = np.fromiter((rank.get(k, -1) for k in keys), dtype=np.int64, count=n)
        new = pos < 0
        pos[new] = end + np.flatnonzero(new)
        listed = np.argsort(pos, kind="stable")
        p: LPMParams = self.params
        if n > p.fcfs_above_waiting:
            order = listed  # FCFS: the list as it is
        else:
            matched = table.cached_prefix_tokens
            late = np.zeros(n, dtype=bool)
            if p.in_batch_check_tokens >= 0:
                late[list(self._deprioritized(p, table, listed.tolist(), matched))] = True
            # stable: ties keep the list's order; deprioritized rows last (SGLang's key inf)
            order = listed[np.lexsort((np.arange(n), -matched[listed], late[listed]))]
        self._rank = {keys[r]: i for i, r in enumerate(order.tolist())}
        return order

    @staticmethod
    def _deprioritized(p: LPMParams, table: FeatureTable, listed: list[int], matched: np.ndarray) -> set[int]:
        """Rows whose uncached prefix a request ahead in the list shares (SGLang's in-batch
        prefix caching, ``_compute_prefix_matches``)."""
        hashes = table.prefix_hashes
        seg = table.prefix_segment_tokens
        seen: set = set()  # chained segment hashes of the prompts inserted so far
        late: set[int] = set()
        for r in listed:
            if matched[r] > p.in_batch_check_tokens:
                continue
            shared = 0
            for h in hashes[r]:
                if h not in seen:
                    break
                shared += 1
            if shared * int(seg[r]) >= p.in_batch_deprioritize_tokens:
                late.add(r)
            else:
                seen.update(hashes[r])
        return late
