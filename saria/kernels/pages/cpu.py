"""The torch path of ``pack_pages`` / ``unpack_pages`` (``backend="torch"``): fast on the CPU.

What runs for CPU tensors without Triton's interpreter (and for ``backend="torch"`` anywhere; on
CUDA it is correct, but the Triton kernel is the fast path there). Same staging layout as the
kernel (:mod:`saria.kernels.pages`), byte for byte:

* ids in runs of consecutive pages (a chunk usually is one run) are copied as slices, one plain
  memory copy per run and tensor, which torch spreads over its threads;
* other ids take one indexed copy per tensor (``index_select`` / ``index_copy_``), each tensor
  seen as the widest integer word its pages allow;
* a large call shares its tensors among up to ``torch.get_num_threads()`` threads.

Not a reference: the tests hold it against :mod:`saria.kernels.pages.naive`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..page_table import PageTable


def _widest(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same byte views reinterpreted as the widest integer word all of them allow (torch's
    indexed copies run several times faster on int64 than on bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return tuple(v.view(dtype) for v in views)
        except RuntimeError:  # size, stride or offset not a multiple of the word
            continue
    return views


def _regions(table: PageTable, staging: torch.Tensor, chunks: int, per_chunk: int):
    """Pairs (tensor t's pages as a [num_pages, page_words] view, t's staging region
    [chunks, per_chunk * page_words]) for every tensor of the table, in the widest common word."""
    rows = staging.view(chunks, table.staging_bytes(per_chunk))
    for t, seg in enumerate(table.segments):
        start = table.tensor_offsets[t] * per_chunk
        yield _widest(table.byte_pages(t), rows[:, start:start + per_chunk * seg.page_bytes])


# torch's indexed copies run on one thread: a large CPU pack or unpack splits its tensors over up
# to torch.get_num_threads() threads (they release the GIL), as a GPU kernel covers them all at once.
PARALLEL_MIN_BYTES = 4 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _runs(ids: torch.Tensor, chunks: int, per_chunk: int) -> list[tuple[int, int, int, int]] | None:
    """``(chunk, first slot, first page, pages)`` per run of consecutive page ids within a chunk,
    or None when the runs are short (under 4 pages on average): then indexed copies are faster."""
    if ids.device.type != "cpu" or not ids.numel():
        return None
    rows = ids.view(chunks, per_chunk).tolist()
    runs = []
    for c, row in enumerate(rows):
        start = 0
        for j in range(1, per_chunk + 1):
            if j == per_chunk or row[j] != row[j - 1] + 1:
                runs.append((c, start, row[start], j - start))
                start = j
    return runs if 4 * len(runs) <= ids.numel() else None


def _copy_runs(table: PageTable, staging: torch.Tensor, chunks: int, per_chunk: int,
               runs: list[tuple[int, int, int, int]], pack: bool) -> None:
    """Pack or unpack by runs of consecutive pages: one slice ``copy_`` per run and tensor (a plain
    memory copy, which torch spreads over its threads), instead of a one-thread indexed copy."""
    for pages, region in _regions(table, staging, chunks, per_chunk):
        words = pages.shape[1]
        for c, j, page, n in runs:
            rows = region[c, j * words:(j + n) * words].view(n, words)
            if pack:
                rows.copy_(pages[page:page + n])
            else:
                pages[page:page + n].copy_(rows)


def _per_tensor(table: PageTable, staging: torch.Tensor, chunks: int, per_chunk: int,
                copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """``copy(pages, region)`` for every tensor of the table (:func:`_regions`); on the CPU, a call
    of at least ``PARALLEL_MIN_BYTES`` shares its tensors among up to ``torch.get_num_threads()``
    threads (each tensor's copy on one thread, so no two threads write the same bytes)."""
    regions = list(_regions(table, staging, chunks, per_chunk))
    threads = min(torch.get_num_threads(), len(regions))
    if table.device.type != "cpu" or threads < 2 or staging.numel() < PARALLEL_MIN_BYTES:
        for pages, region in regions:
            copy(pages, region)
        return
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="saria-pages")
        pool = _pool

    def run(share: list) -> None:
        with torch.no_grad():
            for pages, region in share:
                copy(pages, region)

    futures = [pool.submit(run, regions[i::threads]) for i in range(1, threads)]
    run(regions[0::threads])
    for future in futures:
        future.result()


def _copy(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int, per_chunk: int, *,
          pack: bool) -> None:
    """Both directions: runs of consecutive ids as slice copies (CPU), else one indexed copy per
    tensor (``index_select`` to pack, ``index_copy_`` to unpack)."""
    runs = _runs(ids, chunks, per_chunk)
    if runs is not None:
        _copy_runs(table, staging, chunks, per_chunk, runs, pack=pack)
    elif pack:
        _per_tensor(table, staging, chunks, per_chunk,
                    lambda pages, region: region.copy_(pages.index_select(0, ids).view(region.shape)))
    else:
        _per_tensor(table, staging, chunks, per_chunk,
                    lambda pages, region: pages.index_copy_(0, ids, region.reshape(-1, pages.shape[1])))


@torch.no_grad()
def pack_pages_torch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int,
                     per_chunk: int) -> None:
    """Gather: each tensor's pages ``ids`` (``chunks x per_chunk``, int64 on the table's device)
    into its region of ``staging`` (:func:`_copy`). Trusts its input, as the public op passes it."""
    _copy(table, ids, staging, chunks, per_chunk, pack=True)


@torch.no_grad()
def unpack_pages_torch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int,
                       per_chunk: int) -> None:
    """Scatter: each tensor's region of ``staging`` into its pages ``ids`` (:func:`_copy`). Trusts
    its input, as the public op passes it."""
    _copy(table, ids, staging, chunks, per_chunk, pack=False)
