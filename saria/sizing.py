"""How the data plane lays out its tiers, and what each object occupies there (torch-free).

The data plane holds objects in fixed-size units: the host pool in slots, the SSD store in parts
(one slot of a drive file: a 4 KiB header, then the part's payload). An object occupies whole
units (its last one partly empty), so what it takes in a tier is its *charge*, not its size.
:func:`size_tiers` turns a config's capacities into the units the data plane allocates, never
more than the bytes given:

* host pool: ``dram_bytes // slot`` slots, ``slot = slot_bytes_for(object sizes)``; pinned:
  that many slots, at most ``dram_bytes`` (plus ``staging_bytes // slot`` slots for the cluster
  tier's staging, which the user asks for as ``cluster_staging_bytes``);
* SSD: ``ssd_bytes`` split evenly over the drives (a remainder of fewer bytes than drives is left
  out), each drive file a 4 KiB superblock and as many whole slots (4 KiB header + ``part``) as
  fit: at most ``ssd_bytes // drives`` bytes per file.

The control plane is given the same :class:`TierSizing` and charges every object its whole units
(:meth:`TierLayout.charge`) against what the tier really holds (:attr:`TierLayout.capacity`): the
charges of what it admits add up to at most the units allocated, so every admitted object has
its slots or parts (the allocator takes free parts from any drive). With no sizing (``saria
replay``: no data plane) a unit is one byte: an object charges its own size against the
configured capacity (:meth:`TierSizing.in_bytes`).

A tier given some bytes that cannot hold one object of each kind it keeps (a kv object, and a
hybrid model's state object) is refused with a ``ValueError`` saying the least it needs: it is
never rounded up behind the user's back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from saria.config import SariaConfig

__all__ = ["MAX_SLOT_BYTES", "PAGE", "RULE", "SSD_HEADER_BYTES", "SSD_SUPERBLOCK_BYTES", "TierLayout", "TierSizing",
           "size_tiers", "slot_bytes_for"]

# The rule in one line (``saria doctor`` says it: it knows no model, so no slot size)
RULE = ("never more than asked: host pool = dram_gb in whole slots, each drive file = ssd_gb / drives in a 4 KiB "
        "superblock and whole parts with a 4 KiB header each (a slot or part: the tier's smallest object rounded "
        "up to 4 KiB, at most 4 MiB); a tier too small for an object is refused")

MAX_SLOT_BYTES = 4 << 20  # host slot = SSD part: 4 MiB moves at full PCIe / NVMe speed
PAGE = 4096  # O_DIRECT alignment: slots and parts are whole pages
# The SSD store's drive file format (saria.dataplane.ssd.format; tests hold the two equal): a
# superblock per file, a header before each part's payload.
SSD_SUPERBLOCK_BYTES = 4096
SSD_HEADER_BYTES = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes_for(object_sizes: Sequence[int]) -> int:
    """One slot per object for objects up to 4 MiB (no waste), else 4 MiB slots."""
    return min(MAX_SLOT_BYTES, _round_up(min(object_sizes), PAGE))


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class TierLayout:
    """One tier as the data plane lays it out: ``units`` units (host slots, or SSD parts over
    all drives) of ``unit_bytes`` payload each, from ``given`` bytes asked for. ``drives``: the
    SSD's drive files (``units`` split evenly over them); 0 for the host pool."""

    unit_bytes: int
    units: int
    drives: int = 0
    given: int = 0

    def units_for(self, nbytes: int) -> int:
        """Units an object of ``nbytes`` occupies (at least one)."""
        return max(1, -(-nbytes // self.unit_bytes))

    def charge(self, nbytes: int) -> int:
        """What an object of ``nbytes`` takes of :attr:`capacity`: its whole units."""
        return self.units_for(nbytes) * self.unit_bytes

    @property
    def capacity(self) -> int:
        """The payload bytes of every unit: what the control plane charges objects against."""
        return self.units * self.unit_bytes

    @property
    def units_per_drive(self) -> int:
        return self.units // self.drives if self.drives else 0

    @property
    def file_bytes(self) -> int:
        """SSD: the size of each drive file (superblock, then a header and a part per unit)."""
        return SSD_SUPERBLOCK_BYTES + self.units_per_drive * (SSD_HEADER_BYTES + self.unit_bytes) if self.drives else 0

    @property
    def footprint(self) -> int:
        """Bytes the tier takes: pinned (host pool) or preallocated on the drives (SSD, all files)."""
        return self.drives * self.file_bytes if self.drives else self.capacity


@dataclass(frozen=True)
class TierSizing:
    """The host pool's and the SSD store's layouts (see the module docstring). ``staging_slots``:
    host slots beyond the DRAM tier's (the cluster tier's staging), never charged by the control
    plane."""

    dram: TierLayout
    ssd: TierLayout
    staging_slots: int = 0

    @classmethod
    def in_bytes(cls, dram_bytes: int, ssd_bytes: int) -> TierSizing:
        """No data plane behind (``saria replay``): every byte a unit, an object charges its size."""
        return cls(TierLayout(1, dram_bytes, given=dram_bytes), TierLayout(1, ssd_bytes, given=ssd_bytes))

    @property
    def pool_slots(self) -> int:
        """Slots of the host pool: the DRAM tier's and the staging."""
        return self.dram.units + self.staging_slots

    @property
    def pinned_bytes(self) -> int:
        """The host pool's memory (pinned where there is CUDA)."""
        return self.pool_slots * self.dram.unit_bytes

    def describe(self) -> str:
        """One line for logs: what was asked and what is taken, per tier."""
        d, s = self.dram, self.ssd
        dram = (f"DRAM {_size(d.given)} asked, {_size(d.footprint)} pinned ({d.units:,} slots of "
                f"{_size(d.unit_bytes)})")
        if self.staging_slots:
            dram += f" + {_size(self.staging_slots * d.unit_bytes)} staging ({self.staging_slots:,} slots)"
        if not s.units:
            return dram + "; SSD off"
        return (f"{dram}; SSD {_size(s.given)} asked, {_size(s.footprint)} preallocated ({s.drives} file(s) of "
                f"{s.units_per_drive:,} parts of {_size(s.unit_bytes)}, a 4 KiB header each)")


def _check_holds(tier: str, layout: TierLayout, sizes: dict[str, int], unit: str) -> None:
    """Refuse a tier given bytes that cannot hold one object of each kind (``sizes``)."""
    need = max(layout.units_for(n) for n in sizes.values())
    if layout.given == 0 or layout.units >= need:
        return
    kind, nbytes = max(sizes.items(), key=lambda item: layout.units_for(item[1]))
    if layout.drives:
        per_drive = -(-need // layout.drives)  # parts each drive must hold
        least = layout.drives * (SSD_SUPERBLOCK_BYTES + per_drive * (SSD_HEADER_BYTES + layout.unit_bytes))
        where = (f"{layout.drives} drive(s), each a {SSD_SUPERBLOCK_BYTES}-byte superblock and whole "
                 f"{layout.unit_bytes:,}-byte parts with a {SSD_HEADER_BYTES}-byte header each")
    else:
        least, where = need * layout.unit_bytes, f"whole {layout.unit_bytes:,}-byte slots"
    raise ValueError(f"the {tier} tier's {layout.given:,} bytes hold no {kind} object ({nbytes:,} bytes, "
                     f"{need} {unit}(s) in {where}): give it at least {least:,} bytes ({_size(least)}), or 0 for none")


def size_tiers(config: SariaConfig, drives: int, staging_bytes: int = 0) -> TierSizing:
    """The layouts of ``config``'s tiers (a :class:`saria.config.SariaConfig` whose chunk sizes
    are the pages' own) over ``drives`` drive files, with ``staging_bytes`` of host staging beside
    the DRAM tier. ``ValueError``: the SSD tier without drives, a negative ``staging_bytes``, or a
    tier that holds no object of some kind (module docstring)."""
    if isinstance(drives, bool) or not isinstance(drives, int) or drives < 0:
        raise ValueError(f"drives must be an int >= 0, got {drives!r}")
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 0:
        raise ValueError(f"staging_bytes must be an int >= 0, got {staging_bytes!r}")
    chunk = config.chunk
    sizes = {"kv": chunk.kv_bytes, **({"state": chunk.state_bytes} if chunk.state_bytes else {})}
    slot = slot_bytes_for(list(sizes.values()))
    # What the SSD holds: kv objects in their FP8 form under ssd_dtype="fp8", in parts sized for
    # them (a part is then not a host slot: writes from DRAM quantize through a buffer anyway)
    ssd_sizes = {**sizes, "kv": config.ssd_kv_bytes}
    part = slot if config.ssd_dtype == "auto" else slot_bytes_for(list(ssd_sizes.values()))
    dram = TierLayout(slot, config.dram_bytes // slot, given=config.dram_bytes)
    _check_holds("DRAM", dram, sizes, "slot")
    ssd = TierLayout(part, 0)
    if config.ssd_bytes:
        if drives < 1:
            raise ValueError("the policy uses SSD but no ssd_paths were given (one directory per drive)")
        per_drive = max(0, (config.ssd_bytes // drives - SSD_SUPERBLOCK_BYTES) // (SSD_HEADER_BYTES + part))
        ssd = TierLayout(part, per_drive * drives, drives, given=config.ssd_bytes)
        _check_holds("SSD", ssd, ssd_sizes, "part")
    return TierSizing(dram, ssd, staging_bytes // slot)
