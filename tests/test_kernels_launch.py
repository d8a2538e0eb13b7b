"""The launch rules of the page kernels and the checksum: grid limits, and every page byte copied
exactly once when pages split into several tiles (small tile overrides keep the grids small under
the interpreter)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from kernel_cases import DEVICE, assert_round_trip, fresh_like, gdn_pages, mla, random_bytes, vllm_layers
from saria.kernels import PageTable, Segment, check_block_ids, checksum_naive, pack_pages_naive, resolve_backend
from saria.kernels.pages import triton as pages_module
from saria.kernels.pages.triton import MAX_GRID_YZ, LaunchConfig, launch_config

checksum_module = importlib.import_module("saria.kernels.checksum.triton")

TRITON = resolve_backend("auto", DEVICE)
needs_triton = pytest.mark.skipif(TRITON != "triton",
                                  reason="no Triton kernel here: neither CUDA nor TRITON_INTERPRET=1")


def _table(*page_bytes: int, stride: int | None = None) -> SimpleNamespace:
    """What launch_config reads of a table: its segments (no memory needed)."""
    return SimpleNamespace(segments=[Segment(base=0, page_stride=stride or b, page_bytes=b, num_pages=1)
                                     for b in page_bytes])


# --- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pages, ids, want", [
    # Qwen3-8B: 36 tensors of 64 KiB pages, 32 ids a chunk: two 32 KiB tiles a page.
    pytest.param([65536] * 36, 32, LaunchConfig(8192, 2, 4, 2048), id="qwen3-8b"),
    # Qwen3-Next-like: 12 FA pages of 2,162,688 B and 36 GDN pages of 2,146,304 used bytes.
    pytest.param([2162688] * 12 + [2146304] * 36, 1, LaunchConfig(8192, 66, 4, 2048), id="hybrid"),
    pytest.param([256, 200, 176], 3, LaunchConfig(1024, 1, 4, 2048), id="small-pages"),
    pytest.param([20000], 1, LaunchConfig(8192, 1, 4, 2048), id="one-tile"),
    pytest.param([32769], 1, LaunchConfig(8192, 2, 4, 2048), id="one-byte-over-a-tile"),
    pytest.param([3], 1, LaunchConfig(1024, 1, 4, 2048), id="three-bytes"),
])
def test_gpu_rule(pages, ids, want):
    assert launch_config(_table(*pages), ids, interpreted=False) == want


@pytest.mark.parametrize("largest", [1, 15, 4096, 65536, 2162688, 1 << 31, 1 << 40])
def test_gpu_rule_within_grid_limits_and_covers_the_largest_page(largest):
    cfg = launch_config(_table(largest, 16), 7, interpreted=False)
    assert cfg.words >= 4 and cfg.words & (cfg.words - 1) == 0  # tiles start 16-byte aligned
    assert cfg.bytes >= 1 and cfg.bytes & (cfg.bytes - 1) == 0
    assert 1 <= cfg.tiles <= MAX_GRID_YZ
    # One tile per program up to the grid limit; past it, programs loop over every tiles-th tile.
    assert cfg.tiles == min(MAX_GRID_YZ, -(-largest // (4 * cfg.words)))


def test_interpreted_rule_does_not_split():
    for pages in ([65536] * 36, [2162688] * 2, [3], [256, 77]):
        cfg = launch_config(_table(*pages), 4, interpreted=True)
        assert cfg.tiles == 1 and cfg.bytes == 4 * cfg.words
        assert 16 <= cfg.words <= pages_module.INTERPRETED_MAX_WORDS


def test_padding_is_not_part_of_a_page():
    """A GDN page's padding (page stride > page bytes) decides nothing: only used bytes are copied."""
    padded = launch_config(_table(2146304, stride=2162688), 1, interpreted=False)
    assert padded == launch_config(_table(2146304), 1, interpreted=False)
    assert padded.tiles == 66  # ceil(2,146,304 / 32,768)


@pytest.mark.parametrize("override, match", [
    ({"words": 6}, "power of two"), ({"words": 2}, "power of two"), ({"tiles": 0}, "tiles"),
    ({"tiles": MAX_GRID_YZ + 1}, "tiles"), ({"num_warps": 3}, "num_warps"), ({"byte_step": 3}, "byte_step"),
    ({"order": "row"}, "order"),
])
def test_bad_overrides_refused(override, match):
    caches = mla(4, 2, 8, torch.float32)
    table = PageTable(caches)
    blocks = check_block_ids(table, torch.tensor([1, 2]))
    staging = torch.empty(table.staging_bytes(2), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        pages_module.launch(table, blocks.on(DEVICE), staging, blocks.per_chunk, True, **override)


# --- coverage with split pages -------------------------------------------------------------------

def _mixed_table():
    """Pages of different sizes in one table: 256 B (FA), padded GDN pages of 208 and 96 used bytes
    out of 256, a 48-byte MLA page, and a 30-byte page (unaligned: the byte path)."""
    return (vllm_layers(6, 4, 2, 8, torch.bfloat16, layers=1, seed=1)
            + gdn_pages(6, 256, 208, seed=2) + gdn_pages(6, 256, 96, seed=3)
            + mla(6, 2, 12, torch.float16, seed=4) + mla(6, 3, 5, torch.float16, seed=5))


def _round_trip_with(caches, block_ids, **override):
    table = PageTable(caches)
    blocks = check_block_ids(table, block_ids, unique=True)
    ids = blocks.on(DEVICE)
    staging = torch.full((table.staging_bytes(blocks.numel()),), 0xA5, dtype=torch.uint8, device=DEVICE)
    cfg = pages_module.launch(table, ids, staging, blocks.per_chunk, True, **override)
    assert torch.equal(staging, pack_pages_naive(caches, block_ids).reshape(-1)), cfg
    fresh = fresh_like(caches)
    pages_module.launch(PageTable(fresh), ids, staging, blocks.per_chunk, False, **override)
    assert_round_trip(fresh, caches, block_ids)
    return cfg


@needs_triton
@pytest.mark.parametrize("override", [
    pytest.param({"words": 16, "tiles": 4}, id="tiles-cover-the-largest-page"),  # 256 B = 4 tiles of 64 B
    pytest.param({"words": 16, "tiles": 2}, id="programs-loop-over-tiles"),  # each program 2 tiles
    pytest.param({"words": 8, "tiles": 3}, id="stride-not-dividing-the-tiles"),  # 8 tiles over 3 programs
    pytest.param({"words": 16, "tiles": 7}, id="programs-past-the-page-end"),
    pytest.param({"words": 4, "tiles": 1}, id="one-program-many-tiles"),
    pytest.param({"words": 8, "tiles": 3, "byte_step": 4}, id="byte-steps-inside-a-tile"),
    pytest.param({"words": 16, "tiles": 3, "order": "tile"}, id="tile-major-grid"),
    pytest.param({"words": 8, "tiles": 5, "byte_step": 8, "order": "tile"}, id="tile-major-grid-byte-steps"),
    pytest.param({"words": 16, "tiles": 1, "order": "tile"}, id="tile-major-no-split"),
])
def test_split_pages_round_trip_exactly(override):
    caches = _mixed_table()
    _round_trip_with(caches, torch.tensor([[5, 0], [3, 2]]), **override)  # 2-D ids: two chunks


@needs_triton
@pytest.mark.parametrize("page_bytes", [1, 3, 17, 63, 64, 65, 100])
def test_odd_page_sizes_split(page_bytes):
    caches = [random_bytes((5, page_bytes), torch.uint8, page_bytes), random_bytes((5, 64), torch.uint8, 7)]
    _round_trip_with(caches, torch.tensor([4, 0, 2]), words=4, tiles=3, byte_step=8)


@needs_triton
def test_unaligned_staging_and_pages_split():
    big = random_bytes((5 * 96 + 2,), torch.uint8, 3)
    cache = big[2:].view(5, 96)  # pages 2 bytes off 16: the byte path
    table = PageTable([cache])
    blocks = check_block_ids(table, torch.tensor([3, 1]), unique=True)
    buffer = torch.zeros(2 * 96 + 1, dtype=torch.uint8, device=DEVICE)
    out = buffer[1:]
    pages_module.launch(table, blocks.on(DEVICE), out, blocks.per_chunk, True, words=4, tiles=2, byte_step=4)
    assert torch.equal(out, pack_pages_naive([cache], torch.tensor([3, 1])))


# --- checksum ------------------------------------------------------------------------------------

def test_checksum_gpu_rule(monkeypatch):
    monkeypatch.setattr(checksum_module, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    rule = checksum_module.checksum_config
    words = (72 << 20) // 4
    cfg = rule(words, cuda, interpreted=False)
    assert cfg.block == checksum_module.BLOCK_WORDS and cfg.num_warps == checksum_module.NUM_WARPS
    assert cfg.programs == checksum_module.PROGRAMS_PER_SM * 132
    assert rule(10, cuda, interpreted=False).programs == 1  # never more programs than blocks
    assert rule(0, cuda, interpreted=False).programs == 1
    assert rule(words, cuda, interpreted=True).programs == checksum_module.PROGRAMS_INTERPRETED


@needs_triton
@pytest.mark.parametrize("block, programs", [(4, 1), (16, 3), (64, 2), (8, 7)])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 63, 64, 65, 67, 256, 257, 1021])
def test_checksum_multi_block_loop_equals_the_reference(block, programs, n):
    """Programs looping over several blocks, a partial last block, 1-3 tail bytes, more programs
    than blocks."""
    data = random_bytes((n + 3,), torch.uint8, n)
    for view in (data[:n], data[3:]):  # data[3:]: an unaligned view, of n bytes
        assert checksum_module.checksum_triton(view, block=block, programs=programs) == checksum_naive(view)


@needs_triton
def test_checksum_of_views_and_dtypes_through_the_kernel():
    base = random_bytes((4 * 300 + 6,), torch.uint8, 5)
    for view in (base, base[1:], base[2:-1], base[:3], base[:0], base.view(torch.int16)[1:]):
        assert checksum_module.checksum_triton(view.reshape(-1).view(torch.uint8), block=16,
                                               programs=3) == checksum_naive(view)
