"""The Triton kernel of ``pack_pages`` / ``unpack_pages`` and its launcher (:func:`launch`).

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

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import variants
from ..backend import INTERPRETED
from ..checks import MAX_PAGE_IDS, check_choice, check_in_range, check_power_of_two
from ..page_table import PageTable

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
    :func:`launch` computes it once per table. Order: ``"page"`` (the tile-major grid is a sweep
    option)."""
    return config_for_bytes(max(s.page_bytes for s in table.segments), interpreted=interpreted)


def config_for_bytes(largest: int, *, interpreted: bool = INTERPRETED) -> LaunchConfig:
    """:func:`launch_config` for pages of at most ``largest`` bytes."""
    page_words = -(-largest // 4)
    if interpreted:
        words = min(INTERPRETED_MAX_WORDS, max(16, _next_pow2(page_words)))
        return LaunchConfig(words=words, tiles=1, num_warps=NUM_WARPS, bytes=4 * words)
    words = min(TILE_WORDS, max(MIN_TILE_WORDS, _next_pow2(page_words)))
    tiles = min(MAX_GRID_YZ, -(-largest // (4 * words)))
    return LaunchConfig(words=words, tiles=tiles, num_warps=NUM_WARPS, bytes=min(BYTES_PER_ITER, 4 * words))


_CONFIGS: "weakref.WeakKeyDictionary[PageTable, LaunchConfig]" = weakref.WeakKeyDictionary()


# Every int that varies per call is not specialized (Triton would compile a variant per value class:
# == 1, multiple of 16, other) and the table and ids pointers not on alignment (scalar loads): one
# compile per (PACK, WORDS, BYTES, TILE_MAJOR, num_warps), warmed at start (saria.kernels.warm).
@triton.jit(do_not_specialize=["staging_addr", "pages_per_chunk", "chunk_bytes", "tiles"],
            do_not_specialize_on_alignment=["p_table", "p_ids"])
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

    copy_page_tiles(src_addr, dst_addr, page_bytes, i_s, n_s, WORDS, BYTES)


@triton.jit
def copy_page_tiles(src_addr, dst_addr, page_bytes, i_s, n_s, WORDS: tl.constexpr, BYTES: tl.constexpr):
    """Copy tiles ``i_s, i_s + n_s, ...`` of one page of ``page_bytes`` from ``src_addr`` to
    ``dst_addr`` (int64 addresses): 16-byte words when both addresses and the size are multiples of
    16 (``ld/st.global.v4.b32``: the hints make that visible to the compiler), else bytes, ``BYTES``
    at a time over the same tiles. Shared by the pack/unpack kernel and the scattered one."""
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


def launch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, per_chunk: int, pack: bool, *,
           words: int | None = None, num_warps: int | None = None, tiles: int | None = None,
           byte_step: int | None = None, order: str | None = None) -> LaunchConfig:
    """Pack (``pack=True``: pages -> staging) or unpack with one launch over every
    (page id, tensor, tile) of the call, configured by :func:`launch_config`; ``words`` /
    ``num_warps`` / ``tiles`` / ``byte_step`` / ``order`` override it (benchmark sweeps, tests).
    Returns the configuration launched. Never synchronizes. Trusts its input, as the public ops
    pass it: ``table`` verified, ``ids`` the int64 ids of a :class:`~saria.kernels.checks.BlockIds`
    on the table's device (``BlockIds.on``), ``staging`` accepted by
    :func:`~saria.kernels.checks.check_staging`."""
    cfg = _CONFIGS.get(table)
    if cfg is None:  # the rule depends on the table alone: computed once per table
        cfg = _CONFIGS[table] = launch_config(table, ids.numel())
    if any(x is not None for x in (words, num_warps, tiles, byte_step, order)):
        words = cfg.words if words is None else words
        check_power_of_two(words, "words", least=4, why=" (tiles start 16-byte aligned)")
        tiles = cfg.tiles if tiles is None else tiles
        check_in_range(tiles, "tiles", 1, MAX_GRID_YZ, " (CUDA grid axis 2)")
        num_warps = cfg.num_warps if num_warps is None else num_warps
        check_power_of_two(num_warps, "num_warps", most=32)
        if byte_step is None:
            byte_step = 4 * words if INTERPRETED else min(BYTES_PER_ITER, 4 * words)
        check_power_of_two(byte_step, "byte_step")
        order = cfg.order if order is None else order
        check_choice(order, "order", ("page", "tile"))
        cfg = LaunchConfig(words=words, tiles=tiles, num_warps=num_warps, bytes=byte_step, order=order)
    if ids.numel() == 0:
        return cfg
    tiles, tile_major = cfg.tiles, cfg.order == "tile"
    if tile_major:
        tiles = max(1, min(tiles, MAX_PAGE_IDS // ids.numel()))  # axis 0 = ids * tiles < 2**31
        grid = (ids.numel() * tiles, len(table), 1)
    else:
        grid = (ids.numel(), len(table), tiles)
    variants.launch(_copy_pages_kernel, grid, _args(table, ids, staging.data_ptr(), per_chunk, tiles),
                    _consts(cfg, pack, tile_major), cfg.num_warps)
    return cfg


def _args(table: PageTable, ids: torch.Tensor, staging_addr: int, per_chunk: int, tiles: int) -> tuple:
    return (table._addresses(), ids, staging_addr, per_chunk, table.staging_bytes(per_chunk), tiles)


def _consts(cfg: LaunchConfig, pack: bool, tile_major: bool) -> dict:
    return dict(PACK=pack, WORDS=cfg.words, BYTES=cfg.bytes, TILE_MAJOR=tile_major)


def warm(table: PageTable, per_chunk: int, staging_addr: int) -> list[tuple]:
    """Compile (record, under the interpreter) the variants :func:`launch` uses for ``table`` with
    its own launch rule, packing and unpacking; ``staging_addr``: an address like those of the
    staging it will see (its int type is part of the variant). Returns their keys."""
    cfg = _CONFIGS.get(table)
    if cfg is None:
        cfg = _CONFIGS[table] = launch_config(table, per_chunk)
    ids = torch.zeros(per_chunk, dtype=torch.int64, device=table.device)
    return [variants.warm(_copy_pages_kernel, table.device, _args(table, ids, staging_addr, per_chunk, cfg.tiles),
                          _consts(cfg, pack, False), cfg.num_warps) for pack in (True, False)]
