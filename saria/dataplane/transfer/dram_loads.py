"""The DRAM -> GPU reload path (one dispatcher thread, ``dram`` stream).

Every request's DRAM objects, in submission order, batch by batch (at most ``batch_bytes`` each,
one page table); each host-slot-sized slice waits for the
:class:`~saria.dataplane.transfer.coordinator.Coordinator` (Eq. 4 pacing while SSD reads are runnable),
then is copied into the batch's GPU staging; the batch is unpacked into its pages with
:func:`~saria.kernels.unpack_pages`. On the CPU the slots already are device memory: objects
whose slots are adjacent are unpacked straight from them (no staging copy), the others gathered
into a reused staging; the unpacks run on a second thread, in order, so pacing and staging of
the next batch overlap them as a GPU's copy engines and SMs do.

A serial plan's SSD part is handed to the SSD path once its DRAM part is issued.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from saria.dataplane import nvtx
from saria.dataplane.devices import bind_thread, pool_initializer
from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.dram.staging import StagingPool
from saria.dataplane.transfer.load_job import LoadItem, LoadJob
from saria.dataplane.transfer.results import TransferCounters
from saria.dataplane.transfer.streams import Streams
from saria.dataplane.transfer.tables import log, unpack_run


class DramLoads:
    """The DRAM -> GPU path: :meth:`submit` queues a reload's DRAM objects for the dispatcher
    thread, which starts what the job holds back for after them (a serial plan's SSD reads)."""

    def __init__(self, dram: DramStore, coordinator: Coordinator, streams: Streams, counters: TransferCounters,
                 staging: StagingPool, batch_bytes: int):
        self.dram = dram
        self.coordinator = coordinator
        self.streams = streams
        self.counters = counters
        self.staging = staging
        self.batch_bytes = batch_bytes
        # On the CPU the host slots are device memory: DRAM objects are unpacked straight from them
        # when their slots are contiguous (tests turn this off to exercise the gather path).
        self.zero_copy = streams.device.type == "cpu"
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="saria-dram", daemon=True)
        self._thread.start()
        self._device = ThreadPoolExecutor(1, thread_name_prefix="saria-dram-unpack",
                                          initializer=pool_initializer(streams.device)) \
            if streams.device.type != "cuda" else None

    def submit(self, job: LoadJob, items: list[LoadItem]) -> None:
        """Queue ``job``'s DRAM objects (in plan order) behind every reload submitted before."""
        self._queue.put((job, items))

    def close(self) -> None:
        """Finish the queued reloads and stop the threads."""
        self._queue.put(None)
        self._thread.join()
        if self._device is not None:
            self._device.shutdown(wait=True)  # may still submit a serial plan's SSD reads

    def _loop(self) -> None:
        bind_thread(self.streams.device)
        while True:
            work = self._queue.get()
            if work is None:
                return
            job, items = work
            for batch in self._batches(items):
                self._load_batch(job, batch)
            if job.deferred:  # a serial plan's SSD part starts once its DRAM part is issued
                self._on_device(job.start_deferred)

    def _batches(self, items: list[LoadItem]) -> list[list[LoadItem]]:
        """Cut a reload's items (in plan order) into batches unpacked by one launch each: items of
        one page table, at most ``batch_bytes`` together (at least one item); an item with
        ``skip`` pages goes alone (its staging loses its leading pages before the unpack)."""
        batches: list[list[LoadItem]] = []
        size = 0
        for item in items:
            last = batches[-1] if batches else None
            if last is None or item.skip or last[0].skip or last[0].table is not item.table or \
                    size + item.nbytes > self.batch_bytes:
                batches.append([item])
                size = item.nbytes
            else:
                last.append(item)
                size += item.nbytes
        return batches

    def _load_batch(self, job: LoadJob, batch: list[LoadItem]) -> None:
        """Copy one batch's DRAM objects into staging slice by slice (each slice paced by the
        coordinator), then unpack them with one launch. Never raises: a missing object, or a batch
        whose copy fails, becomes failed objects of the job, never wrong bytes."""
        present = []
        for item in batch:
            obj = self.dram.get(item.key)
            if obj is None:
                self.counters.add(missing_dram_objects=1, load_failures=1)
                job.finish(item, error=LookupError(f"{item.key} is not in DRAM"))
            elif obj.nbytes != item.nbytes:
                self.counters.add(load_failures=1)
                job.finish(item, error=ValueError(f"{item.key} holds {obj.nbytes} bytes, its pages need {item.nbytes}"))
            else:
                present.append((item, obj))
        if not present:
            return
        pending = [item for item, _ in present]
        t0 = time.perf_counter()
        try:
            with self.streams.on("dram"):
                for items, staging, handle in self._stage(job, present):
                    self._on_device(self._unpack_staged, job, items, staging, handle)
                    done = {id(i) for i in items}
                    pending = [i for i in pending if id(i) not in done]
        except Exception as exc:  # staging memory, a copy: what is not unpacked yet fails
            log.warning("DRAM reload of %s failed: %s", [i.key for i in pending], exc)
            self.counters.add(load_failures=len(pending))
            job.finish(pending, error=exc)
        self.counters.add(dram_to_gpu_bytes=sum(obj.nbytes for _, obj in present),
                          dram_to_gpu_seconds=time.perf_counter() - t0)

    def _on_device(self, fn, *args) -> None:
        """Run ``fn`` as the DRAM path's device work. CUDA: now, on the DRAM thread (what it does is
        asynchronous on the ``dram`` stream). CPU: queued, in order, on the DRAM unpack thread, so
        the DRAM thread goes on pacing and staging the next batch while this one is unpacked, as a
        GPU's copy engines and SMs overlap with the host."""
        if self._device is None:
            fn(*args)
        else:
            self._device.submit(fn, *args)

    def _unpack_staged(self, job: LoadJob, items: list[LoadItem], staging: torch.Tensor, handle: object) -> None:
        """Unpack a DRAM run (never raises), then give its staging back."""
        try:
            unpack_run(job, items, staging, "dram", self.streams, self.counters)
        finally:
            self.staging.give(handle)

    def _pace(self, job: LoadJob, nbytes: int) -> float:
        """Wait for the coordinator to release a slice of ``nbytes``; the seconds it held it."""
        with nvtx.nvtx_range(nvtx.PACE_WAIT):
            return self.coordinator.acquire(nbytes)

    def _stage(self, job: LoadJob, present: list[tuple[LoadItem, DramObject]]):
        """Yield ``(items, staging, handle)``: runs of objects whose packed bytes are ``staging``
        back to back on the device, each slice released by the coordinator first.

        On CUDA every object is copied into one device staging per batch (pinned H2D copies on the
        ``dram`` stream, a timeline event per slice). On the CPU the host slots already are device
        memory: objects whose slots follow each other in memory are unpacked straight from them (a
        run of such objects adjacent in memory is one staging), and only the others are gathered
        into a reused staging buffer. Either way each slice waits for the coordinator (Eq. 4)."""
        if self.zero_copy:
            gather = []
            run: list[LoadItem] = []
            run_view, run_bytes = None, 0
            for item, obj in present:
                view = self.dram.contiguous(obj)
                if view is None:
                    gather.append((item, obj))
                    continue
                paced = self._pace_object(job, obj)
                if run and paced:  # while paced, the unpack (the CPU's transfer) follows each object's slices
                    yield run, run_view.as_strided((run_bytes,), (1,)), None
                    run = []
                if run and run_view.data_ptr() + run_bytes == view.data_ptr() and \
                        _within_storage(run_view, run_bytes + obj.nbytes):
                    run.append(item)
                    run_bytes += obj.nbytes
                    continue
                if run:
                    yield run, run_view.as_strided((run_bytes,), (1,)), None
                run, run_view, run_bytes = [item], view, obj.nbytes
            if run:
                yield run, run_view.as_strided((run_bytes,), (1,)), None
            if not gather:
                return
            present = gather
        total = sum(obj.nbytes for _, obj in present)
        handle, staging = self.staging.take(total)
        offset = 0
        for _, obj in present:
            for piece in self.dram.views(obj):
                n = piece.numel()
                self._pace(job, n)
                with nvtx.nvtx_range(nvtx.COPY_H2D):
                    staging[offset:offset + n].copy_(piece, non_blocking=True)
                offset += n
                if job.timed:  # a timing event per slice only when a timeline reads it
                    job.mark("dram", n, self.streams.record("dram", timing=True))
        yield [item for item, _ in present], staging, handle

    def _pace_object(self, job: LoadJob, obj: DramObject) -> bool:
        """A CPU object unpacked from its slots: its slices still go through the coordinator.
        ``True`` while the coordinator paces DRAM traffic (SSD reads are runnable)."""
        for piece in self.dram.views(obj):
            self._pace(job, piece.numel())
            job.mark("dram", piece.numel())
        c = self.coordinator
        return c.ssd_runnable > 0 and (c.mode == "serial" or (c.mode == "coordinated" and c.pacing_enabled))


def _within_storage(view: torch.Tensor, nbytes: int) -> bool:
    return view.storage_offset() + nbytes <= view.untyped_storage().nbytes()
