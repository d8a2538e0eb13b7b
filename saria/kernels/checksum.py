"""``checksum``: a 64-bit, position-keyed checksum of staging bytes, computed on the device.

The bytes are read as little-endian 4-byte words ``w_i`` (a short tail is zero-padded into one
last word). Each word and its index form a 64-bit value ``x_i = (i << 32) ^ w_i`` that the
splitmix64 finalizer ``mix`` scrambles; the checksum is::

    h = mix( (sum_i mix(x_i) mod 2**64) ^ mix(num_bytes) )

``mix`` is a bijection, so changing any single word changes exactly one term and always changes
the sum (for buffers under 16 GiB, where ``(i, w_i)`` is unique). Swapping two different words or
zeroing a page changes several terms; the sum then stays equal with probability about 2**-64.
Including the length catches truncation and zero-extension. It is a corruption check, not a MAC.

The Triton kernel reduces on the device: a grid of at most ``PROGRAMS_PER_SM`` programs per SM,
each looping over every ``P``-th block of ``BLOCK`` words and summing ``mix(x_i)`` into uint64
registers, then adding its sum into one zeroed int64 with a single atomic add (addition modulo
2**64 is order independent, so the value does not depend on the schedule). The program next in line
after the last whole block also takes the partial block and the 1-3 tail bytes, so the host reads
one int64 back: one ``.item()``, the one synchronizing op of this package.

CPU tensors (``backend="auto"`` or ``"torch"``) take a blocked numpy path instead: the words are
mixed ``CPU_BLOCK_WORDS`` at a time in place, in two uint64 work buffers per thread that stay in
cache, so a call allocates nothing proportional to its input. Under ``TRITON_INTERPRET=1`` the
interpreted kernel is 20-30x slower than that path and gives the same value, so ``auto`` does not
pick it for CPU tensors; ``backend="triton"`` still runs it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .backend import INTERPRETED, launch_guard, resolve_backend
from .page_table import check_memory

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MAX_BYTES = 1 << 34  # word indices must fit in 32 bits for the single-change guarantee

# Device launch (checksum_config): words per block, warps, programs per SM. Chosen on one H200
# (132 SMs, torch 2.11, triton 3.6; bench_kernels.py --sweep-block, kernel alone, docs/kernels.md):
# of {1024 words / 4 warps, 2048 / 4, 2048 / 8, 4096 / 8} x {4, 8, 16 programs per SM, one program
# per block}, 2048 / 8 / 16 per SM (2,112 programs) was the best at 8 chunks of both tables (1.46 and
# 1.49x the D2D copy's rate: it reads each byte once) and for one hybrid chunk (1.31x), and 1.09x
# then 1.20x (two runs) for one 72 MiB Qwen3-8B chunk (33 us). One program per block was 10-30%
# slower than a few programs per SM looping over blocks. 40 registers; the loop body is ~27 SASS
# instructions per word (the 64-bit mix as 32-bit halves), so the kernel is close to issue-bound.
BLOCK_WORDS = 2048
NUM_WARPS = 8
PROGRAMS_PER_SM = 16
# The interpreter pays per program and per op, not per byte: one program, large blocks.
BLOCK_WORDS_INTERPRETED = 1 << 16
PROGRAMS_INTERPRETED = 1
# Words the CPU path mixes per step: its two uint64 work buffers are 2 x 512 KiB, inside a 1-2 MiB L2.
CPU_BLOCK_WORDS = 1 << 16


def mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int (the scalar twin of the kernel's mix)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


@triton.jit
def _mix(idx, b_w):
    """mix((idx << 32) ^ w) for uint32 word indices ``idx`` and int32 words ``b_w``, in uint64."""
    z = (idx.to(tl.uint64) << 32) | b_w.to(tl.uint32, bitcast=True).to(tl.uint64)
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["n_words", "n_bytes"])
def _checksum_kernel(p_words, n_words, p_bytes, n_bytes, p_sum, BLOCK: tl.constexpr):
    """Adds sum_i mix((i << 32) ^ w_i) over all words (and the zero-padded tail word) into *p_sum."""
    i_p = tl.program_id(0).to(tl.int64)
    n_p = tl.num_programs(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    n_words = n_words.to(tl.int64)
    n_full = n_words // BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    # Whole blocks: no masks. Word indices fit in 32 bits (MAX_BYTES): only addresses are 64-bit.
    for start in range(i_p * BLOCK, n_full * BLOCK, n_p * BLOCK):
        b_w = tl.load(p_words + start + o)
        acc += _mix((start + o).to(tl.uint32), b_w)
    total = tl.sum(acc, axis=0)
    if i_p == n_full % n_p:  # the program next in line: the partial block and the tail bytes
        last = n_full * BLOCK
        mask = o < n_words - last
        b_w = tl.load(p_words + last + o, mask=mask, other=0)
        z = _mix((last + o).to(tl.uint32), b_w)
        total += tl.sum(tl.where(mask, z, tl.zeros_like(z)), axis=0)
        o_t = tl.arange(0, 4)
        tail = n_words * 4
        mask_t = o_t < n_bytes - tail
        b_t = tl.load(p_bytes + tail + o_t, mask=mask_t, other=0).to(tl.uint32)
        w_t = tl.sum(b_t << (8 * o_t).to(tl.uint32), axis=0)  # little-endian, zero-padded
        z_t = _mix(n_words.to(tl.uint32), w_t.to(tl.int32, bitcast=True))
        if n_bytes > tail:
            total += z_t
    tl.atomic_add(p_sum, total.to(tl.int64, bitcast=True), sem="relaxed")  # read after the kernel ends


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


@dataclass(frozen=True)
class ChecksumConfig:
    """One device checksum launch: ``programs`` programs of ``num_warps`` warps, each summing
    every ``programs``-th block of ``block`` words."""

    block: int
    programs: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def checksum_config(n_words: int, device: torch.device, *, interpreted: bool = INTERPRETED) -> ChecksumConfig:
    """The launch rule: ``BLOCK_WORDS`` words per block, at most ``PROGRAMS_PER_SM`` programs per
    SM (fewer when there are fewer blocks), ``NUM_WARPS`` warps; under the interpreter one program
    of ``BLOCK_WORDS_INTERPRETED`` words per block."""
    if interpreted or device.type != "cuda":
        return ChecksumConfig(BLOCK_WORDS_INTERPRETED, PROGRAMS_INTERPRETED, NUM_WARPS)
    index = device.index if device.index is not None else torch.cuda.current_device()
    blocks = max(1, triton.cdiv(n_words, BLOCK_WORDS))
    return ChecksumConfig(BLOCK_WORDS, min(blocks, PROGRAMS_PER_SM * _sm_count(index)), NUM_WARPS)


def _launch_checksum(data: torch.Tensor, out: torch.Tensor, *, block: int | None = None,
                     programs: int | None = None, num_warps: int | None = None) -> ChecksumConfig:
    """Add the unfinished sum of flat uint8 ``data`` (non-empty) into ``out`` (int64 [1], zeroed by
    the caller). ``block`` / ``programs`` / ``num_warps`` override :func:`checksum_config`
    (benchmark sweeps, tests). Never synchronizes. Returns the configuration launched."""
    n = data.numel()
    if data.data_ptr() % 4 or data.storage_offset() % 4:  # the offset too: an empty view's data_ptr is 0
        data = data.clone()  # word loads need 4-byte alignment; a fresh allocation has it
    n_words = n // 4
    cfg = checksum_config(n_words, data.device)
    if block is not None or programs is not None or num_warps is not None:
        block = cfg.block if block is None else block
        if block < 4 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 4, got {block}")
        programs = cfg.programs if programs is None else programs
        if not 1 <= programs < 2**31:
            raise ValueError(f"programs must be in [1, 2**31), got {programs}")
        num_warps = cfg.num_warps if num_warps is None else num_warps
        cfg = ChecksumConfig(block, programs, num_warps)
    words = data[:n_words * 4].view(torch.int32)
    with launch_guard():
        _checksum_kernel[(cfg.programs,)](words, n_words, data, n, out, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return cfg


def _checksum_triton(data: torch.Tensor, **overrides) -> int:
    """The kernel's checksum of flat uint8 ``data``: one launch, one int64 read back."""
    n = data.numel()
    if n == 0:
        return _finish(0, 0, b"", 0)
    out = torch.zeros(1, dtype=torch.int64, device=data.device)
    _launch_checksum(data, out, **overrides)
    # .item(): one D2H copy and one sync. A pinned buffer and a stream sync measured the same on the
    # H200 (63 us incl. sync for 72 MiB either way), so the simpler path stays.
    return mix64((out.item() & MASK64) ^ mix64(n))


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
    return _checksum_triton(data)
