"""Retention decisions for lower-tier prefix caches: how long a conversation's cached prefix stays.

The tiered prefix cache (:mod:`.prefix_offload`) evicts by a fixed order per tier (LRU, LFU,
session-aware, or the clairvoyant reference). A *retention decision*, taken when a request
finishes, overrides that order for the request's conversation in every listed tier
(:meth:`.prefix_offload.PrefixTiers.retain`):

============  =====================================================================================
``default``   the conversation's keep is lifted; the tier's eviction order decides (other
              conversations' keeps stay)
``keep``      the segments of the request's prompt stored in the tiers (shared prefixes another
              conversation wrote included: a hit needs the whole leading run) and the entries the
              conversation wrote, later ones too, leave the eviction order for ``keep_s`` seconds;
              a write nobody keeps never evicts a kept entry; a kept write, a swap-in or a tier of
              kept entries only evicts the earliest deadline first, a prefix's tail first
``drop``      the entries the conversation wrote that nobody keeps are evicted from every listed
              tier now (no demotion): frees room for others; shared prefixes others wrote stay
``demote``    those of them in the first listed tier move to the next now (DRAM -> NVMe)
============  =====================================================================================

The decision's ``hbm`` part applies to the HBM copies of the request's prompt segments (cached and
referenced by nobody), which otherwise age in vLLM's LRU free queue:

=================  ================================================================================
``lru``            the default: vLLM's LRU order (a keep an earlier decision of the conversation
                   gave them ends; segments another conversation keeps stay kept until its deadline)
``keep``           with ``kind="keep"``: out of the LRU order for ``keep_s`` too, evicted only when
                   HBM holds nothing else evictable, never refusing an allocation; a reuse ends it
``evict_first``    to the LRU head, the prompt's tail first: HBM reuses their blocks before any
                   other's (the copies below stay, per the write policy; those another
                   conversation keeps stay kept)
=================  ================================================================================

A *prefetch decision*, taken when a request arrives whose cached prefix lies partly in a tier
below the first listed one, copies those segments up to the first tier before the request is
admitted (:meth:`.prefix_offload.PrefixTiers.prefetch`; ``kvsched/Residency-v0`` with
``prefetch=True``).

This is the action space of ``kvsched/Residency-v0`` (:mod:`kvsched.envs.residency_env`); the
session-aware heuristic is ``keep`` with a fixed time (the conversation's expected think time,
in the spirit of CachedAttention's (Gao et al., USENIX ATC 2024, section 3.3) and Mooncake's
(Qin et al., FAST 2025, section 6) conversation-aware placement), LRU is ``default`` under an
LRU tier. The clairvoyant order (Belady) is the reference for what knowing the future is worth.

The core owns this vocabulary; the caller (an environment, a script) decides. Decisions are
taken between events: the cluster stops (``DecisionWatch(residency=True)``) after the event in
which requests finished, at that time, so a request that finished inside a fast-forwarded decode
stretch is decided at the stretch's end [kvsched choice: the lower tiers change inside a stretch
only by its own writes].
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import require

#: the kinds of retention decision (see the module docstring)
RETENTION_KINDS: tuple[str, ...] = ("default", "drop", "demote", "keep")
#: what a retention decision does with the request's HBM copies (see the module docstring)
HBM_CHOICES: tuple[str, ...] = ("lru", "keep", "evict_first")


@dataclass(frozen=True)
class RetentionDecision:
    """One retention decision for a finished request's conversation.

    Attributes:
        kind: one of :data:`RETENTION_KINDS`.
        keep_s: with ``kind="keep"``, seconds from the decision (> 0); 0 otherwise.
        hbm: one of :data:`HBM_CHOICES` (default ``lru``, vLLM's order); ``keep`` only with
            ``kind="keep"``.

    Raises:
        ConfigError: an unknown kind or HBM choice, a keep time that is not > 0 with ``keep``
            (0 otherwise), or ``hbm="keep"`` with another kind.
    """

    kind: str = "default"
    keep_s: float = 0.0
    hbm: str = "lru"

    def __post_init__(self) -> None:
        require(self.kind in RETENTION_KINDS, "RetentionDecision.kind", self.kind,
                f"one of {', '.join(RETENTION_KINDS)}")
        k = self.keep_s
        ok = isinstance(k, (int, float)) and not isinstance(k, bool) and k == k and k != float("inf")
        require(ok and (k > 0 if self.kind == "keep" else k == 0), "RetentionDecision.keep_s", k,
                "a finite number of seconds > 0 with kind 'keep', 0 otherwise")
        require(self.hbm in HBM_CHOICES and (self.hbm != "keep" or self.kind == "keep"), "RetentionDecision.hbm",
                self.hbm, f"one of {', '.join(HBM_CHOICES)} ('keep' only with kind 'keep')")

    @property
    def label(self) -> str:
        """``default``, ``drop``, ``demote`` or ``keep <s>s``, then ``+hbm`` (HBM kept too) or
        ``, hbm first`` (HBM evicts them first)."""
        base = f"keep {self.keep_s:g}s" if self.kind == "keep" else self.kind
        return base + {"lru": "", "keep": " +hbm", "evict_first": ", hbm first"}[self.hbm]
