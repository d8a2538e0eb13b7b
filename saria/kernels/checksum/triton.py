"""The Triton kernel of ``checksum`` and its launcher.

The kernel reduces on the device: a grid of at most ``PROGRAMS_PER_SM`` programs per SM, each
looping over every ``P``-th block of ``BLOCK`` words and summing ``mix(x_i)`` into uint64
registers, then adding its sum into one zeroed int64 with a single atomic add (addition modulo
2**64 is order independent, so the value does not depend on the schedule). The program next in line
after the last whole block also takes the partial block and the 1-3 tail bytes, so the host reads
one int64 back: one ``.item()``, the one synchronizing op of saria's kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import variants
from ..backend import INTERPRETED
from ..checks import check_in_range, check_power_of_two
from .formula import MASK64, finish, mix64

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


@triton.jit
def _mix(idx, b_w):
    """mix((idx << 32) ^ w) for uint32 word indices ``idx`` and int32 words ``b_w``, in uint64."""
    z = (idx.to(tl.uint64) << 32) | b_w.to(tl.uint32, bitcast=True).to(tl.uint64)
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


# The sizes are not specialized, nor the alignment of the tail bytes' and the sum's pointers; the
# words' alignment is (16-byte loads when it allows): two variants, both warmed at start (warm).
@triton.jit(do_not_specialize=["n_words", "n_bytes"], do_not_specialize_on_alignment=["p_bytes", "p_sum"])
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


def launch_checksum(data: torch.Tensor, out: torch.Tensor, *, block: int | None = None,
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
        check_power_of_two(block, "block", least=4)
        programs = cfg.programs if programs is None else programs
        check_in_range(programs, "programs", 1, 2**31 - 1)
        num_warps = cfg.num_warps if num_warps is None else num_warps
        cfg = ChecksumConfig(block, programs, num_warps)
    words = data[:n_words * 4].view(torch.int32)
    variants.launch(_checksum_kernel, (cfg.programs,), (words, n_words, data, n, out), dict(BLOCK=cfg.block),
                    cfg.num_warps)
    return cfg


def warm(device: torch.device) -> list[tuple]:
    """Compile (record, under the interpreter) the checksum's variants on ``device``: data
    16-byte aligned, and only 4-byte aligned (a part at any word of a staging). Returns their keys."""
    cfg = checksum_config(1 << 20, device)
    data = torch.zeros(64, dtype=torch.uint8, device=device)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    keys = []
    for start in (0, 4):
        view = data[start:start + 32]
        keys.append(variants.warm(_checksum_kernel, device, (view.view(torch.int32), 8, view, 32, out),
                                  dict(BLOCK=cfg.block), cfg.num_warps))
    return keys


def checksum_triton(data: torch.Tensor, **overrides) -> int:
    """The kernel's checksum of flat uint8 ``data``: one launch, one int64 read back."""
    n = data.numel()
    if n == 0:
        return finish(0, 0, b"", 0)
    out = torch.zeros(1, dtype=torch.int64, device=data.device)
    launch_checksum(data, out, **overrides)
    # .item(): one D2H copy and one sync. A pinned buffer and a stream sync measured the same on the
    # H200 (63 us incl. sync for 72 MiB either way), so the simpler path stays.
    return mix64((out.item() & MASK64) ^ mix64(n))
