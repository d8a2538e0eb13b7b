"""Layer-wise saves: one step's stores copied from the pages into host slots layer by layer, each
layer's copy started as soon as the engine's forward pass wrote that layer (vLLM's
``save_kv_layer``), so that the copies run beside the rest of the forward instead of after it
(docs/dataplane.md, "GPU -> DRAM, layer by layer").

:meth:`LayerSaves.start` (``TransferEngine.store_layers``, before the forward, on the caller's
thread) checks the orders (kv objects from the pages only: a GDN state has no layer hook and is
stored whole; every object's block ids, in one batch: ``Tables.vouch``) and makes the
step's runs; nothing else runs on that thread. The step's preparation then runs, once: the DRAM
drops given with the step (``drops``: run first, so that the slots they free can hold the step's
objects; done by the time :meth:`StepSave.end` returns, whoever ran them), the objects' host slots
(an object that does not fit fails, as with ``store()``), and where every page's bytes go in the
slots (:func:`~saria.dataplane.transfer.layerwise.slot_layout`, the layout the layer-wise reload
reads back, for every tensor and host pool segment at once) and every layer's PACK, worked out
in one pass (:func:`~saria.kernels.prepare_layered`: checked once, one work array
uploaded once under the ``offload`` stream, each layer one launch at an offset into it), by the
engine's save thread (CUDA: ahead of the forward's hooks, which then only launch; CPU: at the first
layer handed to it) or by the first hook that needs it, so its checks never hold up the forward.
It returns a :class:`StepSave`:

* :meth:`StepSave.save_layer` (``save_kv_layer``: layer ``l`` just wrote its pages) costs a few
  launches. On CUDA: an event on the caller's current stream (the forward), the ``offload`` stream
  made to wait for it, the layer's copies launched there (a kernel that writes the pinned slots by
  address), one event recorded after them; the host never waits. On the CPU the layer is handed to
  the engine's save thread, which copies the layers in the order handed over while the forward
  goes on.
* :meth:`StepSave.end` (``wait_for_save``) copies every layer no hook saved (a forward that
  skipped one: its pages are complete once the forward ran) and returns at once (on the CPU a step
  whose hooks saved every layer was handed to the retire thread by the save thread already), one
  :class:`~saria.dataplane.transfer.results.OrderRun` per order. Once every copy ran (observed by
  the engine's :class:`~saria.dataplane.transfer.retire.Retirer`, off the hooks' thread: a hook
  never waits for the device), each order's ``released`` event is set (no copy reads the pages
  any more), the objects are published in the :class:`~saria.dataplane.dram.store.DramStore`
  (their checksums left to be computed where they are needed: ``None``, an SSD write or a
  cluster put computes a part's own) and the completions are done. :meth:`StepSave.finish` is
  the blocking form (it returns once all that happened).

A fault (a copy refused, the engine closing) fails every object of the step: their slots are
freed once no copy can still write them, the completions name them, and ``released`` is set all
the same (a waiter never hangs).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

import torch

from saria.orders import KV, ObjectKey, Order, PromoteOrder, StoreOrder, Tier

from saria.dataplane.devices import bind_thread
from saria.dataplane.dram.host_pool import HostPoolFull
from saria.dataplane.dram.store import DramObject
from saria.dataplane.transfer.flags import LayerFlags, LazyEvent
from saria.dataplane.transfer.layerwise import LayerLaunch, LayerwiseLoads, slot_layout
from saria.dataplane.transfer.results import Completion, OrderRun, RunningFuture, TransferCounters
from saria.dataplane.transfer.streams import Event
from saria.dataplane.transfer.tables import Blocks, Tables, log


@dataclass
class _Object:
    """One kv object of a step: its slots (``None`` once published or freed) and why it failed."""

    key: ObjectKey
    order: int  # index of its order in the step
    ids: object  # BlockIds
    slots: list[int] | None = None
    error: BaseException | None = None


class StepSave:
    """One step's layer-wise saves (module docstring): :meth:`save_layer` as each layer wrote its
    pages, :meth:`finish` once the forward is queued. ``runs``: one
    :class:`~saria.dataplane.transfer.results.OrderRun` per order, in the order given; their
    completions are done and their ``released`` events set once :meth:`finish` returned."""

    def __init__(self, saves: "LayerSaves", runs: list[OrderRun], objects: list[tuple] | tuple, layers: int):
        self.runs = runs
        self.layers = layers
        self.saved = [False] * layers  # layers handed to a copy (by a hook or by finish)
        self._saves = saves
        # (chunk, order index, ids) per kv object, or (orders, a function that makes every object's
        # ids in order) where a batch check vouched for all: its _Object made off the bind hook
        self._specs = objects
        self._objects: list[_Object] | None = None  # made once (_objs), under _prepare_lock
        self._prepared = None  # the step's LayeredCopy, every layer's work (made once, by the first to need it)
        self._preparing = None  # the function that prepares it (None: done, failed, or nothing to copy)
        self._prepare_lock = threading.Lock()
        self._nbytes = 0
        self._done = LayerFlags(layers)  # the layer's copies queued (CUDA) or ran (CPU)
        self._events: list[Event | None] = [None] * layers  # CUDA: recorded after the layer's copies
        self._error: BaseException | None = None  # the first fault: every object of the step fails
        self._lock = threading.Lock()
        self._finished = False  # end() or finish() was called
        self._handed = False  # the step was handed to the retire thread (by end(), or by the CPU's save thread)
        self._claimed = False  # who ends the step is decided (_claim): the retire thread, finish() or abort()
        self._ended = False  # released, published or freed, completed
        self._ended_event = LazyEvent()  # set once _ended
        self._t0: float | None = None
        self._allocated = False  # the objects' slots were taken (by the preparation)
        self._drops: list[tuple[object, list[ObjectKey]]] = []  # the step's DRAM drops, run once, first
        self._drops_lock = threading.Lock()
        self.drop_failures: list[tuple[object, list[ObjectKey], BaseException]] = []  # (order, keys, error)

    # --- per layer (the forward's thread) --------------------------------------------------------

    def save_layer(self, layer: int) -> None:
        """Start copying layer ``layer``'s pages into the objects' slots (it just wrote them):
        never waits for a copy. ``ValueError``: a layer out of range or saved already;
        ``RuntimeError``: the step is finished. A copy that fails is not raised here: its
        objects fail at :meth:`finish`."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} is not one of this step's {self.layers} layers")
        if self._finished:
            raise RuntimeError("this step's saves are finished: save_layer comes before finish")
        if self.saved[layer]:
            raise ValueError(f"layer {layer} was saved already in this step")
        self.saved[layer] = True
        if self._saves.host_seconds is None:
            self._issue(layer)
            return
        t0 = time.perf_counter()
        self._issue(layer)
        self._saves.host_seconds.append(time.perf_counter() - t0)

    def _issue(self, layer: int) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        saves = self._saves
        saves.counters.add(layer_saves=1)
        if self._error is not None:
            self._done.set(layer)
        elif saves.streams.cuda:
            streams = saves.streams
            try:
                copies = self._copies_for(layer)
                streams.wait("offload", streams.caller_event())  # after the forward wrote the layer
                with streams.on("offload"):
                    for copy in copies:
                        copy.launch()
            except Exception as exc:
                self._fault(exc)
            finally:
                try:  # after whatever was launched: finish waits for it before the slots go back
                    self._events[layer] = streams.record("offload")
                except Exception as exc:
                    self._fault(exc)
                self._done.set(layer)
        else:
            saves.submit(self, layer)

    def _run_layer(self, layer: int) -> None:
        """CPU: the save thread copies one layer (never raises: a fault fails the step), then records
        the layer's event (the :class:`~saria.dataplane.transfer.streams.HostEvent` twin of CUDA's)."""
        try:
            if self._error is None:
                for copy in self._copies_for(layer):
                    copy.launch()
        except Exception as exc:
            self._fault(exc)
        finally:
            try:
                self._events[layer] = self._saves.streams.record("offload")
            finally:
                self._done.set(layer)
        if self._done.all_set() and all(self.saved) and self._claim():
            # every layer was handed over by a hook and has run: this thread hands the step to the
            # retire thread (not wait_for_save's end(): a hand-off wakes that thread, tens of us)
            self._handed = True
            self._saves.retirer.after((), self._retire, wait=lambda: self._wait(None))

    def _claim(self) -> bool:
        """Whether the caller is the one to end the step (once: the retire thread's hand-off, a
        blocking finish() or an abort())."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def _objs(self) -> list[_Object]:
        """The step's objects, made on first need (its preparation, or its end), under
        ``_prepare_lock``."""
        objects = self._objects
        if objects is None:
            specs = self._specs
            if type(specs) is tuple:  # (orders, make): the ids vouched for by the batch check, made here
                orders, make = specs
                specs = zip([(chunk, o) for o, order in enumerate(orders) for chunk in order.kv], make())
                specs = [(chunk, o, ids) for (chunk, o), ids in specs]
            objects = self._objects = [_Object(ObjectKey(chunk, KV), o, ids) for chunk, o, ids in specs]
        return objects

    def _run_drops(self) -> None:
        """Run the step's DRAM drops (:meth:`LayerSaves.start`'s ``drops``) once, whoever comes
        first: the preparation, before it takes the objects' slots (the save thread, off the hooks'
        thread), or :meth:`end` / :meth:`_end`, so that they have run once the step ends. A drop
        that fails is kept in :attr:`drop_failures` (the engine dropped what it could)."""
        if not self._drops:
            return
        with self._drops_lock:  # a second caller returns once they ran
            drops, self._drops = self._drops, []
            drop = self._saves.drop
            for order, keys in drops:
                try:
                    if keys is None:
                        keys = order.keys()
                    drop(keys)
                except Exception as exc:
                    self.drop_failures.append((order, keys, exc))

    def _copies_for(self, layer: int) -> list:
        """Layer ``layer``'s copy (one launch), the step's copies of every layer prepared first if
        they are not yet (one pass: the save thread does it ahead of the hooks, else the first
        caller). Raises what the preparation raises (the caller fails the step)."""
        with self._prepare_lock:
            if self._prepared is None and self._preparing is not None:
                prepare, self._preparing = self._preparing, None
                self._prepared = prepare()
            return [] if self._prepared is None else [LayerLaunch(self._prepared, layer)]

    def _prepare_ahead(self) -> None:
        """CUDA: the save thread prepares every layer's copies ahead of the forward's hooks, which
        then only launch (never raises: a fault fails the step)."""
        try:
            if self._error is None and not self._ended:
                self._copies_for(0)
        except Exception as exc:
            self._fault(exc)

    def _fault(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
                log.warning("layer-wise save failed, its objects are not stored: %s", exc)

    # --- the end of the step ---------------------------------------------------------------------

    def end(self) -> list[OrderRun]:
        """Copy the layers no hook saved and hand the rest to the engine's retire thread: once
        every copy ran it releases the pages, publishes the objects and completes the runs (module
        docstring). Returns :attr:`runs` at once, without waiting for any copy (the hot-path rule).
        Called again (or after :meth:`finish`), returns them again."""
        if self._ended or self._handed:
            self._finished = True
            return self.runs
        self._run_drops()  # usually run already, by the preparation: whatever the hook starts next comes after them
        self._issue_late()
        self._finished = True
        if self._claim():  # else the save thread handed it over already, as its last layer ran
            self._handed = True
            self._saves.retirer.after((), self._retire, wait=lambda: self._wait(None))
        return self.runs

    def finish(self, timeout: float | None = None) -> list[OrderRun]:
        """Copy the layers no hook saved, wait until every copy ran, release the pages and publish
        the objects (module docstring); returns :attr:`runs`, every completion done: the blocking
        form of :meth:`end` (closing, tests, benchmarks; never a per-step hook). Called again,
        returns them again. ``TimeoutError`` if the copies are not done within ``timeout``
        seconds: nothing is released or published then (call it again)."""
        if self._ended:
            self._finished = True
            return self.runs
        if self._handed:
            if not self._ended_event.wait(timeout):
                raise TimeoutError("layer-wise saves not retired in time")
            return self.runs
        self._issue_late()
        self._wait(None if timeout is None else time.monotonic() + timeout)
        self._finished = True
        if self._claim():
            self._end()
        elif not self._ended_event.wait(timeout):  # the save thread handed it over meanwhile
            raise TimeoutError("layer-wise saves not retired in time")
        return self.runs

    def _issue_late(self) -> None:
        late = [layer for layer in range(self.layers) if not self.saved[layer]]
        for layer in late:
            self.saved[layer] = True
            self._issue(layer)
        self._saves.counters.add(layer_saves_late=len(late))

    def _retire(self) -> None:
        """The retire thread: every copy ran (``_wait`` returned): release, publish, complete."""
        self._end()

    def _wait(self, deadline: float | None) -> None:
        if not self._done.wait_all(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"layer-wise saves of layer {self._done.first_clear()} not done in time")
        try:
            for event in self._events:
                if event is None:
                    continue
                while deadline is not None and not event.query():
                    if time.monotonic() > deadline:
                        raise TimeoutError("layer-wise saves not done on the device in time")
                    time.sleep(50e-6)
                event.synchronize()
        except TimeoutError:
            raise
        except Exception as exc:  # a device fault: let whatever still runs on the stream end first
            self._fault(exc)
            self._saves.settle()

    def _end(self, error: BaseException | None = None) -> None:
        """Release, publish (or, after a fault, free) and complete: never leaves a ``released``
        unset, a slot unowned or a completion pending."""
        saves = self._saves
        if error is not None:
            self._fault(error)
        self._ended = True
        self._run_drops()  # never left undone (a step failed before its preparation)
        with self._prepare_lock:  # the prepared copies hold the tables and slots; none is taken after this
            self._prepared, self._preparing = None, None
            allocated = self._allocated
            objects = self._objs()
        if not allocated:  # failed before its preparation took any slot: every object fails
            for obj in objects:
                if obj.error is None:
                    obj.error = self._error or RuntimeError("not stored: the step ended before its slots were taken")
                    saves.counters.add(store_failures=1)
        published = 0
        try:
            for run in self.runs:
                run.released.set()  # every copy reading the pages ran
            for obj in objects:
                if obj.slots is not None and obj.error is None and self._error is None:
                    try:
                        saves.dram.put(obj.key, DramObject(obj.slots, saves.kv_bytes, (None,) * len(obj.slots)))
                        obj.slots = None  # the DRAM store owns them now
                        published += saves.kv_bytes
                    except Exception as exc:
                        obj.error = exc
        finally:
            for obj in objects:  # not published: the slots go back, the object fails
                if obj.slots is not None:
                    obj.error = obj.error or self._error or RuntimeError("not published")
                    slots, obj.slots = obj.slots, None
                    saves.counters.add(store_failures=1)
                    try:
                        saves.host_pool.free(slots)
                    except Exception as exc:
                        log.warning("freeing the slots of an object not stored failed: %s", exc)
            for run in self.runs:
                run.released.set()
            for o, run in enumerate(self.runs):
                if not run.completion.done():
                    mine = [obj for obj in objects if obj.order == o]
                    failed = [obj.key for obj in mine if obj.error is not None]
                    run.completion.set_result(Completion.of(run.order.order_id, len(mine), failed))
            saves.forget(self)
            self._ended_event.set()
        seconds = time.perf_counter() - self._t0 if self._t0 is not None and published else 0.0
        saves.counters.add(gpu_to_dram_bytes=published, gpu_to_dram_seconds=seconds)

    def abort(self, error: BaseException) -> None:
        """Fail the step (the engine is closing): wait for the copies handed over, free the slots,
        fail every object, set every ``released``."""
        if self._ended:
            return
        self._fault(error)
        if self._handed:  # the retire thread ends it once its copies ran
            self._ended_event.wait()
            return
        for layer in range(self.layers):
            if not self.saved[layer]:  # never copied now (a hook still to come finds no copies)
                self._done.set(layer)
        self._wait(None)
        if self._claim():
            self._end()
        else:  # the save thread handed it over meanwhile
            self._ended_event.wait()


class LayerSaves:
    """The layer-wise saves of one transfer engine: the checks and per-step preparation
    (:meth:`start`) and the save thread (CPU: it copies the layers handed to it; CUDA: it prepares
    each step's layers ahead of the hooks). Shares
    the layer groups, per-tensor tables and page layout of the engine's
    :class:`~saria.dataplane.transfer.layerwise.LayerwiseLoads` (``loads``)."""

    def __init__(self, tables: Tables, loads: LayerwiseLoads, counters: TransferCounters,
                 drop: Callable[[Sequence[ObjectKey]], None] | None = None):
        self.tables = tables
        self.drop = drop  # frees DRAM objects' slots (the engine's): a step's drops (start's ``drops``)
        self.loads = loads
        self.host_pool = loads.host_pool
        self.dram = loads.dram
        self.streams = loads.streams
        self.counters = counters
        self.kv_bytes = tables.kv_bytes
        self.host_seconds: list[float] | None = None  # a list: each save_layer's host time is appended
        self.retirer = loads.retirer  # ends a step once its copies ran (StepSave.end)
        self._open: set[StepSave] = set()  # steps started, not finished
        self._lock = threading.Lock()
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        # CPU: copies the layers handed over; CUDA: prepares each step's layers ahead of its hooks
        self._thread = threading.Thread(target=self._loop, name="saria-layer-saves", daemon=True)
        self._thread.start()

    def ok(self, order: Order) -> bool:
        """Whether :meth:`start` can take ``order``: a store or a promotion from the pages of kv
        objects only (a GDN state has no layer hook), on an engine whose pages never straddle two
        host slots."""
        return (isinstance(order, (StoreOrder, PromoteOrder)) and getattr(order, "source", Tier.GPU) is Tier.GPU
                and not order.state and self.loads.capable)

    def start(self, orders: Sequence[StoreOrder | PromoteOrder], kv_blocks: Mapping[Hashable, Blocks],
              drops: Sequence[tuple[object, Sequence[ObjectKey] | None]] = ()) -> StepSave:
        """Check the orders (``ValueError`` before anything started) and return the step's
        :class:`StepSave`, which waits for its hooks. Off this thread (the save thread's
        preparation, module docstring), the step then runs ``drops`` (``(order, keys)``: DRAM
        objects to drop first, whose slots the step may take; each once, before the step's slots
        are taken, and done by the time :meth:`StepSave.end` returns), takes the objects' slots
        and prepares every layer's copies."""
        if drops and self.drop is None:
            raise ValueError("these layer-wise saves were built without a drop function: drops cannot go with a step")
        get = kv_blocks.get
        # every object's block id list, in the order of the loop below (a malformed order: the loop says which and why)
        step_ids = self.tables.step_ids(KV, lambda: [get(chunk) for order in orders for chunk in order.kv])
        every = step_ids.every  # the common case: nothing left to check
        objects: list[tuple] | None = None if every else []  # (chunk, order index, ids), where checked here
        capable, k = self.loads.capable, 0
        for o, order in enumerate(orders):
            kind = type(order)
            if kind is not StoreOrder:  # the common case needs none of these checks but the last
                if not isinstance(order, (StoreOrder, PromoteOrder)):
                    raise ValueError(f"store_layers() takes StoreOrders or PromoteOrders, got {kind.__name__}")
                if isinstance(order, PromoteOrder) and order.source is not Tier.GPU:
                    raise ValueError(f"store_layers() copies from HBM; a PromoteOrder from {order.source} is a "
                                     "prewarm (execute())")
            if order.state or not capable or (kind is not StoreOrder and not self.ok(order)):
                raise ValueError(f"order {order.order_id} cannot be stored layer by layer (a GDN state, or pages "
                                 "that straddle host slots): store it whole with store()")
            if every:  # vouched for: the objects are made by the step's preparation (StepSave._objs)
                continue
            for n, chunk in enumerate(order.kv):
                objects.append((chunk, o, step_ids.checked(k, get(chunk), f"kv object {n} of order {order.order_id}")))
                k += 1
        if every:
            objects = (tuple(orders), step_ids.make)
        if self._closed:
            raise RuntimeError("the transfer engine is closed")
        released = LazyEvent()  # one for the step's orders: StepSave._end sets them all at once
        runs = [OrderRun(order, _running(), released) for order in orders]
        step = StepSave(self, runs, objects, len(self.loads.layers))
        step._drops = [(order, None if keys is None else list(keys)) for order, keys in drops]
        self.counters.add(layerwise_save_steps=1,
                          layerwise_store_objects=len(step_ids.lists) if every else len(objects))
        with self._lock:
            self._open.add(step)
        try:
            # the drops, the slots and where the pages go: worked out off this thread (the save thread)
            step._preparing = lambda: self._prepare(step)
            if self.streams.cuda:
                with self._lock:
                    if not self._closed:
                        self._queue.put((step, None))
        except Exception as exc:  # nothing was copied yet: the slots go back, the objects fail
            step._end(exc)
        return step

    def _prepare(self, step: StepSave) -> "LayeredCopy | None":
        """The step's preparation, once, under ``StepSave._prepare_lock`` (the save thread, or the
        first hook that needs it): its drops first, then its objects' slots (an object that does
        not fit fails), then its copies of every layer in one pass: where each page goes in the
        objects' slots (:func:`slot_layout`) and the copies (their work array uploaded on the
        ``offload`` stream, where the layers' launches run). ``None``: nothing to copy. The slots
        stay the step's until it ends, and it ends only after this returned."""
        step._run_drops()
        objects = step._objs()
        self._allocate(objects)
        step._allocated = True
        placed = [obj for obj in objects if obj.slots is not None]
        if not placed:
            return None
        slots = [obj.slots for obj in placed]
        buffers, ids, where, offsets = slot_layout(self.host_pool, self.loads.page_offsets, slots,
                                                   torch.stack([obj.ids.on(torch.device("cpu")) for obj in placed]))
        with self.streams.on("offload"):
            return self.loads.prepare(buffers, ids, where, offsets, pack=True)

    def _allocate(self, objects: list[_Object]) -> None:
        need = self.host_pool.slots_for(self.kv_bytes)
        for obj in objects:
            try:
                obj.slots = self.host_pool.allocate(need)
            except HostPoolFull as exc:
                log.warning("host pool full: %s not stored (%s)", obj.key, exc)
                self.counters.add(host_pool_full=1, store_failures=1)
                obj.error = exc

    # --- the CPU's save thread -------------------------------------------------------------------

    def submit(self, step: StepSave, layer: int) -> None:
        """Hand one layer to the save thread (CPU); once closed, the layer fails its step."""
        with self._lock:
            if not self._closed:
                self._queue.put((step, layer))
                return
        step._fault(RuntimeError("the transfer engine is closed"))
        step._done.set(layer)

    def _loop(self) -> None:
        bind_thread(self.streams.device)
        while True:
            work = self._queue.get()
            if work is None:
                return
            step, layer = work
            if layer is None:
                step._prepare_ahead()
            else:
                step._run_layer(layer)

    def settle(self) -> None:
        """Wait for what is queued on the ``offload`` stream (a failure path: never raises)."""
        try:
            self.streams.synchronize("offload")
        except Exception as exc:
            log.warning("synchronizing the offload stream failed: %s", exc)

    def forget(self, step: StepSave) -> None:
        with self._lock:
            self._open.discard(step)

    def close(self) -> None:
        """Fail the steps not finished (their copies handed over run first) and stop the thread."""
        with self._lock:
            steps = list(self._open)
        for step in steps:
            step.abort(RuntimeError("the transfer engine closed before the step's saves finished"))
        with self._lock:
            self._closed = True
            self._queue.put(None)
        if self._thread is not None:
            self._thread.join()


def _running() -> Future:
    return RunningFuture()
