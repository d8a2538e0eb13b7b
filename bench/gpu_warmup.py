#!/usr/bin/env python3
"""Warm-up for the GPU check (issue 42): the first CUDA context and every Triton kernel variant
saria launches on the hot path, compiled once before the steps that time anything (Triton keeps
them in its cache, so later steps and processes find them). Prints each group's first-call time,
which is what a first compile mid-serving would cost. CUDA only: without it, one line and exit 2.

    python bench/gpu_warmup.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def timed(what: str, fn) -> None:
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"warm-up {what}: {(time.perf_counter() - t0) * 1e3:.0f} ms")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_warmup: needs CUDA (no CUDA device here); nothing run", file=sys.stderr)
        return 2
    from saria.kernels import PageTable, checksum, pack_pages, prepare_scattered, unpack_pages

    device = torch.device("cuda")
    timed("CUDA context", lambda: torch.empty(1, device=device))
    caches = [torch.randn(96, 16, 2, 8, 128, device=device).to(torch.bfloat16) for _ in range(4)]
    table = PageTable(caches)
    ids = torch.arange(32)

    def pages():
        staging = pack_pages(table, ids)
        unpack_pages(staging, table, ids + 32)
        pack_pages(table, torch.arange(64).view(2, 32))  # two chunks: other ints, the same kernel
        checksum(staging)

    def scattered():
        pinned = torch.empty(2 * 32 * table.bytes_per_page, dtype=torch.uint8).pin_memory()
        offsets = (torch.arange(32, dtype=torch.int64) * caches[0][0].numel() * 2).view(1, -1)
        for pack, first in ((True, 0), (False, 64)):
            for programs in (None, 64):
                prepare_scattered(pinned, offsets, [caches[0]], torch.arange(first, first + 32), pack=pack,
                                  max_programs=programs).launch()

    def fp8():
        from saria.kernels import pack_pages_fp8, unpack_pages_fp8
        staging = pack_pages_fp8(table, ids)
        unpack_pages_fp8(staging, table, ids + 32)

    t0 = time.perf_counter()
    timed("pack/unpack/checksum (first compile)", pages)
    timed("pack/unpack/checksum (again)", pages)
    timed("scattered copies (first compile)", scattered)
    timed("scattered copies (again)", scattered)
    try:
        timed("fp8 pack/unpack (first compile)", fp8)
    except Exception as exc:  # an FP8 dtype this torch or GPU lacks: reported, not fatal
        print(f"warm-up fp8: skipped ({type(exc).__name__}: {exc})")
    print(f"gpu_warmup: done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
