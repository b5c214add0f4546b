"""Medha's LARS (Length-Aware Relative Slack) with adaptive chunking -- ``medha_lars_inferred``.

Source: Agrawal et al., "Medha" / "No Request Left Behind" (arXiv 2409.17264, v4-v5 abstracts),
as specified in REFERENCE.md §1.2-1.3. The LARS equations and the adaptive-chunk rule could not
be read from the paper; this is the project's **[inferred]** reconstruction, consistent with
the abstract: chunked prefills interruptible at chunk boundaries, deadline- and length-aware
priority recomputed every step, decodes never paused (stall-free batching), long requests
never starved.

Ordering. For each prefill candidate (running partial prefills and waiting requests) at time t:

    T_hat(len, done) = predicted time of the remaining prefill (cost model)
    deadline  = arrival + max(ttft_floor_s, kappa * T_hat(prompt, 0))   # length-aware SLO
    remaining = T_hat(prompt, done)
    slack     = deadline - t - remaining
    relative  = slack / max(norm, eps_s),  norm = remaining ("remaining") or T_hat(prompt, 0) ("total")

ascending ``relative`` first. Long prefills yield to short ones with less relative slack, but
their deadlines keep approaching, so they are not starved.

Late requests (slack < 0) rank before all on-time ones by *absolute* lateness, most late first
(earliest deadline first). [inferred] Dividing a negative slack by the remaining work would
make a late short request look ever more urgent than a late long one, so under sustained
overload the long one would starve (a test shows it); by lateness, a waiting long request's
rank keeps rising until it runs.

Adaptive chunking (§1.3). The chunk of a prefill with ``p`` cached tokens is the largest
``c`` (a multiple of ``chunk_multiple_tokens``) whose step, together with everything already
planned in the batch (decodes first, then earlier chunks), stays within ``tbt_target_s``; clamped to
``[min_chunk_tokens, max_chunk_tokens]``. Chunks start large and shrink as ``p`` grows,
because attention over the cached context grows.

T_hat is the roofline step time of the remaining tokens as one pass plus one per-step overhead
per extra chunk: the FLOPs and KV traffic of chunked and unchunked prefills are equal
(REFERENCE §5.3), only per-step overheads differ.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable

from .base import PolicyParams, SchedulerPolicy, SearchDim, register


@dataclass(frozen=True)
class LARSParams(PolicyParams):
    """Parameters of LARS (REFERENCE §1.2-1.3; ranges there are the tuning space).

    Attributes:
        kappa: TTFT SLO scale over the predicted isolated prefill time (2-5 suggested). > 0, finite.
        ttft_floor_s: smallest TTFT deadline; REFERENCE §1.2 suggests 0.25-1 s, the default
            takes the low end so interactive prompts are served well inside a 1 s TTFT SLO. > 0, finite.
        eps_s: guard against division by ~0 remaining work (s). > 0, finite.
        normalize: "remaining" (slack per unit of remaining work) or "total".
        adaptive_chunking: size chunks from the TBT target; otherwise no policy cap.
        tbt_target_s: per-step time target that bounds co-batched decodes' TBT (s). > 0, finite.
        min_chunk_tokens: chunk floor (REFERENCE §1.3 suggests 32; the brief says ~40).
        max_chunk_tokens: chunk ceiling (tokens).
        chunk_multiple_tokens: chunks are multiples of this (block size 16); <= max_chunk_tokens.
    """

    #: ``kvsched tune`` space: kappa, ttft_floor_s, the normalisation (REFERENCE §1.2 "tunable:
    #: kappa 2-5, ttft_floor 0.25-1 s, normalisation"; widened to 1.5-6 and 0.1-1 s), the TBT
    #: target (kvsched choice, 20-200 ms around the 50 ms default) and the chunk floor
    #: (REFERENCE §1.3: tunable in [16, 256], block multiples).
    SEARCH_SPACE: ClassVar[Mapping[str, SearchDim]] = {
        "kappa": SearchDim("float", 1.5, 6.0, source="REFERENCE §1.2 (2-5), widened"),
        "ttft_floor_s": SearchDim("float", 0.1, 1.0, log=True, source="REFERENCE §1.2 (0.25-1 s), widened"),
        "normalize": SearchDim("categorical", choices=("remaining", "total"), source="REFERENCE §1.2"),
        "tbt_target_s": SearchDim("float", 0.02, 0.2, log=True, source="kvsched choice"),
        "min_chunk_tokens": SearchDim("int", 16, 256, step=16, source="REFERENCE §1.3 ([16, 256])"),
    }

    kappa: float = 3.0
    ttft_floor_s: float = 0.25
    eps_s: float = 1e-3
    normalize: str = "remaining"
    adaptive_chunking: bool = True
    tbt_target_s: float = 0.05
    min_chunk_tokens: int = 32
    max_chunk_tokens: int = 8192
    chunk_multiple_tokens: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_own()

    @classmethod
    def validator_for(cls, changed: frozenset):
        """Only LARS's own fields changed (the ``kvsched/Knobs-v0`` knobs): their checks and the
        chunk relation, the inherited fields being those of a validated instance; else (or for a
        subclass, which may check more) the full validation."""
        if cls is LARSParams and changed <= _OWN_FIELDS:
            return LARSParams._validate_own
        return super().validator_for(changed)

    def _validate_own(self) -> None:
        """The checks of LARS's own fields (all of them, min <= max chunk and multiple <= max
        chunk: together they leave at least one chunk candidate)."""
        # messages are built only on failure, and the common types take one test each: the
        # Knobs-v0 environment builds parameters every step
        for name in ("kappa", "ttft_floor_s", "eps_s", "tbt_target_s"):
            v = getattr(self, name)
            if type(v) is not float or not 0.0 < v < math.inf:  # NaN takes the full check (and fails it)
                if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
                    require(False, f"LARSParams.{name}", v, "a finite number > 0")
        if self.normalize not in ("remaining", "total"):
            require(False, "LARSParams.normalize", self.normalize, "'remaining' or 'total'")
        if self.adaptive_chunking is not True and self.adaptive_chunking is not False:
            require(False, "LARSParams.adaptive_chunking", self.adaptive_chunking, "true or false")
        for name in ("min_chunk_tokens", "max_chunk_tokens", "chunk_multiple_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                    require(False, f"LARSParams.{name}", v, "an integer >= 1 (tokens)")
        if self.min_chunk_tokens > self.max_chunk_tokens:
            require(False, "LARSParams.min_chunk_tokens", self.min_chunk_tokens,
                    f"<= max_chunk_tokens ({self.max_chunk_tokens})")
        if self.chunk_multiple_tokens > self.max_chunk_tokens:  # else no chunk candidate
            require(False, "LARSParams.chunk_multiple_tokens", self.chunk_multiple_tokens,
                    f"<= max_chunk_tokens ({self.max_chunk_tokens})")


#: the fields LARSParams declares itself, not inherited from PolicyParams (its ``_validate_own``
#: checks them)
_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(LARSParams)) - \
    frozenset(f.name for f in dataclasses.fields(PolicyParams))


@functools.lru_cache(maxsize=1024)
def _chunk_candidates(lo: int, max_tokens: int, multiple: int) -> np.ndarray:
    """``np.arange(lo, max_tokens + 1, multiple)`` as read-only float64, cached: ``kvsched/Knobs-v0``
    sets ``max_chunk_tokens`` every interval, and its range holds ~500 values (a few KB each)."""
    c = np.arange(lo, max_tokens + 1, multiple, dtype=np.float64)
    c.flags.writeable = False
    return c


@register("lars")
class LARS(SchedulerPolicy):
    """Length-aware relative slack ordering of prefills, adaptive chunks, decodes never paused."""

    params_cls = LARSParams
    stall_free = True
    order_is_static = False  # slack depends on time

    def bind(self, ctx) -> None:
        super().bind(ctx)
        self._chunk_overhead_s = float(ctx.spec.cost.step_overhead_s)
        self._budget = ctx.spec.token_budget
        self.set_params(self.params)  # last: a subclass's set_params may read the context's values

    def set_params(self, params: LARSParams) -> None:
        """New parameters between decisions: only the chunk candidates derive from them (the
        step overhead and token budget come from the bound context, which is unchanged).

        The candidates (tokens, float64, ascending, shape ``(n,)``, ``n >= 1`` as validation
        keeps min <= max) are the multiples of ``chunk_multiple_tokens`` from
        ``min_chunk_tokens`` (rounded down to a multiple, at least one) to ``max_chunk_tokens``;
        read-only, shared through :func:`_chunk_candidates`' cache."""
        self.params = params
        m = params.chunk_multiple_tokens
        self._candidates = _chunk_candidates(max(m, (params.min_chunk_tokens // m) * m), params.max_chunk_tokens, m)

    def predicted_prefill_s(self, prompt_tokens: np.ndarray, done_tokens: np.ndarray) -> np.ndarray:
        """T_hat(len, done): seconds to finish the prefill of ``prompt - done`` tokens (arrays)."""
        n = np.maximum(prompt_tokens - done_tokens, 0).astype(np.float64)
        p = done_tokens.astype(np.float64)
        cost = self.ctx.cost
        if cost.parallel is None:
            t = cost.step_time_s(n, n * (p + n / 2.0), p + n)
        else:  # long-context parallelism: the pass streams through the stages (SPP)
            t = cost.prefill_pass_time_s(prompt_tokens, done_tokens)
        extra_chunks = np.maximum(np.ceil(n / self._budget) - 1.0, 0.0)
        return t + extra_chunks * self._chunk_overhead_s

    def relative_slack(self, table: FeatureTable) -> np.ndarray:
        """Priority key of every row: relative slack (s per s) when on time, else lateness (s, < 0)."""
        p = self.params
        prompt = table.prompt_tokens
        # tokens still to prefill: a recompute-preempted request re-prefills its output too
        total = prompt + table.generated_tokens
        t_total = self.predicted_prefill_s(total, np.zeros_like(total))
        remaining = self.predicted_prefill_s(total, table.computed_tokens)
        deadline = table.arrival_s + np.maximum(p.ttft_floor_s, p.kappa * t_total)
        slack = deadline - table.now_s - remaining
        norm = remaining if p.normalize == "remaining" else t_total
        # late requests: absolute lateness (EDF among the late), ahead of every on-time one
        return np.where(slack >= 0, slack / np.maximum(norm, p.eps_s), slack)

    def order_prefills(self, table: FeatureTable) -> np.ndarray:
        # most urgent first; ties by arrival (stable)
        return np.lexsort((table.arrival_s, self.relative_slack(table)))

    def order_waiting(self, table: FeatureTable) -> np.ndarray:
        return self.order_prefills(table)

    def chunk_limit(self, prompt_tokens: int, computed_tokens: int, batch_tokens: int,
                    batch_attn_pairs: float, batch_kv_tokens: int) -> int | None:
        p = self.params
        if not p.adaptive_chunking:
            return None
        c = self._candidates
        pc = float(computed_tokens)
        t = self.ctx.cost.step_times_fast(batch_tokens + c, batch_attn_pairs + c * (pc + c / 2.0),
                                          batch_kv_tokens + pc + c)
        ok = np.flatnonzero(t <= p.tbt_target_s)
        if not len(ok):
            return int(c[0])  # the floor: a prefill always progresses
        return int(c[ok[-1]])
