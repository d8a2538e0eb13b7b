"""The host paths of ``checksum``: a blocked numpy path for CPU tensors (what ``auto`` and
``torch`` run on the CPU) and a torch path for tensors on any device (``backend="torch"`` on CUDA).

The numpy path mixes the words ``CPU_BLOCK_WORDS`` at a time in place, in two uint64 work buffers
per thread that stay in cache, so a call allocates nothing proportional to its input. Both take
the flat uint8 bytes that :func:`~saria.kernels.checks.check_checksum_input` returns (the public
op passes them) and give the kernel's value; the tests hold them against :mod:`.naive`.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .formula import GOLDEN, MASK64, MIX1, MIX2, finish

# Words the CPU path mixes per step: its two uint64 work buffers are 2 x 512 KiB, inside a 1-2 MiB L2.
CPU_BLOCK_WORDS = 1 << 16

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


def checksum_cpu(data: torch.Tensor) -> int:
    """Blocked host checksum of flat uint8 CPU ``data`` (any alignment: numpy reads unaligned words)."""
    n = data.numel()
    n_words = n // 4
    total = 0
    if n_words:
        total = _sum_mixed_words_cpu(data[:n_words * 4].numpy().view(_LE_U32))
    tail = bytes(data[n_words * 4:].tolist()) if n % 4 else b""
    return finish(total, n_words, tail, n)


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


def checksum_torch(data: torch.Tensor) -> int:
    """The checksum of flat uint8 ``data`` on any device, in torch ops (the kernel's value)."""
    words, n_words, tail = _words_and_tail(data)
    total = 0
    if n_words:
        w = words.to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(n_words, dtype=torch.int64, device=w.device)
        total = _sum_mod64(_mix64_torch((idx << 32) ^ w))
    return finish(total, n_words, tail, data.numel())
