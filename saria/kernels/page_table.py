"""The table of paged tensors that every pack/unpack call works on, and its validation.

A paged tensor is any tensor whose dim 0 indexes pages and whose page ``t[b]`` is contiguous in
memory; pages may be any (non-overlapping) stride apart. The kernels see a page as bytes, so the
order inside a page (K/V interleaved per token, per head, MLA latents, a GDN page of conv then
temporal state) does not matter. Examples of valid tables:

* vLLM 0.32 per-layer views ``[num_blocks, ...]``: one tensor per layer;
* a legacy ``[2, NB, BS, H, D]`` cache: ``cache[0]`` and ``cache[1]`` (K and V) as two tensors;
* FlashInfer ``[NB, 2, BS, H, D]`` and MLA ``[NB, BS, D]``: one tensor each;
* a GDN layer's page viewed as int8 with a padded stride:
  ``raw.as_strided((NB, used_bytes), (page_stride, 1))``.

Validation happens once, when the table is built; the data plane builds one per engine and reuses
it, so a hot-path call only validates its block ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Segment:
    """One paged tensor of a table, as the kernels see it."""

    base: int  # address of page 0
    page_stride: int  # bytes from one page to the next
    page_bytes: int  # bytes copied per page (may be < page_stride: padded pages)
    num_pages: int


class PageTable:
    """A validated, immutable table of paged tensors on one device.

    Holds references to the tensors, so their memory (and the addresses in the table) stays valid
    as long as the table lives. Do not resize or re-allocate them while a table refers to them.
    """

    def __init__(self, caches: Sequence[torch.Tensor]):
        if isinstance(caches, torch.Tensor):
            raise ValueError(
                "caches must be a sequence of paged tensors, not a single tensor; "
                "pass [cache] for one tensor (or cache.unbind(0) for a legacy [2, NB, ...] K/V cache)")
        caches = tuple(caches)
        if not caches:
            raise ValueError("caches is empty: a page table needs at least one paged tensor")
        devices = set()
        segments = []
        for i, cache in enumerate(caches):
            segments.append(_segment(i, cache))
            devices.add(cache.device)
        if len(devices) > 1:
            raise ValueError(f"caches are on several devices {sorted(map(str, devices))}: "
                             "all tensors of a table must be on one device")
        self.tensors: tuple[torch.Tensor, ...] = caches
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.device: torch.device = caches[0].device
        # Pages are addressed by one id across all tensors: the id must exist in each of them.
        self.num_pages: int = min(s.num_pages for s in segments)
        # Bytes one page id contributes to staging, and where each tensor's region starts
        # within one chunk's staging bytes (multiply by pages per chunk).
        offsets, total = [], 0
        for s in segments:
            offsets.append(total)
            total += s.page_bytes
        self.tensor_offsets: tuple[int, ...] = tuple(offsets)
        self.bytes_per_page: int = total
        self.overlap: tuple[int, int] | None = _find_overlap(self.segments)
        self._device_table: torch.Tensor | None = None

    @classmethod
    def of(cls, caches: "PageTable | Sequence[torch.Tensor]") -> "PageTable":
        """``caches`` itself if it is already a table, else a new table over it."""
        return caches if isinstance(caches, PageTable) else cls(caches)

    def __len__(self) -> int:
        return len(self.segments)

    def __repr__(self) -> str:
        return (f"PageTable({len(self)} tensors, {self.num_pages} pages, "
                f"{self.bytes_per_page} bytes per page id, device={self.device})")

    def staging_bytes(self, num_page_ids: int) -> int:
        """Bytes of staging that ``num_page_ids`` page ids pack into."""
        return self.bytes_per_page * num_page_ids

    def device_table(self) -> torch.Tensor:
        """int64 ``[T, 4]`` on the table's device: base address, page stride, page bytes, and the
        tensor's offset within one page id's staging bytes. Built once, on first use."""
        if self._device_table is None:
            rows = [[s.base, s.page_stride, s.page_bytes, off]
                    for s, off in zip(self.segments, self.tensor_offsets)]
            table = torch.tensor(rows, dtype=torch.int64)
            self._device_table = table.to(self.device) if self.device.type != "cpu" else table
        return self._device_table

    def byte_pages(self, t: int) -> torch.Tensor:
        """Tensor ``t`` seen as a ``[num_pages, page_bytes]`` uint8 view (no copy)."""
        cache = self.tensors[t]
        pages = cache.view(cache.shape[0], -1) if cache.dim() > 1 else cache.view(-1, 1)
        return pages.view(torch.uint8)


def _segment(i: int, cache: torch.Tensor) -> Segment:
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"caches[{i}] is a {type(cache).__name__}, not a torch.Tensor")
    if cache.layout != torch.strided:
        raise ValueError(f"caches[{i}] has layout {cache.layout}; only dense (strided) tensors hold pages")
    if cache.device.type not in ("cpu", "cuda"):
        raise ValueError(f"caches[{i}] is on {cache.device}; saria supports CUDA and CPU tensors")
    if cache.dim() == 0:
        raise ValueError(f"caches[{i}] is a scalar; dim 0 of a paged tensor must index pages")
    num_pages = cache.shape[0]
    if num_pages == 0:
        raise ValueError(f"caches[{i}] has no pages (shape {tuple(cache.shape)})")
    if cache[0].numel() == 0:
        raise ValueError(f"caches[{i}] has empty pages (shape {tuple(cache.shape)})")
    if not cache[0].is_contiguous():
        raise ValueError(
            f"caches[{i}]: a page (cache[b], shape {tuple(cache.shape[1:])}, strides "
            f"{tuple(cache.stride()[1:])}) is not contiguous in memory; pass a view whose dim 0 indexes "
            "pages (e.g. the two halves of a [2, NB, ...] cache as two tensors)")
    esize = cache.element_size()
    page_bytes = cache[0].numel() * esize
    page_stride = cache.stride(0) * esize
    if num_pages > 1 and page_stride < page_bytes:
        raise ValueError(
            f"caches[{i}]: pages overlap (page stride {page_stride} B < page size {page_bytes} B); "
            "dim 0 must index pages")
    return Segment(base=cache.data_ptr(), page_stride=page_stride, page_bytes=page_bytes,
                   num_pages=num_pages)


def _find_overlap(segments: Sequence[Segment]) -> tuple[int, int] | None:
    """A pair of tensors whose pages may share bytes, or None.

    Tensors whose address extents are disjoint never overlap. Tensors interleaved with the same
    page stride (two views into one buffer) overlap only if their byte windows within a stride
    intersect. Other intersecting extents are reported as overlapping (conservative).
    """
    extents = sorted(
        (s.base, s.base + (s.num_pages - 1) * s.page_stride + s.page_bytes, i)
        for i, s in enumerate(segments))
    for a in range(len(extents)):
        lo_a, hi_a, i = extents[a]
        for b in range(a + 1, len(extents)):
            lo_b, _, j = extents[b]
            if lo_b >= hi_a:
                break
            if not _interleaved_disjoint(segments[i], segments[j]):
                return (min(i, j), max(i, j))
    return None


def _interleaved_disjoint(s: Segment, t: Segment) -> bool:
    stride = s.page_stride
    if stride != t.page_stride or stride == 0:
        return False
    a, b = s.base % stride, t.base % stride
    if b < a:
        a, b, s, t = b, a, t, s
    # Windows [a, a + s.bytes) and [b, b + t.bytes) on a circle of length `stride`.
    return a + s.page_bytes <= b and b + t.page_bytes <= a + stride


def check_block_ids(block_ids: torch.Tensor, table: PageTable, *, unique: bool) -> tuple[torch.Tensor, int, int]:
    """Validate page ids against ``table``; return them as int64 on the table's device, plus
    (chunks, pages per chunk).

    ``block_ids`` is 1-D (the pages of one chunk, or any list of pages) or 2-D
    ``[chunks, pages_per_chunk]`` (a batch of chunks: each chunk's staging bytes contiguous).
    CPU ids are checked without touching the GPU; ids on the GPU are copied to the host to be
    checked, which synchronizes with the current stream (pass CPU ids on hot paths).
    """
    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids must be a torch.Tensor of integers, got {type(block_ids).__name__}")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
        raise ValueError(f"block_ids must have an integer dtype, got {block_ids.dtype}")
    if block_ids.dim() not in (1, 2):
        raise ValueError(
            f"block_ids must be 1-D (pages) or 2-D [chunks, pages_per_chunk], got shape {tuple(block_ids.shape)}")
    if block_ids.device.type != "cpu" and block_ids.device != table.device:
        raise ValueError(f"block_ids are on {block_ids.device} but the caches on {table.device}; "
                         "pass them on the CPU or on the caches' device")
    chunks, per_chunk = (1, block_ids.shape[0]) if block_ids.dim() == 1 else tuple(block_ids.shape)
    flat = block_ids.reshape(-1)
    if flat.numel():
        host = flat.cpu().to(torch.int64)
        lo, hi = int(host.min()), int(host.max())
        if lo < 0:
            raise IndexError(f"block id {lo} is negative")
        if hi >= table.num_pages:
            worst = min(range(len(table)), key=lambda t: table.segments[t].num_pages)
            raise IndexError(f"block id {hi} is out of range: caches[{worst}] has "
                             f"{table.segments[worst].num_pages} pages")
        if unique and torch.unique(host).numel() != host.numel():
            values, counts = torch.unique(host, return_counts=True)
            raise ValueError(f"block id {int(values[counts > 1][0])} appears more than once; unpacking it "
                             "twice would race on the same page")
    ids = flat.to(device=table.device, dtype=torch.int64, non_blocking=True)
    return ids, chunks, per_chunk


def check_staging(staging: torch.Tensor, table: PageTable, chunks: int, per_chunk: int, what: str) -> None:
    """Validate a staging tensor for ``chunks x per_chunk`` page ids of ``table``."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(staging).__name__}")
    if staging.dtype != torch.uint8:
        raise ValueError(f"{what} must be a uint8 tensor, got {staging.dtype}")
    if staging.device != table.device:
        raise ValueError(f"{what} is on {staging.device} but the caches on {table.device}")
    if not staging.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    need = table.staging_bytes(chunks * per_chunk)
    if staging.numel() != need:
        raise ValueError(f"{what} holds {staging.numel()} bytes but {chunks * per_chunk} pages of this table "
                         f"need {need} ({table.bytes_per_page} bytes per page id)")
