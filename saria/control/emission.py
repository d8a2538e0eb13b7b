"""Order emission: what one control-plane call decided (:class:`PendingChanges`) becomes orders.

One :class:`OrderEmitter` per control plane hands out the ids of plans and orders (one counter),
keeps the orders that await a completion with the objects they move, and holds the recovered SSD
objects dropped by a call that returns no orders (``ControlPlane.plan``) until the next call that
does. Within one returned list the orders are safe to run in list order (``saria.orders``): drops
first (later orders may reuse their slots), then writes for evictions (their DRAM slots are held
until they end), stores, the other writes by reason, promotions, prewarms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from saria.control.makers import frozen_maker
from saria.control.residency import WRITE_REASONS, PendingChanges
from saria.control.tree import CacheObject
from saria.orders import DRAM, GPU, SSD, DropOrder, Order, PromoteOrder, StoreOrder, Tier, WriteOrder, split_keys

__all__ = ["InFlight", "OrderEmitter"]


@dataclass(slots=True)
class InFlight:
    """An order awaiting its completion and the objects it moves."""

    order: Order
    objects: list[CacheObject]


class OrderEmitter:
    """Ids, orders in flight, and recovered drops waiting for a call that returns orders."""

    def __init__(self, *, hybrid: bool, kv_bytes: int, state_bytes: int) -> None:
        self._hybrid = hybrid
        self._kv_bytes = kv_bytes
        self._state_bytes = state_bytes
        self._next_id = 1
        self.in_flight: dict[int, InFlight] = {}
        # Recovered objects dropped where no changes were at hand (plan() returns no orders):
        # emitted, first, by the next call that returns orders.
        self.waiting = PendingChanges()

    def take_id(self) -> int:
        """The next id of a plan or an order."""
        order_id = self._next_id
        self._next_id += 1
        return order_id

    def issued(self, any_id: int) -> bool:
        """Whether ``any_id`` was handed out (to a plan or an order)."""
        return 0 < any_id < self._next_id

    def emit(self, changes: PendingChanges) -> list[Order]:
        """The orders for ``changes`` (after the waiting recovered drops), in a safe order; those
        that need a completion are registered in flight."""
        orders: list[Order] = []
        waiting = self.waiting
        if waiting.recovered_drops:  # (nothing else of it is ever read: keep an empty one)
            self.waiting = PendingChanges()
            recovered = waiting.recovered_drops + changes.recovered_drops
        else:
            recovered = changes.recovered_drops
        if recovered:
            kv, state = split_keys(recovered)
            sizes = self._kv_bytes * len(kv) + self._state_bytes * len(state)
            orders.append(_make_drop(self.take_id(), kv, state, sizes, SSD))
        if changes.dram_drops:
            orders.append(self._order(_make_drop, changes.dram_drops, DRAM))
        if changes.ssd_drops:
            orders.append(self._order(_make_drop, changes.ssd_drops, SSD))
        writes = sorted(changes.writes.items(), key=_write_rank) if changes.writes else ()
        for (reason, source), objs in writes:
            if reason == "eviction":
                orders.append(self._order(_make_write, objs, source, reason))
        if changes.stores:
            orders.append(self._order(_make_store, changes.stores))
        for (reason, source), objs in writes:
            if reason != "eviction":
                orders.append(self._order(_make_write, objs, source, reason))
        if changes.promotions:
            orders.append(self._order(_make_promote, changes.promotions, GPU))
        if changes.prewarms:
            orders.append(self._order(_make_promote, changes.prewarms, SSD))
        return orders

    def _order(self, make: Callable[..., Order], objs: list[CacheObject], *extra: object) -> Order:
        """The order ``make`` builds (one of the makers below) for ``objs``, with its fields after
        ``nbytes`` (``extra``); registered in flight unless it is a drop."""
        if self._hybrid:
            kv, state = split_keys(objs)  # a CacheObject names its chunk and kind as an ObjectKey does
            nbytes = sum([obj.nbytes for obj in objs])
        else:  # every object is a kv object, that is a node, and all have the same size
            kv = tuple([node.key for node in objs])
            state = ()
            nbytes = len(objs) * self._kv_bytes
        order = make(self.take_id(), kv, state, nbytes, *extra)
        if make is not _make_drop:
            self.in_flight[order.order_id] = InFlight(order, objs)
        return order


# The orders as their classes build them (saria.control.makers), every field given: the order's
# fields, then DropOrder's tier, WriteOrder's source and reason, PromoteOrder's source.
_make_drop = frozen_maker(DropOrder)
_make_store = frozen_maker(StoreOrder)
_make_write = frozen_maker(WriteOrder)
_make_promote = frozen_maker(PromoteOrder)


def _write_rank(item: tuple[tuple[str, Tier], list]) -> tuple[int, int]:
    reason, source = item[0]
    return WRITE_REASONS.index(reason), source is GPU
