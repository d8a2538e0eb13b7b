"""The connector's worker half: saria's data plane on vLLM's paged KV cache.

* ``register_kv_caches``: one page table over every full-attention layer (each layer's tensor seen
  as ``[num_blocks, ...]`` pages), then a host pool, SSD store, coordinator and transfer engine
  sized by the same options as the scheduler's control plane.
* ``start_load_kv``: start each reload of the step's metadata (asynchronous: vLLM keeps the request
  waiting until ``get_finished`` reports it; with ``layerwise``, inside the step, layer by layer:
  ``wait_for_layer_load`` holds each attention layer until its pages landed, :mod:`.layerwise`).
* ``bind_connector_metadata`` / ``save_kv_layer`` (``layerwise``): before the forward, the step's
  stores that can go layer by layer start, and each layer's copies start once the layer wrote its
  pages (:meth:`.saves.WorkerSaves.start_layers`).
* ``get_finished``: reloads whose every object is in its pages (or failed); the failed objects'
  blocks go to ``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them
  (:mod:`.load_results` keeps what the ended reloads tell vLLM and the scheduler).
* ``wait_for_save``: after the step's forward, end the layer-wise stores (their copies have run),
  start the other orders of requests whose prompt it completed and return (nothing in the step
  waits for their copies). Until the orders of a request no
  longer read its blocks, vLLM keeps them for it; ``get_finished`` reports it sent once they are
  free, and ``handle_preemptions`` waits for them before a step's forward may write the blocks of
  a preempted request. The orders and that bookkeeping are :mod:`.saves`' (:class:`WorkerSaves`).
* ``build_connector_worker_meta``: load results and order completions, for the scheduler; once,
  after the data plane opened, the inventory: the objects a previous run of this server left in
  this rank's SSD store (found whole and verified, written for the same model and layout), which
  the scheduler takes over when every rank holds them; and again after each new epoch (below).
* ``snapshot`` / ``stats_delta``: the rank's counters (:mod:`.counters`).

Parallelism (:mod:`.layout`): under tensor and pipeline parallelism this worker holds one shard of
every object (its KV heads, its layers); it gets ``1 / shards`` of the server's DRAM and SSD
capacity and keeps its SSD store in its own ``rank<r>`` directory of every drive path. The
scheduler combines the ranks' reports: a load or order fails everywhere if it failed anywhere.

Faults (:mod:`.faults`; no exception leaves these hooks):

* An exception in one load (starting or collecting it) fails that request as a whole: it is
  reported finished and failed (``failed_recving``) and vLLM recomputes it; one in one order
  reports that order failed. A load or order call of the engine that raises has started nothing,
  so no byte of it can land in vLLM's blocks later.
* A new epoch in the metadata (the scheduler replaced its control plane, empty): wait for every
  load and order in flight and fail those loads; then drop what the new control plane cannot
  vouch for: every host pool slot, and the SSD objects whose write had not ended when the epoch
  changed. The other SSD objects stay: the rank reports its store's inventory again, and the new
  control plane takes them over as at start (``recover``, :mod:`.recovery`); the cluster tier's
  objects stay too (the scheduler's cluster index outlives its control planes). A fault says nothing
  about the SSD tier's bytes; only evidence about the tier itself drops its objects (a checksum
  or seal that fails on a read, a store written for another identity, a key file without their
  seal epoch). The control plane's epoch here is not a key file's seal epoch.
* A new reset count in the metadata (vLLM reset the connector: the weights may have changed,
  :mod:`.resets`): as for a new epoch, and every SSD object of the rank is deleted whatever else
  keeps them (the rank reports an empty inventory). vLLM 0.33+'s sleep hooks
  (``unregister_kv_caches`` / ``restore_kv_caches``) end every copy before the KV memory goes and
  rebuild the page tables where it came back elsewhere.
* The data plane cannot open, a fault outside any one load or order, or ``faults.LIMIT`` faults
  within ``faults.WINDOW_S``: turn off. The data plane is closed (which waits for the work in
  flight), the loads in flight are failed, and from then on every load fails and every order
  fails; the report says ``off``, and the scheduler stops sending any.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import wait
from typing import Callable

import torch

from saria.orders import DataPlane, ObjectKey
from saria.dataplane.build import DataPlaneParts
from saria.dataplane.transfer.engine import LoadJob
from saria.kernels import PageTable
from saria.seal import Keyring

from . import resets
from .audit import KVAudit
from .cluster import WorkerCluster
from .cluster_loads import ClusterLoad, CombinedLoad
from .counters import WorkerCounters
from .faults import Faults
from .geometry import EngineGeometry
from .layout import ParallelLayout
from .layerwise import LayerLoads
from .load_results import LoadResults
from .metadata import CompletionReport, LoadReport, LoadSpec, SariaConnectorMetadata, SariaWorkerMetadata
from .saves import WorkerSaves
from .settings import ConnectorSettings
from .worker_start import open_rank, take_inventory

log = logging.getLogger("saria.vllm")


class SariaWorker:
    """Worker-side state of the connector (module docstring). Every public method is a vLLM hook
    (or one half of one) and never raises."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, *, num_blocks: int,
                 faults: Faults | None = None, layout: ParallelLayout | None = None,
                 model: dict | None = None, keyring: Keyring | None = None, layerwise: bool = False):
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
        self.results = LoadResults(geometry.hybrid)  # the loads that ended, until they are reported
        self.saves = WorkerSaves(self)  # the orders, and the blocks they still read
        self.counters = WorkerCounters(self)  # snapshot(), stats_delta()
        self._inventory: dict[ObjectKey, int] | None = None  # to report: this rank's SSD objects (start, new epoch)
        self.audit: KVAudit | None = None  # audit_kv: reloaded pages checked against what vLLM computed
        self.cluster: WorkerCluster | None = None  # the cluster tier (settings.cluster)
        self._cluster_layouts: tuple[str, ...] = ()  # to report once: this rank's cluster layout
        self.layerwise = layerwise  # loads inside the step, layer by layer (settings.layerwise_for)
        self.layers: LayerLoads | None = None  # the step's layer-wise loads (.layerwise)
        self._abandoned: set[str] = set()
        self._followed: weakref.ref | None = None  # the step's metadata, once followed
        self.resets = 0  # vLLM's resets of the connector seen so far (.resets)
        self.suspended = False  # vLLM's KV memory is released (sleep, .resets): no load starts
        self.kv_caches: dict[str, torch.Tensor] | None = None  # as registered: .resets rebuilds over them

    @property
    def engine(self) -> DataPlane:
        if self.data is None:
            raise RuntimeError("saria: the data plane is not open")
        return self.data.engine

    @property
    def preemption_waits(self) -> int:
        return self.saves.preemption_waits

    @property
    def _reading(self) -> dict:  # per request: the orders still reading its blocks (tests read it)
        return self.saves.reading

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        try:
            self._open(kv_caches)
        except Exception as exc:
            self.faults.record("register_kv_caches", exc)
            self._turn_off("its data plane could not start")

    def _open(self, kv_caches: dict[str, torch.Tensor], *, start: bool = True) -> None:
        """``start``: the server's start (not a reopen within the run, :func:`.resets.resume`)."""
        rank = open_rank(self.settings, self.geometry, self.layout, self.model, self.num_blocks, kv_caches,
                         keyring=self.keyring, start=start)
        self.data, self.state_table, self._inventory = rank.parts, rank.state_table, rank.inventory
        self.cluster = rank.cluster
        if rank.cluster is not None:
            self._cluster_layouts = (rank.cluster.layout_identity,)
        if self.settings.audit_kv:
            self.audit = KVAudit(rank.kv_views, ssd_fp8=self.settings.ssd_dtype == "fp8")
        if self.layerwise:
            self.layers = LayerLoads(rank.parts.engine, self.geometry.attention_layers, rank.layer_tensors,
                                     max_programs=self.settings.layerwise_max_programs)
            if not self.layers.capable:
                log.warning("saria worker: layer-wise copies off (%s); reloads go whole (still inside the step)",
                            self.layers.paths.refusal)
        # Every kernel variant the data plane can launch, compiled here on vLLM's main thread before
        # anything is served (not mid-serving on the path, save and SSD threads: saria.kernels.variants).
        rank.parts.engine.warm_kernels()

    # --- loads -----------------------------------------------------------------------------------

    def start_load_kv(self, meta: SariaConnectorMetadata) -> None:
        """Start the step's reloads. In-step ones (``LoadSpec.layerwise``) go layer by layer beside
        the forward that follows (:mod:`.layerwise`). Asynchronous ones: on CPU, wait for them here
        (the engine loop would otherwise hold the GIL between our threads' small operations, a
        convoy that turned a 1 MiB reload into seconds; waiting on an event frees it); on CUDA the
        copies run on the device and the loads stay asynchronous."""
        self._abandoned: set[str] = set()  # in-step loads of this step failed by a turn-off
        try:
            self._follow(meta)
            self._cancel(meta)
            in_step = [spec for spec in meta.loads if spec.layerwise]
            if in_step:
                self._start_layers(in_step)
            jobs = [job for spec in meta.loads if not spec.layerwise and (job := self._start_load(spec)) is not None]
            if jobs and not self.off and self.engine.device.type == "cpu":
                for job in jobs:  # host work only (a CPU copy is done once issued): never the device's events
                    job.outcome()
        except Exception as exc:
            self._give_up("start_load_kv", exc)
            specs = getattr(meta, "loads", ())
            self._cancel(meta)
            for req_id in [spec.req_id for spec in specs if not spec.layerwise]:
                if req_id not in self.results.finished:  # not started, or started and failed by the turn-off
                    self.results.fail_request(req_id)
            for spec in specs:  # in-step loads the turn-off did not fail already: their blocks go back in error
                if spec.layerwise and spec.req_id not in self._abandoned:
                    self.results.ended_in_step(spec, None, None, True)

    def _cancel(self, meta: SariaConnectorMetadata) -> None:
        """Loads vLLM waits for that the scheduler could not send: an in-step one's blocks (this
        step's forward reads them) go back in error; any other is reported finished and failed.
        Idempotent (a fault path calls it again)."""
        cancel_blocks = getattr(meta, "cancel_blocks", {})
        for req_id in getattr(meta, "cancels", ()):
            if req_id in cancel_blocks:
                self.results.error_blocks.update(cancel_blocks[req_id])
            elif req_id not in self.results.finished:
                self.results.fail_request(req_id)

    def _start_layers(self, specs: list[LoadSpec]) -> None:
        """Start the step's in-step loads (:mod:`.layerwise`): layer by layer where the engine can."""
        if self.off or self.suspended or self.layers is None:  # nothing starts: vLLM recomputes their blocks
            for spec in specs:
                self.results.ended_in_step(spec, None, None, True)
            return
        self.layers.start(self.engine, specs, self._load, self._cluster_load)
        for exc in self.layers.take_failures():
            self._fault("load", exc)

    def _cluster_load(self, spec: LoadSpec, local: int) -> ClusterLoad:
        if self.cluster is None:
            raise ValueError("a load names cluster chunks but this worker has no cluster tier")
        return ClusterLoad(self.cluster, spec.cluster, spec.kv_blocks[local:], 0 if local else spec.skip_pages)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM's attention layer ``layer_name`` is about to read its pages: make it wait for this
        step's in-step loads of that layer (:meth:`.layerwise.LayerLoads.wait`)."""
        layers = self.layers
        if layers is None or not layers.active:
            return
        try:
            layers.wait(layer_name)
        except Exception as exc:  # the step's loads are in an unknown state: their blocks go back in error
            self._give_up("wait_for_layer_load", exc)

    def before_forward(self, meta: SariaConnectorMetadata) -> None:
        """vLLM bound the step's metadata, its forward comes next: with ``layerwise``, start the
        step's stores that go layer by layer (:meth:`.saves.WorkerSaves.start_layers`)."""
        if self.layers is None or self.off or not isinstance(meta, SariaConnectorMetadata) or not meta.orders:
            return
        try:
            self._follow(meta)
            if not self.off:
                self.saves.start_layers(meta)
        except Exception as exc:
            self._give_up("bind_connector_metadata", exc)

    def save_kv_layer(self, layer_name: str) -> None:
        """vLLM's attention layer ``layer_name`` wrote its pages: start its layer-wise stores' copies."""
        layers = self.layers
        if layers is None or self.saves.step is None:
            return
        try:
            layer = layers.index.get(layer_name)
            if layer is not None:
                self.saves.save_layer(layer)
        except Exception as exc:  # wait_for_save still copies every layer (StepSave.finish)
            self._fault("save_kv_layer", exc)

    def _end_layers(self) -> None:
        """After the step's forward: the in-step loads' results (:meth:`.layerwise.LayerLoads.end`)."""
        if self.layers is None or not self.layers.active:
            return
        for spec, result, unsure in self.layers.end():
            self.results.ended_in_step(spec, result, None if unsure else self.audit, unsure)

    def _start_load(self, spec: LoadSpec) -> LoadJob | None:
        if self.off or self.suspended:
            self.results.fail_load(spec)
            return None
        try:
            job = self._load(spec)
        except Exception as exc:  # the engine started nothing of it
            self.results.fail_load(spec)
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
            self._end_layers()
            self.saves.finished(finished_req_ids)
            for req_id, (spec, job) in list(self._loads.items()):
                if job.ready():
                    result = job.wait()
                    del self._loads[req_id]
                    if self.results.ended(spec, result, self.audit) and spec.state_blocks is not None:
                        # keep the loaded state: a promotion may store it
                        self.saves.capture(req_id, spec.plan.state_chunk, spec.state_blocks[0])
        except Exception as exc:  # a load's state is unknown: stop before its bytes are used
            self._give_up("get_finished", exc)
        done = self.results.take_finished()
        return self.saves.take_sent(), done

    def handle_preemptions(self, meta: SariaConnectorMetadata) -> None:
        """vLLM freed the blocks of the step's preempted requests and its forward may write them:
        wait until no order reads them (rare: preemption comes under memory pressure, long after most
        stores are done)."""
        try:
            self.saves.wait_preempted(getattr(meta, "preempted", ()))
        except Exception as exc:
            self._give_up("handle_preemptions", exc)

    def take_error_blocks(self) -> set[int]:
        return self.results.take_error_blocks()

    def take_failed_requests(self) -> set[str]:
        return self.results.take_failed_requests()

    # --- orders ----------------------------------------------------------------------------------

    def wait_for_save(self, meta: SariaConnectorMetadata) -> None:
        """Start the step's orders after its forward (:meth:`WorkerSaves.start`), and return without
        waiting for any copy."""
        try:
            self._follow(meta)
            self.saves.start(meta)
        except Exception as exc:
            self._give_up("wait_for_save", exc)

    def build_worker_meta(self) -> SariaWorkerMetadata | None:
        loads: list[LoadReport] = []
        completions: list[CompletionReport] = []
        try:
            self.saves.take_completions(completions)
            loads = self.results.take_reports()
        except Exception as exc:
            self._give_up("build_connector_worker_meta", exc)
        inventory, self._inventory = self._inventory, None
        layouts, self._cluster_layouts = self._cluster_layouts, ()
        if not loads and not completions and not self.off and inventory is None and not layouts:
            return None
        return SariaWorkerMetadata(loads, completions, self.epoch, self.off, inventory=inventory,
                                   inventory_reports=0 if inventory is None else 1, cluster_layouts=layouts)

    # --- epochs, faults, turning off -------------------------------------------------------------

    def _follow(self, meta: SariaConnectorMetadata) -> None:
        """Take in what a step's metadata says of the worker's state (off, a new epoch, the requests
        vLLM now holds for saria), once per step: whichever hook sees the metadata first. vLLM's hook
        order differs by runner and version (with a speculator, ``get_transfer_results`` runs before
        ``wait_for_save``), and a held request taken in again after ``get_finished`` reported it
        sent would be reported a second time, after vLLM freed it (docs/vllm.md, "Hook order")."""
        followed = self._followed
        if followed is not None and followed() is meta:
            return
        if not isinstance(meta, SariaConnectorMetadata):
            raise TypeError(f"saria: unexpected connector metadata {type(meta).__name__}")
        # a weak reference: the step's metadata goes when vLLM lets it go (holding it to the next
        # step would free the previous step's whole metadata here, in a hook), and no later
        # metadata can pass for it (a freed one's id may be reused, its reference is dead)
        self._followed = weakref.ref(meta)
        if meta.off and not self.off:
            self._turn_off("the scheduler turned saria off")
        if getattr(meta, "resets", 0) != self.resets:  # vLLM reset the connector: every object goes (.resets)
            resets.worker_reset(self, meta)
        if meta.epoch != self.epoch:
            self._new_epoch(meta.epoch)
        self.saves.held.update(meta.held)

    def _new_epoch(self, epoch: int) -> None:
        """The scheduler replaced its control plane (with an empty one): nothing the old one had in
        flight or in DRAM may be read again, nor stay behind; the SSD objects it had written stay,
        and the new one takes them over from this rank's inventory, as at start."""
        self.epoch = epoch
        self._inventory = None

        def keep_ssd(unfinished: set) -> None:
            self.saves.drop_unvouched(unfinished)
            self._inventory = take_inventory(self.data)  # for the new control plane, as at start
            log.warning("saria worker: control plane replaced (epoch %d): DRAM objects dropped, %d SSD object(s) "
                        "offered to the new one%s", epoch, len(self._inventory),
                        f" ({len(unfinished)} whose write had not ended dropped)" if unfinished else "")

        self._replace_control_plane(keep_ssd, "new epoch", "it could not drop the objects of a replaced control plane")

    def _replace_control_plane(self, drop: Callable[[set], None], where: str, failure: str) -> None:
        """What the old control plane had in flight ends here, for a new epoch or a reset: its
        reports are never sent, every load and order in flight is waited for (no copy into vLLM's
        blocks or out of an object runs past this), then ``drop(unfinished)`` takes away what the new
        control plane cannot vouch for (``unfinished``: the SSD objects whose write had not ended),
        and those loads fail (vLLM recomputes them). A fault in between turns the worker off."""
        self.results.take_reports()  # for the old control plane: never sent
        loads, self._loads = list(self._loads.values()), {}
        orders, unfinished = self.saves.forget()
        if not self.off:
            try:
                for _, job in loads:  # let every copy into vLLM's blocks end before the objects go
                    job.wait()
                wait(orders)
                drop(unfinished)
            except Exception as exc:
                self.faults.record(where, exc)
                self._turn_off(failure)
        for spec, _ in loads:  # loaded for the old control plane: vLLM recomputes them
            self.results.fail_request(spec.req_id)
        self._abandon_layers()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+: the KV cache's memory is about to be released (sleep): end every copy that
        touches it, start none until :meth:`restore_kv_caches` (:func:`.resets.suspend`)."""
        resets.suspend(self)

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+: the KV cache's memory is back: page tables rebuilt where it moved (:func:`.resets.resume`)."""
        resets.resume(self)

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
            self.counters.keep(data)
            try:
                self._close_cluster()
                data.close()
                if data.engine.device.type == "cuda":
                    torch.cuda.synchronize(data.engine.device)
            except Exception as exc:
                log.error("saria worker: closing the data plane failed: %s", exc, exc_info=exc)
        for spec, _ in self._loads.values():
            self.results.fail_load(spec)
        self._loads.clear()
        self._abandon_layers()
        self.saves.turned_off()

    def _abandon_layers(self) -> None:
        """The data plane closed (its copies ran): the step's in-step loads go back in error."""
        if self.layers is not None:
            for spec in self.layers.abandon():
                self._abandoned.add(spec.req_id)
                self.results.ended_in_step(spec, None, None, True)

    # --- counters --------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The rank's counters, also after the data plane closed (:meth:`WorkerCounters.snapshot`)."""
        return self.counters.snapshot()

    def stats_delta(self) -> dict[str, int | float]:
        """What changed since the last call, for vLLM's connector stats (:meth:`WorkerCounters.stats_delta`)."""
        return self.counters.stats_delta()

    def shutdown(self) -> None:
        data, self.data = self.data, None
        if data is None:
            return
        try:
            for _, job in self._loads.values():
                job.wait()
            if self.layers is not None:
                self.layers.abandon()
            wait(self.saves.in_flight())
            self._close_cluster()
            data.close()
        except Exception as exc:
            log.warning("saria worker: shutdown: %s", exc)

    def _close_cluster(self) -> None:
        """Wait for the cluster puts in flight and close the store (before the host pool it reads)."""
        cluster = self.cluster
        if cluster is not None:
            cluster.close()
