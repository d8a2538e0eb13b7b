"""What a committed request places after prefill: its new KV into DRAM, SSD writes, promotions.

In HBM after prefill: every kv object of the request, the state objects of the chunks it computed
(hybrid models: those a checkpoint survived for), and the checkpoint its plan loaded, if the plan
was used. From there, in this order (``ControlPlane.commit_prefill``):

* store: every object prefill computed enters DRAM (``StoreOrder``), evicting from the LRU end;
* write-through (``Policy.write_through``): each of them is written to SSD from HBM;
* reuse path (paper §4.2): a chunk whose R_b reached theta_R is written if admission agrees, from
  its DRAM copy if readable, else from HBM;
* lazy partial promotion (paper §4.4, Eqs. 2-3): the first P SSD-hit chunks of the used prefix are
  copied from HBM into DRAM, P capped by free DRAM plus LRU candidates idle for ``P_tau``;
* prewrite (``Policy.prewrite``): LRU-end DRAM copies that would be admitted at their next
  eviction (E_b + 1) are written now.
"""

from __future__ import annotations


from saria.config import SariaConfig
from saria.control.admission import Admission
from saria.control.counters import Counters
from saria.control.promotion import promotion_groups, promotion_target
from saria.control.residency import PendingChanges, Residency
from saria.control.tree import ABSENT, DRAINING, READY, CacheObject, Node
from saria.orders import DRAM, GPU, SSD, ReloadPlan

__all__ = ["Placement"]


class Placement:
    """A control plane's placement after prefill (module docstring), under its config's policy."""

    def __init__(self, config: SariaConfig, tiers: Residency, admission: Admission, counters: Counters) -> None:
        policy = config.policy
        self._tiers = tiers
        self._admission = admission
        self._counters = counters
        self._hybrid = config.chunk.hybrid
        self._kv_bytes = config.chunk.kv_bytes
        self._store_new = config.dram_bytes > 0
        self._write_through = policy.write_through and config.ssd_bytes > 0
        self._ratio = config.promotion_ratio
        self._p_tau = policy.p_tau_s
        self._promote_ssd_hits = self._ratio > 0.0 and self._store_new
        # (admission.enabled, an SSD tier, is fixed for the plane's life: with none nothing is prewritten)
        self._prewrite_depth = policy.prewrite_depth if policy.prewrite and admission.enabled else 0

    def after_prefill(self, nodes: list[Node], usable: int, plan: ReloadPlan | None, state: CacheObject | None,
                      states: frozenset[int] | None, now: float, changes: PendingChanges) -> None:
        """Place a committed request's chunks ``nodes``, of which the first ``usable`` came from
        ``plan`` (None when ``usable`` is 0) with ``state``, the checkpoint it read (or None);
        ``states``: the chunks whose state objects prefill left readable (None: all)."""
        loaded_state = state if plan is not None and plan.state_source is not None else None
        self._store_and_write(nodes, usable, loaded_state, states, changes)
        if usable and self._promote_ssd_hits and plan.kv_sources[:usable].count(DRAM) < usable:  # an SSD hit to promote
            self._promote(nodes[:usable], plan, state if plan.state_source is SSD else None, now, changes)
        if self._prewrite_depth:
            self._prewrite(changes)

    def _store_and_write(self, nodes: list[Node], usable: int, loaded_state: CacheObject | None,
                         states: frozenset[int] | None, changes: PendingChanges) -> None:
        """New KV (every object prefill computed) enters DRAM; write-through and reuse-path writes.
        A write reads HBM (``Tier.GPU``) unless the object has a readable DRAM copy."""
        tiers = self._tiers
        if self._hybrid:
            computed = [obj for i, node in enumerate(nodes[usable:], usable) for obj in node.objects
                        if obj is node.kv or states is None or i in states]
        else:
            computed = nodes[usable:]  # a node is its kv object, and has no other
        hints = tiers.hints
        if hints.active:  # a done session's new chunks: never stored, never written (saria.control.hints)
            kept = [obj for obj in computed if not hints.never_written(obj)]
            hints.counters.done_stores_skipped += len(computed) - len(kept)
            computed = kept
        if self._store_new:
            absent = [obj for obj in computed if obj.dram == ABSENT]
            stored = tiers.reserve_dram(absent, changes)
            changes.stores += stored
            counters = self._counters
            counters.stores += len(stored)
            counters.store_bytes += sum([obj.nbytes for obj in stored]) if self._hybrid else len(stored) * self._kv_bytes
            counters.stores_skipped += len(absent) - len(stored)
            if hints.active and len(stored) < len(absent):  # no DRAM room: a retained or pinned chunk goes to SSD
                now = tiers.clock
                for obj in absent:
                    if obj.dram == ABSENT and obj.ssd == ABSENT and hints.held(obj, now):
                        tiers.write(obj, GPU, "write-through", changes, hinted=True)
        if self._write_through:
            for obj in computed:
                if obj.ssd == ABSENT:
                    tiers.write(obj, GPU, "write-through", changes)
        admission = self._admission
        if not admission.enabled:  # no SSD tier: theta_R is infinite, no chunk takes the reuse path
            return
        theta_R = admission.theta_R
        if admission.dither:  # R_b + u_b >= theta_R, u_b < 1: R_b > theta_R - 1 (by_reuse decides below)
            theta_R -= 1
        popular = [i for i, node in enumerate(nodes) if node.R_b >= theta_R]
        for i in popular:  # the reuse path: R_b reached theta_R, write what is not persisted
            node = nodes[i]
            for obj in node.objects:
                if obj.ssd != ABSENT or not admission.by_reuse(obj.evidence):
                    continue
                if hints.active and hints.decides(obj, tiers.clock):  # done, or its session's next turn decides
                    continue
                if obj.dram == READY or obj.dram == DRAINING:
                    tiers.write(obj, DRAM, "reuse", changes)
                elif obj is node.kv or obj is loaded_state or (
                        i >= usable and (states is None or i in states)):
                    tiers.write(obj, GPU, "reuse", changes)

    def _promote(self, used: list[Node], plan: ReloadPlan, loaded_state: CacheObject | None, now: float,
                 changes: PendingChanges) -> None:
        """Lazy partial promotion: copy the first P SSD-hit chunks of the ``used`` prefix (with
        ``loaded_state``, the checkpoint read from SSD) from HBM into DRAM,
        P = min(P_target, what free DRAM plus idle LRU candidates can take)."""
        sources = plan.kv_sources
        dram_hits = sources[:len(used)].count(DRAM)
        if dram_hits == len(used):  # no SSD hit: nothing to promote (promotion_target is 0)
            return
        target = promotion_target(self._ratio, dram_hits, len(used) - dram_hits)
        if target == 0:
            return
        chosen, need = promotion_groups(used, sources, target, loaded_state)
        if chosen:
            self._tiers.promote(chosen, need, now - self._p_tau, changes)

    def _prewrite(self, changes: PendingChanges) -> None:
        """Write LRU-end DRAM copies that would be admitted at their next eviction (E_b + 1)."""
        if not self._admission.enabled:  # no SSD tier: nothing is admitted (at_next_eviction is empty)
            return
        tiers = self._tiers
        hints = tiers.hints
        admission = self._admission
        for obj in admission.at_next_eviction(tiers.unpersisted_lru_end(self._prewrite_depth)):
            # the hints' verdict at the next eviction where they give one: a done session's chunk, or
            # one whose session's announced turn lies beyond the SSD's retention, is not prewritten
            if hints.active and hints.at_dram_eviction(obj, tiers.clock, admission.ssd_retention_s) is False:
                continue
            if obj.ssd == ABSENT:  # a write issued in this loop may have evicted nothing, but be sure
                tiers.write(obj, DRAM, "prewrite", changes)

