"""The two capacity-bounded tiers and every change to where an object's copies are.

Each tier counts what its copies that are not ``ABSENT`` take (filling, ready, draining or bad
copies all hold a slot) against its capacity: an object's ``dram_charge`` / ``ssd_charge``, its
whole host slots / SSD parts (:mod:`saria.sizing`: the data plane allocates exactly the capacity's
units, so whatever fits here fits there; a kv object's SSD charge is of its size under
``ssd_dtype``; with no sizing a charge is the object's size), and keeps its evictable copies
(``READY``, unpinned) in LRU order. All copy state changes go through :class:`Residency`, which
records the slots to drop and the copies to store, promote and write in a
:class:`PendingChanges`; the control plane turns those into orders (``emission``).

Rules:
* DRAM eviction increments E_b (of the kv object's chunk; a state object's own evidence only with
  per-object metadata). An admitted object that is not on SSD gets a write, and its DRAM slot is
  held (``DRAINING``, still readable) until the write ends; so is an object whose write is already
  in flight. Anything else is dropped at once.
* SSD eviction drops the copy. SSD objects found on the drives at start that no request has
  reached yet (``recovered``: a previous run's, see ``ControlPlane.recover_ssd``) hold their bytes
  too and are evicted first, oldest first, before any copy in the LRU.
* A pinned copy is out of its LRU: it cannot be evicted. When its last pin goes it re-enters at the
  most recently used end, or, if it was draining or bad meanwhile, its slot is reclaimed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import islice
from typing import Sequence

from saria.control.admission import Admission
from saria.control.counters import Counters
from saria.control.hints import HintBook
from saria.orders import DRAM, SSD, ObjectKey, Tier
from saria.control.tree import ABSENT, BAD, DRAINING, FILLING, READY, CacheObject, ContextTree, Node

WRITE_REASONS = ("eviction", "write-through", "reuse", "prewrite")
_ADMISSION_COUNTER = {"eviction": "admissions_eviction", "write-through": "admissions_write_through",
                      "reuse": "admissions_reuse", "prewrite": "admissions_prewrite"}


class TierState:
    """Capacity and use in bytes (charges, see the module docstring), and the LRU of evictable copies
    (least recently used first)."""

    __slots__ = ("tier", "capacity", "used", "lru")

    def __init__(self, tier: Tier, capacity: int) -> None:
        self.tier = tier
        self.capacity = capacity
        self.used = 0
        self.lru: OrderedDict[CacheObject, None] = OrderedDict()

    @property
    def free(self) -> int:
        return self.capacity - self.used


class PendingChanges:
    """What one control-plane call decided and has not yet turned into orders: slots to drop,
    copies to store, promote, prewarm and write."""

    __slots__ = ("dram_drops", "ssd_drops", "recovered_drops", "stores", "promotions", "prewarms", "writes")

    def __init__(self) -> None:
        self.dram_drops: list[CacheObject] = []
        self.ssd_drops: list[CacheObject] = []
        self.recovered_drops: list[ObjectKey] = []
        self.stores: list[CacheObject] = []
        self.promotions: list[CacheObject] = []
        self.prewarms: list[CacheObject] = []
        self.writes: dict[tuple[str, Tier], list[CacheObject]] = {}

    def write(self, reason: str, source: Tier, obj: CacheObject) -> None:
        key = (reason, source)
        objs = self.writes.get(key)
        if objs is None:
            self.writes[key] = [obj]
        else:
            objs.append(obj)


class Residency:
    """Copies of objects in DRAM and SSD: reservation, eviction, writes, pins and completions."""

    def __init__(self, dram_bytes: int, ssd_bytes: int, admission: Admission, tree: ContextTree,
                 counters: Counters, hints: HintBook | None = None) -> None:
        self.dram = TierState(DRAM, dram_bytes)
        self.ssd = TierState(SSD, ssd_bytes)
        self.recovered: OrderedDict[ObjectKey, int] = OrderedDict()  # on SSD, not yet in the tree: charges
        # kv objects whose DRAM copy a prewarm brought (or is bringing) and no committed plan has read
        # since: the mark goes on the first read (a prewarm hit) or when the copy goes (wasted if evicted).
        self.prewarmed: set[CacheObject] = set()
        self._admission = admission
        self._tree = tree
        self._counters = counters
        # the application's hints (saria.control.hints): looked at only once a hint was seen (hints.active)
        self.hints = hints if hints is not None else HintBook(0, 0, 0.0)

    @property
    def clock(self) -> float:
        """The current call's time."""
        return self._tree.clock

    # ---------------------------------------------------------------------------------------- DRAM
    def reserve_dram(self, objs: list[CacheObject], changes: PendingChanges) -> list[CacheObject]:
        """Give each of ``objs`` a DRAM slot (``FILLING``), in order, evicting from the LRU end as
        needed. Returns those that got one: an object gets none if it is larger than the tier or
        the LRU runs dry first (everything else pinned, filling or draining). Evictions stay done."""
        dram = self.dram
        lru = dram.lru
        capacity = dram.capacity
        pop = lru.popitem
        evict = self.evict_dram
        reserved = []
        for obj in objs:
            need = obj.dram_charge
            if need > capacity:
                continue
            while capacity - dram.used < need and lru:
                evict(pop(False)[0], changes)
            if capacity - dram.used >= need:
                dram.used += need
                obj.dram = FILLING
                reserved.append(obj)
        return reserved

    def evict_dram(self, obj: CacheObject, changes: PendingChanges) -> None:
        """Evict a ``READY`` copy the caller has taken out of the DRAM LRU: E_b goes up; an
        admitted copy not on SSD is written and its slot held (``DRAINING``) until the write ends,
        as is one whose write is already in flight; anything else is dropped at once."""
        evidence = obj.evidence
        evidence.E_b += obj.eviction_step
        self._counters.dram_evictions += 1
        self._admission.dram_evicted = True
        admission = self._admission
        if obj is obj.node:
            situations = admission.situations
            if situations is not None:
                situations.evicted(obj, self._tree.clock)
            tracker = admission.tracker
            if tracker is not None:
                tracker.evicted(obj, self._tree.clock)
        if self.prewarmed and obj in self.prewarmed:
            self.prewarmed.discard(obj)
            self._counters.prewarm_wasted += 1
        ssd = obj.ssd
        if ssd == ABSENT:
            hinted = (self.hints.at_dram_eviction(obj, self._tree.clock, self._admission.ssd_retention_s, count=True)
                      if self.hints.active else None)
            if hinted is None:
                if self._admission.admits(obj) and self.write(obj, DRAM, "eviction", changes):
                    obj.dram = DRAINING
                    return
            elif hinted:  # retained, pinned or its turn announced within the SSD's retention: written whatever
                # admission says (counted apart when only the hint admits)
                if self.write(obj, DRAM, "eviction", changes, hinted=not self._admission.admits(obj)):
                    obj.dram = DRAINING
                    return
        elif ssd == FILLING:  # a write is reading this copy: hold the slot until it ends
            obj.dram = DRAINING
            return
        # drop_dram, inlined: this is the common end of an eviction
        self.dram.used -= obj.dram_charge
        obj.dram = ABSENT
        changes.dram_drops.append(obj)
        if ssd == ABSENT:
            node = obj.node
            if node.state is None or node.holds_nothing():  # no state: obj is the kv object, now gone
                self._tree.went_idle(node)

    def frees_on_eviction(self, obj: CacheObject, earlier: int = 0) -> bool:
        """Whether evicting ``obj`` now gives its slot back at once (no write would hold it), after
        ``earlier`` evictions that add to the same evidence (a chunk's kv and state objects share
        E_b: evicting the kv object first can make the state object admitted)."""
        if obj.ssd == FILLING:
            return False
        if obj.ssd != ABSENT:
            return True
        if self.hints.active:  # the hints' verdict where they give one (a retained chunk is written, a done one never)
            hinted = self.hints.at_dram_eviction(obj, self._tree.clock, self._admission.ssd_retention_s)
            if hinted is not None:
                return not hinted
        return not self._admission.admits(obj, earlier + obj.eviction_step)

    def idle_candidates(self, idle_before: float, need: int, keep: set[Node] | None = None) -> list[CacheObject]:
        """LRU-end copies whose chunk was last reused at or before ``idle_before`` and whose eviction
        frees their slot at once, least recently used first, until ``need`` bytes (charges) are covered
        (walk stops at the first copy reused later). Whether a copy frees its slot counts the
        evictions of the candidates before it that share its evidence, as evicting them in this
        order will. ``keep``: chunks whose copies are passed over (a prewarm's own prompt)."""
        out: list[CacheObject] = []
        covered = 0
        earlier: dict[int, int] = {}  # id(evidence) -> E_b the candidates so far will add
        for obj in self.dram.lru:
            evidence = obj.evidence
            if covered >= need or evidence.last_reuse > idle_before:
                break
            if keep and obj.node in keep:
                continue
            added = earlier.get(id(evidence), 0)
            if self.frees_on_eviction(obj, added):
                out.append(obj)
                covered += obj.dram_charge
                if obj.eviction_step:
                    earlier[id(evidence)] = added + obj.eviction_step
        return out

    def promote(self, groups: list[list[CacheObject]], need: int, idle_before: float, changes: PendingChanges) -> None:
        """Reserve DRAM slots (``FILLING``) for lazy partial promotion: as many of ``groups`` (each a
        chunk's objects, ``need`` bytes of charges in all), from the first, as free DRAM plus the copies
        :meth:`idle_candidates` offers can take; those candidates are evicted as far as needed."""
        counters = self._counters
        counters.promotion_evictions += self._room_from_idle(groups, need, idle_before, None, changes)
        if not groups:
            return
        dram = self.dram
        for objs in groups:
            for obj in objs:
                dram.used += obj.dram_charge
                obj.dram = FILLING
                changes.promotions.append(obj)
                counters.promotion_bytes += obj.nbytes
        counters.promotions += len(groups)

    def drop_dram(self, obj: CacheObject, changes: PendingChanges) -> None:
        self.prewarmed.discard(obj)
        self.dram.used -= obj.dram_charge
        obj.dram = ABSENT
        changes.dram_drops.append(obj)
        if obj.ssd == ABSENT and obj.node.holds_nothing():
            self._tree.went_idle(obj.node)

    def dram_filled(self, objs: list[CacheObject], failing: set[CacheObject], changes: PendingChanges) -> None:
        """A store or promotion into these objects' DRAM slots ended; ``failing`` ones failed."""
        lru = self.dram.lru
        if not failing:  # the common case
            for obj in objs:
                obj.dram = READY
                lru[obj] = None
            return
        for obj in objs:
            if obj in failing:
                self.drop_dram(obj, changes)
            else:
                obj.dram = READY
                lru[obj] = None

    # ----------------------------------------------------------------------------------------- SSD
    def write(self, obj: CacheObject, source: Tier, reason: str, changes: PendingChanges,
              hinted: bool = False) -> bool:
        """Reserve an SSD slot for ``obj`` (evicting SSD copies as needed) and order the write.
        The caller has decided admission (``hinted``: a hint alone admitted it, counted in the
        hint counters instead of by ``reason``). False (counted as skipped) if SSD has no room."""
        if not self.reserve_ssd(obj.ssd_charge, changes):
            self._counters.writes_skipped += 1
            return False
        obj.ssd = FILLING
        changes.write(reason, source, obj)
        if hinted:
            self.hints.counters.hinted_admissions += 1
            return True
        counter = _ADMISSION_COUNTER[reason]
        setattr(self._counters, counter, getattr(self._counters, counter) + 1)
        return True

    def reserve_ssd(self, need: int, changes: PendingChanges) -> bool:
        ssd = self.ssd
        if need > ssd.capacity:
            return False
        lru, recovered = ssd.lru, self.recovered
        if recovered and ssd.capacity - ssd.used < need:
            if self.hints.active:
                self._drop_recovered_hinted(need, changes)
            else:
                while ssd.capacity - ssd.used < need and recovered:
                    self.drop_recovered(next(iter(recovered)), changes)
        if self.hints.active:
            return self._reserve_ssd_hinted(need, changes)
        while ssd.capacity - ssd.used < need:
            if not lru:
                return False
            self._counters.ssd_evictions += 1
            victim = lru.popitem(last=False)[0]
            self._admission.ssd_retention_s = self._tree.clock - victim.node.last_reuse
            self.drop_ssd(victim, changes)
        ssd.used += need
        return True

    def _drop_recovered_hinted(self, need: int, changes: PendingChanges) -> None:
        """:meth:`reserve_ssd`'s room from recovered objects under hints (a previous control plane's
        pins and retentions, ``ControlPlane.restore_hints``, wait for a request to reach their chunks):
        a pinned chunk's objects are never dropped, a retained chunk's only when no other recovered
        object is left (each group oldest first)."""
        ssd, hints, now = self.ssd, self.hints, self._tree.clock
        pinned, retains = hints.pinned_keys, hints.restored_retains
        retained: list[ObjectKey] = []
        for key in list(self.recovered):
            if ssd.capacity - ssd.used >= need:
                return
            if key.chunk in pinned:
                continue
            if retains.get(key.chunk, -math.inf) > now:
                retained.append(key)
                continue
            self.drop_recovered(key, changes)
        for key in retained:
            if ssd.capacity - ssd.used >= need:
                return
            self.drop_recovered(key, changes)

    def _reserve_ssd_hinted(self, need: int, changes: PendingChanges) -> bool:
        """:meth:`reserve_ssd`'s LRU eviction under hints: a pinned copy is never evicted, a copy
        inside its retention only when no other is left (oldest first); the copies passed over go
        to the most recently used end."""
        ssd, lru, hints, now = self.ssd, self.ssd.lru, self.hints, self._tree.clock
        held: list[CacheObject] = []
        retained: list[CacheObject] = []
        ok = True
        while ssd.capacity - ssd.used < need:
            if lru:
                victim = lru.popitem(last=False)[0]
                level = hints.protected(victim, now)
                if level:
                    (retained if level == 1 else held).append(victim)
                    continue
            elif retained:
                victim = retained.pop(0)
                hints.counters.retained_evicted += 1
            else:
                ok = False
                break
            self._counters.ssd_evictions += 1
            self._admission.ssd_retention_s = now - victim.node.last_reuse
            self.drop_ssd(victim, changes)
        for obj in retained + held:
            lru[obj] = None
        if ok:
            ssd.used += need
        return ok

    def drop_ssd(self, obj: CacheObject, changes: PendingChanges) -> None:
        self.ssd.used -= obj.ssd_charge
        obj.ssd = ABSENT
        obj.ssd_unread = False
        changes.ssd_drops.append(obj)
        if obj.dram == ABSENT and obj.node.holds_nothing():
            self._tree.went_idle(obj.node)

    def make_room(self, groups: list[list[CacheObject]], need: int, idle_before: float, keep: set[Node],
                  changes: PendingChanges) -> None:
        """Room in DRAM for a hinted prewarm of ``groups`` (``need`` bytes of charges, more than is
        free): evict :meth:`idle_candidates` (idle since ``idle_before``, not of ``keep``) as far as
        needed, after dropping from the end of ``groups`` the chunks that free DRAM plus every
        candidate cannot take. ``groups`` is shortened in place."""
        self._counters.prewarm_evictions += self._room_from_idle(groups, need, idle_before, keep, changes)

    def _room_from_idle(self, groups: list[list[CacheObject]], need: int, idle_before: float,
                        keep: set[Node] | None, changes: PendingChanges) -> int:
        """Shorten ``groups`` (``need`` bytes of charges) from the end to what free DRAM plus the
        :meth:`idle_candidates` can take, and evict those candidates as far as needed. Returns how
        many were evicted."""
        dram = self.dram
        shortfall = need - dram.free
        candidates = self.idle_candidates(idle_before, shortfall, keep) if shortfall > 0 else []
        room = dram.free + sum([obj.dram_charge for obj in candidates])
        while groups and need > room:  # take fewer chunks, from the end
            need -= sum([obj.dram_charge for obj in groups.pop()])
        evicted = 0
        for victim in candidates:
            if not groups or dram.free >= need:
                break
            del dram.lru[victim]
            self.evict_dram(victim, changes)
            evicted += 1
        while groups and need > dram.free:  # (candidates free their slots at once: never taken)
            need -= sum([obj.dram_charge for obj in groups.pop()])
        return evicted

    def prewarm(self, groups: list[list[CacheObject]], changes: PendingChanges) -> None:
        """Reserve DRAM slots (``FILLING``) for a prewarm of ``groups`` (each a chunk's objects, whose
        SSD copies are ready; the caller has checked they fit in free DRAM, or made room with
        :meth:`make_room`) and
        pin their SSD copies until the order completes. Marks the chunks' kv objects prewarmed."""
        dram = self.dram
        counters = self._counters
        for objs in groups:
            for obj in objs:
                dram.used += obj.dram_charge
                obj.dram = FILLING
                self.pin(obj, SSD)
                changes.prewarms.append(obj)
                counters.prewarm_bytes += obj.nbytes
                if obj is obj.node:  # a node is its kv object
                    self.prewarmed.add(obj)
        counters.prewarm_chunks += len(groups)
        counters.prewarm_orders += 1

    def drop_recovered(self, key: ObjectKey, changes: PendingChanges) -> None:
        """Drop a recovered SSD object no request has reached (its bytes are freed)."""
        self.ssd.used -= self.recovered.pop(key)
        changes.recovered_drops.append(key)
        self._counters.recovered_dropped += 1

    def adopt_recovered(self, obj: CacheObject) -> bool:
        """If ``obj`` (a copy-less object just given a node) was recovered on SSD, make that its
        ready SSD copy (its bytes are counted already). True if it was."""
        charge = self.recovered.pop(ObjectKey(obj.node.key, obj.kind), None)
        if charge is None:
            return False
        self.ssd.used += obj.ssd_charge - charge
        obj.ssd = READY
        self.ssd.lru[obj] = None
        self._counters.recovered_adopted += 1
        return True

    def ssd_written(self, objs: list[CacheObject], failing: set[CacheObject], changes: PendingChanges) -> None:
        """Writes into these objects' SSD slots ended; ``failing`` ones failed (the chunk stays
        non-persisted). A DRAM copy held for a write is reclaimed unless a plan pins it."""
        counters = self._counters
        lru = self.ssd.lru
        for obj in objs:
            if failing and obj in failing:
                counters.writes_failed += 1
                self.drop_ssd(obj, changes)
            else:
                obj.ssd = READY
                obj.ssd_unread = True
                lru[obj] = None
                counters.ssd_writes += 1
                counters.ssd_bytes_written += obj.ssd_nbytes
            if obj.dram == DRAINING and obj.dram_pins == 0:
                self.drop_dram(obj, changes)

    def unpersisted_lru_end(self, depth: int) -> list[CacheObject]:
        """Of the ``depth`` least recently used DRAM copies, those with no SSD copy or write."""
        return [obj for obj in islice(self.dram.lru, depth) if obj.ssd == ABSENT]

    # ---------------------------------------------------------------------------------------- pins
    def pin(self, obj: CacheObject, tier: Tier) -> None:
        """Keep ``obj``'s readable copy in ``tier`` from eviction until :meth:`unpin`."""
        if tier is DRAM:
            if obj.dram_pins == 0 and obj.dram == READY:
                del self.dram.lru[obj]
            obj.dram_pins += 1
        else:
            if obj.ssd_pins == 0:
                del self.ssd.lru[obj]
            obj.ssd_pins += 1

    def pin_all(self, objs: list[CacheObject], tiers: tuple[Tier, ...]) -> None:
        """:meth:`pin` ``objs[i]`` in ``tiers[i]``, for every i."""
        dram_lru, ssd_lru, dram = self.dram.lru, self.ssd.lru, DRAM
        for obj, tier in zip(objs, tiers):
            if tier is dram:
                if obj.dram_pins == 0 and obj.dram == READY:
                    del dram_lru[obj]
                obj.dram_pins += 1
            else:
                if obj.ssd_pins == 0:
                    del ssd_lru[obj]
                obj.ssd_pins += 1

    def unpin_all(self, objs: list[CacheObject], tiers: Sequence[Tier], changes: PendingChanges) -> None:
        """:meth:`unpin` ``objs[i]`` from ``tiers[i]``, for every i."""
        dram_lru, dram, unpin = self.dram.lru, DRAM, self.unpin
        for obj, tier in zip(objs, tiers):
            if tier is dram and obj.dram_pins == 1 and obj.dram == READY:  # the common case, inlined
                obj.dram_pins = 0
                dram_lru[obj] = None
            else:
                unpin(obj, tier, changes)

    def unpin(self, obj: CacheObject, tier: Tier, changes: PendingChanges) -> None:
        if tier is DRAM:
            obj.dram_pins -= 1
            if obj.dram_pins == 0:
                if obj.dram == READY:
                    self.dram.lru[obj] = None
                elif obj.dram == DRAINING and obj.ssd != FILLING:
                    self.drop_dram(obj, changes)
        else:
            obj.ssd_pins -= 1
            if obj.ssd_pins == 0:
                if obj.ssd == READY:
                    self.ssd.lru[obj] = None
                elif obj.ssd == BAD:
                    self.drop_ssd(obj, changes)

    def mark_bad(self, obj: CacheObject) -> None:
        """A read of ``obj``'s (pinned) SSD copy failed: it is never read again and its slot is
        reclaimed when its last pin goes."""
        obj.ssd = BAD
        self._counters.ssd_read_failures += 1

    def touch(self, nodes: list[Node]) -> None:
        """These chunks were referenced: their evictable copies (kv and state) move to the most
        recently used end of each tier's LRU."""
        dram_lru, ssd_lru = self.dram.lru, self.ssd.lru
        for node in nodes:
            for obj in (node,) if node.state is None else (node, node.state):
                if obj.dram == READY and obj.dram_pins == 0:
                    dram_lru.move_to_end(obj)
                if obj.ssd == READY and obj.ssd_pins == 0:
                    ssd_lru.move_to_end(obj)
