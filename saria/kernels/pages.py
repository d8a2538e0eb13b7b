"""``pack_pages`` / ``unpack_pages``: gather paged KV into contiguous staging bytes and scatter back.

Staging layout (the contract with the data plane and the SSD format). For ``block_ids`` of shape
``[C, P]`` (1-D ids are one chunk: ``C = 1``), chunk ``c`` occupies bytes
``[c * P * B, (c + 1) * P * B)`` where ``B = table.bytes_per_page``; inside a chunk the order is
tensor after tensor, and inside a tensor's region page after page in ``block_ids`` order::

    staging[c] = cat_t( cat_j( bytes of caches[t][block_ids[c, j]] ) )      # [tensor][page]

So one chunk's kv object is one contiguous run of bytes, whatever the engine's layout.

The Triton kernel covers every (page id, tensor) pair of the call in one launch, each page split
into tiles over several programs: program ``(i, t, s)`` copies tiles ``s, s + S, s + 2S, ...`` of
page ``block_ids[i]`` of tensor ``t`` (``S`` programs per page, grid axis 2; a tile is ``WORDS``
4-byte words). Pages of different sizes share one grid: a program whose first tile lies past its
page's end copies nothing. When both addresses and the page size are multiples of 16 bytes it moves
16-byte words (``ld/st.global.v4.b32``: the pointer hints below make that visible to the compiler,
and a test checks the PTX); otherwise it falls back to byte copies for that page, ``BYTES`` at a
time over the same tiles. Each program decides for itself, so one unaligned tensor does not slow
the others. :func:`launch_config` picks the tile, the split and the warps from the table's page
sizes (docs/kernels.md has the measurements behind it).
"""

from __future__ import annotations

import operator
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from .backend import INTERPRETED, launch_guard, resolve_backend
from .page_table import MAX_PAGE_IDS, PageTable, check_block_ids, check_staging

# Launch rule (launch_config). Measured on one H200 (132 SMs, torch 2.11, triton 3.6; the D2D copy of
# the same bytes 1,890-2,130 GB/s), bench/bench_kernels.py --sweep-block, kernel alone (ids on the
# GPU), fraction of the D2D copy as pack / unpack; docs/kernels.md has the tables.
# * Tile: 8,192 words (32 KiB) with one program per tile was the best or within ~1% of the best at
#   1 and 8 chunks of both tables: Qwen3-8B 0.92 / 0.92 (1 chunk) and 0.92 / 0.92 (8 chunks), the
#   hybrid table 0.91 / 0.90 and 0.88 / 0.89; 4,096-word tiles 1-3% lower; 16,384 words / 8 warps
#   (one program per 64 KiB page) within 1%.
# * Split: without it (one program per page, as at a82655d) a one-chunk hybrid table ran 48 programs
#   of ~2.1 MB each on 132 SMs: 0.61 of the copy at this tile and 0.30 at the old 2,048 words.
TILE_WORDS = 8192
# Pages smaller than a tile get a tile of the next power of two of their words, at least this many
# (1,024 words = 4 KiB: with 4 warps, 0.94 of the copy at 8 chunks of Qwen3-8B in the a82655d sweep).
MIN_TILE_WORDS = 1024
# Warps per program: 4 was as good as 8 (within 1%) at 8,192 words on both tables.
NUM_WARPS = 4
# The byte path (unaligned pages) copies this many bytes per loop step inside its tile (a register
# tile of 2 KiB; bytes are 4x the instructions of words, so this path is for odd layouts only).
BYTES_PER_ITER = 2048
# CUDA limit on grid axes 1 and 2 (tensors and tiles per page); axis 0 (page ids) allows 2**31 - 1.
MAX_GRID_YZ = 65_535
# Under TRITON_INTERPRET=1 every program costs about 1 ms while an op on a large block costs little:
# no split, and a tile as large as the largest page up to this many words.
INTERPRETED_MAX_WORDS = 1 << 14


@dataclass(frozen=True)
class LaunchConfig:
    """How one pack/unpack launch covers its pages.

    ``words``: int32 words per tile (a power of two, at least 4, so every tile starts 16-byte
    aligned within its page); ``tiles``: programs per (page id, tensor), each taking every
    ``tiles``-th tile of the page; ``num_warps``: warps per program; ``bytes``: bytes per loop
    step of the byte path (a power of two); ``order``: ``"page"`` launches
    ``grid = (page ids, tensors, tiles)``, so the GPU, which starts programs axis 0 first, runs the
    same tile of many pages at once; ``"tile"`` launches ``grid = (page ids * tiles, tensors)``,
    the tiles of one page one after another (an alternative for the sweep; not measured yet)."""

    words: int
    tiles: int
    num_warps: int
    bytes: int
    order: str = "page"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(table: PageTable, num_ids: int, *, interpreted: bool = INTERPRETED) -> LaunchConfig:
    """The launch rule: a tile of ``TILE_WORDS`` (smaller for pages under 32 KiB: the next power of
    two of the largest page's words, at least ``MIN_TILE_WORDS``), one program per tile of the
    largest page (``tiles = ceil(largest page / tile)``, capped at the grid limit 65,535: programs
    then loop over every ``tiles``-th tile), ``NUM_WARPS`` warps. A Qwen3-8B chunk (32 ids x 36
    tensors of 64 KiB) is 32 x 36 x 2 programs; a one-page hybrid chunk (48 tensors of ~2.1 MB) is
    1 x 48 x 66. Under the interpreter: no split and one tile per page up to 16,384 words.
    ``num_ids`` is part of the signature for rules that weigh the page count; this one does not
    (one tile per program measured as good as fewer, longer programs from 1 to 8 chunks), so
    :func:`_launch` computes it once per table. Order: ``"page"`` (the tile-major grid is a sweep
    option)."""
    largest = max(s.page_bytes for s in table.segments)
    page_words = -(-largest // 4)
    if interpreted:
        words = min(INTERPRETED_MAX_WORDS, max(16, _next_pow2(page_words)))
        return LaunchConfig(words=words, tiles=1, num_warps=NUM_WARPS, bytes=4 * words)
    words = min(TILE_WORDS, max(MIN_TILE_WORDS, _next_pow2(page_words)))
    tiles = min(MAX_GRID_YZ, -(-largest // (4 * words)))
    return LaunchConfig(words=words, tiles=tiles, num_warps=NUM_WARPS, bytes=min(BYTES_PER_ITER, 4 * words))


_CONFIGS: "weakref.WeakKeyDictionary[PageTable, LaunchConfig]" = weakref.WeakKeyDictionary()


@triton.jit(do_not_specialize=["tiles"])
def _copy_pages_kernel(
    p_table,  # int64 [T, 4]: base address, page stride, page bytes, tensor offset in one page id's bytes
    p_ids,  # int64 [C * P]
    staging_addr,  # int64: address of staging byte 0
    pages_per_chunk,  # P
    chunk_bytes,  # P * bytes per page id
    tiles,  # programs per (page id, tensor): the tile stride
    PACK: tl.constexpr,  # True: pages -> staging; False: staging -> pages
    WORDS: tl.constexpr,  # int32 words per tile (a power of two >= 4)
    BYTES: tl.constexpr,  # bytes per step of the byte path
    TILE_MAJOR: tl.constexpr,  # grid (ids * tiles, tensors) instead of (ids, tensors, tiles)
):
    if TILE_MAJOR:
        i_x = tl.program_id(0)
        i_n = (i_x // tiles).to(tl.int64)
        i_s = (i_x % tiles).to(tl.int64)  # this program's first tile of the page
    else:
        i_n = tl.program_id(0).to(tl.int64)
        i_s = tl.program_id(2).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    n_s = tiles.to(tl.int64)
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
        # Tiles i_s, i_s + n_s, ...: none when the page ends before this program's first tile.
        for start in range(i_s * WORDS, n_words, n_s * WORDS):
            o_w = start + tl.arange(0, WORDS)
            mask = o_w < n_words
            # Both runs start 16-byte aligned and are contiguous: lets the compiler emit v4 copies.
            p_s = tl.max_contiguous(tl.multiple_of(p_src + o_w, [16]), [WORDS])
            p_d = tl.max_contiguous(tl.multiple_of(p_dst + o_w, [16]), [WORDS])
            tl.store(p_d, tl.load(p_s, mask=mask), mask=mask)
    else:
        p_src8 = src_addr.to(tl.pointer_type(tl.uint8))
        p_dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        for tile in range(i_s * (4 * WORDS), page_bytes, n_s * (4 * WORDS)):
            end = tl.minimum(tile + 4 * WORDS, page_bytes)
            for start in range(tile, end, BYTES):
                o_b = start + tl.arange(0, BYTES)
                mask = o_b < end
                tl.store(p_dst8 + o_b, tl.load(p_src8 + o_b, mask=mask), mask=mask)


def _launch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, per_chunk: int, pack: bool, *,
            words: int | None = None, num_warps: int | None = None, tiles: int | None = None,
            byte_step: int | None = None, order: str | None = None) -> LaunchConfig:
    """One launch over every (page id, tensor, tile) of the call, configured by :func:`launch_config`;
    ``words`` / ``num_warps`` / ``tiles`` / ``byte_step`` / ``order`` override it (benchmark sweeps,
    tests). Returns the configuration launched. Trusts its input: ``table`` verified, ``ids`` from
    :func:`check_block_ids`, ``staging`` from :func:`check_staging` (as the public ops pass them)."""
    cfg = _CONFIGS.get(table)
    if cfg is None:  # the rule depends on the table alone: computed once per table
        cfg = _CONFIGS[table] = launch_config(table, ids.numel())
    if any(x is not None for x in (words, num_warps, tiles, byte_step, order)):
        words = cfg.words if words is None else words
        if words < 4 or words & (words - 1):
            raise ValueError(f"words must be a power of two >= 4 (tiles start 16-byte aligned), got {words}")
        tiles = cfg.tiles if tiles is None else tiles
        if not 1 <= tiles <= MAX_GRID_YZ:
            raise ValueError(f"tiles must be in [1, {MAX_GRID_YZ}] (CUDA grid axis 2), got {tiles}")
        num_warps = cfg.num_warps if num_warps is None else num_warps
        if num_warps < 1 or num_warps > 32 or num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")
        if byte_step is None:
            byte_step = 4 * words if INTERPRETED else min(BYTES_PER_ITER, 4 * words)
        if byte_step < 1 or byte_step & (byte_step - 1):
            raise ValueError(f"byte_step must be a power of two, got {byte_step}")
        order = cfg.order if order is None else order
        if order not in ("page", "tile"):
            raise ValueError(f"order must be 'page' or 'tile', got {order!r}")
        cfg = LaunchConfig(words=words, tiles=tiles, num_warps=num_warps, bytes=byte_step, order=order)
    if ids.numel() == 0:
        return cfg
    tiles, tile_major = cfg.tiles, cfg.order == "tile"
    if tile_major:
        tiles = max(1, min(tiles, MAX_PAGE_IDS // ids.numel()))  # axis 0 = ids * tiles < 2**31
        grid = (ids.numel() * tiles, len(table), 1)
    else:
        grid = (ids.numel(), len(table), tiles)
    with launch_guard():
        _copy_pages_kernel[grid](
            table._addresses(), ids, staging.data_ptr(), per_chunk, table.staging_bytes(per_chunk), tiles,
            PACK=pack, WORDS=cfg.words, BYTES=cfg.bytes, TILE_MAJOR=tile_major, num_warps=cfg.num_warps)
    return cfg


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
