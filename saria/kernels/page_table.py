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

The geometry is validated once, when the table is built; the data plane builds one per engine and
reuses it. A hot-path call re-checks only that every tensor still is what the table was built from
(:meth:`PageTable.verify`, well under a microsecond per tensor) and validates its block ids and
staging. Bad input raises ``ValueError`` (``IndexError`` for block ids out of range), a stale table
:class:`StaleTableError` (a ``ValueError``), always before anything is copied.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

# Triton launches programs per (page id, tensor, tile): tensors on grid axis 1, whose CUDA limit is
# 65,535; page ids on axis 0 (limit 2**31 - 1); tiles of a page on axis 2 (see pages.launch_config).
MAX_TENSORS = 65_535
MAX_PAGE_IDS = 2**31 - 1
# check_block_ids checks up to this many ids as a Python list, more with torch ops.
SMALL_ID_COUNT = 1024

ID_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint8, torch.uint16, torch.uint32, torch.uint64})


class StaleTableError(ValueError):
    """A :class:`PageTable` whose tensors changed (re-pointed, resized, re-viewed) since it was built:
    the addresses it holds no longer describe them. Build a new table over the tensors as they are."""


@dataclass(frozen=True)
class Segment:
    """One paged tensor of a table, as the kernels see it."""

    base: int  # address of page 0
    page_stride: int  # bytes from one page to the next
    page_bytes: int  # bytes copied per page (may be < page_stride: padded pages)
    num_pages: int


def _fingerprint(t: torch.Tensor) -> tuple:
    """What a table's addresses were computed from: data pointer, storage size in bytes, storage
    offset, shape, strides, dtype, and (for a view) where its base's storage lives, which moves
    when the base is re-pointed while the view keeps the old memory. :meth:`PageTable.verify`
    inlines the same tuple for speed."""
    b = t._base
    return (t.data_ptr(), t.untyped_storage().nbytes(), t.storage_offset(), t.shape, t.stride(), t.dtype,
            None if b is None else b.untyped_storage().data_ptr())


class PageTable:
    """A validated, immutable table of paged tensors on one device.

    Holds references to the tensors and to their storages, so the memory its addresses point into
    stays allocated as long as the table lives, even if a tensor is re-pointed. A tensor re-pointed
    or re-shaped after the table was built (``set_``, ``resize_``, ``.data = ...``, in-place view
    ops, a resized storage, a re-pointed root base of a view: torch records only a view's root)
    makes the table stale: every op checks with :meth:`verify` before it copies anything and
    refuses a stale table with :class:`StaleTableError`. Attributes cannot be reassigned.
    """

    def __init__(self, caches: Sequence[torch.Tensor], *, names: Sequence[str] | None = None):
        """``caches``: the paged tensors. ``names``: what errors call each of them (default
        ``caches[i]``; :func:`~saria.kernels.state_table` passes ``conv[l]`` / ``temporal[l]``)."""
        if isinstance(caches, torch.Tensor):
            raise ValueError(
                "caches must be a sequence of paged tensors, not a single tensor; "
                "pass [cache] for one tensor (or cache.unbind(0) for a legacy [2, NB, ...] K/V cache)")
        if isinstance(caches, PageTable):
            raise ValueError("caches is already a PageTable: use it as is (PageTable.of), or PageTable(table.tensors) "
                             "for a new table over its tensors as they are now")
        try:
            caches = tuple(caches)
        except TypeError:
            raise ValueError(f"caches must be a sequence of paged tensors, got {type(caches).__name__}") from None
        if not caches:
            raise ValueError("caches is empty: a page table needs at least one paged tensor")
        if len(caches) > MAX_TENSORS:
            raise ValueError(f"{len(caches)} tensors in one table; one launch covers at most {MAX_TENSORS}")
        names = tuple(f"caches[{i}]" for i in range(len(caches))) if names is None else tuple(names)
        if len(names) != len(caches):
            raise ValueError(f"{len(names)} names for {len(caches)} tensors")
        devices = set()
        segments = []
        for name, cache in zip(names, caches):
            segments.append(_segment(name, cache))
            devices.add(cache.device)
        if len(devices) > 1:
            raise ValueError(f"caches are on several devices {sorted(map(str, devices))}: "
                             "all tensors of a table must be on one device")
        set_ = object.__setattr__  # the table is immutable once built (__setattr__ below)
        set_(self, "tensors", caches)
        set_(self, "names", names)
        set_(self, "segments", tuple(segments))
        set_(self, "device", caches[0].device)
        # Pages are addressed by one id across all tensors: the id must exist in each of them.
        set_(self, "num_pages", min(s.num_pages for s in segments))
        # Bytes one page id contributes to staging, and where each tensor's region starts
        # within one chunk's staging bytes (multiply by pages per chunk).
        offsets, total = [], 0
        for s in segments:
            offsets.append(total)
            total += s.page_bytes
        set_(self, "tensor_offsets", tuple(offsets))
        set_(self, "bytes_per_page", total)
        set_(self, "overlap", _find_overlap(self.segments))
        set_(self, "_fingerprints", [_fingerprint(t) for t in caches])  # a list, as verify() builds
        set_(self, "_storages", tuple(t.untyped_storage() for t in caches))  # keeps the memory allocated
        # Address extents sorted by start, with the furthest end reached so far: page_sharing
        # looks only at the few extents that can reach a given range.
        order = sorted(range(len(segments)), key=lambda i: segments[i].base)
        reach, furthest = [], 0
        for i in order:
            s = segments[i]
            furthest = max(furthest, s.base + (s.num_pages - 1) * s.page_stride + s.page_bytes)
            reach.append(furthest)
        set_(self, "_by_start", (tuple(segments[i].base for i in order), tuple(order), tuple(reach)))
        set_(self, "_device_table", None)

    def __setattr__(self, name, value):
        raise AttributeError(f"PageTable is immutable (tried to set {name!r}): build a new table")

    def __delattr__(self, name):
        raise AttributeError(f"PageTable is immutable (tried to delete {name!r})")

    @classmethod
    def of(cls, caches: "PageTable | Sequence[torch.Tensor]") -> "PageTable":
        """``caches`` itself if it is already a table (after :meth:`verify`), else a new table over it."""
        if isinstance(caches, PageTable):
            caches.verify()
            return caches
        return cls(caches)

    def verify(self) -> None:
        """Raise :class:`StaleTableError` unless every tensor still has the data pointer, storage
        size, storage offset, shape, strides and dtype it had when the table was built (and a view's
        root base still lives where it did). Well under a microsecond per tensor; every op calls it."""
        live = [(t.data_ptr(), t.untyped_storage().nbytes(), t.storage_offset(), t.shape, t.stride(), t.dtype,
                 None if (b := t._base) is None else b.untyped_storage().data_ptr())
                for t in self.tensors]
        if live != self._fingerprints:
            raise StaleTableError(self._stale_message(live))

    def _stale_message(self, live: list) -> str:
        changed = [i for i, (old, new) in enumerate(zip(self._fingerprints, live)) if old != new]
        i = changed[0]
        (ptr, nbytes, offset, shape, stride, dtype, base), (ptr2, nbytes2, offset2, shape2, stride2, dtype2, base2) = (
            self._fingerprints[i], live[i])
        how = []
        if nbytes2 == 0:
            how.append(f"its storage was freed (now 0 bytes, was {nbytes})")
        elif ptr2 != ptr:
            how.append(f"it was re-pointed: data_ptr changed from {ptr:#x} to {ptr2:#x}")
            if nbytes2 != nbytes:
                how.append(f"it now lives in a storage of {nbytes2} bytes (was {nbytes})")
        elif nbytes2 != nbytes:
            how.append(f"its storage {'shrank' if nbytes2 < nbytes else 'grew'} from {nbytes} to {nbytes2} bytes")
        for what, old, new in (("storage offset", offset, offset2), ("shape", tuple(shape), tuple(shape2)),
                               ("strides", stride, stride2), ("dtype", dtype, dtype2)):
            if new != old:
                how.append(f"its {what} changed from {old} to {new}")
        if base2 != base:
            how.append(f"it is a view whose base tensor was re-pointed (the base's memory moved from "
                       f"{base or 0:#x} to {base2 or 0:#x}), so the view no longer shows the base's data")
            fix = "take the views again from the re-pointed base and build a new PageTable over them"
        elif nbytes2 == 0:
            fix = "the table cannot be used again; build a new PageTable over live tensors"
        else:
            fix = "build a new PageTable over the tensors as they are now (PageTable(table.tensors))"
        others = len(changed) - 1
        more = f" ({others} more tensor{'s' if others > 1 else ''} changed too)" if others else ""
        return (f"stale PageTable: {self.names[i]} changed since the table was built: {'; '.join(how)}{more}. "
                f"The table's addresses no longer describe it; {fix}")

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
        tensor's offset within one page id's staging bytes. A copy: the kernels read a private one,
        so nothing outside the table can change where they write."""
        return self._addresses().clone()

    def _addresses(self) -> torch.Tensor:
        """The device table the kernels read (built once, on first use). Not to be handed out."""
        if self._device_table is None:
            rows = [[s.base, s.page_stride, s.page_bytes, off]
                    for s, off in zip(self.segments, self.tensor_offsets)]
            table = torch.tensor(rows, dtype=torch.int64)
            object.__setattr__(self, "_device_table", table.to(self.device) if self.device.type != "cpu" else table)
        return self._device_table

    def byte_pages(self, t: int) -> torch.Tensor:
        """Tensor ``t`` seen as a ``[num_pages, page_bytes]`` uint8 view (no copy)."""
        cache = self.tensors[t]
        pages = cache.view(cache.shape[0], -1) if cache.dim() > 1 else cache.view(-1, 1)
        return pages.view(torch.uint8)

    def page_sharing(self, lo: int, hi: int) -> int | None:
        """The index of a tensor one of whose pages shares a byte with addresses ``[lo, hi)``, or None."""
        if hi <= lo:
            return None
        starts, order, reach = self._by_start
        k = bisect.bisect_left(starts, hi) - 1  # the extents starting before hi ...
        while k >= 0 and reach[k] > lo:  # ... while one of those up to k still ends after lo
            if _page_meets(self.segments[order[k]], lo, hi):
                return order[k]
            k -= 1
        return None


def _page_meets(s: Segment, lo: int, hi: int) -> bool:
    """Whether a page of ``s`` shares a byte with ``[lo, hi)``."""
    if hi <= s.base or lo >= s.base + (s.num_pages - 1) * s.page_stride + s.page_bytes:
        return False
    if s.num_pages == 1:
        return True
    # The first page that ends after lo; the pages before it end at or before lo, those after it
    # start later than it does.
    k = max(0, (lo - s.base - s.page_bytes) // s.page_stride + 1)
    return k < s.num_pages and s.base + k * s.page_stride < hi


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (0 when empty): its size when
    contiguous, the conservative span of a strided view otherwise (torch strides are never
    negative)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def check_memory(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose memory the kernels cannot address as the bytes of its values: sparse,
    nested, quantized, lazily conjugated or negated, not on CPU or CUDA, a ``__torch_dispatch__``
    subclass (fake and wrapper tensors), without memory, or extending past its storage (freed or
    shrunk with ``untyped_storage().resize_``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout)
        raise ValueError(f"{what} has layout {kind}; only dense (strided) tensors are addressable as bytes")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} is on {t.device}; saria supports CUDA and CPU tensors")
    if t.is_quantized:
        raise ValueError(f"{what} is quantized ({t.dtype}); saria copies plain tensors only")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{what} is a lazily {'conjugated' if t.is_conj() else 'negated'} view: its memory does "
                         "not hold its values; pass t.resolve_conj().resolve_neg()")
    if type(t) is not torch.Tensor and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise ValueError(f"{what} is a {type(t).__name__}, a tensor subclass that intercepts every op (a fake or "
                         "wrapper tensor): saria needs the memory of a plain tensor")
    if t.numel() == 0:
        return
    try:
        ptr, storage_bytes = t.data_ptr(), t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"{what} has no addressable memory ({exc})") from None
    if ptr == 0:
        raise ValueError(f"{what} has no memory (data_ptr is 0: a fake tensor, or its storage was freed)")
    need = t.storage_offset() * t.element_size() + extent_bytes(t)
    if need > storage_bytes:
        raise ValueError(f"{what} reaches {need} bytes into a storage of {storage_bytes} bytes: its memory was "
                         "freed or shrunk (untyped_storage().resize_)")


def _segment(what: str, cache: torch.Tensor) -> Segment:
    check_memory(cache, what)
    if cache.dim() == 0:
        raise ValueError(f"{what} is a scalar; dim 0 of a paged tensor must index pages")
    num_pages = cache.shape[0]
    if num_pages == 0:
        raise ValueError(f"{what} has no pages (shape {tuple(cache.shape)})")
    if cache.numel() == 0:
        raise ValueError(f"{what} has empty pages (shape {tuple(cache.shape)})")
    if not cache[0].is_contiguous():
        raise ValueError(
            f"{what}: a page (cache[b], shape {tuple(cache.shape[1:])}, strides "
            f"{tuple(cache.stride()[1:])}) is not contiguous in memory; pass a view whose dim 0 indexes "
            "pages (e.g. the two halves of a [2, NB, ...] cache as two tensors)")
    esize = cache.element_size()
    page_bytes = cache[0].numel() * esize
    page_stride = cache.stride(0) * esize
    if num_pages > 1 and page_stride < page_bytes:
        raise ValueError(
            f"{what}: pages overlap (page stride {page_stride} B < page size {page_bytes} B); "
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
    """Validate page ids against ``table``; return them as a contiguous int64 tensor on the table's
    device, plus (chunks, pages per chunk).

    ``block_ids`` is a tensor of any integer dtype (int8 to int64, uint8 to uint64), 1-D (the pages
    of one chunk, or any list of pages) or 2-D ``[chunks, pages_per_chunk]`` (a batch of chunks:
    each chunk's staging bytes contiguous), on the CPU or on the caches' device, any strides. The
    returned ids are a copy made before checking, so the kernels see exactly the checked values
    whatever happens to ``block_ids`` afterwards. CPU ids are checked without touching the GPU; ids
    on the GPU are copied to the host to be checked, which synchronizes with the current stream
    (pass CPU ids on hot paths). Errors name the offending value and the dtype it came in.
    """
    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids must be a torch.Tensor of integers, got {type(block_ids).__name__} "
                         "(wrap a list or array with torch.tensor(..., dtype=torch.int64))")
    if block_ids.layout != torch.strided or block_ids.is_nested:
        kind = "nested" if block_ids.is_nested else str(block_ids.layout)
        raise ValueError(f"block_ids must be a dense tensor, got layout {kind}")
    if block_ids.dtype not in ID_DTYPES:
        raise ValueError(f"block_ids must have an integer dtype, got {block_ids.dtype}")
    if block_ids.dim() not in (1, 2):
        raise ValueError(
            f"block_ids must be 1-D (pages) or 2-D [chunks, pages_per_chunk], got shape {tuple(block_ids.shape)}")
    if block_ids.device.type != "cpu" and block_ids.device != table.device:
        raise ValueError(f"block_ids are on {block_ids.device} but the caches on {table.device}; "
                         "pass them on the CPU or on the caches' device")
    chunks, per_chunk = (1, block_ids.shape[0]) if block_ids.dim() == 1 else tuple(block_ids.shape)
    if chunks * per_chunk > MAX_PAGE_IDS:
        raise ValueError(f"{chunks * per_chunk} page ids in one call; one launch covers at most {MAX_PAGE_IDS}")
    # The checked copy: contiguous int64 on the host, owned here (uint64 ids >= 2**63 wrap to
    # negative values, told apart below by the dtype).
    host = torch.empty(chunks * per_chunk, dtype=torch.int64)
    host.copy_(block_ids.reshape(-1))
    given = "" if block_ids.dtype == torch.int64 else f" ({block_ids.dtype})"
    if host.numel():
        # A few ids (a chunk or a batch of them) are checked as a Python list: three torch ops on a
        # tiny tensor cost more host time than the copy they guard (measured on the H200 host).
        values = host.tolist() if host.numel() <= SMALL_ID_COUNT else None
        lo, hi = (min(values), max(values)) if values is not None else (int(host.min()), int(host.max()))
        if lo < 0 and block_ids.dtype == torch.uint64:
            hi = int(host[host < 0].max()) + (1 << 64)
        elif lo < 0:
            raise IndexError(f"block id {lo}{given} is negative")
        if hi >= table.num_pages:
            worst = min(range(len(table)), key=lambda t: table.segments[t].num_pages)
            pages = table.segments[worst].num_pages
            raise IndexError(f"block id {hi}{given} is out of range: {table.names[worst]} has {pages} pages "
                             f"(ids 0 to {pages - 1})")
        if unique and (len(set(values)) if values is not None else torch.unique(host).numel()) != host.numel():
            values, counts = torch.unique(host, return_counts=True)
            raise ValueError(f"block id {int(values[counts > 1][0])} appears more than once; unpacking it "
                             "twice would race on the same page")
    if table.device.type == "cpu":
        return host, chunks, per_chunk
    # Through pinned memory: a copy from pageable memory makes CUDA synchronize the stream first, so
    # the host would wait for everything queued before (a reload's whole batch of H2D copies) before
    # it could launch the unpack and queue the next batch. torch's pinned allocator keeps the block
    # until the copy has run.
    return host.pin_memory().to(table.device, non_blocking=True), chunks, per_chunk


def check_staging(staging: torch.Tensor, table: PageTable, chunks: int, per_chunk: int, what: str) -> None:
    """Validate a staging tensor for ``chunks x per_chunk`` page ids of ``table``: contiguous uint8
    on the caches' device, exactly the bytes needed, 1-D or ``[chunks, bytes per chunk]``, backed by
    live memory, and sharing no byte with any page of the table (a staging buffer inside a cache
    would be overwritten by the copy it feeds, or would overwrite the cache)."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(staging).__name__}")
    if staging.layout != torch.strided or staging.is_nested:
        kind = "nested" if staging.is_nested else str(staging.layout)
        raise ValueError(f"{what} must be a dense tensor, got layout {kind}")
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
    rows = (chunks, table.staging_bytes(per_chunk))
    if staging.dim() != 1 and tuple(staging.shape) != rows:
        raise ValueError(f"{what} has shape {tuple(staging.shape)}: pass it 1-D, or {rows} "
                         "([chunks, bytes per chunk]) for these block_ids")
    if need:
        check_memory(staging, what)
        lo = staging.data_ptr()
        t = table.page_sharing(lo, lo + need)
        if t is not None:
            raise ValueError(f"{what} shares memory with the pages of {table.names[t]}: the copy would read and write "
                             "the same bytes; use a separate buffer")
