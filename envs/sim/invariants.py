"""Invariants of an instance's KV state, checked after every step when
``InstanceOptions.check_invariants`` is on (tests, debugging).

- **Conservation** in every tier: ``free + evictable + used == capacity``
  (:meth:`~.kv_cache.BlockPool.check`).
- **HBM holdings**: blocks in use = running requests' (and, with prefill/decode disaggregation,
  the sending prefill-phase copies', :mod:`.disagg`) private blocks + referenced prefix
  segments; segment reference counts = the holders' references.
- **Lower tiers**: each tier's blocks in use = the ``lower_blocks`` of the running and swapped
  requests whose ``lower_tier`` it is; PNM's = the running requests' ``pnm_blocks`` (waiting and
  swapped ones hold none there).
- **Enough blocks**: every running request holds at least ``ceil(computed / block_size)``
  blocks where its KV lives (HBM, or PNM for a PNM-resident one, which then holds no HBM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .instance import Instance


def check_instance(inst: Instance) -> None:
    """Raise ``AssertionError`` naming the first invariant ``inst`` breaks."""
    kv = inst.kv
    for tier in kv.tiers:
        tier.pool.check()
    _check_hbm(inst)
    _check_lower_tiers(inst)
    if kv.prefix_tiers is not None:  # cached prefixes below HBM are their pools' evictable blocks
        kv.prefix_tiers.check()
    for s in inst.running:
        if s.on_pnm:
            if s.hbm_blocks or s.pnm_blocks < kv.blocks_for(s.computed):
                raise AssertionError(f"{s} on PNM holds HBM blocks or too few PNM blocks")
            continue
        if s.hbm_blocks < kv.blocks_for(s.computed):
            raise AssertionError(f"{s} holds fewer blocks than its KV tokens need")


def _check_hbm(inst: Instance) -> None:
    hbm = inst.kv.hbm
    seg_used = hbm.referenced_blocks()
    # prefill-phase copies whose KV awaits the decode instance's read hold blocks too (.disagg)
    private = sum(s.private_blocks for s in inst.running) + sum(s.private_blocks for s in inst.sending)
    if private + seg_used != hbm.used_blocks:
        raise AssertionError(f"HBM used {hbm.used_blocks} != private {private} + referenced segments {seg_used}")
    if hbm.total_refs() != sum(len(s.shared) for s in inst.running) + sum(len(s.shared) for s in inst.sending):
        raise AssertionError("segment reference counts do not match holders")


def _check_lower_tiers(inst: Instance) -> None:
    kv = inst.kv
    held = {t.name: 0 for t in kv.tiers[1:]}
    for s in list(inst.running) + list(inst.swapped):
        if s.lower_blocks:
            held[s.lower_tier] += s.lower_blocks
    held["pnm"] = sum(s.pnm_blocks for s in inst.running)
    for tier in kv.tiers[1:]:
        if held[tier.name] != tier.pool.used_blocks:
            raise AssertionError(f"{tier.name} used {tier.pool.used_blocks} != held {held[tier.name]}")
    if any(s.pnm_blocks for s in inst.waiting) or any(s.pnm_blocks for s in inst.swapped):
        raise AssertionError("a waiting or swapped request holds PNM blocks")
