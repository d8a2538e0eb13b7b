"""Counters of an SSD store: bytes and time per drive path, and what went wrong how often."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class PathCounters:
    """Payload and header bytes moved on one drive path, and seconds spent in those calls (summed
    over threads, so it can exceed wall time when several transfers overlap)."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0


@dataclass
class SSDCounters:
    """Event counts of one store (all updates go through :meth:`add` / :meth:`add_io`)."""

    paths: dict[str, PathCounters] = field(default_factory=dict)
    reads: int = 0  # objects read and verified
    writes: int = 0  # objects committed
    read_failures: int = 0  # failed reads; each dropped its object
    write_failures: int = 0  # failed writes; nothing of them is served
    verification_failures: int = 0  # parts whose checksum did not match
    io_errors: int = 0  # OS errors from reads, writes, syncs
    short_reads: int = 0  # reads that returned fewer bytes than asked
    short_writes: int = 0  # writes that wrote fewer bytes than asked
    retries: int = 0  # transfers resumed after a short read or write
    dropped_at_open: int = 0  # objects not served after a restart (incomplete, inconsistent, stale)
    corrupt_headers: int = 0  # slot headers that failed validation at open
    truncated_slots: int = 0  # slots a drive file had (per its superblock) but no longer holds at open
    wiped_files: int = 0  # drive files wiped at open: written for another identity, or unusable
    wiped_at_open: int = 0  # objects with a part in a wiped drive file (those a wiped file's headers name)
    store_full: int = 0  # writes refused for lack of free slots
    drives_lost: int = 0  # drive files found deleted or replaced while open (drive taken out of service)
    objects_lost: int = 0  # objects dropped because a drive they had a part on was lost
    auth_failures: int = 0  # sealed parts whose GCM tag did not verify (each dropped its object)
    unknown_epoch: int = 0  # sealed parts of a key epoch the key file lacks (each dropped its object)
    unsealed_dropped_at_open: int = 0  # objects a sealed store found unsealed at open (not served, freed)
    other_key_dropped_at_open: int = 0  # objects sealed under another key file found at open (not read, freed)
    sealed_dropped_at_open: int = 0  # sealed objects an unsealed store found at open (not read, freed)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def add_io(self, path: str, kind: str, nbytes: int, seconds: float) -> None:
        """Account ``nbytes`` moved in ``seconds`` on ``path``; ``kind`` is ``"read"`` or ``"write"``."""
        with self._lock:
            p = self.paths.setdefault(path, PathCounters())
            setattr(p, f"{kind}_bytes", getattr(p, f"{kind}_bytes") + nbytes)
            setattr(p, f"{kind}_seconds", getattr(p, f"{kind}_seconds") + seconds)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy as plain data (``paths`` maps each path to its four numbers)."""
        with self._lock:
            out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                   if f.name not in ("paths", "_lock")}
            out["paths"] = {path: {f.name: getattr(p, f.name) for f in fields(p)}
                            for path, p in self.paths.items()}
            return out
