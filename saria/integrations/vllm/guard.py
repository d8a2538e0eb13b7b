"""The connector's scheduler half behind a fault barrier: every hook vLLM's scheduler calls goes
through :class:`SchedulerGuard`, and no exception of saria's comes out.

On a fault (:mod:`.faults`) in the control plane or in :class:`~.scheduler.SariaScheduler`:

* the hook answers safely: a lookup is a miss ``(0, False)``, a finished request frees its blocks
  at once, the metadata is always a valid :class:`~.metadata.SariaConnectorMetadata`;
* the :class:`~.scheduler.SariaScheduler` (and its control plane, whose state may be half
  changed) is replaced by a fresh, empty one under a new ``epoch``. The metadata carries the epoch:
  the worker, on seeing a new one, waits for its loads and orders in flight, fails those loads
  and drops what the new control plane cannot vouch for (its DRAM objects, and SSD objects whose
  write had not ended); reports of the old epoch are ignored here. The SSD tier survives: the new
  control plane takes over the ranks' SSD inventories, which each rank sends again with its first
  report of the new epoch, exactly as the first control plane takes over a previous run's objects
  (the connector builds every one with ``recover``, :mod:`.recovery`: lookups answer "not yet"
  until every rank's inventory is in, for at most ``recover_wait_s``), and the cluster tier's
  lookups go on (its index outlives control planes). A fault is no evidence about the tier's
  bytes: only a failed checksum or seal, another identity or a retired key file epoch drops SSD
  objects (the ``epoch`` here is the control plane's, not a key file's). Requests in flight are
  forgotten: they run on as misses, and are not stored;
* after ``faults.LIMIT`` faults within ``faults.WINDOW_S`` (or when a rebuild fails, or the worker
  reports its data plane off) saria turns off for the rest of the run, with one log line: lookups
  miss, no loads or orders are sent, and the worker closes its data plane.

Whatever happens, a request vLLM waits for hears its load end, and no other does: vLLM calls
``update_state_after_alloc`` with its external tokens in the same scheduling pass that builds the
step's metadata, so a request told to load whose load is not in that metadata (a fault came
between) is sent as a cancel instead, which the worker reports finished and failed (an in-step,
layer-wise load, which vLLM runs in the very step: its blocks reported in error); and a load
for a request vLLM is not waiting for is a fault, never sent. Likewise every request whose blocks
vLLM holds for saria (``request_finished`` answered True: its stores still read them) is named in
the next metadata (``held``) whatever happens, the worker reports it sent once nothing reads its
blocks (at once when off), and until then vLLM keeps stepping (``has_pending_work``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .events import KVEvents
from .faults import Faults
from .metadata import SariaConnectorMetadata, SariaWorkerMetadata, add_counts
from .metrics import GAUGES
from .requests import summary_line
from .scheduler import SariaScheduler, uncount_tokens

log = logging.getLogger("saria.vllm")


class SchedulerGuard:
    """The scheduler half, fail-safe (module docstring). ``build`` makes a fresh
    :class:`SariaScheduler` (with a fresh control plane); ``inner`` is the current one."""

    def __init__(self, build: Callable[[], SariaScheduler], *, log_interval_s: float = 60.0,
                 faults: Faults | None = None, clock: Callable[[], float] = time.monotonic,
                 events: KVEvents | None = None):
        self._build = build
        self.events = events  # vLLM's KV events for saria's tiers, or None (kv events off: nothing kept)
        self.inner = build()
        self.faults = faults or Faults("scheduler", clock=clock)
        self.epoch = 0
        self.off = False
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._awaiting: set[str] = set()  # told to load since the last metadata
        self._awaiting_blocks: dict[str, tuple] = {}  # of those, in-step loads: (blocks, request, tokens)
        self._retired: dict[str, int] = {}  # the totals of control planes since replaced
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until the worker sends them
        self._newly_held: list[str] = []  # of those, not yet told to the worker
        self._last_log = clock()
        self.resets = 0  # vLLM's resets of the connector (reset_cache), told to the workers in every metadata

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
        groups = None
        if num_external_tokens > 0:  # vLLM now waits for this request's load
            self._awaiting.add(request.request_id)
            try:  # an in-step load runs in this step: a cancel must name the blocks vLLM will read
                if self.inner.layerwise:
                    groups = blocks.get_block_ids()
                    group = groups[self.inner.geometry.attention_group]
                    self._awaiting_blocks[request.request_id] = (tuple(group), request, num_external_tokens)
            except Exception as exc:
                groups = None
                self._fault("update_state_after_alloc", exc)
        if self.off:
            return
        try:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens, groups)
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
        for req_id in meta.cancels:
            if req_id in self._awaiting_blocks:  # an in-step load that will not run: vLLM recomputes its tokens
                blocks, request, tokens = self._awaiting_blocks[req_id]
                meta.cancel_blocks[req_id] = blocks
                uncount_tokens(request, tokens)
        self._awaiting.clear()
        self._awaiting_blocks.clear()
        meta.held, self._newly_held = self._newly_held, []
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.epoch, meta.off = self.epoch, self.off
        meta.resets = self.resets
        self._maybe_log()
        return meta

    def update_connector_output(self, output: Any) -> None:
        self._held.difference_update(getattr(output, "finished_sending", None) or ())  # vLLM frees their blocks
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
        """Delays freeing a request's blocks while orders read them (:meth:`SariaScheduler.request_finished`):
        the next metadata tells the worker (``held``), which reports the request sent once nothing
        reads them, whatever happens in between (faults, a new epoch, turning off)."""
        if self.off:
            return False, None
        try:
            delay, params = self.inner.request_finished(request, block_ids)
        except Exception as exc:
            self._fault("request_finished", exc)
            return False, None
        if delay:
            self._held.add(request.request_id)
            self._newly_held.append(request.request_id)
        return bool(delay), params

    def holds_blocks(self) -> bool:
        """vLLM holds blocks of finished requests for saria's stores, freed within a step or a few:
        a request short of blocks waits for them rather than preempting another."""
        return bool(self._held)

    def has_pending_work(self) -> bool:
        """Also while vLLM holds blocks for saria (the worker reports them sent in a later step),
        even once off."""
        if self._held:
            return True
        if self.off:
            return False
        try:
            return self.inner.has_pending_work()
        except Exception as exc:
            self._fault("has_pending_push_work", exc)
            return False

    def take_events(self) -> list:
        """vLLM's KV events for saria's tiers since the last call (:mod:`.events`): none when
        vLLM's KV events are off; once saria is off, the removals of what it held, then none.
        Never raises."""
        if self.events is None:
            return []
        try:
            return self.events.take()
        except Exception as exc:  # KVEvents is fail-safe itself: this is a last resort, never a rebuild
            log.warning("saria: KV events unavailable: %s", exc)
            return []

    def totals(self) -> dict[str, int]:
        """Counters since start, monotonic over rebuilds (:meth:`SariaScheduler.totals` of every
        control plane so far, summed) and ``scheduler_faults``: for the summary line and vLLM's
        connector stats. Never raises."""
        try:
            current = self.inner.totals()
        except Exception as exc:  # a broken control plane: its counts since the last rebuild are lost
            log.warning("saria: scheduler counters unavailable: %s", exc)
            current = {}
        out = add_counts(self._retired, current)
        for name in GAUGES:  # a gauge is the current control plane's, not a sum over rebuilt ones
            out[name] = current.get(name, 0)
        out["scheduler_faults"] = self.faults.count
        return out

    def stats(self) -> dict:
        """Faults and what they led to, for tests, the session result and the summary line."""
        return dict(self.faults.snapshot(), epoch=self.epoch, off=self.off)  # epoch: rebuilds so far

    def reset(self) -> None:
        """vLLM reset the connector (``reset_cache``, :mod:`.resets`): a fresh, empty control plane
        under a new epoch, as after a fault but not counted as one, and the reset counted for the
        workers (each drops every object it holds when the metadata tells it). Never raises; a
        control plane that cannot be built turns saria off (nothing is served then either)."""
        self.resets += 1
        if self.off:
            return
        inner = self._rebuild("reset_cache", "its control plane could not be rebuilt on a reset")
        if inner is None:
            return
        takeover = getattr(inner, "takeover", None)
        if takeover is not None:  # every rank deletes its SSD objects on a reset (it reports none): nothing
            takeover.active = False  # to wait for, also while vLLM is paused (it then steps no more)
        log.info("saria scheduler: reset by vLLM (weights may have changed): control plane rebuilt empty (epoch %d); "
                 "nothing cached before is served again", self.epoch)

    # --- faults ----------------------------------------------------------------------------------

    def _fault(self, where: str, exc: BaseException) -> None:
        if self.faults.record(where, exc):
            self._turn_off(f"{self.faults.limit} faults within {self.faults.window_s:g} s")
            return
        if self._rebuild("rebuild", "its control plane could not be rebuilt") is None:
            return
        log.warning("saria scheduler: control plane rebuilt (epoch %d): it takes over the workers' SSD objects as at "
                    "start; requests in flight run on as misses and the DRAM tier starts empty", self.epoch)

    def _rebuild(self, where: str, failure: str) -> SariaScheduler | None:
        """Replace the control plane with a fresh one under a new epoch (its predecessor's counters
        kept in the totals); the new one, or None when it could not be built (saria turned off)."""
        try:
            inner = self._build()
        except Exception as exc:
            self.faults.record(where, exc)
            self._turn_off(failure)
            return None
        try:
            self._retired = add_counts(self._retired, self.inner.totals())
        except Exception as exc:
            log.warning("saria: counters of the replaced control plane lost: %s", exc)
        try:  # the applications' pins, retentions and sessions outlive the control plane (saria.control.hints)
            inner.control.restore_hints(self.inner.control.hint_state(), inner.clock())
        except Exception as exc:  # the type only: a message could name a hinted chunk
            log.warning("saria: cache hints (pins, sessions) of the replaced control plane lost: %s",
                        type(exc).__name__)
        self.inner = inner
        self.epoch += 1
        return inner

    def _turn_off(self, reason: str) -> None:
        if self.off:
            return
        self.off = True
        if self.events is not None:
            self.events.close()  # what saria held is gone: routers hear it removed
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
                log.info("saria: %s", summary_line(self.totals(), self.epoch))
        except Exception as exc:  # a log line is never worth a fault's consequences
            log.warning("saria: summary line failed: %s", exc)
