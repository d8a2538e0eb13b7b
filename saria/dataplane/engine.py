"""The transfer engine: executes the control plane's plans and orders against an engine's paged
KV cache, the host pool (DRAM tier) and the SSD store, on separate queues.

Paths, each on its own thread and (on CUDA) its own stream. The data plane costs bytes, not
objects: a reload's objects travel in batches (at most ``batch_bytes`` each, one page table), each
batch landing in one staging (the objects' packed bytes back to back, which is exactly what
:func:`~saria.kernels.pack_pages` makes for a 2-D ``[objects, pages]`` id tensor) and unpacked by
one launch; stores and writes pack every object of an order with one launch per object kind.

* **DRAM -> GPU** (one dispatcher thread, ``dram`` stream): every request's DRAM objects, in
  submission order, batch by batch; each host-slot-sized slice waits for the
  :class:`~saria.dataplane.coordinator.Coordinator` (Eq. 4 pacing while SSD reads are runnable),
  then is copied into the batch's GPU staging; the batch is unpacked into its pages with
  :func:`~saria.kernels.unpack_pages`. On the CPU the slots already are device memory: objects
  whose slots are adjacent are unpacked straight from them (no staging copy), the others gathered
  into a reused staging; the unpacks run on a second thread, in order, so pacing and staging of
  the next batch overlap them as a GPU's copy engines and SMs do.
* **SSD -> GPU** (the SSD store's reader pool, then one ``ssd`` unpack thread and stream): a
  batch's objects are read with one :meth:`~saria.dataplane.ssd_store.SSDStore.read_many` into
  one staging (GDS through kvikio, or POSIX, with O_DIRECT straight into the page-aligned CPU
  staging), each part verified against its checksum by the store on the reader thread; the
  reader that finishes an object hands it to the unpack thread (the one hand-off), which
  unpacks every run of arrived objects adjacent in their staging with one launch.
* **GPU -> DRAM** (``offload`` thread and stream): store and promotion orders pack pages with
  :func:`~saria.kernels.pack_pages`, checksum each host-slot-sized part on the GPU, and copy into
  freshly allocated host slots.
* **DRAM/GPU -> SSD** (the SSD store's writer pool): write orders, from DRAM slots or, for
  write-through, from freshly packed GPU staging.

Nothing here decides anything: the engine moves what it is told and reports back. Loads return a
:class:`LoadJob` whose result names the objects that failed (for ``commit_prefill(failed=...)``);
:meth:`TransferEngine.execute` runs a list of orders and returns an :class:`OrderRun` per order:
its ``Future[Completion]`` (for ``ControlPlane.complete``) and its ``released`` event (the source
pages may be reused). The caller ferries results and completions to the control plane, which may
live in another process (vLLM's scheduler). The DRAM index is a :class:`DramStore`; reload jobs
live in ``load_job``.

On a machine without CUDA the same code runs with CPU tensors: copies are synchronous and there
are no streams, but every thread, queue, batch, pacing decision and verification is the same
(plus the CPU's zero-copy DRAM unpack and its DRAM unpack thread, which stand in for the GPU's
asynchronous copies and launches).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Hashable, Iterable, Mapping, Sequence

import torch

from saria.orders import KV, STATE, DropOrder, ObjectKey, Order, PromoteOrder, ReloadPlan, StoreOrder, Tier, \
    WriteOrder
from saria.kernels import PageTable, checksum, drop_leading_pages, pack_pages, unpack_pages

from . import nvtx
from .coordinator import Coordinator
from .dram_store import DramObject, DramStore
from .host_pool import HostPool, HostPoolFull
from .keys import object_key
from .load_job import LoadItem, LoadJob, LoadResult, StagingPool
from .ssd_store import SSDStore

_LoadItem = LoadItem  # the name before load_job.py

__all__ = ["Blocks", "Completion", "DramObject", "DramStore", "EngineCounters", "LoadItem", "LoadJob", "LoadResult",
           "OrderRun", "TransferEngine"]

log = logging.getLogger("saria.dataplane.engine")

Blocks = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class Completion:
    """How an order ended, for ``ControlPlane.complete(order_id, ok, now, failed=failed)``."""

    order_id: int
    ok: bool
    failed: tuple[ObjectKey, ...] = ()


@dataclass(frozen=True)
class OrderRun:
    """One order started by :meth:`TransferEngine.execute`.

    ``completion``: resolves to the order's :class:`Completion` (``None`` for a drop, which is done
    when ``execute`` returns). ``released``: set once the engine no longer reads the order's source
    pages, so their blocks may be reused: at once for drops and DRAM-source writes; for stores,
    promotions and GPU-source writes once the pack of every object has run on the device. It is
    also set when the order fails part-way or the engine closes: a waiter never hangs."""

    order: Order
    completion: "Future[Completion] | None"
    released: threading.Event


@dataclass
class EngineCounters:
    loads: int = 0
    load_objects: int = 0
    load_failures: int = 0
    dram_to_gpu_bytes: int = 0
    dram_to_gpu_seconds: float = 0.0
    ssd_to_gpu_bytes: int = 0
    ssd_to_gpu_seconds: float = 0.0
    gpu_to_dram_bytes: int = 0
    gpu_to_dram_seconds: float = 0.0
    ssd_write_bytes: int = 0
    ssd_write_failures: int = 0
    store_failures: int = 0
    host_pool_full: int = 0
    dram_drops: int = 0
    ssd_drops: int = 0
    missing_dram_objects: int = 0

    def snapshot(self) -> dict:
        return asdict(self)


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
        table (one unpack launch each); an object with skipped pages is a run of its own."""
        runs: list[tuple[int, int]] = []
        for k in ks:
            item = self.items[k]
            if runs and runs[-1][1] == k and not item.skip and not self.items[runs[-1][0]].skip and \
                    self.items[runs[-1][0]].table is item.table:
                runs[-1] = (runs[-1][0], k + 1)
            else:
                runs.append((k, k + 1))
        return runs

    def release(self, n: int) -> bool:
        """``n`` more objects are done with the staging; ``True`` once all are."""
        with self._lock:
            self._left -= n
            return self._left == 0


class TransferEngine:
    """Moves objects between an engine's paged KV cache, the host pool and the SSD store.

    ``kv_table``: the engine's full-attention pages (one :class:`PageTable` over every layer);
    a chunk's kv object is ``pack_pages(kv_table, its pages_per_chunk block ids)``.
    ``state_table``: hybrid models' GDN state pages (a state object is ``state_pages`` of them).
    ``host_pool.slot_bytes`` must equal ``ssd.part_bytes``: a host slot is an SSD part, so SSD
    writes go straight from slots and per-part checksums are computed once, at pack time.
    """

    def __init__(self, kv_table: PageTable, *, host_pool: HostPool, coordinator: Coordinator,
                 pages_per_chunk: int, ssd: SSDStore | None = None, state_table: PageTable | None = None,
                 state_pages: int = 1, batch_bytes: int = 256 << 20):
        if pages_per_chunk < 1:
            raise ValueError(f"pages_per_chunk must be >= 1, got {pages_per_chunk}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        if state_table is not None and state_pages < 1:
            raise ValueError(f"state_pages must be >= 1, got {state_pages}")
        if state_table is not None and state_table.device != kv_table.device:
            raise ValueError(f"state pages are on {state_table.device}, KV pages on {kv_table.device}")
        if ssd is not None and ssd.part_bytes != host_pool.slot_bytes:
            raise ValueError(f"host slots ({host_pool.slot_bytes} B) and SSD parts ({ssd.part_bytes} B) must be "
                             "the same size: an SSD object is written part by part from host slots")
        self.kv_table = kv_table
        self.state_table = state_table
        self.pages_per_chunk = pages_per_chunk
        self.state_pages = state_pages
        self.host_pool = host_pool
        self.ssd = ssd
        self.coordinator = coordinator
        self.device = kv_table.device
        self.kv_bytes = kv_table.staging_bytes(pages_per_chunk)
        self.state_bytes = state_table.staging_bytes(state_pages) if state_table is not None else 0
        self._counters = EngineCounters()
        self._counter_lock = threading.Lock()
        self.dram = DramStore(host_pool)
        cuda = self.device.type == "cuda"
        self._streams = {name: torch.cuda.Stream(self.device) for name in ("dram", "ssd", "offload")} if cuda else {}
        self._dram_queue: queue.Queue = queue.Queue()
        self._dram_thread = threading.Thread(target=self._dram_loop, name="saria-dram", daemon=True)
        self._dram_thread.start()
        self.batch_bytes = batch_bytes
        # On the CPU the host slots are device memory: DRAM objects are unpacked straight from them
        # when their slots are contiguous (tests turn this off to exercise the gather path).
        self._zero_copy = self.device.type == "cpu"
        self._staging = StagingPool(self.device)
        self._ssd_cond = threading.Condition()
        self._ssd_inflight = 0  # SSD objects submitted and not yet unpacked or failed
        self._unpack_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._unpack_thread = threading.Thread(target=self._ssd_unpack_loop, name="saria-ssd-unpack", daemon=True)
        self._unpack_thread.start()
        self._dram_device = None if cuda else ThreadPoolExecutor(1, thread_name_prefix="saria-dram-unpack")
        self._offload_pool = ThreadPoolExecutor(1, thread_name_prefix="saria-offload")
        self._closed = False

    # --- small helpers ---------------------------------------------------------------------------

    def _stream(self, name: str):
        stream = self._streams.get(name)
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _record_event(self, name: str):
        stream = self._streams.get(name)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _count(self, **deltas) -> None:
        with self._counter_lock:
            for name, value in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def _table(self, kind: str) -> tuple[PageTable, int, int]:
        """(table, pages per object, bytes per object) for an object kind."""
        if kind == KV:
            return self.kv_table, self.pages_per_chunk, self.kv_bytes
        if self.state_table is None:
            raise ValueError("a state object was asked for but this engine has no state_table (not a hybrid model)")
        return self.state_table, self.state_pages, self.state_bytes

    def _ids(self, kind: str, chunk: Hashable, blocks: Blocks | None) -> torch.Tensor:
        table, pages, _ = self._table(kind)
        if blocks is None:
            raise ValueError(f"no block ids given for the {kind} object of chunk {chunk!r}")
        try:
            ids = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(list(blocks), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"the block ids of the {kind} object of chunk {chunk!r} are not integers: {exc}") from None
        if ids.dim() != 1 or ids.numel() != pages:
            raise ValueError(f"the {kind} object of chunk {chunk!r} needs {pages} block ids, got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"the block ids of the {kind} object of chunk {chunk!r} must be integers, got {ids.dtype}")
        ids = ids.to(device="cpu", dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_pages):
            raise ValueError(f"the {kind} object of chunk {chunk!r} names block ids {ids.tolist()} outside "
                             f"[0, {table.num_pages})")
        return ids

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the transfer engine is closed")

    def dram_object(self, chunk: Hashable, kind: str = KV) -> DramObject | None:
        """The DRAM copy of an object, or ``None`` (see :attr:`dram`, the :class:`DramStore`)."""
        return self.dram.get(ObjectKey(chunk, kind))

    def dram_objects(self) -> int:
        """How many objects are resident in DRAM."""
        return len(self.dram)

    # --- reloads ---------------------------------------------------------------------------------

    def load(self, plan: ReloadPlan, kv_blocks: Sequence[Blocks], state_blocks: Blocks | None = None, *,
             skip_pages: int = 0, timeline: list | None = None) -> LoadJob:
        """Start reloading ``plan`` into the pages ``kv_blocks[i]`` (chunk ``i``'s block ids) and,
        for a hybrid plan, ``state_blocks``. Returns at once; DRAM and SSD objects proceed on their
        own paths (one after the other when ``plan.serial``). ``timeline``: if a list, ``wait()``
        fills it with ``(path, seconds since start, bytes)`` per DRAM slice and SSD object (for
        benchmarks; on CUDA DRAM slices are timed by events, SSD objects by host clock).
        ``skip_pages``: the first chunk's leading pages that must not be written (the engine computed
        them already and may share them); its block ids still list all of its pages.
        Raises (bad plan or block ids) only before any object is started: an object that cannot be
        started later is a failed object of the job."""
        self._check_open()
        if len(kv_blocks) != plan.num_chunks:
            raise ValueError(f"plan {plan.plan_id} has {plan.num_chunks} chunks but {len(kv_blocks)} block lists")
        items = []
        for i, (chunk, tier, blocks) in enumerate(zip(plan.chunk_hashes, plan.kv_sources, kv_blocks)):
            items.append(LoadItem(i, ObjectKey(chunk, KV), tier, self.kv_table, self._ids(KV, chunk, blocks),
                                   self.kv_bytes))
        if not 0 <= skip_pages < self.pages_per_chunk or (skip_pages and not items):
            raise ValueError(f"skip_pages must be in [0, {self.pages_per_chunk}) and needs a chunk, got {skip_pages}")
        if items:
            items[0].skip = skip_pages
        if plan.state_chunk is not None:
            index = plan.chunk_hashes.index(plan.state_chunk)
            table, _, nbytes = self._table(STATE)
            items.append(LoadItem(index, ObjectKey(plan.state_chunk, STATE), plan.state_source, table,
                                   self._ids(STATE, plan.state_chunk, state_blocks), nbytes))
        if any(i.tier is Tier.SSD for i in items) and self.ssd is None:
            raise ValueError(f"plan {plan.plan_id} reads from SSD but this engine has no SSD store")
        job = LoadJob(plan, items, timeline, self._record_event("dram") if timeline is not None else None)
        self._count(loads=1, load_objects=len(items))
        dram_items = [i for i in items if i.tier is Tier.DRAM]
        ssd_items = [i for i in items if i.tier is Tier.SSD]
        if plan.serial and dram_items:
            job.defer_ssd(ssd_items)  # submitted by the DRAM thread once the DRAM part is done
        else:
            self._submit_ssd_reads(job, ssd_items)
        if dram_items:
            self._dram_queue.put((job, dram_items))
        return job

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

    def _unpack(self, item: LoadItem, staging: torch.Tensor) -> None:
        """Unpack one object from its own staging (``item.nbytes`` bytes)."""
        if item.skip:
            staging = drop_leading_pages(staging, item.table, item.blocks.numel(), item.skip)
        unpack_pages(staging, item.table, item.blocks[item.skip:])

    def _unpack_run(self, job: LoadJob, items: list[LoadItem], staging: torch.Tensor, path: str) -> None:
        """Unpack ``items`` (one page table; ``staging`` their packed bytes back to back) with one
        launch on ``path``'s stream, and finish them on ``job``. Never raises (its callers are the
        paths' threads, which must neither die nor leave a job waiting): if the launch is refused
        (e.g. two objects naming the same page), each object is unpacked alone and only those that
        fail alone fail."""
        try:
            with self._stream(path), nvtx.nvtx_range(nvtx.UNPACK):
                if len(items) == 1:
                    self._unpack(items[0], staging)
                else:
                    unpack_pages(staging, items[0].table, torch.stack([i.blocks for i in items]))
                event = self._record_event(path)
        except Exception as exc:
            if len(items) == 1:
                log.warning("%s reload of %s failed: %s", path.upper(), items[0].key, exc)
                self._count(load_failures=1)
                job.finish(items, error=exc)
                return
            offset = 0
            for item in items:
                self._unpack_run(job, [item], staging[offset:offset + item.nbytes], path)
                offset += item.nbytes
            return
        job.finish(items, event=event)

    # --- DRAM -> GPU ----------------------------------------------------------------------------

    def _dram_loop(self) -> None:
        while True:
            work = self._dram_queue.get()
            if work is None:
                return
            job, items = work
            for batch in self._batches(items):
                self._load_dram_batch(job, batch)
            deferred = job.take_deferred()  # a serial plan's SSD part starts once its DRAM part is issued
            if deferred:
                self._on_dram_device(self._submit_ssd_reads, job, deferred)

    def _load_dram_batch(self, job: LoadJob, batch: list[LoadItem]) -> None:
        """Copy one batch's DRAM objects into staging slice by slice (each slice paced by the
        coordinator), then unpack them with one launch. Never raises: a missing object, or a batch
        whose copy fails, becomes failed objects of the job, never wrong bytes."""
        present = []
        for item in batch:
            obj = self.dram.get(item.key)
            if obj is None:
                self._count(missing_dram_objects=1, load_failures=1)
                job.finish(item, error=LookupError(f"{item.key} is not in DRAM"))
            elif obj.nbytes != item.nbytes:
                self._count(load_failures=1)
                job.finish(item, error=ValueError(f"{item.key} holds {obj.nbytes} bytes, its pages need {item.nbytes}"))
            else:
                present.append((item, obj))
        if not present:
            return
        pending = [item for item, _ in present]
        t0 = time.perf_counter()
        try:
            with self._stream("dram"):
                for items, staging, handle in self._stage_dram(job, present):
                    self._on_dram_device(self._unpack_staged, job, items, staging, handle)
                    done = {id(i) for i in items}
                    pending = [i for i in pending if id(i) not in done]
        except Exception as exc:  # staging memory, a copy: what is not unpacked yet fails
            log.warning("DRAM reload of %s failed: %s", [i.key for i in pending], exc)
            self._count(load_failures=len(pending))
            job.finish(pending, error=exc)
        self._count(dram_to_gpu_bytes=sum(obj.nbytes for _, obj in present),
                    dram_to_gpu_seconds=time.perf_counter() - t0)

    def _on_dram_device(self, fn, *args) -> None:
        """Run ``fn`` as the DRAM path's device work. CUDA: now, on the DRAM thread (what it does is
        asynchronous on the ``dram`` stream). CPU: queued, in order, on the DRAM unpack thread, so
        the DRAM thread goes on pacing and staging the next batch while this one is unpacked, as a
        GPU's copy engines and SMs overlap with the host."""
        if self._dram_device is None:
            fn(*args)
        else:
            self._dram_device.submit(fn, *args)

    def _unpack_staged(self, job: LoadJob, items: list[LoadItem], staging: torch.Tensor, handle: object) -> None:
        """Unpack a DRAM run (never raises), then give its staging back."""
        try:
            self._unpack_run(job, items, staging, "dram")
        finally:
            self._staging.give(handle)

    def _pace(self, job: LoadJob, nbytes: int) -> float:
        """Wait for the coordinator to release a slice of ``nbytes``; the seconds it held it."""
        with nvtx.nvtx_range(nvtx.PACE_WAIT):
            return self.coordinator.acquire(nbytes)

    def _stage_dram(self, job: LoadJob, present: list[tuple[LoadItem, DramObject]]):
        """Yield ``(items, staging, handle)``: runs of objects whose packed bytes are ``staging``
        back to back on the device, each slice released by the coordinator first.

        On CUDA every object is copied into one device staging per batch (pinned H2D copies on the
        ``dram`` stream, a timeline event per slice). On the CPU the host slots already are device
        memory: objects whose slots follow each other in memory are unpacked straight from them (a
        run of such objects adjacent in memory is one staging), and only the others are gathered
        into a reused staging buffer. Either way each slice waits for the coordinator (Eq. 4)."""
        if self._zero_copy:
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
                        self._within_storage(run_view, run_bytes + obj.nbytes):
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
        handle, staging = self._staging.take(total)
        offset = 0
        for _, obj in present:
            for piece in self.dram.views(obj):
                n = piece.numel()
                self._pace(job, n)
                with nvtx.nvtx_range(nvtx.COPY_H2D):
                    staging[offset:offset + n].copy_(piece, non_blocking=True)
                offset += n
                job.mark("dram", n, self._record_event("dram"))
        yield [item for item, _ in present], staging, handle

    def _pace_object(self, job: LoadJob, obj: DramObject) -> bool:
        """A CPU object unpacked from its slots: its slices still go through the coordinator.
        ``True`` while the coordinator paces DRAM traffic (SSD reads are runnable)."""
        for piece in self.dram.views(obj):
            self._pace(job, piece.numel())
            job.mark("dram", piece.numel())
        c = self.coordinator
        return c.ssd_runnable > 0 and (c.mode == "serial" or (c.mode == "coordinated" and c.pacing_enabled))

    @staticmethod
    def _within_storage(view: torch.Tensor, nbytes: int) -> bool:
        return view.storage_offset() + nbytes <= view.untyped_storage().nbytes()

    # --- SSD -> GPU -----------------------------------------------------------------------------

    def _submit_ssd_reads(self, job: LoadJob, items: list[LoadItem]) -> None:
        """Start reading ``items`` from SSD: per batch of at most ``batch_bytes``, one staging and
        one ``read_many`` submission. Never raises (``load()`` calls it after other reads of the job
        may have started): an object that cannot be started is a failed object."""
        batch: list[LoadItem] = []
        size = 0
        for item in items:
            if batch and size + item.nbytes > self.batch_bytes:
                self._submit_ssd_batch(job, batch)
                batch, size = [], 0
            batch.append(item)
            size += item.nbytes
        if batch:
            self._submit_ssd_batch(job, batch)

    def _submit_ssd_batch(self, job: LoadJob, items: list[LoadItem]) -> None:
        self.coordinator.ssd_begin(len(items))
        with self._ssd_cond:
            self._ssd_inflight += len(items)
        batch = _SsdBatch(job, items, time.perf_counter())
        try:
            with self._stream("ssd"):  # reads wait for this stream: earlier unpacks of reused memory
                batch.handle, batch.staging = self._staging.take(sum(i.nbytes for i in items))
                rows = [batch.row(k) for k in range(len(items))]
                futures = self.ssd.read_many([object_key(i.key.chunk, i.key.kind) for i in items], rows)
        except Exception as exc:  # no memory for staging, store closed: every object of the batch fails
            for k in range(len(items)):
                self._ssd_arrived(batch, k, exc)
            return
        for k, future in enumerate(futures):
            if isinstance(future, BaseException):  # not found, refused: this object fails
                self._ssd_arrived(batch, k, future)
            else:
                future.add_done_callback(lambda f, k=k: self._ssd_arrived(batch, k, f.exception()))

    def _ssd_arrived(self, batch: "_SsdBatch", k: int, error: BaseException | None) -> None:
        """Object ``k`` of ``batch`` is read and verified (or failed): on the reader thread that
        finished it, the one hand-off, to the unpack thread."""
        self.coordinator.ssd_end()
        item = batch.items[k]
        if error is None:
            self._count(ssd_to_gpu_bytes=item.nbytes, ssd_to_gpu_seconds=time.perf_counter() - batch.t0)
            batch.job.mark("ssd", item.nbytes)
        self._unpack_queue.put((batch, k, error))

    def _ssd_unpack_loop(self) -> None:
        """The SSD unpack thread: takes every object that has arrived, and unpacks each run of
        them adjacent in one batch's staging (same page table) with one launch."""
        while True:
            work = [self._unpack_queue.get()]
            while True:
                try:
                    work.append(self._unpack_queue.get_nowait())
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
                    self._count(load_failures=1)
                    batch.job.finish(batch.items[k], error=error)
                    self._ssd_release(batch, 1)
                else:
                    arrived.setdefault(id(batch), (batch, []))[1].append(k)
            for batch, ks in arrived.values():
                try:
                    for start, stop_k in batch.runs(sorted(ks)):
                        items = list(batch.items[start:stop_k])
                        self._unpack_run(batch.job, items, batch.span(start, stop_k), "ssd")
                finally:
                    self._ssd_release(batch, len(ks))
            done = len(work) - (1 if stop else 0)
            with self._ssd_cond:
                self._ssd_inflight -= done
                self._ssd_cond.notify_all()
            if stop:
                return

    def _ssd_release(self, batch: "_SsdBatch", n: int) -> None:
        if batch.release(n):
            self._staging.give(batch.handle)

    # --- GPU -> DRAM: store and promote ----------------------------------------------------------

    def store(self, order: StoreOrder | PromoteOrder, kv_blocks: Mapping[Hashable, Blocks],
              state_blocks: Mapping[Hashable, Blocks] | None = None,
              prepacked: Mapping[ObjectKey, torch.Tensor] | None = None, *,
              released: threading.Event | None = None) -> "Future[Completion]":
        """Copy the order's objects from their pages into new host slots. On CUDA the copy waits
        for the work queued so far on the caller's current stream (the prefill that computed them).
        Objects that do not fit in the host pool fail (named in the completion); the rest land.
        The pages are no longer read once the future is done, and earlier once ``released`` (if
        given) is set: after the pack of every object has run on the device, or the order failed,
        or the engine closed. ``prepacked``: objects whose bytes were packed earlier (a GDN state
        captured when a step ended on its boundary, see :meth:`capture_state`), used as is; an
        object found neither there nor in the block maps fails."""
        self._check_open()
        if not isinstance(order, (StoreOrder, PromoteOrder)):
            raise ValueError(f"store() takes a StoreOrder or PromoteOrder, got {type(order).__name__}")
        objects = self._resolve(order, kv_blocks, state_blocks or {}, prepacked or {})
        ready = self._caller_event()
        released = released if released is not None else threading.Event()
        try:
            return self._offload_pool.submit(self._run_store, order, objects, ready, released)
        except RuntimeError:  # the pool shut down under us: the engine is closing
            released.set()
            raise

    def _caller_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _resolve(self, order: Order, kv_blocks: Mapping[Hashable, Blocks], state_blocks: Mapping[Hashable, Blocks],
                 prepacked: Mapping[ObjectKey, torch.Tensor]) -> list[tuple[ObjectKey, torch.Tensor | None,
                                                                             torch.Tensor | None]]:
        """(key, block ids, prepacked staging) per object of ``order``: exactly one of the two is
        set, or neither when the caller has no copy of a prepacked-only object (it then fails)."""
        out = []
        for kind, chunks, blocks in ((KV, order.kv, kv_blocks), (STATE, order.state, state_blocks)):
            for chunk in chunks:
                key = ObjectKey(chunk, kind)
                staging = prepacked.get(key)
                if staging is not None:
                    _, _, nbytes = self._table(kind)
                    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 or \
                            staging.numel() != nbytes or staging.device != self.device:
                        raise ValueError(f"prepacked {key} must be {nbytes} uint8 bytes on {self.device}")
                    out.append((key, None, staging.reshape(-1)))
                elif chunk in blocks or not prepacked:
                    out.append((key, self._ids(kind, chunk, blocks.get(chunk)), None))
                else:
                    out.append((key, None, None))
        return out

    def _pack_objects(self, objects: list) -> list[tuple[ObjectKey, torch.Tensor | None, BaseException | None]]:
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
            table, _, _ = self._table(kind)
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
        event = self._record_event(stream_name)
        if event is not None:
            event.synchronize()

    def _run_store(self, order: Order, objects: list, ready, released: threading.Event) -> Completion:
        failed = []
        stored = []
        try:
            with self._stream("offload"):
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                t0 = time.perf_counter()
                packed = self._pack_objects(objects)
                self._packed_on_device("offload")
                released.set()
                for key, staging, error in packed:
                    try:
                        if error is not None:
                            raise error
                        sums = self._part_checksums(staging)
                        slots = self.host_pool.allocate(self.host_pool.slots_for(staging.numel()))
                    except HostPoolFull as exc:
                        log.warning("host pool full: %s not stored (%s)", key, exc)
                        self._count(host_pool_full=1, store_failures=1)
                        failed.append(key)
                        continue
                    except Exception as exc:
                        log.warning("storing %s failed: %s", key, exc)
                        self._count(store_failures=1)
                        failed.append(key)
                        continue
                    offset = 0
                    with nvtx.nvtx_range(nvtx.COPY_D2H):
                        for piece in self.host_pool.views(slots, staging.numel()):
                            piece.copy_(staging[offset:offset + piece.numel()], non_blocking=True)
                            offset += piece.numel()
                    stored.append((key, DramObject(slots, staging.numel(), sums)))
                stream = self._streams.get("offload")
                if stream is not None:
                    stream.synchronize()  # the slots hold the bytes before the objects are published
            for key, obj in stored:
                self.dram.put(key, obj)
            self._count(gpu_to_dram_bytes=sum(obj.nbytes for _, obj in stored),
                        gpu_to_dram_seconds=time.perf_counter() - t0)
        except BaseException:
            for _, obj in stored:  # not published: give the slots back
                self.host_pool.free(obj.slots)
            raise
        finally:
            released.set()
        ok = len(failed) < len(objects) or not objects
        return Completion(order.order_id, ok, tuple(failed) if ok else ())

    def capture_state(self, blocks: int | Blocks) -> torch.Tensor:
        """Pack one GDN state object now into fresh staging and return it (uint8, ``state_bytes``
        long, on the engine's device): a checkpoint set aside when a step ends on its boundary,
        before the engine's next step overwrites the state pages. Pass it later as
        ``prepacked[ObjectKey(chunk, STATE)]`` to :meth:`store`, :meth:`write` or :meth:`execute`.

        ``blocks``: the object's ``state_pages`` block ids (an int when ``state_pages == 1``).
        On CUDA the pack is queued on the caller's current stream, after the step that computed
        the state. ``ValueError``: no ``state_table``, or wrong block ids."""
        self._check_open()
        if self.state_table is None:
            raise ValueError("capture_state needs a state_table: this engine has none (not a hybrid model)")
        if isinstance(blocks, int) and not isinstance(blocks, bool):
            blocks = [blocks]
        ids = self._ids(STATE, "(captured)", blocks)
        with nvtx.nvtx_range(nvtx.PACK):
            return pack_pages(self.state_table, ids)

    # --- SSD writes ------------------------------------------------------------------------------

    def write(self, order: WriteOrder, kv_blocks: Mapping[Hashable, Blocks] | None = None,
              state_blocks: Mapping[Hashable, Blocks] | None = None,
              packed: threading.Event | None = None,
              prepacked: Mapping[ObjectKey, torch.Tensor] | None = None) -> "Future[Completion]":
        """Write the order's objects to SSD: from their DRAM slots (``order.source`` DRAM, no copy)
        or packed from their pages (``Tier.GPU``: give the block ids; run it before they are freed).
        ``packed`` is set once the pages are no longer read: at once for DRAM-source writes, after
        the pack of every object has run on the device for GPU-source ones (also when the order
        fails or the engine closes). ``prepacked`` as in :meth:`store`.
        """
        self._check_open()
        if self.ssd is None:
            raise ValueError("write order but this engine has no SSD store")
        if not isinstance(order, WriteOrder):
            raise ValueError(f"write() takes a WriteOrder, got {type(order).__name__}")
        released = packed if packed is not None else threading.Event()
        result: Future = Future()
        keys = [ObjectKey(c, KV) for c in order.kv] + [ObjectKey(c, STATE) for c in order.state]
        if order.source is Tier.DRAM:
            released.set()
            futures = [self._write_from_dram(key) for key in keys]
            self._gather_writes(order, keys, futures, result)
        elif order.source is Tier.GPU:
            objects = self._resolve(order, kv_blocks or {}, state_blocks or {}, prepacked or {})
            ready = self._caller_event()
            try:
                self._offload_pool.submit(self._pack_and_write, order, keys, objects, ready, released, result)
            except RuntimeError:  # the engine is closing
                released.set()
                raise
        else:
            raise ValueError(f"write order {order.order_id} has source {order.source}; expected DRAM or GPU")
        return result

    def _pack_and_write(self, order: WriteOrder, keys: list[ObjectKey], objects: list, ready,
                        released: threading.Event, result: Future) -> None:
        """On the offload thread: pack the order's objects (one launch per kind), let the pages go,
        then hand each object's staging to the SSD store (which holds it until written)."""
        try:
            with self._stream("offload"):
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
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
        obj = self.dram_object(key.chunk, key.kind)
        if obj is None:
            self._count(missing_dram_objects=1)
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
                    self._count(ssd_write_failures=1)
                else:
                    self._count(ssd_write_bytes=nbytes)
                state["left"] -= 1
                finished = state["left"] == 0
            if finished:
                failed = state["failed"]
                ok = len(failed) < len(keys) or not keys
                result.set_result(Completion(order.order_id, ok, tuple(failed) if ok else ()))

        if not futures:
            result.set_result(Completion(order.order_id, True))
        for key, future in zip(keys, futures):
            nbytes = self._table(key.kind)[2]
            if isinstance(future, BaseException):
                one_done(key, future, nbytes)
            else:
                future.add_done_callback(lambda f, k=key, n=nbytes: one_done(k, f.exception(), n))

    # --- drops -----------------------------------------------------------------------------------

    def drop(self, order: DropOrder) -> None:
        """Free the order's objects in its tier (DRAM slots, or the SSD copy)."""
        self._check_open()
        if not isinstance(order, DropOrder):
            raise ValueError(f"drop() takes a DropOrder, got {type(order).__name__}")
        keys = [ObjectKey(c, KV) for c in order.kv] + [ObjectKey(c, STATE) for c in order.state]
        if order.tier is Tier.DRAM:
            for key in keys:
                if self.dram.drop(key) is not None:
                    self._count(dram_drops=1)
        elif order.tier is Tier.SSD:
            if self.ssd is None:
                raise ValueError("SSD drop order but this engine has no SSD store")
            for key in keys:
                if self.ssd.delete(object_key(key.chunk, key.kind)):
                    self._count(ssd_drops=1)
        else:
            raise ValueError(f"drop order {order.order_id} names tier {order.tier}; expected DRAM or SSD")

    # --- all orders ------------------------------------------------------------------------------

    def execute(self, orders: Iterable[Order], kv_blocks: Mapping[Hashable, Blocks] | None = None,
                state_blocks: Mapping[Hashable, Blocks] | None = None,
                prepacked: Mapping[ObjectKey, torch.Tensor] | None = None) -> list[OrderRun]:
        """Run a list of orders as the control plane returned them, in list order (drops first):
        the one dispatch for every kind of order. Returns one :class:`OrderRun` per order.

        ``kv_blocks`` / ``state_blocks``: chunk hash -> block ids of the objects to store or write
        from HBM; ``prepacked``: objects packed earlier (:meth:`capture_state`), as in :meth:`store`.
        A bad order (unknown type, missing or wrong block ids, a tier this engine lacks, a bad
        prepacked tensor) raises ``ValueError`` before anything of it started; the orders before
        it did start (their runs are lost to the caller, but they complete and release as usual).
        """
        runs = []
        kv_blocks = kv_blocks or {}
        state_blocks = state_blocks or {}
        prepacked = prepacked or {}
        for order in orders:
            released = threading.Event()
            if isinstance(order, DropOrder):
                self.drop(order)
                released.set()
                runs.append(OrderRun(order, None, released))
            elif isinstance(order, (StoreOrder, PromoteOrder)):
                runs.append(OrderRun(order, self.store(order, kv_blocks, state_blocks, prepacked, released=released),
                                     released))
            elif isinstance(order, WriteOrder):
                runs.append(OrderRun(order, self.write(order, kv_blocks, state_blocks, released, prepacked),
                                     released))
            else:
                raise ValueError(f"unknown order type {type(order).__name__}")
        return runs

    def counters(self) -> dict:
        """Engine, coordinator, host pool and SSD store counters in one snapshot."""
        with self._counter_lock:
            out = {"engine": self._counters.snapshot()}
        out["coordinator"] = self.coordinator.counters.snapshot()
        out["host_pool"] = self.host_pool.counters.snapshot()
        if self.ssd is not None:
            out["ssd"] = self.ssd.counters()
        return out

    def close(self) -> None:
        """Finish queued work and stop the threads (the host pool and SSD store stay open)."""
        if self._closed:
            return
        self._closed = True
        self._dram_queue.put(None)
        self._dram_thread.join()
        if self._dram_device is not None:
            self._dram_device.shutdown(wait=True)  # may still submit a serial plan's SSD reads
        self._offload_pool.shutdown(wait=True)
        with self._ssd_cond:  # reads in flight call back into the unpack thread: let them land
            self._ssd_cond.wait_for(lambda: self._ssd_inflight == 0)
        self._unpack_queue.put(None)
        self._unpack_thread.join()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
