"""checksum: the documented formula, both backends agree, and the corruptions it must catch."""

from __future__ import annotations

import importlib
import struct

import pytest
import torch

from kernel_cases import DEVICE, random_bytes, vllm_layers
from saria.kernels import checksum, checksum_reference, pack_pages, resolve_backend
from saria.kernels.checksum import MASK64, mix64

checksum_module = importlib.import_module("saria.kernels.checksum")  # saria.kernels.checksum is the function

TRITON = resolve_backend("auto", DEVICE)
BACKENDS = sorted({TRITON, "torch"})


def formula(data: bytes) -> int:
    """The module docstring's definition, written out in plain Python."""
    n_words, rem = divmod(len(data), 4)
    words = list(struct.unpack(f"<{n_words}I", data[:n_words * 4]))
    if rem:
        words.append(int.from_bytes(data[n_words * 4:].ljust(4, b"\0"), "little"))
    total = sum(mix64((i << 32) ^ w) for i, w in enumerate(words)) & MASK64
    return mix64(total ^ mix64(len(data)))


def test_mix64_is_splitmix64():
    # splitmix64 with state 0: first output 0xe220a8397b1dcdaf (Vigna's reference implementation).
    assert mix64(0) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 64, 1023, 16384 + 7], ids=lambda n: f"{n}B")
def test_matches_formula(backend, n):
    data = random_bytes((n,), torch.uint8, n)
    assert checksum(data, backend=backend) == formula(bytes(data.cpu().tolist()))


def test_backends_agree_on_multi_program_buffer():
    block = checksum_module.WORDS_PER_PROGRAM if DEVICE.type == "cuda" else checksum_module.WORDS_PER_PROGRAM_INTERPRETED
    data = random_bytes((3 * block * 4 + 12,), torch.uint8, 1)  # several kernel programs
    assert checksum(data, backend=TRITON) == checksum_reference(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_bytes_equal_checksum_any_dtype(backend):
    data = random_bytes((4096,), torch.uint8, 2)
    assert checksum(data, backend=backend) == checksum(data.clone(), backend=backend)
    assert checksum(data.view(torch.float16).view(32, 64), backend=backend) == checksum(data, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unaligned_start(backend):
    buf = random_bytes((1001,), torch.uint8, 3)
    assert checksum(buf[1:], backend=backend) == formula(bytes(buf[1:].cpu().tolist()))


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
