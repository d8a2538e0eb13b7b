"""The checksum's definition, shared by every implementation: its constants, the splitmix64
finalizer on a Python int, and the last step (tail word and length). The formula is in
:mod:`saria.kernels.checksum`; :mod:`.naive` writes it out in full."""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MAX_BYTES = 1 << 34  # word indices must fit in 32 bits for the single-change guarantee


def mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int (the scalar twin of the kernel's mix)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def finish(total: int, n_words: int, tail: bytes, n_bytes: int) -> int:
    """The checksum from the sum of the whole words' terms: add the zero-padded tail word's term
    (if any), then mix in the length."""
    if tail:
        total = (total + mix64((n_words << 32) ^ int.from_bytes(tail.ljust(4, b"\0"), "little"))) & MASK64
    return mix64(total ^ mix64(n_bytes))
