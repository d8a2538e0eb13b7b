"""What the SSD store knows about its objects: where each part lives, and how the slot headers
found at open become that index (the headers are the manifest; there is no separate journal)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from saria.dataplane.ssd.format import SealFields, SlotHeader


@dataclass(frozen=True)
class PartLocation:
    """One part of an object: slot ``slot`` of drive ``drive`` holds ``length`` payload bytes;
    ``checksum`` verifies them, or, for a sealed part (``checksum`` 0), ``seal`` opens them."""

    drive: int
    slot: int
    length: int
    checksum: int
    seal: SealFields | None = None


@dataclass
class IndexEntry:
    """An indexed object, its read pins, and whether it left the index (slots freed at pins == 0)."""

    info: "ObjectInfo"
    pins: int = 0
    dead: bool = False


@dataclass(frozen=True, repr=False)
class ObjectInfo:
    """A committed object: ``length`` bytes in ``parts`` (part ``i`` is bytes ``[i*part_bytes, ...)``).
    ``repr`` leaves the key out (it holds a chunk hash, or a sealed object's chunk id): its length only."""

    key: bytes
    length: int
    generation: int
    parts: tuple[PartLocation, ...]

    def __repr__(self) -> str:
        key = "<sealed>" if any(p.seal is not None for p in self.parts) else f"<{len(self.key)} bytes>"
        return f"ObjectInfo(key={key}, length={self.length}, generation={self.generation}, parts={self.parts!r})"


@dataclass
class Recovered:
    """The outcome of :func:`assemble`: objects to serve, slots to erase, what was dropped."""

    objects: dict[bytes, ObjectInfo] = field(default_factory=dict)
    erase: list[tuple[int, int]] = field(default_factory=list)  # (drive, slot) of dropped parts
    dropped_objects: int = 0  # (key, generation) groups not served: incomplete, inconsistent, stale
    max_generation: int = 0


def _complete(parts: list[tuple[int, int, SlotHeader]], part_bytes: int) -> bool:
    """Do these headers (all of one key and generation) form exactly one whole, consistent object?"""
    first = parts[0][2]
    count, length = first.part_count, first.object_length
    if len(parts) != count or length <= 0 or not 0 < length - (count - 1) * part_bytes <= part_bytes:
        return False
    seen = set()
    for _, _, h in parts:
        expected = part_bytes if h.part_index < count - 1 else length - (count - 1) * part_bytes
        if (h.part_count != count or h.object_length != length or h.part_capacity != part_bytes
                or h.part_length != expected or h.part_index in seen):
            return False
        seen.add(h.part_index)
    return True


def assemble(headers: list[tuple[int, int, SlotHeader]], part_bytes: int) -> Recovered:
    """Rebuild the index from committed headers ``(drive, slot, header)`` found by a scan.

    A key's newest *complete* generation is served; every other group of its headers (older
    generations, a newer write that crashed half-committed, parts that disagree) is dropped and its
    slots listed in ``erase`` so it cannot come back at the next open.
    """
    groups: dict[tuple[bytes, int], list[tuple[int, int, SlotHeader]]] = defaultdict(list)
    out = Recovered()
    for drive, slot, h in headers:
        groups[(h.key, h.generation)].append((drive, slot, h))
        out.max_generation = max(out.max_generation, h.generation)
    best: dict[bytes, int] = {}
    for (key, gen), parts in groups.items():
        if _complete(parts, part_bytes) and gen > best.get(key, -1):
            best[key] = gen
    for (key, gen), parts in groups.items():
        if best.get(key) == gen:
            ordered = sorted(parts, key=lambda p: p[2].part_index)
            out.objects[key] = ObjectInfo(key, ordered[0][2].object_length, gen, tuple(
                PartLocation(d, s, h.part_length, h.checksum, h.seal) for d, s, h in ordered))
        else:
            out.dropped_objects += 1
            out.erase.extend((d, s) for d, s, _ in parts)
    return out
