"""``prepare_scattered``: copy pages between a :class:`~saria.kernels.PageTable` and bytes at given
offsets of one buffer, checked once and launched many times (:class:`ScatteredCopy`).

``pack_pages`` / ``unpack_pages`` move pages to and from one staging laid out chunk by chunk. Here
each page has its own place in a big buffer, given by the caller: ``offsets[t, i]`` is the byte
offset of page ``block_ids[i]`` of tensor ``t``::

    pack=False:  bytes of caches[t][block_ids[i]] = buffer[offsets[t, i] : offsets[t, i] + page_bytes(t)]
    pack=True:   buffer[offsets[t, i] : offsets[t, i] + page_bytes(t)] = bytes of caches[t][block_ids[i]]

(for example one layer's pages of many objects, each in its own slot of a pool). Everything is
checked once, by :func:`prepare_scattered`, which also precomputes what the copy needs: on the
Triton path one int64 array of (source, destination, bytes) per (tensor, page) on the device and a
compiled kernel; on the torch path the slices and index tensors. :meth:`ScatteredCopy.launch` then
re-checks only that the table and the buffer are what they were (well under a microsecond a tensor)
and launches one kernel (or runs the torch copies).

With caches on a GPU the buffer may be pinned CPU memory: the kernel reads and writes it by address
through unified virtual addressing (zero-copy, over the bus), so one launch covers every page.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from ..backend import launch_guard, resolve_copy_backend
from ..block_ids import BlockIds
from ..checks import MAX_PAGE_IDS, check_block_ids, check_count, check_in_range, check_unpack_target
from ..page_table import PageTable
from .scattered_checks import check_offsets, check_regions, check_scattered_buffer
from .triton import MAX_GRID_YZ, copy_page_tiles, launch_config
from ..variants import launcher_for

# Torch path: pages alone in their run of the buffer and smaller than this are copied by one indexed
# copy per tensor (its flat index as large as the pages) instead of one slice copy each.
INDEXED_MAX_PAGE_BYTES = 4096


@triton.jit(do_not_specialize=["row0", "n", "tensors", "tiles", "total"], do_not_specialize_on_alignment=["p_work"])
def _scattered_kernel(
    p_work,  # int64 [.., 3]: source address, destination address, bytes of each (tensor, page)
    row0,  # this launch's first row: item (t, i) is row row0 + t * n + i of p_work
    n,  # pages per tensor
    tensors,
    tiles,  # programs per (page, tensor): the tile stride
    total,  # n * tensors * tiles work items
    WORDS: tl.constexpr,  # int32 words per tile (a power of two >= 4)
    BYTES: tl.constexpr,  # bytes per step of the byte path
    PERSISTENT: tl.constexpr,  # grid (programs,), each striding over the work; else grid (n, tensors, tiles)
):
    if PERSISTENT:
        first = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64)
    else:
        first = tl.program_id(0).to(tl.int64) + n.to(tl.int64) * (
            tl.program_id(1).to(tl.int64) + tensors.to(tl.int64) * tl.program_id(2).to(tl.int64))
        step = total.to(tl.int64)
    n_s = tiles.to(tl.int64)
    for w in range(first, total, step):
        i_n = w % n
        rest = w // n
        i_t = rest % tensors
        i_s = rest // tensors  # this program's first tile of the page
        item = p_work + (row0 + i_t * n + i_n) * 3
        src_addr = tl.load(item)
        dst_addr = tl.load(item + 1)
        page_bytes = tl.load(item + 2)
        copy_page_tiles(src_addr, dst_addr, page_bytes, i_s, n_s, WORDS, BYTES)


class ScatteredCopy:
    """One checked copy between a table's pages and a buffer, made by :func:`prepare_scattered`;
    :meth:`launch` runs it, as often as wanted. Holds the table, the buffer and everything the copy
    reads, so their memory outlives it. ``nbytes``: the bytes one launch moves; ``backend``:
    ``"triton"`` or ``"torch"``; ``programs``: the Triton grid's size (0 on the torch path)."""

    __slots__ = ("nbytes", "backend", "programs", "_table", "_buffer", "_buffer_id", "_run", "_keep", "_device",
                 "_event", "_streams")

    def __init__(self, *args, **kwargs):
        raise TypeError("ScatteredCopy is made by prepare_scattered(...)")

    def launch(self) -> None:
        """Copy. On CUDA the kernel is queued on the current stream and nothing synchronizes (a
        pinned buffer written by a pack is complete once that stream reaches this point). Refuses
        with ``StaleTableError`` a table whose tensors changed, and with ``ValueError`` a buffer
        that was re-pointed or resized, since prepare (nothing is copied then)."""
        self._table.verify()
        buffer = self._buffer
        if (buffer.data_ptr(), buffer.untyped_storage().nbytes()) != self._buffer_id:
            raise ValueError("the buffer was re-pointed or resized since prepare_scattered: its addresses no longer "
                             "hold; prepare the copy again")
        if self._device is None:
            self._run()
            return
        index = self._device.index
        if torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                self._launch_cuda(index)
        else:
            self._launch_cuda(index)

    def _launch_cuda(self, index: int) -> None:
        stream = _raw_stream(index)
        if stream not in self._streams:
            self._first_on(stream)
        self._run(stream)

    def _first_on(self, stream: int) -> None:
        """The first launch on a stream: it waits for the upload of the work array (queued on the
        stream prepare ran on) unless that has completed, and the work array is recorded as used
        there, so its memory is not reused while a launch on that stream may still read it."""
        current = torch.cuda.current_stream(self._device)
        if self._event is not None:
            if self._event.query():
                self._event = None
            else:
                current.wait_event(self._event)
        for t in self._keep:
            if t.device.type == "cuda":
                t.record_stream(current)
        self._streams.add(stream)

    def __repr__(self) -> str:
        return f"ScatteredCopy({self.nbytes} bytes, backend={self.backend}, {self._table!r})"


def upload_work(copy, work: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``work`` (int64 ``[rows, n, 3]`` on the host) where ``copy``'s kernel reads it: on CUDA
    uploaded once, through pinned memory on the current stream (the host never waits for it), with
    an event that tells a launch on another stream when it has landed (``copy._event``, read by
    ``_first_on``) and that stream recorded as the one it was queued on (``copy._streams``)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            work = work.pin_memory().to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        object.__setattr__(copy, "_event", event)
        object.__setattr__(copy, "_streams", {_raw_stream(device.index)})
    return work


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def prepare_scattered(buffer: torch.Tensor, offsets: torch.Tensor, caches: PageTable | Sequence[torch.Tensor],
                      block_ids: torch.Tensor | BlockIds | Sequence[int], *, pack: bool, backend: str = "auto",
                      max_programs: int | None = None) -> ScatteredCopy:
    """Check and precompute a copy between pages ``block_ids`` of every tensor in ``caches`` and
    bytes of ``buffer``; the copy runs at :meth:`ScatteredCopy.launch`.

    ``buffer``: 1-D contiguous uint8, on the caches' device or (caches on a GPU) pinned CPU memory.
    ``offsets``: int64 CPU ``[len(table), n]``, the byte offset in ``buffer`` of page ``i`` of
    tensor ``t``. ``block_ids``: ``n`` ids (an integer tensor, a sequence of ints, or 1-D
    :class:`BlockIds`). ``pack=False``: buffer -> pages; ``pack=True``: pages -> buffer.
    ``backend``: as for ``pack_pages`` (``auto``: Triton on CUDA or under the interpreter, else
    torch). ``max_programs``: at most this many Triton programs (each then strides over the work),
    so the copy leaves SMs to concurrent kernels; None: one program per (page, tensor, tile).

    Refused before anything is copied: a stale table (``StaleTableError``), ids out of range
    (``IndexError``) or, when unpacking, repeated; a region outside the buffer (``IndexError``);
    overlapping buffer regions when packing; a buffer sharing memory with the pages, of the wrong
    dtype, shape or device, or pageable CPU memory for GPU caches; offsets of the wrong dtype,
    device or shape (all ``ValueError``).
    """
    table = PageTable.of(caches)
    if max_programs is not None:
        max_programs = check_count(max_programs, "max_programs")
        check_in_range(max_programs, "max_programs", 1, MAX_PAGE_IDS)
    which, move = resolve_copy_backend(backend, table.device)
    check_scattered_buffer(buffer, table)
    if not pack:
        check_unpack_target(table)
    blocks = check_block_ids(table, _as_ids(block_ids), unique=not pack)
    if blocks.dim() != 1:
        raise ValueError(f"block_ids must be 1-D (n ids, one column of offsets each), got shape {tuple(blocks.shape)}")
    n = blocks.numel()
    offs = check_offsets(offsets, len(table), n)
    check_regions(offs, [s.page_bytes for s in table.segments], buffer.numel(), table.names, disjoint=pack)

    copy = object.__new__(ScatteredCopy)
    set_ = object.__setattr__
    for name, value in (("nbytes", n * table.bytes_per_page), ("backend", which), ("programs", 0),
                        ("_table", table), ("_buffer", buffer),
                        ("_buffer_id", (buffer.data_ptr(), buffer.untyped_storage().nbytes())),
                        ("_device", table.device if table.device.type == "cuda" else None), ("_event", None),
                        ("_streams", set()), ("_keep", ())):
        set_(copy, name, value)
    ids = blocks.on(torch.device("cpu"))
    # What the copy keeps (index tensors, gather buffers) is made as plain tensors even when the
    # caller prepares under torch.inference_mode (vLLM's forward does): launch() may then run on
    # any thread, where writing into an inference tensor would be refused.
    with torch.inference_mode(False):
        if n == 0:
            set_(copy, "_run", lambda stream=None: None)
        elif which == "triton":
            _prepare_triton(copy, table, buffer, offs, ids, pack, max_programs)
        else:
            set_(copy, "_run", _torch_plan(table, buffer, offs, ids, pack))
    if not move:  # backend="null" (or null_copies()): prepared as for real, launches copy nothing
        set_(copy, "_run", lambda stream=None: None)
    return copy


def _as_ids(block_ids) -> torch.Tensor | BlockIds:
    """A tensor or :class:`BlockIds` as given (:func:`check_block_ids` checks them); a sequence of
    ints as an int64 tensor (anything but ints refused: a float would be truncated)."""
    if isinstance(block_ids, (torch.Tensor, BlockIds)):
        return block_ids
    if isinstance(block_ids, (str, bytes)):
        raise ValueError(f"block_ids must be an integer tensor or a sequence of ints, got {type(block_ids).__name__}")
    try:
        values = list(block_ids)
    except TypeError:
        raise ValueError(f"block_ids must be an integer tensor or a sequence of ints, got "
                         f"{type(block_ids).__name__}") from None
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"block_ids must hold integers, got {type(v).__name__} {v!r}")
    try:
        return torch.tensor([operator.index(v) for v in values], dtype=torch.int64)
    except RuntimeError:  # beyond int64
        raise IndexError(f"block id {max(values, key=abs)} is out of range (beyond int64)") from None


# --- Triton path -----------------------------------------------------------------------------------

def _prepare_triton(copy: ScatteredCopy, table: PageTable, buffer: torch.Tensor, offs: torch.Tensor,
                    ids: torch.Tensor, pack: bool, max_programs: int | None) -> None:
    """The work array (source, destination, bytes per (tensor, page)) on the device, the grid, and
    the launcher."""
    seg = table.segments
    bases = torch.tensor([s.base for s in seg], dtype=torch.int64).unsqueeze(1)
    strides = torch.tensor([s.page_stride for s in seg], dtype=torch.int64).unsqueeze(1)
    sizes = torch.tensor([s.page_bytes for s in seg], dtype=torch.int64).unsqueeze(1)
    pages = bases + ids.unsqueeze(0) * strides
    places = buffer.data_ptr() + offs
    src, dst = (pages, places) if pack else (places, pages)
    device = table.device
    work = upload_work(copy, torch.stack([src, dst, sizes.expand_as(src)], dim=2).contiguous(), device)
    set_ = object.__setattr__
    n, tensors = ids.numel(), len(table)
    cfg = launch_config(table, n)
    tiles = min(cfg.tiles, MAX_GRID_YZ)
    total = n * tensors * tiles
    persistent = max_programs is not None and max_programs < total
    grid = (max_programs,) if persistent else (n, tensors, tiles)
    args = (work, 0, n, tensors, tiles, total)
    consts = dict(WORDS=cfg.words, BYTES=cfg.bytes, PERSISTENT=persistent)
    set_(copy, "_keep", (work,))
    set_(copy, "programs", max_programs if persistent else total)
    set_(copy, "_run", launcher_for(_scattered_kernel, device, grid, args, consts, cfg.num_warps))


# --- torch path ------------------------------------------------------------------------------------

def _torch_plan(table: PageTable, buffer: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor,
                pack: bool) -> Callable:
    """The copies, precomputed. Pages are grouped into runs that lie back to back in the buffer
    (one object's pages of a tensor, usually): a run of consecutive ids is one slice copy, another
    run one indexed copy (``index_select`` into the run's bytes, or ``index_copy_`` from them) when
    the buffer is on the pages' device. Pages alone in their run that are smaller than
    ``INDEXED_MAX_PAGE_BYTES`` take one indexed copy per tensor over a flat word index (same
    device); the rest one slice copy each."""
    ops, singles = [], []
    for t in range(len(table)):
        o, s = _torch_ops(table, t, buffer, offs[t], ids, pack)
        ops.extend(o)
        singles.extend(s)
    ops.extend(singles)
    return run_all(ops)


def run_all(ops: list[Callable]) -> Callable:
    """One copy's torch ops as one call (``stream`` ignored: the torch path copies in the call)."""

    @torch.no_grad()
    def run(stream=None):
        for op in ops:
            op()

    return run


def _torch_ops(table: PageTable, t: int, buffer: torch.Tensor, row: torch.Tensor, ids: torch.Tensor,
               pack: bool) -> tuple[list[Callable], list[Callable]]:
    """Tensor ``t``'s copies of pages ``ids`` to or from ``buffer`` at byte offsets ``row``
    (:func:`_torch_plan`): the run and slice copies, and the indexed copy of the pages alone in
    their run (to be run after the others)."""
    ops, singles = [], []
    if not ids.numel():
        return ops, singles
    same = buffer.device == table.device
    id_list = ids.tolist()
    seg = table.segments[t]
    pages, size = table.byte_pages(t), seg.page_bytes
    starts = [0] + ((row[1:] != row[:-1] + size).nonzero().view(-1) + 1).tolist()
    ends = starts[1:] + [ids.numel()]
    alone = []
    for a, b in zip(starts, ends):
        at, k = int(row[a]), b - a
        first = id_list[a]
        theirs = buffer[at:at + k * size]
        if k == 1 and same and size < INDEXED_MAX_PAGE_BYTES:
            alone.append(a)
        elif id_list[a:b] == list(range(first, first + k)):
            ops.append(_slice_op(pages[first:first + k], theirs.view(k, size), pack))
        elif same:
            ops.append(_run_op(pages, theirs, ids[a:b], size, pack))
        else:  # a pinned CPU buffer and GPU pages: no indexed copy across devices
            ops.extend(_slice_op(pages[p:p + 1], theirs[j * size:(j + 1) * size].view(1, size), pack)
                       for j, p in enumerate(id_list[a:b]))
    if alone:
        singles.append(_flat_op(pages, buffer, size, ids[alone], row[alone], pack))
    return ops, singles


def _slice_op(mine: torch.Tensor, theirs: torch.Tensor, pack: bool) -> Callable:
    dst, src = (theirs, mine) if pack else (mine, theirs)
    return lambda: dst.copy_(src, non_blocking=True)


def _words(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same byte views as the widest integer word all of them allow (torch's indexed copies run
    several times faster on int64 than on bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return tuple(v.view(dtype) for v in views)
        except RuntimeError:  # a size, stride or storage offset not a multiple of the word
            continue
    return views


def _run_op(pages: torch.Tensor, theirs: torch.Tensor, chosen: torch.Tensor, size: int, pack: bool) -> Callable:
    """Pages ``chosen`` to or from one run of ``len(chosen)`` pages back to back in the buffer."""
    mine, run = _words(pages, theirs.view(chosen.numel(), size))
    chosen = chosen.to(pages.device)
    if pack:
        return lambda: torch.index_select(mine, 0, chosen, out=run)
    return lambda: mine.index_copy_(0, chosen, run)


def _flat_op(pages: torch.Tensor, buffer: torch.Tensor, size: int, chosen: torch.Tensor, at: torch.Tensor,
             pack: bool) -> Callable:
    """Pages ``chosen`` to or from anywhere in the buffer (``at``): one indexed copy over the flat
    index of every word of every page, in the widest word the size, the offsets and the views allow."""
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        w = torch.empty(0, dtype=dtype).element_size()
        if size % w or bool((at % w).any()):
            continue
        try:
            words, flat = pages.view(dtype), buffer[:buffer.numel() - buffer.numel() % w].view(dtype)
        except RuntimeError:  # a stride or storage offset not a multiple of the word
            continue
        index = ((at // w).unsqueeze(1) + torch.arange(size // w, device=at.device)).view(-1).to(buffer.device)
        chosen = chosen.to(buffer.device)
        if pack:
            return lambda: flat.index_copy_(0, index, words.index_select(0, chosen).view(-1))
        return lambda: words.index_copy_(0, chosen, flat.index_select(0, index).view(chosen.numel(), -1))
    raise AssertionError("uint8 views always exist")
