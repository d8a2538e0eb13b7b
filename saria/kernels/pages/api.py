"""``pack_pages`` / ``unpack_pages`` / ``drop_leading_pages``: the public ops. Each checks its
arguments (:mod:`saria.kernels.checks`), picks the backend, and calls the Triton launcher
(:mod:`.triton`) or the torch path (:mod:`.cpu`)."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ..backend import resolve_copy_backend
from ..block_ids import BlockIds
from ..checks import check_block_ids, check_drop_leading_pages, check_staging, check_unpack_target
from ..page_table import PageTable
from .cpu import pack_pages_torch, unpack_pages_torch
from .triton import launch

# Check once, launch many: the stagings each table accepted, by everything check_staging read of
# them (a hit skips it; anything changed is a miss and is checked again). Bounded per table.
_STAGINGS: "weakref.WeakKeyDictionary[PageTable, dict]" = weakref.WeakKeyDictionary()
_STAGINGS_PER_TABLE = 32


def _check_staging(staging, table: PageTable, chunks: int, per_chunk: int, what: str) -> None:
    """:func:`~saria.kernels.checks.check_staging`, skipped for a plain tensor that passed it for
    this table and geometry with the same address, storage size, offset, shape, strides, dtype,
    device and flags (what the check reads; the table itself is immutable and verified by the
    caller). A tensor subclass, or anything whose key cannot be read, is checked every time."""
    if type(staging) is not torch.Tensor:
        check_staging(staging, table, chunks, per_chunk, what)
        return
    try:
        key = (staging.data_ptr(), staging.untyped_storage().nbytes(), staging.storage_offset(), staging.shape,
               staging.stride(), staging.dtype, staging.device, staging.layout, staging.is_nested, staging.is_neg(),
               staging.is_conj(), chunks, per_chunk)
    except (RuntimeError, NotImplementedError):  # nested, fake, freed: the full check says what is wrong
        check_staging(staging, table, chunks, per_chunk, what)
        return
    seen = _STAGINGS.get(table)
    if seen is not None and key in seen:
        return
    check_staging(staging, table, chunks, per_chunk, what)
    if seen is None:
        seen = _STAGINGS[table] = {}
    elif len(seen) >= _STAGINGS_PER_TABLE:
        seen.clear()
    seen[key] = None


def pack_pages(caches: PageTable | Sequence[torch.Tensor], block_ids: torch.Tensor | BlockIds,
               out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Gather pages ``block_ids`` of every tensor in ``caches`` into contiguous uint8 staging.

    ``caches``: a sequence of paged tensors (dim 0 indexes pages, each page contiguous; see
    :mod:`saria.kernels.page_table`) or a prebuilt :class:`PageTable`. ``block_ids``: 1-D integer
    ids, or 2-D ``[chunks, pages_per_chunk]`` for a batch of chunks (returned as
    ``[chunks, bytes_per_chunk]``, each row one chunk), or the :class:`BlockIds` that
    :func:`~saria.kernels.check_block_ids` returned for them (then not checked again). ``out``:
    optional contiguous uint8 tensor of exactly the right size on the caches' device, 1-D or
    ``[chunks, bytes_per_chunk]``, sharing no memory with the caches. Returns the staging tensor,
    laid out tensor after tensor, pages in ``block_ids`` order (:mod:`saria.kernels.pages`). Never
    synchronizes when ``block_ids`` are on the CPU. Everything is checked before anything is
    copied: a stale table raises ``StaleTableError``, bad ids ``IndexError`` or ``ValueError``, bad
    staging ``ValueError``. The table is verified on every call; a staging that passed its checks
    for this table is not checked again until anything about it changes (check once, launch many).
    ``backend``: ``auto``, ``triton``, ``torch``, or ``null`` (benchmarks: everything is checked
    and nothing copied, :func:`~saria.kernels.backend.null_copies`).
    """
    table = PageTable.of(caches)
    blocks = check_block_ids(table, block_ids)
    chunks, per_chunk = blocks.chunks, blocks.per_chunk
    size = table.staging_bytes(chunks * per_chunk)
    shape = (size,) if blocks.dim() == 1 else (chunks, table.staging_bytes(per_chunk))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=table.device)
    else:
        _check_staging(out, table, chunks, per_chunk, "out")
    which, move = resolve_copy_backend(backend, table.device)
    if not move:
        return out
    if which == "triton":
        launch(table, blocks.on(table.device), out, per_chunk, pack=True)
    elif size:
        pack_pages_torch(table, blocks.on(table.device), out, chunks, per_chunk)
    return out


def unpack_pages(staging: torch.Tensor, caches: PageTable | Sequence[torch.Tensor],
                 block_ids: torch.Tensor | BlockIds, *, backend: str = "auto") -> None:
    """Scatter ``staging`` (as produced by :func:`pack_pages` for the same ids) back into the pages
    ``block_ids`` of every tensor in ``caches``, in place. The exact inverse of ``pack_pages``.

    Duplicate ids and tables whose tensors share page bytes are refused: the writes would race.
    So is a ``staging`` sharing memory with any page of the table. ``block_ids`` may be a
    :class:`BlockIds` (checked once, by :func:`~saria.kernels.check_block_ids`): then only its
    bound and, if not checked yet, duplicates are. Errors as for :func:`pack_pages`.
    """
    table = PageTable.of(caches)
    check_unpack_target(table)
    blocks = check_block_ids(table, block_ids, unique=True)
    _check_staging(staging, table, blocks.chunks, blocks.per_chunk, "staging")
    which, move = resolve_copy_backend(backend, table.device)
    if not move:
        return
    if which == "triton":
        launch(table, blocks.on(table.device), staging, blocks.per_chunk, pack=False)
    elif staging.numel():
        unpack_pages_torch(table, blocks.on(table.device), staging, blocks.chunks, blocks.per_chunk)


def drop_leading_pages(staging: torch.Tensor, caches: PageTable | Sequence[torch.Tensor], pages_per_chunk: int,
                       skip: int) -> torch.Tensor:
    """One chunk's staging without its first ``skip`` pages in every tensor: the staging that
    :func:`unpack_pages` expects for the chunk's remaining ``pages_per_chunk - skip`` ids (a copy).
    Used when the engine already holds the start of a chunk and must not have it overwritten.
    ``staging``: one chunk (1-D, or ``[1, bytes]``); ``pages_per_chunk``, ``skip``: integers."""
    table = PageTable.of(caches)
    flat, pages_per_chunk, skip = check_drop_leading_pages(staging, pages_per_chunk, skip)
    check_staging(flat, table, 1, pages_per_chunk, "staging")
    if skip == 0:
        return flat
    return torch.cat([flat[off * pages_per_chunk + skip * seg.page_bytes:(off + seg.page_bytes) * pages_per_chunk]
                      for off, seg in zip(table.tensor_offsets, table.segments)])
