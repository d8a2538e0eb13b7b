"""The naive reference of ``checksum``: the formula of :mod:`saria.kernels.checksum` written out in
plain Python, one word at a time. The tests' oracle (about a microsecond a byte: small inputs only)."""

from __future__ import annotations

import struct

import torch

from .formula import MASK64, mix64


def checksum_naive(data: bytes | torch.Tensor) -> int:
    """The checksum of ``data``: bytes, or a tensor's bytes in memory order (it must be contiguous)."""
    if isinstance(data, torch.Tensor):
        data = bytes(data.detach().reshape(-1).view(torch.uint8).cpu().tolist())
    n_words, rem = divmod(len(data), 4)
    words = list(struct.unpack(f"<{n_words}I", data[:n_words * 4]))
    if rem:
        words.append(int.from_bytes(data[n_words * 4:].ljust(4, b"\0"), "little"))
    total = 0
    for i, w in enumerate(words):
        total = (total + mix64((i << 32) ^ w)) & MASK64
    return mix64(total ^ mix64(len(data)))
