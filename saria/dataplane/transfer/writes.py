"""The DRAM/GPU -> SSD path (the SSD store's writer pool): write orders from DRAM slots (no copy,
their checksums computed at pack time) or, for write-through, from GPU staging packed on the
packer's offload thread and then held by the store until written. An order's ``released`` event is
set at once for DRAM-source writes, once its pages are packed for GPU-source ones.

Under ``ssd_dtype="fp8"`` a kv object goes to SSD in its FP8 form: packed so by the quantizing
kernel from the pages, or quantized from its DRAM copy on the offload thread (not the caller's:
the caller is the engine's step); its part checksums are those of the stored bytes."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Hashable, Mapping

import torch

from saria.orders import ObjectKey, Tier, WriteOrder
from saria.kernels import quantize_staging

from saria.dataplane.dram.store import DramStore
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.packing import Objects, Packer
from saria.dataplane.transfer.results import Completion, TransferCounters
from saria.dataplane.transfer.tables import Blocks, Tables, log


class Writes:
    """SSD writes of an engine's objects, from DRAM slots or packed from its pages."""

    def __init__(self, packer: Packer, tables: Tables, dram: DramStore, ssd: SSDStore | None,
                 counters: TransferCounters):
        self.packer = packer
        self.tables = tables
        self.dram = dram
        self.ssd = ssd
        self.counters = counters
        # DRAM copies cannot go to SSD slot by slot: their kv objects are quantized first, or SSD
        # parts are not host slots (fp8 sizes them for the smaller objects)
        self._recode = ssd is not None and (tables.ssd_dtype != "auto" or ssd.part_bytes != packer.host_pool.slot_bytes)

    def write(self, order: WriteOrder, kv_blocks: Mapping[Hashable, Blocks], state_blocks: Mapping[Hashable, Blocks],
              prepacked: Mapping[ObjectKey, torch.Tensor], released: threading.Event) -> "Future[Completion]":
        """Write the order's objects to SSD from their DRAM slots (``released`` at once) or, for a
        GPU source, packed on the offload thread. ``ValueError`` for any other source."""
        result: Future = Future()
        keys = order.keys()
        if order.source is Tier.DRAM:
            released.set()
            if self._recode:  # quantizing or copying takes time: on the offload thread
                self.packer.pool.submit(self._write_all_from_dram, order, keys, result)
            else:
                self._write_all_from_dram(order, keys, result)
        elif order.source is Tier.GPU:
            objects = self.packer.resolve(order, kv_blocks, state_blocks, prepacked)
            self.packer.submit(self._pack_and_write, order, objects, released, keys, result)
        else:
            raise ValueError(f"write order {order.order_id} has source {order.source}; expected DRAM or GPU")
        return result

    def _pack_and_write(self, order: WriteOrder, objects: Objects, ready, released: threading.Event,
                        keys: list[ObjectKey], result: Future) -> None:
        """On the offload thread: pack the order's objects (one launch per kind), let the pages go,
        then hand each object's staging to the SSD store (which holds it until written)."""
        try:
            with self.packer.streams.on("offload"):
                self.packer.streams.wait(None, ready)  # the offload stream (current here) follows the caller's work
                packed = self.packer.pack(objects, for_ssd=True)
                self.packer.packed_on_device("offload")
                released.set()
                futures = [error if error is not None else self._write_staging(key, staging)
                           for key, staging, error in packed]
            self._gather_writes(order, keys, futures, result)
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            raise
        finally:
            released.set()

    def _write_all_from_dram(self, order: WriteOrder, keys: list[ObjectKey], result: Future) -> None:
        """Write each object of the order from its DRAM copy (the control plane keeps the copies
        until the order completes)."""
        try:
            self._gather_writes(order, keys, [self._write_from_dram(key) for key in keys], result)
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            raise

    def _write_from_dram(self, key: ObjectKey) -> Future | BaseException:
        """One object from its DRAM copy: straight from its slots, or, when SSD parts are not host
        slots, from one buffer of the form the SSD stores (a kv object quantized)."""
        obj = self.dram.get(key)
        if obj is None:
            self.counters.add(missing_dram_objects=1)
            return LookupError(f"{key} is not in DRAM")
        try:
            if not self._recode:
                return self.ssd.write(object_key(key.chunk, key.kind), self.dram.views(obj), obj.checksums)
            raw = self.dram.contiguous(obj)
            if raw is None:
                raw = torch.cat(self.dram.views(obj))
            data = self._quantized(raw) if self.tables.quantized(key.kind) else raw
        except Exception as exc:  # store full, closed
            return exc
        return self._write_staging(key, data)

    def _quantized(self, raw: torch.Tensor) -> torch.Tensor:
        """A DRAM copy's FP8 form, encoded on the engine's device: on a GPU one copy up from the
        pinned slots, then the encoding on the ``offload`` stream (the store then writes from the
        device, by GDS where it can); on a CPU in place (torch: ~20 ms per million elements)."""
        with self.packer.streams.on("offload"):
            data = quantize_staging(raw.to(self.tables.device, non_blocking=True), self.tables.kv_dtype)
        self.packer.packed_on_device("offload")  # the FP8 bytes exist before the store reads them
        return data

    def _write_staging(self, key: ObjectKey, staging: torch.Tensor) -> Future | BaseException:
        try:  # a sealed store's tags replace the checksums: no pass over the bytes for them
            sums = None if self.ssd.sealed else self.packer.part_checksums(staging, self.ssd.part_bytes)
            # the store holds the staging tensor until the write is done
            return self.ssd.write(object_key(key.chunk, key.kind), staging, sums)
        except Exception as exc:
            return exc

    def _gather_writes(self, order: WriteOrder, keys: list[ObjectKey], futures: list, result: Future) -> None:
        state = {"left": len(futures), "failed": []}
        lock = threading.Lock()

        def one_done(key: ObjectKey, error: BaseException | None, nbytes: int) -> None:
            with lock:
                if error is not None:
                    log.warning("SSD write of %s failed: %s", key, error)
                    state["failed"].append(key)
                    self.counters.add(ssd_write_failures=1)
                else:
                    self.counters.add(ssd_write_bytes=nbytes)
                state["left"] -= 1
                finished = state["left"] == 0
            if finished:
                result.set_result(Completion.of(order.order_id, len(keys), state["failed"]))

        if not futures:
            result.set_result(Completion(order.order_id, True))
        for key, future in zip(keys, futures):
            nbytes = self.tables.ssd_bytes(key.kind)  # the bytes the SSD stores
            if isinstance(future, BaseException):
                one_done(key, future, nbytes)
            else:
                future.add_done_callback(lambda f, k=key, n=nbytes: one_done(k, f.exception(), n))
