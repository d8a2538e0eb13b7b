"""pack_pages / unpack_pages: bit-exact round trips on every layout, both backends, bad input."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (DEVICE, DTYPES, assert_round_trip, flashinfer, fresh_like, gdn_pages, legacy_halves, mla,
                          random_bytes, vllm_layers)
from saria.kernels import (BlockIds, PageTable, check_block_ids, pack_pages, pack_pages_naive, resolve_backend,
                           unpack_pages)
from saria.kernels.pages.triton import BYTES_PER_ITER, TILE_WORDS

TRITON = resolve_backend("auto", DEVICE)  # "triton" under the interpreter or on CUDA
BACKENDS = sorted({TRITON, "torch"})

LAYOUTS = [
    # (id, builder): page sizes in bytes noted; 16-byte multiples take the vector path
    pytest.param(lambda dt: vllm_layers(7, 4, 2, 8, dt), id="vllm-per-layer"),
    pytest.param(lambda dt: legacy_halves(9, 4, 2, 8, dt), id="legacy-2xNB-halves"),
    pytest.param(lambda dt: flashinfer(5, 2, 3, 8, dt), id="flashinfer-NB2"),
    pytest.param(lambda dt: mla(6, 3, 12, dt), id="mla"),
    pytest.param(lambda dt: vllm_layers(5, 1, 1, 3, dt), id="odd-page-bytes"),
    pytest.param(lambda dt: mla(5, 1, 5, dt), id="tiny-odd-page"),
]


def _ids(*values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("build", LAYOUTS)
def test_round_trip_every_layout_and_dtype(build, dtype, backend):
    caches = build(DTYPES[dtype])
    ids = _ids(4, 0, 2)  # odd count, out of order, page 0 included
    staging = pack_pages(caches, ids, backend=backend)
    assert staging.dtype == torch.uint8 and staging.is_contiguous()
    fresh = fresh_like(caches)
    unpack_pages(staging, fresh, ids, backend=backend)
    assert_round_trip(fresh, caches, ids)


@pytest.mark.parametrize("build", LAYOUTS)
def test_backends_produce_the_naive_reference_staging(build):
    caches = build(torch.bfloat16)
    ids = _ids(3, 1, 4, 0, 2)
    want = pack_pages_naive(caches, ids)
    for backend in BACKENDS:
        assert torch.equal(pack_pages(caches, ids, backend=backend), want), backend


def test_staging_layout_is_tensor_then_page_in_id_order():
    caches = vllm_layers(6, 2, 1, 4, torch.float16, layers=3)
    ids = _ids(5, 2)
    staging = pack_pages(caches, ids)
    expected = torch.cat([c[i].reshape(-1).view(torch.uint8) for c in caches for i in ids.tolist()])
    assert torch.equal(staging, expected)


def test_batch_of_chunks_each_row_one_chunk():
    caches = vllm_layers(8, 2, 1, 8, torch.bfloat16, layers=2)
    ids = torch.tensor([[7, 1, 3], [0, 6, 2]])
    staging = pack_pages(caches, ids)
    assert staging.shape == (2, PageTable(caches).staging_bytes(3))
    for c in range(2):
        assert torch.equal(staging[c], pack_pages(caches, ids[c]))
    fresh = fresh_like(caches)
    unpack_pages(staging, fresh, ids)
    assert_round_trip(fresh, caches, ids)


def test_hybrid_table_fa_and_padded_gdn_pages_in_one_call():
    fa = vllm_layers(6, 4, 2, 8, torch.bfloat16, layers=2)  # 256-byte pages
    page_stride = 256
    gdn = gdn_pages(6, page_stride, 200, seed=5) + gdn_pages(6, page_stride, 176, seed=6)
    caches = fa + gdn
    ids = _ids(1, 5, 3)
    for backend in BACKENDS:
        staging = pack_pages(caches, ids, backend=backend)
        assert staging.numel() == 3 * (256 + 256 + 200 + 176)
        fresh = fresh_like(caches)
        unpack_pages(staging, fresh, ids, backend=backend)
        assert_round_trip(fresh, caches, ids)  # padding bytes of GDN pages stay zero


def test_interleaved_views_of_one_buffer():
    """Conv and temporal state as two views into one padded page buffer (vLLM's GDN page)."""
    raw = random_bytes((5, 96), torch.int8, 3)
    conv = raw.as_strided((5, 24), (96, 1))
    temporal = raw.as_strided((5, 64), (96, 1), storage_offset=32)
    ids = _ids(4, 1)
    staging = pack_pages([conv, temporal], ids)
    fresh_raw = torch.zeros_like(raw)
    fresh = [fresh_raw.as_strided((5, 24), (96, 1)), fresh_raw.as_strided((5, 64), (96, 1), storage_offset=32)]
    unpack_pages(staging, fresh, ids)
    assert torch.equal(fresh[0][ids], conv[ids]) and torch.equal(fresh[1][ids], temporal[ids])
    untouched = torch.tensor([0, 2, 3])
    assert not fresh_raw[untouched].any() and not fresh_raw[:, 24:32].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unaligned_addresses_take_the_narrow_path_correctly(backend):
    # A cache starting 2 bytes into its buffer, and staging starting 1 byte into its buffer.
    big = random_bytes((7 * 64 + 1,), torch.float16, 9)
    cache = big[1:].view(7, 64)
    ids = _ids(6, 0, 3)
    buffer = torch.zeros(3 * 128 + 1, dtype=torch.uint8, device=DEVICE)
    out = buffer[1:]
    pack_pages([cache], ids, out=out, backend=backend)
    assert torch.equal(out, pack_pages_naive([cache], ids))
    fresh_big = torch.zeros_like(big)
    unpack_pages(out, [fresh_big[1:].view(7, 64)], ids, backend=backend)
    assert torch.equal(fresh_big[1:].view(7, 64)[ids].view(torch.uint8), cache[ids].view(torch.uint8))


@pytest.mark.parametrize("page_bytes", [pytest.param(4 * (2 * TILE_WORDS + 4), id="aligned-3-tiles"),
                                        pytest.param(2 * BYTES_PER_ITER + 3, id="unaligned-3-byte-steps")])
def test_pages_larger_than_one_loop_iteration(page_bytes):
    caches = [random_bytes((4, page_bytes), torch.uint8, 11), random_bytes((4, page_bytes), torch.uint8, 12)]
    ids = _ids(3, 0)
    staging = pack_pages(caches, ids, backend=TRITON)
    assert torch.equal(staging, pack_pages_naive(caches, ids))
    fresh = fresh_like(caches)
    unpack_pages(staging, fresh, ids, backend=TRITON)
    assert_round_trip(fresh, caches, ids)


def test_out_is_filled_and_returned():
    caches = mla(4, 2, 8, torch.float32)
    ids = _ids(2, 3)
    out = torch.empty(2 * 64, dtype=torch.uint8, device=DEVICE)
    assert pack_pages(caches, ids, out=out) is out
    assert torch.equal(out, pack_pages_naive(caches, ids))


def test_empty_ids_move_nothing():
    caches = mla(4, 2, 8, torch.float32)
    staging = pack_pages(caches, torch.empty(0, dtype=torch.int64))
    assert staging.numel() == 0
    fresh = fresh_like(caches)
    unpack_pages(staging, fresh, torch.empty(0, dtype=torch.int64))
    assert not fresh[0].any()


def test_integer_id_dtypes_accepted():
    caches = mla(6, 1, 4, torch.float32)
    expected = pack_pages(caches, _ids(5, 1))
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(pack_pages(caches, torch.tensor([5, 1], dtype=dtype)), expected)


def test_prebuilt_table_reused():
    caches = vllm_layers(5, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    ids = _ids(0, 4)
    first = pack_pages(table, ids)
    caches[0][0].fill_(1.5)
    second = pack_pages(table, ids)  # the table refers to the live tensors, not a copy
    assert not torch.equal(first, second)
    assert torch.equal(second, pack_pages_naive(caches, ids))


# --- bad input: a clear error before any kernel runs, and the process alive ---------------------

def _caches():
    return vllm_layers(4, 2, 1, 8, torch.bfloat16)


@pytest.mark.parametrize("ids, error, match", [
    pytest.param(_ids(0, 4), IndexError, "out of range", id="id-too-large"),
    pytest.param(_ids(1, -1), IndexError, "negative", id="negative-id"),
    pytest.param(torch.tensor([0.0, 1.0]), ValueError, "integer dtype", id="float-ids"),
    pytest.param(torch.tensor([True, False]), ValueError, "integer dtype", id="bool-ids"),
    pytest.param([0, 1], ValueError, "torch.Tensor", id="list-ids"),
    pytest.param(torch.tensor(1), ValueError, "1-D", id="scalar-ids"),
    pytest.param(torch.zeros(1, 1, 1, dtype=torch.int64), ValueError, "1-D", id="3d-ids"),
], )
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_bad_ids(op, ids, error, match):
    caches = _caches()
    before = [c.clone() for c in caches]
    staging = torch.zeros(PageTable(caches).staging_bytes(2), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(error, match=match):
        if op == "pack":
            pack_pages(caches, ids)
        else:
            unpack_pages(staging, caches, ids)
    assert all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, caches))
    assert pack_pages(caches, _ids(3)).numel() == PageTable(caches).bytes_per_page  # still alive


def test_duplicate_ids_refused_by_unpack_only():
    caches = _caches()
    staging = pack_pages(caches, _ids(1, 1))  # packing a page twice is fine
    with pytest.raises(ValueError, match="more than once"):
        unpack_pages(staging, caches, _ids(1, 1))


def test_non_contiguous_page_refused():
    legacy = random_bytes((2, 4, 2, 1, 8), torch.bfloat16, 0)
    with pytest.raises(ValueError, match="not contiguous"):
        pack_pages([legacy.transpose(0, 1)], _ids(0))  # [NB, 2, ...] view of a [2, NB, ...] cache


def test_overlapping_pages_refused():
    raw = random_bytes((64,), torch.uint8, 0)
    with pytest.raises(ValueError, match="overlap"):
        PageTable([raw.as_strided((4, 16), (8, 1))])


def test_tensors_sharing_memory_refused_by_unpack():
    cache = random_bytes((4, 16), torch.uint8, 0)
    staging = pack_pages([cache, cache], _ids(0))
    with pytest.raises(ValueError, match="share memory"):
        unpack_pages(staging, [cache, cache], _ids(0))


def test_empty_table_and_single_tensor_refused():
    with pytest.raises(ValueError, match="empty"):
        pack_pages([], _ids(0))
    with pytest.raises(ValueError, match="sequence"):
        pack_pages(random_bytes((4, 8), torch.uint8, 0), _ids(0))


def test_degenerate_tensors_refused():
    with pytest.raises(ValueError, match="no pages"):
        PageTable([torch.zeros(0, 8, device=DEVICE)])
    with pytest.raises(ValueError, match="scalar"):
        PageTable([torch.tensor(1.0, device=DEVICE)])
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        PageTable([[1, 2]])


def test_mixed_devices_refused():
    cpu = torch.zeros(4, 8)
    meta = torch.zeros(4, 8, device="meta")
    with pytest.raises(ValueError, match="meta"):
        PageTable([cpu, meta])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="several devices"):
            PageTable([cpu, cpu.cuda()])


@pytest.mark.parametrize("staging, match", [
    pytest.param(lambda n: torch.zeros(n + 1, dtype=torch.uint8, device=DEVICE), "need", id="too-big"),
    pytest.param(lambda n: torch.zeros(n - 1, dtype=torch.uint8, device=DEVICE), "need", id="too-small"),
    pytest.param(lambda n: torch.zeros(n // 2, dtype=torch.int16, device=DEVICE), "uint8", id="wrong-dtype"),
    pytest.param(lambda n: torch.zeros(2, n, dtype=torch.uint8, device=DEVICE)[:, ::2], "contiguous",
                 id="non-contiguous"),
    pytest.param(lambda n: torch.zeros(n, dtype=torch.uint8, device="meta"), "meta", id="wrong-device"),
    pytest.param(lambda n: bytearray(n), "torch.Tensor", id="not-a-tensor"),
])
def test_bad_staging(staging, match):
    caches = _caches()
    n = PageTable(caches).staging_bytes(2)
    with pytest.raises(ValueError, match=match):
        unpack_pages(staging(n), caches, _ids(0, 1))
    with pytest.raises(ValueError, match=match):
        pack_pages(caches, _ids(0, 1), out=staging(n))


def test_ids_on_another_device_refused():
    with pytest.raises(ValueError, match="block_ids are on"):
        pack_pages(_caches(), torch.zeros(1, dtype=torch.int64, device="meta"))


def test_backend_choice():
    for bad in ("cuda", ["torch"], None):  # the op caches what it resolved: still refused, every time
        for _ in range(2):
            with pytest.raises(ValueError, match="backend must be one of"):
                pack_pages(_caches(), _ids(0), backend=bad)
    assert resolve_backend("torch", DEVICE) == "torch"
    if DEVICE.type == "cpu":  # the suite runs the kernels under the interpreter here
        with pytest.raises(ValueError, match="interpreter"):
            resolve_backend("triton", torch.device("cuda"))


def test_concurrent_calls_from_threads():
    """Many threads packing and checksumming at once (the interpreter is serialized internally)."""
    from concurrent.futures import ThreadPoolExecutor

    from saria.kernels import checksum

    caches = vllm_layers(8, 2, 1, 8, torch.bfloat16, layers=2)
    expected = {i: pack_pages(caches, _ids(i, 7 - i), backend="torch") for i in range(8)}

    def job(i):
        staging = pack_pages(caches, _ids(i, 7 - i))
        return torch.equal(staging, expected[i]) and checksum(staging) == checksum(expected[i], backend="torch")

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(job, list(range(8)) * 3))


def test_drop_leading_pages_unpacks_only_the_rest():
    from saria.kernels import drop_leading_pages

    caches = vllm_layers(9, 2, 1, 8, torch.bfloat16, layers=2) + gdn_pages(9, 96, 40, seed=2)
    ids = _ids(6, 2, 8, 4)
    staging = pack_pages(caches, ids)
    rest = drop_leading_pages(staging, caches, 4, 1)
    assert torch.equal(rest, pack_pages(caches, ids[1:]))
    fresh = fresh_like(caches)
    unpack_pages(rest, fresh, ids[1:])
    assert_round_trip(fresh, caches, ids[1:])
    with pytest.raises(ValueError, match="skip"):
        drop_leading_pages(staging, caches, 4, 4)


@pytest.mark.parametrize("build", LAYOUTS)
def test_cpu_path_split_over_threads_is_the_same_bytes(build, monkeypatch):
    """A large CPU pack/unpack shares its tensors among threads: the same staging and pages as one
    thread, for a batch of chunks (2-D ids, each tensor's region strided) and for one chunk."""
    import saria.kernels.pages.cpu as cpu_path

    if DEVICE.type != "cpu":
        pytest.skip("the thread split is the CPU path's")
    caches = build(torch.bfloat16)
    for ids in (_ids(4, 0, 2), torch.tensor([[4, 0], [2, 1]])):
        serial = pack_pages(caches, ids, backend="torch")
        monkeypatch.setattr(cpu_path, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
        staged = pack_pages(caches, ids, backend="torch")
        assert torch.equal(staged, serial)
        fresh = fresh_like(caches)
        unpack_pages(staged, fresh, ids, backend="torch")
        for got, want in zip(fresh, caches):
            assert torch.equal(got[ids.reshape(-1)].view(torch.int16), want[ids.reshape(-1)].view(torch.int16))
        monkeypatch.undo()


def test_runs_of_consecutive_ids_take_slice_copies_with_the_same_bytes():
    """CPU path: ids in runs of consecutive pages are copied slice by slice; the bytes are
    those of the indexed copies, for runs that break inside a chunk and across chunks."""
    import saria.kernels.pages.cpu as cpu_path

    if DEVICE.type != "cpu":
        pytest.skip("the run path is the CPU path's")
    caches = vllm_layers(24, 4, 2, 8, torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [9, 10, 11, 12, 20, 21, 22, 23], [16, 17, 18, 19, 8, 13, 14, 15]])
    assert cpu_path._runs(ids.reshape(-1), 3, 8) is not None
    assert cpu_path._runs(torch.tensor([5, 3, 1, 7]), 1, 4) is None  # short runs: indexed copies
    staged = pack_pages(caches, ids, backend="torch")
    want = torch.cat([c[ids[k]].reshape(-1).view(torch.uint8) for k in range(3) for c in caches])
    assert torch.equal(staged.reshape(-1), want)
    fresh = fresh_like(caches)
    unpack_pages(staged, fresh, ids, backend="torch")
    for got, ref in zip(fresh, caches):
        assert torch.equal(got[ids.reshape(-1)].view(torch.int16), ref[ids.reshape(-1)].view(torch.int16))


# --- block ids checked once: BlockIds ----------------------------------------------------------

def test_checked_block_ids_give_the_same_bytes_as_a_tensor():
    caches = vllm_layers(9, 2, 1, 8, torch.bfloat16, layers=2)
    table = PageTable(caches)
    a, b = check_block_ids(table, _ids(6, 2, 8)), check_block_ids(table, _ids(1, 0, 5))
    for backend in BACKENDS:
        assert torch.equal(pack_pages(table, a, backend=backend), pack_pages_naive(caches, _ids(6, 2, 8)))
        assert torch.equal(pack_pages(table, a[1:], backend=backend), pack_pages_naive(caches, _ids(2, 8)))
        batch = BlockIds.stack([a, b])
        staging = pack_pages(table, batch, backend=backend)
        assert staging.shape == (2, table.staging_bytes(3))
        assert torch.equal(staging, pack_pages_naive(caches, torch.tensor([[6, 2, 8], [1, 0, 5]])))
        assert torch.equal(pack_pages(table, batch[1], backend=backend), staging[1])
        fresh = fresh_like(caches)
        unpack_pages(staging, fresh, batch, backend=backend)
        assert_round_trip(fresh, caches, torch.tensor([[6, 2, 8], [1, 0, 5]]))


def test_checked_block_ids_are_not_checked_again(monkeypatch):
    """An op given BlockIds compares their bound with the table and, for an unpack, looks for
    duplicates once; it does not re-run the per-id checks (the data plane checks when an order
    arrives)."""
    from saria.kernels import checks

    caches = vllm_layers(6, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    blocks = check_block_ids(table, _ids(4, 1))
    assert check_block_ids(table, blocks) is blocks
    unique = check_block_ids(table, blocks, unique=True)
    assert unique.unique and check_block_ids(table, unique, unique=True) is unique

    dense = checks.check_dense

    def once(t, what):
        assert what != "block_ids", "block ids checked twice"
        return dense(t, what)

    def refuse(*args, **kwargs):
        raise AssertionError("block ids checked for duplicates twice")

    monkeypatch.setattr(checks, "check_dense", once)
    monkeypatch.setattr(checks, "_check_unique", refuse)
    staging = pack_pages(table, blocks)
    unpack_pages(staging, fresh_like(caches), unique)


def test_checked_block_ids_still_refused_where_they_do_not_fit():
    big = vllm_layers(9, 2, 1, 8, torch.bfloat16)
    small = vllm_layers(4, 2, 1, 8, torch.bfloat16)
    before = [c.clone() for c in small]
    blocks = check_block_ids(PageTable(big), _ids(1, 6))
    with pytest.raises(IndexError, match=r"block id 6 is out of range: caches\[0\] has 4 pages"):
        pack_pages(small, blocks)
    with pytest.raises(IndexError, match="block id 6 is out of range"):
        unpack_pages(pack_pages(big, blocks), small, blocks)
    one = check_block_ids(PageTable(big), _ids(2, 3))
    twice = BlockIds.stack([one, check_block_ids(PageTable(big), _ids(3, 0))])
    staging = pack_pages(big, twice)  # packing a page twice is fine
    with pytest.raises(ValueError, match="block id 3 appears more than once"):
        unpack_pages(staging, big, twice)
    assert all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, small))


@pytest.mark.parametrize("misuse, error, match", [
    pytest.param(lambda b: BlockIds(torch.tensor([1])), TypeError, "made by check_block_ids", id="constructed"),
    pytest.param(lambda b: b[[0, 0]], TypeError, "int or a slice", id="fancy-index"),
    pytest.param(lambda b: b[0], TypeError, "single id", id="one-id"),
    pytest.param(lambda b: BlockIds.stack([]), ValueError, "non-empty", id="stack-nothing"),
    pytest.param(lambda b: BlockIds.stack([b, b[1:]]), ValueError, "different lengths", id="stack-ragged"),
    pytest.param(lambda b: BlockIds.stack([_ids(1, 2)]), ValueError, "1-D BlockIds", id="stack-tensors"),
    pytest.param(lambda b: setattr(b, "end", 10**9), AttributeError, "immutable", id="widened"),
])
def test_block_ids_misuse(misuse, error, match):
    blocks = check_block_ids(PageTable(_caches()), _ids(1, 2))
    with pytest.raises(error, match=match):
        misuse(blocks)


def test_a_cached_staging_check_still_refuses_a_changed_table_or_staging(monkeypatch):
    """Check once, launch many: a staging that passed its checks for a table is not checked again
    while nothing about it changed, but the table is verified on every call, and a staging that
    changed since (re-pointed, resized, freed) is checked again and refused."""
    from saria.kernels import StaleTableError
    from saria.kernels.pages import api

    caches = vllm_layers(6, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    staging = pack_pages(table, _ids(4, 1))
    pack_pages(table, _ids(4, 1), out=staging)  # checked, then cached
    calls = []
    real = api.check_staging
    monkeypatch.setattr(api, "check_staging", lambda *a: (calls.append(a[-1]), real(*a)))
    for _ in range(3):
        pack_pages(table, _ids(4, 1), out=staging)
        unpack_pages(staging, table, _ids(2, 3))
    assert calls == []  # cached
    caches[1].set_(torch.zeros_like(caches[1]))  # the table goes stale after its staging was cached
    with pytest.raises(StaleTableError):
        pack_pages(table, _ids(4, 1), out=staging)
    with pytest.raises(StaleTableError):
        unpack_pages(staging, table, _ids(2, 3))
    table = PageTable(vllm_layers(6, 2, 1, 8, torch.bfloat16))
    staging = pack_pages(table, _ids(4, 1))
    unpack_pages(staging, table, _ids(2, 3))
    calls.clear()
    staging.untyped_storage().resize_(staging.numel() - 1)  # freed or shrunk after its check was cached
    with pytest.raises(ValueError, match="freed or shrunk"):
        unpack_pages(staging, table, _ids(2, 3))
    assert calls == ["staging"]
    inside = table.byte_pages(0).view(-1)[:staging.numel()]  # a staging inside the pages: refused every time
    for _ in range(2):
        with pytest.raises(ValueError, match="shares memory"):
            pack_pages(table, _ids(4, 1), out=inside)


def test_the_null_backend_checks_everything_and_copies_nothing():
    from saria.kernels import StaleTableError, prepare_scattered
    from saria.kernels.backend import null_copies

    caches = vllm_layers(6, 2, 1, 8, torch.bfloat16)
    table = PageTable(caches)
    before = [c.clone() for c in caches]
    staging = torch.zeros(table.staging_bytes(2), dtype=torch.uint8, device=DEVICE)
    assert not pack_pages(table, _ids(4, 1), out=staging, backend="null").any()
    unpack_pages(torch.ones_like(staging), table, _ids(2, 3), backend="null")
    with null_copies():
        pack_pages(table, _ids(4, 1), out=staging)
        buffer = torch.ones(2 * table.bytes_per_page, dtype=torch.uint8, device=DEVICE)
        offsets = torch.tensor([[0, table.bytes_per_page]], dtype=torch.int64)
        copy = prepare_scattered(buffer, offsets, [caches[0]], [2, 3], pack=False)
        copy.launch()
        with pytest.raises(ValueError, match="appears more than once"):
            unpack_pages(torch.ones_like(staging), table, _ids(2, 2))
        from saria.kernels import prepare_layered
        pb = table.segments[0].page_bytes
        where = torch.tensor([[0, pb], [2 * pb, 3 * pb]], dtype=torch.int64)
        for backend in ("auto", "torch"):  # the Triton path here runs under the interpreter
            layered = prepare_layered(table, [[0], [1]], [torch.ones(4 * pb, dtype=torch.uint8, device=DEVICE)],
                                      [2, 3], None, where, pack=False, backend=backend)
            layered.launch(0), layered.launch(1)
    assert not staging.any()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, caches))
    pack_pages(table, _ids(4, 1), out=staging)  # outside null_copies(): copies again
    assert staging.any()
    caches[0].set_(torch.zeros_like(caches[0]))
    with pytest.raises(StaleTableError):
        pack_pages(table, _ids(4, 1), backend="null")
    with pytest.raises(StaleTableError):
        copy.launch()
