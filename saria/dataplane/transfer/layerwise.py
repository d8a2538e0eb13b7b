"""Layer-wise reloads: one step's reloads moved layer by layer, so that the engine's forward pass
computes layer ``l`` while the pages of layer ``l + 1`` are still arriving (vLLM's per-layer hooks;
docs/vllm.md, "Layer-wise reloads").

:meth:`LayerwiseLoads.submit` takes a step's reloads (kv objects only: a hybrid model's state
object has no layer hook and loads whole, :meth:`TransferEngine.load`) and returns a
:class:`StepLoad` at once. Everything every layer's copy needs is worked out once per path and
step, in one vectorized pass on the path's thread (:func:`~saria.kernels.prepare_layered`: the
checks, one work array of addresses for every layer uploaded once on the path's stream), so that
each layer costs one launch and one event:

* **DRAM objects**: each layer's pages are copied straight out of the host slots (where they lie:
  :func:`slot_layout`; on CUDA a kernel that reads the pinned slots by address, every tensor and
  host pool segment of the layer in one launch; on the CPU the torch twin's slice copies), on the
  ``dram`` stream, layer after layer, each layer's bytes released by the coordinator first (Eq. 4).
* **SSD objects**: read whole, as the SSD path reads them (verified or opened on the store's reader
  threads), into one host staging per step (pinned on CUDA): the SSD read runs ahead. Once every
  read of the step ended, each layer's pages of the objects that arrived are copied out of it on
  the ``ssd`` stream. An object that failed its read is never copied, at no layer: its load fails,
  and its chunk and every chunk after it in its plan are recomputed by the engine.

Per layer and path the step keeps a host flag ``issued`` (the layer's copies are queued; one
:class:`~saria.dataplane.transfer.flags.LayerFlags` for all layers) and a device event recorded
after them (on the CPU its :class:`~saria.dataplane.transfer.streams.HostEvent` twin). :meth:`StepLoad.wait_layer` waits for the first and makes the caller's current stream wait
for the second: the host never blocks on the device. On the CPU the path threads copy
synchronously, so ``issued`` means done and the caller's thread waits on it (the twin of the
device wait). A path that fails part-way still sets every layer's flag (a layer never waits
forever); its objects are failed.

The step's plans are one :class:`~saria.dataplane.transfer.load_job.StepJob` (one job a step, not
one per plan: it is made on the hook's thread), each item naming its plan. After the forward,
:meth:`StepLoad.end` returns each plan's result (failed objects, valid chunks, from that plan's
items only: known on the host once every layer is issued) without waiting for the device: the
forward's stream already waits for every layer's copies. What the copies still read (the SSD staging) is given back by the
engine's :class:`~saria.dataplane.transfer.retire.Retirer` once the device reached the last
layer's events. :meth:`StepLoad.finish` is the blocking form (closing, tests, benchmarks).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import torch

from saria.kernels import LayeredCopy, PageTable, default_max_programs, prepare_layered
from saria.orders import Tier

from saria.dataplane.devices import bind_thread, pool_initializer
from saria.dataplane.dram.host_pool import HostPool, host_address_refusal
from saria.dataplane.dram.staging import StagingPool
from saria.dataplane.dram.store import DramStore
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.transfer.flags import LayerFlags, LazyEvent
from saria.dataplane.transfer.load_job import LoadItem, StepJob
from saria.dataplane.transfer.results import TransferCounters
from saria.dataplane.transfer.retire import Retirer
from saria.dataplane.transfer.streams import Event, Streams
from saria.dataplane.transfer.tables import Tables, log

PATHS = ("dram", "ssd")


class _Path:
    """One path's work of one step: per layer, ``issued`` (set once the layer's copies are queued,
    or given up) and the device event recorded after them (``None``: nothing to wait for)."""

    def __init__(self, name: str, layers: int):
        self.name = name
        self.items: list[LoadItem] = []  # made by the path's thread (StepJob.take)
        self.issued = LayerFlags(layers)
        self.events: list[Event | None] = [None] * layers
        self.done = LazyEvent()  # every layer issued and every item finished on its job
        self.finished: set[int] = set()  # ids of the items finished on their jobs (a failure fails the rest)

    def layer_done(self, layer: int, event: Event | None) -> None:
        self.events[layer] = event
        self.issued.set(layer)

    def give_up(self) -> None:
        """Set every layer not issued yet: a waiter never hangs (the items are failed by the caller)."""
        self.issued.set_all()

    def finish(self, job: StepJob, item: LoadItem, event: Event | None = None,
               error: BaseException | None = None) -> None:
        self.finished.add(id(item))
        job.finish(item, event=event, error=error)

    def finish_all(self, work: list[tuple]) -> None:
        """Finish the delivered items on their jobs, with the last layer's event (every layer's
        copies are queued in order on one stream, so it follows all of them)."""
        event = self.events[-1] if self.events else None
        for job, item, *_ in work:
            self.finish(job, item, event=event)


class StepLoad:
    """One step's layer-wise reloads in flight (module docstring): ``job``, one
    :class:`~saria.dataplane.transfer.load_job.StepJob` for every plan of the step (its results one
    per plan, in the order submitted); :meth:`wait_layer` before the layer reads its pages,
    :meth:`end` once the step's forward is queued."""

    def __init__(self, job: StepJob, paths: list[_Path], layers: int, streams: Streams,
                 counters: TransferCounters, retirer: Retirer):
        self.job = job
        self.layers = layers
        self._paths = paths
        self._streams = streams
        self._counters = counters
        self._retirer = retirer
        self._keep: list[object] = []  # host buffers the device reads until the step's copies ran
        self._give: list[tuple] = []  # (pool, handle) of staging to give back then
        self._lock = threading.Lock()
        self._released = LazyEvent()  # the staging is given back (every copy ran)
        self._ended = False
        self._left = len(paths)  # paths whose thread has not ended its work on the step
        self._results: list | None = None  # the jobs' results, made by the last path thread to end
        self.waited = [False] * layers

    def wait_layer(self, layer: int) -> None:
        """Make the caller's current stream wait for layer ``layer``'s pages (CUDA: a device-side
        wait once its copies are queued; CPU: the host waits until they are copied)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} is not one of this step's {self.layers} layers")
        for path in self._paths:
            path.issued.wait(layer)
            event = path.events[layer]
            if event is not None:
                self._streams.wait(None, event)
        self.waited[layer] = True
        self._counters.add(layer_waits=1)

    def wait_all(self) -> None:
        """Make the caller's current stream wait for every layer (a forward that reaches no hook)."""
        for layer in range(self.layers):
            if not self.waited[layer]:
                self.wait_layer(layer)

    def end(self, timeout: float | None = None) -> list:
        """After the step's forward was queued: each job's
        :class:`~saria.dataplane.transfer.load_job.LoadResult`, in submission order, once every
        layer is issued (host work only: never waits for the device). The staging the copies read
        goes back once the device ran them (the engine's retire thread). Called again, returns the
        results again."""
        for path in self._paths:
            if not path.done.wait(timeout):
                raise TimeoutError(f"layer-wise {path.name} reloads not done after {timeout} s")
        results = self._results  # made by the last path thread (every item issued by then)
        if results is None:
            results = self.job.outcomes(timeout)
        if not self._paths:  # nothing to copy: no path thread hands the step to the retire thread
            with self._lock:
                ended, self._ended = self._ended, True
            if not ended:
                self._retirer.after((), self._release)
        return results

    def _path_ended(self, path: _Path) -> None:
        """A path thread ended its work on the step (every layer issued or given up, every item
        finished on its job): the last one makes the jobs' results (for :meth:`end`, off the hook's
        thread), then sets its ``done`` and hands the step to the retire thread, which gives the
        staging back once the device ran every layer's copies (not this hook's thread: a hand-off
        wakes the retire thread)."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self._results = self.job.outcomes(0)
            except Exception as exc:  # noqa: BLE001 - end() makes them itself
                log.warning("layer-wise reloads' results: %s", exc)
        path.done.set()
        if last:
            events = [event for path in self._paths for event in path.events if event is not None]
            self._retirer.after(events, self._release)

    def finish(self, timeout: float | None = None) -> list:
        """:meth:`end`, then wait until every copy of the step ran (host and device): the blocking
        form, for closing and for callers without a stream to order (benchmarks, tests)."""
        self.end(timeout)
        results = self.job.wait(timeout)
        if not self._released.wait(timeout):
            raise TimeoutError(f"layer-wise reloads' staging not given back after {timeout} s")
        return results

    def _release(self) -> None:
        """Every copy of the step ran: the staging goes back (the retire thread)."""
        self._keep.clear()
        give, self._give = self._give, []
        for pool, handle in give:
            pool.give(handle)
        self._released.set()


class LayerwiseLoads:
    """The layer-wise reload paths of one transfer engine: a DRAM thread and an SSD thread, each
    working through the steps submitted to it in order (module docstring).

    ``layers``: the kv table's tensors grouped by model layer (tensor indices; default one tensor
    per layer). ``capable`` is ``False`` when a page of some tensor would straddle two host slots
    (slot size not a multiple of the page layout), or when the device cannot read the host pool's
    registered memory at its host address (:func:`~saria.dataplane.dram.host_pool.host_address_refusal`,
    asked once here): such an engine reloads and stores whole only; ``refusal`` says why.
    The layer-wise saves (:mod:`~saria.dataplane.transfer.layer_saves`) share ``layers``,
    ``tensor_tables`` and ``page_offsets``."""

    def __init__(self, tables: Tables, host_pool: HostPool, dram: DramStore, ssd: SSDStore | None,
                 coordinator: Coordinator, streams: Streams, counters: TransferCounters,
                 layers: Sequence[Sequence[int]] | None = None, *, max_programs: int | None = None,
                 retirer: Retirer | None = None):
        table = tables.kv_table
        if layers is None:
            layers = [[t] for t in range(len(table))]
        layers = [list(group) for group in layers]
        flat = sorted(t for group in layers for t in group)
        if flat != list(range(len(table))) or any(not group for group in layers):
            raise ValueError(f"layers must group each of the kv table's {len(table)} tensors exactly once, "
                             f"got {layers}")
        self.tables = tables
        self.host_pool = host_pool
        self.dram = dram
        self.ssd = ssd
        self.coordinator = coordinator
        self.streams = streams
        self.counters = counters
        self.layers = layers
        # The cap on each layer's copy programs: None the default (COPY_MAX_PROGRAMS on CUDA, none on
        # the CPU or the interpreter), 0 none.
        if max_programs is None:
            max_programs = default_max_programs(streams.device)
        elif max_programs == 0:
            max_programs = None
        self.max_programs = max_programs
        self.backend = "auto"  # of the copies (saria.kernels.resolve_backend); tests set "torch" for the CPU twin
        self._own_retirer = retirer is None
        self.retirer = retirer if retirer is not None else Retirer(on_start=pool_initializer(streams.device))  # what waits for the device, off the hooks
        self._staging = StagingPool(torch.device("cpu"), keep=2)  # the CPU's SSD read-ahead buffers
        self.host_seconds: list[float] | None = None  # a list: each layer issue's host time is appended
        self.prepare_seconds: list[float] | None = None  # a list: each step's preparation (all layers) is appended
        ppc = tables.pages_per_chunk
        self.tensor_tables = [PageTable([t], names=[name]) for t, name in zip(table.tensors, table.names)]
        # Per tensor: each page's byte offset inside a kv object (the object's staging layout).
        self.page_offsets = [table.tensor_offsets[t] * ppc + torch.arange(ppc, dtype=torch.int64) * seg.page_bytes
                              for t, seg in enumerate(table.segments)]
        slot = host_pool.slot_bytes
        fits = all(bool(((offsets % slot) + seg.page_bytes <= slot).all())
                   for offsets, seg in zip(self.page_offsets, table.segments))
        # why not (None: capable): the copies address host slots by their host address
        self.refusal = "a page straddles two host slots" if not fits else \
            host_address_refusal(streams.device, host_pool.segment_addresses(), host_pool.pinned)
        self.capable = self.refusal is None
        self._queues = {name: queue.SimpleQueue() for name in PATHS}  # a put: C, no condition's Python
        self._threads = [threading.Thread(target=self._loop, args=(name,), name=f"saria-layers-{name}", daemon=True)
                         for name in PATHS]
        for thread in self._threads:
            thread.start()

    # --- submission (the caller's thread) --------------------------------------------------------

    def submit(self, job: StepJob, *, dram: bool = True, ssd: bool = True) -> StepLoad:
        """Start a step's reloads: ``job``, whose plans the engine checked (kv objects from DRAM or
        SSD); ``dram`` / ``ssd``: whether it has objects for that path (a path with none is not
        woken). Returns at once; never raises after the job was created (an object that cannot be
        moved is a failed object of its plan). Each path thread makes its items
        (:meth:`StepJob.take`), off this thread."""
        paths = [_Path(name, len(self.layers)) for name, has in (("dram", dram), ("ssd", ssd)) if has]
        step = StepLoad(job, paths, len(self.layers), self.streams, self.counters, self.retirer)
        self.counters.add(layerwise_steps=1, layerwise_objects=job.count)
        for path in paths:
            self._queues[path.name].put((step, path))
        return step

    def close(self) -> None:
        """Finish the steps queued and stop the threads."""
        for name in PATHS:
            self._queues[name].put(None)
        for thread in self._threads:
            thread.join()
        if self._own_retirer:
            self.retirer.close()

    # --- the path threads ------------------------------------------------------------------------

    def _loop(self, name: str) -> None:
        bind_thread(self.streams.device)
        run = self._run_dram if name == "dram" else self._run_ssd
        while True:
            work = self._queues[name].get()
            if work is None:
                return
            step, path = work
            job, items = step.job, None
            try:
                items = [(job, item) for item in job.take(name == "dram")]  # made here, not on the hook
                path.items = [item for _, item in items]
                run(step, path, items)
            except Exception as exc:  # never leaves a layer waiting or a job unfinished
                log.warning("layer-wise %s reload failed: %s", name.upper(), exc)
                if items is None:  # its items could not be made: every object of the path fails
                    self.counters.add(load_failures=job.abandon(name == "dram"))
                else:
                    left = [(job, item) for job, item in items if id(item) not in path.finished]
                    self.counters.add(load_failures=len(left))
                    for job, item in left:
                        job.finish(item, error=exc)
            finally:  # the failed items are failed first: a waiter wakes to them
                path.give_up()
                step._path_ended(path)  # sets path.done

    def _run_dram(self, step: StepLoad, path: _Path, work: list[tuple[StepJob, LoadItem]]) -> None:
        present = []
        for job, item in work:
            obj = self.dram.get(item.key)
            if obj is None or obj.nbytes != item.nbytes:
                self.counters.add(load_failures=1, missing_dram_objects=int(obj is None))
                path.finish(job, item, error=LookupError(f"{item.key} is not in DRAM as its pages need it"))
            else:
                present.append((job, item, obj.slots))
        if not present:
            return
        t0 = time.perf_counter()
        self._issue(step, path, lambda: self._dram_copies(present), pace=True)
        path.finish_all(present)
        self.counters.add(dram_to_gpu_bytes=sum(item.nbytes for _, item, _ in present),
                          dram_to_gpu_seconds=time.perf_counter() - t0)

    def _run_ssd(self, step: StepLoad, path: _Path, work: list[tuple[StepJob, LoadItem]]) -> None:
        t0 = time.perf_counter()
        total = sum(item.nbytes for _, item in work)
        if self.streams.cuda:  # pinned: the copy kernel reads it by address (torch's host allocator reuses it)
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            step._keep.append(staging)
        else:  # page-aligned and reused: O_DIRECT reads land in it, no page faults on warm buffers
            handle, staging = self._staging.take(total)
            step._keep.append(staging)
            step._give.append((self._staging, handle))
        bases, offset = [], 0
        for _, item in work:
            bases.append(offset)
            offset += item.nbytes
        self.coordinator.ssd_begin(len(work))
        ended = 0
        try:
            futures = self.ssd.read_many([object_key(i.key.chunk, i.key.kind) for _, i in work],
                                         [staging[b:b + i.nbytes] for b, (_, i) in zip(bases, work)])
            arrived = []
            for (job, item), base, future in zip(work, bases, futures):
                error = future if isinstance(future, BaseException) else future.exception()
                self.coordinator.ssd_end()
                ended += 1
                if error is not None:
                    log.warning("SSD reload of %s failed: %s", item.key, error)
                    self.counters.add(load_failures=1)
                    path.finish(job, item, error=error)
                else:
                    arrived.append((job, item, base))
        finally:
            for _ in range(len(work) - ended):
                self.coordinator.ssd_end()
        if not arrived:
            return
        self.counters.add(ssd_to_gpu_bytes=sum(i.nbytes for _, i, _ in arrived),
                          ssd_to_gpu_seconds=time.perf_counter() - t0)
        self._issue(step, path, lambda: self._ssd_copies(staging, arrived), pace=False)
        path.finish_all(arrived)

    def _issue(self, step: StepLoad, path: _Path, prepare, *, pace: bool) -> None:
        """Prepare every layer's copy at once (``prepare``: one pass, its work array uploaded on the
        path's stream), then queue each layer's launch on that stream (after the caller's queued
        work), record its event, set ``issued``: per layer a launch and an event."""
        after = step.job.after
        with self.streams.on(path.name):
            if after is not None:
                self.streams.wait(path.name, after)
            t0 = time.perf_counter()
            copy = prepare()
            if self.prepare_seconds is not None:
                self.prepare_seconds.append(time.perf_counter() - t0)
            for layer in range(len(self.layers)):
                nbytes = copy.nbytes[layer]
                if pace and nbytes:
                    self.coordinator.acquire(nbytes)
                t0 = time.perf_counter()
                try:
                    copy.launch(layer)
                except BaseException:  # what was launched still reads the staging: the retire waits for it
                    path.events[layer] = self.streams.record(path.name)
                    raise
                path.layer_done(layer, self.streams.record(path.name))  # CPU: its HostEvent twin
                if self.host_seconds is not None:  # a benchmark reads the host cost of each layer's issue
                    self.host_seconds.append(time.perf_counter() - t0)
                self.counters.add(layer_copies=int(nbytes > 0))

    # --- what each layer copies (worked out once per step) ---------------------------------------

    def _dram_copies(self, present: list[tuple[StepJob, LoadItem, list[int]]]) -> LayeredCopy:
        """Every layer's copy out of the host slots (:func:`slot_layout`), the leading pages an
        item skips left out."""
        ids = torch.stack([item.blocks.on(torch.device("cpu")) for _, item, _ in present])  # [object, page]
        keep = None
        if any(item.skip for _, item, _ in present):
            keep = torch.ones_like(ids, dtype=torch.bool)
            for o, (_, item, _) in enumerate(present):
                keep[o, :item.skip] = False
        buffers, chosen, where, offsets = slot_layout(self.host_pool, self.page_offsets,
                                                      [slots for _, _, slots in present], ids, keep)
        return self.prepare(buffers, chosen, where, offsets, pack=False)

    def _ssd_copies(self, staging: torch.Tensor, arrived: list[tuple[StepJob, LoadItem, int]]) -> LayeredCopy:
        """Every layer's copy out of the step's SSD staging."""
        offsets = torch.stack(self.page_offsets)  # [tensor, page of an object]
        offs = torch.cat([offsets[:, item.skip:] + base for _, item, base in arrived], dim=1)
        ids = torch.cat([item.blocks.on(torch.device("cpu"))[item.skip:] for _, item, _ in arrived])
        return self.prepare([staging], ids, None, offs, pack=False)

    def prepare(self, buffers: list[torch.Tensor], ids: torch.Tensor, where: torch.Tensor | None,
                offsets: torch.Tensor, *, pack: bool) -> LayeredCopy:
        """One step's copies of every layer (:func:`~saria.kernels.prepare_layered`), checked and
        built in one pass; on CUDA the work array is uploaded on the current stream."""
        return prepare_layered(self.tables.kv_table, self.layers, buffers, ids, where, offsets, pack=pack,
                               backend=self.backend, max_programs=self.max_programs, tensor_tables=self.tensor_tables)


class LayerLaunch:
    """Layer ``layer`` of a :class:`~saria.kernels.LayeredCopy`, as a copy to :meth:`launch`."""

    __slots__ = ("copy", "layer")

    def __init__(self, copy: LayeredCopy, layer: int):
        self.copy, self.layer = copy, layer

    def launch(self) -> None:
        self.copy.launch(self.layer)


def slot_layout(host_pool: HostPool, page_offsets: list[torch.Tensor], slots: Sequence[Sequence[int]],
                ids: torch.Tensor, keep: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the pages of objects held in host slots lie in the pool's memory, for the step-wide
    copies (layer-wise reloads read them there, layer-wise saves write them there).

    ``page_offsets[t]``: each page's byte offset of tensor ``t`` inside an object (its packed
    layout); ``slots[o]``: object ``o``'s slots (its part ``k``, bytes ``[k * slot_bytes, (k + 1) *
    slot_bytes)``, in ``slots[o][k]``); ``ids`` int64 ``[objects, pages]``: their block ids;
    ``keep`` bool ``[objects, pages]``: the pages to copy (default all). Returns ``(buffers, ids,
    where, offsets)`` as :func:`~saria.kernels.prepare_layered` takes them: the host pool segments
    holding some of the pages, the ``n`` ids kept, and per (tensor, kept page) its segment's index
    and byte offset in it. Worked out for all objects and tensors at once; a page never straddles
    two slots (``LayerwiseLoads.capable``)."""
    slot_bytes = host_pool.slot_bytes
    parts = max(len(s) for s in slots)
    buffers: list[torch.Tensor] = []
    index: dict[int, int] = {}
    # [object, part] -> segment index / offset in it, as lists (an item assignment into a tensor
    # costs microseconds, and a step places hundreds of slots)
    seg_list = [[0] * parts for _ in slots]
    start_list = [[0] * parts for _ in slots]
    for o, held in enumerate(slots):
        for k, slot in enumerate(held):
            segment, start = host_pool.locate(slot)
            b = index.get(segment.data_ptr())
            if b is None:
                b = index[segment.data_ptr()] = len(buffers)
                buffers.append(segment)
            seg_list[o][k], start_list[o][k] = b, start
    seg_of = torch.tensor(seg_list, dtype=torch.int64)
    start_of = torch.tensor(start_list, dtype=torch.int64)
    offsets = torch.stack(page_offsets)  # [tensor, page]
    part, inner = offsets // slot_bytes, offsets % slot_bytes
    # [tensor, object, page] as flat [object, part] indices (torch.take: a broadcast multi-dimensional
    # index cost milliseconds for these few thousand elements, with torch's threads busy)
    flat = torch.arange(len(slots)).view(1, -1, 1) * parts + part.unsqueeze(1)
    where = torch.take(seg_of, flat)
    places = torch.take(start_of, flat) + inner.unsqueeze(1)
    if keep is None:
        return buffers, ids.reshape(-1), where.reshape(len(page_offsets), -1), places.reshape(len(page_offsets), -1)
    return buffers, ids[keep], where[:, keep], places[:, keep]
