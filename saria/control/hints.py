"""Cache-control hints from the application: what a request says about its own prompt's future.

An application often knows what no admission rule can guess: that a session's next turn is coming
(an agent waiting on a tool), that a conversation was closed, that a system prompt is shared by
every user. A request carries that as a few hints (:class:`Hints`, read from vLLM's
``kv_transfer_params`` by :func:`parse_hints`, both in :mod:`saria.control.hint_vocabulary`;
docs/vllm.md has the vocabulary), and the control plane takes
them as inputs to its existing rules (:class:`HintBook`; docs/policy.md). Without hints nothing
here runs and every decision is Eq. 1's (and the policy's other rules').

* ``retain_s``: keep the request's chunks reachable for at least that long: a chunk reaching DRAM
  eviction inside its retention is written to SSD even when admission would not (a *hinted
  admission*; a new chunk that finds no DRAM room is written from HBM instead), and SSD eviction
  takes chunks whose retention has passed first (a retained chunk goes only when nothing else can).
  Each tenant's retained bytes (SSD charges of its chunks inside a retention) are capped
  (``retain_bytes_per_tenant``, a tenth of the SSD tier by default): a ``retain_s`` that would pass
  the cap is refused whole (``retains_refused``, never an error); a chunk the tenant already retains
  is extended at no charge.
* ``pin`` (a TTL in seconds, or until unpinned): the request's chunks are written to SSD at their
  DRAM eviction and never evicted from SSD while pinned. Each tenant's pinned bytes (SSD charges)
  are capped (``pin_bytes_per_tenant``), and all tenants' together at half the SSD tier: a pin
  that would pass either cap is refused whole (counted, never an error). ``pin: false`` unpins
  the request's chunks (of its own tenant).
* ``session`` + ``next_turn_s``: the application's word replaces Eq. 1's guess for the session's
  private chunks of its latest prompt (:meth:`HintBook.at_dram_eviction`): at DRAM eviction such a
  chunk is written when the announced turn comes within the SSD's expected retention (the age of
  its latest LRU victim, the ``oracle`` rule's horizon) and not written when it comes later,
  whatever admission says; the reuse path leaves it to its eviction and prewrite skips it where the
  eviction would not write it. (The ``oracle`` rule writes a chunk exactly when a request it knows
  of references it within that horizon; this is its online counterpart, from the hint alone.) The
  session's older prompts' chunks, shared chunks and sessions that announced nothing keep Eq. 1.
  When the request ends, a prewarm of its chunks (SSD -> free DRAM, :meth:`ControlPlane.prewarm`)
  is due ``Policy.prewarm_lead_s`` before the announced next turn; the session's next request
  cancels it (and the announcement: a turn that announces nothing leaves its chunks to Eq. 1).
* ``done``: the session ended. Its *private* chunks (made by a request of the session and
  referenced by no request of another session, nor one without a session, since) lose their
  evidence (E_b = R_b = 0), are never written to SSD afterwards (no eviction, reuse or prewrite
  admission), go first at eviction (their DRAM and SSD copies move to the LRU ends), and the
  done request's new chunks are not stored in DRAM. Its private chunks of earlier prompts are
  never written either. A chunk referenced again, or a session that sends again, is alive again.

Tenants: sessions and pins are keyed by the request's tenant (the connector's: the key file's
tenant tag, or the digest of the request's ``cache_salt``), so a hint of tenant B never names
tenant A's session or pins. No hint value, session id or tenant appears in a message or counter
label here: they are only compared and counted.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

from saria.control.hint_vocabulary import MAX_HINT_S, MAX_SESSION_CHARS, Hints, parse_hints
from saria.control.tree import CacheObject, Node

__all__ = ["HintBook", "HintCounters", "Hints", "parse_hints", "MAX_HINT_S", "MAX_SESSION_CHARS"]

MAX_SESSIONS = 65_536         # hinted sessions kept (least recently used dropped first)
GLOBAL_PIN_FRACTION = 0.5     # all tenants' pinned bytes together, of the SSD tier
DEFAULT_PIN_FRACTION = 0.1    # one tenant's pinned bytes by default, of the SSD tier
DEFAULT_RETAIN_FRACTION = 0.1  # one tenant's retained bytes by default, of the SSD tier


@dataclass(slots=True)
class HintCounters:
    """What the hints did (kept apart from :class:`~saria.control.counters.Counters`, whose
    figures are the replays' and stay as they were). ``pinned_bytes`` is a gauge (now), the others
    count since start."""

    hinted_requests: int = 0      # committed requests that carried hints
    hinted_admissions: int = 0    # objects written at eviction for a hint (retain, pin, next turn) admission refused
    announced_admits: int = 0     # evictions of a session's private chunk, its announced turn within the SSD's retention
    announced_skips: int = 0      # ... beyond it: not written, whatever admission says
    pins: int = 0                 # pins accepted (a pin hint, all of its chunks)
    pins_refused: int = 0         # pin hints refused: over the tenant's cap or the global one, or no SSD tier
    unpins: int = 0               # pin: false hints that released something
    pins_expired: int = 0         # chunk pins whose TTL ended
    pinned_bytes: int = 0         # gauge: SSD charges of the chunks pinned now, all tenants
    retains_refused: int = 0      # retain_s hints refused: over the tenant's retain cap, or no SSD tier
    retained_bytes: int = 0       # gauge: SSD charges of the chunks inside a retention now, all tenants
    retained_evicted: int = 0     # SSD copies evicted inside their retention (nothing else left)
    prewarms_hinted: int = 0      # prewarm orders issued for next_turn_s
    prewarms_cancelled: int = 0   # hinted prewarms whose session's next turn came first
    sessions_done: int = 0        # done hints applied
    done_chunks: int = 0          # private chunks of done sessions
    done_stores_skipped: int = 0  # new chunks of a done request not stored in DRAM
    hints_malformed: int = 0      # malformed or unknown hint keys ignored (counted by the caller that parses)


class _Mark:
    """A chunk's hint state (``node.hint``): its owner (the (tenant, session) that referenced it,
    or ``_SHARED``), its retention end, its pins and whether its session is done."""

    __slots__ = ("owner", "retain_until", "pins", "done")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.retain_until = -math.inf
        self.pins: dict[Hashable, float] | None = None  # tenant -> pin end
        self.done = False

    def pinned(self, now: float) -> bool:
        pins = self.pins
        return pins is not None and any(until > now for until in pins.values())


_SHARED = ("shared",)  # an owner no session key equals (keys are (tenant, str))


@dataclass(slots=True)
class _Pin:
    until: float
    charge: int
    node: Node | None  # None: restored from a previous control plane, its chunk not referenced since


@dataclass(slots=True)
class _Session:
    hashes: tuple = ()
    due: float | None = None
    generation: int = 0
    next_at: float | None = None  # when its next turn comes, as its latest next_turn_s said (None: not said)
    latest: frozenset = frozenset()  # the chunk keys of its latest prompt (what its next turn continues)
    chunks: list = field(default_factory=list)  # nodes it referenced (owner checks at done)


class HintBook:
    """Every hint's state in one control plane: chunk marks (``node.hint``), pins per tenant,
    hinted sessions and their prewarms. Not thread-safe (the control plane's lock covers it)."""

    def __init__(self, ssd_capacity: int, pin_bytes_per_tenant: int | None, prewarm_lead_s: float,
                 retain_bytes_per_tenant: int | None = None) -> None:
        self.counters = HintCounters()
        self.active = False  # any hint seen: the hooks in residency and placement look only then
        self.ssd_capacity = ssd_capacity
        self.cap = (int(DEFAULT_PIN_FRACTION * ssd_capacity) if pin_bytes_per_tenant is None
                    else int(pin_bytes_per_tenant))
        self.global_cap = int(GLOBAL_PIN_FRACTION * ssd_capacity)
        self.lead_s = prewarm_lead_s
        self.retain_cap = (int(DEFAULT_RETAIN_FRACTION * ssd_capacity) if retain_bytes_per_tenant is None
                           else int(retain_bytes_per_tenant))
        self.retains: dict[Hashable, dict[Hashable, list]] = {}  # tenant -> chunk key -> [until, charge]
        self.retained: dict[Hashable, int] = {}  # tenant -> bytes (SSD charges) inside their retention
        self._retain_expiry: list[tuple[float, int, Hashable, Hashable]] = []  # (until, seq, tenant, key)
        self.restored_retains: dict[Hashable, float] = {}  # chunk key -> retention end, from a previous plane
        self.pins: dict[Hashable, dict[Hashable, _Pin]] = {}  # tenant -> chunk key -> pin
        self.pinned: dict[Hashable, int] = {}  # tenant -> bytes
        self.pinned_keys: dict[Hashable, set] = {}  # chunk key -> the tenants pinning it
        self._expiry: list[tuple[float, int, Hashable, Hashable]] = []  # (until, seq, tenant, key)
        self._seq = 0
        self.sessions: OrderedDict[tuple, _Session] = OrderedDict()
        self.ended: OrderedDict[tuple, None] = OrderedDict()  # sessions that said done (the latest MAX_SESSIONS)
        self._due: list[tuple[float, int, tuple, int]] = []  # (due, seq, session key, generation)

    # ------------------------------------------------------------------------------- at commit
    def referenced(self, nodes: list[Node], tenant: Hashable, hints: Hints | None, fresh_from: int = 0) -> None:
        """A committed request referenced ``nodes`` (with ``hints``, or None; the chunks from
        ``fresh_from`` on are new, made by this request): ownership of the chunks the book follows,
        and a done mark cleared (the chunk is alive again). A chunk the book did not follow that
        existed before this request was referenced by requests of no session: it is shared."""
        owner = (tenant, hints.session) if hints is not None and hints.session is not None else _SHARED
        if hints is None and not self.active:
            return
        self.active = True
        for i, node in enumerate(nodes):
            mark = node.hint
            if mark is None:
                if owner is _SHARED:
                    continue  # a chunk no session claims: nothing to follow
                node.hint = _Mark(owner if i >= fresh_from else _SHARED)
            else:
                if mark.owner != owner:
                    mark.owner = _SHARED
                mark.done = False
        if self.restored_retains:  # a chunk retained under a previous control plane: retained again
            for node in nodes:
                until = self.restored_retains.pop(node.key, None)
                if until is not None:
                    mark = self._mark(node)
                    mark.retain_until = max(mark.retain_until, until)
        if self.pins:  # a pinned chunk whose node was reclaimed (it held nothing) and is back: pinned again
            for node in nodes:
                tenants = self.pinned_keys.get(node.key)
                if tenants is not None and (node.hint is None or node.hint.pins is None):
                    mark = self._mark(node)
                    mark.pins = {}
                    for tenant_ in tenants:
                        record = self.pins[tenant_][node.key]
                        record.node = node
                        mark.pins[tenant_] = record.until
        if owner is not _SHARED:
            if self.ended:
                self.ended.pop(owner, None)  # the session is back: its chunks are alive again
            session = self._session(owner)
            if session.due is not None:  # its next turn came: the prewarm is no longer due
                session.due = None
                session.generation += 1
                self.counters.prewarms_cancelled += 1
            session.next_at = None  # the announced turn came (this request may announce the next)
            session.chunks = list(nodes)
            session.latest = frozenset([node.key for node in nodes])

    def apply(self, nodes: list[Node], tenant: Hashable, hints: Hints, now: float) -> None:
        """A committed request's retain, pin and unpin hints on its chunks ``nodes``."""
        self.counters.hinted_requests += 1
        if hints.session is not None and hints.next_turn_s is not None and not hints.done:
            self._session((tenant, hints.session)).next_at = now + hints.next_turn_s  # turn_ended refines it
        if hints.retain_s is not None:
            self.retain(nodes, tenant, now + hints.retain_s, now)
        if hints.unpin:
            self.unpin(nodes, tenant)
        if hints.pin is not None:
            self.pin(nodes if hints.pin_chunks is None else nodes[:hints.pin_chunks], tenant, now + hints.pin)

    def retain(self, nodes: list[Node], tenant: Hashable, until: float, now: float) -> bool:
        """Retain ``nodes`` for ``tenant`` until ``until``, all or none: refused (False, counted) when
        the tenant's retained bytes (SSD charges of its chunks inside their retention) would pass
        ``retain_cap``. A chunk the tenant already retains is extended at no charge."""
        if not nodes:
            return True
        self._expire_retains(now)
        mine = self.retains.get(tenant, {})
        need = sum([_charge(node) for node in nodes if node.key not in mine])
        if self.ssd_capacity <= 0 or self.retained.get(tenant, 0) + need > self.retain_cap:
            self.counters.retains_refused += 1
            return False
        mine = self.retains.setdefault(tenant, mine)
        for node in nodes:
            record = mine.get(node.key)
            if record is None:
                mine[node.key] = [until, _charge(node)]
            elif until > record[0]:
                record[0] = until
            else:
                continue
            self._seq += 1
            heapq.heappush(self._retain_expiry, (until, self._seq, tenant, node.key))
            mark = self._mark(node)
            if until > mark.retain_until:
                mark.retain_until = until
        self.retained[tenant] = self.retained.get(tenant, 0) + need
        self.counters.retained_bytes = sum(self.retained.values())
        return True

    def _expire_retains(self, now: float) -> None:
        expiry = self._retain_expiry
        while expiry and expiry[0][0] <= now:
            _, _, tenant, key = heapq.heappop(expiry)
            mine = self.retains.get(tenant)
            record = None if mine is None else mine.get(key)
            if record is not None and record[0] <= now:
                del mine[key]
                self.retained[tenant] -= record[1]
                if not mine:
                    del self.retains[tenant]
                    del self.retained[tenant]
        self.counters.retained_bytes = sum(self.retained.values())

    def retained_of(self, tenant: Hashable) -> int:
        return self.retained.get(tenant, 0)

    def pin(self, nodes: list[Node], tenant: Hashable, until: float) -> bool:
        """Pin ``nodes`` for ``tenant`` until ``until``, all or none: refused (False) past a cap."""
        if not nodes:
            return True
        mine = self.pins.get(tenant, {})
        new = [node for node in nodes if node.key not in mine]
        need = sum([_charge(node) for node in new])
        total = sum(self.pinned.values())
        if self.ssd_capacity <= 0 or self.pinned.get(tenant, 0) + need > self.cap or total + need > self.global_cap:
            self.counters.pins_refused += 1
            return False
        mine = self.pins.setdefault(tenant, mine)
        for node in nodes:
            record = mine.get(node.key)
            if record is None:
                record = mine[node.key] = _Pin(until, _charge(node), node)
                self.pinned_keys.setdefault(node.key, set()).add(tenant)
            elif until > record.until:
                record.until = until
            record.node = node
            mark = self._mark(node)
            if mark.pins is None:
                mark.pins = {}
            mark.pins[tenant] = record.until
            if math.isfinite(until):
                self._seq += 1
                heapq.heappush(self._expiry, (until, self._seq, tenant, node.key))
        self.pinned[tenant] = self.pinned.get(tenant, 0) + need
        self.counters.pins += 1
        self.counters.pinned_bytes = sum(self.pinned.values())
        return True

    def unpin(self, nodes: list[Node], tenant: Hashable) -> None:
        mine = self.pins.get(tenant)
        if not mine:
            return
        released = False
        for node in nodes:
            if node.key in mine:
                self._release(tenant, node.key)
                released = True
        self.counters.unpins += released

    def _release(self, tenant: Hashable, key: Hashable) -> None:
        mine = self.pins[tenant]
        record = mine.pop(key)
        self.pinned[tenant] -= record.charge
        tenants = self.pinned_keys[key]
        tenants.discard(tenant)
        if not tenants:
            del self.pinned_keys[key]
        if not mine:
            del self.pins[tenant]
            del self.pinned[tenant]
        mark = None if record.node is None else record.node.hint
        if mark is not None and mark.pins is not None and record.node.node is not None:
            mark.pins.pop(tenant, None)
            if not mark.pins:
                mark.pins = None
        self.counters.pinned_bytes = sum(self.pinned.values())

    def expire(self, now: float) -> None:
        """End the pins whose TTL has passed, and the retentions."""
        if self._retain_expiry and self._retain_expiry[0][0] <= now:
            self._expire_retains(now)
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            until, _, tenant, key = heapq.heappop(expiry)
            record = self.pins.get(tenant, {}).get(key)
            if record is not None and record.until <= now:
                self._release(tenant, key)
                self.counters.pins_expired += 1

    def done(self, tenant: Hashable, session: str, dram_lru: OrderedDict, ssd_lru: OrderedDict) -> None:
        """Session ``(tenant, session)`` ended: its private chunks lose their evidence and go first."""
        owner = (tenant, session)
        record = self.sessions.pop(owner, None)
        self.counters.sessions_done += 1
        self.ended[owner] = None  # its private chunks outside its last prompt are never written either
        while len(self.ended) > MAX_SESSIONS:
            self.ended.popitem(last=False)
        if record is None:
            return
        record.generation += 1
        for node in record.chunks:
            mark = node.hint
            if mark is None or mark.owner != owner or node.node is None or mark.pins:  # shared, reclaimed, pinned
                continue
            mark.done = True
            mark.retain_until = -math.inf
            self.counters.done_chunks += 1
            for obj in node.objects:
                evidence = obj.evidence
                evidence.E_b = evidence.R_b = 0
                if obj in dram_lru:
                    dram_lru.move_to_end(obj, last=False)
                if obj in ssd_lru:
                    ssd_lru.move_to_end(obj, last=False)

    # ------------------------------------------------------------------- across a rebuild
    def snapshot(self) -> dict:
        """What the applications said that outlives this control plane (plain data, no nodes): each
        tenant's pins and retentions (chunk key -> end, charge), the sessions' announced turns,
        latest prompts and due prewarms, and the sessions that ended. :meth:`restore` takes it."""
        return {
            "pins": {tenant: {key: (p.until, p.charge) for key, p in mine.items()} for tenant, mine in self.pins.items()},
            "retains": {tenant: {key: (r[0], r[1]) for key, r in mine.items()} for tenant, mine in self.retains.items()},
            "sessions": [(owner, s.next_at, s.due, s.hashes, tuple(s.latest)) for owner, s in self.sessions.items()],
            "ended": list(self.ended),
        }

    def restore(self, state: dict, now: float) -> None:
        """Take over a previous control plane's :meth:`snapshot` (this one new, its hints empty):
        pins and retentions whose end has not passed (a pinned chunk is pinned again when a request
        references it, as one whose node was reclaimed is, its recovered SSD objects kept meanwhile:
        ``Residency._drop_recovered_hinted``; its bytes count against its tenant's cap at once),
        sessions (their announced turns decide admission again, their due prewarms are
        due again) and the ended sessions. A pin or retention past this plane's caps (a smaller
        SSD tier) is dropped, counted as refused."""
        for tenant, mine in state.get("pins", {}).items():
            for key, (until, charge) in mine.items():
                if until <= now:
                    continue
                total = sum(self.pinned.values())
                if (self.ssd_capacity <= 0 or self.pinned.get(tenant, 0) + charge > self.cap
                        or total + charge > self.global_cap):
                    self.counters.pins_refused += 1
                    continue
                self.pins.setdefault(tenant, {})[key] = _Pin(until, charge, None)
                self.pinned_keys.setdefault(key, set()).add(tenant)
                self.pinned[tenant] = self.pinned.get(tenant, 0) + charge
                if math.isfinite(until):
                    self._seq += 1
                    heapq.heappush(self._expiry, (until, self._seq, tenant, key))
        self.counters.pinned_bytes = sum(self.pinned.values())
        for tenant, mine in state.get("retains", {}).items():
            for key, (until, charge) in mine.items():
                if until <= now:
                    continue
                if self.ssd_capacity <= 0 or self.retained.get(tenant, 0) + charge > self.retain_cap:
                    self.counters.retains_refused += 1
                    continue
                self.retains.setdefault(tenant, {})[key] = [until, charge]
                self.restored_retains[key] = max(until, self.restored_retains.get(key, -math.inf))
                self.retained[tenant] = self.retained.get(tenant, 0) + charge
                self._seq += 1
                heapq.heappush(self._retain_expiry, (until, self._seq, tenant, key))
        self.counters.retained_bytes = sum(self.retained.values())
        for owner, next_at, due, hashes, latest in state.get("sessions", []):
            session = self._session(owner)
            session.next_at, session.hashes, session.latest = next_at, hashes, frozenset(latest)
            if due is not None:
                session.generation += 1
                session.due = max(due, now)
                self._seq += 1
                heapq.heappush(self._due, (session.due, self._seq, owner, session.generation))
        for owner in state.get("ended", []):
            self.ended[owner] = None
        self.active = self.active or bool(self.pins or self.retains or self.sessions or self.ended)

    # --------------------------------------------------------------------------------- prewarm
    def turn_ended(self, tenant: Hashable, hints: Hints, hashes: tuple, now: float) -> None:
        """A hinted request of a session ended at ``now``: a prewarm of ``hashes`` becomes due
        ``lead_s`` before ``now + next_turn_s`` (not before ``now``)."""
        if hints.session is None or hints.next_turn_s is None or hints.done or not hashes:
            return
        owner = (tenant, hints.session)
        session = self._session(owner)
        session.generation += 1
        session.hashes = hashes
        session.next_at = now + hints.next_turn_s
        session.due = max(now, now + hints.next_turn_s - self.lead_s)
        self._seq += 1
        heapq.heappush(self._due, (session.due, self._seq, owner, session.generation))

    def due(self, now: float) -> list[tuple]:
        """The chunk hashes of the hinted prewarms due at ``now`` (each handed out once)."""
        out = []
        while self._due and self._due[0][0] <= now:
            _, _, owner, generation = heapq.heappop(self._due)
            session = self.sessions.get(owner)
            if session is None or session.generation != generation or session.due is None:
                continue
            session.due = None
            out.append(session.hashes)
        return out

    def next_due(self) -> float | None:
        while self._due:
            due, _, owner, generation = self._due[0]
            session = self.sessions.get(owner)
            if session is not None and session.generation == generation and session.due is not None:
                return due
            heapq.heappop(self._due)
        return None

    # ------------------------------------------------------------------------ eviction rules
    def at_dram_eviction(self, obj: CacheObject, now: float, horizon: float = math.inf,
                         count: bool = False) -> bool | None:
        """For an object at its DRAM eviction with no SSD copy: True to write it whatever admission
        says, False never to, None to let admission decide (Eq. 1 and the policy's other rules).
        ``horizon``: the SSD's expected retention (the age of its latest LRU victim, as the oracle's);
        ``count``: an eviction, not a question (counted in ``announced_admits`` / ``announced_skips``).

        * a done session's private chunk: False;
        * retained or pinned: True;
        * a private chunk of a session that announced its next turn (``next_turn_s``): True when
          that turn comes within ``horizon`` (the SSD will still hold the copy then), else False:
          the application's word replaces Eq. 1's guess, as the oracle's knowledge of the next use
          does (:meth:`announced`);
        * anything else (a shared chunk, a session that announced nothing): None."""
        mark = obj.node.hint
        if mark is None:
            return None
        if mark.done:
            return False
        if mark.retain_until > now or mark.pinned(now):
            return True
        if mark.owner is _SHARED:
            return None
        if mark.owner in self.ended:  # a private chunk of a done session (outside its last prompt)
            return False
        verdict = self.announced(mark.owner, obj.node.key, now, horizon)
        if count and verdict is not None:
            if verdict:
                self.counters.announced_admits += 1
            else:
                self.counters.announced_skips += 1
        return verdict

    def announced(self, owner: tuple, key: Hashable, now: float, horizon: float) -> bool | None:
        """Whether session ``owner``'s announced next turn comes within ``horizon`` of ``now``
        (None: it announced none). A turn announced for a time already passed is due any moment:
        within."""
        session = self.sessions.get(owner)
        if session is None or session.next_at is None or key not in session.latest:
            return None
        return session.next_at - now <= horizon

    @staticmethod
    def held(obj: CacheObject, now: float) -> bool:
        """Retained or pinned (a new chunk with no DRAM room is written from HBM)."""
        mark = obj.node.hint
        return mark is not None and not mark.done and (mark.retain_until > now or mark.pinned(now))

    def decides(self, obj: CacheObject, now: float) -> bool:
        """The hints, not the reuse branch, decide ``obj``'s write (at its eviction): a done
        session's private chunk, or a private chunk of a session that announced its next turn and
        is neither retained nor pinned (the oracle has no reuse branch either)."""
        mark = obj.node.hint
        if mark is None:
            return False
        if mark.done:
            return True
        if mark.owner is _SHARED or mark.retain_until > now or mark.pinned(now):
            return False
        if mark.owner in self.ended:
            return True
        session = self.sessions.get(mark.owner)
        return session is not None and session.next_at is not None and obj.node.key in session.latest

    @staticmethod
    def never_written(obj: CacheObject) -> bool:
        mark = obj.node.hint
        return mark is not None and mark.done

    @staticmethod
    def protected(obj: CacheObject, now: float) -> int:
        """0: evictable from SSD; 1: inside its retention (goes only when nothing else can);
        2: pinned (never)."""
        mark = obj.node.hint
        if mark is None:
            return 0
        if mark.pinned(now):
            return 2
        return 1 if mark.retain_until > now else 0

    # ------------------------------------------------------------------------------- helpers
    def _mark(self, node: Node) -> _Mark:
        mark = node.hint
        if mark is None:
            mark = node.hint = _Mark(_SHARED)
        return mark

    def _session(self, owner: tuple) -> _Session:
        session = self.sessions.get(owner)
        if session is None:
            session = self.sessions[owner] = _Session()
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(owner)
        return session

    def pinned_of(self, tenant: Hashable) -> int:
        return self.pinned.get(tenant, 0)


def _charge(node: Node) -> int:
    """What pinning a chunk holds of the SSD tier: its objects' SSD charges."""
    return sum([obj.ssd_charge for obj in node.objects])

