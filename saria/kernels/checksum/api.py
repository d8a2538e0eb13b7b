"""``checksum``: the public op. Checks its argument (:mod:`saria.kernels.checks`) and picks the
implementation: the Triton kernel (:mod:`.triton`) for CUDA tensors, the blocked numpy path
(:mod:`.cpu`) for CPU tensors."""

from __future__ import annotations

import torch

from ..backend import resolve_backend
from ..checks import check_checksum_input
from .cpu import checksum_cpu, checksum_torch
from .formula import MAX_BYTES
from .triton import checksum_triton


def checksum(staging: torch.Tensor, *, backend: str = "auto") -> int:
    """64-bit checksum of the bytes of a contiguous tensor (:mod:`saria.kernels.checksum`)."""
    data = check_checksum_input(staging, MAX_BYTES)
    resolved = resolve_backend(backend, data.device)
    # CPU tensors: the blocked host path, also under the interpreter (the interpreted kernel is
    # 20-30x slower and gives the same value); only an explicit backend="triton" interprets it there.
    if data.device.type == "cpu" and (resolved == "torch" or backend == "auto"):
        return checksum_cpu(data)
    if resolved == "torch":
        return checksum_torch(data)
    return checksum_triton(data)
