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


@dataclass(frozen=True)
class RetentionDecision:
    """One retention decision for a finished request's conversation.

    Attributes:
        kind: one of :data:`RETENTION_KINDS`.
        keep_s: with ``kind="keep"``, seconds from the decision (> 0); 0 otherwise.

    Raises:
        ConfigError: an unknown kind, or a keep time that is not > 0 with ``keep`` (0 otherwise).
    """

    kind: str = "default"
    keep_s: float = 0.0

    def __post_init__(self) -> None:
        require(self.kind in RETENTION_KINDS, "RetentionDecision.kind", self.kind,
                f"one of {', '.join(RETENTION_KINDS)}")
        k = self.keep_s
        ok = isinstance(k, (int, float)) and not isinstance(k, bool) and k == k and k != float("inf")
        require(ok and (k > 0 if self.kind == "keep" else k == 0), "RetentionDecision.keep_s", k,
                "a finite number of seconds > 0 with kind 'keep', 0 otherwise")

    @property
    def label(self) -> str:
        """``default``, ``drop``, ``demote`` or ``keep <s>s``."""
        return f"keep {self.keep_s:g}s" if self.kind == "keep" else self.kind
