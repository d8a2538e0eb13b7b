"""``checksum``: a 64-bit, position-keyed checksum of staging bytes, computed on the device.

The bytes are read as little-endian 4-byte words ``w_i`` (a short tail is zero-padded into one
last word). Each word and its index form a 64-bit value ``x_i = (i << 32) ^ w_i`` that the
splitmix64 finalizer ``mix`` scrambles; the checksum is::

    h = mix( (sum_i mix(x_i) mod 2**64) ^ mix(num_bytes) )

``mix`` is a bijection, so changing any single word changes exactly one term and always changes
the sum (for buffers under 16 GiB, where ``(i, w_i)`` is unique). Swapping two different words or
zeroing a page changes several terms; the sum then stays equal with probability about 2**-64.
Including the length catches truncation and zero-extension. It is a corruption check, not a MAC.
The value is part of saria's SSD format: every implementation gives the same one.

* :mod:`.api`: the public op (checks, implementation choice);
* :mod:`.triton`: the Triton kernel, a device reduction, and its launch rule (CUDA tensors, or any
  with ``backend="triton"`` under the interpreter);
* :mod:`.cpu`: the blocked numpy path (CPU tensors, ``auto`` and ``torch``) and the torch path
  (``backend="torch"`` on CUDA);
* :mod:`.formula`: the constants, the scalar ``mix64`` and the last step, shared by all of them;
* :mod:`.naive`: the naive reference, the formula in plain Python: the tests' oracle.
"""

from .api import checksum
from .cpu import checksum_cpu, checksum_torch
from .formula import MASK64, mix64
from .naive import checksum_naive

__all__ = ["MASK64", "checksum", "checksum_cpu", "checksum_naive", "checksum_torch", "mix64"]
