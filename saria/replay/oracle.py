"""The future a replay can tell the ``oracle`` admission rule: when each chunk is next referenced.

Built in a first pass over the trace and the arrival schedule, before the replay starts. What it
knows, exactly:

* for every chunk hash, every request that references it, and each request's *estimated* arrival:
  its recorded arrival (``recorded`` arrivals), or its session's start plus the recorded idle gaps
  before it (``rewindow``), a lower bound that leaves out the earlier turns' queueing, loading and
  prefill, which depend on the policy;
* which requests the replay has planned so far (the replay calls :meth:`TraceFuture.planned`).

``next_use(key, now)`` is the estimated arrival of the earliest request not yet planned that
references ``key`` (no earlier than ``now``), or ``math.inf`` when none will. It does not know
whether that request will find the chunk's prefix, nor what the SSD will hold then: the rule
compares the next use with the SSD's retention time (``saria.control.admission``).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

from saria.replay.arrivals import Schedule

__all__ = ["TraceFuture"]


class TraceFuture:
    __slots__ = ("_uses", "_first", "_planned")

    def __init__(self, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule) -> None:
        estimated = [math.inf] * len(chunks)
        for session in schedule.sessions:
            at = session.start_s
            for position, request in enumerate(session.requests):
                if position:
                    at += session.gaps_s[position - 1]
                estimated[request] = at
        order = sorted(range(len(chunks)), key=estimated.__getitem__)
        uses: dict[Hashable, list[tuple[float, int]]] = {}
        for request in order:
            at = estimated[request]
            if at == math.inf:  # not in the schedule: never planned
                continue
            for key in chunks[request]:
                entry = uses.get(key)
                if entry is None:
                    uses[key] = [(at, request)]
                else:
                    entry.append((at, request))
        self._uses = uses
        self._first: dict[Hashable, int] = {}  # per key, the first entry that may be unplanned
        self._planned = bytearray(len(chunks))

    def planned(self, request: int) -> None:
        """Request ``request`` was planned: its references are no longer future uses."""
        self._planned[request] = 1

    def uses_within(self, key: Hashable, now: float, horizon: float) -> int:
        """How many requests not yet planned reference ``key`` no later than ``now + horizon``
        (by their estimated arrivals)."""
        uses = self._uses.get(key)
        if uses is None:
            return 0
        planned = self._planned
        end = now + horizon
        count = 0
        for i in range(self._first.get(key, 0), len(uses)):
            at, request = uses[i]
            if at > end:
                break
            if not planned[request]:
                count += 1
        return count

    def next_use(self, key: Hashable, now: float) -> float:
        uses = self._uses.get(key)
        if uses is None:
            return math.inf
        i = self._first.get(key, 0)
        planned = self._planned
        while i < len(uses) and planned[uses[i][1]]:
            i += 1
        self._first[key] = i
        if i == len(uses):
            return math.inf
        return max(uses[i][0], now)
