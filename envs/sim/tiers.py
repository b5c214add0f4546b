"""KV tiers as data: what a tier holds, how big it is, and the link to the tier above it.

An instance's KV lives in an ordered list of tiers (:attr:`InstanceSpec.tiers
<kvsched.envs.sim.instance_spec.InstanceSpec.tiers>`): HBM first (the tier the GPU computes on),
then host DRAM and NVMe (swap and offload targets, REFERENCE §5.2 and §5.4), then any extra tiers
a spec declares, then the processing-near-memory tier (REFERENCE §3) last. Every tier but HBM
hangs below a ``parent``: a copy from HBM to a tier crosses the write links of every tier on its
path (HBM -> DRAM over PCIe, DRAM -> NVMe over the NVMe write link), and a copy back crosses their
read links in reverse; each link is a FIFO queue (``t = latency + bytes / bandwidth``, REFERENCE
§5.2), named by ``write_queue`` / ``read_queue`` (the keys of a run's ``stats["link_bytes"]``).

What a tier may hold (``holds``):

- ``"running"``: the blocks of requests that compute (HBM only);
- ``"prefix"``: cached prefix blocks that outlive their request (HBM's prefix cache, vLLM
  ``--enable-prefix-caching``);
- ``"swapped"``: blocks of a preempted request copied out of HBM (vLLM V0 swap, offload);
- ``"pnm_resident"``: KV of requests whose decode attention runs near memory (REFERENCE §3.2).

A new tier is one :class:`TierSpec` in ``InstanceSpec.extra_tiers``: occupancy, metrics, records,
router tables, feature tables, preemption targets and their costs iterate the list. Only a tier
with a mechanism of its own (a PNM device computes) needs code of its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import ConfigError, bounded_repr, require
from .hardware import LinkSpec
from .spec_validation import non_negative, real_in

#: What a tier may hold (see the module docstring).
TIER_CONTENTS: tuple[str, ...] = ("running", "prefix", "swapped", "pnm_resident")

#: The tiers every instance has, in list order (capacity 0 when the spec leaves one out); their
#: columns are always present in records, occupancy and router tables. Extra tiers go between
#: ``nvme`` and ``pnm``.
STANDARD_TIERS: tuple[str, ...] = ("hbm", "dram", "nvme", "pnm")

#: Preemption modes no tier may take: what each already means (a tier named like one of them must
#: set another ``preemption_mode``).
RESERVED_MODES: dict[str, str] = {"recompute": "recompute preemption (vLLM V1)",
                                  "migrate": "migration to the PNM tier"}

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class TierSpec:
    """One KV tier (see the module docstring).

    Attributes:
        name: tier name, lower case ``[a-z][a-z0-9_]*`` (at most 32 characters); used in column
            names (``used_blocks_<name>``, ``bytes_hbm_to_<name>``) and as the ``tier`` of requests
            whose KV lives there.
        capacity_bytes: KV bytes the tier holds for the whole instance (>= 0; 0 = absent). Blocks:
            ``floor(capacity_bytes / kv_bytes_per_block)``.
        holds: what the tier may hold, a subset of :data:`TIER_CONTENTS`.
        parent: the tier above it on the copy path to HBM (``""`` for HBM itself).
        write_link: the link a copy from ``parent`` into this tier crosses (None for HBM).
        read_link: the link a copy from this tier back to ``parent`` crosses (None for HBM).
        write_queue, read_queue: names of the FIFO queues of those links (``""``:
            ``<name>_write`` / ``<name>_read``); two tiers naming one queue share it.
        preemption_mode: the ``preemption_mode`` (and tier-aware preemption cost key) that sends a
            victim here first (``""``: the tier's name; standard tiers: DRAM ``"swap"``, NVMe
            ``"offload"``).

    Raises:
        ConfigError: a bad name, a negative or non-finite capacity, unknown contents (or
            ``running`` / ``pnm_resident`` outside HBM / PNM), a tier below HBM without both links,
            links that are not :class:`LinkSpec` values, or a preemption mode on a tier that does
            not hold ``swapped``.
    """

    name: str
    capacity_bytes: float
    holds: tuple[str, ...] = ("swapped",)
    parent: str = "hbm"
    write_link: LinkSpec | None = None
    read_link: LinkSpec | None = None
    write_queue: str = ""
    read_queue: str = ""
    preemption_mode: str = ""

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(_NAME.match(self.name)), "TierSpec.name", self.name,
                "a lower-case name [a-z][a-z0-9_]* of at most 32 characters")
        o = f"TierSpec({self.name!r})"
        non_negative(o, "capacity_bytes", self.capacity_bytes)
        real_in(o, "capacity_bytes", self.capacity_bytes, math.isfinite, "a finite number of bytes >= 0")
        if isinstance(self.holds, list):
            object.__setattr__(self, "holds", tuple(self.holds))
        require(isinstance(self.holds, tuple) and bool(self.holds) and all(h in TIER_CONTENTS for h in self.holds)
                and len(set(self.holds)) == len(self.holds),
                f"{o}.holds", self.holds, f"a non-empty list of distinct contents among {', '.join(TIER_CONTENTS)}")
        require(isinstance(self.parent, str), f"{o}.parent", self.parent, "a tier name")
        for content, owner in (("running", "hbm"), ("pnm_resident", "pnm")):  # the mechanisms of those two tiers
            require(content not in self.holds or self.name == owner, f"{o}.holds", self.holds,
                    f"no {content!r}: only the {owner!r} tier holds it")
        if self.name == "hbm":
            return
        require(bool(self.parent) and self.parent != self.name, f"{o}.parent", self.parent,
                "the name of a tier above it (e.g. 'hbm')")
        for link in ("write_link", "read_link"):
            require(isinstance(getattr(self, link), LinkSpec), f"{o}.{link}", getattr(self, link),
                    "a LinkSpec (a link preset name or inline fields in YAML)")
        for q in ("write_queue", "read_queue", "preemption_mode"):
            v = getattr(self, q)
            require(isinstance(v, str) and (not v or bool(_NAME.match(v))), f"{o}.{q}", v,
                    "'' or a lower-case name [a-z][a-z0-9_]*")
        if not self.write_queue:
            object.__setattr__(self, "write_queue", f"{self.name}_write")
        if not self.read_queue:
            object.__setattr__(self, "read_queue", f"{self.name}_read")
        require(not self.preemption_mode or "swapped" in self.holds, f"{o}.preemption_mode", self.preemption_mode,
                "'' for a tier that does not hold 'swapped' blocks (only a swap target has a preemption mode)")
        if not self.preemption_mode and "swapped" in self.holds:
            object.__setattr__(self, "preemption_mode", self.name)

    @property
    def holds_swapped(self) -> bool:
        """Whether preempted requests' blocks may be copied here."""
        return "swapped" in self.holds


def check_tier_list(tiers: tuple[TierSpec, ...], where: str) -> None:
    """Validate an ordered tier list: HBM first, unique names, each parent listed before its child,
    and unique preemption modes, none of :data:`RESERVED_MODES`.

    Raises:
        ConfigError: naming ``where`` and the offending tier.
    """
    if not tiers or tiers[0].name != "hbm":
        raise ConfigError(f"{where}: the first tier must be 'hbm'")
    seen: set[str] = set()
    modes: dict[str, str] = {}
    for t in tiers:
        if t.name in seen:
            raise ConfigError(f"{where}: tier name {bounded_repr(t.name)} appears twice; tier names are unique")
        if t.name != "hbm" and t.parent not in seen:
            raise ConfigError(f"{where}: tier {bounded_repr(t.name)} has parent {bounded_repr(t.parent)}, "
                              f"which is not a tier listed before it ({', '.join(sorted(seen))})")
        if t.preemption_mode:
            if t.preemption_mode in modes or t.preemption_mode in RESERVED_MODES:
                means = (f"tier {modes[t.preemption_mode]!r}" if t.preemption_mode in modes
                         else RESERVED_MODES[t.preemption_mode])
                raise ConfigError(f"{where}: tier {bounded_repr(t.name)} has preemption_mode "
                                  f"{bounded_repr(t.preemption_mode)}, which "
                                  f"{means} already means; give the tier another preemption_mode (or name)")
            modes[t.preemption_mode] = t.name
        seen.add(t.name)


def tier_path(tiers: tuple[TierSpec, ...], index: int) -> list[int]:
    """Indices of the tiers a copy from HBM to ``tiers[index]`` lands in, top down (HBM excluded).

    ``tier_path(tiers, nvme)`` is ``[dram, nvme]`` for the standard list: a copy to NVMe crosses
    PCIe (DRAM's write link), then the NVMe write link.
    """
    by_name = {t.name: i for i, t in enumerate(tiers)}
    path = []
    i = index
    while tiers[i].name != "hbm":
        path.append(i)
        i = by_name[tiers[i].parent]
    path.reverse()
    return path
