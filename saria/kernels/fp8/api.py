"""``pack_pages_fp8`` / ``unpack_pages_fp8`` (pages <-> FP8 objects, one launch each),
``quantize_staging`` / ``dequantize_staging`` (the same encoding on packed bytes) and
``fp8_staging_bytes``: the public ops. Each checks its arguments (:mod:`saria.kernels.checks`,
:mod:`.checks`), picks the backend, and calls the Triton launcher (:mod:`.triton`) or the torch path
(:mod:`.cpu`)."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ...ssd_dtype import FP8_GROUP, fp8_bytes
from ..backend import resolve_backend
from ..block_ids import BlockIds
from ..checks import check_block_ids, check_unpack_target
from ..page_table import PageTable
from .checks import check_fp8_dtype, check_fp8_rows, check_fp8_table, check_skip
from .cpu import dequantize_rows, pack_pages_fp8_torch, quantize_rows, unpack_pages_fp8_torch
from .triton import launch


# A table's FP8 check, once per table (tables are immutable, and every op verifies them first).
_CHECKED: "weakref.WeakKeyDictionary[PageTable, torch.dtype]" = weakref.WeakKeyDictionary()


def _fp8_dtype(table: PageTable) -> torch.dtype:
    dtype = _CHECKED.get(table)
    if dtype is None:
        dtype = _CHECKED[table] = check_fp8_table(table, FP8_GROUP)
    return dtype


def fp8_staging_bytes(table: PageTable | Sequence[torch.Tensor], pages: int) -> int:
    """Bytes of the FP8 object of ``pages`` page ids of ``table`` (``saria.ssd_dtype.fp8_bytes`` of
    their packed bytes). ``ValueError`` for a table fp8 does not apply to (:func:`pack_pages_fp8`)."""
    table = PageTable.of(table)
    return fp8_bytes(table.staging_bytes(pages), _fp8_dtype(table).itemsize)


def _check_staging(staging: torch.Tensor, table: PageTable, chunks: int, per_chunk: int, what: str) -> None:
    """FP8 staging for ``chunks`` objects of ``per_chunk`` pages: contiguous uint8 on the caches'
    device, 1-D or ``[chunks, fp8 bytes per object]``, exactly that size, sharing no page's bytes."""
    row = fp8_staging_bytes(table, per_chunk)
    rows = check_fp8_rows(staging, what, table.device)
    if staging.numel() != chunks * row or (staging.dim() == 2 and tuple(staging.shape) != (chunks, row)):
        raise ValueError(f"{what} has shape {tuple(staging.shape)} but {chunks} FP8 object(s) of {per_chunk} pages of "
                         f"this table take {chunks} x {row} bytes (1-D, or [{chunks}, {row}])")
    if rows.numel():
        lo = staging.data_ptr()
        t = table.page_sharing(lo, lo + staging.numel())
        if t is not None:
            raise ValueError(f"{what} shares memory with the pages of {table.names[t]}: use a separate buffer")


def pack_pages_fp8(caches: PageTable | Sequence[torch.Tensor], block_ids: torch.Tensor | BlockIds,
                   out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """The FP8 form (saria/ssd_dtype.py) of what :func:`~saria.kernels.pack_pages` packs for the same
    arguments: each object (1-D ids: one; 2-D ``[chunks, pages_per_chunk]``: one a row) encoded on its
    own, its codes then its scales. Returns uint8, 1-D or ``[chunks, fp8 bytes per chunk]``
    (:func:`fp8_staging_bytes`). The Triton kernel quantizes while it gathers (one launch, no raw
    staging); the torch path packs then quantizes. Besides pack_pages' errors, ``ValueError`` for
    tensors of several dtypes, a dtype other than bf16 / fp16 / fp32, a page that is not a whole
    number of 128-element groups, and ``out`` of the wrong size, dtype or device.

    NaN and inf: a group holding a NaN stores the scale NaN, one holding an inf (and no NaN) the
    scale inf, both with codes 0, so the whole group decodes to NaN: the damage stays visible and
    confined to its 128 elements, never a finite wrong value."""
    table = PageTable.of(caches)
    _fp8_dtype(table)
    blocks = check_block_ids(table, block_ids)
    chunks, per_chunk = blocks.chunks, blocks.per_chunk
    row = fp8_staging_bytes(table, per_chunk)
    if out is None:
        out = torch.empty((row,) if blocks.dim() == 1 else (chunks, row), dtype=torch.uint8, device=table.device)
    else:
        _check_staging(out, table, chunks, per_chunk, "out")
    if resolve_backend(backend, table.device) == "triton":
        launch(table, blocks.on(table.device), out, per_chunk, pack=True)
    elif out.numel():
        pack_pages_fp8_torch(table, blocks.on(table.device), out, chunks, per_chunk)
    return out


def unpack_pages_fp8(staging: torch.Tensor, caches: PageTable | Sequence[torch.Tensor],
                     block_ids: torch.Tensor | BlockIds, *, skip: int = 0, backend: str = "auto") -> None:
    """Decode the FP8 objects in ``staging`` (as :func:`pack_pages_fp8` wrote them) into the pages
    ``block_ids`` of every tensor of ``caches``, in place: each element ``code * scale`` in float32,
    rounded to the cache dtype to nearest even (a NaN is written as the dtype's positive quiet NaN).

    ``skip`` (1-D ids only): ``staging`` is one whole object of ``pages_per_chunk = len(block_ids) +
    skip`` pages, whose first ``skip`` pages (in every tensor) are not written, and ``block_ids`` name
    the pages of the others. Refused as by :func:`~saria.kernels.unpack_pages` (duplicate ids, tensors
    or staging sharing page bytes, a stale table) and :func:`pack_pages_fp8`."""
    table = PageTable.of(caches)
    check_unpack_target(table)
    _fp8_dtype(table)
    blocks = check_block_ids(table, block_ids, unique=True)
    skip = check_skip(skip, blocks.dim(), blocks.per_chunk)
    chunks, per_chunk = blocks.chunks, blocks.per_chunk + skip
    _check_staging(staging, table, chunks, per_chunk, "staging")
    if resolve_backend(backend, table.device) == "triton":
        launch(table, blocks.on(table.device), staging, per_chunk, pack=False, skip=skip)
    elif blocks.numel():
        unpack_pages_fp8_torch(table, blocks.on(table.device), staging, chunks, per_chunk, skip)


def _result(out: torch.Tensor | None, given: torch.Tensor, rows: int, size: int, what: str) -> torch.Tensor:
    """``out`` checked to hold ``rows`` rows of ``size`` bytes shaped as ``given`` (1-D for one
    row), on its device; a new tensor when ``None``."""
    shape = (size,) if given.dim() == 1 else (rows, size)
    if out is None:
        return torch.empty(shape, dtype=torch.uint8, device=given.device)
    if tuple(check_fp8_rows(out, "out", given.device).shape) != (rows, size) or out.dim() != given.dim():
        raise ValueError(f"out has shape {tuple(out.shape)}; {what} {tuple(given.shape)} is {shape}")
    return out


def quantize_staging(raw: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 form of packed objects ``raw`` (uint8, 1-D: one object; 2-D: one a row) of ``dtype``
    elements (bf16, fp16 or fp32), in torch on the CPU or CUDA: byte for byte what
    :func:`pack_pages_fp8` writes for the pages ``raw`` was packed from. ``out``: optional
    contiguous uint8 of the result's shape on ``raw``'s device. Returns it."""
    dtype = check_fp8_dtype(dtype)
    rows = check_fp8_rows(raw, "raw")
    size = fp8_bytes(rows.shape[1], dtype.itemsize)
    out = _result(out, raw, rows.shape[0], size, "the FP8 form of raw")
    if out.numel():
        quantize_rows(rows, dtype, out.view(rows.shape[0], size))
    return out


def dequantize_staging(stored: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw bytes of FP8 objects ``stored`` (uint8, 1-D: one; 2-D: one a row) decoded to ``dtype``
    (bf16, fp16 or fp32): byte for byte what :func:`unpack_pages_fp8` writes into the pages. ``out``:
    optional contiguous uint8 of the result's shape on ``stored``'s device. Returns it."""
    dtype = check_fp8_dtype(dtype)
    rows = check_fp8_rows(stored, "stored")
    elements, rest = divmod(rows.shape[1] * FP8_GROUP, FP8_GROUP + 4)
    if rest or elements % FP8_GROUP:
        raise ValueError(f"stored rows of {rows.shape[1]} bytes are not FP8 objects: an object of n elements "
                         f"(n a multiple of {FP8_GROUP}) takes n + n / 32 bytes, a multiple of {FP8_GROUP + 4}")
    size = elements * dtype.itemsize
    out = _result(out, stored, rows.shape[0], size, "the decoded form of stored")
    if out.numel():
        dequantize_rows(rows, dtype, out.view(rows.shape[0], size))
    return out
