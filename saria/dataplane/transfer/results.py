"""What the transfer engine hands back and counts: an order's :class:`Completion` and
:class:`OrderRun`, and the engine's :class:`TransferCounters` (one lock, added to by every path)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, _base
from dataclasses import dataclass
from typing import Sequence

from saria.orders import ObjectKey, Order

from saria.dataplane.transfer.flags import LazyEvent

class RunningFuture(Future):
    """A running ``Future`` whose condition (a lock and a ``threading.Condition``, ~2 us to build
    on a busy host) is built on its first use, for the runs of a layer-wise step (one per order, on
    the bind hook's thread, most never waited on): :meth:`done` and :meth:`result` of a finished one
    read its state without it. Otherwise a ``Future`` in every way (``concurrent.futures.wait``,
    callbacks, ``set_result`` from another thread)."""

    def __init__(self):  # Future.__init__ less the condition, in the RUNNING state
        self._state = _RUNNING
        self._result = None
        self._exception = None
        self._waiters = []
        self._done_callbacks = []

    def __getattr__(self, name: str):
        if name != "_condition":
            raise AttributeError(name)
        with _CONDITION_LOCK:  # one condition, whichever thread comes first
            cond = self.__dict__.get("_condition")
            if cond is None:
                cond = self.__dict__["_condition"] = threading.Condition()
        return cond

    def done(self) -> bool:
        return self._state in _DONE  # a state once done stays done: no lock needed to see it

    def result(self, timeout: float | None = None):
        if self._state == _FINISHED and self._exception is None:  # set_result sets _result first
            return self._result
        return super().result(timeout)


_CONDITION_LOCK = threading.Lock()
_DONE = (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED, _base.FINISHED)
_FINISHED, _RUNNING = _base.FINISHED, _base.RUNNING


@dataclass(frozen=True)
class Completion:
    """How an order ended, for ``ControlPlane.complete(order_id, ok, now, failed=failed)``."""

    order_id: int
    ok: bool
    failed: tuple[ObjectKey, ...] = ()

    @classmethod
    def of(cls, order_id: int, objects: int, failed: Sequence[ObjectKey]) -> "Completion":
        """An order of ``objects`` objects, ``failed`` of them failed: ok while some object landed
        (or none was asked for), naming the failed ones; not ok, naming none, when all failed."""
        ok = len(failed) < objects or not objects
        return cls(order_id, ok, tuple(failed) if ok else ())


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
    released: "threading.Event | LazyEvent"  # a layer-wise step's orders share one LazyEvent


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
    ssd_to_dram_bytes: int = 0      # prewarms
    ssd_to_dram_seconds: float = 0.0
    prewarm_failures: int = 0
    layerwise_steps: int = 0        # steps whose reloads went layer by layer (transfer.layerwise)
    layerwise_objects: int = 0
    layer_copies: int = 0           # scattered copies launched for them (per layer, tensor and source)
    layer_waits: int = 0            # layers the engine's forward waited for (StepLoad.wait_layer)
    layerwise_save_steps: int = 0   # steps whose stores went layer by layer (transfer.layer_saves)
    layerwise_store_objects: int = 0
    layer_saves: int = 0            # layers whose copies were started (StepSave.save_layer, or finish)
    layer_saves_late: int = 0       # of them, layers no hook saved: copied by StepSave.finish

    def snapshot(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}  # numbers: no deep copy (asdict)


class TransferCounters:
    """The engine's :class:`EngineCounters`, added to by every path's threads under one lock."""

    def __init__(self):
        self._values = EngineCounters()
        self._lock = threading.Lock()

    def add(self, **deltas) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._values, name, getattr(self._values, name) + value)

    def snapshot(self) -> dict:
        with self._lock:
            return self._values.snapshot()
