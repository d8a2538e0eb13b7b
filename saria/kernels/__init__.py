"""Triton kernels that move paged KV blocks and GDN checkpoints between an engine's cache and
contiguous staging buffers, and checksum staging. Kernels know nothing about tiers.

One subpackage per op, each with the same parts side by side: ``api.py`` (the public op: checks
its arguments, picks the backend), ``triton.py`` (the ``@triton.jit`` kernel and its launcher),
``cpu.py`` (the fast path in torch / numpy ops: ``backend="torch"``, and what CPU tensors run
without Triton's interpreter) and ``naive.py`` (the naive reference, plain loops: the tests'
oracle). ``pages`` is pack / unpack (and ``prepare_scattered``: pages to and from given offsets
of a buffer), ``state`` GDN checkpoints (through the pages' kernel), ``checksum`` the staging
checksum, ``fp8`` the SSD tier's FP8 objects (quantized while packed).
Shared: ``checks`` (every argument check), ``block_ids`` (ids that passed the check, so they are
checked once), ``page_table`` (the table of paged tensors), ``backend`` (Triton or torch). docs/kernels.md has the map.
"""

from .backend import BACKENDS, INTERPRETED, default_backend, resolve_backend
from .block_ids import BlockIds
from .checks import check_block_ids, extent_bytes
from .checksum import checksum, checksum_naive, checksum_torch
from .fp8 import (dequantize_naive, dequantize_staging, fp8_staging_bytes, pack_pages_fp8, pack_pages_fp8_naive,
                  quantize_naive, quantize_staging, unpack_pages_fp8, unpack_pages_fp8_naive)
from .page_table import PageTable, Segment, StaleTableError
from .pages import (COPY_MAX_PROGRAMS, LayeredCopy, ScatteredCopy, default_max_programs, drop_leading_pages, pack_pages, pack_pages_naive, pack_pages_torch,
                    prepare_layered, prepare_scattered, scattered_copy_naive, unpack_pages, unpack_pages_naive, unpack_pages_torch)
from .warm import warm_kernels
from .state import pack_state, pack_state_naive, state_table, unpack_state, unpack_state_naive

__all__ = [
    "BACKENDS", "BlockIds", "COPY_MAX_PROGRAMS", "INTERPRETED", "LayeredCopy", "PageTable", "ScatteredCopy", "Segment", "StaleTableError",
    "check_block_ids", "checksum", "checksum_naive", "checksum_torch", "default_backend", "dequantize_naive",
    "dequantize_staging", "drop_leading_pages", "extent_bytes", "fp8_staging_bytes", "pack_pages", "pack_pages_fp8",
    "pack_pages_fp8_naive", "pack_pages_naive", "pack_pages_torch", "pack_state", "pack_state_naive",
    "default_max_programs", "prepare_layered", "prepare_scattered", "quantize_naive", "quantize_staging", "resolve_backend", "scattered_copy_naive",
    "state_table", "unpack_pages", "unpack_pages_fp8", "unpack_pages_fp8_naive", "unpack_pages_naive",
    "unpack_pages_torch", "unpack_state", "unpack_state_naive", "warm_kernels",
]
