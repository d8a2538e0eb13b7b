"""The SSD -> DRAM path (``prewarm`` thread): a prewarm (:class:`~saria.orders.PromoteOrder` with
``source=Tier.SSD``) reads each object's SSD copy, verified by the store like every SSD read,
straight into freshly allocated host slots (one SSD part is one host slot), checksums the slots
and publishes the object once it is whole; an object that cannot be read fails alone. No GPU work.
A kv object stored in its FP8 form (``ssd_dtype="fp8"``) is read into a buffer of its own and
dequantized into the slots: DRAM holds what the cache holds."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from saria.orders import ObjectKey, PromoteOrder, Tier
from saria.kernels import checksum, dequantize_staging

from saria.dataplane import nvtx
from saria.dataplane.devices import pool_initializer
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
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="saria-prewarm",
                                       initializer=pool_initializer(tables.device))

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
                _, _, nbytes = self.tables.table(key.kind)
                expected = self.tables.ssd_bytes(key.kind)
                ssd_key = object_key(key.chunk, key.kind)
                info = self.ssd.info(ssd_key)
                if info is None:
                    raise LookupError(f"{key} is not on SSD")
                if info.length != expected:
                    raise ValueError(f"{key} is {info.length} bytes on SSD, {expected} expected")
                slots = self.host_pool.allocate(self.host_pool.slots_for(nbytes))
                views = self.host_pool.views(slots, nbytes)
                if self.tables.quantized(key.kind) or self.ssd.part_bytes != self.host_pool.slot_bytes:
                    self._read_recoded(key, ssd_key, info.length, views)
                else:  # verified against its checksums by the store
                    self.ssd.read(ssd_key, views).result()
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
            self.dram.put(key, DramObject(slots, nbytes, sums))
            landed += info.length
        self.counters.add(ssd_to_dram_bytes=landed, ssd_to_dram_seconds=time.perf_counter() - t0)
        return Completion.of(order.order_id, len(keys), failed)

    def _read_recoded(self, key: ObjectKey, ssd_key: bytes, length: int, views: list[torch.Tensor]) -> None:
        """Read an object whose SSD parts are not host slots (its FP8 form, or parts of another
        size) into a buffer of its own, verified by the store, then into ``views`` (dequantized)."""
        stored = torch.empty(length, dtype=torch.uint8)
        self.ssd.read(ssd_key, stored).result()
        raw = dequantize_staging(stored, self.tables.kv_dtype) if self.tables.quantized(key.kind) else stored
        offset = 0
        for view in views:
            view.copy_(raw[offset:offset + view.numel()])
            offset += view.numel()
