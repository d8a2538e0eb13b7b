"""The connector's scheduler half behind a fault barrier: every hook vLLM's scheduler calls goes
through :class:`SchedulerGuard`, and no exception of saria's comes out.

On a fault (:mod:`.faults`) in the control plane or in :class:`~.scheduler.SariaScheduler`:

* the hook answers safely: a lookup is a miss ``(0, False)``, a finished request frees its blocks
  at once, the metadata is always a valid :class:`~.metadata.SariaConnectorMetadata`;
* the :class:`~.scheduler.SariaScheduler` (and its control plane, whose state may be half
  changed) is replaced by a fresh, empty one under a new ``epoch``. The metadata carries the epoch:
  the worker, on seeing a new one, waits for its loads and orders in flight, fails those loads
  and drops every object it caches (nothing the new control plane does not know of may be read or
  leak); reports of the old epoch are ignored here. Requests in flight are forgotten: they run on
  as misses, and are not stored;
* after ``faults.LIMIT`` faults within ``faults.WINDOW_S`` (or when a rebuild fails, or the worker
  reports its data plane off) saria turns off for the rest of the run, with one log line: lookups
  miss, no loads or orders are sent, and the worker closes its data plane.

Whatever happens, a request vLLM waits for hears its load end, and no other does: vLLM calls
``update_state_after_alloc`` with its external tokens in the same scheduling pass that builds the
step's metadata, so a request told to load whose load is not in that metadata (a fault came
between) is sent as a cancel instead, which the worker reports finished and failed; and a load
for a request vLLM is not waiting for is a fault, never sent.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .faults import Faults
from .metadata import SariaConnectorMetadata, SariaWorkerMetadata
from .scheduler import SariaScheduler, summary_line

log = logging.getLogger("saria.vllm")


class SchedulerGuard:
    """The scheduler half, fail-safe (module docstring). ``build`` makes a fresh
    :class:`SariaScheduler` (with a fresh control plane); ``inner`` is the current one."""

    def __init__(self, build: Callable[[], SariaScheduler], *, log_interval_s: float = 60.0,
                 faults: Faults | None = None, clock: Callable[[], float] = time.monotonic):
        self._build = build
        self.inner = build()
        self.faults = faults or Faults("scheduler", clock=clock)
        self.epoch = 0
        self.off = False
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._awaiting: set[str] = set()  # told to load asynchronously since the last metadata
        self._last_log = clock()

    # --- vLLM scheduler hooks --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.off:
            return 0, False
        try:
            return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            self._fault("get_num_new_matched_tokens", exc)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:  # vLLM now waits for this request's load
            self._awaiting.add(request.request_id)
        if self.off:
            return
        try:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:
            self._fault("update_state_after_alloc", exc)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        if self.off:
            return {}
        try:
            return self.inner.hit_sources(request, num_external_tokens)
        except Exception as exc:
            self._fault("get_external_cache_hit_sources", exc)
            return {}

    def build_connector_meta(self, scheduler_output: Any) -> SariaConnectorMetadata:
        meta = None
        if not self.off:
            try:
                meta = self.inner.build_connector_meta(scheduler_output)
                stray = sorted({load.req_id for load in meta.loads} - self._awaiting)
                if stray:  # vLLM would take their "load finished" for a broken invariant and stop
                    raise RuntimeError(f"loads for requests vLLM is not waiting for: {stray}")
            except Exception as exc:
                self._fault("build_connector_meta", exc)
                meta = None  # its loads and orders belong to the control plane just replaced
        if meta is None:
            meta = SariaConnectorMetadata()
        sent = {load.req_id for load in meta.loads}
        meta.cancels = sorted(self._awaiting - sent)
        self._awaiting.clear()
        meta.epoch, meta.off = self.epoch, self.off
        self._maybe_log()
        return meta

    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(report, SariaWorkerMetadata):
            if report.off:
                self._turn_off("the worker turned its data plane off")
            if report.epoch != self.epoch:
                return  # reports on a control plane since replaced
        if self.off:
            return
        try:
            self.inner.update_connector_output(output)
        except Exception as exc:
            self._fault("update_connector_output", exc)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Never delays freeing: the worker ran every order that reads a request's blocks in the
        step that completed its prompt."""
        if self.off:
            return False, None
        try:
            return self.inner.request_finished(request, list(block_ids))
        except Exception as exc:
            self._fault("request_finished", exc)
            return False, None

    def has_pending_work(self) -> bool:
        if self.off:
            return False
        try:
            return self.inner.has_pending_work()
        except Exception as exc:
            self._fault("has_pending_push_work", exc)
            return False

    def stats(self) -> dict:
        """Faults and what they led to, for tests, the session result and the summary line."""
        return dict(self.faults.snapshot(), epoch=self.epoch, off=self.off)  # epoch: rebuilds so far

    # --- faults ----------------------------------------------------------------------------------

    def _fault(self, where: str, exc: BaseException) -> None:
        if self.faults.record(where, exc):
            self._turn_off(f"{self.faults.limit} faults within {self.faults.window_s:g} s")
            return
        try:
            inner = self._build()
        except Exception as build_exc:
            self.faults.record("rebuild", build_exc)
            self._turn_off("its control plane could not be rebuilt")
            return
        self.inner = inner
        self.epoch += 1
        log.warning("saria scheduler: control plane rebuilt empty (epoch %d); requests in flight are served as "
                    "misses and the worker drops every cached object", self.epoch)

    def _turn_off(self, reason: str) -> None:
        if self.off:
            return
        self.off = True
        log.error("saria: turned off for the rest of this run (%s); vLLM computes every token itself from now on",
                  reason)

    def _maybe_log(self) -> None:
        now = self.clock()
        if not self.log_interval_s or now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        try:
            if self.off:
                log.info("saria: off, %d fault(s)", self.faults.count)
            else:
                log.info("saria: %s", summary_line(self.inner.control, self.faults.count, self.epoch))
        except Exception as exc:  # a log line is never worth a fault's consequences
            log.warning("saria: summary line failed: %s", exc)
