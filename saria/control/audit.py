"""``ControlPlane.audit``: every invariant of a control plane, recomputed from scratch.

O(nodes + plans + orders in flight); for tests and debugging, never on the hot path. Reads the
plane's internals on purpose: it is the independent check of the bookkeeping they keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from saria.orders import DRAM, SSD, PromoteOrder, Tier
from saria.control.tree import ABSENT, BAD, DRAINING, FILLING, READY

if TYPE_CHECKING:
    from saria.control.counters import Counters
    from saria.control.residency import Residency
    from saria.control.tree import ContextTree


def audit(tree: ContextTree, tiers: Residency, plans: Iterable, in_flight: Iterable, counters: Counters) -> list[str]:
    """Every invariant the control plane keeps, checked from scratch (the caller holds its lock):
    its tree, tiers and counters, its live plans (records with ``reads()``: every (object, tier)
    pinned) and its orders in flight (records with ``order`` and ``objects``)."""
    problems: list[str] = []
    pins: dict[tuple[int, Tier], int] = {}
    for record in plans:
        for obj, source in record.reads():
            pins[(id(obj), source)] = pins.get((id(obj), source), 0) + 1
    orders_of: dict[int, list[str]] = {}
    for flight in in_flight:
        prewarm = isinstance(flight.order, PromoteOrder) and flight.order.source is SSD
        for obj in flight.objects:
            orders_of.setdefault(id(obj), []).append(type(flight.order).__name__)
            if prewarm:  # a prewarm pins the SSD copies it reads until it completes
                pins[(id(obj), SSD)] = pins.get((id(obj), SSD), 0) + 1
    used = {DRAM: 0, SSD: 0}
    queued = tree.queue_entries()
    children: dict[int, int] = {}
    for key, node in tree.nodes.items():
        if node.key != key:
            problems.append(f"{node!r} filed under another chunk hash")
        if node.parent is not None:
            if tree.nodes.get(node.parent.key) is not node.parent:
                problems.append(f"{node!r}: parent {node.parent!r} is not in the tree")
            children[id(node.parent)] = children.get(id(node.parent), 0) + 1
        entries = queued.pop(id(node), 0)
        if node.queued != entries:
            problems.append(f"{node!r}: counts {node.queued} window-queue entries, the queue holds {entries}")
        if (node.state is not None) != (tree.is_boundary(node.depth)):
            problems.append(f"{node!r}: state object presence does not match the checkpoint boundaries")
        for obj in node.objects:
            flights = orders_of.get(id(obj), [])
            if (obj.dram_charge, obj.ssd_charge) != (tree.kv_charges if obj is node else tree.state_charges):
                problems.append(f"{obj!r}: charges {obj.dram_charge}/{obj.ssd_charge} are not its kind's")
            if obj.dram != ABSENT:
                used[DRAM] += obj.dram_charge
            if obj.ssd != ABSENT:
                used[SSD] += obj.ssd_charge
            if obj.dram_pins != pins.get((id(obj), DRAM), 0) or obj.ssd_pins != pins.get((id(obj), SSD), 0):
                problems.append(f"{obj!r}: pin counts do not match the live plans and prewarms")
            if obj.dram_pins and obj.dram not in (READY, DRAINING):
                problems.append(f"{obj!r}: pinned in DRAM but not readable there")
            if obj.ssd_pins and obj.ssd not in (READY, BAD):
                problems.append(f"{obj!r}: pinned in SSD but neither ready nor bad")
            if (obj in tiers.dram.lru) != (obj.dram == READY and obj.dram_pins == 0):
                problems.append(f"{obj!r}: DRAM LRU membership wrong")
            if (obj in tiers.ssd.lru) != (obj.ssd == READY and obj.ssd_pins == 0):
                problems.append(f"{obj!r}: SSD LRU membership wrong")
            fills = flights.count("StoreOrder") + flights.count("PromoteOrder")
            if (obj.dram == FILLING) != (fills == 1) or fills > 1:
                problems.append(f"{obj!r}: DRAM filling without exactly one store/promote order ({flights})")
            if (obj.ssd == FILLING) != (flights.count("WriteOrder") == 1) or flights.count("WriteOrder") > 1:
                problems.append(f"{obj!r}: SSD filling without exactly one write order ({flights})")
            if obj.dram == DRAINING and obj.ssd != FILLING and obj.dram_pins == 0:
                problems.append(f"{obj!r}: draining with no write in flight and no pin")
    for key, node in tree.nodes.items():
        if node.children != children.get(id(node), 0):
            problems.append(f"{node!r}: child count {node.children}, actual {children.get(id(node), 0)}")
        if node.dormant and node.children == 0 and node.holds_nothing():
            problems.append(f"{node!r}: dormant and idle but not reclaimed")
    for obj in tiers.prewarmed:
        if obj.dram == ABSENT or obj is not obj.node or tree.nodes.get(obj.node.key) is not obj.node:
            problems.append(f"{obj!r}: marked prewarmed but not a kv object with a DRAM copy in the tree")
    if queued:
        problems.append(f"window queue: {sum(queued.values())} entries of {len(queued)} nodes not in the tree")
    used[tiers.ssd.tier] += sum(tiers.recovered.values())
    for key in tiers.recovered:
        if key.chunk in tree.nodes:
            problems.append(f"recovered SSD object {key!r} belongs to a chunk the tree knows")
    for tier in (tiers.dram, tiers.ssd):
        if tier.used != used[tier.tier]:
            problems.append(f"{tier.tier}: used {tier.used} bytes, copies hold {used[tier.tier]}")
        if not 0 <= tier.used <= tier.capacity:
            problems.append(f"{tier.tier}: used {tier.used} bytes outside [0, {tier.capacity}]")
        for obj in tier.lru:
            if tree.nodes.get(obj.node.key) is not obj.node:
                problems.append(f"{obj!r} in the {tier.tier} LRU belongs to a reclaimed node")
    c = counters
    if c.hits_dram_chunks + c.hits_ssd_chunks + c.misses != c.references:
        problems.append(f"counters: hits {c.hits} + misses {c.misses} != references {c.references}")
    return problems
