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

CPU tensors (``backend="auto"`` or ``"torch"``) take a blocked numpy path instead: the words are
mixed ``CPU_BLOCK_WORDS`` at a time in place, in two uint64 work buffers per thread that stay in
cache, so a call allocates nothing proportional to its input. Under ``TRITON_INTERPRET=1`` the
interpreted kernel is 20-30x slower than that path and gives the same value, so ``auto`` does not
pick it for CPU tensors; ``backend="triton"`` still runs it.
"""

from __future__ import annotations

import threading

import numpy as np
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
# Words the CPU path mixes per step: its two uint64 work buffers are 2 x 512 KiB, inside a 1-2 MiB L2.
CPU_BLOCK_WORDS = 1 << 16


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
    if data.data_ptr() % 4 or data.storage_offset() % 4:  # the offset too: an empty view's data_ptr is 0
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


_U64 = np.uint64
_LE_U32 = np.dtype("<u4")
# ((j << 32) + GOLDEN) mod 2**64 for the word at offset j of a block; read-only, shared by all threads.
_BLOCK_KEYS = np.arange(CPU_BLOCK_WORDS, dtype=_U64) << _U64(32)
np.add(_BLOCK_KEYS, _U64(GOLDEN), out=_BLOCK_KEYS)
_BLOCK_KEYS.flags.writeable = False
_work = threading.local()  # (z, t): uint64[CPU_BLOCK_WORDS] each, per thread (callers run concurrently)


def _work_buffers() -> tuple[np.ndarray, np.ndarray]:
    bufs = getattr(_work, "bufs", None)
    if bufs is None:
        bufs = _work.bufs = (np.empty(CPU_BLOCK_WORDS, dtype=_U64), np.empty(CPU_BLOCK_WORDS, dtype=_U64))
    return bufs


def _sum_mixed_words_cpu(words: np.ndarray) -> int:
    """``sum_i mix64((i << 32) ^ words[i]) mod 2**64`` for little-endian uint32 ``words``, in place.

    numpy uint64 array arithmetic wraps modulo 2**64 (as the kernel's uint64 does) and ``>>`` on
    uint64 is a logical shift, so this is the kernel's formula op for op. Since ``words[i] < 2**32``,
    ``(i << 32) ^ w == (i << 32) + w``, which lets the block's index keys be one shared array plus
    one scalar per block.
    """
    z_buf, t_buf = _work_buffers()
    s30, s27, s31, m1, m2 = _U64(30), _U64(27), _U64(31), _U64(MIX1), _U64(MIX2)
    total = 0
    n_words = words.shape[0]
    for start in range(0, n_words, CPU_BLOCK_WORDS):
        k = min(CPU_BLOCK_WORDS, n_words - start)
        z, t = z_buf[:k], t_buf[:k]
        np.add(_BLOCK_KEYS[:k], words[start:start + k], out=z)  # (j << 32) + GOLDEN + w
        if start:
            np.add(z, _U64((start << 32) & MASK64), out=z)
        np.right_shift(z, s30, out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, m1, out=z)
        np.right_shift(z, s27, out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, m2, out=z)
        np.right_shift(z, s31, out=t)
        np.bitwise_xor(z, t, out=z)
        total += int(np.add.reduce(z, dtype=_U64))
    return total & MASK64


def _checksum_cpu(data: torch.Tensor) -> int:
    """Blocked host checksum of flat uint8 CPU ``data`` (any alignment: numpy reads unaligned words)."""
    n = data.numel()
    n_words = n // 4
    total = 0
    if n_words:
        total = _sum_mixed_words_cpu(data[:n_words * 4].numpy().view(_LE_U32))
    tail = bytes(data[n_words * 4:].tolist()) if n % 4 else b""
    return _finish(total, n_words, tail, n)


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
    resolved = resolve_backend(backend, data.device)
    # CPU tensors: the blocked host path, also under the interpreter (module docstring); only an
    # explicit backend="triton" interprets the kernel there.
    if data.device.type == "cpu" and (resolved == "torch" or backend == "auto"):
        return _checksum_cpu(data)
    if resolved == "torch":
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
