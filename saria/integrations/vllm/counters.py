"""A worker rank's counters (:class:`WorkerCounters`): the snapshot that tests, ``saria`` commands
and the metrics read, and its per-step delta for vLLM's connector stats (:mod:`.metrics`).

The data plane's counters are those of the engine (``engine``, ``coordinator``, ``host_pool``,
``ssd``), of the cluster tier (``cluster``) and of the layer-wise reloads (``layerwise``); when
the worker turns off they are kept as they were when its data plane closed (:meth:`~WorkerCounters.keep`), so a snapshot still has them.
"""

from __future__ import annotations

import logging
from typing import Any

from saria.dataplane.build import DataPlaneParts

from .metrics import worker_totals

log = logging.getLogger("saria.vllm")


class WorkerCounters:
    """The counters of one worker rank (module docstring). ``worker``: its
    :class:`~.worker.SariaWorker` (``data``, ``cluster``, ``faults``, ``epoch``, ``off``,
    ``saves``, ``audit``)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.final: dict = {}  # the engine's counters when its data plane closed
        self._seen: dict[str, float] = {}

    def keep(self, data: DataPlaneParts) -> None:
        """The data plane ``data`` is about to close: keep its counters."""
        try:
            self.final = data.engine.counters()
            if self.worker.cluster is not None:
                self.final["cluster"] = self.worker.cluster.counters()
        except Exception as exc:
            log.warning("saria worker: counters unavailable: %s", exc)

    def snapshot(self) -> dict:
        """The engine's counters (``engine``, ``coordinator``, ``host_pool``, ``ssd``), also after
        the data plane closed, and the connector's (``connector``: faults, epoch, off)."""
        worker = self.worker
        try:
            out = worker.data.engine.counters() if worker.data is not None else dict(self.final)
            if worker.data is not None and worker.cluster is not None:
                out["cluster"] = worker.cluster.counters()
        except Exception as exc:
            log.warning("saria worker: counters unavailable: %s", exc)
            out = {}
        out["connector"] = dict(worker.faults.snapshot(), epoch=worker.epoch, off=worker.off,
                                held=len(worker.saves.held), preemption_waits=worker.saves.preemption_waits)
        if worker.audit is not None:
            out["audit"] = dict(worker.audit.counters(), served=worker.audit.served)
        if worker.layers is not None:
            counters = worker.layers.counters  # numbers: a shallow copy (asdict deep-copies, every step)
            out["layerwise"] = {name: getattr(counters, name) for name in counters.__dataclass_fields__}
        return out

    def stats_delta(self) -> dict[str, int | float]:
        """What changed since the last call, for vLLM's connector stats (:func:`~.metrics.worker_totals`)."""
        totals = worker_totals(self.snapshot(), self.worker.faults.count)
        delta = {k: v - self._seen.get(k, 0) for k, v in totals.items()}
        self._seen = totals
        return {k: v for k, v in delta.items() if v}
