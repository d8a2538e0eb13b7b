"""The transfer engine: executes the control plane's plans and orders against an engine's paged
KV cache, the host pool (DRAM tier) and the SSD store, on separate queues.

Paths, each on its own thread and (on CUDA) its own stream:

* **DRAM -> GPU** (one dispatcher thread, ``dram`` stream): every request's DRAM objects, in
  submission order, cut into host-slot-sized slices; each slice waits for the
  :class:`~saria.dataplane.coordinator.Coordinator` (Eq. 4 pacing while SSD reads are runnable),
  then is copied into GPU staging; the object is unpacked into its pages with
  :func:`~saria.kernels.unpack_pages`.
* **SSD -> GPU** (the SSD store's reader pool, then an ``ssd`` unpack thread and stream): each
  object is read straight into GPU staging (GDS through kvikio, or POSIX through a bounce buffer),
  verified against its checksum by the store, and unpacked.
* **GPU -> DRAM** (``offload`` thread and stream): store and promotion orders pack pages with
  :func:`~saria.kernels.pack_pages`, checksum each host-slot-sized part on the GPU, and copy into
  freshly allocated host slots.
* **DRAM/GPU -> SSD** (the SSD store's writer pool): write orders, from DRAM slots or, for
  write-through, from freshly packed GPU staging.

Nothing here decides anything: the engine moves what it is told and reports back. Loads return a
:class:`LoadJob` whose result names the objects that failed (for ``commit_prefill(failed=...)``);
orders return a ``Future[Completion]`` (for ``ControlPlane.complete``). The caller ferries them to
the control plane, which may live in another process (vLLM's scheduler).

On a machine without CUDA the same code runs with CPU tensors: copies are synchronous and there
are no streams, but every thread, queue, pacing decision and verification is the same.
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
from .host_pool import HostPool, HostPoolFull
from .keys import object_key
from .ssd_store import SSDStore

log = logging.getLogger("saria.dataplane.engine")

Blocks = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class Completion:
    """How an order ended, for ``ControlPlane.complete(order_id, ok, now, failed=failed)``."""

    order_id: int
    ok: bool
    failed: tuple[ObjectKey, ...] = ()


@dataclass(frozen=True)
class LoadResult:
    """How a reload ended. ``failed``: objects that could not be delivered (pass them to
    ``commit_prefill(failed=...)`` or ``release(failed=...)``); ``valid_chunks``: how many leading
    chunks of the plan are loaded and usable (everything from the first failure on must be
    recomputed; a failed state object invalidates the whole plan)."""

    plan_id: int
    failed: tuple[ObjectKey, ...]
    valid_chunks: int
    dram_bytes: int
    ssd_bytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class DramObject:
    """An object resident in the host pool: its slots, size and per-slot checksums."""

    slots: list[int]
    nbytes: int
    checksums: tuple[int, ...]


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


@dataclass
class _LoadItem:
    index: int  # chunk position in the plan (the state object: the position of its chunk)
    key: ObjectKey
    tier: Tier
    table: PageTable
    blocks: torch.Tensor
    nbytes: int
    skip: int = 0  # leading pages the engine already holds: not written


class LoadJob:
    """One reload in flight. ``wait()`` blocks the host until every object is in its pages;
    ``wait_on(stream)`` instead makes a CUDA stream wait (no host block once all is issued)."""

    def __init__(self, plan: ReloadPlan, items: list[_LoadItem], timeline: list | None, start_event=None):
        self.plan = plan
        self._items = items
        self._pending = len(items)
        self._lock = threading.Lock()
        self._issued = threading.Event()
        self._events: list = []
        self._failed: list[_LoadItem] = []
        self._start = time.perf_counter()
        self._end: float | None = None
        self.timeline = timeline
        self._start_event = start_event  # CUDA: device time base for timeline points
        self._marks: list[tuple[str, object, int]] = []
        self._ssd_deferred: list[_LoadItem] = []
        self.dram_bytes = sum(i.nbytes for i in items if i.tier is Tier.DRAM)
        self.ssd_bytes = sum(i.nbytes for i in items if i.tier is Tier.SSD)
        if not items:
            self._issued.set()

    def _finish(self, item: _LoadItem, event=None, error: BaseException | None = None) -> None:
        with self._lock:
            if event is not None:
                self._events.append(event)
            if error is not None:
                self._failed.append(item)
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._issued.set()

    def _mark(self, path: str, nbytes: int, event=None) -> None:
        """A timeline point: ``nbytes`` of ``path`` done now (host time) or when ``event`` fires
        (resolved in :meth:`wait`, without blocking the copy threads)."""
        if self.timeline is not None:
            with self._lock:
                self._marks.append((path, event if event is not None else time.perf_counter() - self._start, nbytes))

    def done(self) -> bool:
        """All objects issued (and, on CPU, copied). On CUDA the copies may still be running."""
        return self._issued.is_set()

    def ready(self) -> bool:
        """Every object is in its pages (or failed): issued, and every CUDA event reached. Never blocks."""
        return self._issued.is_set() and all(event.query() for event in self._events)

    def wait(self, timeout: float | None = None) -> LoadResult:
        if not self._issued.wait(timeout):
            raise TimeoutError(f"reload of plan {self.plan.plan_id} not done after {timeout} s")
        for event in self._events:
            event.synchronize()
        if self._end is None:
            self._end = time.perf_counter()
            if self.timeline is not None:
                for path, when, nbytes in self._marks:
                    if not isinstance(when, float):
                        when = self._start_event.elapsed_time(when) / 1e3
                    self.timeline.append((path, when, nbytes))
                self.timeline.sort(key=lambda point: point[1])
        return self.result()

    def wait_on(self, stream) -> None:
        """Make ``stream`` wait for every copy and unpack of this reload (CUDA); host-blocks only
        until everything is issued."""
        self._issued.wait()
        for event in self._events:
            stream.wait_event(event)

    def result(self) -> LoadResult:
        if not self._issued.is_set():
            raise RuntimeError("reload still in flight: call wait() first")
        failed = sorted(self._failed, key=lambda i: (i.index, i.key.kind))
        valid = self.plan.num_chunks
        for item in failed:
            valid = 0 if item.key.kind == STATE else min(valid, item.index)
        return LoadResult(self.plan.plan_id, tuple(i.key for i in failed), valid, self.dram_bytes, self.ssd_bytes,
                          (self._end or time.perf_counter()) - self._start)


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
                 state_pages: int = 1):
        if pages_per_chunk < 1:
            raise ValueError(f"pages_per_chunk must be >= 1, got {pages_per_chunk}")
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
        self._dram: dict[tuple[Hashable, str], DramObject] = {}
        self._dram_lock = threading.Lock()
        cuda = self.device.type == "cuda"
        self._streams = {name: torch.cuda.Stream(self.device) for name in ("dram", "ssd", "offload")} if cuda else {}
        self._dram_queue: queue.Queue = queue.Queue()
        self._dram_thread = threading.Thread(target=self._dram_loop, name="saria-dram", daemon=True)
        self._dram_thread.start()
        self._unpack_pool = ThreadPoolExecutor(1, thread_name_prefix="saria-ssd-unpack")
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
        ids = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(list(blocks), dtype=torch.int64)
        if ids.dim() != 1 or ids.numel() != pages:
            raise ValueError(f"the {kind} object of chunk {chunk!r} needs {pages} block ids, got {tuple(ids.shape)}")
        return ids.cpu()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the transfer engine is closed")

    def dram_object(self, chunk: Hashable, kind: str = KV) -> DramObject | None:
        with self._dram_lock:
            return self._dram.get((chunk, kind))

    def dram_objects(self) -> int:
        with self._dram_lock:
            return len(self._dram)

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
            items.append(_LoadItem(i, ObjectKey(chunk, KV), tier, self.kv_table, self._ids(KV, chunk, blocks),
                                   self.kv_bytes))
        if not 0 <= skip_pages < self.pages_per_chunk or (skip_pages and not items):
            raise ValueError(f"skip_pages must be in [0, {self.pages_per_chunk}) and needs a chunk, got {skip_pages}")
        if items:
            items[0].skip = skip_pages
        if plan.state_chunk is not None:
            index = plan.chunk_hashes.index(plan.state_chunk)
            table, _, nbytes = self._table(STATE)
            items.append(_LoadItem(index, ObjectKey(plan.state_chunk, STATE), plan.state_source, table,
                                   self._ids(STATE, plan.state_chunk, state_blocks), nbytes))
        if any(i.tier is Tier.SSD for i in items) and self.ssd is None:
            raise ValueError(f"plan {plan.plan_id} reads from SSD but this engine has no SSD store")
        job = LoadJob(plan, items, timeline, self._record_event("dram") if timeline is not None else None)
        self._count(loads=1, load_objects=len(items))
        dram_items = [i for i in items if i.tier is Tier.DRAM]
        ssd_items = [i for i in items if i.tier is Tier.SSD]
        if plan.serial and dram_items:
            job._ssd_deferred = ssd_items  # submitted by the DRAM thread once the DRAM part is done
        else:
            for item in ssd_items:
                self._submit_ssd_read(job, item)
        for n, item in enumerate(dram_items):
            self._dram_queue.put((job, item, n == len(dram_items) - 1))
        return job

    def _dram_loop(self) -> None:
        while True:
            work = self._dram_queue.get()
            if work is None:
                return
            job, item, last = work
            try:
                event = self._load_from_dram(job, item)
            except Exception as exc:  # delivered as a failed object, never as wrong bytes
                log.warning("DRAM reload of %s failed: %s", item.key, exc)
                self._count(load_failures=1)
                job._finish(item, error=exc)
            else:
                job._finish(item, event=event)
            if last and job._ssd_deferred:
                deferred, job._ssd_deferred = job._ssd_deferred, []
                for ssd_item in deferred:
                    self._submit_ssd_read(job, ssd_item)

    def _load_from_dram(self, job: LoadJob, item: _LoadItem):
        obj = self.dram_object(item.key.chunk, item.key.kind)
        if obj is None:
            self._count(missing_dram_objects=1)
            raise LookupError(f"{item.key} is not in DRAM")
        if obj.nbytes != item.nbytes:
            raise ValueError(f"{item.key} holds {obj.nbytes} bytes, its pages need {item.nbytes}")
        t0 = time.perf_counter()
        with self._stream("dram"):
            staging = torch.empty(obj.nbytes, dtype=torch.uint8, device=self.device)
            offset = 0
            for piece in self.host_pool.views(obj.slots, obj.nbytes):
                n = piece.numel()
                with nvtx.nvtx_range(nvtx.PACE_WAIT):
                    self.coordinator.acquire(n)
                with nvtx.nvtx_range(nvtx.COPY_H2D):
                    staging[offset:offset + n].copy_(piece, non_blocking=True)
                offset += n
                if job.timeline is not None:
                    job._mark("dram", n, self._record_event("dram"))
            with nvtx.nvtx_range(nvtx.UNPACK):
                self._unpack(item, staging)
            event = self._record_event("dram")
        self._count(dram_to_gpu_bytes=obj.nbytes, dram_to_gpu_seconds=time.perf_counter() - t0)
        return event

    def _unpack(self, item: _LoadItem, staging: torch.Tensor) -> None:
        if item.skip:
            staging = drop_leading_pages(staging, item.table, item.blocks.numel(), item.skip)
        unpack_pages(staging, item.table, item.blocks[item.skip:])

    def _submit_ssd_read(self, job: LoadJob, item: _LoadItem) -> None:
        """Never raises: ``load()`` calls it after other reads of the job may have started."""
        self.coordinator.ssd_begin()
        t0 = time.perf_counter()
        try:
            with self._stream("ssd"):
                staging = torch.empty(item.nbytes, dtype=torch.uint8, device=self.device)
            future = self.ssd.read(object_key(item.key.chunk, item.key.kind), staging)
        except Exception as exc:  # no memory for staging, not found, store closed: a failed object
            self.coordinator.ssd_end()
            self._count(load_failures=1)
            job._finish(item, error=exc)
            return

        def done(f: Future) -> None:
            self.coordinator.ssd_end()
            error = f.exception()
            if error is not None:
                log.warning("SSD reload of %s failed: %s", item.key, error)
                self._count(load_failures=1)
                job._finish(item, error=error)
                return
            self._count(ssd_to_gpu_bytes=item.nbytes, ssd_to_gpu_seconds=time.perf_counter() - t0)
            job._mark("ssd", item.nbytes)
            self._unpack_pool.submit(self._unpack_ssd_object, job, item, staging)

        future.add_done_callback(done)

    def _unpack_ssd_object(self, job: LoadJob, item: _LoadItem, staging: torch.Tensor) -> None:
        try:
            with self._stream("ssd"), nvtx.nvtx_range(nvtx.UNPACK):
                self._unpack(item, staging)
                event = self._record_event("ssd")
        except Exception as exc:
            self._count(load_failures=1)
            job._finish(item, error=exc)
        else:
            job._finish(item, event=event)

    # --- GPU -> DRAM: store and promote ----------------------------------------------------------

    def store(self, order: StoreOrder | PromoteOrder, kv_blocks: Mapping[Hashable, Blocks],
              state_blocks: Mapping[Hashable, Blocks] | None = None,
              prepacked: Mapping[ObjectKey, torch.Tensor] | None = None) -> "Future[Completion]":
        """Copy the order's objects from their pages into new host slots. On CUDA the copy waits
        for the work queued so far on the caller's current stream (the prefill that computed them).
        Objects that do not fit in the host pool fail (named in the completion); the rest land.
        The pages are no longer read once the future is done. ``prepacked``: objects whose bytes
        were packed earlier (a GDN state captured when a step ended on its boundary), used as is;
        an object found neither there nor in the block maps fails."""
        self._check_open()
        if not isinstance(order, (StoreOrder, PromoteOrder)):
            raise ValueError(f"store() takes a StoreOrder or PromoteOrder, got {type(order).__name__}")
        objects = self._resolve(order, kv_blocks, state_blocks or {}, prepacked or {})
        ready = self._caller_event()
        return self._offload_pool.submit(self._run_store, order, objects, ready)

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
                    if staging.dtype != torch.uint8 or staging.numel() != nbytes or staging.device != self.device:
                        raise ValueError(f"prepacked {key} must be {nbytes} uint8 bytes on {self.device}")
                    out.append((key, None, staging))
                elif chunk in blocks or not prepacked:
                    out.append((key, self._ids(kind, chunk, blocks.get(chunk)), None))
                else:
                    out.append((key, None, None))
        return out

    def _pack(self, key: ObjectKey, ids: torch.Tensor | None,
              staging: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Pack an object into GPU staging (unless given packed) and checksum it part by part
        (one part = one host slot)."""
        if staging is None:
            if ids is None:
                raise LookupError(f"{key}: neither its pages nor a packed copy were given")
            table, _, _ = self._table(key.kind)
            with nvtx.nvtx_range(nvtx.PACK):
                staging = pack_pages(table, ids)
        part = self.host_pool.slot_bytes
        sums = tuple(checksum(staging[o:o + part]) for o in range(0, staging.numel(), part))
        return staging, sums

    def _run_store(self, order: Order, objects: list, ready) -> Completion:
        failed = []
        with self._stream("offload"):
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            for key, ids, packed in objects:
                t0 = time.perf_counter()
                try:
                    staging, sums = self._pack(key, ids, packed)
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
                stream = self._streams.get("offload")
                if stream is not None:
                    stream.synchronize()  # the slots hold the bytes before the object is published
                old = None
                with self._dram_lock:
                    old = self._dram.get((key.chunk, key.kind))
                    self._dram[(key.chunk, key.kind)] = DramObject(slots, staging.numel(), sums)
                if old is not None:
                    self.host_pool.free(old.slots)
                self._count(gpu_to_dram_bytes=staging.numel(), gpu_to_dram_seconds=time.perf_counter() - t0)
        ok = len(failed) < len(objects) or not objects
        return Completion(order.order_id, ok, tuple(failed) if ok else ())

    # --- SSD writes ------------------------------------------------------------------------------

    def write(self, order: WriteOrder, kv_blocks: Mapping[Hashable, Blocks] | None = None,
              state_blocks: Mapping[Hashable, Blocks] | None = None,
              packed: threading.Event | None = None,
              prepacked: Mapping[ObjectKey, torch.Tensor] | None = None) -> "Future[Completion]":
        """Write the order's objects to SSD: from their DRAM slots (``order.source`` DRAM, no copy)
        or packed from their pages (``Tier.GPU``: give the block ids; run it before they are freed).
        ``packed`` is set once the pages are no longer read (at once for DRAM-source writes).
        ``prepacked`` as in :meth:`store`.
        """
        self._check_open()
        if self.ssd is None:
            raise ValueError("write order but this engine has no SSD store")
        if not isinstance(order, WriteOrder):
            raise ValueError(f"write() takes a WriteOrder, got {type(order).__name__}")
        result: Future = Future()
        keys = [ObjectKey(c, KV) for c in order.kv] + [ObjectKey(c, STATE) for c in order.state]
        if order.source is Tier.DRAM:
            futures = [self._write_from_dram(key) for key in keys]
            if packed is not None:
                packed.set()
            self._gather_writes(order, keys, futures, result)
        elif order.source is Tier.GPU:
            objects = self._resolve(order, kv_blocks or {}, state_blocks or {}, prepacked or {})
            ready = self._caller_event()

            def pack_and_write():
                with self._stream("offload"):
                    if ready is not None:
                        torch.cuda.current_stream(self.device).wait_event(ready)
                    futures = [self._write_from_gpu(key, ids, staging) for key, ids, staging in objects]
                if packed is not None:
                    packed.set()  # _pack synchronized: the staging holds the bytes
                self._gather_writes(order, keys, futures, result)

            self._offload_pool.submit(pack_and_write)
        else:
            raise ValueError(f"write order {order.order_id} has source {order.source}; expected DRAM or GPU")
        return result

    def _write_from_dram(self, key: ObjectKey) -> Future | BaseException:
        obj = self.dram_object(key.chunk, key.kind)
        if obj is None:
            self._count(missing_dram_objects=1)
            return LookupError(f"{key} is not in DRAM")
        try:
            return self.ssd.write(object_key(key.chunk, key.kind), self.host_pool.views(obj.slots, obj.nbytes),
                                  obj.checksums)
        except Exception as exc:  # store full, closed
            return exc

    def _write_from_gpu(self, key: ObjectKey, ids: torch.Tensor | None,
                        staging: torch.Tensor | None) -> Future | BaseException:
        try:
            staging, sums = self._pack(key, ids, staging)
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
        keys = [(c, KV) for c in order.kv] + [(c, STATE) for c in order.state]
        if order.tier is Tier.DRAM:
            for key in keys:
                with self._dram_lock:
                    obj = self._dram.pop(key, None)
                if obj is not None:
                    self.host_pool.free(obj.slots)
                    self._count(dram_drops=1)
        elif order.tier is Tier.SSD:
            if self.ssd is None:
                raise ValueError("SSD drop order but this engine has no SSD store")
            for chunk, kind in keys:
                if self.ssd.delete(object_key(chunk, kind)):
                    self._count(ssd_drops=1)
        else:
            raise ValueError(f"drop order {order.order_id} names tier {order.tier}; expected DRAM or SSD")

    # --- all orders ------------------------------------------------------------------------------

    def execute(self, orders: Iterable[Order], kv_blocks: Mapping[Hashable, Blocks] | None = None,
                state_blocks: Mapping[Hashable, Blocks] | None = None) -> list["Future[Completion]"]:
        """Run a list of orders as the control plane returned them (in list order: drops first).
        Returns the futures of the orders that complete (stores, promotions, writes)."""
        futures = []
        for order in orders:
            if isinstance(order, DropOrder):
                self.drop(order)
            elif isinstance(order, (StoreOrder, PromoteOrder)):
                futures.append(self.store(order, kv_blocks or {}, state_blocks))
            elif isinstance(order, WriteOrder):
                futures.append(self.write(order, kv_blocks, state_blocks))
            else:
                raise ValueError(f"unknown order type {type(order).__name__}")
        return futures

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
        self._offload_pool.shutdown(wait=True)
        self._unpack_pool.shutdown(wait=True)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
