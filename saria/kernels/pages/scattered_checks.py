"""The argument checks of :func:`~saria.kernels.prepare_scattered` (pages to and from bytes at given
offsets of one buffer), on top of :mod:`saria.kernels.checks`: the buffer (its device, pinned memory
for CUDA pages, no byte shared with a page), the offsets table, and the regions it names (inside the
buffer and, when packing, disjoint). Each raises before anything is copied."""

from __future__ import annotations

from typing import Sequence

import torch

from ..checks import PageTable, check_dense, check_memory


def check_scattered_buffer(buffer, table: PageTable) -> None:
    """The buffer of :func:`~saria.kernels.prepare_scattered`: 1-D contiguous uint8 in live memory,
    on the caches' device or (caches on a GPU) pinned CPU memory, which the GPU addresses directly
    (unified virtual addressing); sharing no byte with any page of the table."""
    check_dense(buffer, "buffer")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a 1-D contiguous uint8 tensor, got {buffer.dtype} of shape "
                         f"{tuple(buffer.shape)}{'' if buffer.is_contiguous() else ', not contiguous'}")
    if buffer.device != table.device:
        if table.device.type == "cuda" and buffer.device.type == "cpu":
            if not buffer.is_pinned():
                raise ValueError(f"buffer is in pageable CPU memory but the caches on {table.device}: the GPU reads "
                                 "and writes a CPU buffer by address, which needs pinned memory (allocate it with "
                                 "pin_memory=True, or pass buffer.pin_memory())")
        else:
            raise ValueError(f"buffer is on {buffer.device} but the caches on {table.device}: pass it on the "
                             "caches' device" + (" or, for caches on a GPU, in pinned CPU memory"
                                                 if table.device.type == "cuda" else ""))
    check_memory(buffer, "buffer")
    if buffer.numel():
        lo = buffer.data_ptr()
        t = table.page_sharing(lo, lo + buffer.numel())
        if t is not None:
            raise ValueError(f"buffer shares memory with the pages of {table.names[t]}: the copy would read and write "
                             "the same bytes; use a separate buffer")


def check_offsets(offsets, tensors: int, pages: int) -> torch.Tensor:
    """``offsets`` of :func:`~saria.kernels.prepare_scattered`: int64 CPU ``[tensors, pages]``.
    Returns a private contiguous copy, so what is checked is what is used."""
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"offsets must be a torch.Tensor (int64, [tensors, pages]), got {type(offsets).__name__}")
    check_dense(offsets, "offsets")
    if offsets.dtype != torch.int64:
        raise ValueError(f"offsets must be int64, got {offsets.dtype}")
    if offsets.device.type != "cpu":
        raise ValueError(f"offsets must be on the CPU (they are checked there), got {offsets.device}")
    if tuple(offsets.shape) != (tensors, pages):
        raise ValueError(f"offsets has shape {tuple(offsets.shape)}; this table and block_ids need "
                         f"({tensors}, {pages}): one row per tensor of the table, one column per block id")
    host = torch.empty((tensors, pages), dtype=torch.int64)
    host.copy_(offsets)
    return host


def check_regions(offsets: torch.Tensor, page_bytes: Sequence[int], size: int, names: Sequence[str], *,
                  disjoint: bool) -> None:
    """Every region ``[offsets[t, i], offsets[t, i] + page_bytes[t])`` inside a buffer of ``size``
    bytes (``IndexError`` otherwise) and, with ``disjoint`` (the buffer is written), no two of them
    sharing a byte (``ValueError``: the writes would race). ``offsets`` as :func:`check_offsets`
    returns it."""
    if not offsets.numel():
        return
    sizes = torch.tensor(list(page_bytes), dtype=torch.int64).unsqueeze(1)
    bad = (offsets < 0) | (offsets > size - sizes)  # no overflow: size - sizes is small
    if bool(bad.any()):
        t, i = (int(x) for x in bad.nonzero()[0])
        off, n = int(offsets[t, i]), int(page_bytes[t])
        where = "is negative" if off < 0 else f"+ {n} bytes (a page of {names[t]}) ends past the buffer's {size} bytes"
        raise IndexError(f"offsets[{t}, {i}] = {off} {where}")
    if not disjoint or offsets.numel() < 2:
        return
    starts = offsets.reshape(-1)
    ends = (offsets + sizes).reshape(-1)
    order = torch.argsort(starts, stable=True)
    s, e = starts[order], ends[order]
    # Sorted by start, two regions overlap only if some region starts before its predecessor ends.
    clash = (s[1:] < e[:-1]).nonzero()
    if clash.numel():
        k = int(clash[0])
        (ta, ia), (tb, ib) = (divmod(int(order[j]), offsets.shape[1]) for j in (k, k + 1))
        raise ValueError(f"buffer regions overlap: offsets[{ta}, {ia}] = {int(s[k])} (+{page_bytes[ta]} bytes) and "
                         f"offsets[{tb}, {ib}] = {int(s[k + 1])} (+{page_bytes[tb]} bytes); packing would write the "
                         "same bytes twice")


def check_placements(where, offsets, buffers: Sequence[torch.Tensor], page_bytes: Sequence[int],
                     names: Sequence[str], pages: int, *, disjoint: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``where`` / ``offsets`` of :func:`~saria.kernels.prepare_layered`: int64 CPU ``[tensors,
    pages]`` each (``where`` may be ``None``: every page in ``buffers[0]``), every buffer index in
    range, every region ``[offsets[t, i], + page_bytes[t])`` inside its buffer (``IndexError``) and,
    with ``disjoint`` (the buffers are written), no two regions sharing a byte, whichever buffers
    they are in (``ValueError``). Returns private contiguous copies of both."""
    tensors = len(page_bytes)
    offs = check_offsets(offsets, tensors, pages)
    if where is None:
        where = torch.zeros((tensors, pages), dtype=torch.int64)
    else:
        if not isinstance(where, torch.Tensor):
            raise ValueError(f"where must be a torch.Tensor (int64, [tensors, pages]), got {type(where).__name__}")
        where = check_offsets(where, tensors, pages)
        if where.numel() and (bool((where < 0).any()) or bool((where >= len(buffers)).any())):
            t, i = (int(x) for x in ((where < 0) | (where >= len(buffers))).nonzero()[0])
            raise IndexError(f"where[{t}, {i}] = {int(where[t, i])} names no buffer (there are {len(buffers)})")
    if not offs.numel():
        return where, offs
    sizes = torch.tensor(list(page_bytes), dtype=torch.int64).unsqueeze(1)
    limits = torch.tensor([b.numel() for b in buffers], dtype=torch.int64)[where]
    bad = (offs < 0) | (offs > limits - sizes)
    if bool(bad.any()):
        t, i = (int(x) for x in bad.nonzero()[0])
        off, n, size = int(offs[t, i]), int(page_bytes[t]), int(limits[t, i])
        what = "is negative" if off < 0 else f"+ {n} bytes (a page of {names[t]}) ends past its buffer's {size} bytes"
        raise IndexError(f"offsets[{t}, {i}] = {off} {what}")
    if not disjoint or offs.numel() < 2:
        return where, offs
    # By address: two buffers may be views of one memory, so regions are compared where they lie.
    starts = (torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)[where] + offs).reshape(-1)
    ends = starts + sizes.expand_as(offs).reshape(-1)
    order = torch.argsort(starts, stable=True)
    s, e = starts[order], ends[order]
    clash = (s[1:] < e[:-1]).nonzero()
    if clash.numel():
        k = int(clash[0])
        (ta, ia), (tb, ib) = (divmod(int(order[j]), pages) for j in (k, k + 1))
        raise ValueError(f"buffer regions overlap: offsets[{ta}, {ia}] = {int(offs[ta, ia])} in buffer "
                         f"{int(where[ta, ia])} (+{page_bytes[ta]} bytes) and offsets[{tb}, {ib}] = {int(offs[tb, ib])} "
                         f"in buffer {int(where[tb, ib])} (+{page_bytes[tb]} bytes); packing would write the same "
                         "bytes twice")
    return where, offs
