"""Adversarial misuse of the kernel API: every call either raises the documented error before
anything is copied (the process alive, every byte of the caches and of the memory around them
unchanged) or gives exactly what the naive reference gives. Real tensors throughout."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kernel_cases import DEVICE, gdn_pages, random_bytes, vllm_layers
from saria.kernels import (PageTable, StaleTableError, check_block_ids, checksum, drop_leading_pages, pack_pages,
                           pack_pages_naive, pack_state, resolve_backend, unpack_pages, unpack_state)
from saria.kernels.checks import MAX_TENSORS

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})
PAGE = 64  # bytes per page (int32 pages of 16 elements)
NB = 8


def _ids(*values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def _buffer(pages: int, seed: int) -> torch.Tensor:
    """Random bytes, one row per page: the memory a cache lives in, with guard pages around it."""
    return random_bytes((pages, PAGE), torch.uint8, seed)


def _on(buf: torch.Tensor, first: int, pages: int) -> torch.Tensor:
    """An int32 paged tensor over pages ``[first, first + pages)`` of ``buf`` (not a view: its own
    TensorImpl on buf's storage, as an engine's cache would be)."""
    return torch.empty(0, dtype=torch.int32, device=buf.device).set_(
        buf.untyped_storage(), first * PAGE // 4, (pages, PAGE // 4), (PAGE // 4, 1))


def _page_bytes(t: torch.Tensor) -> torch.Tensor:
    """Pure torch: ``t``'s pages as rows of bytes (a copy), for any paged tensor."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _nested(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(list(tensors), layout=torch.jagged)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (random float bits include NaNs, which torch.equal never calls equal)."""
    return torch.equal(_page_bytes(a), _page_bytes(b))


# --- 1. a table whose tensors were re-pointed is refused by every API, before any byte moves ---------

def _repoint_same_storage_smaller(cache, bufs):
    cache.set_(cache.untyped_storage(), cache.storage_offset(), (1, PAGE // 4), (PAGE // 4, 1))


def _repoint_other_buffer(cache, bufs):
    small = _buffer(3, 99)  # page 0 is the new cache, pages 1 and 2 guard it
    bufs.append(small)
    cache.set_(small.untyped_storage(), 0, (1, PAGE // 4), (PAGE // 4, 1))


def _resize_shrink(cache, bufs):
    cache.resize_(1, PAGE // 4)


def _data_swap(cache, bufs):
    small = _buffer(3, 98)
    bufs.append(small)
    cache.data = _on(small, 0, 1)


def _data_swap_dtype(cache, bufs):
    cache.data = cache.data.view(torch.int16)  # same memory, twice the elements per page


def _data_swap_dtype_same_size(cache, bufs):
    """Only the dtype changes: same storage, offset, shape, strides and address. Why verify() must
    compare dtypes (ssd_dtype=fp8 reads the values as the table's dtype)."""
    cache.data = cache.data.view(torch.float32)


def _storage_reallocated_same_size(cache, bufs):
    """Storage.resize_ always allocates anew, even to the same size: only the address moves (why the
    data pointer stands for the storage's address and size)."""
    storage = cache.untyped_storage()
    storage.resize_(storage.nbytes())


def _storage_grown(cache, bufs):
    storage = cache.untyped_storage()
    storage.resize_(storage.nbytes() + PAGE)


def _set_other_storage_same_address(cache, bufs):
    """Another storage object over the very same memory (from DLPack): address, size, offset, shape,
    strides and dtype all unchanged; only the storage differs (Tensor.is_set_to sees it)."""
    alias = torch.from_dlpack(bufs[0]).untyped_storage()
    assert alias is not cache.untyped_storage() and alias.data_ptr() == cache.untyped_storage().data_ptr()
    cache.set_(alias, cache.storage_offset(), cache.shape, cache.stride())


def _as_strided_in_place(cache, bufs):
    cache.as_strided_((NB, PAGE // 8), (PAGE // 4, 1))  # half pages


def _unsqueeze_in_place(cache, bufs):
    cache.unsqueeze_(1)


def _storage_freed(cache, bufs):
    bufs.clear()  # nothing left to compare: the memory is gone
    cache.untyped_storage().resize_(0)


REPOINTS = [
    pytest.param(_repoint_same_storage_smaller, "shape changed from", id="set_-smaller-same-storage"),
    pytest.param(_repoint_other_buffer, "re-pointed: data_ptr changed", id="set_-other-buffer"),
    pytest.param(_resize_shrink, r"shape changed from \(8, 16\) to \(1, 16\)", id="resize_-shrink"),
    pytest.param(_data_swap, "re-pointed: data_ptr changed", id="data-swap"),
    pytest.param(_data_swap_dtype, "dtype changed from torch.int32 to torch.int16", id="data-swap-dtype"),
    pytest.param(_data_swap_dtype_same_size, "dtype changed from torch.int32 to torch.float32",
                 id="data-swap-dtype-same-size"),
    pytest.param(_storage_reallocated_same_size, "re-pointed: data_ptr changed", id="storage-realloc-same-size"),
    pytest.param(_storage_grown, "re-pointed: data_ptr changed", id="storage-grown"),
    pytest.param(_set_other_storage_same_address, "re-pointed to another storage at the same address",
                 id="set_-alias-storage"),
    pytest.param(_as_strided_in_place, "shape changed", id="as_strided_"),
    pytest.param(_unsqueeze_in_place, "shape changed", id="unsqueeze_"),
    pytest.param(_storage_freed, "storage was freed", id="storage-freed"),
]


def _call(api: str, table: PageTable, backend: str):
    ids = _ids(5, 1)
    staging = torch.zeros(table.staging_bytes(2), dtype=torch.uint8, device=DEVICE)
    if api == "pack":
        return pack_pages(table, ids, backend=backend)
    if api == "pack-out":
        return pack_pages(table, ids, out=staging, backend=backend)
    if api == "unpack":
        return unpack_pages(staging, table, ids, backend=backend)
    if api == "drop_leading_pages":
        return drop_leading_pages(staging, table, 2, 1)
    if api == "PageTable.of":
        return PageTable.of(table)
    if api == "verify_tensors":
        return table.verify_tensors([1])
    return table.verify()


APIS = ["pack", "pack-out", "unpack", "drop_leading_pages", "PageTable.of", "verify", "verify_tensors"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("repoint, how", REPOINTS)
def test_stale_table_refused_and_memory_around_untouched(repoint, how, api, backend):
    buf = _buffer(NB + 2, 1)  # the cache is pages 1..8: page 0 and page 9 are guards
    cache = _on(buf, 1, NB)
    other = _on(_buffer(NB, 2), 0, NB)  # a second, untouched tensor of the table
    table = PageTable([other, cache])
    bufs = [buf]
    repoint(cache, bufs)
    before = [b.clone() for b in bufs] + [other.clone()]
    with pytest.raises(StaleTableError, match=how) as error:
        _call(api, table, backend)
    assert isinstance(error.value, ValueError)
    assert "caches[1] changed" in str(error.value) and "build a new PageTable" in str(error.value)
    for b, snapshot in zip(bufs + [other], before):
        assert _same(b, snapshot), "a refused call wrote memory"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("repoint, how", [p for p in REPOINTS if p.id != "storage-freed"])
def test_fresh_table_on_the_repointed_tensor_works(repoint, how, backend):
    buf = _buffer(NB + 2, 3)
    cache = _on(buf, 1, NB)
    stale = PageTable([cache])
    bufs = [buf]
    repoint(cache, bufs)
    with pytest.raises(StaleTableError):
        stale.verify()
    table = PageTable(stale.tensors)  # what the error suggests
    last = table.num_pages - 1
    assert torch.equal(pack_pages(table, _ids(last, 0), backend=backend), pack_pages_naive([cache], _ids(last, 0)))
    with pytest.raises(IndexError, match=f"block id {table.num_pages} is out of range"):
        pack_pages(table, _ids(table.num_pages), backend=backend)
    # Unpack writes exactly page 0 of the tensor as it is now, and nothing else anywhere.
    snapshot = [b.clone() for b in bufs]
    staging = random_bytes((table.bytes_per_page,), torch.uint8, 7)
    unpack_pages(staging, table, _ids(0), backend=backend)
    assert torch.equal(_page_bytes(cache)[0], staging)
    for b, s in zip(bufs, snapshot):  # outside page 0 of the tensor as it is now, no byte changed
        now, then = b.view(-1).clone(), s.view(-1).clone()
        lo = cache.data_ptr() - b.data_ptr()
        if 0 <= lo < now.numel():
            now[lo:lo + table.bytes_per_page] = then[lo:lo + table.bytes_per_page] = 0
        assert torch.equal(now, then)


def test_view_whose_base_was_repointed_is_refused():
    """A legacy [2, NB, ...] cache given as its K and V halves: re-pointing the base leaves the
    halves on the old memory, which the engine no longer uses (stale data, silently). Torch keeps
    only a view's root base, so this is caught when the re-pointed tensor is that root."""
    base = random_bytes((2, NB, PAGE), torch.uint8, 4).clone()  # a root tensor, not itself a view
    table = PageTable(list(base.unbind(0)))
    base.set_(random_bytes((2, NB, PAGE), torch.uint8, 5))
    with pytest.raises(StaleTableError, match="view whose base tensor was re-pointed") as error:
        pack_pages(table, _ids(0))
    assert "1 more tensor changed too" in str(error.value) and "take the views again" in str(error.value)
    fresh = PageTable(list(base.unbind(0)))
    assert torch.equal(pack_pages(fresh, _ids(3)), torch.cat([base[0, 3], base[1, 3]]))


@pytest.mark.parametrize("mutate", ["set_", "data", "storage-resize"])
def test_view_whose_base_moved_is_refused(mutate):
    """A view (vLLM's per-layer caches are views of raw buffers) is refused when its root base is
    re-pointed (set_, .data = ...) or the shared storage is reallocated."""
    raw = random_bytes((2 * NB, PAGE), torch.uint8, 11).clone()
    views = [raw[:NB], raw[NB:]]  # (view(dtype) records no base: slice the root itself)
    table = PageTable(views)
    if mutate == "set_":
        raw.set_(random_bytes((2 * NB, PAGE), torch.uint8, 12))
    elif mutate == "data":
        raw.data = random_bytes((2 * NB, PAGE), torch.uint8, 13)
    else:
        raw.untyped_storage().resize_(raw.untyped_storage().nbytes())
    assert views[0]._base is raw
    with pytest.raises(StaleTableError, match="caches.0. changed"):
        pack_pages(table, _ids(0))
    with pytest.raises(StaleTableError):
        table.verify_tensors([1])


def test_view_whose_base_was_repointed_before_the_table_is_refused_when_that_storage_moves():
    """A view whose base was already re-pointed when the table was built: the table records the
    base's storage as it was, and refuses once that storage is reallocated (as it did before)."""
    raw = random_bytes((NB, PAGE), torch.uint8, 14).clone()
    view = raw[:]
    raw.set_(random_bytes((NB, PAGE), torch.uint8, 15))
    table = PageTable([view])
    table.verify()
    raw.untyped_storage().resize_(raw.untyped_storage().nbytes())
    with pytest.raises(StaleTableError, match="base tensor was re-pointed"):
        table.verify()


def test_base_is_fixed_when_a_tensor_is_made():
    """verify() compares the root bases recorded when the table was built and checks no base for a
    tensor made without one: torch never changes a tensor's _base after it is made (re-pointing,
    resizing, re-striding or swapping .data of a view or of a plain tensor keeps it)."""
    for make_view in (False, True):
        raw = random_bytes((NB, PAGE), torch.uint8, 16).clone()
        t = raw[:] if make_view else raw.clone()
        base = t._base
        other = random_bytes((NB, PAGE), torch.uint8, 17)
        for mutate in (lambda: t.as_strided_((NB, PAGE // 2), (PAGE, 1)), lambda: t.unsqueeze_(0),
                       lambda: t.resize_(2, PAGE), lambda: t.set_(other.untyped_storage(), 0, (NB, PAGE), (PAGE, 1)),
                       lambda: setattr(t, "data", other[1:]), lambda: t.set_(raw[2:])):
            mutate()
            assert t._base is base
        assert (base is raw) == make_view


def test_storage_resized_in_place_is_refused():
    cache = random_bytes((NB, PAGE), torch.uint8, 6)
    table = PageTable([cache])
    cache.untyped_storage().resize_(NB * PAGE // 2)
    with pytest.raises(StaleTableError, match="storage"):
        pack_pages(table, _ids(7))


def test_table_keeps_the_original_memory_alive():
    """The table holds the storages it points into: re-pointing a tensor does not free the memory
    a stale table's addresses refer to (so even a table used past the check could not reach freed
    memory)."""
    cache = random_bytes((NB, PAGE), torch.uint8, 8)
    expected = cache.clone()
    table = PageTable([cache])
    cache.set_(torch.zeros(1, PAGE, dtype=torch.uint8, device=DEVICE))
    storage = table._storages[0]
    assert storage.nbytes() == NB * PAGE
    assert torch.equal(torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(storage).view(NB, PAGE), expected)


def test_unchanged_table_and_harmless_changes_pass():
    caches = vllm_layers(NB, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    caches[0].requires_grad_(False)  # no change to memory or geometry
    caches[1].set_(caches[1].untyped_storage(), caches[1].storage_offset(), caches[1].shape, caches[1].stride())
    table.verify()
    # A view's base re-strided on the same storage: the view still shows the base's memory.
    raw = random_bytes((2 * NB, PAGE), torch.uint8, 18).clone()
    views = [raw[:NB], raw[NB:]]
    view_table = PageTable(views)
    raw.as_strided_((PAGE, 2 * NB), (1, PAGE))
    view_table.verify()
    view_table.verify_tensors([0])
    assert torch.equal(pack_pages(table, _ids(3, 1)), pack_pages_naive(caches, _ids(3, 1)))


def test_table_is_immutable():
    caches = vllm_layers(NB, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    for name, value in [("num_pages", 10**6), ("tensors", ()), ("_fingerprints", [])]:
        with pytest.raises(AttributeError, match="immutable"):
            setattr(table, name, value)
    with pytest.raises(AttributeError, match="immutable"):
        del table.segments
    addresses = table.device_table()
    addresses[:, 0] = 0  # a copy: the kernels read their own
    assert torch.equal(pack_pages(table, _ids(2)), pack_pages_naive(caches, _ids(2)))


# --- 2. block ids: every dtype and shape either works or names the value given --------------------

ID_VALUE_ERRORS = [
    pytest.param(lambda: _ids(2**64 - 1, dtype=torch.uint64), IndexError,
                 r"block id 18446744073709551615 \(torch.uint64\) is out of range: caches\[0\] has 8 pages",
                 id="uint64-max"),
    pytest.param(lambda: _ids(1, 2**63, dtype=torch.uint64), IndexError,
                 r"block id 9223372036854775808 \(torch.uint64\) is out of range", id="uint64-2**63"),
    pytest.param(lambda: _ids(8, dtype=torch.uint64), IndexError, r"block id 8 \(torch.uint64\) is out of range",
                 id="uint64-just-past"),
    pytest.param(lambda: _ids(2**32 - 1, dtype=torch.uint32), IndexError,
                 r"block id 4294967295 \(torch.uint32\) is out of range", id="uint32-max"),
    pytest.param(lambda: _ids(1, -3, dtype=torch.int8), IndexError, r"block id -3 \(torch.int8\) is negative",
                 id="int8-negative"),
    pytest.param(lambda: _ids(-2**63), IndexError, "block id -9223372036854775808 is negative", id="int64-min"),
    pytest.param(lambda: _ids(2**63 - 1), IndexError, "block id 9223372036854775807 is out of range",
                 id="int64-max"),
    pytest.param(lambda: _ids(0, 8), IndexError, r"block id 8 is out of range: caches\[0\] has 8 pages \(ids 0 to 7\)",
                 id="just-past-the-end"),
    pytest.param(lambda: torch.tensor([True]), ValueError, "integer dtype, got torch.bool", id="bool"),
    pytest.param(lambda: torch.tensor([1.0]), ValueError, "integer dtype, got torch.float32", id="float"),
    pytest.param(lambda: torch.tensor([1 + 0j]), ValueError, "integer dtype, got torch.complex64", id="complex"),
    pytest.param(lambda: [1, 2**64], ValueError, "got list", id="list-with-huge-int"),
    pytest.param(lambda: [], ValueError, "got list", id="empty-list"),
    pytest.param(lambda: np.array([1, 2]), ValueError, "got ndarray", id="numpy"),
    pytest.param(lambda: 3, ValueError, "got int", id="python-int"),
    pytest.param(lambda: torch.tensor(1), ValueError, r"got shape \(\)", id="0-d"),
    pytest.param(lambda: torch.zeros(1, 1, 1, dtype=torch.int64), ValueError, r"got shape \(1, 1, 1\)", id="3-d"),
    pytest.param(lambda: _ids(1, 2).to_sparse(), ValueError, "dense tensor, got layout torch.sparse_coo", id="sparse"),
    pytest.param(lambda: _nested(_ids(1), _ids(2, 3)), ValueError, "layout nested", id="nested"),
    pytest.param(lambda: _ids(1, 2).to("meta"), ValueError, "block_ids are on meta", id="meta"),
]


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("make, error, match", ID_VALUE_ERRORS)
def test_bad_block_ids_name_the_value(make, error, match, op):
    cache = random_bytes((NB, PAGE), torch.uint8, 10)
    before = cache.clone()
    staging = torch.zeros(2 * PAGE, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(error, match=match):
        if op == "pack":
            pack_pages([cache], make())
        else:
            unpack_pages(staging, [cache], make())
    assert torch.equal(cache, before)


def _quantized_ids():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 1.0, 0, torch.qint8)


def test_quantized_ids_refused():
    with pytest.raises(ValueError, match="integer dtype, got torch.qint8"):
        pack_pages([random_bytes((NB, PAGE), torch.uint8, 0)], _quantized_ids())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [
    pytest.param(lambda: _ids(5, 2**40, 1, -7, 3)[::2], id="strided-1-d"),  # the skipped values are poison
    pytest.param(lambda: _ids(6).expand(3), id="expanded-stride-0"),
    pytest.param(lambda: _ids(1, 4, 6, 2, 0, 7).view(2, 3).t(), id="transposed-2-d"),
    pytest.param(lambda: _ids(2, 1, 7)[1:], id="storage-offset"),
] + [pytest.param(lambda dt=dt: _ids(7, 0, 3, dtype=dt), id=str(dt).removeprefix("torch."))
     for dt in (torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32, torch.uint64)])
def test_odd_but_valid_block_ids_match_the_reference(make, backend):
    """Non-contiguous ids used to reach the kernel as their raw storage (the kernel read the skipped
    values: a crash); every integer dtype is accepted."""
    caches = [random_bytes((NB, PAGE), torch.uint8, 11), random_bytes((NB, 24), torch.float16, 12)]
    ids = make()
    staging = pack_pages(caches, ids, backend=backend)
    assert torch.equal(staging, pack_pages_naive(caches, ids))
    fresh = [torch.zeros_like(c) for c in caches]
    if torch.unique(ids).numel() == ids.numel():
        unpack_pages(staging, fresh, ids, backend=backend)
        touched = ids.reshape(-1).long()
        for f, c in zip(fresh, caches):
            assert torch.equal(_page_bytes(f)[touched], _page_bytes(c)[touched])
            assert int(_page_bytes(f).ne(0).sum()) == int(_page_bytes(f)[touched].ne(0).sum())
    else:
        with pytest.raises(ValueError, match="block id 6 appears more than once"):
            unpack_pages(staging, fresh, ids, backend=backend)


def test_checked_ids_are_a_private_copy():
    """The kernels see the values that were checked, whatever happens to the caller's tensor later."""
    table = PageTable([random_bytes((NB, PAGE), torch.uint8, 13)])
    ids = _ids(1, 2, 3)
    checked = check_block_ids(table, ids, unique=True)
    ids[0] = 10**9
    on = checked.on(DEVICE)
    assert checked.tolist() == [1, 2, 3] and on.tolist() == [1, 2, 3]
    assert on.is_contiguous() and on.dtype == torch.int64
    assert (checked.chunks, checked.per_chunk, checked.end, checked.unique) == (1, 3, 4, True)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_empty_ids_move_nothing(shape):
    cache = random_bytes((NB, PAGE), torch.uint8, 14)
    before = cache.clone()
    ids = torch.zeros(shape, dtype=torch.int64)
    staging = pack_pages([cache], ids)
    assert staging.numel() == 0
    unpack_pages(staging, [cache], ids)
    assert torch.equal(cache, before)


# --- 3. staging: aliasing, shape, dead memory -----------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["inside-destination-page", "inside-other-tensor", "straddling-the-end"])
def test_staging_sharing_memory_with_a_cache_refused(where, backend):
    """Unpacking from a staging buffer that overlaps a destination page reads bytes the copy has
    already overwritten; packing into one overwrites the cache."""
    buf = _buffer(2 * NB + 4, 15)
    a, b = _on(buf, 0, NB), _on(buf, NB, NB)  # two tensors back to back in one buffer
    table = PageTable([a, b])
    n = table.staging_bytes(2)
    start = {"inside-destination-page": 5 * PAGE, "inside-other-tensor": (NB + 1) * PAGE,
             "straddling-the-end": (2 * NB) * PAGE - n // 2}[where]
    staging = buf.view(-1)[start:start + n]
    before = buf.clone()
    with pytest.raises(ValueError, match="staging shares memory with the pages of caches"):
        unpack_pages(staging, table, _ids(5, 6), backend=backend)
    with pytest.raises(ValueError, match="out shares memory with the pages of caches"):
        pack_pages(table, _ids(5, 6), out=staging, backend=backend)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_next_to_the_caches_or_in_page_padding_is_fine(backend):
    """Only page bytes count: a buffer right after a cache, or in the padding of padded (GDN)
    pages, shares no page and the copy is exact."""
    buf = _buffer(NB + 4, 16)
    cache = _on(buf, 0, NB)
    ids = _ids(3, 0)
    after = buf.view(-1)[NB * PAGE:NB * PAGE + 2 * PAGE]
    pack_pages([cache], ids, out=after, backend=backend)
    assert torch.equal(after, pack_pages_naive([cache], ids))
    padded = gdn_pages(NB, 96, 40, seed=3)[0]  # pages of 40 bytes, 96 apart
    raw = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(padded.untyped_storage())
    gap = raw[2 * 96 + 40:2 * 96 + 80]  # 40 bytes of page 2's padding
    out = pack_pages([padded], _ids(5), out=gap, backend=backend)
    assert torch.equal(out, pack_pages_naive([padded], _ids(5)))


def test_two_d_staging_must_match_the_ids():
    caches = vllm_layers(NB, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    one_chunk = pack_pages(table, _ids(1, 2, 3, 4))  # 1-D ids: one chunk of 4 pages
    with pytest.raises(ValueError, match=r"staging has shape \(2, 256\): pass it 1-D, or \(1, 512\)"):
        unpack_pages(one_chunk.view(2, -1), table, _ids(1, 2, 3, 4))  # would mix the layouts up
    two_chunks = pack_pages(table, torch.tensor([[1, 2], [3, 4]]))
    assert two_chunks.shape == (2, 256)
    unpack_pages(two_chunks.view(-1), table, torch.tensor([[1, 2], [3, 4]]))  # 1-D is always fine
    with pytest.raises(ValueError, match="staging has shape"):
        unpack_pages(two_chunks.view(4, -1), table, torch.tensor([[1, 2], [3, 4]]))


def _freed(n: int) -> torch.Tensor:
    t = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
    t.untyped_storage().resize_(0)
    return t


def _shrunk(n: int) -> torch.Tensor:
    t = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
    t.untyped_storage().resize_(n // 2)
    return t


def _fake(*shape: int) -> torch.Tensor:
    """A fake tensor (torch.compile's tracing tensors): shape and device, but no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.zeros(shape, dtype=torch.uint8, device=DEVICE)


@pytest.mark.parametrize("make, match", [
    pytest.param(_freed, "has no memory", id="storage-freed"),
    pytest.param(_shrunk, "reaches 512 bytes into a storage of 256 bytes", id="storage-shrunk"),
    pytest.param(_fake, "FakeTensor, a tensor subclass", id="fake-tensor"),
    pytest.param(lambda n: torch.zeros(n, dtype=torch.uint8).to_sparse(), "dense tensor", id="sparse"),
])
def test_staging_without_live_memory_refused(make, match):
    """A staging tensor whose storage was freed still has its shape: the kernel would write through
    a dangling pointer (torch itself segfaults reading such a tensor)."""
    cache = random_bytes((NB, PAGE), torch.uint8, 17)
    before = cache.clone()
    n = 8 * PAGE
    with pytest.raises(ValueError, match=match):
        pack_pages([cache], _ids(*range(8)), out=make(n))
    with pytest.raises(ValueError, match=match):
        unpack_pages(make(n), [cache], _ids(*range(8)))
    assert torch.equal(cache, before)


# --- 4. caches that are not plain memory ------------------------------------------------------------

def _quantized_cache():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.randn(NB, 16), 0.1, 0, torch.qint8)


def _freed_cache():
    t = torch.zeros(NB, 16)
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize("make, match", [
    pytest.param(_quantized_cache, "quantized", id="quantized"),  # torch segfaults viewing it as bytes
    pytest.param(lambda: torch.randn(NB, 4, dtype=torch.complex64).conj(), "lazily conjugated", id="conj-view"),
    pytest.param(lambda: torch._neg_view(torch.randn(NB, 4, dtype=torch.complex64)), "lazily negated", id="neg-view"),
    pytest.param(lambda: _fake(NB, PAGE), "FakeTensor, a tensor subclass", id="fake-tensor"),
    pytest.param(_freed_cache, "has no memory", id="storage-freed"),
    pytest.param(lambda: _nested(torch.zeros(2, 4), torch.zeros(3, 4)), "nested", id="nested"),
    pytest.param(lambda: torch.zeros(NB, 4).to_sparse(), "sparse", id="sparse"),
    pytest.param(lambda: torch.zeros(NB, 4, device="meta"), "meta", id="meta"),
    pytest.param(lambda: torch.zeros(NB, 0), "empty pages", id="zero-size-pages"),
    pytest.param(lambda: torch.zeros(4).expand(NB, 4), "pages overlap", id="expanded-stride-0"),
])
def test_caches_without_addressable_pages_refused(make, match):
    with pytest.raises(ValueError, match=match):
        PageTable([make()])


@pytest.mark.parametrize("caches, match", [
    pytest.param(None, "got NoneType", id="None"),
    pytest.param(7, "got int", id="int"),
    pytest.param([torch.zeros(2, 4)] * (MAX_TENSORS + 1), "at most 65535", id="too-many-tensors"),
])
def test_bad_table_arguments(caches, match):
    with pytest.raises(ValueError, match=match):
        PageTable(caches)


def test_table_of_a_table():
    table = PageTable([torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="already a PageTable"):
        PageTable(table)
    assert PageTable.of(table) is table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(NB, 2, 3, dtype=torch.complex64), id="complex64"),
    pytest.param(lambda: torch.randn(NB, 5, dtype=torch.float64).requires_grad_(), id="requires-grad"),
    pytest.param(lambda: torch.nn.Parameter(torch.randn(NB, 6)), id="parameter"),
    pytest.param(lambda: torch.randint(0, 2, (NB, 7)).bool(), id="bool"),
    pytest.param(lambda: random_bytes((NB, 5), torch.float8_e5m2, 3), id="fp8-odd-page"),
])
def test_unusual_but_plain_caches_round_trip(make, backend):
    source = make().to(DEVICE)
    ids = _ids(6, 1)
    staging = pack_pages([source], ids, backend=backend)
    assert torch.equal(staging, pack_pages_naive([source.detach()], ids))
    fresh = torch.zeros_like(source.detach()).requires_grad_(source.requires_grad)
    unpack_pages(staging, [fresh], ids, backend=backend)
    assert torch.equal(_page_bytes(fresh.detach())[ids], _page_bytes(source.detach())[ids])


def test_inference_mode_caches_round_trip():
    with torch.inference_mode():
        source = random_bytes((NB, PAGE), torch.uint8, 21).clone()
        fresh = torch.zeros_like(source)
    for backend in BACKENDS:
        unpack_pages(pack_pages([source], _ids(2), backend=backend), [fresh], _ids(2), backend=backend)
    assert torch.equal(fresh[2], source[2])


# --- 5. drop_leading_pages, state, checksum -----------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    pytest.param(lambda s: ([1, 2], 2, 1), "staging must be a torch.Tensor, got list", id="list-staging"),
    pytest.param(lambda s: (s, 2.0, 1), "pages_per_chunk must be an integer, got float 2.0", id="float-count"),
    pytest.param(lambda s: (s, 2, True), "skip must be an integer, got True", id="bool-skip"),
    pytest.param(lambda s: (s, "2", 1), "pages_per_chunk must be an integer", id="str-count"),
    pytest.param(lambda s: (s, 0, 0), r"skip must be in \[0, pages_per_chunk\) = \[0, 0\)", id="zero-pages"),
    pytest.param(lambda s: (s, 2, -1), r"skip must be in \[0, pages_per_chunk\) = \[0, 2\)", id="negative-skip"),
    pytest.param(lambda s: (s.view(2, -1), 2, 1), "one chunk's staging", id="two-rows"),
    pytest.param(lambda s: (s[:-1], 2, 1), "need", id="short"),
])
def test_drop_leading_pages_misuse(args, match):
    caches = vllm_layers(NB, 2, 1, 8, torch.bfloat16)
    staging = pack_pages(caches, _ids(4, 5))
    given, pages_per_chunk, skip = args(staging)
    with pytest.raises(ValueError, match=match):
        drop_leading_pages(given, caches, pages_per_chunk, skip)


def test_drop_leading_pages_accepts_integer_scalars():
    caches = vllm_layers(NB, 2, 1, 8, torch.bfloat16)
    staging = pack_pages(caches, _ids(4, 5, 6))
    rest = drop_leading_pages(staging, caches, np.int64(3), torch.tensor(1))
    assert torch.equal(rest, pack_pages(caches, _ids(5, 6)))


def _states(seed=0):
    temporal = [random_bytes((4, 2, 4, 4), torch.float32, seed + l) for l in range(2)]
    conv = [random_bytes((4, 3, 8), torch.bfloat16, seed + 10 + l) for l in range(2)]
    return temporal, conv


def test_state_tensors_repointed_between_calls_use_their_new_memory():
    """pack_state/unpack_state build their table per call, so a re-pointed tensor is simply read
    where it lives now."""
    temporal, conv = _states()
    pack_state(temporal, conv, _ids(1))
    replacement = random_bytes((4, 2, 4, 4), torch.float32, 50)
    temporal[1].set_(replacement)
    expected = pack_pages_naive([conv[0], temporal[0], conv[1], temporal[1]], _ids(3))
    assert torch.equal(pack_state(temporal, conv, _ids(3)), expected)


def test_state_errors_name_the_state_tensor():
    temporal, conv = _states()
    with pytest.raises(IndexError, match=r"out of range: conv\[0\] has 4 pages"):
        pack_state(temporal, conv, _ids(4))
    one_slot = PageTable([conv[0], temporal[0], conv[1], temporal[1]]).bytes_per_page
    inside_temporal_1 = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(temporal[1].untyped_storage())
    with pytest.raises(ValueError, match=r"staging shares memory with the pages of temporal\[1\]"):
        unpack_state(inside_temporal_1[:one_slot], temporal, conv, _ids(0))
    with pytest.raises(ValueError, match="temporal must be a tensor or a sequence"):
        pack_state(None, conv, _ids(0))


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: _quantized_cache(), "quantized", id="quantized"),  # torch segfaulted here
    pytest.param(lambda: torch.randn(8, dtype=torch.complex64).conj(), "lazily conjugated", id="conj-view"),
    pytest.param(lambda: _fake(64), "FakeTensor, a tensor subclass", id="fake-tensor"),
    pytest.param(lambda: _freed(64), "has no memory", id="storage-freed"),  # was an internal setStorage error
    pytest.param(lambda: _shrunk(64), "reaches 64 bytes into a storage of 32", id="storage-shrunk"),
    pytest.param(lambda: _nested(torch.zeros(2), torch.zeros(3)), "contiguous", id="nested"),
    pytest.param(lambda: torch.zeros(4, 4).t(), "contiguous", id="non-contiguous"),
    pytest.param(lambda: b"bytes", "torch.Tensor", id="bytes"),
])
def test_checksum_misuse(make, match):
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=match):
            checksum(make(), backend=backend)


def test_checksum_of_plain_unusual_tensors_is_of_their_bytes():
    for t in (torch.randn(5, 3, dtype=torch.complex64, device=DEVICE),
              torch.randn(7, dtype=torch.float64, device=DEVICE).requires_grad_(),
              torch.zeros(0, device=DEVICE), torch.ones(3, dtype=torch.bool, device=DEVICE)):
        want = checksum(t.detach().contiguous().view(-1).view(torch.uint8).clone(), backend="torch")
        for backend in BACKENDS:
            assert checksum(t, backend=backend) == want


# --- 6. random misuse: every call raises a documented error or matches the reference ---------------

OPS = ["none", "set_-smaller", "set_-same", "set_-elsewhere", "resize_-shrink", "resize_-grow", "data-swap",
       "as_strided_", "free-storage"]


def _mutate(op: str, cache: torch.Tensor, seed: int) -> None:
    n = PAGE // 4
    if op == "set_-smaller":
        cache.set_(cache.untyped_storage(), cache.storage_offset(), (2, n), (n, 1))
    elif op == "set_-same":  # re-pointed at exactly the same memory and geometry: nothing changed
        cache.set_(cache.untyped_storage(), cache.storage_offset(), cache.shape, cache.stride())
    elif op == "set_-elsewhere":  # same geometry, other memory
        cache.set_(_on(_buffer(NB, seed), 0, NB).untyped_storage(), 0, (NB, n), (n, 1))
    elif op == "resize_-shrink":
        cache.resize_(3, n)
    elif op == "resize_-grow":
        cache.resize_(3 * NB, n)
    elif op == "data-swap":
        cache.data = _on(_buffer(NB + 1, seed), 1, NB)
    elif op == "as_strided_":
        cache.as_strided_((NB // 2, n), (2 * n, 1))
    elif op == "free-storage":
        cache.untyped_storage().resize_(0)


def _geometry(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.untyped_storage().nbytes(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


ID_DTYPE_CHOICES = [torch.int64, torch.int32, torch.int8, torch.uint8, torch.uint64]


def _unsigned(ids: torch.Tensor) -> list[int]:
    """The values of ``ids`` as Python ints (uint64 read as unsigned)."""
    if ids.dtype == torch.uint64:
        return [v % 2**64 for v in ids.view(torch.int64).tolist()]
    return ids.tolist()


@st.composite
def _block_ids(draw):
    """1-D ids of a random integer dtype: mostly small (valid, negative, just past the end), some
    extreme; sometimes every other element of a tensor whose skipped elements are out of range."""
    dtype = draw(st.sampled_from(ID_DTYPE_CHOICES))
    info = torch.iinfo(dtype)
    small = st.integers(max(-2, info.min), NB + 1)
    extreme = st.sampled_from([info.min, info.max, min(2**32, info.max), NB * 4])
    values = draw(st.lists(st.one_of(small, small, small, extreme), min_size=0, max_size=4))
    signed = [v - 2**64 if v >= 2**63 else v for v in values]  # uint64 bit patterns as int64
    ids = torch.tensor(signed, dtype=torch.int64)
    ids = ids.view(torch.uint64) if dtype == torch.uint64 else ids.to(dtype)
    if draw(st.booleans()) and ids.numel():
        poisoned = torch.full((2 * ids.numel(),), 100, dtype=dtype)
        poisoned[::2] = ids
        ids = poisoned[::2]
    return ids


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(op=st.sampled_from(OPS), api=st.sampled_from(["pack", "unpack", "drop"]),
       backend=st.sampled_from(BACKENDS), ids=_block_ids(), seed=st.integers(0, 2**16))
def test_random_misuse_raises_documented_errors_or_matches_reference(op, api, backend, ids, seed):
    buf = _buffer(NB + 2, seed)  # the cache is pages 1..8; pages 0 and 9 guard it
    cache = _on(buf, 1, NB)
    other = random_bytes((NB, 24), torch.float16, seed + 1)
    table = PageTable([cache, other])
    built = _geometry(cache)
    _mutate(op, cache, seed + 2)
    stale = _geometry(cache) != built
    watched = [buf, other] if op != "free-storage" else [other]  # a freed buffer cannot be read
    before = [w.clone() for w in watched]
    values = _unsigned(ids)
    event(f"{op}, {'stale' if stale else 'fresh'} table")
    pages = max(len(values), 1) if api == "drop" else len(values)  # drop_leading_pages: one chunk of >= 1 page
    staging = random_bytes((table.staging_bytes(pages),), torch.uint8, seed + 3)
    try:
        if api == "pack":
            result = pack_pages(table, ids, backend=backend)
        elif api == "unpack":
            unpack_pages(staging, table, ids, backend=backend)
        else:
            result = drop_leading_pages(staging, table, pages, 0)
    except (IndexError, ValueError) as error:
        for w, b in zip(watched, before):
            assert _same(w, b), "a refused call wrote memory"
        if stale:
            assert isinstance(error, StaleTableError), f"a stale table was not refused first: {error}"
        elif any(v < 0 for v in values):
            assert isinstance(error, IndexError) and f"block id {min(values)} " in str(error)
        elif any(v >= NB for v in values):
            assert isinstance(error, IndexError) and f"block id {max(values)} " in str(error)
        else:
            assert api == "unpack" and "appears more than once" in str(error)
        return
    assert not stale, "a stale table was used"
    assert all(0 <= v < NB for v in values) or api == "drop"
    if api == "pack":
        assert torch.equal(result, pack_pages_naive([cache, other], ids))
    elif api == "unpack" and values:
        assert len(set(values)) == len(values)
        rows = torch.tensor(values, dtype=torch.int64)
        offset = 0
        for t, snapshot in ((cache, _on(before[0], 1, NB)), (other, before[1])):
            expected = _page_bytes(snapshot)
            part = staging[offset:offset + expected.shape[1] * len(values)].view(len(values), -1)
            expected[rows] = part
            offset += part.numel()
            assert torch.equal(_page_bytes(t), expected)
        assert torch.equal(buf[0], before[0][0]) and torch.equal(buf[NB + 1], before[0][NB + 1])
    elif api == "unpack":
        assert all(_same(w, b) for w, b in zip(watched, before))
    else:
        assert torch.equal(result, staging)


@st.composite
def _aliasing_layout(draw):
    """Two uint8 paged views and a staging range placed at random in one 512-byte buffer (or the
    staging in a buffer of its own), with distinct ids valid for both views."""
    size = 512
    views = []
    for _ in range(2):
        page = draw(st.integers(1, 40))
        stride = draw(st.integers(page, page + 40))
        pages = draw(st.integers(1, 4))
        offset = draw(st.integers(0, size - (pages - 1) * stride - page))
        views.append((offset, stride, page, pages))
    count = draw(st.integers(1, min(v[3] for v in views)))
    ids = draw(st.permutations(range(min(v[3] for v in views))))[:count]
    length = count * sum(v[2] for v in views)
    staging_at = draw(st.one_of(st.none(), st.integers(0, size - length)))
    return size, views, ids, staging_at


def _bytes_of(view) -> set[int]:
    offset, stride, page, pages = view
    return {offset + k * stride + j for k in range(pages) for j in range(page)}


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(layout=_aliasing_layout(), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16))
def test_random_aliasing_is_refused_and_the_rest_is_exact(layout, backend, seed):
    """Caches sharing bytes with each other (unpack), or staging sharing bytes with any page (pack
    and unpack): refused before anything moves. Every accepted call matches a byte-level model."""
    size, views, ids, staging_at = layout
    buf = random_bytes((size,), torch.uint8, seed)
    caches = [buf.as_strided((n, page), (stride, 1), offset) for offset, stride, page, n in views]
    length = len(ids) * sum(v[2] for v in views)
    staging = buf[staging_at:staging_at + length] if staging_at is not None else random_bytes(
        (length,), torch.uint8, seed + 1)
    pages = [_bytes_of(v) for v in views]
    staged = set(range(staging_at, staging_at + length)) if staging_at is not None else set()
    caches_alias = bool(pages[0] & pages[1])
    staging_aliases = bool(staged & (pages[0] | pages[1]))
    event(f"caches alias: {caches_alias}, staging aliases: {staging_aliases}")
    id_tensor = torch.tensor(ids, dtype=torch.int64)
    before, source = buf.clone(), staging.clone()

    # pack: only the staging matters (reading a page twice is fine), and the check is exact
    try:
        out = pack_pages(caches, id_tensor, out=staging, backend=backend)
    except ValueError as error:
        assert staging_aliases and "out shares memory" in str(error), str(error)
        assert torch.equal(buf, before)
    else:
        assert not staging_aliases
        model = [before[o + i * s:o + i * s + p] for o, s, p, n in views for i in ids]
        assert torch.equal(out, torch.cat(model))
        outside = torch.ones(size, dtype=torch.bool, device=DEVICE)
        if staging_at is not None:
            outside[staging_at:staging_at + length] = False
        assert torch.equal(buf[outside], before[outside])
    buf.copy_(before)
    staging.copy_(source)

    # unpack: cache aliasing (conservative: may refuse more) then staging aliasing (exact)
    try:
        unpack_pages(staging, caches, id_tensor, backend=backend)
    except ValueError as error:
        if "staging shares memory" in str(error):
            assert staging_aliases
        else:
            assert "share memory: unpacking" in str(error), str(error)
        assert torch.equal(buf, before)
    else:
        assert not caches_alias and not staging_aliases
        model = before.clone()
        at = 0
        for offset, stride, page, n in views:
            for i in ids:
                model[offset + i * stride:offset + i * stride + page] = source[at:at + page]
                at += page
        assert torch.equal(buf, model)
