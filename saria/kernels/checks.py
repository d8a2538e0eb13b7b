"""Every argument check of the kernel ops, in one place.

The ops (:mod:`~saria.kernels.pages`, :mod:`~saria.kernels.state`, :mod:`~saria.kernels.checksum`)
and :class:`~saria.kernels.PageTable` call these before anything is copied: the Triton kernels
dereference raw addresses, so input that slips past them can crash the process or write memory
that is not the caller's. Bad input raises ``ValueError`` (``IndexError`` for block ids out of
range), naming the offending argument and value.

The FP8 ops' own checks (dtype, whole groups, FP8 staging) are in :mod:`saria.kernels.fp8.checks`,
and the scattered copy's (its buffer, offsets and regions) in :mod:`saria.kernels.pages.scattered_checks`,
on top of these.

Block ids are checked once: :func:`check_block_ids` returns a :class:`BlockIds`, and handing that
to any op (or to :func:`check_block_ids` again) re-checks in O(1) only that it fits the table, so a
caller that validates early (the data plane, when an order arrives) does not pay for it twice.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, Sequence

import torch

from .block_ids import BlockIds


class PageTable(Protocol):
    """What these checks read of a :class:`saria.kernels.PageTable` (which checks its own tensors
    with :func:`check_caches`, :func:`check_paged_tensor` and :func:`check_one_device`, so this
    module does not import it)."""

    tensors: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    segments: tuple[Any, ...]
    device: torch.device
    num_pages: int
    bytes_per_page: int
    overlap: tuple[int, int] | None  # two tensors whose pages share memory, if any

    def staging_bytes(self, num_page_ids: int) -> int: ...

    def page_sharing(self, lo: int, hi: int) -> int | None: ...

# Triton launches programs per (page id, tensor, tile): tensors on grid axis 1, whose CUDA limit is
# 65,535; page ids on axis 0 (limit 2**31 - 1); tiles of a page on axis 2 (pages.triton.launch_config).
MAX_TENSORS = 65_535
MAX_PAGE_IDS = 2**31 - 1
# check_block_ids checks up to this many ids as a Python list, more with torch ops.
SMALL_ID_COUNT = 1024

ID_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint8, torch.uint16, torch.uint32, torch.uint64})


# --- memory --------------------------------------------------------------------------------------

def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (0 when empty): its size when
    contiguous, the conservative span of a strided view otherwise (torch strides are never
    negative)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def check_dense(t, what: str) -> None:
    """Refuse anything but a dense (strided, not nested) torch tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout)
        raise ValueError(f"{what} must be a dense tensor, got layout {kind}")


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


# --- page tables ---------------------------------------------------------------------------------

def check_caches(caches, names: Sequence[str] | None) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...]]:
    """The arguments of ``PageTable(caches, names=names)`` as tuples (default names ``caches[i]``);
    each tensor is checked by :func:`check_paged_tensor`, their devices by :func:`check_one_device`."""
    if isinstance(caches, torch.Tensor):
        raise ValueError(
            "caches must be a sequence of paged tensors, not a single tensor; "
            "pass [cache] for one tensor (or cache.unbind(0) for a legacy [2, NB, ...] K/V cache)")
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
    return caches, names


def check_paged_tensor(cache: torch.Tensor, what: str) -> None:
    """A tensor whose dim 0 indexes non-empty, contiguous, non-overlapping pages in live memory."""
    check_memory(cache, what)
    if cache.dim() == 0:
        raise ValueError(f"{what} is a scalar; dim 0 of a paged tensor must index pages")
    if cache.shape[0] == 0:
        raise ValueError(f"{what} has no pages (shape {tuple(cache.shape)})")
    if cache.numel() == 0:
        raise ValueError(f"{what} has empty pages (shape {tuple(cache.shape)})")
    if not cache[0].is_contiguous():
        raise ValueError(
            f"{what}: a page (cache[b], shape {tuple(cache.shape[1:])}, strides "
            f"{tuple(cache.stride()[1:])}) is not contiguous in memory; pass a view whose dim 0 indexes "
            "pages (e.g. the two halves of a [2, NB, ...] cache as two tensors)")
    page_bytes = cache[0].numel() * cache.element_size()
    page_stride = cache.stride(0) * cache.element_size()
    if cache.shape[0] > 1 and page_stride < page_bytes:
        raise ValueError(
            f"{what}: pages overlap (page stride {page_stride} B < page size {page_bytes} B); "
            "dim 0 must index pages")


def check_one_device(caches: Sequence[torch.Tensor]) -> None:
    devices = {cache.device for cache in caches}
    if len(devices) > 1:
        raise ValueError(f"caches are on several devices {sorted(map(str, devices))}: "
                         "all tensors of a table must be on one device")


def check_unpack_target(table: PageTable) -> None:
    """Refuse to unpack into a table whose tensors share page bytes: the writes would race."""
    if table.overlap is not None:
        a, b = table.overlap
        raise ValueError(f"{table.names[a]} and {table.names[b]} share memory: unpacking into them would overwrite "
                         "one tensor's pages with the other's")


# --- block ids -----------------------------------------------------------------------------------

def _out_of_range(table: PageTable, hi: int, given: str) -> IndexError:
    worst = min(range(len(table)), key=lambda t: table.segments[t].num_pages)
    pages = table.segments[worst].num_pages
    return IndexError(f"block id {hi}{given} is out of range: {table.names[worst]} has {pages} pages "
                      f"(ids 0 to {pages - 1})")


def _check_unique(host: torch.Tensor, values: list | None) -> None:
    if (len(set(values)) if values is not None else torch.unique(host).numel()) != host.numel():
        repeated, counts = torch.unique(host, return_counts=True)
        raise ValueError(f"block id {int(repeated[counts > 1][0])} appears more than once; unpacking it "
                         "twice would race on the same page")


_INT64 = torch.int64


def _given(dtype: torch.dtype) -> str:
    """How an error names the dtype ids came in (nothing for int64)."""
    return "" if dtype == torch.int64 else f" ({dtype})"


def check_block_ids(table: PageTable, block_ids: torch.Tensor | BlockIds, *, unique: bool = False) -> BlockIds:
    """Check page ids against ``table`` (and, with ``unique``, that none repeats: an unpack needs
    that) and return them as :class:`BlockIds`.

    ``block_ids`` is a tensor of any integer dtype (int8 to int64, uint8 to uint64), 1-D (the pages
    of one chunk, or any list of pages) or 2-D ``[chunks, pages_per_chunk]`` (a batch of chunks:
    each chunk's staging bytes contiguous), on the CPU or on the table's device, any strides. The
    result holds a copy made before checking, so the kernels see exactly the checked values whatever
    happens to ``block_ids`` afterwards. CPU ids are checked without touching the GPU; ids on the
    GPU are copied to the host to be checked, which synchronizes with the current stream (pass CPU
    ids on hot paths). Errors name the offending value and the dtype it came in.

    ``block_ids`` already a :class:`BlockIds` (from an earlier call): only ``end`` is compared with
    this table, and duplicates are looked for if ``unique`` and they were not yet.
    """
    if (type(block_ids) is torch.Tensor and block_ids.dtype is _INT64 and block_ids.is_cpu
            and block_ids.layout == torch.strided and not block_ids.is_nested and block_ids.dim() == 1
            and 0 < (count := block_ids.numel()) <= SMALL_ID_COUNT and block_ids.is_contiguous()):
        # The hot path's ids (one chunk, int64 on the CPU): the same checks on a private copy, in
        # fewer steps. Ids that fail them go on to the general path below, which names the error.
        host = block_ids.clone()
        values = host.tolist()
        ordered = sorted(values)  # faster than min() and max() of a list of ints (a typed compare)
        hi = ordered[-1]
        if ordered[0] >= 0 and hi < table.num_pages and (not unique or len(set(values)) == count):
            return BlockIds._new(host, hi + 1, unique, count)
    if isinstance(block_ids, BlockIds):
        if block_ids.numel() > MAX_PAGE_IDS:
            raise ValueError(f"{block_ids.numel()} page ids in one call; one launch covers at most {MAX_PAGE_IDS}")
        if block_ids.end > table.num_pages:
            raise _out_of_range(table, block_ids.end - 1, "")
        if unique and not block_ids.unique:
            host = block_ids._host.reshape(-1)
            _check_unique(host, host.tolist() if host.numel() <= SMALL_ID_COUNT else None)
            return BlockIds._new(block_ids._host, block_ids.end, True)
        return block_ids
    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids must be a torch.Tensor of integers, got {type(block_ids).__name__} "
                         "(wrap a list or array with torch.tensor(..., dtype=torch.int64))")
    check_dense(block_ids, "block_ids")
    dtype = block_ids.dtype
    if dtype not in ID_DTYPES:
        raise ValueError(f"block_ids must have an integer dtype, got {dtype}")
    dim = block_ids.dim()
    if dim not in (1, 2):
        raise ValueError(
            f"block_ids must be 1-D (pages) or 2-D [chunks, pages_per_chunk], got shape {tuple(block_ids.shape)}")
    if not block_ids.is_cpu and block_ids.device != table.device:
        raise ValueError(f"block_ids are on {block_ids.device} but the caches on {table.device}; "
                         "pass them on the CPU or on the caches' device")
    count = block_ids.numel()
    if count > MAX_PAGE_IDS:
        raise ValueError(f"{count} page ids in one call; one launch covers at most {MAX_PAGE_IDS}")
    # The checked copy: contiguous int64 on the host, owned here (uint64 ids >= 2**63 wrap to
    # negative values, told apart below by the dtype). Plain contiguous int64 CPU ids (the hot
    # path's) are cloned: one op instead of an allocation and a copy.
    if dtype is _INT64 and type(block_ids) is torch.Tensor and block_ids.is_cpu and block_ids.is_contiguous():
        host = block_ids.clone()
    else:
        host = torch.empty(block_ids.shape, dtype=torch.int64)
        host.copy_(block_ids)
    flat = host if dim == 1 else host.view(-1)
    end = 0
    if count:
        # A few ids (a chunk or a batch of them) are checked as a Python list: three torch ops on a
        # tiny tensor cost more host time than the copy they guard (measured on the H200 host).
        values = flat.tolist() if count <= SMALL_ID_COUNT else None
        if values is not None:
            ordered = sorted(values)  # faster than min() and max() of a list of ints (a typed compare)
            lo, hi = ordered[0], ordered[-1]
        else:
            lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 and dtype == torch.uint64:
            hi = int(flat[flat < 0].max()) + (1 << 64)
        elif lo < 0:
            raise IndexError(f"block id {lo}{_given(dtype)} is negative")
        if hi >= table.num_pages:
            raise _out_of_range(table, hi, _given(dtype))
        if unique:
            _check_unique(flat, values)
        end = hi + 1
    return BlockIds._new(host, end, unique)


# --- staging -------------------------------------------------------------------------------------

def check_staging(staging: torch.Tensor, table: PageTable, chunks: int, per_chunk: int, what: str) -> None:
    """Validate a staging tensor for ``chunks x per_chunk`` page ids of ``table``: contiguous uint8
    on the caches' device, exactly the bytes needed, 1-D or ``[chunks, bytes per chunk]``, backed by
    live memory, and sharing no byte with any page of the table (a staging buffer inside a cache
    would be overwritten by the copy it feeds, or would overwrite the cache)."""
    check_dense(staging, what)
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


def check_drop_leading_pages(staging, pages_per_chunk, skip) -> tuple[torch.Tensor, int, int]:
    """The arguments of ``drop_leading_pages`` as (flat staging, pages_per_chunk, skip): integer
    counts with ``0 <= skip < pages_per_chunk``, and one chunk's staging (1-D, or ``[1, bytes]``);
    :func:`check_staging` checks the staging against the table."""
    pages_per_chunk, skip = check_count(pages_per_chunk, "pages_per_chunk"), check_count(skip, "skip")
    if not 0 <= skip < pages_per_chunk:
        raise ValueError(f"skip must be in [0, pages_per_chunk) = [0, {pages_per_chunk}), got {skip}")
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
    if staging.dim() != 1 and not (staging.dim() == 2 and staging.shape[0] == 1):
        raise ValueError(f"staging has shape {tuple(staging.shape)}: drop_leading_pages takes one chunk's "
                         "staging (1-D or [1, bytes]); pass one row at a time")
    return staging.reshape(-1), pages_per_chunk, skip


def check_count(value, name: str) -> int:
    """``value`` as an int (ints and integer scalars; not bools, floats or strings)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


# --- checksum input ------------------------------------------------------------------------------

def check_checksum_input(staging: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """``staging``'s bytes as a flat uint8 view, after checking they are real memory in order
    (contiguous, CPU or CUDA, live) and at most ``max_bytes``."""
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"checksum needs a torch.Tensor, got {type(staging).__name__}")
    if staging.layout != torch.strided or staging.is_nested or not staging.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor (its bytes are checksummed in memory order)")
    if staging.device.type not in ("cpu", "cuda"):
        raise ValueError(f"checksum supports CUDA and CPU tensors, not {staging.device}")
    check_memory(staging, "the tensor to checksum")
    data = staging.detach().reshape(-1)
    data = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    if data.numel() > max_bytes:
        raise ValueError(f"checksum covers at most {max_bytes} bytes per call, got {data.numel()}")
    return data


# --- GDN state -----------------------------------------------------------------------------------

TEMPORAL_DTYPES = (torch.float32, torch.bfloat16)


def _layers(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    try:
        return list(x)
    except TypeError:
        raise ValueError(f"{name} must be a tensor or a sequence of tensors (one per GDN layer), "
                         f"got {type(x).__name__}") from None


def check_state_tensors(temporal, conv) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """saria-format GDN state, one tensor (or a sequence of them) per layer: temporal
    ``[slots, HV, V, K]`` fp32 or bf16, conv ``[slots, conv_len, conv_dim]`` float, as many of each,
    all with the same number of slots. Returns them as two lists."""
    temporal, conv = _layers(temporal, "temporal"), _layers(conv, "conv")
    if not temporal:
        raise ValueError("no GDN layers: temporal and conv must hold one tensor per layer")
    if len(temporal) != len(conv):
        raise ValueError(f"{len(temporal)} temporal state tensors but {len(conv)} conv state tensors: "
                         "pass one of each per GDN layer")
    slots = None
    for l, (t, c) in enumerate(zip(temporal, conv)):
        for name, x, dims in (("temporal", t, 4), ("conv", c, 3)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name}[{l}] is a {type(x).__name__}, not a torch.Tensor")
            if x.dim() != dims:
                layout = "[slots, HV, V, K]" if dims == 4 else "[slots, conv_len, conv_dim]"
                raise ValueError(f"{name}[{l}] must be {layout}, got shape {tuple(x.shape)}")
            if slots is None:
                slots = x.shape[0]
            elif x.shape[0] != slots:
                raise ValueError(f"{name}[{l}] has {x.shape[0]} slots, other state tensors {slots}")
        if t.dtype not in TEMPORAL_DTYPES:
            raise ValueError(f"temporal[{l}] has dtype {t.dtype}; GDN temporal state is float32 or bfloat16")
        if not c.dtype.is_floating_point:
            raise ValueError(f"conv[{l}] has dtype {c.dtype}; GDN conv state is a float tensor")
    return temporal, conv


# --- launch overrides (benchmark sweeps, tests) --------------------------------------------------

def check_power_of_two(value: int, name: str, *, least: int = 1, most: int | None = None, why: str = "") -> None:
    if value < least or (most is not None and value > most) or value & (value - 1):
        bound = f" >= {least}" if most is None else f" from {least} to {most}"
        raise ValueError(f"{name} must be a power of two{bound}{why}, got {value}")


def check_in_range(value: int, name: str, lo: int, hi: int, why: str = "") -> None:
    """``lo <= value <= hi``."""
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{why}, got {value}")


def check_choice(value, name: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
