"""Processing-near-memory (PNM) placement and run-time migration of long-context decodes.

Source: REFERENCE.md §3 ("NELSSA-style policy spec", **[inferred]**: no paper of that name was
found; the spec is reconstructed from CXL-PNM, arXiv 2511.00321, L3, arXiv 2504.17584, and PAM,
arXiv 2602.11521). Long-context requests are placed on the PNM tier, or migrated there at run
time, so their decode attention runs near memory and their KV leaves HBM: the GPU decode batch
grows and short requests find cache space sooner. Eviction never happens for them, so there is
no reload or recompute to pay later.

Rules (checked at the start of every step, over GPU-resident decoding requests):

1. **Placement / length trigger** (§3.2): migrate when ``predicted_total_ctx >= L_pnm``, with
   ``predicted_total_ctx = prompt + est_output`` where ``est_output`` is the true output length
   under oracle lengths, else ``max(generated, est_output_tokens)``. A prompt at or above the
   threshold is therefore placed on PNM as soon as its prefill (on the GPU, where it is compute-
   bound) has finished; a shorter one migrates when its context grows past the threshold.
2. **Low-watermark trigger** (§3.2): when free HBM blocks fall below ``low_watermark_fraction``
   of the HBM pool, migrate more decoding requests, largest context first (§3.2 "choose victims
   by largest ctx first"), until the blocks they hold cover the shortfall; only requests with at
   least ``watermark_min_context_tokens`` of context (moving a short context costs a link
   operation and per-step RPCs for little HBM).

Copies run in the background over the GPU<->PNM link (DMA, no CPU on the path); a request does
not decode while its KV is in flight (kvsched's choice: §3.2 keeps it decoding on the GPU with
double buffering, which would need two copies of its KV). Everything else (admission order,
preemption victim) is vLLM FCFS. Requires an instance spec with a PNM tier (``pnm:``); without
one the policy is FCFS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.envs.sim.errors import require
from kvsched.envs.sim.features import FeatureTable

from .base import PolicyParams, SchedulerPolicy, register


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class PNMParams(PolicyParams):
    """Parameters of the PNM policy (plus the policy-wide options of :class:`PolicyParams`).

    Attributes:
        length_threshold_tokens: ``L_pnm``, tokens of predicted total context at which a request
            goes to PNM; 32768 (REFERENCE §3.2 default 32k, range 16k-256k, **[inferred]**).
        low_watermark_fraction: share of HBM KV blocks below which free HBM triggers more
            migrations; 0.05 (REFERENCE §3.2: 5-10 % of KV blocks, **[inferred]**). 0 turns the
            watermark trigger off.
        watermark_min_context_tokens: smallest context the watermark trigger moves; 8192 (kvsched's
            choice, the long-prompt class boundary of the metrics, **[inferred]**).
        est_output_tokens: output tokens assumed for a request whose output length is hidden
            (``est_output_len`` of §3.2); 0 (kvsched's choice: only the context seen so far counts).
        max_pnm_attention_s: if set, migrate only while the PNM devices' decode attention over all
            PNM-resident KV (``CostModel.pnm_attention_time_s`` of the blocks in use there plus the
            candidate's) stays within this many seconds per step; None (default, as REFERENCE §3.2,
            which has no such guard). kvsched's extension **[inferred]**: a hybrid step lasts
            ``max(GPU part, PNM attention)``, so past the GPU part PNM attention slows every request
            in the batch (one 200 GB/s card reads ~1/17 as fast as H100 HBM, REFERENCE §3.1).

    Raises:
        ConfigError: a threshold < 1, a fraction outside [0, 1), or a negative token count.
    """

    length_threshold_tokens: int = 32768
    low_watermark_fraction: float = 0.05
    watermark_min_context_tokens: int = 8192
    est_output_tokens: int = 0
    max_pnm_attention_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        o = "PNMParams"
        require(_is_int(self.length_threshold_tokens) and self.length_threshold_tokens >= 1,
                f"{o}.length_threshold_tokens", self.length_threshold_tokens, "an integer >= 1")
        f = self.low_watermark_fraction
        require(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f < 1,
                f"{o}.low_watermark_fraction", f, "a number in [0, 1)")
        for name in ("watermark_min_context_tokens", "est_output_tokens"):
            v = getattr(self, name)
            require(_is_int(v) and v >= 0, f"{o}.{name}", v, "an integer >= 0")
        m = self.max_pnm_attention_s
        require(m is None or (isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m < float("inf")),
                f"{o}.max_pnm_attention_s", m, "None or a finite number of seconds > 0")


@register("pnm")
class PNMMigration(SchedulerPolicy):
    """FCFS scheduling plus length-threshold placement and watermark migration to PNM."""

    params_cls = PNMParams
    order_is_static = True
    uses_pnm = True

    def _predicted_total(self, table: FeatureTable) -> np.ndarray:
        if table.oracle_lengths:
            return table.prompt_tokens + table.output_tokens
        return table.prompt_tokens + np.maximum(table.generated_tokens, self.params.est_output_tokens)

    def choose_migrations(self, table: FeatureTable, hbm_available_blocks: int, hbm_capacity_blocks: int,
                          pnm_available_blocks: int) -> np.ndarray | None:
        """Rows to migrate: length-triggered ones (largest context first), then watermark ones.

        Only rows whose KV fits in the PNM pool together with the rows before them are returned.
        """
        p = self.params
        bs = self.ctx.spec.block_size_tokens
        ctx = table.computed_tokens
        # room for the KV and the next token: a request that could not grow on PNM would be
        # preempted there before emitting a token, and could come back forever (livelock)
        need = -(-(ctx + 1) // bs)
        by_ctx = np.argsort(-ctx, kind="stable")
        triggered = self._predicted_total(table) >= p.length_threshold_tokens
        chosen = [int(r) for r in by_ctx if triggered[r]]
        wm = int(np.ceil(p.low_watermark_fraction * hbm_capacity_blocks))
        if hbm_available_blocks < wm:
            shortfall = wm - hbm_available_blocks - int(table.hbm_blocks[chosen].sum())
            taken = set(chosen)
            for r in by_ctx:
                if shortfall <= 0:
                    break
                r = int(r)
                if r not in taken and ctx[r] >= p.watermark_min_context_tokens:
                    chosen.append(r)
                    shortfall -= int(table.hbm_blocks[r])
        out, room = [], pnm_available_blocks
        pnm_tokens = (self.ctx.spec.num_pnm_blocks - pnm_available_blocks) * bs
        for r in chosen:
            if need[r] <= room and self._within_attention_budget(pnm_tokens + int(need[r]) * bs):
                out.append(r)
                room -= int(need[r])
                pnm_tokens += int(need[r]) * bs
        return np.asarray(out, dtype=np.int64) if out else None

    def _within_attention_budget(self, pnm_tokens) -> np.ndarray | bool:
        if self.params.max_pnm_attention_s is None:
            return True
        return self.ctx.cost.pnm_attention_time_s(pnm_tokens) <= self.params.max_pnm_attention_s

    def migration_free_steps(self, ctx_tokens: np.ndarray, hbm_available_blocks: np.ndarray,
                             pnm_available_blocks: int, hbm_capacity_blocks: int, block_size_tokens: int) -> int:
        """Steps before either trigger could fire (a lower bound; see the base class).

        A request whose KV does not fit in the PNM pool now never will within such steps (its KV
        grows, the pool only fills), so only fitting requests are considered. Their
        ``prompt + generated`` is ``ctx + 1`` and grows by one per step (the length trigger);
        fixed predictions (oracle or ``est_output_tokens``) were judged at the current step.
        """
        p = self.params
        k = len(hbm_available_blocks)
        need = -(-(ctx_tokens + 1) // block_size_tokens)  # as choose_migrations: KV plus the next token
        # the PNM pool only fills and the candidates only grow: what fails now fails later
        fits = (need <= pnm_available_blocks) & self._within_attention_budget(
            (self.ctx.spec.num_pnm_blocks - pnm_available_blocks + need) * block_size_tokens)
        if k == 0 or not fits.any():
            return k
        top = int(ctx_tokens[fits].max())
        first = max(0, p.length_threshold_tokens - 1 - top)
        wm = int(np.ceil(p.low_watermark_fraction * hbm_capacity_blocks))
        eligible_from = max(0, p.watermark_min_context_tokens - top)
        low = np.flatnonzero(hbm_available_blocks[eligible_from:] < wm)
        if low.size:
            first = min(first, eligible_from + int(low[0]))
        return min(first, k)
