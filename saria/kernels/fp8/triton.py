"""The Triton kernels of ``pack_pages_fp8`` / ``unpack_pages_fp8`` and their launcher (:func:`launch`).

Same grid as the pages' kernel (:mod:`saria.kernels.pages.triton`): one launch covers every
(page id, tensor, tile) of the call; program ``(i, t, s)`` handles tiles ``s, s + S, ...`` of page
``block_ids[i]`` of tensor ``t``. A tile is ``GROUPS`` groups of 128 elements, a ``[GROUPS, 128]``
block of registers: the pack loads it in the cache dtype, takes each group's amax, its scale and its
codes, and stores the codes and the scales straight into the FP8 object (no raw staging in between);
the unpack loads codes and scales and stores the decoded elements into the page.

Rounding is integer bit arithmetic, not Triton's float casts (which the interpreter gets wrong:
docs/kernels.md), so the compiled kernel, the interpreter and torch agree bit for bit:

* e4m3: ``|q|`` (already clamped to 448) >= 2**-6 rounds its float32 mantissa to 3 bits, to
  nearest even, and rebiases the exponent; below, ``m = rne(|q| * 2**9)`` (0 to 8) is the
  subnormal code (8 is 2**-6, the smallest normal, code 0x08: the same bits);
* bf16: ``(bits + 0x7FFF + lsb) >> 16``; fp16 through the ``cvt.rn`` cast, which the interpreter
  (numpy) also rounds to nearest even.

Divisions are ``tl.math.div_rn`` (IEEE), as the format requires. Scales are stored and loaded as
4 single bytes (little-endian), so an FP8 object may start at any address. A page whose address and
first code are 16-byte aligned takes a branch whose pointers carry alignment hints (16-byte vector
loads and stores: tests/test_kernels_codegen.py checks the PTX); other pages the same tile code
without them. :func:`launch_config` picks the tile and the split from the table's page sizes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import variants
from ..backend import INTERPRETED
from ..checks import check_in_range, check_power_of_two
from ..page_table import PageTable

GROUP = 128  # saria.ssd_dtype.FP8_GROUP: elements per scale (a tl.constexpr below)
# Groups per tile on a GPU: 16 x 128 elements (4 KiB of bf16 read per tile). Not measured on a GPU
# yet (bench/bench_kernels.py has the fp8 rows, --sweep-block sweeps 8 to 32 groups and 4 / 8 warps).
# ptxas (sm_90a, bf16, 4 warps): 16 groups 72 / 76 registers (pack / unpack), 32 groups 149 / 72,
# 64 groups 221 / 124, no spills; so 16 groups fit 7 programs an SM (28 KiB of loads in flight), 32
# groups 3 (24 KiB).
TILE_GROUPS = 16
NUM_WARPS = 4
MAX_GRID_YZ = 65_535
# Under the interpreter (about 1 ms a program): one tile per page, up to this many groups.
INTERPRETED_MAX_GROUPS = 64

GROUP_C = tl.constexpr(GROUP)
_CODE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the kernels' DTYPE constexpr


@dataclass(frozen=True)
class Fp8LaunchConfig:
    """``groups``: 128-element groups per tile (a power of two); ``tiles``: programs per
    (page id, tensor); ``num_warps``: warps per program."""

    groups: int
    tiles: int
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(table: PageTable, *, interpreted: bool = INTERPRETED) -> Fp8LaunchConfig:
    """A tile of ``TILE_GROUPS`` groups (fewer for smaller pages: the next power of two of the
    largest page's groups), one program per tile of the largest page (capped at the grid limit;
    programs then loop). Under the interpreter, one tile per page up to 64 groups."""
    esize = table.tensors[0].element_size()
    largest = max(s.page_bytes for s in table.segments) // esize // GROUP
    cap = INTERPRETED_MAX_GROUPS if interpreted else TILE_GROUPS
    groups = min(cap, _next_pow2(largest))
    tiles = 1 if interpreted else min(MAX_GRID_YZ, -(-largest // groups))
    return Fp8LaunchConfig(groups=groups, tiles=tiles, num_warps=NUM_WARPS)


_CONFIGS: "weakref.WeakKeyDictionary[PageTable, Fp8LaunchConfig]" = weakref.WeakKeyDictionary()


@triton.jit
def _e4m3_codes(q):
    """float32 ``q`` (finite) -> e4m3fn code bits as int32, clamped to +-448, rounded to nearest even."""
    qb = q.to(tl.int32, bitcast=True)
    a = tl.minimum(qb & 0x7FFFFFFF, 0x43E00000)  # |q| as bits, clamped to 448.0 (bits order like values)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits, exponent bias 127 -> 7
    e = a >> 23
    mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.maximum(tl.minimum(141 - e, 31), 1)  # |q| * 2**9 = mant * 2**(e - 141); normal lanes clamped
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    code = tl.where(a >= 0x3C800000, normal, sub)  # 0x3C800000: 2**-6, e4m3's smallest normal
    return code | tl.where(qb < 0, 0x80, 0)


@triton.jit
def _e4m3_values(code):
    """int32 e4m3fn codes (0-255) -> float32 values (0x7F / 0xFF: NaN)."""
    mag = code & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2**-9, exact
    bits = tl.where(e > 0, normal, sub) | tl.where(code >= 128, -2147483648, 0)
    bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _page_and_object(p_table, p_ids, i_n, i_t, per_chunk, ids_per_chunk, skip, page_id_bytes,
                     ESIZE: tl.constexpr):
    """(page address, elements of the page, byte offset in staging of the page's first code, and of
    its first group's scale) for page id ``i_n`` of tensor ``i_t``."""
    base = tl.load(p_table + i_t * 4)
    page_stride = tl.load(p_table + i_t * 4 + 1)
    n_elem = tl.load(p_table + i_t * 4 + 2) // ESIZE
    tensor_elem = tl.load(p_table + i_t * 4 + 3) // ESIZE
    block = tl.load(p_ids + i_n)
    i_c = i_n // ids_per_chunk
    i_j = i_n - i_c * ids_per_chunk + skip  # the page's slot in its object
    chunk_elems = (page_id_bytes // ESIZE) * per_chunk
    first = tensor_elem * per_chunk + i_j * n_elem  # element index of the page in its object
    row = i_c * (chunk_elems + chunk_elems // GROUP_C * 4)
    return base + block * page_stride, n_elem, row + first, row + chunk_elems + (first // GROUP_C) * 4


@triton.jit
def _pack_tile(p_x, p_c, p_s, mask, g_mask):
    """One tile: elements at ``p_x`` ([GROUPS, 128] pointers) -> codes at ``p_c``, each group's
    scale as 4 bytes from ``p_s`` ([GROUPS] pointers)."""
    x = tl.load(p_x, mask=mask, other=0.0).to(tl.float32)
    amax_b = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # integer max: NaN > inf > finite
    scale = tl.math.div_rn(amax_b.to(tl.float32, bitcast=True), 448.0)
    s_b = tl.where(amax_b > 0x7F800000, 0x7FC00000, scale.to(tl.int32, bitcast=True))  # one NaN
    ok = (s_b > 0) & (s_b < 0x7F800000)  # finite and non-zero: else the group's codes are 0
    safe = tl.where(ok, scale, 1.0)
    codes = tl.where(ok[:, None], _e4m3_codes(tl.math.div_rn(x, safe[:, None])), 0)
    tl.store(p_c, codes.to(tl.uint8), mask=mask)
    for k in tl.static_range(4):
        tl.store(p_s + k, ((s_b >> (8 * k)) & 0xFF).to(tl.uint8), mask=g_mask)


@triton.jit
def _unpack_tile(p_x, p_c, p_s, mask, g_mask, DTYPE: tl.constexpr):
    """One tile: codes at ``p_c`` and scales at ``p_s`` -> elements at ``p_x``, ``code * scale`` in
    float32 rounded to the cache dtype to nearest even (NaN as the dtype's positive quiet NaN)."""
    codes = tl.load(p_c, mask=mask, other=0).to(tl.int32)
    s_b = tl.load(p_s, mask=g_mask, other=0).to(tl.int32)
    for k in tl.static_range(1, 4):
        s_b = s_b | (tl.load(p_s + k, mask=g_mask, other=0).to(tl.int32) << (8 * k))
    y = _e4m3_values(codes) * s_b.to(tl.float32, bitcast=True)[:, None]
    nan = y != y
    if DTYPE == 0:
        yb = y.to(tl.int32, bitcast=True)
        hi = (yb + 0x7FFF + ((yb >> 16) & 1)) >> 16  # round to nearest even; the arithmetic shift
        hi = tl.where(nan, 0x7FC0, hi & 0xFFFF)  # of a negative value is undone by the mask
        out = hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == 1:
        hb = y.to(tl.float16).to(tl.int16, bitcast=True)
        out = tl.where(nan, 0x7E00, hb).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        out = tl.where(nan, 0x7FC00000, y.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    tl.store(p_x, out, mask=mask)


# Every int that varies per call is not specialized and the table and ids pointers not on alignment
# (scalar loads): one compile per (PACK, DTYPE, ESIZE, GROUPS, num_warps), warmed at start.
@triton.jit(do_not_specialize=["staging_addr", "per_chunk", "ids_per_chunk", "skip", "page_id_bytes", "tiles"],
            do_not_specialize_on_alignment=["p_table", "p_ids"])
def _fp8_pages_kernel(
    p_table,  # int64 [T, 4]: base address, page stride, page bytes, tensor offset (PageTable._addresses)
    p_ids,  # int64 [C * (P - skip)]
    staging_addr,  # int64: address of the FP8 staging's byte 0
    per_chunk,  # P: pages of one object
    ids_per_chunk,  # P - skip
    skip,  # leading slots of the object not unpacked (0 for a pack)
    page_id_bytes,  # bytes of one page id across the tensors (PageTable.bytes_per_page)
    tiles,
    PACK: tl.constexpr,
    DTYPE: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    ESIZE: tl.constexpr,
    GROUPS: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    n_s = tiles.to(tl.int64)
    page_addr, n_elem, code_off, scale_off = _page_and_object(
        p_table, p_ids, i_n, i_t, per_chunk, ids_per_chunk, skip, page_id_bytes, ESIZE)
    n_elem = tl.multiple_of(n_elem, 128)  # checked by the public ops: whole groups (masks stay per row)
    # Page and codes 16-byte aligned: hint it, so rows move in 16-byte words (checked in the PTX).
    aligned = ((page_addr | (staging_addr + code_off)) & 15) == 0
    if DTYPE == 0:
        p_page = page_addr.to(tl.pointer_type(tl.bfloat16))
    elif DTYPE == 1:
        p_page = page_addr.to(tl.pointer_type(tl.float16))
    else:
        p_page = page_addr.to(tl.pointer_type(tl.float32))
    p_codes = (staging_addr + code_off).to(tl.pointer_type(tl.uint8))
    p_scales = (staging_addr + scale_off).to(tl.pointer_type(tl.uint8))
    g = tl.arange(0, GROUPS)
    o2 = g[:, None] * GROUP_C + tl.arange(0, GROUP_C)[None, :]
    tile = GROUPS * GROUP_C
    for start in range(i_s * tile, n_elem, n_s * tile):
        o = start + o2
        g_mask = start + g * GROUP_C < n_elem
        # Whole groups (a page is a multiple of 128 elements): the mask is the rows', broadcast, so
        # the compiler sees it constant along a row and may move rows in vectors.
        mask = tl.broadcast_to(g_mask[:, None], (GROUPS, GROUP_C))
        p_s = p_scales + (start // GROUP_C + g) * 4
        if aligned:  # the hints are attributes of the ops that make the pointers: made in this branch only
            p_x = tl.max_contiguous(tl.multiple_of(p_page + o, [16, 16]), [1, GROUP_C])
            p_c = tl.max_contiguous(tl.multiple_of(p_codes + o, [16, 16]), [1, GROUP_C])
            if PACK:
                _pack_tile(p_x, p_c, p_s, mask, g_mask)
            else:
                _unpack_tile(p_x, p_c, p_s, mask, g_mask, DTYPE)
        else:
            if PACK:
                _pack_tile(p_page + o, p_codes + o, p_s, mask, g_mask)
            else:
                _unpack_tile(p_page + o, p_codes + o, p_s, mask, g_mask, DTYPE)


def launch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, per_chunk: int, pack: bool, *,
           skip: int = 0, groups: int | None = None, tiles: int | None = None,
           num_warps: int | None = None) -> Fp8LaunchConfig:
    """Pack (``pack=True``: pages -> FP8 objects) or unpack, one launch over every
    (page id, tensor, tile). ``per_chunk``: pages of one object; ``ids``: ``chunks * (per_chunk -
    skip)`` int64 ids on the table's device, the pages of slots ``skip`` onwards of each object.
    ``groups`` / ``tiles`` / ``num_warps`` override :func:`launch_config` (sweeps, tests). Trusts its
    input, as the public ops pass it (one bf16 / fp16 / fp32 dtype, pages of whole groups, staging
    checked). Never synchronizes. Returns the configuration launched."""
    cfg = _CONFIGS.get(table)
    if cfg is None:
        cfg = _CONFIGS[table] = launch_config(table)
    if groups is not None or tiles is not None or num_warps is not None:
        groups = cfg.groups if groups is None else groups
        check_power_of_two(groups, "groups")
        tiles = cfg.tiles if tiles is None else tiles
        check_in_range(tiles, "tiles", 1, MAX_GRID_YZ, " (CUDA grid axis 2)")
        num_warps = cfg.num_warps if num_warps is None else num_warps
        check_power_of_two(num_warps, "num_warps", most=32)
        cfg = Fp8LaunchConfig(groups=groups, tiles=tiles, num_warps=num_warps)
    if ids.numel() == 0:
        return cfg
    variants.launch(_fp8_pages_kernel, (ids.numel(), len(table), cfg.tiles),
                    _args(table, ids, staging.data_ptr(), per_chunk, skip, cfg), _consts(table, cfg, pack), cfg.num_warps)
    return cfg


def _args(table: PageTable, ids: torch.Tensor, staging_addr: int, per_chunk: int, skip: int,
          cfg: Fp8LaunchConfig) -> tuple:
    return (table._addresses(), ids, staging_addr, per_chunk, per_chunk - skip, skip, table.bytes_per_page, cfg.tiles)


def _consts(table: PageTable, cfg: Fp8LaunchConfig, pack: bool) -> dict:
    return dict(PACK=pack, DTYPE=_CODE_DTYPES[table.tensors[0].dtype], ESIZE=table.tensors[0].element_size(),
                GROUPS=cfg.groups)


def warm(table: PageTable, per_chunk: int, staging_addr: int) -> list[tuple]:
    """Compile (record, under the interpreter) the variants :func:`launch` uses for ``table``,
    packing and unpacking (the table must be one the FP8 ops take). Returns their keys."""
    cfg = _CONFIGS.get(table)
    if cfg is None:
        cfg = _CONFIGS[table] = launch_config(table)
    ids = torch.zeros(per_chunk, dtype=torch.int64, device=table.device)
    return [variants.warm(_fp8_pages_kernel, table.device, _args(table, ids, staging_addr, per_chunk, 0, cfg),
                          _consts(table, cfg, pack), cfg.num_warps) for pack in (True, False)]
