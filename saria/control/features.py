"""The learned admission rule's features (:mod:`saria.control.learned`): what each is, and
:class:`FeatureTracker`, which keeps per chunk what Eq. 1 does not (the previous eviction's time and
``R_b`` then, two decayed reference counts, the gap between its last two references) and turns a
chunk at a DRAM eviction into :data:`FEATURES`, every one known online at that moment (nothing about
the future). Torch-free, LightGBM-free."""

from __future__ import annotations

import math
from typing import Callable, Sequence

__all__ = ["FEATURES", "FEATURE_VERSION", "FeatureTracker", "PENDING"]

# What each feature is (at a chunk's DRAM eviction, ``now``; the chunk's E_b counts this eviction).
FEATURES = (
    "evictions",            # E_b (Eq. 1's eviction count)
    "reuses",               # R_b (Eq. 1's reuse count)
    "log_since_eviction",   # log2(1 + seconds since its previous eviction); -1: none before
    "hits_in_dram",         # references since its previous eviction (or since it was created)
    "decayed_refs_5m",      # references, each decayed with a 5-minute half-life
    "decayed_refs_1h",      # ... with a 1-hour half-life
    "log_idle",             # log2(1 + seconds since its last reference): DRAM's current retention age
    "gap_over_dram",        # its last reuse gap over that age; -1: referenced once
    "gap_over_ssd",         # its last reuse gap over the SSD's retention age (0: the SSD never evicted); -1: once
    "dram_over_ssd",        # DRAM's retention age over the SSD's (0: the SSD never evicted)
    "turns",                # its session's turns so far (0: no session)
    "since_turn_over_gap",  # seconds since the session's last turn over its usual gap (the population's
                            # before it has one); -1: no gap known
    "comebacks",            # the session's turns that came back to chunks evicted since
    "depth",                # its depth in its prefix (0: a first chunk)
    "parent_copy",          # 1 when its parent has a copy in DRAM or SSD (or it has no parent)
    "sharers",              # times it passed from one session to another (0: one session's alone)
    "recompute_s_per_gib",  # seconds to recompute its prefix per GiB its kv object writes to SSD
)
FEATURE_VERSION = 1
_HALF_SHORT, _HALF_LONG = 300.0, 3600.0
_DECAY_SHORT, _DECAY_LONG = math.log(2.0) / _HALF_SHORT, math.log(2.0) / _HALF_LONG
# A node's ``learn`` list: [previous eviction time (-inf: none), R_b then, decayed short, decayed long,
# their time, last reuse gap (-1: none), pending online label (t_evict, horizon, features) or None]
_EVICT_T, _EVICT_R, _D_SHORT, _D_LONG, _D_T, _GAP, PENDING = range(7)
_INF = math.inf
_exp, _log2 = math.exp, math.log2


class FeatureTracker:
    """Per-chunk history beyond E_b / R_b, and a chunk's :data:`FEATURES` at an eviction. The
    control plane calls :meth:`referenced` for the known chunks of every committed request (before
    their ``last_reuse`` moves) and :meth:`evicted` at every kv object's DRAM eviction (after E_b
    counts it). ``ssd_retention`` reads the SSD's current retention age (inf before it evicts)."""

    __slots__ = ("sessions", "ssd_retention", "_recompute", "observer", "rule", "last")

    def __init__(self, sessions, ssd_retention: Callable[[], float], *, chunk_tokens: int, ssd_kv_bytes: int,
                 prefill_tps: float, observer: Callable | None = None) -> None:
        self.sessions = sessions
        self.ssd_retention = ssd_retention
        # seconds per GiB written, per chunk of depth: (depth + 1) * this
        self._recompute = chunk_tokens / prefill_tps / (ssd_kv_bytes / 2.0**30)
        self.observer = observer  # observer(node, features, now, ssd_retention): a replay's labeler
        self.rule: LearnedRule | None = None  # online labels for retraining
        # The latest eviction: (node, E_b, features or None, the previous eviction's time and R_b then,
        # last_reuse): features() of that eviction, asked after evicted() moved the history on.
        self.last: tuple | None = None

    @staticmethod
    def _learn(node) -> list:
        learn = node.learn
        if learn is None:  # never referenced since it was created (at last_reuse)
            learn = node.learn = [-math.inf, 0, 1.0, 1.0, node.last_reuse, -1.0, None]
        return learn

    def referenced(self, nodes: Sequence, now: float) -> None:
        """These known chunks are referenced again at ``now`` (called before their ``last_reuse`` moves)."""
        exp = math.exp
        rule = self.rule
        for node in nodes:
            learn = node.learn
            if learn is None:
                learn = node.learn = [-math.inf, 0, 1.0, 1.0, node.last_reuse, -1.0, None]
            dt = now - learn[4]
            learn[2] = learn[2] * exp(-_DECAY_SHORT * dt) + 1.0
            learn[3] = learn[3] * exp(-_DECAY_LONG * dt) + 1.0
            learn[4] = now
            learn[5] = now - node.last_reuse
            if learn[6] is not None:
                if rule is not None:
                    rule.settle(learn, now)
                learn[6] = None

    def features(self, node, now: float, extra_evictions: int = 0) -> list[float]:
        """:data:`FEATURES` of ``node`` evicted at ``now`` with ``extra_evictions`` more evictions
        than its E_b counts (prewrite asks about the next one)."""
        learn = node.learn
        if learn is None:
            learn = self._learn(node)
        last_reuse = node.last_reuse
        dt = now - learn[4]
        idle = now - last_reuse if now > last_reuse else 0.0
        gap = learn[5]
        ssd = self.ssd_retention()
        previous, reuses_then = learn[0], learn[1]
        R_b, E_b, depth = node.R_b, node.E_b, node.depth
        last = self.last
        if last is not None and last[0] is node and last[1] == E_b and last[5] == last_reuse:
            previous, reuses_then = last[3], last[4]  # this is that eviction, or the next one asked before a reuse
        session = node.session
        if session is None:
            turns = comebacks = 0
            since = -1.0
        else:
            turns, comebacks = session.turns, session.comebacks
            usual = session.gap
            if usual != usual:
                usual = self.sessions.population_gap
            since = -1.0 if usual != usual else (now - session.last_end) / (usual if usual > 1e-3 else 1e-3)
        parent = node.parent
        if gap < 0.0:
            over_dram = over_ssd = -1.0
        else:
            over_dram = gap / (idle if idle > 1e-3 else 1e-3)
            over_ssd = gap / ssd if 0.0 < ssd < _INF else 0.0
        return [
            E_b + extra_evictions,
            R_b,
            -1.0 if previous == -_INF else _log2(1.0 + (now - previous if now > previous else 0.0)),
            R_b - reuses_then,
            learn[2] * _exp(-_DECAY_SHORT * dt),
            learn[3] * _exp(-_DECAY_LONG * dt),
            _log2(1.0 + idle),
            over_dram,
            over_ssd,
            idle / ssd if 0.0 < ssd < _INF else 0.0,
            turns,
            since,
            comebacks,
            depth,
            1 if parent is None or parent.dram or parent.ssd else 0,
            node.sharers,
            (depth + 1) * self._recompute,
        ]

    def evicted(self, node, now: float) -> None:
        """``node``'s kv object was just evicted from DRAM (its E_b counts it)."""
        learn = node.learn
        rule, observer = self.rule, self.observer
        if node.evicted_as is None:
            node.evicted_as = ()  # the session's comebacks count a return to it (no situation filed)
        if learn is None and rule is None and observer is None:  # the common case, inlined
            node.learn = [now, node.R_b, 1.0, 1.0, node.last_reuse, -1.0, None]
            self.last = (node, node.E_b, None, -math.inf, 0, node.last_reuse)
            return
        if learn is None:
            learn = self._learn(node)
        features = None
        self.last = None
        if rule is not None or observer is not None:
            features = self.features(node, now)
            if observer is not None:
                observer(node, features, now, self.ssd_retention())
            if rule is not None:
                rule.pending(node, learn, features, now)
        self.last = (node, node.E_b, features, learn[0], learn[1], node.last_reuse)
        learn[0] = now
        learn[1] = node.R_b

