"""The offload paths: GPU -> DRAM stores and promotions, DRAM/GPU -> SSD writes, SSD -> DRAM prewarms.

* **GPU -> DRAM** (``offload`` thread and stream): store and promotion orders pack pages with
  :func:`~saria.kernels.pack_pages` (one launch per object kind per order), checksum each
  host-slot-sized part on the GPU, and copy into freshly allocated host slots; the objects are
  published in the :class:`~saria.dataplane.dram.store.DramStore` once the copies landed.
* **DRAM/GPU -> SSD** (the SSD store's writer pool): write orders, from DRAM slots (no copy, their
  checksums computed at pack time) or, for write-through, from freshly packed GPU staging (packed
  on the ``offload`` thread and stream, then held by the store until written).

* **SSD -> DRAM** (``prewarm`` thread): a prewarm (:class:`~saria.orders.PromoteOrder` with
  ``source=Tier.SSD``) reads each object's SSD copy, verified by the store like every SSD read,
  straight into freshly allocated host slots (one SSD part is one host slot), checksums the slots
  and publishes the object once it is whole; an object that cannot be read fails alone.

An order's ``released`` event is set once its source pages are no longer read: after the pack of
every object has run on the device (at once for DRAM-source writes), or when the order fails or
the engine closes.

The packs look :func:`pack_pages` up in this module at run time: tests and the vLLM session
runner replace ``saria.dataplane.transfer.offload.pack_pages`` to slow or gate them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable, Mapping

import torch

from saria.orders import KV, STATE, ObjectKey, Order, PromoteOrder, StoreOrder, Tier, WriteOrder
from saria.kernels import checksum, pack_pages

from saria.dataplane import nvtx
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.dram.host_pool import HostPool, HostPoolFull
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.transfer.paths import Blocks, Completion, Counters, Streams, Tables, log
from saria.dataplane.ssd.store import SSDStore

# (key, block ids, prepacked staging) per object of an order: see Offload.resolve
Objects = list[tuple[ObjectKey, "torch.Tensor | None", "torch.Tensor | None"]]


class Offload:
    """Stores, promotions and writes, each order packed and copied on the one offload thread
    (``pool``) in submission order."""

    def __init__(self, tables: Tables, host_pool: HostPool, dram: DramStore, ssd: SSDStore | None, streams: Streams,
                 counters: Counters):
        self.tables = tables
        self.host_pool = host_pool
        self.dram = dram
        self.ssd = ssd
        self.streams = streams
        self.counters = counters
        self.device = tables.device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="saria-offload")
        self.prewarm_pool = ThreadPoolExecutor(1, thread_name_prefix="saria-prewarm")

    def close(self) -> None:
        """Finish the queued orders and stop the offload and prewarm threads."""
        self.pool.shutdown(wait=True)
        self.prewarm_pool.shutdown(wait=True)

    # --- GPU -> DRAM: store and promote ----------------------------------------------------------

    def store(self, order: StoreOrder | PromoteOrder, kv_blocks: Mapping[Hashable, Blocks],
              state_blocks: Mapping[Hashable, Blocks], prepacked: Mapping[ObjectKey, torch.Tensor],
              released: threading.Event) -> "Future[Completion]":
        """Queue the order's pack and copy into host slots, after the caller's queued work (CUDA)."""
        objects = self.resolve(order, kv_blocks, state_blocks, prepacked)
        ready = self.streams.caller_event()
        try:
            return self.pool.submit(self._run_store, order, objects, ready, released)
        except RuntimeError:  # the pool shut down under us: the engine is closing
            released.set()
            raise

    def _run_store(self, order: Order, objects: Objects, ready, released: threading.Event) -> Completion:
        failed = []
        stored: list[tuple[ObjectKey, DramObject]] = []  # slots taken, not yet owned by the DRAM store
        try:
            with self.streams.on("offload"):
                self.streams.wait(None, ready)  # the offload stream (current here) follows the caller's work
                t0 = time.perf_counter()
                packed = self._pack_objects(objects)
                self._packed_on_device("offload")
                released.set()
                for key, staging, error in packed:
                    slots = None
                    try:
                        if error is not None:
                            raise error
                        sums = self._part_checksums(staging)
                        slots = self.host_pool.allocate(self.host_pool.slots_for(staging.numel()))
                        self._copy_to_slots(staging, slots)
                    except Exception as exc:
                        if slots is not None:  # copies into them may be queued: let them land first
                            self._settle("offload")
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
                self.streams.synchronize("offload")  # the slots hold the bytes before the objects are published
            nbytes = sum(obj.nbytes for _, obj in stored)
            while stored:  # each object's slots pass to the DRAM store as it is published
                self.dram.put(*stored[0])
                stored.pop(0)
            self.counters.add(gpu_to_dram_bytes=nbytes, gpu_to_dram_seconds=time.perf_counter() - t0)
        except BaseException:
            self._settle("offload")
            for _, obj in stored:  # not published: give the slots back
                self.host_pool.free(obj.slots)
            raise
        finally:
            released.set()
        ok = len(failed) < len(objects) or not objects
        return Completion(order.order_id, ok, tuple(failed) if ok else ())

    def _copy_to_slots(self, staging: torch.Tensor, slots: list[int]) -> None:
        """Queue the copy of one object's staging into its host slots on the current stream."""
        offset = 0
        with nvtx.nvtx_range(nvtx.COPY_D2H):
            for piece in self.host_pool.views(slots, staging.numel()):
                piece.copy_(staging[offset:offset + piece.numel()], non_blocking=True)
                offset += piece.numel()

    def _settle(self, stream_name: str) -> None:
        """Wait for what is queued on a stream before its memory is given back (failure paths:
        never raises; a device that cannot even synchronize has bigger problems to report)."""
        try:
            self.streams.synchronize(stream_name)
        except Exception as exc:
            log.warning("synchronizing the %s stream failed: %s", stream_name, exc)

    # --- SSD -> DRAM: prewarm --------------------------------------------------------------------

    def prewarm(self, order: PromoteOrder) -> "Future[Completion]":
        """Queue a prewarm: read the order's objects from SSD into new host slots (no GPU work)."""
        if order.source is not Tier.SSD:
            raise ValueError(f"prewarm() takes a PromoteOrder with source=Tier.SSD, got source={order.source}")
        if self.ssd is None:
            raise ValueError("a prewarm reads SSD, and this engine has no SSD store")
        return self.prewarm_pool.submit(self._run_prewarm, order)

    def _run_prewarm(self, order: PromoteOrder) -> Completion:
        failed = []
        keys = [ObjectKey(chunk, KV) for chunk in order.kv] + [ObjectKey(chunk, STATE) for chunk in order.state]
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

    # --- DRAM/GPU -> SSD: writes -----------------------------------------------------------------

    def write(self, order: WriteOrder, kv_blocks: Mapping[Hashable, Blocks], state_blocks: Mapping[Hashable, Blocks],
              prepacked: Mapping[ObjectKey, torch.Tensor], released: threading.Event) -> "Future[Completion]":
        """Write the order's objects to SSD from their DRAM slots (``released`` at once) or, for a
        GPU source, packed on the offload thread. ``ValueError`` for any other source."""
        result: Future = Future()
        keys = [ObjectKey(c, KV) for c in order.kv] + [ObjectKey(c, STATE) for c in order.state]
        if order.source is Tier.DRAM:
            released.set()
            futures = [self._write_from_dram(key) for key in keys]
            self._gather_writes(order, keys, futures, result)
        elif order.source is Tier.GPU:
            objects = self.resolve(order, kv_blocks, state_blocks, prepacked)
            ready = self.streams.caller_event()
            try:
                self.pool.submit(self._pack_and_write, order, keys, objects, ready, released, result)
            except RuntimeError:  # the engine is closing
                released.set()
                raise
        else:
            raise ValueError(f"write order {order.order_id} has source {order.source}; expected DRAM or GPU")
        return result

    def _pack_and_write(self, order: WriteOrder, keys: list[ObjectKey], objects: Objects, ready,
                        released: threading.Event, result: Future) -> None:
        """On the offload thread: pack the order's objects (one launch per kind), let the pages go,
        then hand each object's staging to the SSD store (which holds it until written)."""
        try:
            with self.streams.on("offload"):
                self.streams.wait(None, ready)  # the offload stream (current here) follows the caller's work
                packed = self._pack_objects(objects)
                self._packed_on_device("offload")
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

    def _write_from_dram(self, key: ObjectKey) -> Future | BaseException:
        obj = self.dram.get(key)
        if obj is None:
            self.counters.add(missing_dram_objects=1)
            return LookupError(f"{key} is not in DRAM")
        try:
            return self.ssd.write(object_key(key.chunk, key.kind), self.dram.views(obj), obj.checksums)
        except Exception as exc:  # store full, closed
            return exc

    def _write_staging(self, key: ObjectKey, staging: torch.Tensor) -> Future | BaseException:
        try:
            sums = self._part_checksums(staging)
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
                failed = state["failed"]
                ok = len(failed) < len(keys) or not keys
                result.set_result(Completion(order.order_id, ok, tuple(failed) if ok else ()))

        if not futures:
            result.set_result(Completion(order.order_id, True))
        for key, future in zip(keys, futures):
            nbytes = self.tables.table(key.kind)[2]
            if isinstance(future, BaseException):
                one_done(key, future, nbytes)
            else:
                future.add_done_callback(lambda f, k=key, n=nbytes: one_done(k, f.exception(), n))

    # --- packing ---------------------------------------------------------------------------------

    def capture(self, ids: torch.Tensor) -> torch.Tensor:
        """Pack one state object's pages now, on the caller's thread and current stream."""
        with nvtx.nvtx_range(nvtx.PACK):
            return pack_pages(self.tables.state_table, ids)

    def resolve(self, order: Order, kv_blocks: Mapping[Hashable, Blocks], state_blocks: Mapping[Hashable, Blocks],
                prepacked: Mapping[ObjectKey, torch.Tensor]) -> Objects:
        """(key, block ids, prepacked staging) per object of ``order``: exactly one of the two is
        set, or neither when the caller has no copy of a prepacked-only object (it then fails)."""
        out = []
        for kind, chunks, blocks in ((KV, order.kv, kv_blocks), (STATE, order.state, state_blocks)):
            for chunk in chunks:
                key = ObjectKey(chunk, kind)
                staging = prepacked.get(key)
                if staging is not None:
                    _, _, nbytes = self.tables.table(kind)
                    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 or \
                            staging.numel() != nbytes or staging.device != self.device:
                        raise ValueError(f"prepacked {key} must be {nbytes} uint8 bytes on {self.device}")
                    out.append((key, None, staging.reshape(-1)))
                elif chunk in blocks or not prepacked:
                    out.append((key, self.tables.ids(kind, chunk, blocks.get(chunk)), None))
                else:
                    out.append((key, None, None))
        return out

    def _pack_objects(self, objects: Objects) -> list[tuple[ObjectKey, torch.Tensor | None, BaseException | None]]:
        """Pack the objects of one order into GPU staging, on the current stream: one pack launch
        per object kind over the block ids of all its objects (the staging of a batch is the
        concatenation of the objects' packed bytes, one row each). Prepacked objects are used as
        is. Returns ``(key, staging, error)`` per object, in order; an object whose pages cannot be
        packed (or with neither pages nor a packed copy) has an error instead of a staging."""
        out: list = [None] * len(objects)
        for kind in (KV, STATE):
            batch = [(n, ids) for n, (key, ids, packed) in enumerate(objects) if key.kind == kind and ids is not None]
            if not batch:
                continue
            table, _, _ = self.tables.table(kind)
            try:
                with nvtx.nvtx_range(nvtx.PACK):
                    rows = pack_pages(table, torch.stack([ids for _, ids in batch]))
                for (n, _), row in zip(batch, rows):
                    out[n] = (objects[n][0], row, None)
            except Exception:  # one bad object: pack them one by one to name it
                for n, ids in batch:
                    try:
                        with nvtx.nvtx_range(nvtx.PACK):
                            out[n] = (objects[n][0], pack_pages(table, ids), None)
                    except Exception as exc:
                        out[n] = (objects[n][0], None, exc)
        for n, (key, ids, packed) in enumerate(objects):
            if ids is None:
                error = None if packed is not None else LookupError(
                    f"{key}: neither its pages nor a packed copy were given")
                out[n] = (key, packed, error)
        return out

    def _part_checksums(self, staging: torch.Tensor) -> tuple[int, ...]:
        """Checksums of an object's parts (one part = one host slot = one SSD part)."""
        part = self.host_pool.slot_bytes
        with nvtx.nvtx_range(nvtx.VERIFY):
            return tuple(checksum(staging[o:o + part]) for o in range(0, staging.numel(), part))

    def _packed_on_device(self, stream_name: str) -> None:
        """Block until the packs queued on ``stream_name`` have run (CUDA): the pages are free."""
        self.streams.record(stream_name).synchronize()
