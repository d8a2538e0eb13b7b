"""The naive reference of ``pack_pages`` / ``unpack_pages``: the documented staging layout as
plain loops, one page at a time. The tests' oracle; too slow for anything else.

It reads the layout off the tensors themselves, not off a :class:`~saria.kernels.PageTable`, and
checks nothing: give it valid input. For each chunk (a row of 2-D ids; 1-D ids are one chunk),
for each tensor, for each id of the chunk, the bytes of that page::

    staging[c] = cat_t( cat_j( bytes of caches[t][block_ids[c][j]] ) )
"""

from __future__ import annotations

from typing import Sequence

import torch


def _page(cache: torch.Tensor, block: int) -> torch.Tensor:
    """Page ``block`` of ``cache`` as a writable uint8 view of its bytes."""
    return cache.detach()[block:block + 1].reshape(-1).view(torch.uint8)


def _rows(block_ids) -> list[list[int]]:
    """The ids chunk by chunk (1-D ids are one chunk)."""
    ids = torch.as_tensor(block_ids)
    return [ids.tolist()] if ids.dim() == 1 else ids.tolist()


def pack_pages_naive(caches: Sequence[torch.Tensor], block_ids) -> torch.Tensor:
    """The staging bytes of ``block_ids`` (1-D: one chunk, returned 1-D; 2-D: one row per chunk)."""
    rows = _rows(block_ids)
    per_chunk = torch.as_tensor(block_ids).shape[-1]
    chunk_bytes = sum(_page(cache, 0).numel() for cache in caches) * per_chunk
    out = torch.empty(len(rows), chunk_bytes, dtype=torch.uint8, device=caches[0].device)
    for c, row in enumerate(rows):
        at = 0
        for cache in caches:
            for block in row:
                page = _page(cache, block)
                out[c, at:at + page.numel()] = page
                at += page.numel()
    return out[0] if torch.as_tensor(block_ids).dim() == 1 else out


def unpack_pages_naive(staging: torch.Tensor, caches: Sequence[torch.Tensor], block_ids) -> None:
    """Write ``staging`` (as :func:`pack_pages_naive` lays it out) into the pages ``block_ids``."""
    flat = staging.reshape(-1)
    at = 0
    for row in _rows(block_ids):
        for cache in caches:
            for block in row:
                page = _page(cache, block)
                page.copy_(flat[at:at + page.numel()])
                at += page.numel()


def scattered_copy_naive(buffer: torch.Tensor, offsets, caches: Sequence[torch.Tensor], block_ids, *,
                         pack: bool) -> None:
    """What :func:`~saria.kernels.prepare_scattered` launches, one page at a time: page ``i`` of
    tensor ``t`` is ``buffer[offsets[t][i] : offsets[t][i] + its bytes]``; ``pack=True`` copies the
    pages into the buffer, ``pack=False`` the buffer into the pages."""
    rows = torch.as_tensor(offsets).tolist()
    ids = torch.as_tensor(block_ids).reshape(-1).tolist()
    for cache, row in zip(caches, rows):
        for block, at in zip(ids, row):
            page = _page(cache, block)
            if pack:
                buffer[at:at + page.numel()].copy_(page)
            else:
                page.copy_(buffer[at:at + page.numel()])
