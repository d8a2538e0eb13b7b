"""SSD admission: the paper's Eq. 1, ``admit(b) = E_b >= theta_E or R_b >= theta_R``, and the
rules that refine it (``Policy.admission``, rules joined by ``+``).

* ``eq1``: Eq. 1 on a chunk's evidence (shared by all its objects with unified metadata), so a GDN
  checkpoint is admitted exactly when its chunk is. A disabled branch (``None``) never fires;
  ``admit_all`` (full duplicate caching) admits everything; without an SSD tier nothing is admitted.
* ``session``: also write a chunk at an eviction when chunks evicted in the same situation were
  referenced again at least ``session_p`` of the time, a rate learned from the traffic
  (:class:`saria.control.sessions.SessionTracker`; the situation: eviction count, idle time, idle
  time over its session's usual gap between turns, the session's comebacks after evictions). Eq. 1
  waits for a second eviction, which loses the reuse right after the first (an agent session
  coming back after a tool call); the prediction writes at the first eviction when sessions like
  this one have been coming back.
* ``deferred``: the reuse branch (``R_b >= theta_R``) writes nothing until DRAM has had to evict
  a copy: a popular chunk is at no risk while everything fits, and once DRAM evicts, Eq. 1 admits
  it at its eviction anyway. (The paper's Eq. 1 writes it at its theta_R-th reuse, which on an
  agent trace whose working set fits in DRAM is every write it makes, none ever read.)
* ``prefix``: never write a chunk whose parent chunk has no copy in DRAM or SSD (nor one being
  written): a reload stops at the first missing chunk, so that write could never be read.
* ``cost``: never write a chunk whose reload would not beat recomputing it: reloading its prefix
  (``depth + 1`` chunks) from the drives, plus ``reload_overhead_s``, against prefilling those
  tokens at ``prefill_tps`` (short prefixes of fast models).
* ``learned``, joined to Eq. 1 as ``eq1&learned`` (write a chunk at an eviction when Eq. 1 *and*
  the model admit it: fewer writes) or ``eq1|learned`` (when either does: more retention): a
  gradient-boosted tree model of the oracle's labels on features known at the eviction
  (:mod:`saria.control.learned`), admitting when its probability passes ``learned_tau``. It
  decides at evictions: with ``&`` a prewrite needs the model too (asked about the next eviction;
  with ``deferred``, nothing is prewritten before DRAM first evicts: until then there is no
  eviction to judge, as for the reuse branch) and the reuse branch writes nothing early (a chunk
  with ``R_b >= theta_R`` is judged at its eviction, where the model sees it); with ``|``
  prewrite and the reuse branch stay Eq. 1's, and what only the model admits is written at the
  eviction (its features are an eviction's). While the features drift off the model's training
  range Eq. 1 decides alone.
* ``oracle`` (alone; ``saria replay --policy oracle`` only): the replay tells admission every
  chunk's next use (:class:`FutureUses`); a chunk is admitted exactly when a request not yet
  planned will reference it within the SSD's retention time (the age of the SSD's latest LRU
  victim; unbounded before the first SSD eviction). Nothing else is written (no reuse branch).

Cache hints (:mod:`saria.control.hints`) come before these rules where they speak: a retained or
pinned chunk is written at its eviction, a done session's private chunk never, and a session's
private chunk whose next turn the application announced is written exactly when that turn comes
within ``ssd_retention_s`` (the oracle's test, on the hint instead of the trace's future). The
residency and placement hooks ask the hints first and this class only where they say nothing.

Fractional thresholds (``dither``, set by the endurance governor): a chunk is admitted by eviction
when ``E_b + u_b >= theta_E`` and by reuse when ``R_b + u_b >= theta_R``, with ``u_b`` in [0, 1) a
fixed pseudo-random fraction of the chunk's hash. For integer thresholds this is exactly Eq. 1;
theta_E = 2.4 admits every chunk with ``E_b >= 3`` and the 60 % of chunks with ``E_b = 2`` whose
``u_b >= 0.4``, so writes move smoothly between E2 and E3 (and likewise between R8 and R9). (A
state object with its own evidence, under per-object metadata, has no hash of its own: ``u = 0``.)
"""

from __future__ import annotations

import math
import zlib
from typing import Hashable, Protocol

from saria.config import Policy, SariaConfig, admission_rules, learned_join
from saria.control.counters import Counters
from saria.control.features import FeatureTracker
from saria.control.learned import LearnedRule, TreeModel, shipped_model
from saria.control.sessions import SessionTracker
from saria.control.tree import ABSENT, CacheObject, Evidence, Node

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads consecutive integer ids over [0, 1)
_MASK = (1 << 64) - 1


def chunk_fraction(evidence: Evidence | Node) -> float:
    """``u_b``: a fraction in [0, 1) fixed by the chunk's hash (the same in every process)."""
    key = getattr(evidence, "key", None)
    if key is None:
        return 0.0
    if isinstance(key, int):
        return ((key * _GOLDEN) & _MASK) / 2.0**64
    data = key if isinstance(key, bytes) else (key if isinstance(key, str) else repr(key)).encode()
    return zlib.crc32(data) / 2.0**32


class FutureUses(Protocol):
    """What the ``oracle`` rule knows: when a chunk is next referenced (seconds on the caller's
    clock, ``math.inf`` for never), counting only requests not planned yet."""

    def next_use(self, key: Hashable, now: float) -> float: ...


class Admission:
    __slots__ = ("theta_E", "theta_R", "admit_all", "enabled", "dither", "rules", "eq1_only", "sessions", "future",
                 "ssd_retention_s", "dram_evicted", "_clock", "_cost_depth", "_session", "_prefix", "_cost", "_oracle",
                 "_deferred", "tracker", "learned", "_and", "situations", "_learned_only")

    def __init__(self, policy: Policy, ssd_capacity: int, *, config: SariaConfig | None = None,
                 clock=None, future: FutureUses | None = None, counters: Counters | None = None,
                 observer=None) -> None:
        """``clock()``: the control plane's now (the rules ``session``, ``learned`` and ``oracle``
        read it); ``config``: bandwidths and chunk sizes (the rules ``cost`` and ``learned``);
        ``future``: the oracle's knowledge (required by the rule ``oracle``); ``counters``: where
        the rule ``learned`` counts; ``observer(node, features, now, ssd_retention)``: called at
        every kv object's DRAM eviction with its learned-rule features and the SSD's retention age
        (a replay's labeler, under any policy)."""
        self.theta_E = math.inf if policy.theta_E is None else policy.theta_E
        self.theta_R = math.inf if policy.theta_R is None else policy.theta_R
        self.admit_all = policy.admit_all
        self.enabled = ssd_capacity > 0
        self.dither = False
        self.rules = rules = admission_rules(policy.admission)
        self._session, self._prefix = "session" in rules, "prefix" in rules
        self._cost, self._oracle = "cost" in rules, "oracle" in rules
        self._deferred = "deferred" in rules
        self.eq1_only = rules <= {"eq1", "deferred"}  # eviction decisions are Eq. 1's alone
        learned = "learned" in rules
        if (self._session or self._oracle or learned) and clock is None:
            raise ValueError(f"admission {policy.admission!r} needs the control plane's clock")
        if self._oracle and future is None:
            raise ValueError("admission=oracle knows every chunk's next use, which only a replay can tell it: "
                             "use it with saria replay --policy oracle")
        self._clock = clock
        self.future = future
        tracked = self._session or learned or observer is not None
        self.sessions = SessionTracker(policy.session_p) if tracked else None
        self.situations = self.sessions if self._session else None  # what the session rule files evictions under
        self._learned_only = learned and rules <= {"eq1", "deferred", "learned"}  # admits() fast path
        self.ssd_retention_s = math.inf  # the age of the SSD's latest LRU victim (oracle's horizon)
        self.dram_evicted = False  # DRAM has evicted a copy (rule deferred: reuse writes start then)
        self.tracker: FeatureTracker | None = None
        self.learned: LearnedRule | None = None
        self._and = learned_join(policy.admission) == "and"
        if learned or observer is not None:
            cfg = config if config is not None else SariaConfig(policy=policy)
            self.sessions.count_sharers = True
            self.tracker = FeatureTracker(self.sessions, lambda: self.ssd_retention_s,
                                          chunk_tokens=cfg.chunk.chunk_tokens, ssd_kv_bytes=cfg.ssd_kv_bytes,
                                          prefill_tps=policy.prefill_tps or 6500.0, observer=observer)
        if learned:
            model = shipped_model() if policy.learned_model is None else TreeModel.load(policy.learned_model)
            tau = policy.learned_tau
            if tau is None:
                tau = model.tau("and" if self._and else "or")
            self.learned = LearnedRule(model, tau, self.tracker,
                                       counters if counters is not None else Counters(),
                                       retrain_s=policy.learned_retrain_s, horizon_cap=policy.metadata_window_s)
        self._cost_depth = 0
        if self._cost:
            if config is None or policy.prefill_tps is None:
                raise ValueError("admission rule cost needs the model's prefill throughput (Policy.prefill_tps) "
                                 "and the configured bandwidths")
            # Reload (overhead + n chunks at the drives' bandwidth) beats recompute (n chunks at
            # prefill_tps) from n > overhead / (compute - read) per chunk: the least depth + 1 written.
            chunk = config.chunk
            per_chunk = (chunk.chunk_tokens / policy.prefill_tps
                         - config.ssd_kv_bytes / (config.bandwidth.disk_gbps * 1e9))  # a reload reads SSD bytes
            self._cost_depth = (math.inf if per_chunk <= 0
                                else math.floor(policy.reload_overhead_s / per_chunk))  # min depth written

    def admitted(self, evidence: Evidence, extra_evictions: int = 0) -> bool:
        """Eq. 1 on ``evidence``, counting ``extra_evictions`` more evictions (prewrite asks with 1:
        would the chunk qualify at its next eviction?)."""
        if not self.enabled:
            return False
        if self.admit_all:
            return True
        evictions = evidence.E_b + extra_evictions
        if self.dither:
            u = chunk_fraction(evidence)
            return evidence.R_b + u >= self.theta_R or evictions + u >= self.theta_E
        return evidence.R_b >= self.theta_R or evictions >= self.theta_E

    def admits(self, obj: CacheObject, extra_evictions: int = 0, model: bool = True) -> bool:
        """Every rule of the policy on ``obj`` (see the module docstring), counting
        ``extra_evictions`` more evictions of its evidence; ``model`` False leaves the learned
        rule out (Eq. 1 alone where it is joined)."""
        if not self.enabled:
            return False
        if self.eq1_only:
            return self.admitted(obj.evidence, extra_evictions)
        if self._learned_only:
            if self.dither:
                admitted = self.admitted(obj.evidence, extra_evictions)
            else:
                evidence = obj.evidence
                admitted = (self.admit_all or evidence.R_b >= self.theta_R
                            or evidence.E_b + extra_evictions >= self.theta_E)
            if model and admitted is self._and:  # AND: Eq. 1 admits, the model decides; OR: it rejects, likewise
                verdict = self.learned.admits(obj.node, self._clock(), extra_evictions)
                if verdict is not None:
                    return verdict
            return admitted
        node = obj.node
        if self._oracle:
            now = self._clock()
            next_use = self.future.next_use(node.key, now)
            return next_use < math.inf and next_use - now <= self.ssd_retention_s
        evidence = obj.evidence
        admitted = self.admitted(evidence, extra_evictions)
        learned = self.learned
        if model and learned is not None and admitted is self._and:  # AND: Eq. 1 admits; OR: it does not
            verdict = learned.admits(node, self._clock(), extra_evictions)
            if verdict is not None:
                admitted = verdict
        if not (admitted
                or (self._session and self.sessions.returns(node, evidence.E_b + extra_evictions, self._clock()))):
            return False
        if self._prefix:
            parent = node.parent
            if parent is not None and parent.dram == ABSENT and parent.ssd == ABSENT:
                return False
        return not self._cost or node.depth >= self._cost_depth

    def at_next_eviction(self, objs: list[CacheObject]) -> list[CacheObject]:
        """Those of ``objs`` that admission admits with one more eviction (``E_b + eviction_step``):
        prewrite candidates. (Eq. 1 inlined for a list, when it is the only rule.)"""
        if not self.enabled:
            return []
        if self.admit_all and not self._prefix and not self._cost:
            return list(objs)
        if self.learned is not None and self._and and self._deferred and not self.dram_evicted:
            return []  # AND + deferred: no prewrite before DRAM first evicts (the model judges evictions)
        if self.learned is not None and not self._learned_only:  # OR: prewrite is Eq. 1's (and the other rules')
            return [obj for obj in objs if self.admits(obj, obj.eviction_step, self._and)]
        if self._learned_only:  # Eq. 1 (inlined); with AND the model too
            if self.dither:
                eq1 = [obj for obj in objs if self.admitted(obj.evidence, obj.eviction_step)]
            else:
                theta_E, theta_R = self.theta_E, self.theta_R
                eq1 = [obj for obj in objs
                       if obj.evidence.E_b + obj.eviction_step >= theta_E or obj.evidence.R_b >= theta_R]
            return [obj for obj in eq1 if self.admits(obj, obj.eviction_step)] if self._and else eq1
        if not self.eq1_only:
            return [obj for obj in objs if self.admits(obj, obj.eviction_step)]
        if self.dither:
            return [obj for obj in objs if self.admitted(obj.evidence, obj.eviction_step)]
        theta_E, theta_R = self.theta_E, self.theta_R
        return [obj for obj in objs
                if obj.evidence.E_b + obj.eviction_step >= theta_E or obj.evidence.R_b >= theta_R]

    def by_reuse(self, evidence: Evidence) -> bool:
        """The reuse branch alone: the reuse path writes as soon as it holds (never for the oracle,
        nor with ``eq1&learned``, which judges the chunk at its eviction; with rule ``deferred``,
        only once DRAM has evicted something)."""
        if (not self.enabled or self._oracle or (self._deferred and not self.dram_evicted)
                or (self._and and self.learned is not None)):
            return False
        if self.dither:
            return evidence.R_b + chunk_fraction(evidence) >= self.theta_R
        return evidence.R_b >= self.theta_R
