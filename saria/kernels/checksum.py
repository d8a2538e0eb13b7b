"""``checksum``: a 64-bit, position-keyed checksum of staging bytes, computed on the device.

The bytes are read as little-endian 4-byte words ``w_i`` (a short tail is zero-padded into one
last word). Each word and its index form a 64-bit value ``x_i = (i << 32) ^ w_i`` that the
splitmix64 finalizer ``mix`` scrambles; the checksum is::

    h = mix( (sum_i mix(x_i) mod 2**64) ^ mix(num_bytes) )

``mix`` is a bijection, so changing any single word changes exactly one term and always changes
the sum (for buffers under 16 GiB, where ``(i, w_i)`` is unique). Swapping two different words or
zeroing a page changes several terms; the sum then stays equal with probability about 2**-64.
Including the length catches truncation and zero-extension. It is a corruption check, not a MAC.

The Triton kernel sums one block of words per program into an int64 partial; the host adds the
partials (the result is a Python int, so this is the one synchronizing op of this package).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import launch_guard, resolve_backend
from .page_table import check_memory

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MAX_BYTES = 1 << 34  # word indices must fit in 32 bits for the single-change guarantee

# Words one program reads: 4096 x 4 B = 16 KiB, so a 72 MiB Qwen3-8B chunk is 4,608 programs.
WORDS_PER_PROGRAM = 4096
# The interpreter pays per program and per op, not per byte: far fewer, larger programs on CPU.
WORDS_PER_PROGRAM_INTERPRETED = 1 << 16


def mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int (the scalar twin of the kernel's mix)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


@triton.jit
def _checksum_kernel(p_words, n_words, p_partials, WORDS: tl.constexpr):
    i_p = tl.program_id(0).to(tl.int64)
    o_w = i_p * WORDS + tl.arange(0, WORDS)
    mask = o_w < n_words
    b_w = tl.load(p_words + o_w, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    z = (o_w.to(tl.uint64) << 32) ^ b_w
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    z = tl.where(mask, z, tl.zeros_like(z))
    tl.store(p_partials + i_p, tl.sum(z, axis=0).to(tl.int64, bitcast=True))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix64_torch(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps modulo 2**64, which is what the uint64 formula needs.
    z = x + _signed(GOLDEN)
    z = (z ^ _srl(z, 30)) * _signed(MIX1)
    z = (z ^ _srl(z, 27)) * _signed(MIX2)
    return z ^ _srl(z, 31)


def _sum_mod64(x: torch.Tensor) -> int:
    """Exact sum of int64 bit patterns modulo 2**64 (no reliance on overflow in a reduction)."""
    lo = int((x & 0xFFFFFFFF).sum())
    hi = int(_srl(x, 32).sum())
    return (lo + (hi << 32)) & MASK64


def _words_and_tail(data: torch.Tensor) -> tuple[torch.Tensor, int, bytes]:
    """Split uint8 ``data`` into whole int32 words and the tail bytes (at most 3)."""
    n = data.numel()
    n_words = n // 4
    tail = bytes(data[n_words * 4:].cpu().tolist()) if n % 4 else b""
    if data.data_ptr() % 4:
        data = data.clone()  # word loads need 4-byte alignment; a fresh allocation has it
    return data[:n_words * 4].view(torch.int32), n_words, tail


def _finish(total: int, n_words: int, tail: bytes, n_bytes: int) -> int:
    if tail:
        total = (total + mix64((n_words << 32) ^ int.from_bytes(tail.ljust(4, b"\0"), "little"))) & MASK64
    return mix64(total ^ mix64(n_bytes))


def _as_bytes(staging: torch.Tensor) -> torch.Tensor:
    """``staging``'s bytes as a flat uint8 view, after checking they are real memory in order."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"checksum needs a torch.Tensor, got {type(staging).__name__}")
    if staging.layout != torch.strided or staging.is_nested or not staging.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor (its bytes are checksummed in memory order)")
    if staging.device.type not in ("cpu", "cuda"):
        raise ValueError(f"checksum supports CUDA and CPU tensors, not {staging.device}")
    check_memory(staging, "the tensor to checksum")
    data = staging.detach().reshape(-1)
    data = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    if data.numel() > MAX_BYTES:
        raise ValueError(f"checksum covers at most {MAX_BYTES} bytes per call, got {data.numel()}")
    return data


def checksum_reference(staging: torch.Tensor) -> int:
    """Pure-torch checksum (same value as the kernel)."""
    data = _as_bytes(staging)
    words, n_words, tail = _words_and_tail(data)
    total = 0
    if n_words:
        w = words.to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(n_words, dtype=torch.int64, device=w.device)
        total = _sum_mod64(_mix64_torch((idx << 32) ^ w))
    return _finish(total, n_words, tail, data.numel())


def checksum(staging: torch.Tensor, *, backend: str = "auto") -> int:
    """64-bit checksum of the bytes of a contiguous tensor (module docstring)."""
    data = _as_bytes(staging)
    if resolve_backend(backend, data.device) == "torch":
        return checksum_reference(data)
    words, n_words, tail = _words_and_tail(data)
    total = 0
    if n_words:
        block = WORDS_PER_PROGRAM if data.device.type == "cuda" else WORDS_PER_PROGRAM_INTERPRETED
        programs = triton.cdiv(n_words, block)
        partials = torch.empty(programs, dtype=torch.int64, device=data.device)
        with launch_guard():
            _checksum_kernel[(programs,)](words, n_words, partials, WORDS=block, num_warps=4)
        total = sum(partials.tolist()) & MASK64
    return _finish(total, n_words, tail, data.numel())
