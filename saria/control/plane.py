"""The control plane: one object per cache, one lock, time passed in by the caller.

See the package docstring (``saria.control``) for the request lifecycle and API.
"""

from __future__ import annotations

import math
import threading
from collections import abc
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Sequence

from saria.config import SariaConfig
from saria.control.admission import Admission, FutureUses
from saria.control.audit import audit
from saria.control.checks import (check_hashes, check_id, check_key, check_names, check_now, check_ok, check_states,
                                  objects_named, short)
from saria.control.counters import Counters
from saria.control.governor import EnduranceGovernor
from saria.orders import (DRAM, GPU, KV, SSD, STATE, ControlPlaneError, DropOrder, ObjectKey, Order,
                                  PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder)
from saria.control.planner import find_prefix
from saria.control.promotion import promotion_target
from saria.control.residency import WRITE_REASONS, PendingChanges, Residency
from saria.control.tree import ABSENT, DRAINING, READY, STATUS_NAMES, CacheObject, ContextTree, Node

__all__ = ["ChunkInfo", "ControlPlane", "CopyInfo", "Usage"]


@dataclass(frozen=True, slots=True)
class CopyInfo:
    """Where one object is: its DRAM and SSD copy status (``absent``, ``filling``, ``ready``,
    ``draining``, ``bad``) and pin counts."""

    nbytes: int
    dram: str
    ssd: str
    dram_pins: int
    ssd_pins: int


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """A snapshot of one chunk's metadata (``ControlPlane.chunk_info``)."""

    key: Hashable
    depth: int
    parent: Hashable | None
    E_b: int
    R_b: int
    last_reuse: float
    kv: CopyInfo
    state: CopyInfo | None


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes held per tier (every non-absent copy; on SSD also the recovered objects no request has
    reached yet) against capacity, and bookkeeping sizes."""

    dram_used: int
    dram_capacity: int
    ssd_used: int
    ssd_capacity: int
    nodes: int
    live_plans: int
    orders_in_flight: int


@dataclass(slots=True)
class _PlanRecord:
    plan: ReloadPlan
    hashes: tuple             # the request's chunk hashes, as planned
    nodes: list[Node | None]  # their nodes (None: unknown), resolved at tree ``generation``
    generation: int
    state: CacheObject | None  # the checkpoint the plan reads (hybrid), pinned like its kv objects

    def reads(self) -> list[tuple[CacheObject, Tier]]:
        """Every (object, source tier) the plan reads and pins, in request order."""
        out: list[tuple[CacheObject, Tier]] = list(zip(self.nodes, self.plan.kv_sources))
        if self.state is not None:
            out.append((self.state, self.plan.state_source))
        return out


@dataclass(slots=True)
class _InFlight:
    order: Order
    objects: list[CacheObject]


class ControlPlane:
    """Decides what to keep where, what to reload from where, and what to write or promote.

    Thread-safe: every public method holds one lock. Deterministic: the same calls give the same
    results. ``now`` (seconds, any epoch) never runs backwards: an earlier ``now`` than one already
    seen counts as the latest seen.
    """

    def __init__(self, config: SariaConfig | None = None, *, future: FutureUses | None = None) -> None:
        """``future``: every chunk's next use, for ``admission=oracle`` (a replay's knowledge)."""
        self.config = config = config if config is not None else SariaConfig()
        if not isinstance(config, SariaConfig):
            raise ValueError(f"ControlPlane needs a SariaConfig, got {config!r}")
        policy = config.policy
        self._lock = threading.Lock()
        self._counters = Counters()
        self._tree = ContextTree(config.chunk, policy.metadata_window_s, policy.unified_metadata, self._counters)
        tree = self._tree
        self._admission = Admission(policy, config.ssd_bytes, config=config, clock=lambda: tree.clock, future=future)
        self._sessions = self._admission.sessions
        self._tiers = Residency(config.dram_bytes, config.ssd_bytes, self._admission, self._tree, self._counters)
        self._hybrid = config.chunk.hybrid
        self._tier_prefix = policy.lookup == "tier-prefix"
        self._ratio = config.promotion_ratio
        self._p_tau = policy.p_tau_s
        self._prewrite_depth = policy.prewrite_depth if policy.prewrite else 0
        self._write_through = policy.write_through and config.ssd_bytes > 0
        self._store_new = config.dram_bytes > 0
        self._kv_bytes = config.chunk.kv_bytes
        self._chunk_tokens = config.chunk.chunk_tokens
        self._serial = policy.serial_loading
        self._next_id = 1
        self._now = -math.inf
        self._plans: dict[int, _PlanRecord] = {}
        self._in_flight: dict[int, _InFlight] = {}
        # Recovered objects dropped where no batch was at hand (plan() returns no orders): emitted,
        # first, by the next call that returns orders.
        self._pending_drops = PendingChanges()
        self._governor = None
        if config.write_budget.auto:  # theta_E and theta_R become fractional, moved by the governor
            self._governor = EnduranceGovernor.from_config(config.write_budget, config.write_budget_bytes_per_s,
                                                           policy.theta_E, policy.theta_R)
            self._admission.dither = True
            self._admission.theta_E = self._governor.theta_E
            self._admission.theta_R = self._governor.theta_R

    # ============================================================================== public API
    def plan(self, chunk_hashes: Sequence[Hashable], now: float) -> ReloadPlan:
        """Plan the reload of the longest reusable prefix of a request's chunks and pin every
        object it reads until :meth:`release` or :meth:`commit_prefill`."""
        with self._lock:
            now = check_now(now, self._now)
            hashes = check_hashes(chunk_hashes)
            nodes = self._resolve(hashes)
            # ---- valid: from here on, state changes
            self._adopt_run(hashes, nodes, now)
            prefix = find_prefix(nodes, tier_prefix=self._tier_prefix, hybrid=self._hybrid)
            self._now = self._tree.clock = now
            n = prefix.length
            sources = tuple(prefix.kv_sources)
            self._tiers.pin_all(nodes[:n], sources)
            dram_chunks = sources.count(DRAM)
            dram_bytes = dram_chunks * self._kv_bytes
            ssd_bytes = (n - dram_chunks) * self._kv_bytes
            state = prefix.state
            if state is not None:
                self._tiers.pin(state, prefix.state_source)
                if prefix.state_source is DRAM:
                    dram_bytes += state.nbytes
                else:
                    ssd_bytes += state.nbytes
            plan = ReloadPlan(self._take_id(), hashes[:n], sources, None if state is None else state.node.key,
                              prefix.state_source, n * self._chunk_tokens, dram_bytes, ssd_bytes, self._serial)
            self._plans[plan.plan_id] = _PlanRecord(plan, hashes, nodes, self._tree.generation, state)
            self._counters.plans += 1
            self._finish(None, now)  # plan() returns no orders: drops it decided wait in _pending_drops
            return plan

    def release(self, plan: ReloadPlan | int, now: float, failed: Iterable[Hashable | ObjectKey] = ()) -> list[Order]:
        """Give up a plan without committing a request (aborted, or planned again). ``failed``
        names SSD reads of the plan that failed (a chunk hash: its SSD-read objects; an
        :class:`ObjectKey`: that object): their SSD copies are marked bad and dropped.
        Returns drop orders for slots freed."""
        with self._lock:
            now = check_now(now, self._now)
            record = self._live_plan(plan)
            bad, _ = self._read_failures(record, check_names(failed))
            self._now = self._tree.clock = now
            batch = PendingChanges()
            self._finish_reads(record, bad, batch, used=False)
            return self._finish(batch, now)

    def commit_prefill(self, chunk_hashes: Sequence[Hashable], now: float, plan: ReloadPlan | int | None = None,
                       failed: Iterable[Hashable | ObjectKey] = (), states: Iterable[int] | None = None
                       ) -> list[Order]:
        """After prefill: account the request, store its new KV in DRAM, write what admission and
        the policy call for, promote SSD hits, prewrite; release ``plan`` (which must be a live
        plan whose chunks begin ``chunk_hashes``). ``failed`` as in :meth:`release`; chunks from
        the first failed read on (for hybrid models, the whole plan) count as recomputed.
        ``states`` (hybrid models): the indices of the chunks whose state objects prefill left
        readable, when only some checkpoints survive (vLLM keeps a GDN state only where a scheduler
        step ended); None: every checkpoint the prefill computed.
        Returns the orders to execute, in a safe order."""
        with self._lock:
            now = check_now(now, self._now)
            hashes = check_hashes(chunk_hashes)
            states = check_states(states, len(hashes))
            failed = check_names(failed)
            record = None if plan is None else self._live_plan(plan)
            if record is None and failed:
                raise ControlPlaneError(f"failed names reads {short(failed)}, but no plan is committed")
            planned = 0 if record is None else len(record.plan.chunk_hashes)
            if planned and hashes[:planned] != record.plan.chunk_hashes:
                raise ControlPlaneError(f"plan {record.plan.plan_id} covers chunks {short(record.plan.chunk_hashes)} "
                                        f"which do not begin the committed chunk hashes {short(hashes)}")
            bad, first_bad = (set(), planned) if record is None else self._read_failures(record, failed)
            if record is not None and record.generation == self._tree.generation and record.hashes == hashes:
                nodes = record.nodes.copy()  # resolved by plan() and the tree has not changed since
            else:
                prev = record.nodes[planned - 1] if planned else None
                nodes = (record.nodes[:planned] if planned else []) + self._resolve(hashes, planned, prev)
            # ---- valid: from here on, state changes
            self._now = self._tree.clock = now
            batch = PendingChanges()
            usable = planned if first_bad >= planned else (0 if self._hybrid else first_bad)
            # Touch first: a node the request uses is then awake, so no drop below reclaims it.
            self._account(hashes, nodes, record, usable, now)
            if record is not None:
                self._finish_reads(record, bad, batch, used=True)
            self._store_and_write(nodes, record, usable, batch, states)
            if usable and self._ratio > 0.0 and self._store_new:
                self._promote(record, usable, now, batch)
            if self._prewrite_depth:
                self._prewrite(batch)
            return self._finish(batch, now)

    def complete(self, order_id: int, ok: bool, now: float, failed: Iterable[Hashable | ObjectKey] = ()) -> list[Order]:
        """The data plane finished order ``order_id``: ``ok`` for all its objects except those named
        in ``failed`` (chunk hashes or :class:`ObjectKey`), or ``ok=False`` for all of them.
        A stored or promoted copy becomes readable; a written copy becomes persisted (a failed
        write leaves the chunk non-persisted), and a DRAM slot held for the write is reclaimed.
        Returns drop orders for slots freed."""
        with self._lock:
            now = check_now(now, self._now)
            check_ok(ok)
            record = self._in_flight.get(check_id(order_id, "order"))
            if record is None:
                raise ControlPlaneError(self._why_not_in_flight(order_id))
            failed = check_names(failed)  # named objects are checked even when the whole order failed
            named = objects_named(record.objects, failed, f"of order {order_id}") if failed else set()
            failing = named if ok else set(record.objects)
            self._now = self._tree.clock = now
            del self._in_flight[order_id]
            batch = PendingChanges()
            order = record.order
            if isinstance(order, WriteOrder):
                self._tiers.ssd_written(record.objects, failing, batch)
            else:
                if isinstance(order, StoreOrder):
                    self._counters.stores_failed += len(failing)
                elif order.source is SSD:  # a prewarm: its SSD copies were pinned while it read them
                    self._counters.prewarm_failed += len(failing)
                    self._counters.prewarm_bytes_read += sum([obj.nbytes for obj in record.objects
                                                              if obj not in failing])
                    for obj in record.objects:
                        self._tiers.unpin(obj, SSD, batch)
                else:
                    self._counters.promotions_failed += len(failing)
                self._tiers.dram_filled(record.objects, failing, batch)
            return self._finish(batch, now)

    def prewarm(self, chunk_hashes: Sequence[Hashable], now: float, max_bytes: int | None = None) -> list[Order]:
        """Reload a context's SSD-only prefix into free DRAM ahead of its next request (a session's
        predicted next turn): the chunks of the reusable prefix a :meth:`plan` of ``chunk_hashes``
        would read from SSD now (same lookup; a hybrid model's prefix cut back to its deepest
        checkpoint, whose state object comes along when it too is SSD-only), from the first such
        chunk, as many as fit in free DRAM and in ``max_bytes`` (``None``:
        ``config.prewarm_max_bytes``), stopping at the first that does not. Never evicts, never
        counts a reference or a reuse. Chunks already in DRAM, filling, or unknown are skipped or
        end the prefix exactly as a plan would. Returns at most one :class:`PromoteOrder` with
        ``source=Tier.SSD``: its DRAM slots are reserved (``filling``, not readable) and its SSD
        copies pinned until :meth:`complete`; the copies become readable when it completes ok.
        A DRAM copy a prewarm brought counts as a prewarm hit when a committed plan first reads it,
        as wasted if it is evicted first (``Counters.prewarm_*``)."""
        with self._lock:
            now = check_now(now, self._now)
            hashes = check_hashes(chunk_hashes)
            if max_bytes is None:
                cap = self.config.prewarm_max_bytes
            elif isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
                raise ControlPlaneError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
            else:
                cap = max_bytes
            nodes = self._resolve(hashes)
            # ---- valid: from here on, state changes
            self._now = self._tree.clock = now
            batch = PendingChanges()
            room = min(cap, self._tiers.dram.free)
            if room > 0 and self._store_new:
                groups = self._prewarm_groups(nodes, room)
                if groups:
                    self._tiers.prewarm(groups, batch)
            return self._finish(batch, now)

    def recover_ssd(self, keys: Iterable[ObjectKey], now: float) -> list[Order]:
        """Take over SSD objects a previous run left on the drives (the data plane found them whole
        and verified, written for this same model and layout). A recovered object holds its SSD
        bytes at once but has no place in the context tree until a request's chunks reach it:
        then :meth:`plan` reloads it like any SSD copy (the run of recovered chunks right after the
        known prefix joins the tree; a recovered chunk that a request recomputes keeps its SSD
        copy). When SSD room is needed, recovered objects no request reached go first, oldest
        first. Objects that do not fit, that the tree already knows without an SSD copy (this run
        computed them before the list came: the drives' copy is stale to it) and state objects of a
        model without any are dropped; a repeat (in the list, or of an object already recovered or
        being dropped) counts once; an object this run wrote or is writing is left to that write.
        Returns the drop orders, to run before any order returned earlier that could write the
        same keys."""
        with self._lock:
            now = check_now(now, self._now)
            if isinstance(keys, (str, bytes, ObjectKey)) or not isinstance(keys, abc.Iterable):
                raise ControlPlaneError(f"keys must be a list of ObjectKeys, got {type(keys).__name__}")
            keys = list(keys)
            for key in keys:
                if not isinstance(key, ObjectKey):
                    raise ControlPlaneError(f"recover_ssd takes ObjectKeys, got {type(key).__name__} {short([key])}")
                check_key(key.chunk)
                if key.kind not in (KV, STATE):  # ObjectKey checks its kind, unless it was got around
                    raise ControlPlaneError(f"ObjectKey.kind must be 'kv' or 'state', got {key.kind!r}")
            keys = list(dict.fromkeys(keys))  # a repeat is the same object: one decision, one drop at most
            self._now = self._tree.clock = now
            batch = PendingChanges()
            tiers, counters = self._tiers, self._counters
            sizes = {KV: self._kv_bytes, STATE: self.config.chunk.state_bytes}
            waiting = set(self._pending_drops.recovered_drops)  # dropped by plan(): go out first below
            for key in keys:
                if key in tiers.recovered or key in waiting:
                    continue
                node = self._tree.nodes.get(key.chunk)
                obj = None if node is None else (node if key.kind == KV else node.state)
                if node is not None and obj is not None and obj.ssd != ABSENT:
                    continue  # this run's write of it supersedes the drives' copy
                if node is not None or not sizes[key.kind] or tiers.ssd.free < sizes[key.kind]:
                    batch.recovered_drops.append(key)
                    counters.recovered_dropped += 1
                    continue
                tiers.recovered[key] = sizes[key.kind]
                tiers.ssd.used += sizes[key.kind]
                counters.recovered += 1
            return self._finish(batch, now)

    @property
    def governor(self) -> EnduranceGovernor | None:
        """The endurance governor moving theta_E (``config.write_budget.auto``), or None. Read its
        ``theta_E``, ``rate`` and ``history``; the control plane alone updates it."""
        return self._governor

    def counters(self) -> Counters:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._counters)

    def usage(self) -> Usage:
        with self._lock:
            dram, ssd = self._tiers.dram, self._tiers.ssd
            return Usage(dram.used, dram.capacity, ssd.used, ssd.capacity, len(self._tree),
                         len(self._plans), len(self._in_flight))

    def chunk_info(self, chunk_hash: Hashable) -> ChunkInfo | None:
        """A snapshot of one chunk's metadata, or None if the tree does not know it."""
        with self._lock:
            node = self._tree.nodes.get(check_key(chunk_hash))
            if node is None:
                return None
            return ChunkInfo(node.key, node.depth, None if node.parent is None else node.parent.key,
                             node.E_b, node.R_b, node.last_reuse, copy_info(node.kv),
                             None if node.state is None else copy_info(node.state))

    def audit(self) -> list[str]:
        """Check every internal invariant (O(nodes)); returns the violations, empty when sound.
        For tests and debugging."""
        with self._lock:
            return audit(self._tree, self._tiers, self._plans.values(), self._in_flight.values(), self._counters)

    # ============================================================================ request steps
    def _finish_reads(self, record: _PlanRecord, bad: set[CacheObject], batch: PendingChanges, used: bool) -> None:
        """Mark failed SSD reads bad, count completed reads (of a ``used`` plan), unpin everything
        the plan pinned."""
        del self._plans[record.plan.plan_id]
        plan, tiers, counters = record.plan, self._tiers, self._counters
        objs = record.nodes[:len(plan.chunk_hashes)]
        sources = list(plan.kv_sources)
        if record.state is not None:
            objs.append(record.state)
            sources.append(plan.state_source)
        for obj in bad:
            tiers.mark_bad(obj)
        if used and plan.ssd_bytes:
            counters.ssd_reads += sources.count(SSD) - len(bad)
            counters.ssd_bytes_read += plan.ssd_bytes - sum(obj.nbytes for obj in bad)
            for obj, source in zip(objs, sources):
                if source is SSD and obj.ssd_unread and obj not in bad:
                    obj.ssd_unread = False
                    counters.ssd_useful_write_bytes += obj.nbytes
        tiers.unpin_all(objs, sources, batch)

    def _account(self, hashes: tuple, nodes: list[Node | None], record: _PlanRecord | None, usable: int,
                 now: float) -> None:
        """Create or touch every chunk's node (the request reuses or recomputes it: R_b of a known
        chunk goes up, its window restarts, its copies become most recently used) and count hits
        and misses. Fills ``nodes`` in."""
        try:
            known = nodes.index(None)  # the tree resolves unknown chunks as a suffix
        except ValueError:
            known = len(nodes)
        if known:
            self._tree.reuse(nodes[:known], now)
            self._tiers.touch(nodes[:known])
        if known < len(nodes):
            nodes[known:] = self._tree.extend(hashes[known:], nodes[known - 1] if known else None, now)
            if self._tiers.recovered:
                self._adopt(nodes[known:])
        if self._sessions is not None:
            self._sessions.commit(nodes, known, now)
        counters = self._counters
        counters.requests += 1
        counters.references += len(nodes)
        if not usable:
            counters.misses += len(nodes)
            return
        plan = record.plan
        kv_bytes = self.config.chunk.kv_bytes
        dram_hits = plan.kv_sources[:usable].count(DRAM)
        ssd_hits = usable - dram_hits
        counters.hits_dram_chunks += dram_hits
        counters.hits_ssd_chunks += ssd_hits
        counters.misses += len(nodes) - usable
        counters.hits_dram_bytes += dram_hits * kv_bytes
        counters.hits_ssd_bytes += ssd_hits * kv_bytes
        prewarmed = self._tiers.prewarmed
        if prewarmed and dram_hits:
            for node, source in zip(nodes[:usable], plan.kv_sources):
                if source is DRAM and node in prewarmed:  # first read since a prewarm brought it
                    prewarmed.discard(node)
                    counters.prewarm_hits += 1
        if plan.state_source is not None:  # hybrid: usable is the whole plan, its checkpoint was used
            state = record.state
            if plan.state_source is DRAM:
                counters.hits_dram_bytes += state.nbytes
            else:
                counters.hits_ssd_bytes += state.nbytes
            if state.evidence is not state.node:  # per-object metadata: the checkpoint itself was reused
                state.evidence.R_b += 1
                state.evidence.last_reuse = now

    def _store_and_write(self, nodes: list[Node], record: _PlanRecord | None, usable: int,
                         batch: PendingChanges, states: frozenset[int] | None = None) -> None:
        """New KV (every object prefill computed) enters DRAM; write-through and reuse-path writes.

        In HBM after prefill: every kv object of the request, the state objects of computed chunks
        (those in ``states`` when given), and the plan's state object if the plan was used. A write
        reads HBM (``Tier.GPU``) unless the object has a readable DRAM copy."""
        tiers = self._tiers
        if self._hybrid:
            computed = [obj for i, node in enumerate(nodes[usable:], usable) for obj in node.objects
                        if obj is node.kv or states is None or i in states]
        else:
            computed = nodes[usable:]  # a node is its kv object, and has no other
        if self._store_new:
            absent = [obj for obj in computed if obj.dram == ABSENT]
            stored = tiers.reserve_dram(absent, batch)
            batch.stores += stored
            counters = self._counters
            counters.stores += len(stored)
            counters.store_bytes += sum([obj.nbytes for obj in stored]) if self._hybrid else len(stored) * self._kv_bytes
            counters.stores_skipped += len(absent) - len(stored)
        if self._write_through:
            for obj in computed:
                if obj.ssd == ABSENT:
                    tiers.write(obj, GPU, "write-through", batch)
        admission = self._admission
        theta_R = admission.theta_R if admission.enabled else math.inf
        if admission.dither:  # R_b + u_b >= theta_R, u_b < 1: R_b > theta_R - 1 (by_reuse decides below)
            theta_R -= 1
        popular = [i for i, node in enumerate(nodes) if node.R_b >= theta_R]
        if not popular:
            return
        loaded_state = record.state if usable and record.plan.state_source is not None else None
        for i in popular:  # the reuse path: R_b reached theta_R, write what is not persisted
            node = nodes[i]
            for obj in node.objects:
                if obj.ssd != ABSENT or not admission.by_reuse(obj.evidence):
                    continue
                if obj.dram == READY or obj.dram == DRAINING:
                    tiers.write(obj, DRAM, "reuse", batch)
                elif obj is node.kv or obj is loaded_state or (
                        i >= usable and (states is None or i in states)):
                    tiers.write(obj, GPU, "reuse", batch)

    def _promote(self, record: _PlanRecord, usable: int, now: float, batch: PendingChanges) -> None:
        """Lazy partial promotion (paper §4.4): copy the first P SSD-hit chunks of the used prefix
        from HBM into DRAM, P = min(P_target, what free DRAM plus idle LRU candidates can take)."""
        sources = record.plan.kv_sources
        dram_hits = sources[:usable].count(DRAM)
        target = promotion_target(self._ratio, dram_hits, usable - dram_hits)
        if target == 0:
            return
        loaded_state = record.state if record.plan.state_source is SSD else None
        chosen: list[list[CacheObject]] = []
        need = 0
        for node, source in zip(record.nodes[:usable], sources):
            if len(chosen) == target:
                break
            if source is not SSD or node.dram != ABSENT:  # a node is its kv object
                continue
            if loaded_state is not None and node.state is loaded_state and loaded_state.dram == ABSENT:
                chosen.append([node, loaded_state])
                need += node.nbytes + loaded_state.nbytes
            else:
                chosen.append([node])
                need += node.nbytes
        if chosen:
            self._tiers.promote(chosen, need, now - self._p_tau, batch)

    def _prewarm_groups(self, nodes: list[Node | None], room: int) -> list[list[CacheObject]]:
        """The chunks (each its objects to prewarm) of the reusable prefix of ``nodes`` that a plan
        would read from SSD, from the first, while they fit in ``room`` bytes."""
        prefix = find_prefix(nodes, tier_prefix=self._tier_prefix, hybrid=self._hybrid)
        groups: list[list[CacheObject]] = []
        need = 0
        state = prefix.state if prefix.state_source is SSD and prefix.state.dram == ABSENT else None
        last = prefix.length - 1
        for i, (node, source) in enumerate(zip(nodes[:prefix.length], prefix.kv_sources)):
            if source is not SSD or node.dram != ABSENT:  # a node is its kv object
                continue
            group = [node, state] if state is not None and i == last else [node]
            size = sum([obj.nbytes for obj in group])
            if need + size > room:
                return groups
            groups.append(group)
            need += size
        if state is not None and (not groups or groups[-1][-1] is not state) and need + state.nbytes <= room:
            groups.append([state])  # the checkpoint alone: its chunk's kv object is in DRAM already
        return groups

    def _prewrite(self, batch: PendingChanges) -> None:
        """Write LRU-end DRAM copies that would be admitted at their next eviction (E_b + 1)."""
        tiers = self._tiers
        for obj in self._admission.at_next_eviction(tiers.unpersisted_lru_end(self._prewrite_depth)):
            if obj.ssd == ABSENT:  # a write issued in this loop may have evicted nothing, but be sure
                tiers.write(obj, DRAM, "prewrite", batch)

    # =============================================================================== bookkeeping
    def _finish(self, batch: PendingChanges | None, now: float) -> list[Order]:
        """End of a mutating call: expire metadata, let the governor (if any) set theta_E and theta_R for the
        next calls, build the orders (none for ``batch`` None: a call that returns no orders),
        free reclaimed nodes."""
        self._tree.expire(now)
        if self._governor is not None:
            self._admission.theta_E = self._governor.update(now, self._counters.ssd_bytes_written)
            self._admission.theta_R = self._governor.theta_R
        orders = self._emit(batch) if batch is not None else []
        self._tree.bury()
        return orders

    def _emit(self, batch: PendingChanges) -> list[Order]:
        """Turn a batch into orders, registering those that need a completion. Drops come first
        (later orders may reuse their slots); then writes for evictions (their DRAM slots are held
        until they end), stores, the other writes by reason, promotions."""
        orders: list[Order] = []
        pending, self._pending_drops = self._pending_drops, PendingChanges()
        recovered = pending.recovered_drops + batch.recovered_drops
        if recovered:
            kv = tuple([key.chunk for key in recovered if key.kind == KV])
            state = tuple([key.chunk for key in recovered if key.kind != KV])
            sizes = self._kv_bytes * len(kv) + self.config.chunk.state_bytes * len(state)
            orders.append(DropOrder(self._take_id(), kv, state, sizes, tier=SSD))
        if batch.dram_drops:
            orders.append(self._order(DropOrder, batch.dram_drops, tier=DRAM))
        if batch.ssd_drops:
            orders.append(self._order(DropOrder, batch.ssd_drops, tier=SSD))
        writes = sorted(batch.writes.items(), key=_write_rank) if batch.writes else ()
        for (reason, source), objs in writes:
            if reason == "eviction":
                orders.append(self._order(WriteOrder, objs, source=source, reason=reason))
        if batch.stores:
            orders.append(self._order(StoreOrder, batch.stores))
        for (reason, source), objs in writes:
            if reason != "eviction":
                orders.append(self._order(WriteOrder, objs, source=source, reason=reason))
        if batch.promotions:
            orders.append(self._order(PromoteOrder, batch.promotions))
        if batch.prewarms:
            orders.append(self._order(PromoteOrder, batch.prewarms, source=SSD))
        return orders

    def _order(self, kind: type[Order], objs: list[CacheObject], **extra: object) -> Order:
        if self._hybrid:
            kv = tuple([obj.node.key for obj in objs if obj.kind is KV])
            state = tuple([obj.node.key for obj in objs if obj.kind is not KV])
            nbytes = sum([obj.nbytes for obj in objs])
        else:  # every object is a kv object, that is a node, and all have the same size
            kv = tuple([node.key for node in objs])
            state = ()
            nbytes = len(objs) * self._kv_bytes
        order = kind(self._take_id(), kv, state, nbytes, **extra)
        if kind is not DropOrder:
            self._in_flight[order.order_id] = _InFlight(order, objs)
        return order

    def _take_id(self) -> int:
        order_id = self._next_id
        self._next_id += 1
        return order_id

    def _adopt_run(self, hashes: tuple, nodes: list[Node | None], now: float) -> None:
        """Give the run of recovered chunks right after the known prefix its nodes (``nodes``
        filled in), so that a plan can reload them."""
        recovered = self._tiers.recovered
        if not recovered or nodes[-1:] != [None]:
            return
        first = end = nodes.index(None)
        while end < len(hashes) and ObjectKey(hashes[end], KV) in recovered:
            end += 1
        if end > first:
            nodes[first:end] = made = self._tree.extend(hashes[first:end], nodes[first - 1] if first else None, now)
            self._adopt(made)

    def _adopt(self, made: list[Node]) -> None:
        """New nodes take over their recovered SSD objects; a recovered state object of a chunk that
        keeps none is dropped."""
        tiers = self._tiers
        for node in made:
            tiers.adopt_recovered(node)
            if node.state is not None:
                tiers.adopt_recovered(node.state)
            elif ObjectKey(node.key, STATE) in tiers.recovered:
                tiers.drop_recovered(ObjectKey(node.key, STATE), self._pending_drops)

    # ======================================================================== ids and lookups
    def _resolve(self, hashes: tuple, start: int = 0, prev: Node | None = None) -> list[Node | None]:
        try:
            return self._tree.resolve(hashes, start, prev)
        except TypeError as exc:
            raise ControlPlaneError(f"chunk hashes must be hashable: {exc}") from None

    def _live_plan(self, plan: ReloadPlan | int) -> _PlanRecord:
        plan_id = plan.plan_id if isinstance(plan, ReloadPlan) else check_id(plan, "plan")
        record = self._plans.get(plan_id)
        if record is None:
            if plan_id in self._in_flight:
                raise ControlPlaneError(f"id {plan_id} is an order, not a reload plan")
            if 0 < plan_id < self._next_id:
                raise ControlPlaneError(f"plan {plan_id} was already released or committed (or is not a plan)")
            raise ControlPlaneError(f"unknown plan id {plan_id!r}: never issued")
        if isinstance(plan, ReloadPlan) and plan is not record.plan and plan != record.plan:
            raise ControlPlaneError(f"plan {plan_id} does not match the plan this control plane issued")
        return record

    def _why_not_in_flight(self, order_id: int) -> str:
        if order_id in self._plans:
            return f"id {order_id} is a reload plan: release it or commit it, plans are not completed"
        if 0 < order_id < self._next_id:
            return (f"order {order_id} is not awaiting completion: already completed, a drop order "
                    f"(needs none), or a released plan")
        return f"unknown order id {order_id!r}: never issued"

    def _read_failures(self, record: _PlanRecord, failed: tuple) -> tuple[set, int]:
        """The plan's SSD-read objects named in ``failed`` (checked by ``check_names``), and the index
        of the first failed chunk (the plan's length if none)."""
        if not failed:
            return set(), record.plan.num_chunks
        ssd_reads = [obj for obj, source in record.reads() if source is SSD]
        bad = objects_named(ssd_reads, failed, f"plan {record.plan.plan_id} reads from SSD")
        index = {node: i for i, node in enumerate(record.nodes[:record.plan.num_chunks])}
        return bad, min(index[obj.node] for obj in bad)


def _write_rank(item: tuple[tuple[str, Tier], list]) -> tuple[int, int]:
    reason, source = item[0]
    return WRITE_REASONS.index(reason), source is GPU


def copy_info(obj: CacheObject) -> CopyInfo:
    return CopyInfo(obj.nbytes, STATUS_NAMES[obj.dram], STATUS_NAMES[obj.ssd], obj.dram_pins, obj.ssd_pins)
