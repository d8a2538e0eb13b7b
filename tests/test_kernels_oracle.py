"""Differential tests: every implementation of every op (the Triton kernel, interpreted on CPU or
compiled on CUDA, and the fast CPU / torch path) against the op's naive reference, on random
layouts, ids and bytes. Example counts stay small: the interpreter costs about 1 ms a program."""

from __future__ import annotations

import importlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import DEVICE, random_bytes
from saria.kernels import (checksum, checksum_naive, checksum_torch, pack_pages, pack_pages_naive, pack_state,
                           pack_state_naive, resolve_backend, unpack_pages, unpack_pages_naive, unpack_state,
                           unpack_state_naive)

host = importlib.import_module("saria.kernels.checksum.cpu")

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)


DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64,
          torch.float8_e4m3fn]


@st.composite
def _paged(draw, pages: int, seed: int):
    """A paged tensor over its own buffer: random dtype, page size, padding and start offset (so
    pages are often not 16-byte aligned and take the kernel's byte path). Returns a function that
    builds it over a given buffer, and the buffer."""
    dtype = draw(st.sampled_from(DTYPES))
    page = draw(st.integers(1, 40))  # elements per page
    stride = page + draw(st.sampled_from([0, 0, 1, 3, 8]))
    offset = draw(st.integers(0, 5))
    buffer = random_bytes((offset + pages * stride,), dtype, seed)

    def over(buf: torch.Tensor) -> torch.Tensor:
        return buf.as_strided((pages, page), (stride, 1), offset)

    return over, buffer


@st.composite
def _case(draw, distinct: bool):
    """(views, buffers, ids): 1 to 3 paged tensors and 1-D or 2-D ids, distinct for an unpack."""
    pages = draw(st.integers(2, 8))
    seed = draw(st.integers(0, 2**16))
    tensors = [draw(_paged(pages, seed + t)) for t in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        shape = (draw(st.integers(1, min(3, pages))),)
    else:
        chunks = draw(st.integers(1, 2))
        shape = (chunks, draw(st.integers(1, pages // chunks)))
    count = shape[0] if len(shape) == 1 else shape[0] * shape[1]
    if distinct:
        values = draw(st.permutations(range(pages)))[:count]
    else:
        values = draw(st.lists(st.integers(0, pages - 1), min_size=count, max_size=count))
    return [over for over, _ in tensors], [buf for _, buf in tensors], torch.tensor(values).view(shape)


@examples(25)
@given(case=_case(distinct=False))
def test_pack_pages_equals_the_naive_reference(case):
    views, buffers, ids = case
    caches = [over(buf) for over, buf in zip(views, buffers)]
    want = pack_pages_naive(caches, ids)
    for backend in BACKENDS:
        assert torch.equal(pack_pages(caches, ids, backend=backend), want), backend


@examples(25)
@given(case=_case(distinct=True))
def test_unpack_pages_equals_the_naive_reference(case):
    """Unpacked into zeroed buffers: every byte of every buffer (pages, padding, the bytes before
    the first page) as the naive reference leaves it."""
    views, buffers, ids = case
    staging = pack_pages_naive([over(buf) for over, buf in zip(views, buffers)], ids)
    want = [torch.zeros_like(buf) for buf in buffers]
    unpack_pages_naive(staging, [over(buf) for over, buf in zip(views, want)], ids)
    for backend in BACKENDS:
        got = [torch.zeros_like(buf) for buf in buffers]
        unpack_pages(staging, [over(buf) for over, buf in zip(views, got)], ids, backend=backend)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), backend


@st.composite
def _states(draw):
    layers, slots = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    hv, v, k = (draw(st.integers(1, 3)) for _ in range(3))
    conv_len, conv_dim = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    t_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    c_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    seed = draw(st.integers(0, 2**16))
    temporal = [random_bytes((slots, hv, v, k), t_dtype, seed + l) for l in range(layers)]
    conv = [random_bytes((slots, conv_len, conv_dim), c_dtype, seed + 50 + l) for l in range(layers)]
    order = draw(st.permutations(range(slots)))
    ids = torch.tensor(order[:2]).view(2 if draw(st.booleans()) else 1, -1)
    return temporal, conv, ids.view(-1) if draw(st.booleans()) else ids


@examples(15)
@given(case=_states())
def test_state_ops_equal_the_naive_reference(case):
    temporal, conv, slots = case
    want = pack_state_naive(temporal, conv, slots)
    fresh_want = ([torch.zeros_like(t) for t in temporal], [torch.zeros_like(c) for c in conv])
    unpack_state_naive(want, *fresh_want, slots)
    for backend in BACKENDS:
        assert torch.equal(pack_state(temporal, conv, slots, backend=backend), want), backend
        fresh = ([torch.zeros_like(t) for t in temporal], [torch.zeros_like(c) for c in conv])
        unpack_state(want, *fresh, slots, backend=backend)
        for got, expected in zip(fresh[0] + fresh[1], fresh_want[0] + fresh_want[1]):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), backend


@examples(40)
@given(n=st.integers(0, 3000), offset=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_checksum_implementations_equal_the_naive_reference(n, offset, seed):
    data = random_bytes((n + offset,), torch.uint8, seed)[offset:]
    want = checksum_naive(data)
    assert checksum_torch(data) == want
    assert host.checksum_cpu(data.cpu()) == want
    for backend in BACKENDS:
        assert checksum(data, backend=backend) == want, backend
