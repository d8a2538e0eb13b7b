"""checksum: the documented formula, both backends agree, and the corruptions it must catch."""

from __future__ import annotations

import importlib
import random
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cases import DEVICE, random_bytes, vllm_layers
from saria.kernels import checksum, checksum_naive, checksum_torch, pack_pages, resolve_backend
from saria.kernels.checksum import mix64

kernel = importlib.import_module("saria.kernels.checksum.triton")
host = importlib.import_module("saria.kernels.checksum.cpu")

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})


def test_mix64_is_splitmix64():
    # splitmix64 with state 0: first output 0xe220a8397b1dcdaf (Vigna's reference implementation).
    assert mix64(0) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("data, value", [(b"", 0xA706DD2F4D197E6F), (b"a", 0x9049DDEEB6661E92),
                                         (b"saria", 0xCAFE254F8981BA7F),
                                         (bytes(range(256)) * 3 + b"xy", 0x804AC10968AEA4A3)])
def test_known_values(data, value):
    """The value is part of the SSD format: pinned, for the reference and every backend."""
    assert checksum_naive(data) == value
    tensor = torch.tensor(list(data), dtype=torch.uint8, device=DEVICE)
    for backend in BACKENDS:
        assert checksum(tensor, backend=backend) == value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 64, 1023, 16384 + 7], ids=lambda n: f"{n}B")
def test_matches_the_naive_reference(backend, n):
    data = random_bytes((n,), torch.uint8, n)
    assert checksum(data, backend=backend) == checksum_naive(data)


def test_backends_agree_on_multi_program_buffer():
    block = kernel.BLOCK_WORDS if DEVICE.type == "cuda" else kernel.BLOCK_WORDS_INTERPRETED
    data = random_bytes((3 * block * 4 + 12,), torch.uint8, 1)  # several kernel programs
    assert checksum(data, backend=TRITON) == checksum_torch(data) == checksum_naive(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_bytes_equal_checksum_any_dtype(backend):
    data = random_bytes((4096,), torch.uint8, 2)
    assert checksum(data, backend=backend) == checksum(data.clone(), backend=backend)
    assert checksum(data.view(torch.float16).view(32, 64), backend=backend) == checksum(data, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unaligned_start(backend):
    buf = random_bytes((1001,), torch.uint8, 3)
    assert checksum(buf[1:], backend=backend) == checksum_naive(buf[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_detects_every_single_word_change(backend):
    data = random_bytes((256 + 2,), torch.uint8, 4)  # 64 words and a 2-byte tail
    h = checksum(data, backend=backend)
    seen = {h}
    for word in range(65):
        changed = data.clone()
        changed[word * 4] ^= 0x01
        seen.add(checksum(changed, backend=backend))
    assert len(seen) == 66


@pytest.mark.parametrize("backend", BACKENDS)
def test_detects_swapped_words(backend):
    data = random_bytes((1024,), torch.uint8, 5)
    h = checksum(data, backend=backend)
    for a, b in [(0, 1), (3, 200), (17, 255)]:
        swapped = data.clone().view(torch.int32)
        swapped[a], swapped[b] = data.view(torch.int32)[b], data.view(torch.int32)[a]
        assert checksum(swapped, backend=backend) != h


@pytest.mark.parametrize("backend", BACKENDS)
def test_detects_zeroed_page_and_truncation(backend):
    caches = vllm_layers(6, 2, 1, 8, torch.bfloat16)
    staging = pack_pages(caches, torch.tensor([1, 4, 2]))
    h = checksum(staging, backend=backend)
    zeroed = staging.clone()
    zeroed[64:128] = 0  # one page of one tensor
    assert checksum(zeroed, backend=backend) != h
    assert checksum(staging[:-4], backend=backend) != h
    padded = torch.cat([staging, torch.zeros(4, dtype=torch.uint8, device=DEVICE)])
    assert checksum(padded, backend=backend) != h


def test_bad_input():
    with pytest.raises(ValueError, match="contiguous"):
        checksum(torch.zeros(8, 8, dtype=torch.uint8)[:, ::2])
    with pytest.raises(ValueError, match="torch.Tensor"):
        checksum(b"bytes")
    with pytest.raises(ValueError, match="meta"):
        checksum(torch.zeros(8, dtype=torch.uint8, device="meta"))


# --- the blocked CPU path ------------------------------------------------------------------------------

BLOCK_BYTES = 4 * host.CPU_BLOCK_WORDS


def cpu_bytes(n: int, seed: int, offset: int = 0) -> torch.Tensor:
    """``n`` random bytes on the CPU starting ``offset`` bytes into a fresh (aligned) allocation."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=gen)[offset:]


def cpu_path(data: torch.Tensor) -> int:
    """What CPU callers get: ``auto`` and ``torch`` both run the blocked host path for CPU tensors."""
    value = checksum(data)
    assert checksum(data, backend="torch") == value
    return value


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 * 4096 + 7), offset=st.integers(0, 7), seed=st.integers(0, 2**31))
def test_cpu_path_matches_the_naive_reference(n, offset, seed):
    data = cpu_bytes(n, seed, offset)
    assert cpu_path(data) == checksum_naive(data) == checksum_torch(data)


@settings(max_examples=8, deadline=None)
@given(blocks=st.integers(0, 3), delta=st.integers(-9, 9), offset=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_cpu_path_matches_the_naive_reference_across_blocks(blocks, delta, offset, seed):
    data = cpu_bytes(max(0, blocks * BLOCK_BYTES + delta), seed, offset)
    assert cpu_path(data) == checksum_naive(data)


@pytest.mark.parametrize("n", [BLOCK_BYTES + d for d in (-5, -4, -3, -1, 0, 1, 3, 4, 5)]
                         + [2 * BLOCK_BYTES + d for d in (-4, -1, 0, 1, 4)], ids=lambda n: f"{n}B")
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cpu_path_at_block_boundaries(n, offset):
    data = cpu_bytes(n, n, offset)
    assert cpu_path(data) == checksum_naive(data)


def test_cpu_path_empty_and_unaligned_empty():
    buf = cpu_bytes(16, 0)
    for offset in range(4):
        assert cpu_path(buf[offset:offset]) == checksum_naive(b"") == checksum_torch(buf[offset:offset])


def test_cpu_path_extreme_words_wrap_mod_2_64():
    """All-ones words (and every 32-bit extreme) exercise the wrapping multiplies and the wrapping sum."""
    for fill in (0x00, 0xFF):
        data = torch.full((BLOCK_BYTES + 6,), fill, dtype=torch.uint8)
        assert cpu_path(data) == checksum_naive(data)
    pattern = torch.tensor([0, 0, 0, 0x80, 0xFF, 0xFF, 0xFF, 0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 1, 0, 0, 0], dtype=torch.uint8)
    data = pattern.repeat(4099)
    assert cpu_path(data) == checksum_naive(data)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool,
                                   torch.complex64, torch.int8])
def test_cpu_path_any_dtype_and_offset_views_are_their_bytes(dtype):
    base = cpu_bytes(3 * 4096 * 8, 9).view(dtype)
    for view in (base, base[3:], base.view(-1, 8)[5:17], base[1:-1]):
        raw = view.reshape(-1).view(torch.uint8).clone()
        assert cpu_path(view) == checksum_naive(raw)


def test_cpu_path_agrees_with_the_triton_kernel():
    """The host path and the Triton kernel (interpreted on CPU, compiled on CUDA) on random buffers."""
    if TRITON != "triton":
        pytest.skip("no Triton kernel here: neither CUDA nor TRITON_INTERPRET=1")
    block = kernel.BLOCK_WORDS if DEVICE.type == "cuda" else kernel.BLOCK_WORDS_INTERPRETED
    rng = random.Random(0)
    for seed, n in enumerate([0, 3, 4, 4 * block - 1, 4 * block, 4 * block + 5, BLOCK_BYTES + 1,
                              *(rng.randrange(1, 3 * BLOCK_BYTES) for _ in range(4))]):
        offset = seed % 4
        host = cpu_bytes(n, seed, offset)
        kernel_input = host if DEVICE.type == "cpu" else host.to(DEVICE)
        assert checksum(kernel_input, backend="triton") == cpu_path(host), (n, offset)


def test_cpu_path_is_thread_safe():
    """Offload and SSD threads checksum at once: per-thread work buffers, no crosstalk."""
    bufs = [cpu_bytes(n, i, i % 4) for i, n in enumerate([BLOCK_BYTES * 2 + 3, 5000, BLOCK_BYTES - 1, 1 << 20,
                                                           BLOCK_BYTES * 3, 17, 0, BLOCK_BYTES + 4])]
    want = [checksum_torch(b) for b in bufs]
    with ThreadPoolExecutor(max_workers=6) as pool:
        for _ in range(3):
            assert list(pool.map(checksum, bufs * 3)) == want * 3


def test_cpu_path_allocates_nothing_proportional_to_its_input():
    data = cpu_bytes(8 << 20, 1, 1)  # unaligned, 32 blocks
    checksum(data)  # this thread's work buffers now exist
    tracemalloc.start()
    try:
        checksum(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, peak
