"""NVTX ranges around every data-plane operation, so Nsight Systems shows where reload time goes.

The names are a contract with ``profiling/`` (its README says what to look for under each). Ranges
are pushed only when CUDA is available; elsewhere :func:`nvtx_range` costs one attribute check.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

PACK = "saria.pack"  # pages -> GPU staging (kernel launch)
UNPACK = "saria.unpack"  # GPU staging -> pages (kernel launch)
COPY_H2D = "saria.copy.dram_to_gpu"  # one DRAM slice onto the DRAM stream
COPY_D2H = "saria.copy.gpu_to_dram"  # offload / promotion into host slots
SSD_READ = "saria.ssd.read"  # one part read (GDS or POSIX), on a reader thread
SSD_WRITE = "saria.ssd.write"  # one part written, on a writer thread
PACE_WAIT = "saria.pace.wait"  # a DRAM slice held back by the coordinator
VERIFY = "saria.verify"  # checksum of data read from SSD

ALL = (PACK, UNPACK, COPY_H2D, COPY_D2H, SSD_READ, SSD_WRITE, PACE_WAIT, VERIFY)

@functools.cache
def enabled() -> bool:
    return torch.cuda.is_available()


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range on the calling thread (a no-op without CUDA)."""
    if not enabled():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
