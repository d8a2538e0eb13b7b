"""pack_pages_fp8 / unpack_pages_fp8 / quantize_staging / dequantize_staging (ssd_dtype=fp8): every
backend against the naive oracle, the differential quantize_staging(pack_pages) == pack_pages_fp8,
the error bound of saria/ssd_dtype.py, the edge values, every layout, batches, skip, each refusal.
Shapes stay small: the interpreter costs about 1 ms a program, the oracle ~20 us an element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import DEVICE, flashinfer, fresh_like, legacy_halves, mla, vllm_layers
from saria.kernels import (PageTable, StaleTableError, checksum, dequantize_naive, dequantize_staging,
                           fp8_staging_bytes, pack_pages, pack_pages_fp8, pack_pages_fp8_naive, quantize_naive,
                           quantize_staging, resolve_backend, unpack_pages_fp8, unpack_pages_fp8_naive)
from saria.kernels.fp8 import triton as fp8_triton
from saria.ssd_dtype import FP8_GROUP, fp8_bytes

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})
FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The cache dtype's own rounding of a decoded value: relative half ulp, and half its smallest subnormal.
ROUNDING = {torch.bfloat16: (2.0 ** -8, 2.0 ** -134), torch.float16: (2.0 ** -11, 2.0 ** -25),
            torch.float32: (2.0 ** -24, 2.0 ** -150)}


def _ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def _values(caches, seed: int, spread: int = 12):
    """Fill float caches with signed values of mixed magnitudes (2**-spread to 2**spread within a
    group), a few exact zeros; returns them."""
    gen = torch.Generator().manual_seed(seed)
    for c in caches:
        n = c.numel()
        v = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=gen).float())
        v[torch.rand(n, generator=gen) < 0.02] = 0.0
        c.copy_(v.view(c.shape))
    return caches


def _bytes(caches):
    return [PageTable([c]).byte_pages(0).clone() for c in caches]


def _same_bytes(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


LAYOUTS = [  # page elements noted: whole 128-element groups
    pytest.param(lambda dt: vllm_layers(6, 2, 2, 16, dt), id="vllm-per-layer-128"),
    pytest.param(lambda dt: legacy_halves(6, 4, 2, 32, dt), id="legacy-halves-256"),
    pytest.param(lambda dt: flashinfer(5, 2, 3, 32, dt), id="flashinfer-384"),
    pytest.param(lambda dt: mla(5, 1, 128, dt), id="mla-128"),
]


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("build", LAYOUTS)
def test_every_layout_matches_the_oracle_both_ways(build, dtype):
    caches = _values(build(FLOATS[dtype]), seed=1)
    ids = _ids(4, 0, 2)
    want = pack_pages_fp8_naive(caches, ids)
    assert want.numel() == fp8_staging_bytes(caches, 3) == fp8_bytes(PageTable(caches).staging_bytes(3),
                                                                       caches[0].element_size())
    assert torch.equal(quantize_staging(pack_pages(caches, ids), FLOATS[dtype]), want)
    expected = fresh_like(caches)
    unpack_pages_fp8_naive(want, expected, ids)
    for backend in BACKENDS:
        assert torch.equal(pack_pages_fp8(caches, ids, backend=backend), want), backend
        fresh = fresh_like(caches)
        unpack_pages_fp8(want, fresh, ids, backend=backend)
        assert _same_bytes(fresh, expected), backend
    assert torch.equal(dequantize_staging(want, FLOATS[dtype]), pack_pages(expected, ids))


@st.composite
def _case(draw):
    """(caches over padded buffers, ids): 1 to 3 tensors of one random dtype, 1 to 3 groups a page,
    random padding and start offset, 1-D or 2-D distinct ids."""
    dtype = draw(st.sampled_from(list(FLOATS.values())))
    pages = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**16))
    caches = []
    for t in range(draw(st.integers(1, 3))):
        page = FP8_GROUP * draw(st.integers(1, 3))
        stride = page + draw(st.sampled_from([0, 0, 8, 128]))
        offset = draw(st.integers(0, 3))
        buf = torch.zeros(offset + pages * stride, dtype=dtype, device=DEVICE)
        caches.append(buf.as_strided((pages, page), (stride, 1), offset))
    _values(caches, seed, spread=draw(st.sampled_from([0, 4, 20])))
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):
        ids = order[:draw(st.integers(1, pages))]
    else:
        chunks = draw(st.integers(1, 2))
        ids = order[:chunks * draw(st.integers(1, pages // chunks))].view(chunks, -1)
    return caches, ids


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # fp16 infs: NaN groups
@given(_case())
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_random_layouts_match_the_oracle(case):
    caches, ids = case
    want = pack_pages_fp8_naive(caches, ids)
    raw = pack_pages(caches, ids)
    assert torch.equal(quantize_staging(raw, caches[0].dtype), want)
    expected = fresh_like(caches)
    unpack_pages_fp8_naive(want, expected, ids)
    for backend in BACKENDS:
        got = pack_pages_fp8(caches, ids, backend=backend)
        assert torch.equal(got, want), backend
        fresh = fresh_like(caches)
        unpack_pages_fp8(got, fresh, ids, backend=backend)
        # every byte of the buffers, padding included: only the listed pages are written
        whole = [torch.empty(0, dtype=torch.uint8).set_(f.untyped_storage()) for f in fresh]
        assert all(torch.equal(w, torch.empty(0, dtype=torch.uint8).set_(e.untyped_storage()))
                   for w, e in zip(whole, expected)), backend
    assert torch.equal(dequantize_staging(want, caches[0].dtype), pack_pages(expected, ids))


@pytest.mark.parametrize("dtype", list(FLOATS))
def test_round_trip_error_within_the_documented_bound(dtype):
    dt = FLOATS[dtype]
    spread = 10 if dt == torch.float16 else 16  # fp16 tops out at 65504: no infs here
    caches = _values(vllm_layers(6, 4, 2, 32, dt, layers=2), seed=7, spread=spread)
    ids = _ids(5, 1, 3)
    stored = pack_pages_fp8(caches, ids)
    fresh = fresh_like(caches)
    unpack_pages_fp8(stored, fresh, ids)
    x = pack_pages(caches, ids).view(dt).float()
    y = pack_pages(fresh, ids).view(dt).float()
    n = x.numel()
    scale = stored[n:].clone().view(torch.float32).repeat_interleave(FP8_GROUP)
    rel, tiny = ROUNDING[dt]
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale + rel * y.abs() + tiny
    assert ((x - y).abs() <= bound).all()
    assert (x - y).abs().max() > 0  # it is lossy: the bound is what is tested, not exactness


def _one_group_cache(values, dtype=torch.float32):
    """One page per group of ``values`` (each a list of up to 128 floats, zero-padded)."""
    rows = [list(v) + [0.0] * (FP8_GROUP - len(v)) for v in values]
    return [torch.tensor(rows, dtype=dtype, device=DEVICE)]


def _grid_values():
    """Every e4m3 magnitude, every midpoint and its float32 neighbours, with 448 in each group so the
    scale is exactly 1 and q = x: the rounding itself is what is compared."""
    mags = sorted({float(v) for v in torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()})
    mids = [(a + b) / 2 for a, b in zip(mags, mags[1:])]
    values = []
    for v in mags + mids:
        t = torch.tensor([v], dtype=torch.float32)
        values += [v, -v, float(torch.nextafter(t, t + 1)), float(torch.nextafter(t, t - 1))]
    values += [2.0 ** -12, 2.0 ** -11, 3 * 2.0 ** -11, 1e-30, -1e-30, -0.0, 447.9]
    values = [v for v in values if abs(v) <= 448.0]
    groups = [values[i:i + 127] for i in range(0, len(values), 127)]
    return [[448.0] + g for g in groups]


def test_e4m3_rounding_at_every_midpoint_matches_the_oracle():
    caches = _one_group_cache(_grid_values())
    ids = torch.arange(caches[0].shape[0])
    want = pack_pages_fp8_naive(caches, ids)
    n = caches[0].numel()
    assert (want[n:].view(torch.float32) == 1.0).all()
    for backend in BACKENDS:
        assert torch.equal(pack_pages_fp8(caches, ids, backend=backend), want), backend


def test_every_code_decodes_as_the_oracle_for_each_dtype():
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)  # 4 groups; 0x7F / 0xFF decode to NaN
    scales = torch.tensor([1.0, 2.0 ** -20, 3.7e-3, 65504.0 / 448], dtype=torch.float32)
    stored = torch.cat([codes, scales.view(torch.uint8)]).to(DEVICE)
    for dt in FLOATS.values():
        want = dequantize_naive(stored, dt)
        assert torch.equal(dequantize_staging(stored, dt), want)
        caches = [torch.zeros(6, 512, dtype=dt, device=DEVICE)]
        for backend in BACKENDS:
            fresh = fresh_like(caches)
            unpack_pages_fp8(stored, fresh, _ids(4), backend=backend)
            assert torch.equal(fresh[0][4].view(torch.uint8), want), (dt, backend)


# NaN groups decode as scale (NaN) x code under the interpreter's numpy: the expected warning
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_groups(backend):
    big = 3.0e4
    groups = [
        [0.0] * 128,  # zeros: scale 0, codes 0
        [-0.0] * 128,  # negative zeros: still scale 0 and codes 0
        [1.0, -0.0, 0.0],  # -0.0 in a live group keeps its sign (code 0x80)
        [big, -big, big / 3],  # values at +-448 * scale
        [1.0, 2.0 ** -12, -(2.0 ** -13), 2.0 ** -20],  # subnormal codes and flush to 0
        [1.0e4, 1.0e-4, -3.0, 7.5e-2],  # mixed magnitudes in one group
        [1e-44, -2e-44],  # fp32 subnormals whose scale (amax / 448) underflows to 0: stored as zeros
        [1.0, float("nan"), 2.0],  # NaN: scale NaN, codes 0, the group decodes to NaN
        [1.0, float("inf"), 2.0],  # inf: scale inf, codes 0, the group decodes to NaN
    ]
    caches = _one_group_cache(groups)
    ids = torch.arange(len(groups))
    want = pack_pages_fp8_naive(caches, ids)
    got = pack_pages_fp8(caches, ids, backend=backend)
    assert torch.equal(got, want)
    n = caches[0].numel()
    codes, scales = got[:n].view(-1, 128), got[n:].clone().view(torch.float32)
    assert scales[0] == 0 and not codes[0].any() and scales[1] == 0 and not codes[1].any()
    assert codes[2, 1] == 0x80 and codes[2, 2] == 0
    assert codes[3, 0] == 0x7E and codes[3, 1] == 0xFE and scales[3] == torch.tensor(big) / 448
    assert scales[6] == 0 and not codes[6].any()
    assert torch.isnan(scales[7]) and scales[7:8].view(torch.int32) == 0x7FC00000 and not codes[7].any()
    assert torch.isinf(scales[8]) and not codes[8].any()
    fresh = fresh_like(caches)
    unpack_pages_fp8(got, fresh, ids, backend=backend)
    out = fresh[0]
    assert torch.equal(out[3, :2], caches[0][3, :2])  # +-448 * scale is exact
    assert torch.isnan(out[7]).all() and torch.isnan(out[8]).all()  # the damage is visible ...
    assert torch.equal(out[5, 0], caches[0][5, 0]) and not torch.isnan(out[:7]).any()  # ... and confined


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_rows_are_objects_encoded_on_their_own(backend):
    caches = _values(vllm_layers(8, 2, 2, 32, torch.bfloat16, layers=2), seed=3)
    ids = torch.tensor([[7, 1, 3], [0, 6, 2]])
    got = pack_pages_fp8(caches, ids, backend=backend)
    assert got.shape == (2, fp8_staging_bytes(caches, 3))
    for c in range(2):
        assert torch.equal(got[c], pack_pages_fp8(caches, ids[c], backend=backend))
    assert torch.equal(got, quantize_staging(pack_pages(caches, ids), torch.bfloat16))
    fresh, expected = fresh_like(caches), fresh_like(caches)
    unpack_pages_fp8(got, fresh, ids, backend=backend)
    unpack_pages_fp8_naive(got, expected, ids)
    assert _same_bytes(fresh, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_leaves_the_leading_pages_and_writes_the_rest(backend):
    caches = _values(legacy_halves(8, 2, 2, 32, torch.float16), seed=4)
    stored = pack_pages_fp8(caches, _ids(5, 2, 7, 0))  # one object of 4 pages
    fresh, expected = fresh_like(caches), fresh_like(caches)
    unpack_pages_fp8(stored, fresh, _ids(3, 6), skip=2, backend=backend)  # slots 2, 3 -> pages 3, 6
    unpack_pages_fp8_naive(stored, expected, _ids(3, 6), skip=2)
    assert _same_bytes(fresh, expected)
    whole = fresh_like(caches)
    unpack_pages_fp8(stored, whole, _ids(1, 4, 3, 6), backend=backend)
    for f, w in zip(fresh, whole):
        assert torch.equal(f[[3, 6]], w[[3, 6]]) and not f[[0, 1, 2, 4, 5, 7]].any()


def test_unaligned_staging_and_the_multi_tile_launch():
    caches = _values(mla(6, 4, 128, torch.bfloat16), seed=5)  # 4 groups a page
    ids = _ids(5, 0, 3)
    want = pack_pages_fp8_naive(caches, ids)
    buf = torch.zeros(want.numel() + 1, dtype=torch.uint8, device=DEVICE)
    for backend in BACKENDS:
        out = buf[1:]  # scales at addresses that are not 4-byte aligned
        assert pack_pages_fp8(caches, ids, out=out, backend=backend) is out and torch.equal(out, want)
    if TRITON == "triton":
        table = PageTable(caches)
        out = torch.zeros_like(want)
        cfg = fp8_triton.launch(table, ids.to(DEVICE), out, 3, True, groups=1, tiles=3)  # programs loop over tiles
        assert (cfg.groups, cfg.tiles) == (1, 3) and torch.equal(out, want)
        fresh, expected = fresh_like(caches), fresh_like(caches)
        fp8_triton.launch(PageTable(fresh), ids.to(DEVICE), want, 3, False, groups=2, tiles=1)
        unpack_pages_fp8_naive(want, expected, ids)
        assert _same_bytes(fresh, expected)


def test_checksum_of_the_stored_bytes_sees_one_flipped_byte():
    caches = _values(vllm_layers(4, 2, 2, 16, torch.bfloat16), seed=6)
    stored = pack_pages_fp8(caches, _ids(1, 3))
    base = checksum(stored)
    n = PageTable(caches).staging_bytes(2) // 2
    for at in (0, n - 1, n, stored.numel() - 1):  # first and last code, first and last scale byte
        flipped = stored.clone()
        flipped[at] ^= 0x10
        assert checksum(flipped) != base, at


def test_sizes_and_the_tables_element_dtype():
    caches = vllm_layers(4, 2, 2, 16, torch.float32, layers=3)  # 128 elements a page
    assert PageTable(caches).element_dtype == torch.float32
    assert PageTable(caches + [torch.zeros(4, 128, dtype=torch.int8)]).element_dtype is None
    assert fp8_staging_bytes(caches, 5) == 3 * 5 * (128 + 4) == fp8_bytes(3 * 5 * 128 * 4, 4)


def test_empty_ids_and_empty_objects():
    caches = vllm_layers(4, 2, 2, 16, torch.float32)
    assert pack_pages_fp8(caches, _ids()).numel() == 0
    unpack_pages_fp8(torch.empty(0, dtype=torch.uint8), caches, _ids())
    assert quantize_staging(torch.empty(0, dtype=torch.uint8), torch.float32).numel() == 0
    assert dequantize_staging(torch.empty(2, 0, dtype=torch.uint8), torch.bfloat16).shape == (2, 0)


# --- refusals: one clear error line, nothing written --------------------------------------------

def _bf16():
    return _values(vllm_layers(4, 2, 2, 16, torch.bfloat16), seed=8)


def _int8_gdn():
    return [torch.zeros(4, 256, dtype=torch.int8)]


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: _bf16() + _int8_gdn(), r"one element dtype.*caches\[0\] is torch.bfloat16, caches\[2\] is "
                 "torch.int8", id="mixed-dtypes"),
    pytest.param(lambda: [torch.zeros(4, 256, dtype=torch.float8_e4m3fn)], "bf16, fp16 or fp32 caches, got "
                 "torch.float8_e4m3fn", id="fp8-cache"),
    pytest.param(lambda: [torch.zeros(4, 256, dtype=torch.int8)], "got torch.int8", id="int8-cache"),
    pytest.param(lambda: _bf16() + [torch.zeros(4, 2, 40, dtype=torch.bfloat16)],
                 r"caches\[2\] has pages of 80 elements \(160 bytes\).*multiple of 128", id="partial-group"),
])
@pytest.mark.parametrize("op", ["pack", "unpack", "size"])
def test_tables_fp8_does_not_apply_to(make, match, op):
    caches = make()
    before = _bytes(caches)
    with pytest.raises(ValueError, match=match):
        if op == "pack":
            pack_pages_fp8(caches, _ids(0, 1))
        elif op == "unpack":
            unpack_pages_fp8(torch.zeros(1 << 12, dtype=torch.uint8), caches, _ids(0, 1))
        else:
            fp8_staging_bytes(caches, 2)
    assert all(torch.equal(b, a) for b, a in zip(before, _bytes(caches)))


def _staging_cases():
    size = fp8_staging_bytes(_bf16(), 2)
    return [
        pytest.param(lambda c: torch.zeros(size - 1, dtype=torch.uint8), "FP8 object", id="short"),
        pytest.param(lambda c: torch.zeros(size + 132, dtype=torch.uint8), "FP8 object", id="long"),
        pytest.param(lambda c: torch.zeros(size, dtype=torch.int8), "uint8", id="int8"),
        pytest.param(lambda c: torch.zeros(2, size // 2, dtype=torch.uint8), r"\[1, ", id="wrong-2d"),
        pytest.param(lambda c: torch.zeros(size, dtype=torch.uint8, device="meta"), "is on meta", id="device"),
        pytest.param(lambda c: torch.zeros(2 * size, dtype=torch.uint8)[::2], "contiguous", id="strided"),
        pytest.param(lambda c: c[0].view(-1).view(torch.uint8)[:size], "shares memory", id="inside-cache"),
    ]


@pytest.mark.parametrize("make, match", _staging_cases())
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_bad_staging(make, match, op):
    caches = _bf16()
    staging = make(caches)
    before = _bytes(caches)
    with pytest.raises(ValueError, match=match):
        if op == "pack":
            pack_pages_fp8(caches, _ids(2, 3), out=staging)
        else:
            unpack_pages_fp8(staging, caches, _ids(2, 3))
    assert all(torch.equal(b, a) for b, a in zip(before, _bytes(caches)))


@pytest.mark.parametrize("ids, skip, error, match", [
    pytest.param(_ids(1, 1), 0, ValueError, "more than once", id="duplicates"),
    pytest.param(_ids(1, 4), 0, IndexError, "out of range", id="out-of-range"),
    pytest.param(torch.tensor([[1], [2]]), 1, ValueError, "1-D block_ids", id="skip-2d"),
    pytest.param(_ids(1), -1, ValueError, ">= 0", id="negative-skip"),
    pytest.param(_ids(), 1, ValueError, "no block_ids", id="skip-nothing"),
    pytest.param(_ids(1), 1.5, ValueError, "integer", id="float-skip"),
])
def test_bad_unpack_ids_and_skip(ids, skip, error, match):
    caches = _bf16()
    staging = torch.zeros(fp8_staging_bytes(caches, 2), dtype=torch.uint8)
    before = _bytes(caches)
    with pytest.raises(error, match=match):
        unpack_pages_fp8(staging, caches, ids, skip=skip)
    assert all(torch.equal(b, a) for b, a in zip(before, _bytes(caches)))


def test_stale_table_refused():
    caches = _bf16()
    table = PageTable(caches)
    staging = pack_pages_fp8(table, _ids(0, 1))
    caches[0].set_(torch.zeros_like(caches[0]))
    with pytest.raises(StaleTableError):
        pack_pages_fp8(table, _ids(0, 1))
    with pytest.raises(StaleTableError):
        unpack_pages_fp8(staging, table, _ids(0, 1))


@pytest.mark.parametrize("call, error, match", [
    pytest.param(lambda: quantize_staging(torch.zeros(256, dtype=torch.uint8), torch.int8), ValueError,
                 "got torch.int8", id="q-int8"),
    pytest.param(lambda: quantize_staging(torch.zeros(256, dtype=torch.uint8), "bf16"), TypeError,
                 "torch.dtype", id="q-not-a-dtype"),
    pytest.param(lambda: quantize_staging(torch.zeros(300, dtype=torch.uint8), torch.bfloat16), ValueError,
                 "whole groups of 128", id="q-partial-group"),
    pytest.param(lambda: quantize_staging(torch.zeros(256, dtype=torch.int16), torch.bfloat16), ValueError,
                 "uint8", id="q-not-bytes"),
    pytest.param(lambda: quantize_staging(torch.zeros(256, dtype=torch.uint8), torch.bfloat16,
                                          out=torch.zeros(131, dtype=torch.uint8)), ValueError, "out has shape",
                 id="q-bad-out"),
    pytest.param(lambda: dequantize_staging(torch.zeros(130, dtype=torch.uint8), torch.float16), ValueError,
                 "multiple of 132", id="dq-not-an-object"),
    pytest.param(lambda: dequantize_staging(torch.zeros(1, 1, 132, dtype=torch.uint8), torch.float16),
                 ValueError, "1-D", id="dq-3d"),
    pytest.param(lambda: dequantize_staging(torch.zeros(132, dtype=torch.uint8), torch.float16,
                                            out=torch.zeros(2, 128, dtype=torch.uint8)), ValueError,
                 "out has shape", id="dq-bad-out"),
])
def test_bad_host_side_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_host_side_encoding_fills_out_and_matches_the_oracle_per_row():
    raw = pack_pages(_bf16(), torch.tensor([[0, 1], [3, 2]]))
    out = torch.empty(2, fp8_bytes(raw.shape[1], 2), dtype=torch.uint8)
    assert quantize_staging(raw, torch.bfloat16, out=out) is out
    assert all(torch.equal(out[r], quantize_naive(raw[r], torch.bfloat16)) for r in range(2))
    back = torch.empty_like(raw)
    assert dequantize_staging(out, torch.bfloat16, out=back) is back
    assert all(torch.equal(back[r], dequantize_naive(out[r], torch.bfloat16)) for r in range(2))
