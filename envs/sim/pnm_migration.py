"""Processing-near-memory migrations: long decodes move their KV to a PNM tier (REFERENCE §3).

Only with ``spec.pnm``. A PNM-resident request (``on_pnm``) keeps its KV in the PNM pool, grows it
there, and its decode attention runs near memory (``CostModel.pnm_step_time_fast``). It gets there
two ways (REFERENCE §3.2, CXL-PNM arXiv 2511.00321, L3 arXiv 2504.17584; a NELSSA-style design,
**[inferred]**):

(a) the policy's ``choose_migrations`` (asked at the start of every step, over GPU-resident
    decodes) starts a background GPU->PNM copy over the PNM link; the request keeps its HBM
    blocks and does not decode until the copy lands (a transfer event), then frees them;
(b) tier-aware preemption picks mode ``"migrate"``: its HBM blocks are freed at once and the step
    waits for the copy, as a V0 swap-out does.

A PNM-resident request that cannot grow in a full PNM pool is preempted by recompute (vLLM V1
preempts when its own pool is full, REFERENCE §4.1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .request import RUNNING, RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance


class PNMMigrator:
    """The PNM tier's mechanism for one instance.

    Attributes:
        migrations: GPU->PNM copies started.
    """

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.migrations = 0

    def choose_migrations(self, now: float) -> None:
        """Ask the policy which GPU-resident decodes to move to PNM now, and start the copies.

        Candidates: running, ready (KV in HBM), decoding (prefill done), not on PNM. The policy
        sees them as a FeatureTable plus the free HBM and PNM blocks (REFERENCE §3.2 triggers);
        copies start in its order while the PNM pool has room.
        """
        inst = self.inst
        cands = [st for st in inst.running
                 if st.status == RUNNING and st.ready_s <= now and not st.on_pnm and not st.pnm_migrating
                 and st.generated > 0 and st.computed == st.prompt_tokens + st.generated - 1]
        if not cands:
            return
        kv = inst.kv
        rows = inst.policy.choose_migrations(inst.feature_table(cands, now), kv.hbm.available_blocks,
                                             kv.hbm.capacity_blocks, kv.pnm.available_blocks)
        if rows is None:
            return
        for r in rows:
            if not self.migrate(cands[int(r)], now, background=True):
                break

    def migrate(self, st: RequestState, now: float, background: bool) -> bool:
        """Copy ``st``'s KV GPU->PNM over the PNM link (DMA, no CPU on the path, §3.2).

        ``background`` (policy migration): ``st`` keeps its HBM blocks and does not decode until
        the copy lands (:meth:`landed` frees them). Otherwise (preemption mode ``"migrate"``): its
        HBM blocks are freed now and the step waits for the copy, as a V0 swap-out. Time:
        ``link.latency_s + per-rank bytes / link.bytes_per_s``, queued FIFO on the instance's PNM
        link. Returns ``False`` (nothing changed) when the PNM pool is full.
        """
        from .instance import TRANSFER_EVENT
        from .kv_manager import add_tier_bytes

        inst = self.inst
        kv = inst.kv
        n_blocks = kv.blocks_for(st.computed)
        # the pool must also hold its next token, else it is preempted there before emitting one
        if n_blocks < 1 or kv.pnm.available_blocks < kv.blocks_for(st.computed + 1) \
                or not kv.pnm.allocate(n_blocks):
            return False
        tier = kv.by_name["pnm"]
        nbytes = n_blocks * kv.block_bytes
        end = tier.write(now, inst.cost.transfer_time_s(n_blocks, tier.links()[0]), nbytes, "pnm_migration", st.rid)
        add_tier_bytes(st, "hbm_to_pnm", nbytes)
        st.pnm_blocks = n_blocks
        st.ready_s = end
        self.migrations += 1
        if background:
            st.pnm_migrating = True
            inst.pending_events.append((end, TRANSFER_EVENT, st))
        else:
            kv.free(st)
            st.on_pnm = True
            st.tier = "pnm"
            if end > inst._step_ready_s:
                inst._step_ready_s = end  # the step waits for the copy (its HBM blocks are reused)
        return True

    def landed(self, st: RequestState) -> None:
        """A background migration's copy landed: ``st`` decodes on PNM from now; its HBM blocks go."""
        st.pnm_migrating = False
        st.on_pnm = True
        st.tier = "pnm"
        self.inst.kv.free(st)

    def preempt_resident(self, st: RequestState, now: float = 0.0) -> None:
        """The PNM pool cannot hold ``st``'s next token: recompute preemption (back to waiting, its
        KV dropped), as vLLM V1 preempts when its own pool is full (REFERENCE §4.1). ``now`` (s)
        only dates it for an observer."""
        inst = self.inst
        obs = inst.preemptor.observer
        if obs is not None:
            from .observer import PreemptionEvent

            obs.on_preemption(PreemptionEvent(inst.instance_id, now, st.rid, "recompute", "pnm_full", -1,
                                              st.computed, st.pnm_blocks))
        inst.running.remove(st)
        self.release(st)
        inst.preemptor._count(st)
        inst.preemptor.requeue_for_recompute(st)

    def release(self, st: RequestState) -> None:
        """Free ``st``'s PNM blocks; it is GPU-resident again (if it runs again)."""
        if st.pnm_blocks:
            self.inst.kv.pnm.release_private(st.pnm_blocks)
        st.pnm_blocks = 0
        st.on_pnm = False
        st.pnm_migrating = False
        st.tier = "hbm"

    def migration_costs(self, candidates: list[RequestState], tokens: np.ndarray) -> np.ndarray:
        """Seconds of the one-way copy over the PNM link of each decoding candidate (never reloaded:
        it decodes near memory, REFERENCE §3.2); ``inf`` for a request still in prefill (only
        decode attention runs near memory) or one whose next token the PNM pool cannot hold."""
        inst = self.inst
        kv = inst.kv
        bs = kv.bs
        decoding = np.fromiter((c.generated > 0 and c.computed == c.prompt_tokens + c.generated - 1
                                for c in candidates), bool, count=len(candidates))
        need = -(-tokens // bs)
        room = -(-(tokens + 1) // bs)  # as migrate: its next token must fit too
        link = kv.by_name["pnm"].links()[0]
        mig = link.latency_s + need * inst.cost.kv_bytes_per_token_per_gpu * bs / link.bytes_per_s
        return np.where(decoding & (need >= 1) & (room <= kv.pnm.available_blocks), mig, np.inf)
