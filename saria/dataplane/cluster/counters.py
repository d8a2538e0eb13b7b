"""Counters of a cluster store: objects and bytes moved, and misses by cause."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from saria.dataplane.cluster.errors import MISS_CAUSES


@dataclass
class ClusterCounters:
    """Event counts of one store (all updates go through :meth:`add` / :meth:`miss`)."""

    puts: int = 0  # objects stored (all parts and the metadata accepted)
    put_bytes: int = 0
    put_seconds: float = 0.0  # time in Mooncake's put calls (per batch, summed over threads)
    gets: int = 0  # objects read and verified
    get_bytes: int = 0
    get_seconds: float = 0.0  # time in Mooncake's get calls and verification
    exists_calls: int = 0
    exists_timeouts: int = 0  # exists_many calls that timed out (answered all False)
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_CAUSES, 0))
    timeouts: int = 0  # objects whose batch timed out (also in misses["timeout"])
    corrupt: int = 0  # objects found corrupt and dropped (also in misses["corrupt"])
    auth_failures: int = 0  # sealed objects that failed authentication (also in misses["unauthentic"])
    unknown_epoch: int = 0  # sealed objects of a key epoch the key file lacks (also in misses["unknown_epoch"])
    present: int = 0  # objects a sealed put found in the cluster already and did not write again
    rewritten: int = 0  # objects a sealed put found with metadata that did not open, or parts gone, and wrote again
    junk_meta: int = 0  # metadata values a lookup found junk (larger than any object's, or not parsing): misses
    off_calls: int = 0  # calls answered at once because the tier was off
    dropped: int = 0  # objects removed from Mooncake after evidence against them
    went_off: int = 0  # times the tier was turned off (master unreachable)
    came_back: int = 0  # times it came back
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def miss(self, cause: str, n: int = 1) -> None:
        with self._lock:
            self.misses[cause] += n
            if cause == "timeout":
                self.timeouts += n
            elif cause == "corrupt":
                self.corrupt += n
            elif cause == "unauthentic":
                self.auth_failures += n
            elif cause == "unknown_epoch":
                self.unknown_epoch += n

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy as plain data."""
        with self._lock:
            out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                   if f.name not in ("misses", "_lock")}
            out["misses"] = dict(self.misses)
            return out
