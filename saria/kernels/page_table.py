"""The table of paged tensors that every pack/unpack call works on.

A paged tensor is any tensor whose dim 0 indexes pages and whose page ``t[b]`` is contiguous in
memory; pages may be any (non-overlapping) stride apart. The kernels see a page as bytes, so the
order inside a page (K/V interleaved per token, per head, MLA latents, a GDN page of conv then
temporal state) does not matter. Examples of valid tables:

* vLLM 0.32 per-layer views ``[num_blocks, ...]``: one tensor per layer;
* a legacy ``[2, NB, BS, H, D]`` cache: ``cache[0]`` and ``cache[1]`` (K and V) as two tensors;
* FlashInfer ``[NB, 2, BS, H, D]`` and MLA ``[NB, BS, D]``: one tensor each;
* a GDN layer's page viewed as int8 with a padded stride:
  ``raw.as_strided((NB, used_bytes), (page_stride, 1))``.

The geometry is validated once, when the table is built (the checks are in
:mod:`saria.kernels.checks`); the data plane builds one per engine and reuses it. A hot-path call
re-checks only that every tensor still is what the table was built from (:meth:`PageTable.verify`,
well under a microsecond per tensor) and validates its block ids and staging. Bad input raises
``ValueError``, a stale table :class:`StaleTableError` (a ``ValueError``), always before anything is
copied.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import check_caches, check_one_device, check_paged_tensor


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
    """Everything a table's addresses were computed from, for error messages: data pointer, storage
    size in bytes, storage offset, shape, strides, dtype, and (for a view) where its base's storage
    lives, which moves when the base is re-pointed while the view keeps the old memory.
    :meth:`PageTable.verify` checks the same facts more cheaply (see there)."""
    b = t._base
    return (t.data_ptr(), t.untyped_storage().nbytes(), t.storage_offset(), t.shape, t.stride(), t.dtype,
            None if b is None else b.untyped_storage().data_ptr())


# C-level getters, mapped over a table's tensors (no Python frame per tensor).
_storage_ptr = torch.UntypedStorage.data_ptr
_is_set_to = torch.Tensor.is_set_to
_untyped_storage = torch.Tensor.untyped_storage
_dtype_of = operator.attrgetter("dtype")


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
        if isinstance(caches, PageTable):
            raise ValueError("caches is already a PageTable: use it as is (PageTable.of), or PageTable(table.tensors) "
                             "for a new table over its tensors as they are now")
        caches, names = check_caches(caches, names)
        for name, cache in zip(names, caches):
            check_paged_tensor(cache, name)
        check_one_device(caches)
        segments = [_segment(cache) for cache in caches]
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
        set_(self, "_fingerprints", [_fingerprint(t) for t in caches])  # what error messages compare
        set_(self, "_storages", tuple(t.untyped_storage() for t in caches))  # keeps the memory allocated
        # What verify() compares (see there): the storages' addresses, a private alias of each tensor as it is
        # now (same storage, offset, sizes, strides) for Tensor.is_set_to, dtypes, and for the views
        # their root bases and the storage each base had.
        set_(self, "_ptrs", [s.data_ptr() for s in self._storages])
        set_(self, "_refs", tuple(t.detach() for t in caches))
        set_(self, "_dtypes", [t.dtype for t in caches])
        views = [(i, t._base) for i, t in enumerate(caches) if t._base is not None]
        set_(self, "_views", tuple(i for i, _ in views))
        set_(self, "_bases", tuple(b for _, b in views))
        set_(self, "_base_storages", [b.untyped_storage() for _, b in views])
        # A base already on another storage than its view's (re-pointed before the table was built):
        # its storage's address is compared as well, as the view's own pointer does not cover it.
        set_(self, "_loose_bases", tuple((s, s.data_ptr()) for (i, _), s in zip(views, self._base_storages)
                                         if s is not self._storages[i]))
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
        """Raise :class:`StaleTableError` unless every tensor still is what the table was built from:
        same data pointer, storage, storage offset, shape, strides and dtype, and, for a view, a root
        base still on the storage it had. About 0.3 us per tensor; every op calls it.

        Checked per tensor, each by one C call mapped over the table:

        * ``is_set_to(ref)``, ``ref`` a private alias taken when the table was built: the same
          storage object (not merely one at the same address), storage offset, sizes and strides
          (``set_``, ``resize_``, ``as_strided_``, ``unsqueeze_``, ``.data = ...``);
        * the address of that storage (the table holds it): it moves when the storage is resized
          or freed (``untyped_storage().resize_`` always allocates anew, even to the same size, and
          frees to address 0), so it also stands for the storage's size. With the same storage,
          offset and dtype, the tensor's own data pointer is then unchanged too;
        * ``dtype``: ``.data = t.view(other_dtype)`` changes it alone, in place;
        * a view's root base (fixed when the view is made: ``t._base`` never changes, and a tensor
          made without a base never gains one) must still be on the storage it had: ``base.set_``
          leaves the view on the old memory. A tensor that is not a view has nothing more to check.
        """
        ts = self.tensors
        if (list(map(_storage_ptr, self._storages)) != self._ptrs or not all(map(_is_set_to, ts, self._refs))
                or list(map(_dtype_of, ts)) != self._dtypes
                or (self._bases and not self._bases_in_place())):
            raise StaleTableError(self._stale_message([_fingerprint(t) for t in ts]))

    def _bases_in_place(self) -> bool:
        # Storages compare by identity (no __eq__): torch keeps one Python object per storage while
        # it lives (torch >= 2.1), and the table holds these.
        return (list(map(_untyped_storage, self._bases)) == self._base_storages
                and (not self._loose_bases or all(s.data_ptr() == p for s, p in self._loose_bases)))

    def verify_tensors(self, indices: Sequence[int]) -> None:
        """:meth:`verify` for the tensors ``indices`` only (a launch that reads only those)."""
        ts, storages, refs, ptrs, dtypes = self.tensors, self._storages, self._refs, self._ptrs, self._dtypes
        for i in indices:
            t = ts[i]
            if storages[i].data_ptr() != ptrs[i] or not t.is_set_to(refs[i]) or t.dtype != dtypes[i]:
                self.verify()  # raises, naming every tensor that changed
        if self._bases and not self._bases_in_place():
            self.verify()

    def _changed(self, i: int) -> bool:
        """Whether tensor ``i`` fails any check of :meth:`verify`."""
        t = self.tensors[i]
        if (self._storages[i].data_ptr() != self._ptrs[i] or not t.is_set_to(self._refs[i])
                or t.dtype != self._dtypes[i]):
            return True
        if i in self._views:
            k = self._views.index(i)
            s = self._base_storages[k]
            return self._bases[k].untyped_storage() is not s or any(
                s is s2 and s.data_ptr() != p for s2, p in self._loose_bases)
        return False

    def _stale_message(self, live: list) -> str:
        changed = [i for i, (old, new) in enumerate(zip(self._fingerprints, live)) if old != new or self._changed(i)]
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
        if not how:  # the same address, size and geometry, in another storage object
            how.append(f"it was re-pointed to another storage at the same address ({ptr2:#x})")
        others = len(changed) - 1
        more = f" ({others} more tensor{'s' if others > 1 else ''} changed too)" if others else ""
        return (f"stale PageTable: {self.names[i]} changed since the table was built: {'; '.join(how)}{more}. "
                f"The table's addresses no longer describe it; {fix}")

    def __len__(self) -> int:
        return len(self.segments)

    def __repr__(self) -> str:
        return (f"PageTable({len(self)} tensors, {self.num_pages} pages, "
                f"{self.bytes_per_page} bytes per page id, device={self.device})")

    @property
    def element_dtype(self) -> torch.dtype | None:
        """The dtype every tensor of the table has, or None when they differ (a hybrid table: FA
        pages in the cache dtype, GDN pages seen as int8). ``ssd_dtype=fp8`` needs one."""
        dtypes = {t.dtype for t in self.tensors}
        return dtypes.pop() if len(dtypes) == 1 else None

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


def _segment(cache: torch.Tensor) -> Segment:
    """The geometry of a paged tensor that :func:`~saria.kernels.checks.check_paged_tensor` accepted."""
    esize = cache.element_size()
    return Segment(base=cache.data_ptr(), page_stride=cache.stride(0) * esize, page_bytes=cache[0].numel() * esize,
                   num_pages=cache.shape[0])


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
