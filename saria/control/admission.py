"""Persistence-aware SSD admission (paper Eq. 1): ``admit(b) = E_b >= theta_E or R_b >= theta_R``.

Evaluated on a chunk's evidence (shared by all its objects with unified metadata), so a GDN
checkpoint is admitted exactly when its chunk is. A disabled branch (``None``) never fires;
``admit_all`` (full duplicate caching) admits everything; without an SSD tier nothing is admitted.
"""

from __future__ import annotations

import math

from saria.config import Policy
from saria.control.tree import CacheObject, Evidence


class Admission:
    __slots__ = ("theta_E", "theta_R", "admit_all", "enabled")

    def __init__(self, policy: Policy, ssd_capacity: int) -> None:
        self.theta_E = math.inf if policy.theta_E is None else policy.theta_E
        self.theta_R = math.inf if policy.theta_R is None else policy.theta_R
        self.admit_all = policy.admit_all
        self.enabled = ssd_capacity > 0

    def admitted(self, evidence: Evidence, extra_evictions: int = 0) -> bool:
        """Eq. 1 on ``evidence``, counting ``extra_evictions`` more evictions (prewrite asks with 1:
        would the chunk qualify at its next eviction?)."""
        return self.enabled and (self.admit_all or evidence.E_b + extra_evictions >= self.theta_E
                                 or evidence.R_b >= self.theta_R)

    def at_next_eviction(self, objs: list[CacheObject]) -> list[CacheObject]:
        """Those of ``objs`` that Eq. 1 admits with one more eviction (``E_b + eviction_step``):
        prewrite candidates. (Eq. 1 again, inlined for a list.)"""
        if not self.enabled:
            return []
        if self.admit_all:
            return list(objs)
        theta_E, theta_R = self.theta_E, self.theta_R
        return [obj for obj in objs
                if obj.evidence.E_b + obj.eviction_step >= theta_E or obj.evidence.R_b >= theta_R]

    def by_reuse(self, evidence: Evidence) -> bool:
        """The reuse branch alone: the reuse path writes as soon as it holds."""
        return self.enabled and evidence.R_b >= self.theta_R
