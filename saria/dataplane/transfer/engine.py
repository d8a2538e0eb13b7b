"""The transfer engine: executes the control plane's plans and orders against an engine's paged
KV cache, the host pool (DRAM tier) and the SSD store, on separate queues.

:class:`TransferEngine` is the facade: it checks every plan and order, splits a reload's objects
between the two reload paths, and hands stores and writes to the offload path. Each path is its
own module, owning its thread(s) and (on CUDA) its own stream:

* **DRAM -> GPU** (:mod:`~saria.dataplane.transfer.dram_loads`, ``dram`` stream): every request's DRAM
  objects in submission order, batch by batch, each host-slot-sized slice paced by the
  :class:`~saria.dataplane.transfer.coordinator.Coordinator` (Eq. 4), one unpack per batch.
* **SSD -> GPU** (:mod:`~saria.dataplane.transfer.ssd_loads`, ``ssd`` stream): one
  :meth:`~saria.dataplane.ssd.store.SSDStore.read_many` per batch into one staging, verified on
  the reader threads, one hand-off to the unpack thread, one unpack per run of arrived objects.
* **Layer by layer, DRAM and SSD -> GPU** (:mod:`~saria.dataplane.transfer.layerwise`, ``dram`` and
  ``ssd`` streams): one step's reloads with one event per layer (:meth:`TransferEngine.load_layers`),
  each layer's pages copied straight out of the host slots or an SSD read-ahead staging.
* **GPU -> DRAM** (:mod:`~saria.dataplane.transfer.stores`, ``offload`` stream): stores and
  promotions packed, checksummed per host-slot part and copied into host slots; layer by layer
  (:mod:`~saria.dataplane.transfer.layer_saves`), each layer's pages copied straight into the slots.
* **DRAM/GPU -> SSD** (:mod:`~saria.dataplane.transfer.writes`): writes from DRAM slots or from
  freshly packed GPU staging (both packing paths share the offload thread of
  :mod:`~saria.dataplane.transfer.packing`).
* **SSD -> DRAM** (:mod:`~saria.dataplane.transfer.prewarm`, ``prewarm`` thread): prewarms.

What they share: page tables and the unpack (:mod:`~saria.dataplane.transfer.tables`), results and
counters (:mod:`~saria.dataplane.transfer.results`), streams (:mod:`~saria.dataplane.transfer.streams`).
The data plane costs bytes, not objects: a reload's objects travel in batches (at most
``batch_bytes`` each, one page table), each batch landing in one staging (the objects' packed
bytes back to back, which is exactly what :func:`~saria.kernels.pack_pages` makes for a 2-D
``[objects, pages]`` id tensor) and unpacked by one launch; stores and writes pack every object of
an order with one launch per object kind.

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

import threading
from concurrent.futures import Future
from typing import Hashable, Iterable, Mapping, Sequence

import torch

from saria.orders import DRAM, KV, SSD, STATE, DropOrder, ObjectKey, Order, PromoteOrder, ReloadPlan, StoreOrder, \
    Tier, WriteOrder
from saria.kernels import PageTable, warm_kernels

from saria.dataplane.devices import pool_initializer
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.dram.staging import StagingPool
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.transfer.dram_loads import DramLoads
from saria.dataplane.transfer.layer_saves import LayerSaves, StepSave
from saria.dataplane.transfer.layerwise import LayerwiseLoads, StepLoad
from saria.dataplane.transfer.retire import Retirer
from saria.dataplane.transfer.load_job import LoadItem, LoadJob, LoadResult, StepJob
from saria.dataplane.transfer.packing import Packer
from saria.dataplane.transfer.prewarm import Prewarms
from saria.dataplane.transfer.results import Completion, EngineCounters, OrderRun, TransferCounters
from saria.dataplane.transfer.ssd_loads import SsdLoads
from saria.dataplane.transfer.stores import Stores
from saria.dataplane.transfer.streams import Streams
from saria.dataplane.transfer.tables import Blocks, Tables
from saria.dataplane.transfer.writes import Writes

__all__ = ["Blocks", "Completion", "DramObject", "DramStore", "EngineCounters", "LoadItem", "LoadJob", "LoadResult",
           "OrderRun", "TransferEngine"]


class TransferEngine:
    """Moves objects between an engine's paged KV cache, the host pool and the SSD store.

    ``kv_table``: the engine's full-attention pages (one :class:`PageTable` over every layer);
    a chunk's kv object is ``pack_pages(kv_table, its pages_per_chunk block ids)``.
    ``state_table``: hybrid models' GDN state pages (a state object is ``state_pages`` of them).
    ``ssd_dtype`` (:mod:`saria.ssd_dtype`): ``"auto"`` stores SSD objects as packed, and then
    ``host_pool.slot_bytes`` must equal ``ssd.part_bytes``: a host slot is an SSD part, so SSD
    writes go straight from slots and per-part checksums are computed once, at pack time.
    ``"fp8"`` stores kv objects on SSD in their FP8 form (``kv_ssd_bytes``): packed by the
    quantizing kernel from the pages, quantized from a DRAM copy on the offload thread, dequantized
    by the unpack on reload and by a prewarm into DRAM; SSD parts may then be of any size.
    """

    def __init__(self, kv_table: PageTable, *, host_pool: HostPool, coordinator: Coordinator,
                 pages_per_chunk: int, ssd: SSDStore | None = None, state_table: PageTable | None = None,
                 state_pages: int = 1, batch_bytes: int = 256 << 20, ssd_dtype: str = "auto"):
        if pages_per_chunk < 1:
            raise ValueError(f"pages_per_chunk must be >= 1, got {pages_per_chunk}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        if state_table is not None and state_pages < 1:
            raise ValueError(f"state_pages must be >= 1, got {state_pages}")
        if state_table is not None and state_table.device != kv_table.device:
            raise ValueError(f"state pages are on {state_table.device}, KV pages on {kv_table.device}")
        self._tables = Tables(kv_table, state_table, pages_per_chunk, state_pages, ssd_dtype)
        if ssd is not None and ssd.part_bytes != host_pool.slot_bytes and ssd_dtype == "auto":
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
        self.kv_bytes = self._tables.kv_bytes
        self.state_bytes = self._tables.state_bytes
        self.ssd_dtype = ssd_dtype
        self.kv_ssd_bytes = self._tables.kv_ssd_bytes
        self.dram = DramStore(host_pool)
        self._counters = TransferCounters()
        self._streams = Streams(self.device)
        staging = StagingPool(self.device)
        self._ssd_loads = SsdLoads(ssd, coordinator, self._streams, self._counters, staging, batch_bytes)
        self._dram_loads = DramLoads(self.dram, coordinator, self._streams, self._counters, staging, batch_bytes)
        self._packer = Packer(self._tables, host_pool, self._streams)
        self._stores = Stores(self._packer, host_pool, self.dram, self._counters)
        self._writes = Writes(self._packer, self._tables, self.dram, ssd, self._counters)
        self._prewarms = Prewarms(self._tables, host_pool, self.dram, ssd, self._counters)
        self._layerwise: LayerwiseLoads | None = None  # started by the first load_layers()
        self._layer_saves: LayerSaves | None = None  # started by the first store_layers()
        self._retirer = Retirer(on_start=pool_initializer(self.device))  # what waits for the device, off the hooks' thread (retire())
        self._closed = False

    @property
    def batch_bytes(self) -> int:
        """The most bytes a reload batch holds (one staging, one unpack launch) on either path."""
        return self._dram_loads.batch_bytes

    @batch_bytes.setter
    def batch_bytes(self, value: int) -> None:
        self._dram_loads.batch_bytes = self._ssd_loads.batch_bytes = value

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the transfer engine is closed")

    def dram_object(self, chunk: Hashable, kind: str = KV) -> DramObject | None:
        """The DRAM copy of an object, or ``None`` (see :attr:`dram`, the :class:`DramStore`)."""
        return self.dram.get(ObjectKey(chunk, kind))

    def dram_objects(self) -> int:
        """How many objects are resident in DRAM."""
        return len(self.dram)

    def pages_moved(self) -> bool:
        """Whether a paged tensor of the engine's tables moved or changed since they were built
        (:meth:`PageTable.verify` fails: e.g. an engine that re-allocated its KV cache on waking
        from sleep). Every copy refuses a stale table; the caller builds a new engine over the
        tensors as they are."""
        for table in (self._tables.kv_table, self._tables.state_table):
            if table is None:
                continue
            try:
                table.verify()
            except ValueError:  # StaleTableError
                return True
        return False

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
        items = self._kv_items(plan, kv_blocks, skip_pages)
        if plan.state_chunk is not None:
            index = plan.chunk_hashes.index(plan.state_chunk)
            table, _, nbytes = self._tables.table(STATE)
            items.append(LoadItem(index, ObjectKey(plan.state_chunk, STATE), plan.state_source, table,
                                   self._tables.ids(STATE, f"the state object of chunk {index} of plan {plan.plan_id}",
                                                    state_blocks), nbytes))
        if any(i.tier is Tier.SSD for i in items) and self.ssd is None:
            raise ValueError(f"plan {plan.plan_id} reads from SSD but this engine has no SSD store")
        # The unpacks follow the caller's queued work (pages freed by a step still running may be
        # written only after it); a timeline's device-timed points are measured from start_event.
        job = LoadJob(plan, items, timeline,
                      start_event=self._streams.record("dram", timing=True) if timeline is not None else None,
                      after=self._streams.caller_event())
        self._counters.add(loads=1, load_objects=len(items))
        dram_items = [i for i in items if i.tier is Tier.DRAM]
        ssd_items = [i for i in items if i.tier is Tier.SSD]
        if plan.serial and dram_items:
            job.then(self._ssd_loads.submit, ssd_items)  # started by the DRAM thread once the DRAM part is issued
        else:
            self._ssd_loads.submit(job, ssd_items)
        if dram_items:
            self._dram_loads.submit(job, dram_items)
        return job

    def _kv_items(self, plan: ReloadPlan, kv_blocks: Sequence[Blocks], skip_pages: int) -> list[LoadItem]:
        """The plan's kv objects as load items, their block ids checked (``ValueError``)."""
        if len(kv_blocks) != plan.num_chunks:
            raise ValueError(f"plan {plan.plan_id} has {plan.num_chunks} chunks but {len(kv_blocks)} block lists")
        items = []
        fp8 = self._tables.quantized(KV)
        for i, (chunk, tier, blocks) in enumerate(zip(plan.chunk_hashes, plan.kv_sources, kv_blocks)):
            quantized = fp8 and tier is Tier.SSD  # arrives in its FP8 form, dequantized by the unpack
            ids = self._tables.ids(KV, f"the kv object of chunk {i} of plan {plan.plan_id}", blocks)
            items.append(LoadItem(i, ObjectKey(chunk, KV), tier, self.kv_table, ids,
                                   self.kv_ssd_bytes if quantized else self.kv_bytes, quantized=quantized))
        if not 0 <= skip_pages < self.pages_per_chunk or (skip_pages and not items):
            raise ValueError(f"skip_pages must be in [0, {self.pages_per_chunk}) and needs a chunk, got {skip_pages}")
        if items:
            items[0].skip = skip_pages
        return items

    def warm_kernels(self) -> list[tuple]:
        """Compile every kernel variant this engine can launch (:func:`saria.kernels.warm_kernels`):
        its tables' pack and unpack, FP8 with ``ssd_dtype=fp8``, and, once :meth:`layerwise` made its
        paths, the layer-wise copies for their layers and cap. Call it on the thread that opened the
        engine, before serving (the worker does, in ``register_kv_caches``)."""
        self._check_open()
        tables, paths = self._tables, self._layerwise
        return warm_kernels(tables.kv_table, tables.pages_per_chunk, state_table=tables.state_table,
                            state_pages=tables.state_pages, fp8=tables.quantized(KV),
                            layers=None if paths is None or not paths.capable else paths.layers,
                            max_programs=None if paths is None else paths.max_programs)

    # --- layer-wise reloads ----------------------------------------------------------------------

    def layerwise(self, layers: Sequence[Sequence[int]] | None = None, *,
                  max_programs: int | None = None) -> LayerwiseLoads:
        """The layer-wise reload paths (:mod:`~saria.dataplane.transfer.layerwise`), started on the
        first call with ``layers`` (the kv table's tensor indices grouped by model layer; default one
        tensor per layer) and ``max_programs`` (a cap on the programs of each layer's copy kernel,
        so that it leaves SMs to a concurrent forward pass: None the default,
        :data:`saria.kernels.COPY_MAX_PROGRAMS` on CUDA and none on the CPU; 0 none). Later calls
        return the same paths (the layer-wise saves share them)."""
        self._check_open()
        if self._layerwise is None:
            self._layerwise = LayerwiseLoads(self._tables, self.host_pool, self.dram, self.ssd, self.coordinator,
                                             self._streams, self._counters, layers, max_programs=max_programs,
                                             retirer=self._retirer)
        return self._layerwise

    def layerwise_ok(self, plan: ReloadPlan) -> bool:
        """Whether :meth:`load_layers` can take ``plan``: kv objects only (no GDN state, which has no
        layer hook), none in an FP8 form (dequantized whole by its unpack), and pages that never
        straddle two host slots."""
        paths = self._layerwise if self._layerwise is not None and not self._closed else self.layerwise()
        return _layerwise_fits(plan, paths.capable, self._tables.quantized(KV))

    def layerwise_ok_all(self, plans: Sequence[ReloadPlan]) -> list[bool]:
        """:meth:`layerwise_ok` for each of a step's plans, the engine's part of it checked once
        (a plan of no chunk: ``True``, the engine not asked; none with a chunk: the engine never
        asked)."""
        if not any(plan.chunk_hashes for plan in plans):
            return [True] * len(plans)
        paths = self._layerwise if self._layerwise is not None and not self._closed else self.layerwise()
        capable, fp8 = paths.capable, self._tables.quantized(KV)
        return [not plan.chunk_hashes or _layerwise_fits(plan, capable, fp8) for plan in plans]

    def load_layers(self, loads: Sequence[tuple[ReloadPlan, Sequence[Blocks], int]]) -> StepLoad:
        """Start one step's reloads layer by layer: ``loads`` are ``(plan, kv_blocks, skip_pages)``
        as for :meth:`load`, all in one :class:`~saria.dataplane.transfer.load_job.StepJob` of the
        returned :class:`~saria.dataplane.transfer.layerwise.StepLoad`. Call ``wait_layer(l)`` on it
        before layer ``l`` reads its pages and ``end()`` (or ``finish()``) for the results, one per plan. Raises (``ValueError``: a plan
        :meth:`layerwise_ok` refuses, bad block ids, an SSD source without a store) only before
        anything started.

        This thread checks everything (every block id: in one batch, :meth:`Tables.vouch`, or one
        by one where the batch does not vouch for every list, with the same errors in the same
        order); the path threads make the load items and the ids' objects (:meth:`StepJob.take`)."""
        self._check_open()
        paths = self.layerwise()
        after = self._streams.caller_event()  # the copies follow the caller's queued work
        step_ids = self._tables.step_ids(KV, lambda: [blocks for _, kv_blocks, _ in loads for blocks in kv_blocks])
        every = step_ids.every  # the common case: nothing left to check
        capable, fp8, no_ssd, pages = paths.capable, self._tables.quantized(KV), self.ssd is None, self.pages_per_chunk
        plans, skips, ids = [], [], None if every else []
        dram = other = False  # whether the DRAM path, the SSD path have work
        for plan, kv_blocks, skip_pages in loads:
            sources = plan.kv_sources
            has_ssd = SSD in sources
            if not _layerwise_fits(plan, capable, fp8):
                raise ValueError(f"plan {plan.plan_id} cannot be reloaded layer by layer (a GDN state, an FP8 SSD "
                                 "object, or pages that straddle host slots): reload it whole with load()")
            n = len(plan.chunk_hashes)
            if len(kv_blocks) != n:
                raise ValueError(f"plan {plan.plan_id} has {n} chunks but {len(kv_blocks)} block lists")
            if not every:  # some list the batch did not vouch for: each checked here, in order
                for i, blocks in enumerate(kv_blocks):
                    ids.append(step_ids.checked(len(ids), blocks, f"the kv object of chunk {i} of plan {plan.plan_id}"))
            if not 0 <= skip_pages < pages or (skip_pages and not n):
                raise ValueError(f"skip_pages must be in [0, {pages}) and needs a chunk, got {skip_pages}")
            if no_ssd and has_ssd:
                raise ValueError(f"plan {plan.plan_id} reads from SSD but this engine has no SSD store")
            if len(sources) != n:
                raise ValueError(f"plan {plan.plan_id} has {n} chunks but {len(sources)} kv sources")
            d = sources.count(DRAM)
            dram = dram or d > 0
            other = other or d < n
            plans.append(plan)
            skips.append(skip_pages)
        job = StepJob(plans, step_ids.make if every else ids, skips, self.kv_table, self.kv_bytes, after)
        self._counters.add(loads=len(plans), load_objects=job.count)
        return paths.submit(job, dram=dram, ssd=other)

    def retire(self, events: Sequence, then) -> None:
        """Run ``then()`` off the caller's thread once the device reached ``events`` (the hot-path
        rule, :mod:`~saria.dataplane.transfer.retire`): what may only happen after a copy ran
        (staging given back, an object published) without a hook ever waiting for the device."""
        self._retirer.after(events, then)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until everything handed to :meth:`retire` (and the layer-wise steps' ends) ran: a
        reset, a new epoch, sleep. Whether it did within ``timeout``."""
        return self._retirer.drain(timeout)

    # --- layer-wise saves ------------------------------------------------------------------------

    def _saves(self) -> LayerSaves:
        self._check_open()
        if self._layer_saves is None:
            self._layer_saves = LayerSaves(self._tables, self.layerwise(), self._counters, drop=self._drop_dram)
        return self._layer_saves

    def store_layers_ok(self, order: Order) -> bool:
        """Whether :meth:`store_layers` can take ``order``: a store or promotion of kv objects from
        the pages only (a GDN state has no layer hook), on an engine whose pages never straddle
        two host slots (``layerwise().capable``)."""
        return self._saves().ok(order)

    def store_layers(self, orders: Sequence[StoreOrder | PromoteOrder],
                     kv_blocks: Mapping[Hashable, Blocks], drops: Sequence[DropOrder] = (), *,
                     drop_keys: Sequence[Sequence[ObjectKey]] | None = None) -> StepSave:
        """Start one step's stores layer by layer (:mod:`~saria.dataplane.transfer.layer_saves`),
        before its forward: call ``save_layer(l)`` on the returned
        :class:`~saria.dataplane.transfer.layer_saves.StepSave` once layer ``l`` wrote its pages,
        and ``finish()`` (one :class:`OrderRun` per order, done) before the pages are reused. The
        layers are those of :meth:`layerwise`. Objects that do not fit in the host pool fail (named
        in the completion). Raises (``ValueError``: an order :meth:`store_layers_ok` refuses, bad
        block ids, a drop not of DRAM) only before anything started.

        ``drops``: DRAM drop orders of the same step that come before these stores (``drop_keys``:
        their ``keys()``, where the caller made them already; else the preparation makes them). They run with the step's
        preparation, off the caller's thread, before the step takes its slots (so the slots they
        free can take its objects), and have run once ``end()`` or ``finish()`` returned; one that
        fails is in the step's ``drop_failures``. The caller's later reads of the DRAM tier must
        not name a dropped object (the control plane never plans one)."""
        saves = self._saves()
        if drop_keys is None:  # made by the step's preparation, off the caller's thread
            drop_keys = [None] * len(drops)
        if len(drop_keys) != len(drops):
            raise ValueError(f"{len(drops)} drops but {len(drop_keys)} key lists")
        for order in drops:
            if not isinstance(order, DropOrder) or order.tier is not Tier.DRAM:
                raise ValueError(f"store_layers() runs DRAM drops with a step, got {order!r}")
        return saves.start(orders, kv_blocks, list(zip(drops, drop_keys)))

    # --- stores, writes, drops -------------------------------------------------------------------

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
        if isinstance(order, PromoteOrder) and order.source is not Tier.GPU:
            raise ValueError(f"store() copies from HBM; a PromoteOrder from {order.source} is a prewarm (execute())")
        return self._stores.store(order, kv_blocks, state_blocks or {}, prepacked or {},
                                   released if released is not None else threading.Event())

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
        return self._packer.capture(self._tables.ids(STATE, "the captured state object", blocks))

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
        return self._writes.write(order, kv_blocks or {}, state_blocks or {}, prepacked or {},
                                   packed if packed is not None else threading.Event())

    def drop(self, order: DropOrder, *, keys: Sequence[ObjectKey] | None = None) -> None:
        """Free the order's objects in its tier (DRAM slots, or the SSD copy). ``keys``:
        ``order.keys()``, where the caller made them already."""
        self._check_open()
        if not isinstance(order, DropOrder):
            raise ValueError(f"drop() takes a DropOrder, got {type(order).__name__}")
        if keys is None:
            keys = order.keys()
        if order.tier is Tier.DRAM:
            self._drop_dram(keys)
        elif order.tier is Tier.SSD:
            if self.ssd is None:
                raise ValueError("SSD drop order but this engine has no SSD store")
            for key in keys:
                if self.ssd.delete(object_key(key.chunk, key.kind)):
                    self._counters.add(ssd_drops=1)
        else:
            raise ValueError(f"drop order {order.order_id} names tier {order.tier}; expected DRAM or SSD")

    def _drop_dram(self, keys: Sequence[ObjectKey]) -> None:
        """Free these DRAM objects' slots (those resident). The host pool outlives the engine, so
        a layer-wise step's drops still run when the engine closed under it."""
        if not all(type(key) is ObjectKey for key in keys):  # DramStore.drop checks them one by one
            keys = [DramStore._key(key, None) for key in keys]
        dropped = self.dram.drop_many(keys)  # one lock, one free of every slot
        if dropped:  # counted once per order
            self._counters.add(dram_drops=dropped)

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
        blocks = (kv_blocks or {}, state_blocks or {}, prepacked or {})
        runs = []
        for order in orders:
            runs_by_source = self._RUNS.get(type(order))
            if runs_by_source is None:
                raise ValueError(f"unknown order type {type(order).__name__}")
            run = runs_by_source.get(getattr(order, "source", None), runs_by_source[None])
            runs.append(run(self, order, *blocks))
        return runs

    def _run_drop(self, order: DropOrder, *_) -> OrderRun:
        self.drop(order)
        return OrderRun(order, None, _RELEASED)  # reads no pages

    def _run_prewarm(self, order: PromoteOrder, *_) -> OrderRun:
        self._check_open()
        return OrderRun(order, self._prewarms.prewarm(order), _set(threading.Event()))  # reads no pages

    def _run_store(self, order: StoreOrder | PromoteOrder, kv_blocks, state_blocks, prepacked) -> OrderRun:
        released = threading.Event()
        return OrderRun(order, self.store(order, kv_blocks, state_blocks, prepacked, released=released), released)

    def _run_write(self, order: WriteOrder, kv_blocks, state_blocks, prepacked) -> OrderRun:
        released = threading.Event()
        return OrderRun(order, self.write(order, kv_blocks, state_blocks, released, prepacked), released)

    # order type -> {its source: how execute() runs it}, ``None`` for every other source (whose
    # run refuses what it cannot do): the one dispatch of orders
    _RUNS = {
        DropOrder: {None: _run_drop},
        StoreOrder: {None: _run_store},
        PromoteOrder: {Tier.SSD: _run_prewarm, None: _run_store},
        WriteOrder: {None: _run_write},
    }

    def counters(self) -> dict:
        """Engine, coordinator, host pool and SSD store counters in one snapshot."""
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
        if self._layer_saves is not None:
            self._layer_saves.close()  # fails the steps not finished: no slot or released left behind
        if self._layerwise is not None:
            self._layerwise.close()
        self._retirer.close()  # after the steps' ends: every staging and slot is back
        self._dram_loads.close()  # may still submit a serial plan's SSD reads
        self._packer.close()
        self._prewarms.close()
        self._ssd_loads.close()  # after every submitter: reads in flight land first

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


# The ``released`` of every run that reads no pages (a drop): set once and never cleared (nothing
# clears a run's ``released``), so one is shared instead of an event built per drop.
_RELEASED = _set(threading.Event())


def _layerwise_fits(plan: ReloadPlan, capable: bool, fp8: bool) -> bool:
    """The rule of :meth:`TransferEngine.layerwise_ok`: kv objects only (no GDN state), none read in an
    FP8 form (``fp8``: the kv table is quantized), on layer-wise paths that can take them (``capable``)."""
    return plan.state_chunk is None and capable and not (fp8 and SSD in plan.kv_sources)
