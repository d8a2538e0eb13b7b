"""Lost drives: a drive file found deleted or replaced while the store has it open (docs/ssd.md,
"Lost drives").

Before a write is published the store checks that each drive file it touched is still the file at
its path (one ``stat``: :meth:`~saria.dataplane.ssd.files.DriveFile.vanished`); :func:`check_drives`
runs the same check on every drive on demand. A drive found lost is taken out of service: it gives
no more slots, the objects with a part on it leave the index (they are lost; their parts on other
drives are erased and freed once no read pins them), one error line is logged, and writes go on
with the drives left (:class:`DriveLost` once none is left).

Like ``jobs``, these helpers drive the store's internals (``store._lost``: drive -> what happened
to its file; the index, the allocator and the lock).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Protocol

from saria.dataplane.ssd.errors import DriveLost

log = logging.getLogger("saria.dataplane.ssd")


class SSDStore(Protocol):
    """The internals of :class:`saria.dataplane.ssd.store.SSDStore` these helpers drive (the store
    passes itself; this module does not import it)."""

    _lost: dict[int, str]
    _files: list[Any]  # DriveFile per drive
    _lock: threading.Lock
    _alloc: Any  # SlotAllocator
    _index: dict[bytes, Any]  # key -> IndexEntry
    _counters: Any  # SSDCounters

    def _retire(self, entry: Any) -> bool: ...

    def _release(self, parts: Any) -> None: ...


def drive_lost(store: SSDStore, drive: int) -> DriveLost | None:
    """``None`` while ``drive`` is in service and its file is still the one at its path; else
    the :class:`DriveLost` error, after taking the drive out of service (the first time)."""
    if drive not in store._lost:
        why = store._files[drive].vanished()
        if why is not None:
            lose_drive(store, drive, why)
    return lost_error(store, drive)


def lost_error(store: SSDStore, drive: int) -> DriveLost | None:
    """The :class:`DriveLost` error of ``drive`` if it is out of service, else ``None``."""
    why = store._lost.get(drive)
    if why is None:
        return None
    path = store._files[drive].path
    return DriveLost(f"SSD drive file {path} {why} while the store had it open; the drive is out of service",
                     path, why)


def none_left_error(store: SSDStore) -> DriveLost | None:
    """Under the store's lock: the :class:`DriveLost` a write raises when every drive is out of
    service, else ``None``."""
    if len(store._lost) < len(store._files):
        return None
    lost = "; ".join(f"{store._files[d].path} {why}" for d, why in sorted(store._lost.items()))
    return DriveLost(f"every drive of the SSD store is out of service ({lost}): nothing can be written")


def lose_drive(store: SSDStore, drive: int, why: str) -> None:
    """Take ``drive`` out of service: no more slots from it, its objects leave the index (their
    parts on other drives are erased and freed once no read pins them), one log line."""
    with store._lock:
        if drive in store._lost:
            return
        store._lost[drive] = why
        store._alloc.retire(drive)
        lost = [e for e in store._index.values() if any(p.drive == drive for p in e.info.parts)]
        for e in lost:
            del store._index[e.info.key]
        free_now = [e for e in lost if store._retire(e)]
        left = len(store._files) - len(store._lost)
    store._counters.add(drives_lost=1, objects_lost=len(lost))
    log.error("SSD drive file %s %s while the store had it open: drive taken out of service, %d object(s) on "
              "it lost; %s", store._files[drive].path, why, len(lost),
              f"{left} drive(s) left in service" if left else "no drive left: writes will fail")
    for e in free_now:
        store._release(e.info.parts)


def lost_drives(store: SSDStore) -> dict[Path, str]:
    """Drive files taken out of service, each with what happened to it."""
    with store._lock:
        return {store._files[d].path: why for d, why in sorted(store._lost.items())}


def check_drives(store: SSDStore) -> dict[Path, str]:
    """Run :func:`drive_lost` on every drive; :func:`lost_drives` after."""
    for d in range(len(store._files)):
        drive_lost(store, d)
    return lost_drives(store)
