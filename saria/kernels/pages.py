"""``pack_pages`` / ``unpack_pages``: gather paged KV into contiguous staging bytes and scatter back.

Staging layout (the contract with the data plane and the SSD format). For ``block_ids`` of shape
``[C, P]`` (1-D ids are one chunk: ``C = 1``), chunk ``c`` occupies bytes
``[c * P * B, (c + 1) * P * B)`` where ``B = table.bytes_per_page``; inside a chunk the order is
tensor after tensor, and inside a tensor's region page after page in ``block_ids`` order::

    staging[c] = cat_t( cat_j( bytes of caches[t][block_ids[c, j]] ) )      # [tensor][page]

So one chunk's kv object is one contiguous run of bytes, whatever the engine's layout.

The Triton kernel covers every (page id, tensor) pair of the call in one launch: program
``(i, t)`` copies page ``block_ids[i]`` of tensor ``t``. When both addresses and the page size are
multiples of 16 bytes it moves 16-byte words (``ld/st.global.v4.b32``: the pointer hints below make
that visible to the compiler, and a test checks the PTX); otherwise it falls back to byte copies
for that page. Each program decides for itself, so one unaligned tensor does not slow the others.
"""

from __future__ import annotations

import operator
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from .backend import launch_guard, resolve_backend
from .page_table import PageTable, check_block_ids, check_staging

# Words (int32) one program moves per loop iteration on the 16-byte path, and bytes on the
# narrow path. 2048 words = 8 KiB: with 4 warps each thread keeps four 16-byte loads in flight.
# Untuned on a GPU yet: bench/bench_kernels.py --sweep-block measures the alternatives.
WORDS_PER_ITER = 2048
BYTES_PER_ITER = 2048
NUM_WARPS = 4


@triton.jit
def _copy_pages_kernel(
    p_table,  # int64 [T, 4]: base address, page stride, page bytes, tensor offset in one page id's bytes
    p_ids,  # int64 [C * P]
    staging_addr,  # int64: address of staging byte 0
    pages_per_chunk,  # P
    chunk_bytes,  # P * bytes per page id
    PACK: tl.constexpr,  # True: pages -> staging; False: staging -> pages
    WORDS: tl.constexpr,
    BYTES: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    base = tl.load(p_table + i_t * 4)
    page_stride = tl.load(p_table + i_t * 4 + 1)
    page_bytes = tl.load(p_table + i_t * 4 + 2)
    tensor_offset = tl.load(p_table + i_t * 4 + 3)
    block = tl.load(p_ids + i_n)
    i_c = i_n // pages_per_chunk
    i_j = i_n - i_c * pages_per_chunk

    page_addr = base + block * page_stride
    stage_addr = staging_addr + i_c * chunk_bytes + tensor_offset * pages_per_chunk + i_j * page_bytes
    if PACK:
        src_addr = page_addr
        dst_addr = stage_addr
    else:
        src_addr = stage_addr
        dst_addr = page_addr

    if ((src_addr | dst_addr | page_bytes) & 15) == 0:
        p_src = src_addr.to(tl.pointer_type(tl.int32))
        p_dst = dst_addr.to(tl.pointer_type(tl.int32))
        n_words = tl.multiple_of(page_bytes // 4, 4)
        for start in range(0, n_words, WORDS):
            o_w = start + tl.arange(0, WORDS)
            mask = o_w < n_words
            # Both runs start 16-byte aligned and are contiguous: lets the compiler emit v4 copies.
            p_s = tl.max_contiguous(tl.multiple_of(p_src + o_w, [16]), [WORDS])
            p_d = tl.max_contiguous(tl.multiple_of(p_dst + o_w, [16]), [WORDS])
            tl.store(p_d, tl.load(p_s, mask=mask), mask=mask)
    else:
        p_src8 = src_addr.to(tl.pointer_type(tl.uint8))
        p_dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        for start in range(0, page_bytes, BYTES):
            o_b = start + tl.arange(0, BYTES)
            mask = o_b < page_bytes
            tl.store(p_dst8 + o_b, tl.load(p_src8 + o_b, mask=mask), mask=mask)


def _launch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, per_chunk: int, pack: bool, *,
            words: int = WORDS_PER_ITER, num_warps: int = NUM_WARPS) -> None:
    """One launch over every (page id, tensor) pair. ``words``/``num_warps``: for benchmark sweeps.
    Trusts its input: ``table`` verified, ``ids`` from :func:`check_block_ids`, ``staging`` from
    :func:`check_staging` (as the public ops below pass them)."""
    if ids.numel() == 0:
        return
    grid = (ids.numel(), len(table))
    with launch_guard():
        _copy_pages_kernel[grid](
            table._addresses(), ids, staging.data_ptr(), per_chunk, table.staging_bytes(per_chunk),
            PACK=pack, WORDS=words, BYTES=BYTES_PER_ITER, num_warps=num_warps)


# --- pure-torch reference ------------------------------------------------------------------------

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


def _reference(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int, per_chunk: int, *,
               pack: bool) -> None:
    """The torch reference of both directions: runs of consecutive ids as slice copies (CPU), else
    one indexed copy per tensor (``index_select`` to pack, ``index_copy_`` to unpack)."""
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
def pack_pages_reference(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int,
                         per_chunk: int) -> None:
    """Reference gather: each tensor's pages into its staging region (:func:`_reference`)."""
    _reference(table, ids, staging, chunks, per_chunk, pack=True)


@torch.no_grad()
def unpack_pages_reference(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int,
                           per_chunk: int) -> None:
    """Reference scatter: each tensor's staging region into its pages (:func:`_reference`)."""
    _reference(table, ids, staging, chunks, per_chunk, pack=False)


# --- public ops ----------------------------------------------------------------------------------

def pack_pages(caches: PageTable | Sequence[torch.Tensor], block_ids: torch.Tensor,
               out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Gather pages ``block_ids`` of every tensor in ``caches`` into contiguous uint8 staging.

    ``caches``: a sequence of paged tensors (dim 0 indexes pages, each page contiguous; see
    :mod:`saria.kernels.page_table`) or a prebuilt :class:`PageTable`. ``block_ids``: 1-D integer
    ids, or 2-D ``[chunks, pages_per_chunk]`` for a batch of chunks (returned as
    ``[chunks, bytes_per_chunk]``, each row one chunk). ``out``: optional contiguous uint8 tensor
    of exactly the right size on the caches' device, 1-D or ``[chunks, bytes_per_chunk]``, sharing
    no memory with the caches. Returns the staging tensor, laid out tensor after tensor, pages in
    ``block_ids`` order (module docstring). Never synchronizes when ``block_ids`` are on the CPU.
    Everything is checked before anything is copied (:mod:`saria.kernels.page_table`): a stale
    table raises ``StaleTableError``, bad ids ``IndexError`` or ``ValueError``, bad staging ``ValueError``.
    """
    table = PageTable.of(caches)
    ids, chunks, per_chunk = check_block_ids(block_ids, table, unique=False)
    size = table.staging_bytes(chunks * per_chunk)
    shape = (size,) if block_ids.dim() == 1 else (chunks, table.staging_bytes(per_chunk))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=table.device)
    else:
        check_staging(out, table, chunks, per_chunk, "out")
    if resolve_backend(backend, table.device) == "triton":
        _launch(table, ids, out, per_chunk, pack=True)
    elif size:
        pack_pages_reference(table, ids, out, chunks, per_chunk)
    return out


def unpack_pages(staging: torch.Tensor, caches: PageTable | Sequence[torch.Tensor],
                 block_ids: torch.Tensor, *, backend: str = "auto") -> None:
    """Scatter ``staging`` (as produced by :func:`pack_pages` for the same ids) back into the pages
    ``block_ids`` of every tensor in ``caches``, in place. The exact inverse of ``pack_pages``.

    Duplicate ids and tables whose tensors share page bytes are refused: the writes would race.
    So is a ``staging`` sharing memory with any page of the table. Errors as for :func:`pack_pages`.
    """
    table = PageTable.of(caches)
    if table.overlap is not None:
        a, b = table.overlap
        raise ValueError(f"{table.names[a]} and {table.names[b]} share memory: unpacking into them would overwrite "
                         "one tensor's pages with the other's")
    ids, chunks, per_chunk = check_block_ids(block_ids, table, unique=True)
    check_staging(staging, table, chunks, per_chunk, "staging")
    if resolve_backend(backend, table.device) == "triton":
        _launch(table, ids, staging, per_chunk, pack=False)
    elif staging.numel():
        unpack_pages_reference(table, ids, staging, chunks, per_chunk)


def drop_leading_pages(staging: torch.Tensor, caches: PageTable | Sequence[torch.Tensor], pages_per_chunk: int,
                       skip: int) -> torch.Tensor:
    """One chunk's staging without its first ``skip`` pages in every tensor: the staging that
    :func:`unpack_pages` expects for the chunk's remaining ``pages_per_chunk - skip`` ids (a copy).
    Used when the engine already holds the start of a chunk and must not have it overwritten.
    ``staging``: one chunk (1-D, or ``[1, bytes]``); ``pages_per_chunk``, ``skip``: integers."""
    table = PageTable.of(caches)
    pages_per_chunk, skip = _count(pages_per_chunk, "pages_per_chunk"), _count(skip, "skip")
    if not 0 <= skip < pages_per_chunk:
        raise ValueError(f"skip must be in [0, pages_per_chunk) = [0, {pages_per_chunk}), got {skip}")
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
    if staging.dim() != 1 and not (staging.dim() == 2 and staging.shape[0] == 1):
        raise ValueError(f"staging has shape {tuple(staging.shape)}: drop_leading_pages takes one chunk's "
                         "staging (1-D or [1, bytes]); pass one row at a time")
    flat = staging.reshape(-1)
    check_staging(flat, table, 1, pages_per_chunk, "staging")
    if skip == 0:
        return flat
    return torch.cat([flat[off * pages_per_chunk + skip * seg.page_bytes:(off + seg.page_bytes) * pages_per_chunk]
                      for off, seg in zip(table.tensor_offsets, table.segments)])


def _count(value, name: str) -> int:
    """``value`` as an int (ints and integer scalars; not bools, floats or strings)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
