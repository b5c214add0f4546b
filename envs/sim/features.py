"""The FeatureTable: what every scheduling policy (heuristic or learned) may see.

A real scheduler knows a request's arrival time, prompt length, its scheduling priority (vLLM's
``Request.priority``, ``vllm/v1/request.py``), how many tokens it has computed and generated so
far, where its KV blocks are and how many, and how often it was preempted. It does **not** know
the output length until the request finishes; the table
exposes ``output_tokens`` only when the scenario enables oracle lengths (otherwise the column
is ``-1``).

Columns are NumPy arrays built lazily on first access, so a policy that keeps queue order
(FCFS) never pays for them. Row ``i`` describes ``states[i]``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Sequence

import numpy as np

from .request import RequestState

#: Tier codes of the standard tier list (the index in ``InstanceSpec.tiers``; -1: none). An
#: instance with extra tiers passes its own (``KVManager.tier_codes``).
TIER_CODES = {"hbm": 0, "dram": 1, "nvme": 2, "pnm": 3, "": -1}


class cached_column:  # noqa: N801  (used as a decorator, like functools.cached_property)
    """``functools.cached_property`` without its lock: computed on first access, then stored in
    the instance ``__dict__`` (which shadows this non-data descriptor). Python 3.11's version
    takes an ``RLock`` on every first access (~1 us), paid by every column of every table a
    policy reads; tables are never shared between threads."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


class FeatureTable:
    """Per-request features of a set of requests at time ``now_s``.

    Args:
        states: the requests (waiting, running or swapped) the decision is about.
        now_s: simulated time in seconds.
        oracle_lengths: expose true output lengths (scenario flag ``oracle_lengths``).
        running: the ``running`` column when the caller knows it (default: from the states).
        tier_codes: tier name -> code of the ``tier`` column (default :data:`TIER_CODES`; the
            index of the tier in the instance's tier list).
        prefix_lookup: request -> tokens its prefix-cache lookup would hit in HBM now (the
            instance's :meth:`~.kv_manager.KVManager.cached_prefix_tokens`); called only when a
            policy reads ``cached_prefix_tokens`` (default: none, the column is 0).

    Columns (each ``np.ndarray`` of shape ``(len(states),)``): ``request_id`` (int64),
    ``arrival_s``, ``wait_s`` (now - arrival), ``prompt_tokens``, ``computed_tokens``,
    ``generated_tokens``, ``to_compute_tokens``, ``hbm_blocks``, ``lower_blocks``, ``tier``,
    ``running`` (bool), ``tier`` (where its KV lives: the tier's index in the instance's tier
    list, 0 HBM, 1 DRAM, 2 NVMe, then extra tiers, then PNM; 3 for PNM with the standard list),
    ``pnm_blocks`` (KV blocks in the PNM tier), ``preemptions``, ``priority`` (int64, the
    request's scheduling priority, lower is served earlier; 0 unless the workload gives one, vLLM's
    default), ``output_tokens`` (-1 unless oracle), ``cached_prefix_tokens`` (tokens whose KV is
    cached in HBM now: the leading run of its prompt's prefix segments a prefix-cache lookup would
    hit if it were admitted now, as vLLM's ``get_computed_blocks`` or SGLang's ``match_prefix``, at
    least one token left to compute; a running row's lookup finds its own computed segments too),
    ``prefix_segment_tokens`` and ``prefix_hashes`` (object: a tuple per row) of its prompt's
    cacheable segments.
    """

    def __init__(self, states: Sequence[RequestState], now_s: float, oracle_lengths: bool = False,
                 running: np.ndarray | None = None, tier_codes: dict[str, int] | None = None,
                 prefix_lookup: Callable[[RequestState], int] | None = None):
        self._states = states  # private: policies read the columns, never the raw states
        self.now_s = now_s
        self.oracle_lengths = oracle_lengths
        self._running = running
        self._tier_codes = TIER_CODES if tier_codes is None else tier_codes
        self._prefix_lookup = prefix_lookup

    @cached_column
    def running(self) -> np.ndarray:
        """True for rows already running (an unfinished prefill), False for waiting rows."""
        if self._running is not None:
            return self._running
        return np.fromiter((s.status == 1 for s in self._states), bool, count=len(self._states))

    def __len__(self) -> int:
        return len(self._states)

    def _col(self, attr: str, dtype=np.int64) -> np.ndarray:
        # map(attrgetter) iterates in C: ~2x faster than a generator expression for small tables
        return np.fromiter(map(attrgetter(attr), self._states), dtype=dtype, count=len(self._states))

    @cached_column
    def request_id(self) -> np.ndarray:
        return self._col("rid")

    @cached_column
    def arrival_s(self) -> np.ndarray:
        return self._col("arrival_s", np.float64)

    @cached_column
    def wait_s(self) -> np.ndarray:
        return self.now_s - self.arrival_s

    @cached_column
    def prompt_tokens(self) -> np.ndarray:
        return self._col("prompt_tokens")

    @cached_column
    def computed_tokens(self) -> np.ndarray:
        return self._col("computed")

    @cached_column
    def generated_tokens(self) -> np.ndarray:
        return self._col("generated")

    @cached_column
    def to_compute_tokens(self) -> np.ndarray:
        return self.prompt_tokens + self.generated_tokens - self.computed_tokens

    @cached_column
    def hbm_blocks(self) -> np.ndarray:
        return np.fromiter((s.shared_blocks + s.private_blocks for s in self._states), np.int64,
                           count=len(self._states))

    @cached_column
    def lower_blocks(self) -> np.ndarray:
        return self._col("lower_blocks")

    @cached_column
    def tier(self) -> np.ndarray:
        codes = self._tier_codes
        pnm = codes["pnm"]
        return np.fromiter((pnm if s.on_pnm else codes[s.lower_tier] if s.lower_tier else 0
                            for s in self._states), np.int8, count=len(self._states))

    @cached_column
    def pnm_blocks(self) -> np.ndarray:
        return self._col("pnm_blocks")

    @cached_column
    def preemptions(self) -> np.ndarray:
        return self._col("preemptions")

    @cached_column
    def priority(self) -> np.ndarray:
        return self._col("priority")

    @cached_column
    def cached_prefix_tokens(self) -> np.ndarray:
        """Computed on first access only (one prefix-cache lookup per row): building the table
        stays as cheap as before for every policy that does not read it."""
        lookup = self._prefix_lookup
        if lookup is None:
            return np.zeros(len(self._states), dtype=np.int64)
        return np.fromiter(map(lookup, self._states), dtype=np.int64, count=len(self._states))

    @cached_column
    def prefix_segment_tokens(self) -> np.ndarray:
        """Tokens per prefix segment (the trace's hash block; 0 without prefix hashes)."""
        return self._col("seg_tokens")

    @cached_column
    def prefix_hashes(self) -> np.ndarray:
        """Object column: each row's chained hashes of the prompt segments a prefix cache could
        hold (a tuple; equal hashes mean equal prompts up to that segment, as vLLM's chained
        block hashes -- what a scheduler knows from the token ids)."""
        out = np.empty(len(self._states), dtype=object)
        for i, s in enumerate(self._states):
            out[i] = s.hashes[:s.n_cacheable_segments]
        return out

    @cached_column
    def output_tokens(self) -> np.ndarray:
        if not self.oracle_lengths:
            return np.full(len(self._states), -1, dtype=np.int64)
        return self._col("output_tokens")
