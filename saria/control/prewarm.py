"""Prewarming: when a session's next turn will come, and what to bring back into DRAM before it.

When: a session alternates requests and idle gaps (the time from one request's completion to the
next one's arrival: a tool call, a human reading). :class:`GapPredictor` keeps one session's
observed gaps and predicts the next arrival as ``last completion + EWMA of the gaps seen so far``
(``alpha`` weighs the newest gap; the first gap seeds the average). With no gap observed yet it
predicts nothing: a session's first idle gap is never prewarmed. Only past gaps are used: the
caller observes a gap when the request that ends it arrives.

The caller schedules :meth:`saria.control.ControlPlane.prewarm` of the session's latest request's
chunk hashes at ``prewarm_at(lead_s)`` = predicted arrival - ``Policy.prewarm_lead_s``, never before
the last completion, and forgets it if the next request arrives first.

What: :func:`prewarm_groups`, the chunks of the reusable prefix that a plan would read from SSD,
from the first, while they fit in the room given (``ControlPlane.prewarm`` gives free DRAM only).
"""

from __future__ import annotations

import math
from typing import Sequence

from saria.control.planner import find_prefix
from saria.control.tree import ABSENT, CacheObject, Node
from saria.orders import SSD

__all__ = ["GapPredictor", "prewarm_groups"]


class GapPredictor:
    """One session's idle gaps and its predicted next arrival (EWMA of the observed gaps)."""

    __slots__ = ("alpha", "estimate_s", "gaps", "last_completion")

    def __init__(self, alpha: float = 0.5) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.estimate_s: float | None = None  # EWMA of the gaps seen, None before the first
        self.gaps = 0
        self.last_completion: float | None = None

    def completed(self, now: float) -> None:
        """The session's latest request completed at ``now``: its idle gap starts."""
        self.last_completion = now

    def arrived(self, now: float) -> None:
        """The session's next request arrived at ``now``: the gap since the last completion is
        observed (a request arriving before the previous one completed observes nothing)."""
        if self.last_completion is None:
            return
        gap = now - self.last_completion
        self.last_completion = None
        if not math.isfinite(gap) or gap < 0:
            return
        self.observe(gap)

    def observe(self, gap_s: float) -> None:
        """Fold one observed gap (seconds, >= 0) into the estimate."""
        if self.estimate_s is None:
            self.estimate_s = float(gap_s)
        else:
            self.estimate_s += self.alpha * (gap_s - self.estimate_s)
        self.gaps += 1

    def next_arrival(self) -> float | None:
        """The predicted arrival of the next request, or None (no gap observed yet, or the session
        has a request in progress)."""
        if self.estimate_s is None or self.last_completion is None:
            return None
        return self.last_completion + self.estimate_s

    def prewarm_at(self, lead_s: float) -> float | None:
        """When to prewarm: ``lead_s`` before the predicted arrival, not before the last completion;
        None when nothing is predicted."""
        predicted = self.next_arrival()
        if predicted is None:
            return None
        return max(self.last_completion, predicted - lead_s)


def prewarm_groups(nodes: Sequence[Node | None], room: int, *, tier_prefix: bool,
                   hybrid: bool) -> list[list[CacheObject]]:
    """The chunks (each its objects to prewarm) of the reusable prefix of ``nodes`` that a plan
    would read from SSD, from the first, while their DRAM charges fit in ``room`` bytes. A hybrid
    prefix ends at its deepest readable checkpoint, whose state object comes along when it too is
    SSD-only."""
    prefix = find_prefix(nodes, tier_prefix=tier_prefix, hybrid=hybrid)
    groups: list[list[CacheObject]] = []
    need = 0
    state = prefix.state if prefix.state_source is SSD and prefix.state.dram == ABSENT else None
    last = prefix.length - 1
    for i, (node, source) in enumerate(zip(nodes[:prefix.length], prefix.kv_sources)):
        if source is not SSD or node.dram != ABSENT:  # a node is its kv object
            continue
        group = [node, state] if state is not None and i == last else [node]
        size = sum([obj.dram_charge for obj in group])
        if need + size > room:
            return groups
        groups.append(group)
        need += size
    if state is not None and (not groups or groups[-1][-1] is not state) and need + state.dram_charge <= room:
        groups.append([state])  # the checkpoint alone: its chunk's kv object is in DRAM already
    return groups
