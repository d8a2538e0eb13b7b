"""Prewarming from the connector's scheduler side: no request is needed to start one.

vLLM has no session id, so a session is keyed by its tip: the hash of its latest request's last
full prompt chunk. A new request whose prompt's full chunks contain a tip (chunk hashes are
prefix-chained: it covers that request's whole prompt, in full chunks) continues that session; any
other request starts one. Per session a :class:`~saria.control.prewarm.GapPredictor` observes the
idle gaps (a request finishing to the session's next request arriving). When a request finishes,
a prewarm of its prompt's chunks is due ``Policy.prewarm_lead_s`` before the predicted next
arrival; at each scheduler step (``build_connector_meta``) the due prewarms of sessions whose next
request has not come yet go to :meth:`saria.control.ControlPlane.prewarm` (each at most
``config.prewarm_max_bytes``), and their orders go to the workers like any order. Paced: after a
prewarm of ``n`` bytes the next waits ``n / prewarm_gbps``.

A prewarm is issued at a scheduler step: an engine with no request at all does not step, so a
prewarm due then waits for the next step (another session's request, or the turn itself).
Pure Python (no vLLM, no torch).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from saria.config import SariaConfig
from saria.control import ControlPlane, Order, PromoteOrder
from saria.control.prewarm import GapPredictor

__all__ = ["PrewarmSession", "PrewarmSessions"]

MAX_SESSIONS = 65_536  # tips kept (least recently finished dropped first): a few hundred bytes each


@dataclass(eq=False)
class PrewarmSession:
    predictor: GapPredictor = field(default_factory=GapPredictor)
    hashes: tuple = ()       # the latest finished request's full prompt chunks
    generation: int = 0      # bumped at every finish: a due prewarm of an older one is stale


class PrewarmSessions:
    """Sessions by tip, their predicted turns and the prewarms due (module docstring)."""

    def __init__(self, control: ControlPlane, config: SariaConfig, max_sessions: int = MAX_SESSIONS) -> None:
        policy = config.policy
        self.control = control
        self.enabled = bool(policy.prewarm) and config.dram_bytes > 0 and config.ssd_bytes > 0
        self.lead_s = policy.prewarm_lead_s
        self.max_bytes = config.prewarm_max_bytes
        self.rate = config.prewarm_bytes_per_s
        self.config = config
        self.max_sessions = max_sessions
        self._tips: OrderedDict[Hashable, PrewarmSession] = OrderedDict()
        self._due: list[tuple[float, int, Hashable, PrewarmSession, int]] = []
        self._seq = itertools.count()
        self._next_free = -math.inf  # pacing: no prewarm starts before this
        self.issued = 0              # prewarm orders handed out

    def arrived(self, hashes: Sequence[Hashable], now: float) -> PrewarmSession:
        """A new request with these full prompt chunk hashes: the session it continues (the one
        whose tip is the deepest of its chunks), or a new one."""
        for h in reversed(hashes):
            session = self._tips.pop(h, None)
            if session is not None:
                session.predictor.arrived(now)
                return session
        return PrewarmSession()

    def finished(self, session: PrewarmSession, hashes: Sequence[Hashable], now: float) -> None:
        """The session's request (these full prompt chunk hashes) finished at ``now``: the session's
        tip moves to its last chunk, and its prewarm is scheduled when a gap can be predicted."""
        session.predictor.completed(now)
        session.generation += 1
        if not hashes:
            return
        session.hashes = tuple(hashes)
        tip = session.hashes[-1]
        self._tips[tip] = session
        self._tips.move_to_end(tip)
        while len(self._tips) > self.max_sessions:
            self._tips.popitem(last=False)
        due = session.predictor.prewarm_at(self.lead_s)
        if self.enabled and due is not None:
            heapq.heappush(self._due, (due, next(self._seq), tip, session, session.generation))

    def due(self, now: float) -> list[Order]:
        """The orders of the prewarms due at ``now`` (as the pacing allows) of sessions whose next
        request has not arrived yet."""
        orders: list[Order] = []
        while self._due and self._due[0][0] <= now and now >= self._next_free:
            _, _, tip, session, generation = heapq.heappop(self._due)
            if generation != session.generation or self._tips.get(tip) is not session:
                continue  # the turn came (or the session was dropped) first
            new = self.control.prewarm(session.hashes, now, self.max_bytes)
            # paced by what the prewarm reads from SSD (a kv object's FP8 form under ssd_dtype=fp8)
            nbytes = sum(self.config.ssd_bytes_of(len(order.kv), len(order.state))
                         for order in new if isinstance(order, PromoteOrder))
            if nbytes:
                self.issued += 1
                self._next_free = max(now, self._next_free) + nbytes / self.rate
            orders += new
        return orders

    def pending(self, now: float) -> bool:
        """Whether a prewarm is due at ``now`` (and the pacing lets it start): the engine should step
        to issue it. Stale entries at the head are dropped."""
        due = self._due
        while due:
            _, _, tip, session, generation = due[0]
            if generation == session.generation and self._tips.get(tip) is session:
                return due[0][0] <= now and now >= self._next_free
            heapq.heappop(due)
        return False

    def __len__(self) -> int:
        return len(self._tips)
