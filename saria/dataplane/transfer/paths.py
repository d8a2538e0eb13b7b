"""What the transfer engine's paths share: their results (:class:`Completion`, :class:`OrderRun`),
their counters (:class:`Counters`), the engine's page tables with the block-id checks
(:class:`Tables`), and the one unpack both reload paths end with (:func:`unpack_run`). Their CUDA
streams and events (and the events' CPU twins) are in :mod:`~saria.dataplane.transfer.streams`.

Each path (:mod:`~saria.dataplane.transfer.dram_loads`, :mod:`~saria.dataplane.transfer.ssd_loads`,
:mod:`~saria.dataplane.transfer.offload`) is given these by :class:`~saria.dataplane.transfer.engine.TransferEngine`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

import torch

from saria.orders import KV, ObjectKey, Order
from saria.kernels import PageTable, drop_leading_pages, unpack_pages

from saria.dataplane import nvtx
from saria.dataplane.transfer.load_job import LoadItem, LoadJob
from saria.dataplane.transfer.streams import STREAMS, Streams  # noqa: F401  (re-exported: the paths import them from here)

log = logging.getLogger("saria.dataplane.transfer.engine")

Blocks = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class Completion:
    """How an order ended, for ``ControlPlane.complete(order_id, ok, now, failed=failed)``."""

    order_id: int
    ok: bool
    failed: tuple[ObjectKey, ...] = ()


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
    released: threading.Event


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

    def snapshot(self) -> dict:
        return asdict(self)


class Counters:
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


class Tables:
    """The engine's page tables and object shapes: ``kv_table`` (a kv object is ``pages_per_chunk``
    of its pages) and, for hybrid models, ``state_table`` (a state object is ``state_pages``)."""

    def __init__(self, kv_table: PageTable, state_table: PageTable | None, pages_per_chunk: int, state_pages: int):
        self.kv_table = kv_table
        self.state_table = state_table
        self.pages_per_chunk = pages_per_chunk
        self.state_pages = state_pages
        self.device = kv_table.device
        self.kv_bytes = kv_table.staging_bytes(pages_per_chunk)
        self.state_bytes = state_table.staging_bytes(state_pages) if state_table is not None else 0

    def table(self, kind: str) -> tuple[PageTable, int, int]:
        """(table, pages per object, bytes per object) for an object kind."""
        if kind == KV:
            return self.kv_table, self.pages_per_chunk, self.kv_bytes
        if self.state_table is None:
            raise ValueError("a state object was asked for but this engine has no state_table (not a hybrid model)")
        return self.state_table, self.state_pages, self.state_bytes

    def ids(self, kind: str, chunk: Hashable, blocks: Blocks | None) -> torch.Tensor:
        """An object's block ids as a CPU int64 tensor; ``ValueError`` if they are missing, not
        integers, the wrong number, or outside the table."""
        table, pages, _ = self.table(kind)
        if blocks is None:
            raise ValueError(f"no block ids given for the {kind} object of chunk {chunk!r}")
        try:
            ids = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(list(blocks), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"the block ids of the {kind} object of chunk {chunk!r} are not integers: {exc}") from None
        if ids.dim() != 1 or ids.numel() != pages:
            raise ValueError(f"the {kind} object of chunk {chunk!r} needs {pages} block ids, got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"the block ids of the {kind} object of chunk {chunk!r} must be integers, got {ids.dtype}")
        ids = ids.to(device="cpu", dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_pages):
            raise ValueError(f"the {kind} object of chunk {chunk!r} names block ids {ids.tolist()} outside "
                             f"[0, {table.num_pages})")
        return ids


def _unpack(item: LoadItem, staging: torch.Tensor) -> None:
    """Unpack one object from its own staging (``item.nbytes`` bytes)."""
    if item.skip:
        staging = drop_leading_pages(staging, item.table, item.blocks.numel(), item.skip)
    unpack_pages(staging, item.table, item.blocks[item.skip:])


def unpack_run(job: LoadJob, items: list[LoadItem], staging: torch.Tensor, path: str, streams: Streams,
               counters: Counters) -> None:
    """Unpack ``items`` (one page table; ``staging`` their packed bytes back to back) with one
    launch on ``path``'s stream, and finish them on ``job`` (with an event on that stream). Never
    raises (its callers are the paths' threads, which must neither die nor leave a job waiting):
    if the launch is refused (e.g. two objects naming the same page), each object is unpacked
    alone and only those that fail alone fail."""
    try:
        with streams.on(path), nvtx.nvtx_range(nvtx.UNPACK):
            if job.after is not None:  # the pages are written only after the caller's queued work
                streams.wait(path, job.after)
            if len(items) == 1:
                _unpack(items[0], staging)
            else:
                unpack_pages(staging, items[0].table, torch.stack([i.blocks for i in items]))
            event = streams.record(path)
    except Exception as exc:
        if len(items) == 1:
            log.warning("%s reload of %s failed: %s", path.upper(), items[0].key, exc)
            counters.add(load_failures=1)
            job.finish(items, error=exc)
            return
        offset = 0
        for item in items:
            unpack_run(job, [item], staging[offset:offset + item.nbytes], path, streams, counters)
            offset += item.nbytes
        return
    job.finish(items, event=event)
