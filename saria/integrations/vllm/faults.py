"""Faults: what the connector does with an exception of saria's own (a bug, a broken invariant, an
error nobody planned for), so that none reaches vLLM's scheduler or worker loop.

A fault is caught where it happens, counted, and logged on logger ``saria.vllm``: the first fault
of a kind (hook and exception type) with its traceback, later ones of that kind as one short line.
The caller then answers vLLM safely (a miss, a failed load, a failed order) and repairs its own
state: the scheduler half rebuilds its control plane, the worker half fails only the affected
request or order. :meth:`Faults.record` says when to stop trying: ``LIMIT`` faults within
``WINDOW_S`` seconds, after which the connector turns itself off for the rest of the run.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

log = logging.getLogger("saria.vllm")

LIMIT = 3  # faults within WINDOW_S that turn the connector off
WINDOW_S = 300.0


class Faults:
    """Count, log once per kind, and decide when to give up (module docstring). ``side`` names the
    half in the log (``scheduler`` or ``worker``)."""

    def __init__(self, side: str, *, limit: int = LIMIT, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        if limit < 1 or window_s <= 0:
            raise ValueError(f"need limit >= 1 and window_s > 0, got {limit} and {window_s}")
        self.side = side
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self.count = 0
        self.by_where: dict[str, int] = {}
        self._kinds: set[tuple[str, str]] = set()
        self._recent: deque[float] = deque()

    def record(self, where: str, exc: BaseException) -> bool:
        """Count and log one fault in ``where`` (a hook or step name). True when this fault is the
        ``limit``-th within ``window_s``: time to turn the connector off."""
        self.count += 1
        self.by_where[where] = self.by_where.get(where, 0) + 1
        kind = (where, type(exc).__name__)
        if kind not in self._kinds:
            self._kinds.add(kind)
            log.error("saria %s: fault in %s (%s: %s); what it touched becomes a cache miss (vLLM computes it)",
                      self.side, where, type(exc).__name__, exc, exc_info=exc)
        else:
            log.warning("saria %s: fault in %s again (%s: %s), %d fault(s) so far", self.side, where,
                        type(exc).__name__, exc, self.count)
        now = self.clock()
        self._recent.append(now)
        while now - self._recent[0] > self.window_s:
            self._recent.popleft()
        return len(self._recent) >= self.limit

    def snapshot(self) -> dict:
        return {"faults": self.count, "by_where": dict(self.by_where)}
