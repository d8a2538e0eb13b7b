"""Slot allocation over the drives of an SSD store: per-drive free lists, striped placement."""

from __future__ import annotations

from typing import Iterable

from saria.dataplane.ssd.errors import StoreFull


class SlotAllocator:
    """Free slots of ``D`` drives. Part ``i`` of an allocation goes to drive ``(start + i) % D``
    (the next drive with a free slot when that one is full), and ``start`` moves on by the number
    of parts, so consecutive objects continue one stripe across the drives.

    A retired drive (:meth:`retire`) has no free slots from then on: allocations skip it.

    Not thread-safe on its own: the store calls it under its lock.
    """

    def __init__(self, free_per_drive: list[Iterable[int]]):
        # pop() takes from the end: keep each list descending so low slots go first
        self._free = [sorted(set(slots), reverse=True) for slots in free_per_drive]
        self._retired: set[int] = set()
        self._start = 0

    @property
    def drives(self) -> int:
        return len(self._free)

    @property
    def free(self) -> int:
        return sum(len(f) for f in self._free)

    def free_on(self, drive: int) -> int:
        return len(self._free[drive])

    def allocate(self, parts: int) -> list[tuple[int, int]]:
        """``parts`` free ``(drive, slot)`` pairs, or :class:`StoreFull` with nothing taken."""
        if parts > self.free:
            raise StoreFull(f"an object of {parts} part(s) needs {parts} free slot(s); "
                            f"{self.free} of the store's slots are free")
        left = [len(f) for f in self._free]
        drives = []
        for i in range(parts):
            d = (self._start + i) % self.drives
            while not left[d]:
                d = (d + 1) % self.drives
            left[d] -= 1
            drives.append(d)
        self._start = (self._start + parts) % self.drives
        return [(d, self._free[d].pop()) for d in drives]

    def release(self, slots: Iterable[tuple[int, int]]) -> None:
        """Give slots back (slots of a retired drive are ignored: that drive is out of service)."""
        for drive, slot in slots:
            if drive not in self._retired:
                self._free[drive].append(slot)

    def retire(self, drive: int) -> None:
        """Take ``drive`` out of service: its free slots are forgotten and never handed out again."""
        self._retired.add(drive)
        self._free[drive] = []
