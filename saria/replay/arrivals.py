"""When requests arrive in a replay: as recorded, or with sessions re-windowed as in the paper (§3).

A :class:`Schedule` is a list of :class:`SessionPlan`\\ s. Each starts at ``start_s`` with its first
request; each later request of the session arrives ``gaps_s[i]`` after its predecessor completes
(at most one active request per session: successors follow the recorded idle intervals). The
replay (``saria.replay.replay``) turns completions into successor arrivals.

* ``recorded``: every request is its own one-request "session" starting at its recorded arrival:
  the trace's timing exactly, with no per-session ordering.
* ``rewindow``: each session keeps its request sequence and intervals (the recorded gaps between
  consecutive arrivals); the session starts are redrawn with Gamma(k=1) (exponential) gaps and
  scaled into ``window_hours``, in the order of the sessions' recorded starts. Sessions come from
  the trace's session ids or, when it has none, are inferred by prefix chaining
  (:func:`infer_sessions`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from saria.replay.traces import Trace

__all__ = ["ARRIVAL_MODES", "Schedule", "SessionPlan", "infer_sessions", "make_schedule", "sessions_of"]

ARRIVAL_MODES = ("auto", "recorded", "rewindow")


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """A session's first arrival and its requests (indices into ``trace.requests``); ``gaps_s[i]``
    is the idle time between request ``i``'s completion and request ``i + 1``'s arrival."""

    start_s: float
    requests: tuple[int, ...]
    gaps_s: tuple[float, ...]


@dataclass(frozen=True)
class Schedule:
    mode: str  # "recorded" or "rewindow"
    sessions: tuple[SessionPlan, ...]
    inferred_sessions: bool = False
    window_s: float | None = None

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)


def infer_sessions(trace: Trace, min_shared_blocks: int = 2) -> list[list[int]]:
    """Group requests into sessions by prefix chaining: a request continues the session whose latest
    request's full blocks are all a prefix of its own (the longest such, of at least
    ``min_shared_blocks`` blocks, so a shared system prompt alone does not join sessions); otherwise
    it starts a session. Each session is a chain: a request continues at most one session, and a
    session's tip is its latest request. Returns sessions as lists of request indices, by first
    arrival."""
    block = trace.block_tokens
    tips: dict[object, tuple[int, int]] = {}  # last full block id of a tip -> (session, tip length)
    sessions: list[list[int]] = []
    for index, request in enumerate(trace.requests):
        full = request.input_tokens // block
        blocks = request.blocks
        joined = -1
        for length in range(full, min_shared_blocks - 1, -1):
            tip = tips.get(blocks[length - 1])
            if tip is not None and tip[1] == length:
                joined = tip[0]
                del tips[blocks[length - 1]]
                break
        if joined < 0:
            joined = len(sessions)
            sessions.append([])
        sessions[joined].append(index)
        if full >= min_shared_blocks:
            tips[blocks[full - 1]] = (joined, full)
    return sessions


def sessions_of(trace: Trace) -> tuple[list[list[int]], bool]:
    """The trace's sessions (request indices in arrival order), and whether they were inferred."""
    if trace.has_sessions:
        groups: dict[object, list[int]] = defaultdict(list)
        for index, request in enumerate(trace.requests):
            # A request without a session id in a trace that has them is a session of its own.
            groups[request.session if request.session is not None else ("#", index)].append(index)
        return list(groups.values()), False
    return infer_sessions(trace), True


def make_schedule(trace: Trace, mode: str = "auto", *, window_hours: float = 12.0, seed: int = 0) -> Schedule:
    """The arrival schedule. ``auto``: re-window when the trace has session ids, else as recorded."""
    if mode not in ARRIVAL_MODES:
        raise ValueError(f"arrivals must be one of {ARRIVAL_MODES}, got {mode!r}")
    if mode == "auto":
        mode = "rewindow" if trace.has_sessions else "recorded"
    requests = trace.requests
    if mode == "recorded":
        return Schedule("recorded", tuple(SessionPlan(r.arrival_s, (i,), ()) for i, r in enumerate(requests)))
    if not (isinstance(window_hours, (int, float)) and window_hours > 0):
        raise ValueError(f"--window-hours must be > 0, got {window_hours!r}")
    groups, inferred = sessions_of(trace)
    groups.sort(key=lambda g: (requests[g[0]].arrival_s, g[0]))
    window = window_hours * 3600.0
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(len(groups) + 1)]  # Gamma(k=1)
    scale = window / sum(gaps)
    plans = []
    start = 0.0
    for group, gap in zip(groups, gaps):
        start += gap * scale  # the n starts fall strictly inside (0, window)
        intervals = tuple(max(0.0, requests[b].arrival_s - requests[a].arrival_s) for a, b in zip(group, group[1:]))
        plans.append(SessionPlan(start, tuple(group), intervals))
    return Schedule("rewindow", tuple(plans), inferred, window)
