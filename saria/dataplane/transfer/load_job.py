"""One reload in flight: :class:`LoadJob` (what the caller waits on), :class:`LoadItem` (one object
of the plan and where it goes) and :class:`LoadResult` (how it ended).

The transfer engine creates the job with its items and reports on it from its copy threads
through the job's public methods: :meth:`LoadJob.finish` when objects are in their pages (with the
CUDA event that says when) or failed, :meth:`LoadJob.mark` for timeline points, and
:meth:`LoadJob.then` / :meth:`LoadJob.start_deferred` for the SSD part of a serial plan, held
back until the DRAM part is issued. The job never moves a byte itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from saria.kernels import BlockIds, PageTable
from saria.orders import DRAM, KV, STATE, ObjectKey, ReloadPlan, Tier

from saria.dataplane.transfer.flags import LazyEvent


@dataclass(frozen=True)
class LoadResult:
    """How a reload ended. ``failed``: objects that could not be delivered (pass them to
    ``commit_prefill(failed=...)`` or ``release(failed=...)``); ``valid_chunks``: how many leading
    chunks of the plan are loaded and usable (everything from the first failure on must be
    recomputed; a failed state object invalidates the whole plan)."""

    plan_id: int
    failed: tuple[ObjectKey, ...]
    valid_chunks: int
    dram_bytes: int
    ssd_bytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class LoadItem:
    """One object of a reload: where it comes from and which pages it goes to.

    ``index``: the chunk's position in the plan (a state object: its chunk's position);
    ``blocks``: its block ids (checked, all of the object's pages); ``nbytes``: its bytes as they
    travel (its FP8 form's when ``quantized``: a kv object read from SSD under ``ssd_dtype="fp8"``,
    dequantized by the unpack); ``skip``: leading pages the engine already holds and that must not
    be written (only the plan's first chunk has any)."""

    index: int
    key: ObjectKey
    tier: Tier
    table: PageTable
    blocks: BlockIds
    nbytes: int
    skip: int = 0
    quantized: bool = False
    plan: int = 0  # in a layer-wise step's StepJob: the position of its plan in the step


class _ItemJob:
    """The item bookkeeping a :class:`LoadJob` and a :class:`StepJob` share: ``items`` pending until
    the engine's threads :meth:`finish` them (each once), the failed ones, the device events after
    which the finished ones are in their pages, and the flag set once the last one is finished.
    :meth:`_what` names the job in messages."""

    timeline = None  # a LoadJob's, if it keeps one (a layer-wise step keeps none)

    def _init_items(self, items, after, pending: int | None = None) -> None:
        """``pending``: how many items will be finished (default ``len(items)``)."""
        self.after = after
        self.items = items
        self._pending = len(items) if pending is None else pending
        self._lock = threading.Lock()
        self._issued = LazyEvent()  # made per job, seldom waited on before it is set
        self._events: list = []
        self._failed: list[LoadItem] = []
        self._start = time.perf_counter()
        self._end: float | None = None
        if not self._pending:
            self._issued.set()

    def _what(self) -> str:
        raise NotImplementedError

    def finish(self, items: LoadItem | Iterable[LoadItem], event=None, error: BaseException | None = None) -> None:
        """``items`` (one or several) are done: in their pages once ``event`` (CUDA) is reached,
        or, with ``error``, failed (their pages hold nothing usable). Each item is finished once."""
        items = [items] if isinstance(items, LoadItem) else list(items)
        if not items:
            return
        with self._lock:
            if len(items) > self._pending:
                raise RuntimeError(f"{self._what()}: {len(items)} objects finished but only {self._pending} "
                                   "are pending")
            if event is not None:
                self._events.append(event)
            if error is not None:
                self._failed.extend(items)
            self._pending -= len(items)
            last = self._pending == 0
        if last:
            self._issued.set()

    @property
    def timed(self) -> bool:
        """Whether this reload keeps a timeline (callers skip recording timing events otherwise)."""
        return self.timeline is not None

    def done(self) -> bool:
        """All objects issued (and, on CPU, copied). On CUDA the copies may still be running."""
        return self._issued.is_set()

    def ready(self) -> bool:
        """Every object is in its pages (or failed): issued, and every CUDA event reached. Never blocks."""
        return self._issued.is_set() and all(event.query() for event in self._events)

    @property
    def events(self) -> tuple:
        """The device events after which every object issued so far is in its pages."""
        with self._lock:
            return tuple(self._events)

    def wait_on(self, streams, name: str | None = None) -> None:
        """Make a stream of ``streams`` (a :class:`~saria.dataplane.transfer.streams.Streams`; ``name``
        ``None``: the caller's current stream) wait for every copy and unpack of this reload, without
        blocking the host once everything is issued (on the CPU the work is done by then)."""
        self._issued.wait()
        for event in self._events:
            streams.wait(name, event)


class LoadJob(_ItemJob):
    """One reload in flight. ``wait()`` blocks the host until every object is in its pages;
    ``wait_on(streams)`` instead makes the caller's CUDA stream wait (no host block once all is issued).

    ``start_event``: with a ``timeline``, a timing event recorded when the reload started (the
    time base of the device-timed points :meth:`mark` gets). ``after``: an event on the caller's
    stream that the reload's unpacks must follow (its pages may still be in use by work the caller
    queued before it, e.g. a step that freed them); ``None``: nothing to follow."""

    def __init__(self, plan: ReloadPlan, items: list[LoadItem], timeline: list | None, start_event=None,
                 after=None):
        if timeline is not None and start_event is not None and not start_event.enable_timing:
            raise ValueError("a timeline's start event must be created with enable_timing=True")
        self.plan = plan
        self._init_items(tuple(items), after)
        self.timeline = timeline
        self._start_event = start_event  # CUDA: device time base for timeline points
        self._marks: list[tuple[str, object, int]] = []
        self._deferred: list[tuple[Callable, list[LoadItem]]] = []
        dram_bytes = ssd_bytes = 0
        for i in items:
            if i.tier is Tier.DRAM:
                dram_bytes += i.nbytes
            elif i.tier is Tier.SSD:
                ssd_bytes += i.nbytes
        self.dram_bytes, self.ssd_bytes = dram_bytes, ssd_bytes

    # --- reported by the engine (finish: _ItemJob) -----------------------------------------------

    def _what(self) -> str:
        return f"reload of plan {self.plan.plan_id}"

    def mark(self, path: str, nbytes: int, event=None) -> None:
        """A timeline point: ``nbytes`` of ``path`` done now (host time) or when ``event`` (a timing
        event) fires, resolved in :meth:`wait` without blocking the copy threads. No-op without a
        timeline."""
        if self.timeline is not None:
            if event is not None and (self._start_event is None or not event.enable_timing):
                raise ValueError("a device-timed timeline point needs a timing event (enable_timing=True) and "
                                 "the job's timing start event")
            with self._lock:
                self._marks.append((path, event if event is not None else time.perf_counter() - self._start, nbytes))

    def then(self, start: Callable[[LoadJob, list[LoadItem]], None], items: Iterable[LoadItem]) -> None:
        """A serial plan's second part: ``start(job, items)`` once the first part is issued
        (:meth:`start_deferred`, called by the path that runs the first part)."""
        with self._lock:
            self._deferred.append((start, list(items)))

    @property
    def deferred(self) -> bool:
        """Whether :meth:`then` holds anything back."""
        return bool(self._deferred)

    def start_deferred(self) -> None:
        """Start what :meth:`then` held back (each once; nothing if nothing was)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for start, items in deferred:
            start(self, items)

    # --- for the caller --------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> LoadResult:
        if not self._issued.wait(timeout):
            raise TimeoutError(f"reload of plan {self.plan.plan_id} not done after {timeout} s")
        for event in self._events:
            event.synchronize()
        if self._end is None:
            self._end = time.perf_counter()
            if self.timeline is not None:
                for path, when, nbytes in self._marks:
                    if not isinstance(when, float):
                        when = self._start_event.elapsed_time(when) / 1e3
                    self.timeline.append((path, when, nbytes))
                self.timeline.sort(key=lambda point: point[1])
        return self.result()

    def outcome(self, timeout: float | None = None) -> LoadResult:
        """The result once every object is issued or failed, without waiting for the device: for a
        caller whose stream already waits for the copies (:meth:`wait_on`, a layer-wise step's
        waits). Which objects failed is known on the host; the copies may still be running."""
        if not self._issued.wait(timeout):
            raise TimeoutError(f"reload of plan {self.plan.plan_id} not issued after {timeout} s")
        return self.result()

    def result(self) -> LoadResult:
        if not self._issued.is_set():
            raise RuntimeError("reload still in flight: call wait() first")
        plan = self.plan
        if not self._failed:  # the common case: everything arrived
            return LoadResult(plan.plan_id, (), len(plan.chunk_hashes), self.dram_bytes, self.ssd_bytes,
                              (self._end or time.perf_counter()) - self._start)
        return _failed_result(plan, self._failed, self.dram_bytes, self.ssd_bytes,
                              (self._end or time.perf_counter()) - self._start)


def _failed_result(plan: ReloadPlan, failed: list[LoadItem], dram_bytes: int, ssd_bytes: int,
                   seconds: float) -> LoadResult:
    """A plan's result when ``failed`` (not empty) did not arrive: every chunk from the first failed
    one on is invalid (a failed state object: the whole plan)."""
    failed = sorted(failed, key=lambda i: (i.index, i.key.kind))
    valid = plan.num_chunks
    for item in failed:
        valid = 0 if item.key.kind == STATE else min(valid, item.index)
    return LoadResult(plan.plan_id, tuple(i.key for i in failed), valid, dram_bytes, ssd_bytes, seconds)


class StepJob(_ItemJob):
    """One layer-wise step's reloads of several plans as one job (one a step, not one per plan):
    the hook checks every plan and its block ids and hands them over; each path thread makes the
    items of its own tier (:meth:`take`: a :class:`LoadItem` per object, naming its plan's position
    in ``plans``, :attr:`LoadItem.plan`), off the hook's thread. The engine finishes items on it as
    on a :class:`LoadJob`; :meth:`outcomes` / :meth:`wait` give one :class:`LoadResult` per plan, in
    order, each from its own items only (one plan's failed object never touches another plan's
    result).

    ``ids``: the checked block ids of every plan's chunks in order, plan after plan (a list of
    :class:`~saria.kernels.BlockIds`, or a callable that makes that list: ids a batch check
    vouched for, made by the first path thread that needs them); ``skips``: each plan's
    ``skip_pages`` (its first chunk's); ``table``, ``nbytes``: every object's page table and size
    (layer-wise objects are kv objects, none in an FP8 form); ``after``: as for :class:`LoadJob`."""

    def __init__(self, plans: list[ReloadPlan], ids, skips: list[int], table: PageTable, nbytes: int,
                 after=None):
        self.plans = plans
        self.skips = skips
        self.table, self.nbytes = table, nbytes
        self._ids = ids
        self._lost: list[bool] = []  # paths (dram or not) that could not make their items (abandon)
        self.count = sum(len(plan.kv_sources) for plan in plans)  # objects, every tier (as many as chunks)
        self._init_items([], after, self.count)  # the path threads add the items they make
        self._results: list[LoadResult] | None = None  # made once every item is issued

    def _what(self) -> str:
        return "layer-wise reloads"

    def _block_ids(self) -> list:
        ids = self._ids
        if callable(ids):
            with self._lock:  # made once, by the first path thread
                if callable(self._ids):
                    self._ids = self._ids()
                ids = self._ids
        return ids

    def take(self, dram: bool) -> list[LoadItem]:
        """The items of every plan's objects read from DRAM (``dram``) or from anywhere else (the
        SSD path's), in plan and chunk order: a path thread's work, made there; each is then
        finished on this job."""
        ids = self._block_ids()
        table, nbytes, out, base = self.table, self.nbytes, [], 0
        for p, plan in enumerate(self.plans):
            sources = plan.kv_sources
            n = len(sources)
            if (DRAM in sources) if dram else sources.count(DRAM) < n:
                skip = self.skips[p]
                for i, (chunk, source) in enumerate(zip(plan.chunk_hashes, sources)):
                    if (source is DRAM) is dram:
                        out.append(LoadItem(i, ObjectKey(chunk, KV), source, table, ids[base + i], nbytes,
                                            skip if i == 0 else 0, False, p))
            base += n
        with self._lock:
            self.items += out
        return out

    def abandon(self, dram: bool) -> int:
        """A path thread could not make its items (:meth:`take` raised): every object it would
        have taken fails (counted here, so that no waiter hangs; named in the results). Returns
        how many."""
        n = sum(plan.kv_sources.count(DRAM) if dram else len(plan.kv_sources) - plan.kv_sources.count(DRAM)
                for plan in self.plans)
        with self._lock:
            self._lost.append(dram)
            self._pending -= n
            last = self._pending <= 0
        if last:
            self._issued.set()
        return n

    def outcomes(self, timeout: float | None = None) -> list[LoadResult]:
        """Each plan's result once every object is issued or failed, without waiting for the device
        (as :meth:`LoadJob.outcome`); made once."""
        if not self._issued.wait(timeout):
            raise TimeoutError(f"layer-wise reloads of plans {[p.plan_id for p in self.plans]} not issued after "
                               f"{timeout} s")
        results = self._results
        if results is None:
            results = self._results = self._make()
        return results

    def wait(self, timeout: float | None = None) -> list[LoadResult]:
        """:meth:`outcomes` once every copy ran (the host waits for the device: closing, tests)."""
        self.outcomes(timeout)
        for event in self._events:
            event.synchronize()
        if self._end is None:
            self._end = time.perf_counter()
            self._results = self._make()
        return self._results

    def _make(self) -> list[LoadResult]:
        n = len(self.plans)
        dram, ssd = [0] * n, [0] * n
        for item in self.items:
            if item.tier is Tier.DRAM:
                dram[item.plan] += item.nbytes
            elif item.tier is Tier.SSD:
                ssd[item.plan] += item.nbytes
        seconds = (self._end or time.perf_counter()) - self._start
        failed: dict[int, list[LoadItem]] = {}
        for item in self._failed:
            failed.setdefault(item.plan, []).append(item)
        if self._lost:  # objects no path thread made an item of
            for p, plan in enumerate(self.plans):
                for i, (chunk, source) in enumerate(zip(plan.chunk_hashes, plan.kv_sources)):
                    if (source is DRAM) in self._lost:
                        failed.setdefault(p, []).append(LoadItem(i, ObjectKey(chunk, KV), source, self.table, None,
                                                                 self.nbytes, plan=p))
        out = []
        for p, plan in enumerate(self.plans):
            bad = failed.get(p)
            out.append(LoadResult(plan.plan_id, (), len(plan.chunk_hashes), dram[p], ssd[p], seconds) if bad is None
                       else _failed_result(plan, bad, dram[p], ssd[p], seconds))
        return out


class PlanLoad:
    """One plan of a :class:`StepJob` as a job of its own (``ready``, ``wait``, ``wait_on``,
    ``outcome``: those of the step's job, the result this plan's): for a caller that combines it
    with other work (a cluster fetch)."""

    __slots__ = ("step", "index")

    def __init__(self, step: StepJob, index: int):
        self.step, self.index = step, index

    @property
    def plan(self) -> ReloadPlan:
        return self.step.plans[self.index]

    def ready(self) -> bool:
        return self.step.ready()

    def done(self) -> bool:
        return self.step.done()

    def wait_on(self, streams, name: str | None = None) -> None:
        self.step.wait_on(streams, name)

    def outcome(self, timeout: float | None = None) -> LoadResult:
        return self.step.outcomes(timeout)[self.index]

    def wait(self, timeout: float | None = None) -> LoadResult:
        return self.step.wait(timeout)[self.index]
