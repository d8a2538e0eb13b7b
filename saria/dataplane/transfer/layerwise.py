"""Layer-wise reloads: one step's reloads moved layer by layer, so that the engine's forward pass
computes layer ``l`` while the pages of layer ``l + 1`` are still arriving (vLLM's per-layer hooks;
docs/vllm.md, "Layer-wise reloads").

:meth:`LayerwiseLoads.submit` takes a step's reloads (kv objects only: a hybrid model's state
object has no layer hook and loads whole, :meth:`TransferEngine.load`) and returns a
:class:`StepLoad` at once. Everything a layer's copy needs is worked out once, when the step is
submitted, so that each layer costs a few launches:

* **DRAM objects**: each layer's pages are copied straight out of the host slots, with one
  :func:`~saria.kernels.prepare_scattered` copy per (tensor, host pool segment) holding them (on
  CUDA a kernel that reads the pinned slots by address; on the CPU slice copies), on the ``dram``
  stream, layer after layer, each layer's bytes released by the coordinator first (Eq. 4).
* **SSD objects**: read whole, as the SSD path reads them (verified or opened on the store's reader
  threads), into one host staging per step (pinned on CUDA): the SSD read runs ahead. Once every
  read of the step ended, each layer's pages of the objects that arrived are copied out of it on
  the ``ssd`` stream. An object that failed its read is never copied, at no layer: its load fails,
  and its chunk and every chunk after it in its plan are recomputed by the engine.

Per layer and path the step keeps a host event ``issued`` (the layer's copies are queued) and, on
CUDA, a device event recorded after them. :meth:`StepLoad.wait_layer` waits for the first and
makes the caller's current stream wait for the second: the host never blocks on the device. On the
CPU the path threads copy synchronously, so ``issued`` means done and the caller's thread waits on
it (the twin of the device wait). A path that fails part-way still sets every layer's event (a
layer never waits forever); its objects are failed.

Each plan is a :class:`~saria.dataplane.transfer.load_job.LoadJob` as for whole reloads: its
result (failed objects, valid chunks) is ready once :meth:`StepLoad.finish` returns.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from saria.kernels import PageTable, prepare_scattered
from saria.orders import Tier

from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.dram.staging import StagingPool
from saria.dataplane.dram.store import DramStore
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.transfer.load_job import LoadItem, LoadJob
from saria.dataplane.transfer.results import TransferCounters
from saria.dataplane.transfer.streams import Event, Streams
from saria.dataplane.transfer.tables import Tables, log

PATHS = ("dram", "ssd")


class _Path:
    """One path's work of one step: per layer, ``issued`` (set once the layer's copies are queued,
    or given up) and the device event recorded after them (``None``: nothing to wait for)."""

    def __init__(self, name: str, layers: int, items: list[LoadItem]):
        self.name = name
        self.items = items
        self.issued = [threading.Event() for _ in range(layers)]
        self.events: list[Event | None] = [None] * layers
        self.done = threading.Event()  # every layer issued and every item finished on its job
        self.finished: set[int] = set()  # ids of the items finished on their jobs (a failure fails the rest)

    def layer_done(self, layer: int, event: Event | None) -> None:
        self.events[layer] = event
        self.issued[layer].set()

    def give_up(self) -> None:
        """Set every layer not issued yet: a waiter never hangs (the items are failed by the caller)."""
        for flag in self.issued:
            flag.set()

    def finish(self, job: LoadJob, item: LoadItem, event: Event | None = None,
               error: BaseException | None = None) -> None:
        self.finished.add(id(item))
        job.finish(item, event=event, error=error)

    def finish_all(self, work: list[tuple]) -> None:
        """Finish the delivered items on their jobs, with the last layer's event (every layer's
        copies are queued in order on one stream, so it follows all of them)."""
        event = self.events[-1] if self.events else None
        for job, item, *_ in work:
            self.finish(job, item, event=event)


@dataclass
class _Copies:
    """One layer's prepared copies (one per tensor and source buffer) and the bytes they move."""

    copies: list = field(default_factory=list)
    nbytes: int = 0


class StepLoad:
    """One step's layer-wise reloads in flight (module docstring): ``jobs`` (one per plan, in the
    order submitted); :meth:`wait_layer` before the layer reads its pages, :meth:`finish` once the
    step's forward is queued."""

    def __init__(self, jobs: list[LoadJob], paths: list[_Path], layers: int, streams: Streams,
                 counters: TransferCounters):
        self.jobs = jobs
        self.layers = layers
        self._paths = paths
        self._streams = streams
        self._counters = counters
        self._keep: list[object] = []  # host buffers the device reads until finish()
        self._give: list[tuple] = []  # (pool, handle) of staging to give back at finish()
        self.waited = [False] * layers

    def wait_layer(self, layer: int) -> None:
        """Make the caller's current stream wait for layer ``layer``'s pages (CUDA: a device-side
        wait once its copies are queued; CPU: the host waits until they are copied)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} is not one of this step's {self.layers} layers")
        for path in self._paths:
            path.issued[layer].wait()
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

    def finish(self, timeout: float | None = None) -> list:
        """Wait until every copy of the step ran (host and device) and return each job's
        :class:`~saria.dataplane.transfer.load_job.LoadResult`, in submission order."""
        for path in self._paths:
            if not path.done.wait(timeout):
                raise TimeoutError(f"layer-wise {path.name} reloads not done after {timeout} s")
        results = [job.wait(timeout) for job in self.jobs]
        self._keep.clear()
        give, self._give = self._give, []
        for pool, handle in give:
            pool.give(handle)
        return results


class LayerwiseLoads:
    """The layer-wise reload paths of one transfer engine: a DRAM thread and an SSD thread, each
    working through the steps submitted to it in order (module docstring).

    ``layers``: the kv table's tensors grouped by model layer (tensor indices; default one tensor
    per layer). ``capable`` is ``False`` when a page of some tensor would straddle two host slots
    (slot size not a multiple of the page layout): such an engine reloads and stores whole only.
    The layer-wise saves (:mod:`~saria.dataplane.transfer.layer_saves`) share ``layers``,
    ``tensor_tables`` and ``page_offsets``."""

    def __init__(self, tables: Tables, host_pool: HostPool, dram: DramStore, ssd: SSDStore | None,
                 coordinator: Coordinator, streams: Streams, counters: TransferCounters,
                 layers: Sequence[Sequence[int]] | None = None, *, max_programs: int | None = None):
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
        self.max_programs = max_programs
        self._staging = StagingPool(torch.device("cpu"), keep=2)  # the CPU's SSD read-ahead buffers
        self.host_seconds: list[float] | None = None  # a list: each layer issue's host time is appended
        self.prepare_seconds: list[float] | None = None  # a list: each layer's precompute (checks) is appended
        ppc = tables.pages_per_chunk
        self.tensor_tables = [PageTable([t], names=[name]) for t, name in zip(table.tensors, table.names)]
        # Per tensor: each page's byte offset inside a kv object (the object's staging layout).
        self.page_offsets = [table.tensor_offsets[t] * ppc + torch.arange(ppc, dtype=torch.int64) * seg.page_bytes
                              for t, seg in enumerate(table.segments)]
        slot = host_pool.slot_bytes
        self.capable = all(bool(((offsets % slot) + seg.page_bytes <= slot).all())
                           for offsets, seg in zip(self.page_offsets, table.segments))
        self._queues = {name: queue.Queue() for name in PATHS}
        self._threads = [threading.Thread(target=self._loop, args=(name,), name=f"saria-layers-{name}", daemon=True)
                         for name in PATHS]
        for thread in self._threads:
            thread.start()

    # --- submission (the caller's thread) --------------------------------------------------------

    def submit(self, jobs: list[LoadJob]) -> StepLoad:
        """Start a step's reloads: ``jobs`` whose items are kv objects from DRAM or SSD (checked by
        the engine). Returns at once; never raises after a job was created (an object that cannot
        be moved is a failed object of its job)."""
        items = {name: [] for name in PATHS}
        for job in jobs:
            for item in job.items:
                items["dram" if item.tier is Tier.DRAM else "ssd"].append((job, item))
        paths = [_Path(name, len(self.layers), [i for _, i in work]) for name, work in items.items() if work]
        step = StepLoad(jobs, paths, len(self.layers), self.streams, self.counters)
        self.counters.add(layerwise_steps=1, layerwise_objects=sum(len(w) for w in items.values()))
        for path in paths:
            self._queues[path.name].put((step, path, items[path.name]))
        return step

    def close(self) -> None:
        """Finish the steps queued and stop the threads."""
        for name in PATHS:
            self._queues[name].put(None)
        for thread in self._threads:
            thread.join()

    # --- the path threads ------------------------------------------------------------------------

    def _loop(self, name: str) -> None:
        run = self._run_dram if name == "dram" else self._run_ssd
        while True:
            work = self._queues[name].get()
            if work is None:
                return
            step, path, items = work
            try:
                run(step, path, items)
            except Exception as exc:  # never leaves a layer waiting or a job unfinished
                log.warning("layer-wise %s reload failed: %s", name.upper(), exc)
                left = [(job, item) for job, item in items if id(item) not in path.finished]
                self.counters.add(load_failures=len(left))
                for job, item in left:
                    job.finish(item, error=exc)
            finally:  # the failed items are failed first: a waiter wakes to them
                path.give_up()
                path.done.set()

    def _run_dram(self, step: StepLoad, path: _Path, work: list[tuple[LoadJob, LoadItem]]) -> None:
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
        self._issue(step, path, self._dram_copies(present), pace=True)
        path.finish_all(present)
        self.counters.add(dram_to_gpu_bytes=sum(item.nbytes for _, item, _ in present),
                          dram_to_gpu_seconds=time.perf_counter() - t0)

    def _run_ssd(self, step: StepLoad, path: _Path, work: list[tuple[LoadJob, LoadItem]]) -> None:
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
        self._issue(step, path, self._ssd_copies(staging, arrived), pace=False)
        path.finish_all(arrived)

    def _issue(self, step: StepLoad, path: _Path, layers, *, pace: bool) -> None:
        """Queue each layer's copies on the path's stream (after the caller's queued work), record
        its event, set ``issued``."""
        after = step.jobs[0].after if step.jobs else None
        with self.streams.on(path.name):
            if after is not None:
                self.streams.wait(path.name, after)
            prepared = iter(layers)
            for layer in range(len(self.layers)):
                t0 = time.perf_counter()
                copies = next(prepared)
                if self.prepare_seconds is not None:
                    self.prepare_seconds.append(time.perf_counter() - t0)
                if pace and copies.nbytes:
                    self.coordinator.acquire(copies.nbytes)
                t0 = time.perf_counter()
                for copy in copies.copies:
                    copy.launch()
                path.layer_done(layer, self.streams.record(path.name) if self.streams.cuda else None)
                if self.host_seconds is not None:  # a benchmark reads the host cost of each layer's issue
                    self.host_seconds.append(time.perf_counter() - t0)
                self.counters.add(layer_copies=len(copies.copies))

    # --- what each layer copies (worked out once per step) ---------------------------------------

    def _dram_copies(self, present: list[tuple[LoadJob, LoadItem, list[int]]]):
        """Per layer, one scattered copy per (tensor, host pool segment) holding the layer's pages
        (:func:`slot_places`), the leading pages an item skips left out."""
        ids = torch.stack([item.blocks.on(torch.device("cpu")) for _, item, _ in present])  # [object, page]
        keep = torch.ones_like(ids, dtype=torch.bool)
        for o, (_, item, _) in enumerate(present):
            keep[o, :item.skip] = False
        return self._prepare(slot_places(self.host_pool, self.page_offsets, [slots for _, _, slots in present],
                                         ids, keep))

    def _ssd_copies(self, staging: torch.Tensor, arrived: list[tuple[LoadJob, LoadItem, int]]):
        """Per layer, one scattered copy per tensor out of the step's SSD staging."""
        per_tensor = []
        for offsets in self.page_offsets:
            offs = [offsets[item.skip:] + base for _, item, base in arrived]
            ids = [item.blocks.on(torch.device("cpu"))[item.skip:] for _, item, _ in arrived]
            per_tensor.append([(staging, torch.cat(offs), torch.cat(ids))])
        return self._prepare(per_tensor)

    def _prepare(self, per_tensor: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]):
        """Each layer's prepared unpacks in turn (:func:`prepare_layers`, lazily: the checks of
        layer ``l + 1`` run while the copies of layer ``l`` are already on their way)."""
        return prepare_layers(self.layers, self.tensor_tables, per_tensor, pack=False, max_programs=self.max_programs)


def slot_places(host_pool: HostPool, page_offsets: list[torch.Tensor], slots: Sequence[Sequence[int]],
                ids: torch.Tensor, keep: torch.Tensor | None = None
                ) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Where the pages of objects held in host slots lie in the pool's memory, for scattered copies
    (layer-wise reloads read them there, layer-wise saves write them there).

    ``page_offsets[t]``: each page's byte offset of tensor ``t`` inside an object (its packed
    layout); ``slots[o]``: object ``o``'s slots (its part ``k``, bytes ``[k * slot_bytes, (k + 1) *
    slot_bytes)``, in ``slots[o][k]``); ``ids`` int64 ``[objects, pages]``: their block ids;
    ``keep`` bool ``[objects, pages]``: the pages to copy (default all). Returns, per tensor, one
    ``(segment, byte offsets in it, block ids)`` per host pool segment holding some of them. Worked
    out for all objects at once; a page never straddles two slots (``LayerwiseLoads.capable``)."""
    slot_bytes = host_pool.slot_bytes
    parts = max(len(s) for s in slots)
    segments: dict[int, int] = {}  # segment address -> its index, in the order first met
    found: list[torch.Tensor] = []
    seg_of = [[0] * parts for _ in slots]  # [object, part] -> segment index
    start_of = [[0] * parts for _ in slots]  # [object, part] -> offset in it
    for o, held in enumerate(slots):
        for k, slot in enumerate(held):
            segment, start = host_pool.locate(slot)
            index = segments.setdefault(segment.data_ptr(), len(segments))
            if index == len(found):
                found.append(segment)
            seg_of[o][k], start_of[o][k] = index, start
    # Every tensor at once (a few tensor ops per step, not per tensor): [tensors, objects, pages].
    offsets = torch.stack(list(page_offsets))
    part, inner = offsets // slot_bytes, offsets % slot_bytes
    # [object, part] looked up as flat indices (torch.take: a multi-dimensional advanced index with
    # broadcast indices costs milliseconds here, for a few thousand elements)
    flat = torch.arange(len(slots)).view(-1, 1, 1) * parts + part.unsqueeze(0)
    where = (torch.take(torch.tensor(start_of, dtype=torch.int64), flat) + inner.unsqueeze(0)).transpose(0, 1)
    tensors = offsets.shape[0]
    if keep is None:
        chosen = ids.reshape(-1)
        where = where.reshape(tensors, -1)
    else:
        chosen = ids[keep]
        where = where[:, keep]
    if len(found) == 1:
        return [[(found[0], where[t], chosen)] for t in range(tensors)]
    seg = torch.take(torch.tensor(seg_of, dtype=torch.int64), flat).transpose(0, 1)
    seg = seg.reshape(tensors, -1) if keep is None else seg[:, keep]
    # Split each tensor's pages by segment, keeping their order: a stable sort on (tensor, segment).
    count = len(found)
    key = (seg + count * torch.arange(tensors).unsqueeze(1)).reshape(-1)
    order = torch.sort(key, stable=True).indices
    sizes = torch.bincount(key, minlength=tensors * count).tolist()
    where_parts = where.reshape(-1)[order].split(sizes)
    chosen_parts = chosen.repeat(tensors)[order].split(sizes)
    return [[(found[i], where_parts[t * count + i], chosen_parts[t * count + i])
             for i in range(count) if sizes[t * count + i]] for t in range(tensors)]


def prepare_layers(layers: list[list[int]], tensor_tables: list[PageTable],
                   per_tensor: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], *, pack: bool,
                   max_programs: int | None):
    """Yield each layer's prepared copies (``layers``: tensor indices per layer): one
    :func:`~saria.kernels.prepare_scattered` per ``(buffer, offsets, ids)`` of each of its tensors
    (``per_tensor``, as :func:`slot_places` gives them); ``pack``: pages -> buffer."""
    for group in layers:
        out = _Copies()
        for t in group:
            for buffer, offsets, ids in per_tensor[t]:
                copy = prepare_scattered(buffer, offsets.view(1, -1), tensor_tables[t], ids, pack=pack,
                                         max_programs=max_programs)
                out.copies.append(copy)
                out.nbytes += copy.nbytes
        yield out
