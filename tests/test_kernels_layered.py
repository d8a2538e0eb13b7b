"""prepare_layered / LayeredCopy: a layer-wise step's copies of every layer, built in one pass and
launched layer by layer. Differential: both backends (the Triton kernel, interpreted here, and the
torch twin) against the naive reference, page by page, on random layers, tensors, buffers
(host segments), placements and skipped pages; every byte compared. Then the refusals, and
slot_layout (where a step's pages lie in the host slots) against a page-by-page walk of the pool.
Cases stay tiny: the interpreter costs about 1 ms a program."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis import given

from kernel_cases import DEVICE, random_bytes
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.transfer.layerwise import slot_layout
from saria.kernels import (COPY_MAX_PROGRAMS, PageTable, StaleTableError, default_max_programs, prepare_layered,
                           resolve_backend, scattered_copy_naive)
from test_kernels_scattered import DTYPES, _junk, examples

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})


@st.composite
def _case(draw, pack: bool):
    """(raws, shapes, layers, buffer sizes, ids, where, offsets, max_programs): 1 to 3 layers of 1
    or 2 paged tensors each (random dtypes, page sizes, padding, start), grouped in a random order;
    1 to 3 buffers; 1 to 4 ids (unique when unpacking; the pages a skip leaves out are simply not
    among them); each (tensor, page) placed in a random buffer at a random place, 16-byte aligned
    or not, regions disjoint when packing (some shared when unpacking)."""
    seed = draw(st.integers(0, 2**16))
    per_layer = draw(st.lists(st.integers(1, 2), min_size=1, max_size=3))
    tensors = sum(per_layer)
    pages = draw(st.integers(2, 6))
    raws, shapes, sizes = [], [], []
    for t in range(tensors):
        dtype = draw(st.sampled_from(DTYPES))
        elems, pad, start = draw(st.integers(1, 24)), draw(st.sampled_from([0, 0, 1, 3, 8])), draw(st.integers(0, 3))
        raws.append(random_bytes((start + pages * (elems + pad),), dtype, seed + t))
        shapes.append(((pages, elems), (elems + pad, 1), start))
        sizes.append(elems * raws[-1].element_size())
    order = draw(st.permutations(range(tensors)))
    layers, k = [], 0
    for count in per_layer:
        layers.append(list(order[k:k + count]))
        k += count
    n = draw(st.integers(1, min(4, pages)))
    ids = draw(st.lists(st.integers(0, pages - 1), min_size=n, max_size=n, unique=not pack))
    buffers = draw(st.integers(1, 3))
    aligned = draw(st.booleans())
    where = [[0] * n for _ in range(tensors)]
    offsets = [[0] * n for _ in range(tensors)]
    ends = [draw(st.integers(0, 5)) for _ in range(buffers)]
    for item in draw(st.permutations(range(tensors * n))):
        t, i = divmod(item, n)
        b = draw(st.integers(0, buffers - 1))
        at = ends[b] + draw(st.integers(0, 20))
        at = -(-at // 16) * 16 if aligned else at
        where[t][i], offsets[t][i] = b, at
        ends[b] = at + sizes[t]
    if not pack and n > 1 and draw(st.booleans()):
        t = draw(st.integers(0, tensors - 1))
        where[t][n - 1], offsets[t][n - 1] = where[t][0], offsets[t][0]  # two pages read the same bytes
    buffer_sizes = [end + draw(st.integers(0, 8)) for end in ends]
    return (raws, shapes, layers, buffer_sizes, ids, torch.tensor(where), torch.tensor(offsets),
            draw(st.sampled_from([None, 1, 2, 5])))


def _views(raws, shapes):
    return [raw.as_strided(*shape) for raw, shape in zip(raws, shapes)]


def _naive(buffers, where, offsets, caches, ids, layers, pack, upto=None):
    """The reference: each (tensor, page) of the layers (all, or those before ``upto``) one naive copy."""
    for group in layers[:upto]:
        for t in group:
            for i, block in enumerate(ids):
                scattered_copy_naive(buffers[int(where[t, i])], [[int(offsets[t, i])]], [caches[t]], [block], pack=pack)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=_case(pack=True))
@examples(25)
def test_pack_of_every_layer_matches_the_naive_reference(backend, case):
    raws, shapes, layers, sizes, ids, where, offsets, max_programs = case
    caches = _views(raws, shapes)
    got = [_junk(size, 1 + b) for b, size in enumerate(sizes)]
    want = [g.clone() for g in got]
    copy = prepare_layered(PageTable(caches), layers, got, ids, where, offsets, pack=True, backend=backend,
                           max_programs=max_programs)
    assert len(copy) == len(layers)
    for layer, group in enumerate(layers):
        copy.launch(layer)
        _naive(want, where, offsets, caches, ids, layers[layer:layer + 1], pack=True)
        for g, w in zip(got, want):  # layer by layer: the layers after it untouched so far
            assert torch.equal(g, w)
        assert copy.nbytes[layer] == len(ids) * sum(caches[t][0].numel() * caches[t].element_size() for t in group)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=_case(pack=False))
@examples(25)
def test_unpack_of_every_layer_matches_the_naive_reference(backend, case):
    raws, shapes, layers, sizes, ids, where, offsets, max_programs = case
    buffers = [_junk(size, 7 + b) for b, size in enumerate(sizes)]
    got_raws, want_raws = [r.clone() for r in raws], [r.clone() for r in raws]
    copy = prepare_layered(PageTable(_views(got_raws, shapes)), layers, buffers, ids, where, offsets, pack=False,
                           backend=backend, max_programs=max_programs)
    for layer in reversed(range(len(layers))):  # any order: each layer's launch is its own
        copy.launch(layer)
    _naive(buffers, where, offsets, _views(want_raws, shapes), ids, layers, pack=False)
    for got, want in zip(got_raws, want_raws):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # padding and other pages untouched


def _small(pages: int = 4, tensors: int = 2):
    caches = [random_bytes((pages, 16), torch.float16, t) for t in range(tensors)]
    return PageTable(caches), caches


def test_refusals_before_a_byte_moves():
    table, caches = _small()
    buffer = torch.zeros(256, dtype=torch.uint8)
    offs = torch.tensor([[0, 32], [64, 96]])
    with pytest.raises(ValueError, match="at most once"):
        prepare_layered(table, [[0], [0]], [buffer], [0, 1], None, offs, pack=True)
    with pytest.raises(IndexError, match="ends past"):
        prepare_layered(table, [[0], [1]], [buffer], [0, 1], None, torch.tensor([[0, 32], [64, 250]]), pack=True)
    with pytest.raises(ValueError, match="overlap"):
        prepare_layered(table, [[0], [1]], [buffer], [0, 1], None, torch.tensor([[0, 32], [64, 40]]), pack=True)
    other = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(IndexError, match="names no buffer"):
        prepare_layered(table, [[0], [1]], [buffer, other], [0, 1], torch.tensor([[0, 2], [1, 1]]), offs, pack=True)
    with pytest.raises(ValueError, match="overlap"):  # the same bytes through two buffers
        prepare_layered(table, [[0], [1]], [buffer, buffer[:128]], [0, 1], torch.tensor([[0, 0], [1, 1]]),
                        torch.tensor([[0, 32], [0, 96]]), pack=True)
    with pytest.raises(IndexError):
        prepare_layered(table, [[0], [1]], [buffer], [0, 9], None, offs, pack=True)
    with pytest.raises(ValueError, match="repeat|duplicate|twice|more than once"):
        prepare_layered(table, [[0], [1]], [buffer], [1, 1], None, offs, pack=False)
    assert not buffer.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_changed_table_or_buffer_is_refused_at_launch(backend):
    table, caches = _small()
    buffer = torch.zeros(256, dtype=torch.uint8)
    copy = prepare_layered(table, [[0], [1]], [buffer], [0, 1], None, torch.tensor([[0, 32], [64, 96]]),
                           pack=True, backend=backend)
    caches[1].set_(torch.zeros_like(caches[1]))
    copy.launch(0)  # layer 0 reads tensor 0 only: still fine
    with pytest.raises(StaleTableError):
        copy.launch(1)
    buffer.set_(torch.zeros(256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="re-pointed"):
        copy.launch(0)


def test_the_cta_cap_is_for_gpus_only():
    assert default_max_programs(torch.device("cpu")) is None
    assert 1 <= COPY_MAX_PROGRAMS <= 132


@given(data=st.data())
@examples(40)
def test_slot_layout_matches_a_walk_of_the_pool(data):
    """Where slot_layout puts each (tensor, kept page) is where a page-by-page walk of the pool puts
    it, for objects spread over several segments and leading pages skipped."""
    slot = 4096
    with HostPool(64 * slot, slot, segment_bytes=4 * slot) as pool:
        tensors, per_chunk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
        page_bytes = [data.draw(st.sampled_from([512, 1024, 1536, 4096])) for _ in range(tensors)]
        object_bytes = per_chunk * sum(page_bytes)
        starts = [0]
        for b in page_bytes[:-1]:
            starts.append(starts[-1] + b * per_chunk)
        page_offsets = [starts[t] + torch.arange(per_chunk, dtype=torch.int64) * page_bytes[t] for t in range(tensors)]
        if any(int(o % slot) + page_bytes[t] > slot for t, offs in enumerate(page_offsets) for o in offs):
            return  # a page would straddle two slots: such an engine is not layer-wise capable
        objects = data.draw(st.integers(1, 3))
        slots = [pool.allocate(pool.slots_for(object_bytes)) for _ in range(objects)]
        ids = torch.tensor(data.draw(st.lists(st.integers(0, 99), min_size=objects * per_chunk,
                                              max_size=objects * per_chunk, unique=True))).view(objects, per_chunk)
        skips = [data.draw(st.integers(0, per_chunk - 1)) for _ in range(objects)]
        keep = torch.ones_like(ids, dtype=torch.bool)
        for o, s in enumerate(skips):
            keep[o, :s] = False
        buffers, chosen, where, offsets = slot_layout(pool, page_offsets, slots, ids, keep if any(skips) else None)
        walk = []
        for t in range(tensors):
            for o in range(objects):
                for j in range(skips[o], per_chunk):
                    at = int(page_offsets[t][j])
                    segment, start = pool.locate(slots[o][at // slot])
                    walk.append((t, int(ids[o, j]), segment.data_ptr() + start + at % slot))
        got = [(t, int(chosen[i]), buffers[int(where[t, i])].data_ptr() + int(offsets[t, i]))
               for t in range(tensors) for i in range(chosen.numel())]
        assert got == walk


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda_only
def test_cuda_pinned_buffers_uploaded_on_one_stream_launched_on_another(monkeypatch):
    """On a GPU: two pinned host buffers (host pool segments), the work array uploaded on the
    stream prepare ran on and the layers launched on another (each first launch there waits for
    the upload), the default cap applied; every byte as the naive reference has it. The variants
    were warmed first: no late compile."""
    from saria.kernels import variants, warm_kernels
    monkeypatch.setattr(variants, "LATE", [])
    caches = [random_bytes((64, 2, 16, 8, 128), torch.bfloat16, t).cuda() for t in range(4)]
    table = PageTable(caches)
    layers, cap = [[0, 1], [2, 3]], default_max_programs(table.device)
    warm_kernels(table, 4, layers=layers, max_programs=cap)
    page = caches[0][0].numel() * 2
    ids = torch.tensor([5, 9, 2, 40])
    where = torch.tensor([[0, 1, 0, 1]] * 4)
    offsets = torch.tensor([[(2 * t + i // 2) * page for i in range(4)] for t in range(4)])
    buffers = [torch.zeros(8 * page, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        copy = prepare_layered(table, layers, buffers, ids, where, offsets, pack=True, max_programs=cap)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        for layer in range(2):
            copy.launch(layer)
    other.synchronize()
    want = [torch.zeros_like(b) for b in buffers]
    _naive(want, where, offsets, [c.cpu() for c in caches], ids.tolist(), layers, pack=True)
    assert all(torch.equal(g, w) for g, w in zip(buffers, want))
    assert all(p <= cap for p in copy.programs) and variants.LATE == []
    fresh = [torch.zeros_like(c) for c in caches]
    back = prepare_layered(PageTable(fresh), layers, buffers, ids, where, offsets, pack=False, max_programs=cap)
    for layer in range(2):
        back.launch(layer)
    torch.cuda.synchronize()
    for got, ref in zip(fresh, caches):
        assert torch.equal(got[ids.cuda()].view(torch.int16), ref[ids.cuda()].view(torch.int16))
    assert variants.LATE == []
