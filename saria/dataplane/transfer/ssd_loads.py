"""The SSD -> GPU reload path (the SSD store's reader pool, then one ``ssd`` unpack thread and
stream).

A reload's SSD objects travel in batches of at most ``batch_bytes``: a batch's objects are read
with one :meth:`~saria.dataplane.ssd.store.SSDStore.read_many` into one staging (GDS through
kvikio, or POSIX, with O_DIRECT straight into the page-aligned CPU staging), each part verified
against its checksum by the store on the reader thread (a sealed store opens and authenticates it
there instead); the reader that finishes an object hands it to the unpack thread (the one
hand-off), which unpacks every run of arrived objects adjacent in their staging with one launch.
An object whose read failed (I/O, checksum, tag) is never unpacked: its load fails and vLLM
recomputes it.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from saria.dataplane.devices import bind_thread
from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.dram.staging import StagingPool
from saria.dataplane.transfer.load_job import LoadItem, LoadJob
from saria.dataplane.transfer.results import TransferCounters
from saria.dataplane.transfer.streams import Streams
from saria.dataplane.transfer.tables import log, unpack_run
from saria.dataplane.ssd.store import SSDStore


class _SsdBatch:
    """SSD objects of one reload read into one staging, back to back (object ``k`` at the sum of
    the sizes before it); the staging goes back to the pool once every object is unpacked or failed."""

    def __init__(self, job: LoadJob, items: list[LoadItem], t0: float):
        self.job, self.items, self.t0 = job, items, t0
        self.offsets = [0]
        for item in items:
            self.offsets.append(self.offsets[-1] + item.nbytes)
        self.staging: torch.Tensor | None = None
        self.handle: object = None
        self._left = len(items)
        self._lock = threading.Lock()

    def row(self, k: int) -> torch.Tensor:
        return self.staging[self.offsets[k]:self.offsets[k + 1]]

    def span(self, start: int, stop: int) -> torch.Tensor:
        return self.staging[self.offsets[start]:self.offsets[stop]]

    def runs(self, ks: list[int]) -> list[tuple[int, int]]:
        """Sorted object indices cut into ``[start, stop)`` runs of consecutive objects of one page
        table and form (one unpack launch each); an object with skipped pages is a run of its own."""
        runs: list[tuple[int, int]] = []
        for k in ks:
            item = self.items[k]
            first = self.items[runs[-1][0]] if runs else None
            if first is not None and runs[-1][1] == k and not item.skip and not first.skip and \
                    first.table is item.table and first.quantized == item.quantized:
                runs[-1] = (runs[-1][0], k + 1)
            else:
                runs.append((k, k + 1))
        return runs

    def release(self, n: int) -> bool:
        """``n`` more objects are done with the staging; ``True`` once all are."""
        with self._lock:
            self._left -= n
            return self._left == 0


class SsdLoads:
    """The SSD -> GPU path: :meth:`submit` starts a reload's SSD reads; the unpack thread lands
    them. ``ssd`` may be ``None`` (an engine without an SSD store never submits)."""

    def __init__(self, ssd: SSDStore | None, coordinator: Coordinator, streams: Streams, counters: TransferCounters,
                 staging: StagingPool, batch_bytes: int):
        self.ssd = ssd
        self.coordinator = coordinator
        self.streams = streams
        self.counters = counters
        self.staging = staging
        self.batch_bytes = batch_bytes
        self._cond = threading.Condition()
        self._inflight = 0  # SSD objects submitted and not yet unpacked or failed
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._unpack_loop, name="saria-ssd-unpack", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob, items: list[LoadItem]) -> None:
        """Start reading ``items`` from SSD: per batch of at most ``batch_bytes``, one staging and
        one ``read_many`` submission. Never raises (``load()`` calls it after other reads of the job
        may have started): an object that cannot be started is a failed object."""
        batch: list[LoadItem] = []
        size = 0
        for item in items:
            if batch and size + item.nbytes > self.batch_bytes:
                self._submit_batch(job, batch)
                batch, size = [], 0
            batch.append(item)
            size += item.nbytes
        if batch:
            self._submit_batch(job, batch)

    def close(self) -> None:
        """Let the reads in flight land (they call back into the unpack thread), then stop it."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)
        self._queue.put(None)
        self._thread.join()

    def _submit_batch(self, job: LoadJob, items: list[LoadItem]) -> None:
        self.coordinator.ssd_begin(len(items))
        with self._cond:
            self._inflight += len(items)
        batch = _SsdBatch(job, items, time.perf_counter())
        try:
            with self.streams.on("ssd"):  # reads wait for this stream: earlier unpacks of reused memory
                batch.handle, batch.staging = self.staging.take(sum(i.nbytes for i in items))
                rows = [batch.row(k) for k in range(len(items))]
                futures = self.ssd.read_many([object_key(i.key.chunk, i.key.kind) for i in items], rows)
        except Exception as exc:  # no memory for staging, store closed: every object of the batch fails
            for k in range(len(items)):
                self._arrived(batch, k, exc)
            return
        for k, future in enumerate(futures):
            if isinstance(future, BaseException):  # not found, refused: this object fails
                self._arrived(batch, k, future)
            else:
                future.add_done_callback(lambda f, k=k: self._arrived(batch, k, f.exception()))

    def _arrived(self, batch: _SsdBatch, k: int, error: BaseException | None) -> None:
        """Object ``k`` of ``batch`` is read and verified (or failed): on the reader thread that
        finished it, the one hand-off, to the unpack thread."""
        self.coordinator.ssd_end()
        item = batch.items[k]
        if error is None:
            self.counters.add(ssd_to_gpu_bytes=item.nbytes, ssd_to_gpu_seconds=time.perf_counter() - batch.t0)
            batch.job.mark("ssd", item.nbytes)
        self._queue.put((batch, k, error))

    def _unpack_loop(self) -> None:
        """The SSD unpack thread: takes every object that has arrived, and unpacks each run of
        them adjacent in one batch's staging (same page table) with one launch."""
        bind_thread(self.streams.device)
        while True:
            work = [self._queue.get()]
            while True:
                try:
                    work.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in work
            arrived: dict[int, tuple[_SsdBatch, list[int]]] = {}
            for entry in work:
                if entry is None:
                    continue
                batch, k, error = entry
                if error is not None:
                    log.warning("SSD reload of %s failed: %s", batch.items[k].key, error)
                    self.counters.add(load_failures=1)
                    batch.job.finish(batch.items[k], error=error)
                    self._release(batch, 1)
                else:
                    arrived.setdefault(id(batch), (batch, []))[1].append(k)
            for batch, ks in arrived.values():
                try:
                    for start, stop_k in batch.runs(sorted(ks)):
                        items = list(batch.items[start:stop_k])
                        unpack_run(batch.job, items, batch.span(start, stop_k), "ssd", self.streams, self.counters)
                finally:
                    self._release(batch, len(ks))
            done = len(work) - (1 if stop else 0)
            with self._cond:
                self._inflight -= done
                self._cond.notify_all()
            if stop:
                return

    def _release(self, batch: _SsdBatch, n: int) -> None:
        if batch.release(n):
            self.staging.give(batch.handle)
