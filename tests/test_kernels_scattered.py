"""prepare_scattered / ScatteredCopy: pages to and from bytes at given offsets of one buffer. Both
backends against the naive reference on random tables and offsets, every refusal before a byte
moves, the memory it holds kept alive, and (with CUDA) a pinned CPU buffer read and written by the
GPU. Cases stay tiny: the interpreter costs about 1 ms a program."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import DEVICE, assert_round_trip, fresh_like, gdn_pages, random_bytes, vllm_layers
from saria.kernels import (PageTable, StaleTableError, check_block_ids, prepare_scattered, resolve_backend,
                           scattered_copy_naive)

TRITON = resolve_backend("auto", DEVICE)  # "triton": interpreted here, compiled on CUDA
BACKENDS = sorted({TRITON, "torch"})
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def examples(n: int) -> settings:
    """``n`` examples, or ``SARIA_LAYERWISE_EXAMPLES`` when that is set (a longer hunt)."""
    n = int(os.environ.get("SARIA_LAYERWISE_EXAMPLES", n))
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (padding between pages included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def _junk(n: int, seed: int) -> torch.Tensor:
    return random_bytes((n,), torch.uint8, seed)


@st.composite
def _case(draw, pack: bool):
    """(raws, views, ids, offsets, buffer size, max_programs): 1 to 3 paged tensors of random
    dtypes, page sizes, padding and start (often unaligned), 1 to 3 ids (repeats only when packing),
    and each (tensor, page) placed in the buffer in a random order with random gaps, 16-byte aligned
    or not; when unpacking, some pages may read the same bytes."""
    pages, tensors, seed = draw(st.integers(2, 6)), draw(st.integers(1, 3)), draw(st.integers(0, 2**16))
    raws, shapes = [], []
    for t in range(tensors):
        dtype = draw(st.sampled_from(DTYPES))
        elems, pad, start = draw(st.integers(1, 24)), draw(st.sampled_from([0, 0, 1, 3, 8])), draw(st.integers(0, 3))
        raws.append(random_bytes((start + pages * (elems + pad),), dtype, seed + t))
        shapes.append(((pages, elems), (elems + pad, 1), start))
    n = draw(st.integers(1, min(3, pages)))
    ids = draw(st.lists(st.integers(0, pages - 1), min_size=n, max_size=n, unique=not pack))
    sizes = [shape[0][1] * raw.element_size() for raw, shape in zip(raws, shapes)]
    aligned = draw(st.booleans())
    offsets, at = [[0] * n for _ in range(tensors)], draw(st.integers(0, 5))
    for k in draw(st.permutations(range(tensors * n))):
        t, i = divmod(k, n)
        at += draw(st.integers(0, 20))
        at = -(-at // 16) * 16 if aligned else at
        offsets[t][i] = at
        at += sizes[t]
    if not pack and n > 1 and draw(st.booleans()):
        t = draw(st.integers(0, tensors - 1))
        offsets[t][n - 1] = offsets[t][0]  # two pages read the same bytes: fine
    size = at + draw(st.integers(0, 8))
    return raws, shapes, ids, torch.tensor(offsets, dtype=torch.int64), size, draw(st.sampled_from([None, 1, 2, 5]))


def _views(raws, shapes):
    return [raw.as_strided(*shape) for raw, shape in zip(raws, shapes)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=_case(pack=True))
@examples(25)
def test_pack_matches_the_naive_reference(backend, case):
    raws, shapes, ids, offsets, size, max_programs = case
    caches = _views(raws, shapes)
    buffer, want = _junk(size, 1), _junk(size, 1)
    copy = prepare_scattered(buffer, offsets, caches, ids, pack=True, backend=backend, max_programs=max_programs)
    copy.launch()
    scattered_copy_naive(want, offsets, caches, ids, pack=True)
    assert torch.equal(buffer, want)  # every byte: the regions, and the gaps untouched
    assert copy.nbytes == len(ids) * sum(c[0].numel() * c.element_size() for c in caches)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=_case(pack=False))
@examples(25)
def test_unpack_matches_the_naive_reference(backend, case):
    raws, shapes, ids, offsets, size, max_programs = case
    buffer = _junk(size, 2)
    got_raws, want_raws = [r.clone() for r in raws], [r.clone() for r in raws]
    copy = prepare_scattered(buffer, offsets, _views(got_raws, shapes), ids, pack=False, backend=backend,
                             max_programs=max_programs)
    copy.launch()
    scattered_copy_naive(buffer, offsets, _views(want_raws, shapes), ids, pack=False)
    for got, want in zip(got_raws, want_raws):
        assert torch.equal(_bytes(got), _bytes(want))  # pages, padding and untouched pages
    assert torch.equal(buffer, _junk(size, 2))  # the source is only read


def _layer(pages=8, seed=0):
    """One vLLM layer: 256-byte pages (16-byte aligned: the vector path)."""
    return vllm_layers(pages, 4, 2, 8, torch.bfloat16, layers=1, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_programs", [None, 3])
def test_round_trip_through_a_pool_of_slots(backend, max_programs):
    """A hybrid table (FA pages, a padded GDN page) packed into slots of a pool at aligned and odd
    offsets, then unpacked into fresh caches: the same bytes, and nothing else written."""
    caches = _layer(6) + gdn_pages(6, 96, 40, seed=3)
    ids = [5, 1, 3]
    offsets = torch.tensor([[0, 1000, 2000], [300, 1301, 2417]], dtype=torch.int64)
    pool = torch.zeros(3000, dtype=torch.uint8, device=DEVICE)
    prepare_scattered(pool, offsets, caches, ids, pack=True, backend=backend, max_programs=max_programs).launch()
    fresh = fresh_like(caches)
    prepare_scattered(pool, offsets, fresh, ids, pack=False, backend=backend, max_programs=max_programs).launch()
    assert_round_trip(fresh, caches, torch.tensor(ids))  # untouched pages and GDN padding still zero


@pytest.mark.parametrize("backend", BACKENDS)
def test_objects_packed_by_pack_pages_unpack_from_their_slots(backend):
    """The reload's case (docs/kernels.md): objects laid out by pack_pages sit in slots of a pool;
    one layer's pages of all of them unpack in one launch with
    offsets[t, i] = slot + tensor_offsets[t] * pages_per_chunk + j * page_bytes(t)."""
    from saria.kernels import pack_pages

    caches = _layer(12) + gdn_pages(12, 96, 40, seed=9)
    table = PageTable(caches)
    chunks = [[3, 4], [10, 0], [7, 8]]  # two pages per object
    slot = table.staging_bytes(2) + 13  # odd slot size: some objects start unaligned
    pool = _junk(4 * slot, 10)
    places = [2, 0, 3]  # object k in slot places[k]
    for ids, s in zip(chunks, places):
        pool[s * slot:s * slot + table.staging_bytes(2)] = pack_pages(table, torch.tensor(ids))
    ids = [b for chunk in chunks for b in chunk]
    offsets = torch.tensor([[places[k] * slot + table.tensor_offsets[t] * 2 + j * seg.page_bytes
                             for k in range(3) for j in range(2)] for t, seg in enumerate(table.segments)])
    fresh = fresh_like(caches)
    prepare_scattered(pool, offsets, fresh, ids, pack=False, backend=backend, max_programs=4).launch()
    assert_round_trip(fresh, caches, torch.tensor(ids))


@pytest.mark.parametrize("indexed_max", [0, 4096])
def test_torch_path_slices_runs_and_indexed_copies_give_the_same_bytes(indexed_max, monkeypatch):
    """Every way the torch path copies: a run consecutive in the buffer and in the ids (one slice
    copy), a run consecutive in the buffer only (one indexed copy), pages alone in the buffer (one
    flat indexed copy per tensor, or a slice copy each when large), at aligned and odd offsets."""
    import saria.kernels.pages.scattered as scattered

    monkeypatch.setattr(scattered, "INDEXED_MAX_PAGE_BYTES", indexed_max)
    caches = vllm_layers(24, 4, 2, 8, torch.bfloat16, layers=2)  # 256-byte pages
    ids = [0, 1, 2, 3, 4, 9, 11, 10, 20, 7, 23, 5]
    # Tensor 0: pages 0-4 and 9, 11, 10 back to back, then 20, 7, 23, 5 each alone. Tensor 1, one
    # byte off (the word views narrow to bytes): back to back but for a gap after the third page.
    row0 = [k * 256 for k in range(8)] + [3000, 3600, 3300, 2500]
    row1 = [4000 + k * 256 + (8 if k >= 3 else 0) + 1 for k in range(12)]
    offsets = torch.tensor([row0, row1], dtype=torch.int64)
    buffer, want = _junk(8000, 4), _junk(8000, 4)
    prepare_scattered(buffer, offsets, caches, ids, pack=True, backend="torch").launch()
    scattered_copy_naive(want, offsets, caches, ids, pack=True)
    assert torch.equal(buffer, want)
    fresh, ref = [torch.zeros_like(c) for c in caches], [torch.zeros_like(c) for c in caches]
    prepare_scattered(buffer, offsets, fresh, ids, pack=False, backend="torch").launch()
    scattered_copy_naive(buffer, offsets, ref, ids, pack=False)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(fresh, ref))


def test_large_pages_out_of_order_and_empty_ids():
    caches = [random_bytes((4, 5000), torch.uint8, 5)]  # over INDEXED_MAX_PAGE_BYTES: slice copies
    offsets = torch.tensor([[10_003, 0, 5000]], dtype=torch.int64)
    for backend in BACKENDS:
        buffer, want = _junk(16_000, 6), _junk(16_000, 6)
        prepare_scattered(buffer, offsets, caches, [3, 0, 2], pack=True, backend=backend).launch()
        scattered_copy_naive(want, offsets, caches, [3, 0, 2], pack=True)
        assert torch.equal(buffer, want), backend
        empty = prepare_scattered(buffer, torch.zeros(1, 0, dtype=torch.int64), caches, [], pack=False,
                                  backend=backend)
        assert empty.nbytes == 0
        empty.launch()
        assert torch.equal(buffer, want)


def test_ids_as_tensor_list_or_checked_block_ids():
    caches = _layer()
    table = PageTable(caches)
    offsets = torch.tensor([[512, 0]], dtype=torch.int64)
    want = _junk(768, 0)
    scattered_copy_naive(want, offsets, caches, [6, 2], pack=True)
    for ids in ([6, 2], (6, 2), torch.tensor([6, 2], dtype=torch.int16), check_block_ids(table, torch.tensor([6, 2]))):
        buffer = _junk(768, 0)
        prepare_scattered(buffer, offsets, table, ids, pack=True).launch()
        assert torch.equal(buffer, want)


def test_launch_repeats_the_copy_with_the_live_bytes():
    """A prepared copy is launched again and again (once per step of a layer): each launch copies
    what the pages hold then."""
    caches = _layer()
    offsets = torch.tensor([[0, 256]], dtype=torch.int64)
    buffer = torch.zeros(512, dtype=torch.uint8, device=DEVICE)
    copy = prepare_scattered(buffer, offsets, caches, [1, 4], pack=True)
    copy.launch()
    caches[0][4].fill_(2.5)
    copy.launch()
    want = torch.zeros(512, dtype=torch.uint8, device=DEVICE)
    scattered_copy_naive(want, offsets, caches, [1, 4], pack=True)
    assert torch.equal(buffer, want)


def test_the_buffer_outlives_the_callers_reference():
    """The copy holds the buffer: dropped by the caller and its memory offered again to new
    tensors, it still reads the bytes it was prepared over."""
    caches = _layer()
    offsets = torch.tensor([[0, 256, 512]], dtype=torch.int64)
    source = _junk(768, 7)
    buffer = source.clone()
    copy = prepare_scattered(buffer, offsets, caches, [0, 3, 5], pack=False)
    del buffer
    gc.collect()
    decoys = [torch.full((768,), 0xAB, dtype=torch.uint8, device=DEVICE) for _ in range(8)]
    copy.launch()
    pages = PageTable(caches).byte_pages(0)
    assert torch.equal(pages[[0, 3, 5]].reshape(-1), source) and all(d.eq(0xAB).all() for d in decoys)


# --- refusals: a clear error, before a byte moves ---------------------------------------------------

def _setup(pages=4):
    caches = _layer(pages)
    before = [_bytes(c) for c in caches]
    return caches, before


def _unchanged(caches, before):
    return all(torch.equal(_bytes(c), b) for c, b in zip(caches, before))


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("args, error, match", [
    pytest.param(dict(ids=[0, 4]), IndexError, "block id 4 is out of range", id="id-too-large"),
    pytest.param(dict(ids=[-1, 0]), IndexError, "negative", id="negative-id"),
    pytest.param(dict(ids=[0.5, 1]), ValueError, "block_ids must hold integers, got float 0.5", id="float-ids"),
    pytest.param(dict(ids=torch.tensor([0.0, 1.0])), ValueError, "integer dtype", id="float-tensor-ids"),
    pytest.param(dict(ids=torch.tensor([[0, 1]])), ValueError, "1-D", id="2d-ids"),
    pytest.param(dict(ids="01"), ValueError, "block_ids must be", id="string-ids"),
    pytest.param(dict(offsets=torch.tensor([[-1, 256]])), IndexError, r"offsets\[0, 0\] = -1 is negative",
                 id="negative-offset"),
    pytest.param(dict(offsets=torch.tensor([[0, 1024 - 255]])), IndexError,
                 r"offsets\[0, 1\] = 769 \+ 256 bytes .* ends past the buffer's 1024 bytes", id="past-the-end"),
    pytest.param(dict(offsets=torch.tensor([[0, 2**63 - 1]])), IndexError, "ends past", id="huge-offset"),
    pytest.param(dict(offsets=torch.tensor([[0, 256]], dtype=torch.int32)), ValueError, "int64", id="int32-offsets"),
    pytest.param(dict(offsets=torch.tensor([0, 256])), ValueError, r"shape \(2,\).*\(1, 2\)", id="1d-offsets"),
    pytest.param(dict(offsets=torch.tensor([[0, 256, 512]])), ValueError, r"shape \(1, 3\).*need \(1, 2\)",
                 id="too-many-offsets"),
    pytest.param(dict(offsets=[[0, 256]]), ValueError, "offsets must be a torch.Tensor", id="list-offsets"),
    pytest.param(dict(offsets=torch.zeros(1, 2, dtype=torch.int64, device="meta")), ValueError, "on the CPU",
                 id="meta-offsets"),
    pytest.param(dict(buffer=torch.zeros(512, dtype=torch.int16)), ValueError,
                 "1-D contiguous uint8 tensor, got torch.int16", id="int16-buffer"),
    pytest.param(dict(buffer=torch.zeros(2, 512, dtype=torch.uint8)), ValueError,
                 r"uint8 tensor, got torch.uint8 of shape \(2, 512\)", id="2d-buffer"),
    pytest.param(dict(buffer=torch.zeros(2048, dtype=torch.uint8)[::2]), ValueError, "not contiguous",
                 id="strided-buffer"),
    pytest.param(dict(buffer=torch.zeros(1024, dtype=torch.uint8, device="meta")), ValueError, "meta",
                 id="meta-buffer"),
    pytest.param(dict(buffer=bytearray(1024)), ValueError, "torch.Tensor", id="bytearray-buffer"),
    pytest.param(dict(max_programs=0), ValueError, "max_programs", id="zero-programs"),
    pytest.param(dict(max_programs=2.0), ValueError, "max_programs must be an integer", id="float-programs"),
    pytest.param(dict(max_programs=True), ValueError, "max_programs must be an integer", id="bool-programs"),
    pytest.param(dict(backend="cuda"), ValueError, "backend must be one of", id="bad-backend"),
])
def test_bad_arguments_refused(pack, args, error, match):
    caches, before = _setup()
    buffer = args.get("buffer", torch.zeros(1024, dtype=torch.uint8, device=DEVICE))
    offsets = args.get("offsets", torch.tensor([[0, 256]], dtype=torch.int64))
    with pytest.raises(error, match=match):
        prepare_scattered(buffer, offsets, caches, args.get("ids", [0, 1]), pack=pack,
                          backend=args.get("backend", "auto"), max_programs=args.get("max_programs"))
    assert _unchanged(caches, before)
    if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
        assert not buffer.any()


def test_duplicate_ids_refused_when_unpacking_only():
    caches, before = _setup()
    offsets = torch.tensor([[0, 256]], dtype=torch.int64)
    buffer = torch.zeros(1024, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="block id 2 appears more than once"):
        prepare_scattered(buffer, offsets, caches, [2, 2], pack=False)
    prepare_scattered(buffer, offsets, caches, [2, 2], pack=True).launch()  # one page in two places
    assert torch.equal(buffer[:256], buffer[256:512]) and buffer[:256].any()
    assert _unchanged(caches, before)


def test_overlapping_regions_refused_when_packing_only():
    caches, before = _setup()
    buffer = torch.zeros(1024, dtype=torch.uint8, device=DEVICE)
    # Sorted by start, [0, 256) and [255, 511) overlap; [600, 856) and [500, 756) too, listed backwards.
    for row in ([0, 255], [600, 500], [7, 7]):
        with pytest.raises(ValueError, match="buffer regions overlap"):
            prepare_scattered(buffer, torch.tensor([row]), caches, [0, 1], pack=True)
    assert not buffer.any()
    prepare_scattered(buffer, torch.tensor([[0, 255]]), caches, [0, 1], pack=False).launch()  # reads overlap: fine
    two = vllm_layers(4, 4, 2, 8, torch.bfloat16, layers=2)
    with pytest.raises(ValueError, match=r"offsets\[0, 1\] = 256 .* offsets\[1, 0\] = 300"):
        prepare_scattered(buffer, torch.tensor([[0, 256], [300, 700]]), two, [0, 1], pack=True)


def test_buffer_sharing_memory_with_the_pages_refused():
    raw = torch.zeros(8 * 256 + 1024, dtype=torch.uint8, device=DEVICE)
    cache = raw[:8 * 256].view(8, 256)
    for pack in (True, False):
        with pytest.raises(ValueError, match=r"buffer shares memory with the pages of caches\[0\]"):
            prepare_scattered(raw, torch.tensor([[2048, 2304]]), [cache], [0, 1], pack=pack)
    prepare_scattered(raw[8 * 256:], torch.tensor([[0, 256]]), [cache], [0, 1], pack=True).launch()  # beside: fine


def test_tensors_sharing_pages_refused_when_unpacking():
    cache = random_bytes((4, 64), torch.uint8, 0)
    with pytest.raises(ValueError, match="share memory"):
        prepare_scattered(torch.zeros(256, dtype=torch.uint8, device=DEVICE), torch.tensor([[0], [64]]),
                          [cache, cache], [1], pack=False)


def test_stale_table_refused_at_prepare_and_at_launch():
    caches, _ = _setup()
    table = PageTable(caches)
    buffer = _junk(512, 8)
    copy = prepare_scattered(buffer, torch.tensor([[0, 256]]), table, [1, 2], pack=False)
    caches[0].set_(torch.zeros(2, 4, 2, 2, 8, dtype=torch.bfloat16, device=DEVICE))  # re-pointed, fewer pages
    with pytest.raises(StaleTableError, match="re-pointed"):
        copy.launch()
    with pytest.raises(StaleTableError):
        prepare_scattered(buffer, torch.tensor([[0, 256]]), table, [1, 2], pack=False)
    assert not caches[0].any()  # the new memory was not written


def test_resized_buffer_refused_at_launch():
    caches, before = _setup()
    buffer = torch.zeros(512, dtype=torch.uint8, device=DEVICE)
    copy = prepare_scattered(buffer, torch.tensor([[0, 256]]), caches, [1, 2], pack=True)
    buffer.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="re-pointed or resized since prepare_scattered"):
        copy.launch()
    assert _unchanged(caches, before)


def test_made_only_by_prepare():
    from saria.kernels import ScatteredCopy

    with pytest.raises(TypeError, match="prepare_scattered"):
        ScatteredCopy()


# --- CUDA: a pinned CPU buffer read and written by the GPU ------------------------------------------

@cuda_only
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("max_programs", [None, 4])
def test_pinned_host_buffer_to_cuda_pages_and_back(backend, max_programs):
    caches = vllm_layers(16, 16, 8, 128, torch.bfloat16, layers=2)  # 64 KiB pages on the GPU
    page = 16 * 2 * 8 * 128 * 2
    ids = [9, 3, 4, 5, 15]
    slot = page + 4096  # slots with a gap; tensor 1 one byte off (the byte path)
    offsets = torch.tensor([[k * slot for k in range(5)], [5 * slot + k * slot + 1 for k in range(5)]])
    pool = torch.zeros(10 * slot + 2, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copy = prepare_scattered(pool, offsets, caches, ids, pack=True, backend=backend, max_programs=max_programs)
        copy.launch()
    stream.synchronize()
    want = torch.zeros_like(pool)
    scattered_copy_naive(want, offsets, caches, ids, pack=True)
    assert torch.equal(pool, want)
    fresh = [torch.zeros_like(c) for c in caches]
    copy = prepare_scattered(pool, offsets, fresh, ids, pack=False, backend=backend, max_programs=max_programs)
    with torch.cuda.stream(stream):  # launched on another stream than prepare's
        copy.launch()
    stream.synchronize()
    for got, ref in zip(fresh, caches):
        assert torch.equal(got[ids].view(torch.int16), ref[ids].view(torch.int16))
        assert not got[[0, 1, 2]].any()


@cuda_only
def test_fast_launch_and_triton_dispatch_copy_the_same_bytes(monkeypatch):
    import saria.kernels.variants as variants

    caches = vllm_layers(8, 16, 8, 128, torch.bfloat16, layers=2)
    offsets = torch.tensor([[0, 70_000], [140_000, 210_003]])
    results = []
    for fast in (True, False):
        monkeypatch.setattr(variants, "FAST_LAUNCH", fast)
        pool = torch.zeros(300_000, dtype=torch.uint8, pin_memory=True)
        prepare_scattered(pool, offsets, caches, [6, 1], pack=True).launch()
        torch.cuda.synchronize()
        results.append(pool)
    assert torch.equal(results[0], results[1])
    want = torch.zeros(300_000, dtype=torch.uint8)
    scattered_copy_naive(want, offsets, caches, [6, 1], pack=True)
    assert torch.equal(results[0], want)


@cuda_only
def test_pageable_host_buffer_refused_for_cuda_pages():
    caches = vllm_layers(4, 4, 2, 8, torch.bfloat16, layers=1)
    with pytest.raises(ValueError, match="pinned memory"):
        prepare_scattered(torch.zeros(1024, dtype=torch.uint8), torch.tensor([[0, 256]]), caches, [0, 1], pack=False)


@pytest.mark.parametrize("pack", [True, False])
def test_prepared_under_inference_mode_launches_on_another_thread(pack):
    """vLLM prepares under torch.inference_mode and a save or load thread launches outside it: the
    copy's own buffers must not be inference tensors (writing one outside the mode is refused)."""
    import threading

    caches = [torch.arange(8 * 64, dtype=torch.uint8).view(8, 64).clone(), torch.zeros(8, 32, dtype=torch.uint8)]
    buffer = torch.arange(1024, dtype=torch.int64).to(torch.uint8) if not pack else torch.zeros(1024, dtype=torch.uint8)
    offsets = torch.tensor([[0, 64, 128], [512, 544, 576]], dtype=torch.int64)  # back to back, ids not consecutive
    with torch.inference_mode():
        copy = prepare_scattered(buffer, offsets, caches, [5, 1, 3], pack=pack, backend="torch")
    expected_buffer, expected_caches = buffer.clone(), [c.clone() for c in caches]
    scattered_copy_naive(expected_buffer, offsets, expected_caches, [5, 1, 3], pack=pack)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, copy.launch))
    thread.start()
    thread.join()
    assert not errors, errors
    assert torch.equal(buffer, expected_buffer)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches))


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
