"""One reload in flight: :class:`LoadJob` (what the caller waits on), :class:`LoadItem` (one object
of the plan and where it goes) and :class:`LoadResult` (how it ended); :class:`StagingPool`, the
reusable staging buffers reloads land in on a machine without CUDA.

The transfer engine creates the job with its items and reports on it from its copy threads
through the job's public methods: :meth:`LoadJob.finish` when objects are in their pages (with the
CUDA event that says when) or failed, :meth:`LoadJob.mark` for timeline points, and
:meth:`LoadJob.defer_ssd` / :meth:`LoadJob.take_deferred` for the SSD part of a serial plan, held
back until the DRAM part is done. The job never moves a byte itself.
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from saria.kernels import PageTable
from saria.orders import STATE, ObjectKey, ReloadPlan, Tier


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
    ``blocks``: its block ids (CPU int64, all of the object's pages); ``skip``: leading pages the
    engine already holds and that must not be written (only the plan's first chunk has any)."""

    index: int
    key: ObjectKey
    tier: Tier
    table: PageTable
    blocks: torch.Tensor
    nbytes: int
    skip: int = 0


class LoadJob:
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
        self.after = after
        self.items = tuple(items)
        self._pending = len(items)
        self._lock = threading.Lock()
        self._issued = threading.Event()
        self._events: list = []
        self._failed: list[LoadItem] = []
        self._start = time.perf_counter()
        self._end: float | None = None
        self.timeline = timeline
        self._start_event = start_event  # CUDA: device time base for timeline points
        self._marks: list[tuple[str, object, int]] = []
        self._deferred: list[LoadItem] = []
        self.dram_bytes = sum(i.nbytes for i in items if i.tier is Tier.DRAM)
        self.ssd_bytes = sum(i.nbytes for i in items if i.tier is Tier.SSD)
        if not items:
            self._issued.set()

    # --- reported by the engine ------------------------------------------------------------------

    def finish(self, items: LoadItem | Iterable[LoadItem], event=None, error: BaseException | None = None) -> None:
        """``items`` (one or several) are done: in their pages once ``event`` (CUDA) is reached,
        or, with ``error``, failed (their pages hold nothing usable). Each item is finished once."""
        items = [items] if isinstance(items, LoadItem) else list(items)
        if not items:
            return
        with self._lock:
            if len(items) > self._pending:
                raise RuntimeError(f"reload of plan {self.plan.plan_id}: {len(items)} objects finished but only "
                                   f"{self._pending} are pending")
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

    def defer_ssd(self, items: Iterable[LoadItem]) -> None:
        """Hold SSD items back until the DRAM part is done (a serial plan); see :meth:`take_deferred`."""
        with self._lock:
            self._deferred.extend(items)

    def take_deferred(self) -> list[LoadItem]:
        """The items held back by :meth:`defer_ssd` (each returned once)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        return deferred

    # --- for the caller --------------------------------------------------------------------------

    def done(self) -> bool:
        """All objects issued (and, on CPU, copied). On CUDA the copies may still be running."""
        return self._issued.is_set()

    def ready(self) -> bool:
        """Every object is in its pages (or failed): issued, and every CUDA event reached. Never blocks."""
        return self._issued.is_set() and all(event.query() for event in self._events)

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

    def wait_on(self, streams, name: str | None = None) -> None:
        """Make a stream of ``streams`` (a :class:`~saria.dataplane.transfer.streams.Streams`; ``name``
        ``None``: the caller's current stream) wait for every copy and unpack of this reload, without
        blocking the host once everything is issued (on the CPU the work is done by then)."""
        self._issued.wait()
        for event in self._events:
            streams.wait(name, event)

    def result(self) -> LoadResult:
        if not self._issued.is_set():
            raise RuntimeError("reload still in flight: call wait() first")
        failed = sorted(self._failed, key=lambda i: (i.index, i.key.kind))
        valid = self.plan.num_chunks
        for item in failed:
            valid = 0 if item.key.kind == STATE else min(valid, item.index)
        return LoadResult(self.plan.plan_id, tuple(i.key for i in failed), valid, self.dram_bytes, self.ssd_bytes,
                          (self._end or time.perf_counter()) - self._start)


class StagingPool:
    """Staging buffers for reloads, reused from one batch to the next.

    On CUDA, :meth:`take` is a plain ``torch.empty`` on the device: PyTorch's caching allocator
    already reuses memory in stream order (take it inside the stream that will use it). On the CPU
    a fresh ``torch.empty`` of tens of MiB is a new ``mmap`` whose every page faults on first touch
    (measured on the 2-core VM: a 72 MiB staging filled at ~1.2 GB/s, about 20x slower than a copy
    into warm memory), so buffers are kept: page-aligned (SSD reads land in them with O_DIRECT,
    without a bounce buffer), at most ``keep`` of them, each reused for any request it can hold.
    """

    ALIGN = 2 << 20  # buffer sizes are rounded up to 2 MiB so nearby sizes share a buffer

    def __init__(self, device: torch.device, keep: int = 4):
        self.device = device
        self.keep = keep
        self._free: list[tuple[mmap.mmap, torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[object, torch.Tensor]:
        """A uint8 tensor of exactly ``nbytes`` (contents undefined) and the handle to :meth:`give`
        back once nothing reads or writes it any more."""
        if self.device.type != "cpu":
            return None, torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            fits = [b for b in self._free if b[1].numel() >= nbytes]
            buf = min(fits, key=lambda b: b[1].numel()) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            size = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return buf, buf[1][:nbytes]

    def give(self, handle: object) -> None:
        """Return a buffer from :meth:`take` (``None``, a CUDA staging, is left to the allocator)."""
        if handle is None:
            return
        with self._lock:
            self._free.append(handle)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=lambda b: b[1].numel()))  # dropped when unreferenced

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b[1].numel() for b in self._free)
