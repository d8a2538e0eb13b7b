"""The connector's worker half: saria's data plane on vLLM's paged KV cache.

* ``register_kv_caches``: one page table over every full-attention layer (each layer's tensor seen
  as ``[num_blocks, ...]`` pages), then a host pool, SSD store, coordinator and transfer engine
  sized by the same options as the scheduler's control plane.
* ``start_load_kv``: start each reload of the step's metadata (asynchronous: vLLM keeps the request
  waiting until ``get_finished`` reports it).
* ``get_finished``: reloads whose every object is in its pages (or failed); the failed objects'
  blocks go to ``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them.
* ``wait_for_save``: after the step's forward, start the orders of requests whose prompt it
  completed and return (nothing in the step waits for a copy): stores and promotions pack pages and
  copy them to host slots, writes from HBM pack them and write to SSD, drops free slots. Until the
  orders of a request no longer read its blocks, vLLM keeps them for it: the scheduler said so when
  the request finished (``held`` in the metadata), and ``get_finished`` reports it sent once they
  are free; ``handle_preemptions`` waits for them before a step's forward may write the blocks of a
  preempted request.
* ``build_connector_worker_meta``: load results and order completions, for the scheduler; once,
  after the data plane opened, the inventory: the objects a previous run of this server left in
  this rank's SSD store (found whole and verified, written for the same model and layout), which
  the scheduler takes over when every rank holds them.

Parallelism (:mod:`.layout`): under tensor and pipeline parallelism this worker holds one shard of
every object (its KV heads, its layers); it gets ``1 / shards`` of the server's DRAM and SSD
capacity and keeps its SSD store in its own ``rank<r>`` directory of every drive path. The
scheduler combines the ranks' reports: a load or order fails everywhere if it failed anywhere.

Faults (:mod:`.faults`; no exception leaves these hooks):

* An exception in one load (starting or collecting it) fails that request as a whole: it is
  reported finished and failed (``failed_recving``) and vLLM recomputes it; one in one order
  reports that order failed. A load or order call of the engine that raises has started nothing,
  so no byte of it can land in vLLM's blocks later.
* A new epoch in the metadata (the scheduler replaced its control plane): wait for every load and
  order in flight, fail those loads, free every host pool slot and delete every SSD object.
* The data plane cannot open, a fault outside any one load or order, or ``faults.LIMIT`` faults
  within ``faults.WINDOW_S``: turn off. The data plane is closed (which waits for the work in
  flight), the loads in flight are failed, and from then on every load fails and every order
  fails; the report says ``off``, and the scheduler stops sending any.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from typing import Hashable

import torch

from saria.orders import STATE, DataPlane, DropOrder, ObjectKey, Order, PromoteOrder, StoreOrder, Tier, split_keys
from saria.dataplane.build import DataPlaneParts
from saria.dataplane.transfer.engine import LoadJob, LoadResult
from saria.kernels import PageTable
from saria.seal import Keyring

from .audit import KVAudit
from .cluster import WorkerCluster
from .cluster_loads import ClusterLoad, CombinedLoad
from .faults import Faults
from .geometry import EngineGeometry
from .layout import ParallelLayout
from .metrics import worker_totals
from .metadata import (CompletionReport, LoadReport, LoadSpec, RequestOrders, SariaConnectorMetadata,
                       SariaWorkerMetadata)
from .settings import ConnectorSettings
from .worker_start import open_rank

log = logging.getLogger("saria.vllm")


class SariaWorker:
    """Worker-side state of the connector (module docstring). Every public method is a vLLM hook
    (or one half of one) and never raises."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, *, num_blocks: int,
                 faults: Faults | None = None, layout: ParallelLayout | None = None,
                 model: dict | None = None, keyring: Keyring | None = None):
        self.settings = settings
        self.geometry = geometry
        self.layout = layout or ParallelLayout()
        self.model = dict(model or {})  # the model identity (layout.model_identity) the SSD store records
        self.keyring = keyring  # secret_file's keys: the SSD and cluster stores seal their objects with them
        self.block_size = geometry.block_size
        self.num_blocks = num_blocks
        self.faults = faults or Faults("worker")
        self.epoch = 0  # the control plane's, from the metadata
        self.off = False
        self.data: DataPlaneParts | None = None
        self.state_table: PageTable | None = None
        self._loads: dict[str, tuple[LoadSpec, LoadJob]] = {}
        self._finished: set[str] = set()  # loads ended, for vLLM's next get_finished
        self._failed_requests: set[str] = set()  # of those, failed as a whole
        self._error_blocks: set[int] = set()
        self._load_reports: list[LoadReport] = []
        self._orders: list[tuple[int, Future]] = []
        self._reading: dict[str, list[threading.Event]] = {}  # per request: orders still reading its blocks
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until get_finished sends them
        self.preemption_waits = 0  # preempted requests whose orders still read their blocks: waited for
        self._completions: list[CompletionReport] = []  # orders that failed before they started
        self._dram_keys: set[ObjectKey] = set()  # every object a store may have put in the host pool
        self._captured: dict[str, dict[Hashable, torch.Tensor]] = {}  # GDN states set aside, per request
        self._final_counters: dict = {}  # the engine's counters when its data plane closed
        self._stats_seen: dict[str, float] = {}
        self._inventory: dict[ObjectKey, int] | None = None  # to report once: this rank's recovered SSD objects
        self.audit: KVAudit | None = None  # audit_kv: reloaded pages checked against what vLLM computed
        self.cluster: WorkerCluster | None = None  # the cluster tier (settings.cluster)
        self._cluster_layouts: tuple[str, ...] = ()  # to report once: this rank's cluster layout

    @property
    def engine(self) -> DataPlane:
        if self.data is None:
            raise RuntimeError("saria: the data plane is not open")
        return self.data.engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._open(kv_caches)
        except Exception as exc:
            self.faults.record("register_kv_caches", exc)
            self._turn_off("its data plane could not start")

    def _open(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank = open_rank(self.settings, self.geometry, self.layout, self.model, self.num_blocks, kv_caches,
                         keyring=self.keyring)
        self.data, self.state_table, self._inventory = rank.parts, rank.state_table, rank.inventory
        self.cluster = rank.cluster
        if rank.cluster is not None:
            self._cluster_layouts = (rank.cluster.layout_identity,)
        if self.settings.audit_kv:
            self.audit = KVAudit(rank.kv_views, ssd_fp8=self.settings.ssd_dtype == "fp8")

    # --- loads -----------------------------------------------------------------------------------

    def start_load_kv(self, meta: SariaConnectorMetadata) -> None:
        """Start the step's reloads. On CPU, wait for them here: the engine loop would otherwise hold
        the GIL between our threads' small operations (a convoy that turned a 1 MiB reload into
        seconds); waiting on an event frees it. On CUDA the copies run on the device and the loads
        stay asynchronous."""
        try:
            self._follow(meta)
            for req_id in meta.cancels:  # vLLM waits for a load the scheduler could not send
                self._fail_request(req_id)
            jobs = [job for spec in meta.loads if (job := self._start_load(spec)) is not None]
            if jobs and not self.off and self.engine.device.type == "cpu":
                for job in jobs:
                    job.wait()
        except Exception as exc:
            self._give_up("start_load_kv", exc)
            specs = getattr(meta, "loads", ())
            for req_id in [spec.req_id for spec in specs] + list(getattr(meta, "cancels", ())):
                if req_id not in self._finished:  # not started, or started and failed by the turn-off
                    self._fail_request(req_id)

    def _start_load(self, spec: LoadSpec) -> LoadJob | None:
        if self.off:
            self._fail_load(spec)
            return None
        try:
            job = self._load(spec)
        except Exception as exc:  # the engine started nothing of it
            self._fail_load(spec)
            self._fault("load", exc)
            return None
        self._loads[spec.req_id] = (spec, job)
        return job

    def _load(self, spec: LoadSpec):
        """The engine's job for the plan, combined with a cluster load when the spec has cluster chunks."""
        if not spec.cluster:
            return self.engine.load(spec.plan, spec.kv_blocks, spec.state_blocks, skip_pages=spec.skip_pages)
        if self.cluster is None:
            raise ValueError("a load names cluster chunks but this worker has no cluster tier")
        local = spec.plan.num_chunks
        job = self.engine.load(spec.plan, spec.kv_blocks[:local], skip_pages=spec.skip_pages) if local else None
        fetch = ClusterLoad(self.cluster, spec.cluster, spec.kv_blocks[local:], 0 if local else spec.skip_pages)
        return CombinedLoad(job, local, fetch)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(sent, loaded)``: held requests whose blocks no order reads any more (vLLM frees them
        now), and reloads whose objects are all in their pages (or failed); each reported once.
        Requests that vLLM finished drop the GDN states set aside for them."""
        try:
            for req_id in finished_req_ids:
                self._captured.pop(req_id, None)
                if req_id not in self._held:  # vLLM freed its blocks at once: no order of it reads them
                    self._reading.pop(req_id, None)
            for req_id, (spec, job) in list(self._loads.items()):
                if job.ready():
                    result = job.wait()
                    del self._loads[req_id]
                    self._finish_load(spec, result)
        except Exception as exc:  # a load's state is unknown: stop before its bytes are used
            self._give_up("get_finished", exc)
        done, self._finished = self._finished, set()
        return self._take_sent(), done

    def _take_sent(self) -> set[str]:
        """Held requests whose orders no longer read their blocks (all of them once off: the data
        plane closed, and its close waited for every order)."""
        sent = {req_id for req_id in self._held
                if self.off or all(event.is_set() for event in self._reading.get(req_id, ()))}
        for req_id in sent:
            self._held.discard(req_id)
            self._reading.pop(req_id, None)
        return sent

    def handle_preemptions(self, meta: SariaConnectorMetadata) -> None:
        """vLLM freed the blocks of the step's preempted requests and its forward may write them:
        wait until no order reads them (rare: preemption comes under memory pressure, long after most
        stores are done)."""
        try:
            for req_id in getattr(meta, "preempted", ()):
                reading = [event for event in self._reading.pop(req_id, ()) if not event.is_set()]
                self.preemption_waits += bool(reading)
                for event in reading:
                    event.wait()
        except Exception as exc:
            self._give_up("handle_preemptions", exc)

    def _finish_load(self, spec: LoadSpec, result: LoadResult) -> None:
        req_id = spec.req_id
        self._finished.add(req_id)
        missed = getattr(result, "cluster_failed", 0)
        self._load_reports.append(LoadReport(req_id, spec.plan.plan_id, result.failed, result.valid_chunks,
                                             cluster_failed=missed))
        if self.audit is not None:
            for c in range(min(result.valid_chunks, spec.plan.num_chunks)):
                self.audit.check(spec.plan.chunk_hashes[c], spec.kv_blocks[c], spec.skip_pages if c == 0 else 0,
                                 from_ssd=spec.plan.kv_sources[c] is Tier.SSD,
                                 served_as=spec.audit_names[c] if spec.audit_names else None)
        if result.failed or missed:
            if self.geometry.hybrid:  # block ids are per group: vLLM takes request-level failures
                self._failed_requests.add(req_id)
                return
            # Every block from the first chunk that did not arrive on: vLLM recomputes them.
            for c in range(result.valid_chunks, len(spec.kv_blocks)):
                skip = spec.skip_pages if c == 0 else 0
                self._error_blocks.update(spec.kv_blocks[c][skip:])
        elif spec.state_blocks is not None:  # keep the loaded state: a promotion may store it
            self._capture(req_id, spec.plan.state_chunk, spec.state_blocks[0])

    def _fail_request(self, req_id: str) -> None:
        """vLLM hears that the request's load ended and failed: it recomputes the whole request."""
        self._finished.add(req_id)
        self._failed_requests.add(req_id)

    def _fail_load(self, spec: LoadSpec) -> None:
        """Fail a load as a whole after a fault: the control plane drops the SSD copies it was to
        read (they are not vouched for); its DRAM copies are not to blame."""
        self._fail_request(spec.req_id)
        plan = spec.plan
        self._load_reports.append(LoadReport(spec.req_id, plan.plan_id, tuple(plan.keys_from(Tier.SSD)), 0,
                                             cluster_failed=len(spec.cluster)))

    def take_error_blocks(self) -> set[int]:
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _capture(self, req_id: str, chunk: Hashable, block: int) -> None:
        """Set a GDN state aside (packed on the caller's stream, so before the next forward writes
        its block); on a fault, do without it (a store of it then fails)."""
        try:
            self._captured.setdefault(req_id, {})[chunk] = self.engine.capture_state(block)
        except Exception as exc:
            self._fault("capture", exc)

    # --- orders ----------------------------------------------------------------------------------

    def wait_for_save(self, meta: SariaConnectorMetadata) -> None:
        """Start the step's orders after its forward, and return without waiting for any copy."""
        try:
            self._follow(meta)
            if not self.off:
                for capture in meta.captures:  # states at the boundaries this step's forward ended on
                    self._capture(capture.req_id, capture.chunk, capture.block)
            for batch in meta.orders:
                states = self._captured.pop(batch.req_id, {}) if batch.req_id is not None else {}
                prepacked = {ObjectKey(chunk, STATE): staging for chunk, staging in states.items()}
                for order in batch.orders:
                    self._run_order(order, batch, prepacked)
        except Exception as exc:
            self._give_up("wait_for_save", exc)

    def _run_order(self, order: Order, batch: RequestOrders, prepacked: dict[ObjectKey, torch.Tensor]) -> None:
        """Start one order (:meth:`TransferEngine.execute`); while it reads the request's blocks,
        its ``released`` event is the request's (``_reading``)."""
        drop = isinstance(order, DropOrder)
        if self.off:
            if not drop:
                self._completions.append(CompletionReport(order.order_id, False))
            return
        if isinstance(order, (StoreOrder, PromoteOrder)):
            self._dram_keys.update(order.keys())  # before it can land
        if drop and order.tier is Tier.DRAM and self.cluster is not None:
            if batch.share and self.settings.cluster_admission == "evicted":
                self.cluster.share_now([k for k in order.keys() if k.chunk in batch.share])
            self.cluster.before_drop(order.keys())  # no put reads the slots the drop frees
        if self.audit is not None and not drop:
            for chunk in order.kv:
                if chunk in batch.kv_blocks:  # this order reads the chunk from vLLM's blocks
                    self.audit.stored(chunk, batch.kv_blocks[chunk])
        try:
            (run,) = self.engine.execute([order], batch.kv_blocks, prepacked=prepacked)
        except Exception as exc:  # the engine started nothing of it
            if not drop:
                self._completions.append(CompletionReport(order.order_id, False))
            self._fault("drop" if drop else type(order).__name__, exc)
            return
        if drop and order.tier is Tier.DRAM:
            self._dram_keys.difference_update(order.keys())
        if batch.req_id is not None and not run.released.is_set():
            self._reading.setdefault(batch.req_id, []).append(run.released)
        if run.completion is not None:
            self._orders.append((order.order_id, run.completion))
            if batch.share and self.cluster is not None and isinstance(order, StoreOrder):
                self.cluster.share_after([k for k in order.keys() if k.chunk in batch.share], run.completion)

    def build_worker_meta(self) -> SariaWorkerMetadata | None:
        loads: list[LoadReport] = []
        completions: list[CompletionReport] = []
        try:
            completions, self._completions = self._completions, []
            orders, self._orders = self._orders, []
            for order_id, future in orders:
                if future.done() or self.off:  # off: the data plane closed, nothing more will finish
                    completions.append(self._completion(order_id, future))
                else:
                    self._orders.append((order_id, future))
            loads, self._load_reports = self._load_reports, []
        except Exception as exc:
            self._give_up("build_connector_worker_meta", exc)
        inventory, self._inventory = self._inventory, None
        layouts, self._cluster_layouts = self._cluster_layouts, ()
        if not loads and not completions and not self.off and inventory is None and not layouts:
            return None
        return SariaWorkerMetadata(loads, completions, self.epoch, self.off, inventory=inventory,
                                   inventory_reports=0 if inventory is None else 1, cluster_layouts=layouts)

    def _completion(self, order_id: int, future: Future) -> CompletionReport:
        if not future.done():  # the data plane closed before it finished
            return CompletionReport(order_id, False)
        error = future.exception()
        if error is not None:
            self._fault("order", error)
            return CompletionReport(order_id, False)
        done = future.result()
        return CompletionReport(order_id, done.ok, done.failed)

    # --- epochs, faults, turning off -------------------------------------------------------------

    def _follow(self, meta: SariaConnectorMetadata) -> None:
        if not isinstance(meta, SariaConnectorMetadata):
            raise TypeError(f"saria: unexpected connector metadata {type(meta).__name__}")
        if meta.off and not self.off:
            self._turn_off("the scheduler turned saria off")
        if meta.epoch != self.epoch:
            self._new_epoch(meta.epoch)
        self._held.update(meta.held)

    def _new_epoch(self, epoch: int) -> None:
        """The scheduler replaced its control plane: nothing the old one placed may be read again
        (it could not vouch for it) or stay behind (the new one does not know of it)."""
        self.epoch = epoch
        self._load_reports, self._completions = [], []  # for the old control plane: never sent
        loads, self._loads = list(self._loads.values()), {}
        orders, self._orders = self._orders, []
        self._captured.clear()
        self._inventory = None  # every object goes: nothing for the new control plane to take over
        if not self.off:
            try:
                for _, job in loads:  # let every copy into vLLM's blocks end before the objects go
                    job.wait()
                wait([future for _, future in orders])
                self._drop_everything()
                log.warning("saria worker: control plane replaced (epoch %d): every cached object dropped", epoch)
            except Exception as exc:
                self.faults.record("new epoch", exc)
                self._turn_off("it could not drop the objects of a replaced control plane")
        for spec, _ in loads:  # loaded for the old control plane: vLLM recomputes them
            self._fail_request(spec.req_id)

    def _drop_everything(self) -> None:
        engine = self.engine
        if self.cluster is not None:
            self.cluster.quiesce()  # no put reads a slot freed here
        keys, self._dram_keys = self._dram_keys, set()
        kv, state = split_keys(keys)
        if kv or state:
            engine.drop(DropOrder(-1, kv, state, 0, Tier.DRAM))
        if self.data.ssd is not None:
            for key in self.data.ssd.keys():
                self.data.ssd.delete(key)
        if self.audit is not None:
            self.audit.forget()
        left = engine.dram_objects()
        if left:
            raise RuntimeError(f"{left} DRAM object(s) left after dropping every one stored")

    def _fault(self, where: str, exc: BaseException) -> None:
        """A fault confined to one load or order (already failed by the caller)."""
        if self.faults.record(where, exc):
            self._turn_off(f"{self.faults.limit} faults within {self.faults.window_s:g} s")

    def _give_up(self, where: str, exc: BaseException) -> None:
        """A fault outside any one load or order: the worker's state is not to be trusted."""
        self.faults.record(where, exc)
        self._turn_off(f"fault in {where}")

    def _turn_off(self, reason: str) -> None:
        """Close the data plane (its close waits for every copy in flight, so nothing lands in
        vLLM's blocks afterwards), fail the loads in flight, and fail everything from now on."""
        if self.off:
            return
        self.off = True
        log.error("saria worker: turned off for the rest of this run (%s); vLLM computes every token itself from "
                  "now on", reason)
        data, self.data = self.data, None
        if data is not None:
            try:
                self._final_counters = data.engine.counters()
                if self.cluster is not None:
                    self._final_counters["cluster"] = self.cluster.counters()
            except Exception as exc:
                log.warning("saria worker: counters unavailable: %s", exc)
            try:
                self._close_cluster()
                data.close()
                if data.engine.device.type == "cuda":
                    torch.cuda.synchronize(data.engine.device)
            except Exception as exc:
                log.error("saria worker: closing the data plane failed: %s", exc, exc_info=exc)
        for spec, _ in self._loads.values():
            self._fail_load(spec)
        self._loads.clear()
        self._captured.clear()
        self._dram_keys.clear()

    # --- counters --------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The engine's counters (``engine``, ``coordinator``, ``host_pool``, ``ssd``), also after
        the data plane closed, and the connector's (``connector``: faults, epoch, off)."""
        try:
            out = self.data.engine.counters() if self.data is not None else dict(self._final_counters)
            if self.data is not None and self.cluster is not None:
                out["cluster"] = self.cluster.counters()
        except Exception as exc:
            log.warning("saria worker: counters unavailable: %s", exc)
            out = {}
        out["connector"] = dict(self.faults.snapshot(), epoch=self.epoch, off=self.off, held=len(self._held),
                                preemption_waits=self.preemption_waits)
        if self.audit is not None:
            out["audit"] = dict(self.audit.counters(), served=self.audit.served)
        return out

    def stats_delta(self) -> dict[str, int | float]:
        """What changed since the last call, for vLLM's connector stats (:func:`~.metrics.worker_totals`)."""
        totals = worker_totals(self.snapshot(), self.faults.count)
        delta = {k: v - self._stats_seen.get(k, 0) for k, v in totals.items()}
        self._stats_seen = totals
        return {k: v for k, v in delta.items() if v}

    def shutdown(self) -> None:
        data, self.data = self.data, None
        if data is None:
            return
        try:
            for _, job in self._loads.values():
                job.wait()
            wait([future for _, future in self._orders])
            self._close_cluster()
            data.close()
        except Exception as exc:
            log.warning("saria worker: shutdown: %s", exc)

    def _close_cluster(self) -> None:
        """Wait for the cluster puts in flight and close the store (before the host pool it reads)."""
        cluster = self.cluster
        if cluster is not None:
            cluster.close()
