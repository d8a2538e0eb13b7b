"""Sessions seen in the chunk hashes alone, and what became of evicted chunks: the ``session``
admission rule's prediction.

An agent or chat session sends turn after turn, each turn's prompt the previous one plus what came
since, after an idle gap (a tool call, a user typing). The control plane never sees a session id:
it sees chunk hashes. A committed request *continues* a session when its chunks contain that
session's tip (the last chunk of the session's latest request): its prompt holds the whole
previous prompt. Otherwise it starts a session of its own (a shared system prompt alone does not
join sessions: its last chunk is no session's tip unless a request was exactly that prompt). Each
session keeps its turn count, the end (commit time) of its latest turn, an exponential average of
its gaps between turns, and how many of its turns came back to chunks evicted since (comebacks);
every chunk a request references belongs to the request's session from then on.

Every DRAM eviction of a chunk is filed under its *situation*: the eviction count (1, 2, 3 or
more), the chunk's idle time (quarter powers of two of seconds: under LRU, how long DRAM now keeps
a chunk), that idle time over its session's usual gap (halves; the population's average before the
session has a gap of its own) and the session's comebacks (0, 1, 2 or more). When a request
references an evicted chunk again, its situation counts a return. ``return_rate`` is the share of
evictions in a situation that returned (with a prior of one half worth two evictions; evictions
still waiting for their return count as not returned), and :meth:`SessionTracker.returns` says a
chunk is worth writing when its situation's rate is at least ``p``. Everything is learned from the
traffic the cache serves; nothing is configured but ``p``.
"""

from __future__ import annotations

import math

__all__ = ["Session", "SessionTracker"]

_GAP_WEIGHT = 0.5  # weight of the newest gap in a session's average
_POPULATION_WEIGHT = 0.02  # and in the population's


class Session:
    __slots__ = ("tip", "turns", "last_end", "gap", "comebacks")

    def __init__(self, tip: object, now: float) -> None:
        self.tip = tip  # the last chunk (node) of the latest turn
        self.turns = 1
        self.last_end = now
        self.gap = math.nan  # average gap between turns' commits; NaN before the second turn
        self.comebacks = 0  # turns that referenced chunks evicted since the session's last use


class SessionTracker:
    """Sessions by their tips, and what became of evicted chunks. Not thread-safe: the control
    plane's lock covers it. Deterministic."""

    __slots__ = ("p", "population_gap", "sessions_started", "outcomes", "count_sharers")

    def __init__(self, p: float = 0.5) -> None:
        self.p = p
        self.population_gap = math.nan
        self.sessions_started = 0
        self.outcomes: dict[tuple[int, int, int, int], list[int]] = {}  # situation -> [evictions, returns]
        self.count_sharers = False  # count in node.sharers each chunk's passes between sessions (rule learned)

    def commit(self, nodes: list, known: int, now: float) -> None:
        """A request with chunk nodes ``nodes`` (the first ``known`` existed before it) committed at
        ``now``: evicted chunks it references again count as returns of their eviction's situation;
        it continues the session whose tip is among its known chunks (the deepest such), or starts
        one; every chunk of it now belongs to that session."""
        if not nodes:
            return
        outcomes = self.outcomes
        session = None
        came_back = False
        for i in range(known - 1, -1, -1):
            node = nodes[i]
            situation = node.evicted_as
            if situation is not None:
                if situation:  # () marks an eviction no situation was filed for (rule learned alone)
                    outcomes[situation][1] += 1
                node.evicted_as = None
                came_back = True
            owner = node.session
            if session is None and owner is not None and owner.tip is node:
                session = owner
        if session is None:
            session = Session(nodes[-1], now)
            self.sessions_started += 1
        else:
            gap = now - session.last_end
            session.gap = gap if session.gap != session.gap else session.gap + _GAP_WEIGHT * (gap - session.gap)
            pop = self.population_gap
            self.population_gap = gap if pop != pop else pop + _POPULATION_WEIGHT * (gap - pop)
            session.turns += 1
            session.tip = nodes[-1]
            session.last_end = now
            session.comebacks += came_back
        if self.count_sharers:
            for node in nodes:
                owner = node.session
                if owner is not session:
                    if owner is not None:
                        node.sharers += 1
                    node.session = session
        else:
            for node in nodes:
                node.session = session

    def situation(self, node, evictions: int, now: float) -> tuple[int, int, int, int]:
        """What an eviction of ``node`` at ``now`` (its ``evictions``-th) is judged by: the eviction
        count (1, 2, 3 or more), the chunk's idle time (quarter powers of two of seconds) and that
        idle time over its session's usual gap (halves, up to 4; 9: no gap known yet)."""
        idle = now - node.last_reuse
        slot = int(4.0 * math.log2(idle)) if idle > 1.0 else 0
        session = node.session
        gap = math.nan if session is None else session.gap
        if gap != gap:
            gap = self.population_gap
        ratio = 9 if gap != gap else min(int(2.0 * idle / max(gap, 1e-3)), 8)
        comebacks = 0 if session is None else min(session.comebacks, 2)
        return min(evictions, 3), min(slot, 120), ratio, comebacks

    def return_rate(self, situation: tuple[int, int, int, int]) -> float:
        """The share of chunks evicted in ``situation`` that a later request referenced again, with
        a prior of one half worth two evictions."""
        seen = self.outcomes.get(situation)
        if seen is None:
            return 0.5
        return (seen[1] + 1.0) / (seen[0] + 2.0)

    def returns(self, node, evictions: int, now: float) -> bool:
        """Whether chunk ``node``, at its ``evictions``-th eviction at ``now``, is predicted to be
        referenced again: chunks evicted in the same situation came back at least ``p`` of the time."""
        return self.return_rate(self.situation(node, evictions, now)) >= self.p

    def evicted(self, node, now: float) -> None:
        """``node`` was just evicted from DRAM (its ``E_b`` counts this eviction): count it in its
        situation, and remember the situation until the chunk is referenced again."""
        situation = self.situation(node, node.E_b, now)
        seen = self.outcomes.get(situation)
        if seen is None:
            self.outcomes[situation] = [1, 0]
        else:
            seen[0] += 1
        node.evicted_as = situation
