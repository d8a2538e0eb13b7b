"""A reference model of the control plane: what ``saria.control.ControlPlane`` must do, written as
plainly as possible from docs/architecture.md and the paper, for differential tests (``test_control_differential``).

Nothing here is fast and nothing is incremental that can be recomputed: tier use is summed from the
copies on every look, an LRU is a recency stamp per copy sorted on every look, children are
counted from parent links, and the metadata window is a flag per node checked against the clock.
The model keeps no state the real control plane is tested for, so where the two agree, both
follow the rules below; where they differ, the real one is wrong or the rule is.

Semantics (docs/architecture.md "Control plane", paper Eqs. 1-3):

* A node per chunk hash, with its parent's node; a request's hashes walk one path from the root.
  A known chunk must sit under the previous chunk of the request; no known chunk may follow an
  unknown one; no hash may repeat. A node keeps ``E_b``, ``R_b``, ``last_reuse``, and its objects:
  ``kv`` always, ``state`` on checkpoint boundaries (depth + 1 a multiple of the checkpoint
  interval) of hybrid models. The evidence of a state object is its node's (unified metadata) or
  its own (E_b, R_b, last_reuse), and then its DRAM evictions count for it alone.
* A copy (of an object, in DRAM or SSD) is absent, filling (an order writes it), ready, draining
  (DRAM: evicted, held as a write source or for a plan; readable), or bad (SSD: a read failed; held
  for the plans that pinned it). Every copy that is not absent takes its bytes of the tier.
* LRU: a ready copy is stamped when it becomes ready, when a request references its chunk, and
  when its last pin goes; the tier evicts the oldest stamp among ready, unpinned copies.
* Eq. 1: ``admit = E_b >= theta_E or R_b >= theta_R`` (``admit_all``: always; no SSD: never); with
  the endurance governor theta_E and theta_R are fractional and a chunk counts ``E_b + u_b`` and
  ``R_b + u_b``, ``u_b`` a fixed fraction of its hash (0 for a state object with its own evidence).
* DRAM eviction: E_b += 1 (a kv object; a state object only with its own evidence); then a copy
  that is admitted and not on SSD gets an SSD write from DRAM ("eviction") and drains until the
  write ends, one whose write is in flight drains too, anything else is dropped. No SSD room for
  the write (after evicting SSD copies): the copy is dropped and the write counted as skipped.
* SSD eviction drops the copy. SSD room is made by evicting until the object fits or nothing is
  evictable; evictions made stay made even if it still does not fit.
* Plans: the longest prefix of the request whose kv objects are readable: ``unified`` reads each
  from DRAM when readable there, else from a ready SSD copy; ``tier-prefix`` reads from DRAM while
  it can, then from SSD, and stops at the first chunk SSD lacks. Hybrid models cut back to the
  deepest boundary whose state object is readable (DRAM preferred). Every read pins its copy.
* Commit: a failed SSD read (named by chunk hash: all of its SSD-read objects; or one object) marks
  the copy bad; chunks from the first failed one on count as recomputed (hybrid: the whole plan).
  Known chunks get R_b += 1, last_reuse = now, their copies stamped; unknown ones become nodes.
  Then the plan's pins go (in plan order: kv objects, then the state object); then new objects
  (those prefill computed: kv objects of recomputed chunks, and their state objects where
  ``states`` says prefill left them) without a DRAM copy get DRAM slots (stores), evicting LRU
  copies as needed, in request order; write-through writes them from HBM; the reuse path writes
  every not-persisted object of chunks with R_b >= theta_R whose own evidence reaches theta_R
  (from DRAM if readable there, else from HBM if HBM holds it), with admission rule ``deferred``
  only once DRAM has evicted something; promotion (Eqs. 2-3) of the first
  ``P`` SSD-read chunks without a DRAM copy (with the plan's state object alongside its chunk),
  ``P = max(0, floor(r (D0 + S0) - D0))`` cut to what free DRAM plus idle (last reused at least
  ``p_tau`` ago), immediately freeing LRU copies can take (whether a copy frees its slot at once
  counts the evictions of the candidates before it: a chunk's kv and state share E_b); prewrite: of the ``depth`` oldest LRU
  DRAM copies, those not on SSD that Eq. 1 admits with one more eviction are written from DRAM.
* Completions: a store or promotion makes its copies ready (failed ones are dropped); a write
  makes its SSD copies ready (failed ones dropped) and then drops DRAM copies draining for it,
  unless a plan pins them. A written copy counts as useful (its bytes, once) the first time a
  committed plan reads it from SSD, until its SSD copy is dropped.
* Metadata window: a node is quiet since its last reference or since its last copy went (whichever
  is later). At the end of every call, a node quiet for a whole window (``quiet_since <= now -
  window``) is parked; a parked node with no children and no copy is reclaimed (and so, in turn,
  its parent if parked, childless and empty). A reference, or losing its last copy, unparks it.
* Time never runs backwards: an earlier ``now`` counts as the latest seen.

Rules where the semantics leave an order open (both implementations follow them):

* Ids: one counter for plans and orders, from 1, in the order they are handed out.
* Orders of one call, in this order: one DRAM DropOrder and one SSD DropOrder (objects in the order
  their slots were freed); eviction writes; the StoreOrder; write-through, reuse and prewrite
  writes (one order per reason and source, DRAM source before HBM); the PromoteOrder. Objects
  within an order in the order they were decided; ``kv`` lists kv objects' chunks, ``state`` state
  objects' chunks, ``nbytes`` the sum.
* A DRAM slot freed during a call may be reserved again in the same call (drops come first).
* Validation comes first: a bad call raises ControlPlaneError and changes nothing.
"""

from __future__ import annotations

import math
import zlib
from collections import abc
from dataclasses import dataclass
from typing import Hashable

from saria.config import SariaConfig
from saria.control import Counters
from saria.control.governor import EnduranceGovernor
from saria.orders import (ControlPlaneError, DropOrder, ObjectKey, PromoteOrder, ReloadPlan, StoreOrder, Tier,
                          WriteOrder)

ABSENT, FILLING, READY, DRAINING, BAD = "absent", "filling", "ready", "draining", "bad"
DRAM, SSD, GPU = Tier.DRAM, Tier.SSD, Tier.GPU
REASONS = ("eviction", "write-through", "reuse", "prewrite")


class Evidence:
    def __init__(self, now: float) -> None:
        self.E_b = 0
        self.R_b = 0
        self.last_reuse = now


class Obj:
    """One object: kv or state of a chunk, with a copy status, pin count and stamp per tier."""

    def __init__(self, node: "Node", kind: str, nbytes: int, own: Evidence | None) -> None:
        self.node, self.kind, self.nbytes, self.own = node, kind, nbytes, own
        self.status = {DRAM: ABSENT, SSD: ABSENT}
        self.pins = {DRAM: 0, SSD: 0}
        self.stamp = {DRAM: 0, SSD: 0}

    @property
    def evidence(self):
        return self.own if self.own is not None else self.node

    @property
    def eviction_step(self) -> int:
        return 1 if self.kind == "kv" or self.own is not None else 0

    def readable(self, tier: Tier) -> bool:
        return self.status[tier] in ((READY, DRAINING) if tier is DRAM else (READY,))


class Node:
    def __init__(self, key: Hashable, parent: "Node | None", now: float) -> None:
        self.key, self.parent = key, parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.E_b = self.R_b = 0
        self.last_reuse = self.quiet_since = now
        self.parked = False
        self.kv: Obj = None  # type: ignore[assignment]
        self.state: Obj | None = None

    @property
    def objects(self) -> list[Obj]:
        return [self.kv] if self.state is None else [self.kv, self.state]

    def holds_nothing(self) -> bool:
        return all(obj.status[t] == ABSENT for obj in self.objects for t in (DRAM, SSD))


@dataclass
class PlanRecord:
    plan: ReloadPlan
    reads: list[tuple[Obj, Tier]]  # kv objects in request order, then the state object


class Batch:
    def __init__(self) -> None:
        self.drops: dict[Tier, list[Obj]] = {DRAM: [], SSD: []}
        self.stores: list[Obj] = []
        self.promotions: list[Obj] = []
        self.writes: dict[tuple[str, Tier], list[Obj]] = {}


class Model:
    def __init__(self, config: SariaConfig) -> None:
        self.config = config
        policy = config.policy
        self.capacity = {DRAM: config.dram_bytes, SSD: config.ssd_bytes}
        self.chunk = config.chunk
        self.nodes: dict[Hashable, Node] = {}
        self.plans: dict[int, PlanRecord] = {}
        self.in_flight: dict[int, tuple[object, list[Obj]]] = {}
        self.counters = Counters()
        self.unread: set[Obj] = set()  # written to SSD, not read from there since
        self.dram_evicted = False  # admission rule deferred: reuse writes start at the first DRAM eviction
        self.next_id = 1
        self.now = -math.inf
        self.tick = 0
        self.theta_E = math.inf if policy.theta_E is None else policy.theta_E
        self.theta_R = math.inf if policy.theta_R is None else policy.theta_R
        self.governor = None
        if config.write_budget.auto:
            self.governor = EnduranceGovernor.from_config(config.write_budget, config.write_budget_bytes_per_s,
                                                          policy.theta_E, policy.theta_R)
            self.theta_E = self.governor.theta_E
            self.theta_R = self.governor.theta_R

    # ------------------------------------------------------------------------------ tiers
    def objects(self) -> list[Obj]:
        return [obj for node in self.nodes.values() for obj in node.objects]

    def used(self, tier: Tier) -> int:
        return sum(obj.nbytes for obj in self.objects() if obj.status[tier] != ABSENT)

    def free(self, tier: Tier) -> int:
        return self.capacity[tier] - self.used(tier)

    def lru(self, tier: Tier) -> list[Obj]:
        """Evictable copies, least recently stamped first."""
        return sorted((o for o in self.objects() if o.status[tier] == READY and o.pins[tier] == 0),
                      key=lambda o: o.stamp[tier])

    def stamp(self, obj: Obj, tier: Tier) -> None:
        self.tick += 1
        obj.stamp[tier] = self.tick

    def became_ready(self, obj: Obj, tier: Tier) -> None:
        obj.status[tier] = READY
        self.stamp(obj, tier)

    def drop(self, obj: Obj, tier: Tier, batch: Batch) -> None:
        obj.status[tier] = ABSENT
        if tier is SSD:
            self.unread.discard(obj)
        batch.drops[tier].append(obj)
        if obj.node.holds_nothing():  # its last copy went: the window restarts
            obj.node.parked = False
            obj.node.quiet_since = self.now

    # ----------------------------------------------------------------------------- Eq. 1
    def admitted(self, obj: Obj, extra: int = 0) -> bool:
        policy = self.config.policy
        if self.capacity[SSD] == 0:
            return False
        ev = obj.evidence
        if policy.admit_all or self.reuses(obj) >= self.theta_R:
            return True
        count = ev.E_b + extra
        if self.governor is not None:
            count += fraction(obj.node.key) if obj.own is None else 0.0
        return count >= self.theta_E

    def reuses(self, obj: Obj) -> float:
        """R_b, plus ``u_b`` under the governor (whose theta_R is fractional too)."""
        if self.governor is None:
            return obj.evidence.R_b
        return obj.evidence.R_b + (fraction(obj.node.key) if obj.own is None else 0.0)

    def evict_dram(self, obj: Obj, batch: Batch) -> None:
        obj.evidence.E_b += obj.eviction_step
        self.counters.dram_evictions += 1
        self.dram_evicted = True
        if obj.status[SSD] == ABSENT and self.admitted(obj) and self.write(obj, DRAM, "eviction", batch):
            obj.status[DRAM] = DRAINING
        elif obj.status[SSD] == FILLING:
            obj.status[DRAM] = DRAINING
        else:
            self.drop(obj, DRAM, batch)

    def reserve_ssd(self, need: int, batch: Batch) -> bool:
        if need > self.capacity[SSD]:
            return False
        while self.free(SSD) < need:
            lru = self.lru(SSD)
            if not lru:
                return False
            self.counters.ssd_evictions += 1
            self.drop(lru[0], SSD, batch)
        return True

    def write(self, obj: Obj, source: Tier, reason: str, batch: Batch) -> bool:
        if not self.reserve_ssd(obj.nbytes, batch):
            self.counters.writes_skipped += 1
            return False
        obj.status[SSD] = FILLING
        batch.writes.setdefault((reason, source), []).append(obj)
        name = {"eviction": "admissions_eviction", "write-through": "admissions_write_through",
                "reuse": "admissions_reuse", "prewrite": "admissions_prewrite"}[reason]
        setattr(self.counters, name, getattr(self.counters, name) + 1)
        return True

    def reserve_dram(self, objs: list[Obj], batch: Batch) -> list[Obj]:
        got = []
        for obj in objs:
            if obj.nbytes > self.capacity[DRAM]:
                continue
            while self.free(DRAM) < obj.nbytes and self.lru(DRAM):
                self.evict_dram(self.lru(DRAM)[0], batch)
            if self.free(DRAM) >= obj.nbytes:
                obj.status[DRAM] = FILLING
                got.append(obj)
        return got

    def unpin(self, obj: Obj, tier: Tier, batch: Batch) -> None:
        obj.pins[tier] -= 1
        if obj.pins[tier]:
            return
        status = obj.status[tier]
        if status == READY:
            self.stamp(obj, tier)
        elif tier is DRAM and status == DRAINING and obj.status[SSD] != FILLING:
            self.drop(obj, DRAM, batch)
        elif tier is SSD and status == BAD:
            self.drop(obj, SSD, batch)

    # ------------------------------------------------------------------------- validation
    def check_now(self, now: object) -> float:
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ControlPlaneError(f"bad now {now!r}")
        return max(now, self.now)

    @staticmethod
    def check_hashes(hashes: object) -> tuple:
        if isinstance(hashes, (str, bytes)) or not isinstance(hashes, abc.Sequence):
            raise ControlPlaneError(f"bad chunk hashes {hashes!r}")
        return tuple(hashes)

    def resolve(self, hashes: tuple) -> list[Node | None]:
        out: list[Node | None] = []
        parent, unknown = None, False
        for key in hashes:
            try:
                node = self.nodes.get(key)
            except TypeError:
                raise ControlPlaneError(f"unhashable chunk hash {key!r}") from None
            if node is not None and (unknown or node.parent is not parent):
                raise ControlPlaneError(f"chunk {key!r} contradicts the tree")
            out.append(node)
            parent, unknown = node, node is None
        if len(set(hashes)) != len(hashes):
            raise ControlPlaneError("a hash repeats")
        return out

    @staticmethod
    def check_id(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ControlPlaneError(f"bad id {value!r}")
        return value

    def live_plan(self, plan: object) -> PlanRecord:
        plan_id = plan.plan_id if isinstance(plan, ReloadPlan) else self.check_id(plan)
        record = self.plans.get(plan_id)
        if record is None or (isinstance(plan, ReloadPlan) and plan != record.plan):
            raise ControlPlaneError(f"not a live plan: {plan!r}")
        return record

    @staticmethod
    def check_names(failed: object) -> list:
        if isinstance(failed, (str, bytes)) or not isinstance(failed, abc.Iterable):
            raise ControlPlaneError(f"failed must be an iterable of chunk hashes or ObjectKeys, got {failed!r}")
        names = list(failed)
        for name in names:
            try:
                hash(name)
            except TypeError:
                raise ControlPlaneError(f"unhashable failure name {name!r}") from None
        return names

    @staticmethod
    def named(objs: list[Obj], names: list) -> set[Obj]:
        out: set[Obj] = set()
        for name in names:
            if isinstance(name, ObjectKey):
                match = [o for o in objs if o.node.key == name.chunk and o.kind == name.kind]
            else:
                match = [o for o in objs if o.node.key == name]
            if not match:
                raise ControlPlaneError(f"{name!r} names none of the objects")
            out.update(match)
        return out

    # --------------------------------------------------------------------------------- API
    def plan(self, hashes: object, now: object) -> ReloadPlan:
        now = self.check_now(now)
        hashes = self.check_hashes(hashes)
        nodes = self.resolve(hashes)
        self.now = now
        tier_prefix = self.config.policy.lookup == "tier-prefix"
        sources: list[Tier] = []
        cut, state, state_source = 0, None, None
        switched = False
        for node in nodes:
            if node is None:
                break
            if node.kv.readable(DRAM) and not (tier_prefix and switched):
                sources.append(DRAM)
            elif node.kv.readable(SSD):
                sources.append(SSD)
                switched = True
            else:
                break
            if self.chunk.hybrid and node.state is not None:
                for tier in (DRAM, SSD):
                    if node.state.readable(tier):
                        cut, state, state_source = len(sources), node.state, tier
                        break
        if self.chunk.hybrid:
            sources = sources[:cut]
        n = len(sources)
        reads = [(nodes[i].kv, sources[i]) for i in range(n)]
        if state is not None:
            reads.append((state, state_source))
        for obj, tier in reads:
            obj.pins[tier] += 1
        dram_bytes = sum(o.nbytes for o, t in reads if t is DRAM)
        ssd_bytes = sum(o.nbytes for o, t in reads if t is SSD)
        plan = ReloadPlan(self.take_id(), hashes[:n], tuple(sources), None if state is None else state.node.key,
                          state_source, n * self.chunk.chunk_tokens, dram_bytes, ssd_bytes,
                          self.config.policy.serial_loading)
        self.plans[plan.plan_id] = PlanRecord(plan, reads)
        self.counters.plans += 1
        self.end(Batch())
        return plan

    def release(self, plan: object, now: object, failed: object = ()) -> list:
        now = self.check_now(now)
        record = self.live_plan(plan)
        bad = self.named([o for o, t in record.reads if t is SSD], self.check_names(failed))
        self.now = now
        batch = Batch()
        self.finish_reads(record, bad, batch, used=False)
        return self.end(batch)

    def commit_prefill(self, hashes: object, now: object, plan: object = None, failed: object = (),
                       states: object = None) -> list:
        now = self.check_now(now)
        hashes = self.check_hashes(hashes)
        if states is not None:
            if isinstance(states, (str, bytes)) or not isinstance(states, abc.Iterable):
                raise ControlPlaneError(f"bad states {states!r}")
            states = list(states)
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(hashes) for i in states):
                raise ControlPlaneError(f"bad states {states!r}")
            states = set(states)
        names = self.check_names(failed)
        record = None if plan is None else self.live_plan(plan)
        if record is None and names:
            raise ControlPlaneError("failures without a plan")
        planned = 0 if record is None else record.plan.num_chunks
        if hashes[:planned] != record_hashes(record):
            raise ControlPlaneError("the plan does not begin the committed hashes")
        nodes = self.resolve(hashes)
        bad: set[Obj] = set()
        first_bad = planned
        if record is not None:
            bad = self.named([o for o, t in record.reads if t is SSD], names)
            if bad:
                first_bad = min(hashes.index(o.node.key) for o in bad)
        # ---- valid
        self.now = now
        batch = Batch()
        usable = planned if first_bad >= planned else (0 if self.chunk.hybrid else first_bad)
        # account: references, reuse evidence, LRU stamps, new nodes, hits
        known = [n for n in nodes if n is not None]
        for node in known:
            node.R_b += 1
            node.last_reuse = node.quiet_since = now
            node.parked = False
            for obj in node.objects:
                for tier in (DRAM, SSD):
                    if obj.status[tier] == READY:
                        self.stamp(obj, tier)
        parent = known[-1] if known else None
        for i in range(len(known), len(hashes)):
            nodes[i] = parent = self.new_node(hashes[i], parent, now)
        c = self.counters
        c.requests += 1
        c.references += len(hashes)
        if usable:
            sources = record.plan.kv_sources[:usable]
            kv_bytes = self.chunk.kv_bytes
            c.hits_dram_chunks += sources.count(DRAM)
            c.hits_ssd_chunks += sources.count(SSD)
            c.hits_dram_bytes += sources.count(DRAM) * kv_bytes
            c.hits_ssd_bytes += sources.count(SSD) * kv_bytes
            if record.plan.state_source is not None:
                state_obj = record.reads[-1][0]
                if record.plan.state_source is DRAM:
                    c.hits_dram_bytes += state_obj.nbytes
                else:
                    c.hits_ssd_bytes += state_obj.nbytes
                if state_obj.own is not None:
                    state_obj.own.R_b += 1
                    state_obj.own.last_reuse = now
        c.misses += len(hashes) - usable
        if record is not None:
            self.finish_reads(record, bad, batch, used=True)
        # new KV in DRAM, write-through, reuse path
        computed = [obj for i in range(usable, len(hashes)) for obj in nodes[i].objects
                    if obj.kind == "kv" or states is None or i in states]
        if self.capacity[DRAM] > 0:
            absent = [o for o in computed if o.status[DRAM] == ABSENT]
            stored = self.reserve_dram(absent, batch)
            batch.stores += stored
            c.stores += len(stored)
            c.store_bytes += sum(o.nbytes for o in stored)
            c.stores_skipped += len(absent) - len(stored)
        if self.config.policy.write_through and self.capacity[SSD] > 0:
            for obj in computed:
                if obj.status[SSD] == ABSENT:
                    self.write(obj, GPU, "write-through", batch)
        loaded_state = record.reads[-1][0] if usable and record.plan.state_source is not None else None
        deferred = "deferred" in self.config.policy.admission.split("+") and not self.dram_evicted
        if self.capacity[SSD] > 0 and not deferred:
            for i, node in enumerate(nodes):
                if node.R_b + (fraction(node.key) if self.governor is not None else 0.0) < self.theta_R:
                    continue
                for obj in node.objects:
                    if obj.status[SSD] != ABSENT or self.reuses(obj) < self.theta_R:
                        continue
                    if obj.readable(DRAM):
                        self.write(obj, DRAM, "reuse", batch)
                    elif obj.kind == "kv" or obj is loaded_state or (i >= usable and (states is None or i in states)):
                        self.write(obj, GPU, "reuse", batch)
        if usable and self.config.promotion_ratio > 0 and self.capacity[DRAM] > 0:
            self.promote(record, usable, now, batch)
        if self.config.policy.prewrite and self.config.policy.prewrite_depth:
            tail = self.lru(DRAM)[:self.config.policy.prewrite_depth]
            for obj in [o for o in tail if o.status[SSD] == ABSENT and self.admitted(o, o.eviction_step)]:
                self.write(obj, DRAM, "prewrite", batch)
        return self.end(batch)

    def complete(self, order_id: object, ok: object, now: object, failed: object = ()) -> list:
        now = self.check_now(now)
        if not isinstance(ok, bool):
            raise ControlPlaneError(f"ok must be a bool, got {ok!r}")
        flight = self.in_flight.get(self.check_id(order_id))
        if flight is None:
            raise ControlPlaneError(f"order {order_id!r} is not in flight")
        order, objs = flight
        failing = self.named(objs, self.check_names(failed)) if ok else set(objs)
        self.now = now
        del self.in_flight[order_id]
        batch = Batch()
        c = self.counters
        for obj in objs:
            if isinstance(order, WriteOrder):
                if obj in failing:
                    c.writes_failed += 1
                    self.drop(obj, SSD, batch)
                else:
                    self.became_ready(obj, SSD)
                    self.unread.add(obj)
                    c.ssd_writes += 1
                    c.ssd_bytes_written += obj.nbytes
                if obj.status[DRAM] == DRAINING and obj.pins[DRAM] == 0:
                    self.drop(obj, DRAM, batch)
            elif obj in failing:
                self.drop(obj, DRAM, batch)
            else:
                self.became_ready(obj, DRAM)
        if not isinstance(order, WriteOrder):
            if isinstance(order, StoreOrder):
                c.stores_failed += len(failing)
            else:
                c.promotions_failed += len(failing)
        return self.end(batch)

    # ---------------------------------------------------------------------------- helpers
    def new_node(self, key: Hashable, parent: Node | None, now: float) -> Node:
        node = Node(key, parent, now)
        node.kv = Obj(node, "kv", self.chunk.kv_bytes, None)
        every = self.chunk.checkpoint_chunks
        if self.chunk.hybrid and (node.depth + 1) % every == 0:
            own = None if self.config.policy.unified_metadata else Evidence(now)
            node.state = Obj(node, "state", self.chunk.state_bytes, own)
        self.nodes[key] = node
        self.counters.nodes_created += 1
        return node

    def finish_reads(self, record: PlanRecord, bad: set[Obj], batch: Batch, used: bool) -> None:
        del self.plans[record.plan.plan_id]
        for obj in bad:
            obj.status[SSD] = BAD
            self.counters.ssd_read_failures += 1
        if used:
            ssd_reads = [o for o, t in record.reads if t is SSD]
            self.counters.ssd_reads += len(ssd_reads) - len(bad)
            self.counters.ssd_bytes_read += sum(o.nbytes for o in ssd_reads if o not in bad)
            for obj in ssd_reads:  # a write's first read from SSD makes it a useful write
                if obj in self.unread and obj not in bad:
                    self.unread.discard(obj)
                    self.counters.ssd_useful_write_bytes += obj.nbytes
        for obj, tier in record.reads:
            self.unpin(obj, tier, batch)

    def promote(self, record: PlanRecord, usable: int, now: float, batch: Batch) -> None:
        sources = record.plan.kv_sources[:usable]
        d0 = sources.count(DRAM)
        s0 = usable - d0
        target = min(max(0, math.floor(self.config.promotion_ratio * (d0 + s0) - d0 + 1e-9)), s0)
        state = record.reads[-1][0] if record.plan.state_source is SSD else None
        chosen: list[list[Obj]] = []
        for (kv, source) in record.reads[:usable]:
            if len(chosen) == target:
                break
            if source is SSD and kv.status[DRAM] == ABSENT:
                group = [kv]
                if state is not None and kv.node.state is state and state.status[DRAM] == ABSENT:
                    group.append(state)
                chosen.append(group)
        if not chosen:
            return
        need = sum(o.nbytes for group in chosen for o in group)
        free = self.free(DRAM)
        candidates, covered = [], 0
        if need > free:
            for obj in self.lru(DRAM):
                if covered >= need - free or obj.evidence.last_reuse > now - self.config.policy.p_tau_s:
                    break
                # Evicting the candidates before it adds to a shared E_b (a chunk's kv, then its state).
                earlier = sum(o.eviction_step for o in candidates if o.evidence is obj.evidence)
                frees = obj.status[SSD] != FILLING and (obj.status[SSD] != ABSENT
                                                        or not self.admitted(obj, earlier + obj.eviction_step))
                if frees:
                    candidates.append(obj)
                    covered += obj.nbytes
        while chosen and need > free + covered:
            need -= sum(o.nbytes for o in chosen.pop())
        if not chosen:
            return
        for victim in candidates:
            if self.free(DRAM) >= need:
                break
            self.evict_dram(victim, batch)
            self.counters.promotion_evictions += 1
        for group in chosen:
            for obj in group:
                obj.status[DRAM] = FILLING
                batch.promotions.append(obj)
                self.counters.promotion_bytes += obj.nbytes
        self.counters.promotions += len(chosen)

    def end(self, batch: Batch) -> list:
        """End of a call that changed state: the metadata window, the governor, the orders."""
        cutoff = self.now - self.config.policy.metadata_window_s
        for node in self.nodes.values():
            if node.quiet_since <= cutoff:
                node.parked = True
        while True:
            children = {id(n.parent) for n in self.nodes.values() if n.parent is not None}
            gone = [n for n in self.nodes.values() if n.parked and id(n) not in children and n.holds_nothing()]
            if not gone:
                break
            for node in gone:
                del self.nodes[node.key]
                self.counters.nodes_reclaimed += 1
        if self.governor is not None:
            self.theta_E = self.governor.update(self.now, self.counters.ssd_bytes_written)
            self.theta_R = self.governor.theta_R
        orders = []
        for tier in (DRAM, SSD):
            if batch.drops[tier]:
                orders.append(self.order(DropOrder, batch.drops[tier], tier=tier))
        writes = sorted(batch.writes.items(), key=lambda item: (REASONS.index(item[0][0]), item[0][1] is GPU))
        for (reason, source), objs in writes:
            if reason == "eviction":
                orders.append(self.order(WriteOrder, objs, source=source, reason=reason))
        if batch.stores:
            orders.append(self.order(StoreOrder, batch.stores))
        for (reason, source), objs in writes:
            if reason != "eviction":
                orders.append(self.order(WriteOrder, objs, source=source, reason=reason))
        if batch.promotions:
            orders.append(self.order(PromoteOrder, batch.promotions))
        return orders

    def order(self, kind: type, objs: list[Obj], **extra: object) -> object:
        kv = tuple(o.node.key for o in objs if o.kind == "kv")
        state = tuple(o.node.key for o in objs if o.kind == "state")
        order = kind(self.take_id(), kv, state, sum(o.nbytes for o in objs), **extra)
        if kind is not DropOrder:
            self.in_flight[order.order_id] = (order, list(objs))
        return order

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    # -------------------------------------------------------------------------- observers
    def chunk_info(self, key: Hashable) -> tuple | None:
        try:
            node = self.nodes.get(key)
        except TypeError:
            raise ControlPlaneError(f"unhashable chunk hash {key!r}") from None
        if node is None:
            return None
        return (node.key, node.depth, None if node.parent is None else node.parent.key, node.E_b, node.R_b,
                node.last_reuse, copy_info(node.kv), None if node.state is None else copy_info(node.state))

    def usage(self) -> tuple:
        return (self.used(DRAM), self.capacity[DRAM], self.used(SSD), self.capacity[SSD], len(self.nodes),
                len(self.plans), len(self.in_flight))


def copy_info(obj: Obj) -> tuple:
    return obj.nbytes, obj.status[DRAM], obj.status[SSD], obj.pins[DRAM], obj.pins[SSD]


def record_hashes(record: PlanRecord | None) -> tuple:
    return () if record is None else record.plan.chunk_hashes


def fraction(key: Hashable) -> float:
    """``u_b`` of the dithered Eq. 1: a fixed fraction in [0, 1) of a chunk's hash (Fibonacci
    hashing of an int, CRC-32 of bytes, a string or any other key's repr)."""
    if isinstance(key, int):
        return ((key * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) / 2.0**64
    data = key if isinstance(key, bytes) else (key if isinstance(key, str) else repr(key)).encode()
    return zlib.crc32(data) / 2.0**32
