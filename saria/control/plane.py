"""The control plane: one object per cache, one lock, time passed in by the caller.

See the package docstring (``saria.control``) for the request lifecycle and API. The plane checks
each call's arguments, then runs it through collaborators with one job each: the tree, admission
and tiers (``Residency``) keep the state; ``planner`` picks a plan's prefix and sources; ``plans``
keeps the live plans; ``placement`` stores, writes and promotes after prefill; ``prewarm`` picks
what a prewarm reads; ``recovery`` takes over a previous run's SSD objects; ``counters`` counts a
request's hits; ``emission`` turns each call's decisions (a ``PendingChanges``) into orders.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import Hashable, Iterable, Sequence

from saria.config import SariaConfig
from saria.control.accounting import count_request
from saria.control.admission import Admission, FutureUses
from saria.control.audit import audit
from saria.control.checks import (brief_index, check_hashes, check_hint_args, check_id, check_key, check_max_bytes,
                                  check_names, check_now, check_ok, check_recovered, check_states, first_difference,
                                  objects_named)
from saria.control.counters import Counters
from saria.control.emission import OrderEmitter
from saria.control.governor import EnduranceGovernor
from saria.control.hints import HintBook, HintCounters, Hints
from saria.control.placement import Placement
from saria.control.planner import find_and_pin, find_prefix, reload_plan
from saria.control.plans import LivePlans, PlanRecord, finish_reads
from saria.control.prewarm import prewarm_groups
from saria.control.recovery import SsdRecovery
from saria.control.residency import PendingChanges, Residency
from saria.control.snapshots import ChunkInfo, CopyInfo, Usage, chunk_info
from saria.control.tree import ContextTree, Node
from saria.orders import SSD, ControlPlaneError, ObjectKey, Order, ReloadPlan, StoreOrder, WriteOrder
from saria.sizing import TierSizing

_NONE_BAD: frozenset = frozenset()  # no failed read (never changed)

__all__ = ["ChunkInfo", "ControlPlane", "CopyInfo", "Usage"]


class ControlPlane:
    """Decides what to keep where, what to reload from where, and what to write or promote.

    Thread-safe: every public method holds one lock. Deterministic: the same calls give the same
    results. ``now`` (seconds, any epoch) never runs backwards: an earlier ``now`` than one already
    seen counts as the latest seen.
    """

    def __init__(self, config: SariaConfig | None = None, *, future: FutureUses | None = None,
                 sizing: TierSizing | None = None, observer=None, pin_bytes_per_tenant: int | None = None,
                 retain_bytes_per_tenant: int | None = None) -> None:
        """``future``: every chunk's next use, for ``admission=oracle`` (a replay's knowledge).
        ``observer(node, features, now, ssd_retention)``: called at every DRAM eviction of a kv
        object with its learned-rule features and the SSD's retention age (:mod:`saria.control.learned`; a replay's labeler).
        ``sizing``: the layout of the data plane this control plane drives
        (:func:`saria.sizing.size_tiers` of the same config): each object is then charged its whole
        host slots and SSD parts against what the host pool and the drive files really hold, so
        whatever it admits fits them. None (a replay): objects charge their sizes against the
        configured capacities. ``pin_bytes_per_tenant``: the most bytes (SSD charges) one tenant's
        ``pin`` hints may hold (None: a tenth of the SSD tier; :mod:`saria.control.hints`);
        ``retain_bytes_per_tenant``: likewise, its chunks inside a ``retain_s`` retention."""
        self.config = config = config if config is not None else SariaConfig()
        if not isinstance(config, SariaConfig):
            raise ValueError(f"ControlPlane needs a SariaConfig, got {config!r}")
        if sizing is None:
            sizing = TierSizing.in_bytes(config.dram_bytes, config.ssd_bytes)
        elif not isinstance(sizing, TierSizing):
            raise ValueError(f"ControlPlane's sizing must be a TierSizing, got {sizing!r}")
        self.sizing = sizing
        policy, chunk = config.policy, config.chunk
        self._lock = threading.Lock()
        self._counters = Counters()
        self._ssd_kv_bytes = config.ssd_kv_bytes  # a kv object on SSD (ssd_dtype); DRAM copies are chunk.kv_bytes
        self._tree = ContextTree(chunk, policy.metadata_window_s, policy.unified_metadata, self._counters,
                                 self._ssd_kv_bytes, sizing)
        tree = self._tree
        self._admission = Admission(policy, config.ssd_bytes, config=config, clock=lambda: tree.clock, future=future,
                                    counters=self._counters, observer=observer)
        self._sessions = self._admission.sessions
        self._tracker = self._admission.tracker
        for name, cap in (("pin_bytes_per_tenant", pin_bytes_per_tenant),
                          ("retain_bytes_per_tenant", retain_bytes_per_tenant)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {cap!r}")
        self._hints = HintBook(sizing.ssd.capacity if config.ssd_bytes > 0 else 0, pin_bytes_per_tenant,
                               policy.prewarm_lead_s, retain_bytes_per_tenant)
        self._tiers = Residency(sizing.dram.capacity, sizing.ssd.capacity, self._admission, self._tree,
                                self._counters, self._hints)
        self._orders = OrderEmitter(hybrid=chunk.hybrid, kv_bytes=chunk.kv_bytes, state_bytes=chunk.state_bytes)
        self._recovery = SsdRecovery(self._tiers, self._tree, self._counters, kv_bytes=tree.kv_charges[1],
                                     state_bytes=tree.state_charges[1] if chunk.hybrid else 0)
        self._placement = Placement(config, self._tiers, self._admission, self._counters)
        self._hybrid = chunk.hybrid
        self._tier_prefix = policy.lookup == "tier-prefix"
        self._store_new = config.dram_bytes > 0
        self._kv_bytes = chunk.kv_bytes
        self._chunk_tokens = chunk.chunk_tokens
        self._serial = policy.serial_loading
        self._now = -math.inf
        self._plans = LivePlans(self._orders)
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
            now = check_now(now, self._now)  # (a float and a tuple: each returns at its first test)
            hashes = check_hashes(chunk_hashes)
            nodes = self._resolve(hashes)
            # ---- valid: from here on, state changes
            tiers = self._tiers
            if tiers.recovered:  # (adopt_run's own first test: nothing recovered awaits a node)
                self._recovery.adopt_run(hashes, nodes, now, self._orders.waiting)
            tree = self._tree
            self._now = tree.clock = now
            if self._hybrid:
                prefix = find_prefix(nodes, tier_prefix=self._tier_prefix, hybrid=True)
                n = prefix.length
                sources = tuple(prefix.kv_sources)
                tiers.pin_all(nodes[:n], sources)
                state, state_source = prefix.state, prefix.state_source
                if state is not None:
                    tiers.pin(state, state_source)
            else:  # find_prefix and pin_all in one walk (a dense model's prefix is not cut back)
                sources = find_and_pin(nodes, tiers.dram.lru, tiers.ssd.lru, tier_prefix=self._tier_prefix)
                n = len(sources)
                state = state_source = None
            plan = reload_plan(self._orders.take_id(), hashes[:n], sources, state, state_source,
                               kv_bytes=self._kv_bytes, chunk_tokens=self._chunk_tokens, serial=self._serial,
                               ssd_kv_bytes=self._ssd_kv_bytes)
            self._plans.add(PlanRecord(plan, hashes, nodes, tree.generation, state))
            self._counters.plans += 1
            self._finish(None, now)  # plan() returns no orders: drops it decided wait in the emitter
            return plan

    def plan_from(self, plan: ReloadPlan | int, first: int) -> ReloadPlan:
        """The part of live plan ``plan`` from chunk ``first`` on, for a caller that holds the
        chunks before it already (an engine that computed them): the same ``plan_id``, the chunks
        ``first:`` with their sources and the plan's checkpoint, and the totals (``tokens``,
        ``dram_bytes``, ``ssd_bytes``) of what it names. Not a plan of its own: release or commit
        ``plan``. ``first`` 0 gives the plan itself. Changes nothing."""
        with self._lock:
            record = self._plans.live(plan)
            whole = record.plan
            if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < max(1, whole.num_chunks):
                raise ControlPlaneError(f"first must be a chunk index of plan {whole.plan_id} "
                                        f"(0 to {max(0, whole.num_chunks - 1)}), got {brief_index(first)}")
            if first == 0:
                return whole
            return reload_plan(whole.plan_id, whole.chunk_hashes[first:], whole.kv_sources[first:], record.state,
                               whole.state_source, kv_bytes=self._kv_bytes, chunk_tokens=self._chunk_tokens,
                               serial=whole.serial, ssd_kv_bytes=self._ssd_kv_bytes)

    def release(self, plan: ReloadPlan | int, now: float, failed: Iterable[Hashable | ObjectKey] = ()) -> list[Order]:
        """Give up a plan without committing a request (aborted, or planned again). ``failed``
        names SSD reads of the plan that failed (a chunk hash: its SSD-read objects; an
        :class:`ObjectKey`: that object): their SSD copies are marked bad and dropped.
        Returns drop orders for slots freed."""
        with self._lock:
            now = check_now(now, self._now)
            record = self._plans.live(plan)
            bad, _ = record.read_failures(check_names(failed))
            self._now = self._tree.clock = now
            changes = PendingChanges()
            self._plans.remove(record)
            finish_reads(record, bad, False, self._tiers, self._counters, changes)
            return self._finish(changes, now)

    def commit_prefill(self, chunk_hashes: Sequence[Hashable], now: float, plan: ReloadPlan | int | None = None,
                       failed: Iterable[Hashable | ObjectKey] = (), states: Iterable[int] | None = None,
                       hints: Hints | None = None, tenant: Hashable = None) -> list[Order]:
        """After prefill: account the request, store its new KV in DRAM, write what admission and
        the policy call for, promote SSD hits, prewrite; release ``plan`` (which must be a live
        plan whose chunks begin ``chunk_hashes``). ``failed`` as in :meth:`release`; chunks from
        the first failed read on (for hybrid models, the whole plan) count as recomputed.
        ``states`` (hybrid models): the indices of the chunks whose state objects prefill left
        readable, when only some checkpoints survive (vLLM keeps a GDN state only where a scheduler
        step ended); None: every checkpoint the prefill computed.
        Returns the orders to execute, in a safe order."""
        with self._lock:
            now = check_now(now, self._now)  # (a float and a tuple: each returns at its first test)
            hashes = check_hashes(chunk_hashes)
            if states is not None:
                states = check_states(states, len(hashes))
            if hints is not None or tenant is not None:  # (None and None pass the check)
                check_hint_args(hints, tenant)
            if type(failed) is not tuple or failed:  # (check_names' common case: none failed)
                failed = check_names(failed)
            if plan is None:
                record = None
            else:  # the live plan handed out (LivePlans.live's common case), else live() says what is wrong
                record = self._plans.get(plan.plan_id) if type(plan) is ReloadPlan else None
                if record is None or record.plan is not plan:
                    record = self._plans.live(plan)
            if record is None and failed:
                raise ControlPlaneError(f"failed names {len(failed)} read(s), but no plan is committed")
            planned = 0 if record is None else len(record.plan.chunk_hashes)
            if planned and hashes[:planned] != record.plan.chunk_hashes:
                differ = first_difference(record.plan.chunk_hashes, hashes)
                raise ControlPlaneError(f"plan {record.plan.plan_id} covers {planned} chunks which do not begin the "
                                        f"committed chunk hashes ({len(hashes)}; they differ from chunk {differ} on)")
            bad, first_bad = (_NONE_BAD, planned) if not failed else record.read_failures(failed)
            if record is not None and record.generation == self._tree.generation and record.hashes == hashes:
                nodes = record.nodes.copy()  # resolved by plan() and the tree has not changed since
            else:
                prev = record.nodes[planned - 1] if planned else None
                nodes = (record.nodes[:planned] if planned else []) + self._resolve(hashes, planned, prev)
            # ---- valid: from here on, state changes
            self._now = self._tree.clock = now
            changes = PendingChanges()
            usable = planned if first_bad >= planned else (0 if self._hybrid else first_bad)
            # Touch first: a node the request uses is then awake, so no drop below reclaims it.
            hinted = hints is not None or self._hints.active
            if hinted:  # the chunks this request makes begin at the first the tree does not know
                fresh_from = next((i for i, node in enumerate(nodes) if node is None), len(nodes))
            self._account(hashes, nodes, record, usable, now)
            if hinted:
                self._apply_hints(nodes, hints, tenant, now, fresh_from)
            if record is not None:
                self._plans.remove(record)
                finish_reads(record, bad, True, self._tiers, self._counters, changes)
            self._placement.after_prefill(nodes, usable, record.plan if usable else None,
                                          record.state if usable else None, states, now, changes)
            return self._finish(changes, now)

    def complete(self, order_id: int, ok: bool, now: float, failed: Iterable[Hashable | ObjectKey] = ()) -> list[Order]:
        """The data plane finished order ``order_id``: ``ok`` for all its objects except those named
        in ``failed`` (chunk hashes or :class:`ObjectKey`), or ``ok=False`` for all of them.
        A stored or promoted copy becomes readable; a written copy becomes persisted (a failed
        write leaves the chunk non-persisted), and a DRAM slot held for the write is reclaimed.
        Returns drop orders for slots freed."""
        with self._lock:
            now = check_now(now, self._now)
            check_ok(ok)
            record = self._orders.in_flight.get(check_id(order_id, "order"))
            if record is None:
                raise ControlPlaneError(self._why_not_in_flight(order_id))
            failed = check_names(failed)  # named objects are checked even when the whole order failed
            named = objects_named(record.objects, failed, f"of order {order_id}") if failed else set()
            failing = named if ok else set(record.objects)
            self._now = self._tree.clock = now
            del self._orders.in_flight[order_id]
            changes = PendingChanges()
            order = record.order
            if isinstance(order, WriteOrder):
                self._tiers.ssd_written(record.objects, failing, changes)
            else:
                if isinstance(order, StoreOrder):
                    self._counters.stores_failed += len(failing)
                elif order.source is SSD:  # a prewarm: its SSD copies were pinned while it read them
                    self._counters.prewarm_failed += len(failing)
                    self._counters.prewarm_bytes_read += sum([obj.ssd_nbytes for obj in record.objects
                                                              if obj not in failing])
                    for obj in record.objects:
                        self._tiers.unpin(obj, SSD, changes)
                else:
                    self._counters.promotions_failed += len(failing)
                self._tiers.dram_filled(record.objects, failing, changes)
            return self._finish(changes, now)

    def prewarm(self, chunk_hashes: Sequence[Hashable], now: float, max_bytes: int | None = None, *,
                make_room: bool = False) -> list[Order]:
        """Reload a context's SSD-only prefix into free DRAM ahead of its next request (a session's
        predicted next turn): the chunks a :meth:`plan` of ``chunk_hashes`` would read from SSD now
        (same lookup and checkpoint rule, ``prewarm.prewarm_groups``), from the first, as many as fit
        in free DRAM and in ``max_bytes`` (``None``: ``config.prewarm_max_bytes``), stopping at the
        first that does not. Never evicts, never counts a reference or a reuse. Returns at most one
        :class:`PromoteOrder` with ``source=Tier.SSD``: its DRAM slots are reserved (``filling``, not
        readable) and its SSD copies pinned until :meth:`complete`; the copies become readable when
        it completes ok. Counted in ``Counters.prewarm_*`` (hits: copies a committed plan first
        reads from DRAM; wasted: copies evicted unread).

        ``make_room`` (a session's own word that its next turn is coming, :meth:`hinted_prewarms`):
        DRAM copies idle for ``Policy.p_tau_s`` may be evicted for it as for a promotion
        (``Residency.idle_candidates``: only copies whose eviction frees their slot at once, never
        one of this prompt's), counted in ``Counters.prewarm_evictions``."""
        with self._lock:
            now = check_now(now, self._now)
            hashes = check_hashes(chunk_hashes)
            cap = check_max_bytes(max_bytes, self.config.prewarm_max_bytes)
            nodes = self._resolve(hashes)
            # ---- valid: from here on, state changes
            self._now = self._tree.clock = now
            changes = PendingChanges()
            tiers = self._tiers
            if cap > 0 and self._store_new:
                if make_room:
                    groups = prewarm_groups(nodes, cap, tier_prefix=self._tier_prefix, hybrid=self._hybrid)
                    need = sum([obj.dram_charge for objs in groups for obj in objs])
                    if need > tiers.dram.free:
                        idle_before = now - self.config.policy.p_tau_s
                        tiers.make_room(groups, need, idle_before, set(nodes), changes)
                else:
                    room = min(cap, tiers.dram.free)
                    groups = prewarm_groups(nodes, room, tier_prefix=self._tier_prefix,
                                            hybrid=self._hybrid) if room > 0 else []
                if groups:
                    tiers.prewarm(groups, changes)
            return self._finish(changes, now)

    def turn_ended(self, chunk_hashes: Sequence[Hashable], now: float, hints: Hints | None,
                   tenant: Hashable = None) -> None:
        """A request ended at ``now`` (its response is complete): with ``session`` and
        ``next_turn_s`` hints, a prewarm of ``chunk_hashes`` (its prompt's chunks) becomes due
        ``Policy.prewarm_lead_s`` before ``now + next_turn_s``; :meth:`hinted_prewarms` issues it
        unless the session's next request commits first. Changes nothing else."""
        with self._lock:
            now = check_now(now, self._now)
            hashes = check_hashes(chunk_hashes)
            check_hint_args(hints, tenant)
            if hints is None or hints.next_turn_s is None:
                return
            self._now = now
            self._hints.active = True
            self._hints.turn_ended(tenant, hints, hashes, now)

    def hinted_prewarms(self, now: float, max_bytes: int | None = None) -> list[Order]:
        """The prewarms due at ``now`` by ``next_turn_s`` hints (:meth:`turn_ended`), each as
        :meth:`prewarm` of the session's latest prompt (at most ``max_bytes``, None:
        ``config.prewarm_max_bytes``) in free DRAM and in the room of copies idle for
        ``Policy.p_tau_s`` (``make_room``: the application said the turn is coming, so a DRAM
        tier that is full, as a serving one is, does not silently refuse it); counted in
        ``hint_counters().prewarms_hinted``."""
        orders: list[Order] = []
        with self._lock:
            now = check_now(now, self._now)
            cap = check_max_bytes(max_bytes, self.config.prewarm_max_bytes)
            if not self._hints.active:
                return orders
            due = self._hints.due(now)
        for hashes in due:  # a session's chunks the tree no longer agrees with: skip that prewarm
            try:
                new = self.prewarm(hashes, now, cap, make_room=True)
            except ControlPlaneError:
                continue
            with self._lock:
                self._hints.counters.prewarms_hinted += len(new)
            orders += new
        return orders

    def hints_active(self) -> bool:
        """Whether any hint is in effect yet (a hinted commit or :meth:`turn_ended` came): until then
        :meth:`hinted_prewarms` has nothing to do, and a caller may skip it. One read of a flag that
        only ever turns on: no lock."""
        return self._hints.active

    def next_hinted_prewarm(self) -> float | None:
        """When the next hinted prewarm is due (None: none is)."""
        with self._lock:
            return self._hints.next_due() if self._hints.active else None

    def hint_counters(self) -> HintCounters:
        """A snapshot of what the hints did (:class:`~saria.control.hints.HintCounters`)."""
        with self._lock:
            return replace(self._hints.counters)

    def pins(self, tenant: Hashable = None) -> dict[Hashable, float]:
        """``tenant``'s pinned chunks: chunk hash -> when the pin ends (``inf``: until unpinned)."""
        with self._lock:
            return {key: pin.until for key, pin in self._hints.pins.get(tenant, {}).items()}

    def pinned_bytes(self, tenant: Hashable = None) -> int:
        """What ``tenant``'s pins hold (SSD charges)."""
        with self._lock:
            return self._hints.pinned_of(tenant)

    def hint_state(self) -> dict:
        """What the applications' hints said that a control plane rebuilt after a fault takes over
        (:meth:`restore_hints`): pins, retentions, sessions (plain data)."""
        with self._lock:
            return self._hints.snapshot()

    def restore_hints(self, state: dict, now: float) -> None:
        """Take over a replaced control plane's :meth:`hint_state` (``saria.control.hints``)."""
        if not isinstance(state, dict):
            raise ControlPlaneError(f"restore_hints takes a hint_state() dict, got {type(state).__name__}")
        with self._lock:
            now = check_now(now, self._now)
            self._hints.restore(state, now)

    def retained_bytes(self, tenant: Hashable = None) -> int:
        """What ``tenant``'s ``retain_s`` hints hold (SSD charges of its chunks inside their retention)."""
        with self._lock:
            return self._hints.retained_of(tenant)

    def recover_ssd(self, keys: Iterable[ObjectKey], now: float) -> list[Order]:
        """Take over SSD objects a previous run left on the drives (the data plane found them whole
        and verified, written for this same model and layout; the rules: ``saria.control.recovery``).
        A recovered object holds its SSD bytes at once and joins the context tree when a request's
        chunks reach it; :meth:`plan` then reloads it like any SSD copy. A repeat (in the list, or
        of an object already recovered or being dropped) counts once. Returns the drop orders, to
        run before any order returned earlier that could write the same keys."""
        with self._lock:
            now = check_now(now, self._now)
            keys = check_recovered(keys)
            self._now = self._tree.clock = now
            changes = PendingChanges()
            self._recovery.take_over(keys, changes, self._orders.waiting)
            return self._finish(changes, now)

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
                         len(self._plans), len(self._orders.in_flight))

    def chunk_info(self, chunk_hash: Hashable) -> ChunkInfo | None:
        """A snapshot of one chunk's metadata, or None if the tree does not know it."""
        with self._lock:
            node = self._tree.nodes.get(check_key(chunk_hash))
            return None if node is None else chunk_info(node)

    def audit(self) -> list[str]:
        """Check every internal invariant (O(nodes)); returns the violations, empty when sound.
        For tests and debugging."""
        with self._lock:
            return audit(self._tree, self._tiers, self._plans.records(), self._orders.in_flight.values(),
                         self._counters)

    # ============================================================================ request steps
    def _account(self, hashes: tuple, nodes: list[Node | None], record: PlanRecord | None, usable: int,
                 now: float) -> None:
        """Create or touch every chunk's node (the request reuses or recomputes it: R_b of a known
        chunk goes up, its window restarts, its copies become most recently used) and count hits
        and misses. Fills ``nodes`` in."""
        try:
            known = nodes.index(None)  # the tree resolves unknown chunks as a suffix
        except ValueError:
            known = len(nodes)
        if known:
            seen = nodes[:known] if known < len(nodes) else nodes  # (read, never kept)
            if self._tracker is not None:
                self._tracker.referenced(seen, now)
            self._tree.reuse(seen, now)
            self._tiers.touch(seen)
        if known < len(nodes):
            made = self._tree.extend(hashes[known:], nodes[known - 1] if known else None, now)
            nodes[known:] = made
            if self._tiers.recovered:  # (adopt's own first test)
                self._recovery.adopt(made, self._orders.waiting)
        if self._sessions is not None:
            self._sessions.commit(nodes, known, now)
        plan = record.plan if usable else None
        count_request(self._counters, nodes, plan, usable, self._kv_bytes, record.state if usable else None,
                      self._tiers.prewarmed)
        if plan is not None and plan.state_source is not None:  # hybrid: usable is the whole plan
            state = record.state
            if state.evidence is not state.node:  # per-object metadata: the checkpoint itself was reused
                state.evidence.R_b += 1
                state.evidence.last_reuse = now

    def _apply_hints(self, nodes: list[Node], hints: Hints | None, tenant: Hashable, now: float,
                     fresh_from: int) -> None:
        """A committed request's hints (module saria.control.hints): ownership of its chunks, then
        its retain, pin and unpin hints, then done."""
        book = self._hints
        book.expire(now)
        book.referenced(nodes, tenant, hints, fresh_from)
        if hints is None:
            return
        book.apply(nodes, tenant, hints, now)
        if hints.done and hints.session is not None:
            book.done(tenant, hints.session, self._tiers.dram.lru, self._tiers.ssd.lru)

    def _finish(self, changes: PendingChanges | None, now: float) -> list[Order]:
        """End of a mutating call: expire metadata, let the governor (if any) set theta_E and theta_R for the
        next calls, emit the orders (none for ``changes`` None: a call that returns no orders),
        free reclaimed nodes."""
        tree = self._tree
        tree.expire(now)
        if self._hints.active:
            self._hints.expire(now)
        if self._governor is not None:
            self._admission.theta_E = self._governor.update(now, self._counters.ssd_bytes_written)
            self._admission.theta_R = self._governor.theta_R
        orders = self._orders.emit(changes) if changes is not None else []
        if tree.reclaimed:  # (bury's own first test)
            tree.bury()
        return orders

    # ======================================================================== ids and lookups
    def _resolve(self, hashes: tuple, start: int = 0, prev: Node | None = None) -> list[Node | None]:
        try:
            return self._tree.resolve(hashes, start, prev)
        except TypeError as exc:
            raise ControlPlaneError(f"chunk hashes must be hashable: {exc}") from None

    def _why_not_in_flight(self, order_id: int) -> str:
        if order_id in self._plans:
            return f"id {order_id} is a reload plan: release it or commit it, plans are not completed"
        if self._orders.issued(order_id):
            return (f"order {order_id} is not awaiting completion: already completed, a drop order "
                    f"(needs none), or a released plan")
        return f"unknown order id {order_id!r}: never issued"
