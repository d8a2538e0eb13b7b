"""The GPU -> DRAM path (``offload`` thread and stream): store and promotion orders packed with
:func:`~saria.kernels.pack_pages` (one launch per object kind per order), checksummed per
host-slot-sized part on the GPU and copied into freshly allocated host slots; the objects are
published in the :class:`~saria.dataplane.dram.store.DramStore` once the copies landed. An order's
``released`` event is set once its pages are packed (or it failed, or the engine closes)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Hashable, Mapping

import torch

from saria.orders import ObjectKey, Order, PromoteOrder, StoreOrder

from saria.dataplane import nvtx
from saria.dataplane.dram.host_pool import HostPool, HostPoolFull
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.transfer.packing import Objects, Packer
from saria.dataplane.transfer.results import Completion, TransferCounters
from saria.dataplane.transfer.tables import Blocks, log


class Stores:
    """Stores and promotions from HBM, each packed and copied on the packer's offload thread."""

    def __init__(self, packer: Packer, host_pool: HostPool, dram: DramStore, counters: TransferCounters):
        self.packer = packer
        self.host_pool = host_pool
        self.dram = dram
        self.counters = counters

    def store(self, order: StoreOrder | PromoteOrder, kv_blocks: Mapping[Hashable, Blocks],
              state_blocks: Mapping[Hashable, Blocks], prepacked: Mapping[ObjectKey, torch.Tensor],
              released: threading.Event) -> "Future[Completion]":
        """Queue the order's pack and copy into host slots, after the caller's queued work (CUDA)."""
        objects = self.packer.resolve(order, kv_blocks, state_blocks, prepacked)
        return self.packer.submit(self._run_store, order, objects, released)

    def _run_store(self, order: Order, objects: Objects, ready, released: threading.Event) -> Completion:
        failed = []
        stored: list[tuple[ObjectKey, DramObject]] = []  # slots taken, not yet owned by the DRAM store
        try:
            with self.packer.streams.on("offload"):
                self.packer.streams.wait(None, ready)  # the offload stream (current here) follows the caller's work
                t0 = time.perf_counter()
                packed = self.packer.pack(objects)
                self.packer.packed_on_device("offload")
                released.set()
                for key, staging, error in packed:
                    slots = None
                    try:
                        if error is not None:
                            raise error
                        sums = self.packer.part_checksums(staging)
                        slots = self.host_pool.allocate(self.host_pool.slots_for(staging.numel()))
                        self._copy_to_slots(staging, slots)
                    except Exception as exc:
                        if slots is not None:  # copies into them may be queued: let them land first
                            self.packer.settle("offload")
                            self.host_pool.free(slots)
                        if isinstance(exc, HostPoolFull):
                            log.warning("host pool full: %s not stored (%s)", key, exc)
                            self.counters.add(host_pool_full=1, store_failures=1)
                        else:
                            log.warning("storing %s failed: %s", key, exc)
                            self.counters.add(store_failures=1)
                        failed.append(key)
                        continue
                    stored.append((key, DramObject(slots, staging.numel(), sums)))
                self.packer.streams.synchronize("offload")  # the slots hold the bytes before the objects are published
            nbytes = sum(obj.nbytes for _, obj in stored)
            while stored:  # each object's slots pass to the DRAM store as it is published
                self.dram.put(*stored[0])
                stored.pop(0)
            self.counters.add(gpu_to_dram_bytes=nbytes, gpu_to_dram_seconds=time.perf_counter() - t0)
        except BaseException:
            self.packer.settle("offload")
            for _, obj in stored:  # not published: give the slots back
                self.host_pool.free(obj.slots)
            raise
        finally:
            released.set()
        return Completion.of(order.order_id, len(objects), failed)

    def _copy_to_slots(self, staging: torch.Tensor, slots: list[int]) -> None:
        """Queue the copy of one object's staging into its host slots on the current stream."""
        offset = 0
        with nvtx.nvtx_range(nvtx.COPY_D2H):
            for piece in self.host_pool.views(slots, staging.numel()):
                piece.copy_(staging[offset:offset + piece.numel()], non_blocking=True)
                offset += piece.numel()
