"""Persistence-aware SSD admission (paper Eq. 1): ``admit(b) = E_b >= theta_E or R_b >= theta_R``.

Evaluated on a chunk's evidence (shared by all its objects with unified metadata), so a GDN
checkpoint is admitted exactly when its chunk is. A disabled branch (``None``) never fires;
``admit_all`` (full duplicate caching) admits everything; without an SSD tier nothing is admitted.

Fractional thresholds (``dither``, set by the endurance governor): a chunk is admitted by eviction
when ``E_b + u_b >= theta_E`` and by reuse when ``R_b + u_b >= theta_R``, with ``u_b`` in [0, 1) a
fixed pseudo-random fraction of the chunk's hash. For integer thresholds this is exactly Eq. 1;
theta_E = 2.4 admits every chunk with ``E_b >= 3`` and the 60 % of chunks with ``E_b = 2`` whose
``u_b >= 0.4``, so writes move smoothly between E2 and E3 (and likewise between R8 and R9). (A state object with its own evidence, under per-object metadata, has
no hash of its own: ``u = 0``.)
"""

from __future__ import annotations

import math
import zlib

from saria.config import Policy
from saria.control.tree import CacheObject, Evidence, Node

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


class Admission:
    __slots__ = ("theta_E", "theta_R", "admit_all", "enabled", "dither")

    def __init__(self, policy: Policy, ssd_capacity: int) -> None:
        self.theta_E = math.inf if policy.theta_E is None else policy.theta_E
        self.theta_R = math.inf if policy.theta_R is None else policy.theta_R
        self.admit_all = policy.admit_all
        self.enabled = ssd_capacity > 0
        self.dither = False

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

    def at_next_eviction(self, objs: list[CacheObject]) -> list[CacheObject]:
        """Those of ``objs`` that Eq. 1 admits with one more eviction (``E_b + eviction_step``):
        prewrite candidates. (Eq. 1 again, inlined for a list.)"""
        if not self.enabled:
            return []
        if self.admit_all:
            return list(objs)
        if self.dither:
            return [obj for obj in objs if self.admitted(obj.evidence, obj.eviction_step)]
        theta_E, theta_R = self.theta_E, self.theta_R
        return [obj for obj in objs
                if obj.evidence.E_b + obj.eviction_step >= theta_E or obj.evidence.R_b >= theta_R]

    def by_reuse(self, evidence: Evidence) -> bool:
        """The reuse branch alone: the reuse path writes as soon as it holds."""
        if self.dither:
            return self.enabled and evidence.R_b + chunk_fraction(evidence) >= self.theta_R
        return self.enabled and evidence.R_b >= self.theta_R
