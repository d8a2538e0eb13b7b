"""The SSD -> DRAM path (``prewarm`` thread): a prewarm (:class:`~saria.orders.PromoteOrder` with
``source=Tier.SSD``) reads each object's SSD copy, verified by the store like every SSD read,
straight into freshly allocated host slots (one SSD part is one host slot), checksums the slots
and publishes the object once it is whole; an object that cannot be read fails alone. No GPU work."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from saria.orders import PromoteOrder, Tier
from saria.kernels import checksum

from saria.dataplane import nvtx
from saria.dataplane.dram.host_pool import HostPool, HostPoolFull
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.results import Completion, TransferCounters
from saria.dataplane.transfer.tables import Tables, log


class Prewarms:
    """Prewarms, one order after the other on their own thread."""

    def __init__(self, tables: Tables, host_pool: HostPool, dram: DramStore, ssd: SSDStore | None,
                 counters: TransferCounters):
        self.tables = tables
        self.host_pool = host_pool
        self.dram = dram
        self.ssd = ssd
        self.counters = counters
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="saria-prewarm")

    def close(self) -> None:
        """Finish the queued prewarms and stop the thread."""
        self.pool.shutdown(wait=True)

    def prewarm(self, order: PromoteOrder) -> "Future[Completion]":
        """Queue a prewarm: read the order's objects from SSD into new host slots (no GPU work)."""
        if order.source is not Tier.SSD:
            raise ValueError(f"prewarm() takes a PromoteOrder with source=Tier.SSD, got source={order.source}")
        if self.ssd is None:
            raise ValueError("a prewarm reads SSD, and this engine has no SSD store")
        return self.pool.submit(self._run_prewarm, order)

    def _run_prewarm(self, order: PromoteOrder) -> Completion:
        failed = []
        keys = order.keys()
        t0 = time.perf_counter()
        landed = 0
        for key in keys:
            slots = None
            try:
                _, _, expected = self.tables.table(key.kind)
                ssd_key = object_key(key.chunk, key.kind)
                info = self.ssd.info(ssd_key)
                if info is None:
                    raise LookupError(f"{key} is not on SSD")
                if info.length != expected:
                    raise ValueError(f"{key} is {info.length} bytes on SSD, {expected} expected")
                slots = self.host_pool.allocate(self.host_pool.slots_for(info.length))
                views = self.host_pool.views(slots, info.length)
                self.ssd.read(ssd_key, views).result()  # verified against its checksums by the store
                with nvtx.nvtx_range(nvtx.VERIFY):
                    sums = tuple(checksum(view) for view in views)
            except Exception as exc:
                if slots is not None:
                    self.host_pool.free(slots)
                if isinstance(exc, HostPoolFull):
                    self.counters.add(host_pool_full=1)
                log.warning("prewarming %s failed: %s", key, exc)
                self.counters.add(prewarm_failures=1)
                failed.append(key)
                continue
            self.dram.put(key, DramObject(slots, info.length, sums))
            landed += info.length
        self.counters.add(ssd_to_dram_bytes=landed, ssd_to_dram_seconds=time.perf_counter() - t0)
        ok = len(failed) < len(keys) or not keys
        return Completion(order.order_id, ok, tuple(failed) if ok else ())
