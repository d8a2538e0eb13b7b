"""The context tree: one node per chunk, linked by prefix, with admission evidence and objects.

Chunk hashes are prefix-chained (a chunk's hash depends on every chunk before it), so a dict from
hash to node, with parent links, is the radix tree over chunk hashes: a request's chunk hashes
walk one path from the root. A node keeps E_b (DRAM evictions of its kv object), R_b (requests
that referenced it again) and its last reuse time across residencies, and its objects: ``kv``
always, ``state`` on checkpoint boundaries of hybrid models.

Metadata is reclaimed by a sliding window: a node is reclaimed once a whole window has passed
with no reuse or recomputation and nothing resident (no copy, so no pin and nothing in flight),
and it has no children. ``quiet_since`` is the later of its last reuse and the moment its last
copy went; the window queue keeps awake nodes in that order. A node whose window passes while it
still holds something is parked ("dormant") until its last copy goes, which wakes it for one more
window; one parked only for its children goes with its last child. Touching a node wakes it.

The window queue is a deque with lazy deletion: touching a node appends it again (no search, no
hash table of every node to keep in order) and counts its entries in ``node.queued``; an entry is
the node's current one when it is its last (``queued`` falls to 1 as older ones leave), and
older entries are dropped when they reach the head. Current entries are in ``quiet_since`` order,
the order an ordered set moved-to-end on every touch would keep. A node is dormant exactly when
it has no entry (``queued == 0``). The queue is compacted when it holds more than a few entries
per node, so stale entries cost a bounded few bytes per node and amortised O(1) time per touch.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Hashable, Sequence

from saria.config import ChunkSpec
from saria.control.counters import Counters
from saria.orders import KV, STATE, ControlPlaneError, chunk_repr
from saria.sizing import TierSizing

# Where a copy of an object stands in one tier.
ABSENT = 0    # no copy
FILLING = 1   # slot reserved, an order is filling it; not readable
READY = 2     # readable; in the tier's LRU unless pinned by a plan
DRAINING = 3  # DRAM only: evicted, slot held while its SSD write is in flight or a plan pins it; readable
BAD = 4       # SSD only: a read failed; slot held until no plan pins it; not readable

# The window queue is compacted when it holds more than _COMPACT_FACTOR entries per node (plus
# _COMPACT_SLACK): 8 bytes an entry, against some 300 bytes a node takes anyway.
_COMPACT_FACTOR = 4
_COMPACT_SLACK = 4096

STATUS_NAMES = {ABSENT: "absent", FILLING: "filling", READY: "ready", DRAINING: "draining", BAD: "bad"}


class Evidence:
    """Admission evidence of paper Eq. 1: ``E_b`` DRAM evictions, ``R_b`` reuses, last reuse time.
    A :class:`Node` carries the same three fields itself; a standalone ``Evidence`` is a state
    object's own, with per-object metadata."""

    __slots__ = ("E_b", "R_b", "last_reuse")

    def __init__(self, now: float) -> None:
        self.E_b = 0
        self.R_b = 0
        self.last_reuse = now


class CacheObject:
    """One object of a chunk: its ``kind`` (``"kv"`` or ``"state"``), size (``nbytes``, as the cache
    and DRAM hold it; ``ssd_nbytes`` on SSD, smaller for a kv object under ``ssd_dtype="fp8"``), what
    a copy takes of each tier's capacity (``dram_charge``, ``ssd_charge``: its whole host slots and
    SSD parts, :mod:`saria.sizing`; its sizes when none are given), the evidence admission
    reads (its node, or its own :class:`Evidence` with per-object metadata), and its copy in each
    tier. ``eviction_step``: what evicting it from DRAM adds to its evidence's E_b: 1 for a kv
    object; for a state object 1 only when it keeps its own evidence (a node counts the evictions
    of its kv object), else 0.

    A chunk's kv object is its :class:`Node` itself; a state object is a plain ``CacheObject``."""

    __slots__ = ("node", "kind", "nbytes", "ssd_nbytes", "dram_charge", "ssd_charge", "evidence", "eviction_step",
                 "dram", "ssd", "dram_pins", "ssd_pins", "ssd_unread")

    def __init__(self, node: Node, kind: str, nbytes: int, evidence: Evidence | Node,
                 ssd_nbytes: int | None = None, dram_charge: int | None = None, ssd_charge: int | None = None) -> None:
        self.node = node
        self.kind = kind
        self.nbytes = nbytes
        self.ssd_nbytes = nbytes if ssd_nbytes is None else ssd_nbytes
        self.dram_charge = nbytes if dram_charge is None else dram_charge
        self.ssd_charge = self.ssd_nbytes if ssd_charge is None else ssd_charge
        self.evidence = evidence
        self.eviction_step = 1 if kind is KV or evidence is not node else 0
        self.dram = ABSENT
        self.ssd = ABSENT
        self.dram_pins = 0
        self.ssd_pins = 0
        self.ssd_unread = False  # written to SSD and not read from there since (useful-write count)

    @property
    def chunk(self) -> Hashable:
        """Its chunk's hash: with ``kind``, the object as an :class:`~saria.orders.ObjectKey` names it
        (so ``saria.orders.split_keys`` takes objects too)."""
        return self.node.key

    def __repr__(self) -> str:
        return (f"<{self.kind} of {chunk_repr(self.node.key)}: dram {STATUS_NAMES[self.dram]} "
                f"ssd {STATUS_NAMES[self.ssd]} pins {self.dram_pins}/{self.ssd_pins}>")


class Node(CacheObject):
    """One chunk: its hash, parent, depth (0 = first chunk of a context), child count, evidence
    (``E_b``, ``R_b``, ``last_reuse``, as :class:`Evidence`) and objects.

    A node is also its own kv object (``node.kv is node``): the kv object's copy fields live in
    the node, one allocation per chunk instead of two (a million-chunk tree is a million fewer
    objects for the allocator and the garbage collector). ``state`` is the separate state object
    on checkpoint boundaries of hybrid models."""

    __slots__ = ("E_b", "R_b", "last_reuse", "key", "parent", "depth", "children", "state", "queued",
                 "quiet_since", "session", "evicted_as", "sharers", "learn", "hint")

    def __init__(self, key: Hashable, parent: Node | None, now: float, kv_bytes: int,
                 ssd_kv_bytes: int | None = None, dram_charge: int | None = None,
                 ssd_charge: int | None = None) -> None:
        # CacheObject.__init__ for the kv object, inlined: the hottest allocation of the control plane.
        self.node = self
        self.kind = KV
        self.nbytes = kv_bytes
        self.ssd_nbytes = ssd_nbytes = kv_bytes if ssd_kv_bytes is None else ssd_kv_bytes
        self.dram_charge = kv_bytes if dram_charge is None else dram_charge
        self.ssd_charge = ssd_nbytes if ssd_charge is None else ssd_charge
        self.evidence = self
        self.eviction_step = 1
        self.dram = ABSENT
        self.ssd = ABSENT
        self.dram_pins = 0
        self.ssd_pins = 0
        self.ssd_unread = False
        self.E_b = 0
        self.R_b = 0
        self.last_reuse = now
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children = 0
        self.state: CacheObject | None = None
        self.queued = 1  # entries in the window queue (extend() appends the first); 0: dormant
        self.quiet_since = now  # last reuse, recomputation or loss of its last copy
        self.session = None  # the latest session that referenced it (admission rule session)
        self.evicted_as = None  # the situation of its latest eviction, until it is referenced again
        self.sharers = 0  # times it passed from one session to another (admission rule learned)
        self.learn = None  # the learned rule's history of it (saria.control.learned.FeatureTracker)
        self.hint = None  # its hint state, once a hinted request referenced it (saria.control.hints)

    @property
    def dormant(self) -> bool:
        """Parked: a whole window passed while it still held something (or had children)."""
        return self.queued == 0

    @property
    def kv(self) -> Node:
        return self

    @property
    def objects(self) -> tuple[CacheObject, ...]:
        """The kv object, then the state object if any."""
        return (self,) if self.state is None else (self, self.state)

    def holds_nothing(self) -> bool:
        """No copy in any tier (which also means no pin and nothing in flight)."""
        state = self.state
        return (self.dram == ABSENT and self.ssd == ABSENT
                and (state is None or (state.dram == ABSENT and state.ssd == ABSENT)))

    def __repr__(self) -> str:
        return (f"<Node {chunk_repr(self.key)} depth {self.depth} E_b {self.E_b} R_b {self.R_b}: kv dram "
                f"{STATUS_NAMES[self.dram]} ssd {STATUS_NAMES[self.ssd]} pins {self.dram_pins}/{self.ssd_pins}>")


class ContextTree:
    """Chunk hash -> :class:`Node`, parent links, object creation and the metadata window."""

    def __init__(self, chunk: ChunkSpec, window_s: float, unified_metadata: bool, counters: Counters,
                 ssd_kv_bytes: int | None = None, sizing: TierSizing | None = None) -> None:
        """``ssd_kv_bytes``: a kv object's size on SSD (None: ``chunk.kv_bytes``, ``ssd_dtype="auto"``);
        ``sizing``: how the tiers hold objects, for each object's charges (None: its sizes)."""
        self.nodes: dict[Hashable, Node] = {}
        # Awake nodes, least recently touched first, with stale entries (see the module docstring).
        self._queue: deque[Node] = deque()
        self._window = window_s
        self._kv_bytes = chunk.kv_bytes
        self._ssd_kv_bytes = chunk.kv_bytes if ssd_kv_bytes is None else ssd_kv_bytes
        self._state_bytes = chunk.state_bytes
        if sizing is None:
            sizing = TierSizing.in_bytes(0, 0)  # unit = 1 byte: charges are sizes
        dram, ssd = sizing.dram, sizing.ssd
        self.kv_charges = (dram.charge(self._kv_bytes), ssd.charge(self._ssd_kv_bytes))
        self.state_charges = (dram.charge(self._state_bytes), ssd.charge(self._state_bytes))
        self._checkpoint_chunks = chunk.checkpoint_chunks if chunk.hybrid else 0
        self._unified = unified_metadata
        self._counters = counters
        self.generation = 0  # bumped whenever a node is created or reclaimed
        self._expiry_floor = -math.inf  # no awake node expires before this time
        self.reclaimed: list[Node] = []  # reclaimed in the current call, see bury() (read by the plane)
        self.clock = -math.inf  # the current call's time, set by the control plane

    def __len__(self) -> int:
        return len(self.nodes)

    def is_boundary(self, depth: int) -> bool:
        """Whether the chunk at ``depth`` ends a checkpoint interval (and so has a state object)."""
        every = self._checkpoint_chunks
        return every > 0 and (depth + 1) % every == 0

    # ----------------------------------------------------------------------------------- lookups
    def resolve(self, hashes: Sequence[Hashable], start: int = 0, prev: Node | None = None) -> list[Node | None]:
        """Nodes of ``hashes[start:]`` (``None`` where the tree has none yet), given ``prev``, the
        node of ``hashes[start - 1]``. Raises :class:`ControlPlaneError` if the sequence contradicts
        the tree: a known chunk under another parent, or a known chunk after an unknown one.
        A repeated hash is a contradiction too. Unhashable ids raise ``TypeError``."""
        get = self.nodes.get
        out: list[Node | None] = []
        append = out.append
        for i in range(start, len(hashes)):
            node = get(hashes[i])
            if node is None:
                if i == len(hashes) - 1:  # the last chunk alone is new (a request's own chunk): nothing to check
                    append(None)
                    break
                # The first unknown chunk: every later one must be unknown too, and distinct (a
                # repeat among known chunks breaks the parent links above).
                unknown = hashes[i:]
                if not self.nodes.keys().isdisjoint(unknown):
                    j = next(j for j in range(i + 1, len(hashes)) if hashes[j] in self.nodes)
                    self._contradiction(j, self.nodes[hashes[j]], None, i)
                if len(set(unknown)) != len(unknown):
                    first: dict = {}
                    j = next(j for j in range(i, len(hashes)) if first.setdefault(hashes[j], j) != j)
                    raise ControlPlaneError(f"chunk {j} repeats the hash of chunk {first[hashes[j]]} in one request; "
                                            f"prefix-chained hashes never repeat")
                out += [None] * len(unknown)
                break
            if node.parent is not prev:
                self._contradiction(i, node, prev, -1)
            append(node)
            prev = node
        return out

    def _contradiction(self, i: int, node: Node, prev: Node | None, unknown_from: int) -> None:
        # by place only: a chunk hash is token-derived (docs/security.md)
        if unknown_from >= 0:
            where = f"after chunk {unknown_from}, which the tree does not know"
        else:
            where = "at the root" if prev is None else f"under chunk {i - 1}"
        known = "at the root" if node.parent is None else "under another chunk"
        raise ControlPlaneError(f"chunk hash sequence contradicts the context tree: chunk {i} comes {where}, but "
                                f"the tree has it {known} (depth {node.depth}); chunk hashes must be prefix-chained")

    # --------------------------------------------------------------------------------- mutations
    def extend(self, keys: Sequence[Hashable], parent: Node | None, now: float) -> list[Node]:
        """Create the nodes of ``keys``, a chain below ``parent`` (None: the root), and return them."""
        if not keys:
            return []
        made: list[Node] = []
        append = made.append
        kv_bytes, ssd_kv_bytes, every = self._kv_bytes, self._ssd_kv_bytes, self._checkpoint_chunks
        dram_charge, ssd_charge = self.kv_charges
        if parent is not None:
            parent.children += 1
        for key in keys:
            node = Node(key, parent, now, kv_bytes, ssd_kv_bytes, dram_charge, ssd_charge)
            if every and (node.depth + 1) % every == 0:
                node.state = CacheObject(node, STATE, self._state_bytes, node if self._unified else Evidence(now),
                                         None, *self.state_charges)
            append(node)
            parent = node
        for node in made[:-1]:  # each new node's only child is the next one of the chain
            node.children = 1
        self.nodes.update(zip(keys, made))
        self._queue += made  # Node() counted the entry: queued = 1
        self.generation += 1
        self._counters.nodes_created += len(made)
        return made

    def reuse(self, nodes: list[Node], now: float) -> None:
        """These known chunks were referenced again (reused or recomputed) now: R_b goes up and
        their metadata window restarts (a parked node wakes)."""
        for node in nodes:
            node.R_b += 1
            node.last_reuse = node.quiet_since = now
            node.queued += 1
        self._queue += nodes

    def expire(self, now: float) -> None:
        """Reclaim or park every node quiet for a whole window (``quiet_since <= now - window``)."""
        if len(self._queue) > _COMPACT_FACTOR * len(self.nodes) + _COMPACT_SLACK:
            self._compact()
        if now < self._expiry_floor:
            return
        queue = self._queue  # after compaction, which replaces the deque
        cutoff = now - self._window
        popleft = queue.popleft
        while queue:
            node = queue[0]
            if node.queued > 1:  # a stale entry: the node was touched again since
                node.queued -= 1
                popleft()
                continue
            if node.quiet_since > cutoff:
                # Current entries are in quiet_since order: a lower bound until then.
                self._expiry_floor = node.quiet_since + self._window
                return
            popleft()
            node.queued = 0  # parked
            self.reclaim_if_idle(node)
        self._expiry_floor = now + self._window

    def _compact(self) -> None:
        """Drop every stale entry of the window queue, keeping current ones in order."""
        kept = []
        append = kept.append
        for node in self._queue:
            node.queued -= 1
            if node.queued == 0:  # its last entry
                append(node)
        for node in kept:
            node.queued = 1
        self._queue = deque(kept)

    def went_idle(self, node: Node) -> None:
        """``node``'s last copy is gone (now = ``clock``): its window restarts, a parked node wakes."""
        node.quiet_since = self.clock
        node.queued += 1
        self._queue.append(node)

    def reclaim_if_idle(self, node: Node) -> None:
        """Reclaim ``node`` if it is parked, childless and holds nothing; then its parent likewise.
        (A parked node that holds nothing was parked for its children after a quiet window.)"""
        while node is not None and node.queued == 0 and node.children == 0 and node.holds_nothing():
            del self.nodes[node.key]
            self.generation += 1
            self._counters.nodes_reclaimed += 1
            self.reclaimed.append(node)
            node = node.parent
            if node is not None:
                node.children -= 1

    def bury(self) -> None:
        """Break the reference cycles of the nodes reclaimed since the last call (a node is its own
        kv object and evidence; a state object points back at its node), so that reference
        counting frees them at once instead of the next full garbage collection. Called once the
        orders naming them have been built."""
        for node in self.reclaimed:
            node.node = node.evidence = node.parent = None  # type: ignore[assignment]
            if node.state is not None:
                node.state.node = node.state.evidence = None  # type: ignore[assignment]
                node.state = None
        self.reclaimed.clear()

    def queue_entries(self) -> dict[int, int]:
        """Window-queue entries per node (``id(node)``), counted from scratch (audits)."""
        counts: dict[int, int] = {}
        for node in self._queue:
            counts[id(node)] = counts.get(id(node), 0) + 1
        return counts
