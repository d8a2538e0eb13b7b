"""The cache hints an application could send with a trace's requests (``saria replay --hints KIND``:
``trace``, the kind below that fits the trace; ``sessions`` or ``pins``, that kind whatever the trace).

What an application knows, derived from the trace as it would know it (docs/policy.md, "Cache
hints from the application"):

* ``sessions``, agent traces (the schedule's sessions have several turns): each request names its session, and
  each turn but the last says when the next one comes (``next_turn_s``: the session's actual idle
  gap after it, what an agent framework waiting on a tool call knows); with ``accuracy`` p < 1, each
  such hint is wrong with probability 1 - p, its value then drawn at random from the trace's gaps
  (seeded). A session's last turn says ``done``.
* ``pins``, chat traces (sessions of one request): the platform pins the prefixes it knows are shared across
  sessions: each request pins its leading chunks that requests of at least two other sessions
  also begin with (``pin_chunks``), and sends nothing per session.
"""

from __future__ import annotations

import math
import random
from typing import Hashable, Sequence

from saria.control.hints import Hints
from saria.replay.arrivals import Schedule

__all__ = ["HINT_SOURCES", "derive_hints"]

HINT_SOURCES = ("trace", "sessions", "pins")  # trace: sessions where the trace has multi-turn ones, else pins
SHARED_BY = 3  # a chunk is a platform's shared prefix when requests of this many sessions begin with it


def derive_hints(schedule: Schedule, chunks: Sequence[tuple[Hashable, ...]], *, accuracy: float = 1.0,
                 seed: int = 0, kind: str = "trace") -> list[Hints | None]:
    """Per request (``chunks[i]``: request i's chunk hashes), the hints of the module docstring:
    ``kind`` ``trace`` (an agent trace's session hints where the schedule has sessions of several
    turns, else the platform's pins), ``sessions`` (session hints only) or ``pins`` (pins only)."""
    if kind not in HINT_SOURCES:
        raise ValueError(f"hints: one of {', '.join(HINT_SOURCES)}, got {kind!r}")
    if not (isinstance(accuracy, (int, float)) and not isinstance(accuracy, bool) and 0.0 <= accuracy <= 1.0):
        raise ValueError(f"--hint-accuracy must be in [0, 1], got {accuracy!r}")
    out: list[Hints | None] = [None] * len(chunks)
    sessions = schedule.sessions
    if kind == "sessions" or (kind == "trace" and any(len(s.requests) > 1 for s in sessions)):
        gaps = [g for s in sessions for g in s.gaps_s if math.isfinite(g)]
        rng = random.Random(seed)
        for index, session in enumerate(sessions):
            name = f"session-{index}"
            last = len(session.requests) - 1
            for position, request in enumerate(session.requests):
                if position == last:
                    out[request] = Hints(session=name, done=True)
                    continue
                gap = session.gaps_s[position]
                if rng.random() >= accuracy and gaps:
                    gap = rng.choice(gaps)
                out[request] = Hints(session=name, next_turn_s=max(0.0, float(gap)))
        return out
    owners: dict[Hashable, set[int]] = {}  # chunk -> the sessions whose requests begin with it (up to SHARED_BY)
    for index, session in enumerate(sessions):
        for request in session.requests:
            for key in chunks[request]:
                seen = owners.setdefault(key, set())
                if len(seen) < SHARED_BY:
                    seen.add(index)
    for session in sessions:
        for request in session.requests:
            keys = chunks[request]
            shared = 0
            while shared < len(keys) and len(owners[keys[shared]]) >= SHARED_BY:
                shared += 1
            if shared:
                out[request] = Hints(pin=math.inf, pin_chunks=shared)
    return out
