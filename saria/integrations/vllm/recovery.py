"""At start, the SSD objects a previous run of this server left: each worker rank reports its
store's inventory with its first report, and once every rank has, the objects every rank holds a
shard of go to the control plane (``ControlPlane.recover_ssd``); the others are deleted on every
rank (a chunk is served only whole). Until then (at most ``wait_s``) lookups answer "not yet".
A control plane rebuilt after a fault takes over this run's SSD objects the same way: each rank
reports its inventory again with its first report of the new epoch."""

from __future__ import annotations

import logging
from typing import Callable

from saria.control import ControlPlane, DropOrder, ObjectKey, Order, Tier
from saria.orders import split_keys

from .metadata import add_counts

log = logging.getLogger("saria.vllm")


class InventoryTakeover:
    """The ranks' SSD inventories, gathered until every rank's is in (or ``wait_s`` passed)."""

    def __init__(self, control: ControlPlane, workers: int, wait_s: float, clock: Callable[[], float], *,
                 active: bool):
        self.control = control
        self.workers = workers
        self.wait_s = wait_s
        self.clock = clock
        self.active = active  # lookups wait for the ranks' inventories
        self.reports = 0
        self._since: float | None = None
        self._inventory: dict[ObjectKey, int] = {}
        self.recovered: list[ObjectKey] = []  # what the takeover gave the control plane (KV events)

    def waiting(self) -> bool:
        """Whether lookups should still wait: inventories are awaited, for at most ``wait_s``."""
        if not self.active:
            return False
        now = self.clock()
        if self._since is None:
            self._since = now
        if now - self._since < self.wait_s:
            return True
        self.active = False
        log.warning("saria: SSD inventories came from %d of %d worker rank(s) within %g s; serving without the "
                    "previous run's SSD objects until the rest arrive", self.reports, self.workers, self.wait_s)
        return False

    def add(self, inventory: dict[ObjectKey, int], reports: int) -> list[Order]:
        """Add ranks' inventories; once every rank's is in, take over the objects every rank holds
        and delete the rest everywhere: the orders to run before any other."""
        self._inventory = add_counts(self._inventory, inventory)
        self.reports += reports
        if self.reports < self.workers:
            return []
        inventory, self._inventory = self._inventory, {}
        whole = [key for key, count in inventory.items() if count >= self.workers]
        # Held by some ranks only: deleted, unless this run wrote (or is writing) it already (an
        # inventory that came after the wait): then the drives hold this run's copy.
        part = [key for key, count in inventory.items() if count < self.workers and not self._on_ssd(key)]
        orders = self.control.recover_ssd(whole, self.clock())
        self.recovered = whole
        if part:
            orders.append(DropOrder(-1, *split_keys(part), 0, Tier.SSD))
        self.active = False
        if inventory:
            log.info("saria: took over %d SSD object(s) the drives hold (%d held by all %d rank(s); %d held by some "
                     "ranks only: deleted)", self.control.counters().recovered, len(whole), self.workers, len(part))
        return orders

    def _on_ssd(self, key: ObjectKey) -> bool:
        info = self.control.chunk_info(key.chunk)
        copy = None if info is None else (info.kv if key.kind == "kv" else info.state)
        return copy is not None and copy.ssd != "absent"
