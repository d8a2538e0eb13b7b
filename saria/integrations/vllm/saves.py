"""A worker rank's saves: the orders that ``wait_for_save`` starts, and which of vLLM's blocks they
still read.

* :meth:`WorkerSaves.start` (``wait_for_save``, after the step's forward): set aside the GDN states
  at the boundaries the forward ended on, then start the orders of requests whose prompt it
  completed, and return (nothing in the step waits for a copy): stores and promotions pack pages
  and copy them to host slots, writes from HBM pack them and write to SSD, drops free slots. An
  order that cannot start is reported failed; so is every order once the worker is off.
* Blocks an order reads: while an order reads a request's blocks, its ``released`` event is the
  request's (``reading``). Until then vLLM keeps the blocks of a finished request: the scheduler
  said so when the request finished (``held`` in the metadata), and ``get_finished`` reports it
  sent once they are free (:meth:`~WorkerSaves.take_sent`); ``handle_preemptions`` waits for them
  (:meth:`~WorkerSaves.wait_preempted`) before a step's forward may write the blocks of a
  preempted request.
* With ``layerwise``, :meth:`~WorkerSaves.start_layers` (before the forward) starts the leading
  batches of the step's orders that need not wait for it: drops (DRAM ones, with no cluster
  tier, go with the step's stores: its preparation runs them off the hook's thread before it takes
  the step's slots), stores of kv objects layer by layer, each layer's copies started by :meth:`~WorkerSaves.save_layer` (vLLM's
  ``save_kv_layer``) as soon as the forward wrote it; ``wait_for_save`` hands them over to end
  (``StepSave.end``: published and completed once every copy ran, without the hook waiting for
  the device) and starts the rest as above.
* :meth:`~WorkerSaves.take_completions` (``build_connector_worker_meta``): the orders that ended.
* :meth:`~WorkerSaves.forget` and :meth:`~WorkerSaves.drop_unvouched` (a new epoch): free every
  host pool slot a store may have filled and delete the SSD objects whose write had not ended when
  the control plane was replaced; every other SSD object stays, for the new control plane to take
  over (the worker reports its inventory again). :meth:`~WorkerSaves.drop_everything` (a reset):
  free every host pool slot and delete every SSD object.

The worker that owns it (``worker``) gives it its engine, cluster tier, audit, settings, ``off``
and fault handling; this object only keeps the orders' state.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future
from typing import Any, Hashable, Iterable

import torch

from saria.orders import STATE, DropOrder, ObjectKey, Order, PromoteOrder, StoreOrder, Tier, WriteOrder, split_keys

from .metadata import CompletionReport, RequestOrders, SariaConnectorMetadata


class WorkerSaves:
    """The orders of one worker rank (module docstring). ``worker``: its
    :class:`~.worker.SariaWorker` (``engine``, ``cluster``, ``audit``, ``settings``, ``data``,
    ``off``, ``_fault``)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.orders: list[tuple[Order, Future]] = []  # started, their completion not reported yet
        self.completions: list[CompletionReport] = []  # orders that failed before they started
        self.reading: dict[str, list[threading.Event]] = {}  # per request: orders still reading its blocks
        self.held: set[str] = set()  # finished requests whose blocks vLLM keeps until get_finished sends them
        self.preemption_waits = 0  # preempted requests whose orders still read their blocks: waited for
        # every object a store may have put in the host pool: the chunks of its kv and state objects
        # (chunks, not ObjectKeys: a step's orders add and take them on a hook's thread)
        self.dram_kv: set[Hashable] = set()
        self.dram_state: set[Hashable] = set()
        self.captured: dict[str, dict[Hashable, torch.Tensor]] = {}  # GDN states set aside, per request
        self.step: Any = None  # layerwise: the step's layer-wise stores (a StepSave), until wait_for_save
        self.layered: list[tuple[Order, RequestOrders]] = []  # their orders, with their batches
        self.ahead = 0  # batches of the step's orders started before its forward (start_layers)

    def capture(self, req_id: str, chunk: Hashable, block: int) -> None:
        """Set a GDN state aside (packed on the caller's stream, so before the next forward writes
        its block); on a fault, do without it (a store of it then fails)."""
        try:
            self.captured.setdefault(req_id, {})[chunk] = self.worker.engine.capture_state(block)
        except Exception as exc:
            self.worker._fault("capture", exc)

    # --- layer-wise stores (layerwise: before the forward, then per layer) -------------------------

    def start_layers(self, meta: SariaConnectorMetadata) -> None:
        """Before the step's forward: start its orders in list order for as long as they need not
        wait for the forward (drops free slots: DRAM ones, with no cluster tier, with the step's
        stores, off this thread and before the step takes its slots; stores of kv objects go layer by layer,
        :meth:`~saria.dataplane.transfer.engine.TransferEngine.store_layers`); the first batch that
        holds anything else (a write or promotion from HBM, a GDN state, a cluster share on
        eviction) and every batch after it start after the forward, in :meth:`start`, as without
        ``layerwise``. What started here is skipped there (``self.ahead`` batches)."""
        worker, engine = self.worker, self.worker.engine
        stores: list[tuple[Order, RequestOrders]] = []
        # DRAM drops before the step's first store (with no cluster tier, whose puts may read their
        # slots): they go with the step, off this thread, before it takes its slots (store_layers)
        drops: list[tuple[DropOrder, RequestOrders]] = []
        if meta.captures:  # the step's forward ends on a GDN state's boundary: everything waits for it
            return
        defer = worker.cluster is None
        layered_ok = engine.store_layers_ok
        capable = engine.layerwise().capable  # a plain store of kv objects goes layer by layer if the engine can
        evicted = worker.settings.cluster_admission == "evicted"
        for batch in meta.orders:
            fits = True
            for o in batch.orders:  # store_layers_ok, the common kinds first
                kind = type(o)
                if not (kind is DropOrder or (kind is StoreOrder and capable and not o.state)
                        or isinstance(o, DropOrder) or layered_ok(o)):
                    fits = False
                    break
            if not fits or (batch.share and evicted):
                break
            for order in batch.orders:
                if type(order) is DropOrder:
                    if defer and order.tier is Tier.DRAM and not worker.off:
                        self._dropped(order)  # in list order: a later store adds them back
                        drops.append((order, batch))
                    else:
                        self._run_drop(order, batch)
                elif isinstance(order, DropOrder):
                    self._run_order(order, batch, {})
                else:
                    stores.append((order, batch))
            self.ahead += 1
        if not stores:
            self._run_drops_here(drops)
            return
        blocks: dict = {}
        for _, batch in stores:
            blocks.update(batch.kv_blocks)
        for order, _ in stores:
            self._may_hold(order)  # before it can land
        try:
            self.step = engine.store_layers([order for order, _ in stores], blocks, [d for d, _ in drops])
        except Exception as exc:  # the engine started nothing of them
            for order, _ in stores:
                self.completions.append(CompletionReport(order.order_id, False))
            worker._fault("StoreOrder", exc)
            self._run_drops_here(drops)
            return
        self.layered = stores
        for (order, batch), run in zip(stores, self.step.runs):
            if batch.req_id is not None:
                self.reading.setdefault(batch.req_id, []).append(run.released)

    def _run_drops_here(self, drops: list[tuple[DropOrder, RequestOrders]]) -> None:
        """Drops that :meth:`start_layers` meant to send with a step that did not start: run them
        on this thread, as :meth:`_run_drop` does."""
        for order, batch in drops:
            self._may_hold(order)  # back as before the drop: _run_drop takes them out once it ran
            self._run_drop(order, batch)

    def _may_hold(self, order: Order) -> None:
        """``order``'s objects may be in the host pool (a store, before it can land; a drop that failed)."""
        self.dram_kv.update(order.kv)
        self.dram_state.update(order.state)

    def _dropped(self, order: Order) -> None:
        self.dram_kv.difference_update(order.kv)
        self.dram_state.difference_update(order.state)

    def save_layer(self, layer: int) -> None:
        """vLLM's attention layer ``layer`` wrote its pages: its copies start (never waits)."""
        if self.step is not None:
            self.step.save_layer(layer)

    def _finish_layers(self, *, block: bool = False) -> None:
        """After the forward: the layers no hook saved are copied too, and the step ends once every
        copy ran (``StepSave.end``: released, published, completed off this thread; ``block``:
        wait for that here, ``StepSave.finish``, only when closing or changing epoch)."""
        step, stores, self.step, self.layered = self.step, self.layered, None, []
        if step is None:
            return
        cluster, audit = self.worker.cluster, self.worker.audit
        if audit is not None and not self.worker.off:  # the pages hold the step's KV now, not before the forward
            for order, batch in stores:
                for chunk in order.kv:
                    if chunk in batch.kv_blocks:
                        audit.stored(chunk, batch.kv_blocks[chunk])
        for (order, batch), run in zip(stores, step.finish() if block else step.end()):
            self.orders.append((order, run.completion))
            if batch.share and cluster is not None and isinstance(order, StoreOrder):
                cluster.share_after([k for k in order.keys() if k.chunk in batch.share], run.completion)
        # the step's drops ran by now (end and finish run them if its preparation did not)
        for order, _, exc in step.drop_failures:
            self._may_hold(order)  # some may be left in the host pool
            if not self.worker.off:
                self.worker._fault("drop", exc)

    # --- starting orders -------------------------------------------------------------------------

    def start(self, meta: SariaConnectorMetadata) -> None:
        """The step's captures, then its orders (the worker followed ``meta`` already); with
        ``layerwise``, the stores that went layer by layer end first and the batches
        :meth:`start_layers` started are skipped."""
        ahead, self.ahead = self.ahead, 0
        self._finish_layers()
        if not self.worker.off:
            for capture in meta.captures:  # states at the boundaries this step's forward ended on
                self.capture(capture.req_id, capture.chunk, capture.block)
        for batch in meta.orders[ahead:]:
            states = self.captured.pop(batch.req_id, {}) if batch.req_id is not None else {}
            prepacked = {ObjectKey(chunk, STATE): staging for chunk, staging in states.items()}
            for order in batch.orders:
                if type(order) is DropOrder:
                    self._run_drop(order, batch)
                else:
                    self._run_order(order, batch, prepacked)

    def _run_drop(self, order: DropOrder, batch: RequestOrders) -> None:
        """:meth:`_run_order` of a drop (the same steps, its keys made once): its slots are free
        when it returns; it reads no pages and completes nothing."""
        worker = self.worker
        if worker.off:
            return
        keys = order.keys()
        dram = order.tier is Tier.DRAM
        cluster = worker.cluster
        if dram and cluster is not None:
            if batch.share and worker.settings.cluster_admission == "evicted":
                cluster.share_now([k for k in keys if k.chunk in batch.share])
            cluster.before_drop(keys)  # no put reads the slots the drop frees
        try:
            worker.engine.drop(order, keys=keys)
        except Exception as exc:  # the engine dropped what it could
            worker._fault("drop", exc)
            return
        if dram:
            self._dropped(order)

    def _run_order(self, order: Order, batch: RequestOrders, prepacked: dict[ObjectKey, torch.Tensor]) -> None:
        """Start one order (:meth:`TransferEngine.execute`); while it reads the request's blocks,
        its ``released`` event is the request's (``reading``)."""
        worker = self.worker
        drop = isinstance(order, DropOrder)
        if worker.off:
            if not drop:
                self.completions.append(CompletionReport(order.order_id, False))
            return
        if isinstance(order, (StoreOrder, PromoteOrder)):
            self._may_hold(order)  # before it can land
        cluster, audit = worker.cluster, worker.audit
        if drop and order.tier is Tier.DRAM and cluster is not None:
            if batch.share and worker.settings.cluster_admission == "evicted":
                cluster.share_now([k for k in order.keys() if k.chunk in batch.share])
            cluster.before_drop(order.keys())  # no put reads the slots the drop frees
        if audit is not None and not drop:
            for chunk in order.kv:
                if chunk in batch.kv_blocks:  # this order reads the chunk from vLLM's blocks
                    audit.stored(chunk, batch.kv_blocks[chunk])
        try:
            if drop:  # what execute() runs for it, without its run: a drop reads no pages, completes nothing
                worker.engine.drop(order)
                run = None
            else:
                (run,) = worker.engine.execute([order], batch.kv_blocks, prepacked=prepacked)
        except Exception as exc:  # the engine started nothing of it
            if not drop:
                self.completions.append(CompletionReport(order.order_id, False))
            worker._fault("drop" if drop else type(order).__name__, exc)
            return
        if run is None:
            if order.tier is Tier.DRAM:
                self._dropped(order)
            return
        if batch.req_id is not None and not run.released.is_set():
            self.reading.setdefault(batch.req_id, []).append(run.released)
        if run.completion is not None:
            self.orders.append((order, run.completion))
            if batch.share and cluster is not None and isinstance(order, StoreOrder):
                cluster.share_after([k for k in order.keys() if k.chunk in batch.share], run.completion)

    # --- the blocks orders read ------------------------------------------------------------------

    def finished(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests: drop their GDN states; a request not held had its blocks
        freed at once, so no order of it reads them."""
        for req_id in req_ids:
            self.captured.pop(req_id, None)
            if req_id not in self.held:
                self.reading.pop(req_id, None)

    def take_sent(self) -> set[str]:
        """Held requests whose orders no longer read their blocks (all of them once off: the data
        plane closed, and its close waited for every order)."""
        off, reading = self.worker.off, self.reading
        sent = set()
        for req_id in self.held:
            events = reading.get(req_id)
            if off or not events or all([event.is_set() for event in events]):
                sent.add(req_id)
        for req_id in sent:
            self.held.discard(req_id)
            self.reading.pop(req_id, None)
        return sent

    def wait_preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM freed the blocks of these preempted requests: wait until no order reads them."""
        for req_id in req_ids:
            reading = [event for event in self.reading.pop(req_id, ()) if not event.is_set()]
            self.preemption_waits += bool(reading)
            for event in reading:
                event.wait()

    # --- completions -----------------------------------------------------------------------------

    def take_completions(self, out: list[CompletionReport]) -> None:
        """Move into ``out`` the completions to report: the orders that failed before they
        started, then those that ended (every one once off: nothing more will finish)."""
        out += self.completions
        self.completions = []
        orders, self.orders = self.orders, []
        off = self.worker.off
        for order, future in orders:
            if future.done():
                out.append(self._completion(order.order_id, future, True))
            elif off:  # the data plane closed, nothing more will finish
                out.append(CompletionReport(order.order_id, False))
            else:
                self.orders.append((order, future))

    def _completion(self, order_id: int, future: Future, done: bool = False) -> CompletionReport:
        """``done``: the caller saw ``future.done()``."""
        if not (done or future.done()):  # the data plane closed before it finished
            return CompletionReport(order_id, False)
        try:
            result = future.result()  # done: never waits
        except CancelledError:  # as future.exception() raises it
            raise
        except BaseException as error:  # noqa: BLE001 - what future.exception() would have returned
            self.worker._fault("order", error)
            return CompletionReport(order_id, False)
        return CompletionReport(order_id, result.ok, result.failed)

    def in_flight(self) -> list[Future]:
        return [future for _, future in self.orders]

    # --- epochs, turning off ---------------------------------------------------------------------

    def abandon_layers(self) -> None:
        """The step's layer-wise stores end now (every copy runs, before anything is freed); their
        completions go with the others."""
        try:
            self._finish_layers(block=True)
        finally:
            self.ahead = 0

    def forget(self) -> tuple[list[Future], set[ObjectKey]]:
        """A new epoch: the reports for the old control plane are never sent and the states set
        aside go. Returns the orders in flight, for the caller to wait for, and the keys of the SSD
        writes among them that had not ended (the new control plane cannot vouch for them:
        :meth:`drop_unvouched` deletes them once they ended)."""
        self.abandon_layers()
        self.completions = []
        orders, self.orders = self.orders, []
        self.captured.clear()
        unfinished = {key for order, future in orders if isinstance(order, WriteOrder) and not future.done()
                      for key in order.keys()}
        return [future for _, future in orders], unfinished

    def drop_unvouched(self, unfinished: Iterable[ObjectKey]) -> None:
        """After a new epoch, once every order in flight ended: free every object a store may have
        put in the host pool, and delete the SSD objects of the writes that had not ended
        (``unfinished``, from :meth:`forget`). Every other SSD object stays: the new control plane
        takes it over from the rank's inventory, as at start."""
        worker = self.worker
        engine = worker.engine
        engine.settle()  # what waited for the device ran: steps ended, staging back, cluster staged objects gone
        if worker.cluster is not None:
            worker.cluster.quiesce()  # no put reads a slot freed here
        kv, state = tuple(self.dram_kv), tuple(self.dram_state)
        self.dram_kv, self.dram_state = set(), set()
        if kv or state:
            engine.drop(DropOrder(-1, kv, state, 0, Tier.DRAM))
        unfinished = list(unfinished)
        if unfinished and worker.data.ssd is not None:
            engine.drop(DropOrder(-1, *split_keys(unfinished), 0, Tier.SSD))
        left = engine.dram_objects()
        if left:
            raise RuntimeError(f"{left} DRAM object(s) left after dropping every one stored")

    def drop_everything(self) -> None:
        """A reset (:mod:`.resets`: the weights may have changed), once every order in flight
        ended: free every host pool slot a store may have filled and delete every SSD object."""
        self.drop_unvouched(())
        ssd = self.worker.data.ssd
        if ssd is not None:
            for key in ssd.keys():
                ssd.delete(key)
        if self.worker.audit is not None:
            self.worker.audit.forget()

    def turned_off(self) -> None:
        """The data plane closed: the states set aside and the host pool's objects are gone (the
        step's layer-wise stores failed with it: their completions say so)."""
        self.abandon_layers()
        self.captured.clear()
        self.dram_kv.clear()
        self.dram_state.clear()
