"""``prepare_layered``: one step's scattered copies of every layer, checked and built in one
vectorized pass and launched layer by layer (:class:`LayeredCopy`).

:func:`~saria.kernels.prepare_scattered` prepares one copy between one table and one buffer; a
layer-wise step needs one per (layer, tensor, buffer), which cost a Python pass each (checks,
tensors, on CUDA an upload and an event) on the threads that feed the forward. Here the copy of a
whole step is described at once: ``n`` page ids shared by every tensor of ``table``, and per
``(tensor t, page i)`` the buffer (``where[t, i]``, an index into ``buffers``) and the byte offset
in it (``offsets[t, i]``)::

    pack=False:  bytes of table[t][ids[i]] = buffers[where[t, i]][offsets[t, i] : + page_bytes(t)]
    pack=True:   buffers[where[t, i]][offsets[t, i] : + page_bytes(t)] = bytes of table[t][ids[i]]

``layers`` groups the table's tensors (tensor indices per layer). Everything is checked once
(:func:`prepare_layered`), and one int64 work array of (source address, destination address,
bytes) is built for every (tensor, page), its rows ordered layer by layer (``[tensors, n, 3]``:
layer ``l``'s tensors are one run of rows), on CUDA uploaded once on the caller's current stream.
:meth:`LayeredCopy.launch` of layer ``l`` is then one kernel launch whose work is an offset into that
array (the kernel works on addresses, so every tensor and every buffer of a layer is one launch).

The torch path (``backend="torch"``, the CPU without the interpreter) runs the same preparation
(the checks, the same per-(tensor, page) placement) and works out each layer's torch copies from
it at the layer's first launch (slice copies over runs of pages, indexed copies otherwise, as
``prepare_scattered`` does): on the CPU a layer's copies run on the launching thread, so working
out every layer's before the first would only hold the first back.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..backend import INTERPRETED, resolve_copy_backend
from ..block_ids import BlockIds
from ..checks import MAX_PAGE_IDS, MAX_TENSORS, check_block_ids, check_count, check_in_range, check_unpack_target
from ..page_table import PageTable
from .scattered import _as_ids, _raw_stream, _scattered_kernel, _torch_ops, run_all, upload_work
from .scattered_checks import check_placements, check_scattered_buffer
from .triton import MAX_GRID_YZ, config_for_bytes
from ..variants import launcher_for, warm

# A conservative cap on the programs (CTAs) of one layer's copy kernel on a GPU, until one is
# measured (bench/bench_layerwise.py --max-programs on a lent device; docs/kernels.md). A layer-wise
# copy runs beside the forward and is bound by the bus (pinned host memory over PCIe, ~25-55 GB/s
# each way), not by SMs: the bytes in flight that cover the bus's latency (~2 us x 55 GB/s ~ 110 KiB)
# need a few dozen programs of 4 warps moving 16-byte words (2 KiB per warp-wide load step, several
# steps in flight each), while every program above that holds an SM slot the forward's kernels wait
# for, stalled on the bus. 32 programs is under a quarter of an H100's 132 SMs (an eighth at two
# programs per SM) and, by the estimate above, still enough to keep PCIe busy. Applied by default to
# layer-wise loads and saves (the connector's ``layerwise_max_programs`` overrides it); the CPU and
# the interpreter ignore it (no SMs to share; the interpreter pays per program).
COPY_MAX_PROGRAMS = 32


def default_max_programs(device: torch.device) -> int | None:
    """The cap on a layer's copy programs on ``device``: :data:`COPY_MAX_PROGRAMS` on CUDA, none on
    the CPU or under the interpreter."""
    return COPY_MAX_PROGRAMS if device.type == "cuda" and not INTERPRETED else None


class LayeredCopy:
    """One step's copies of every layer, made by :func:`prepare_layered`. ``nbytes[l]``: the bytes
    layer ``l``'s launch moves; ``backend``; ``programs[l]``: its Triton grid's size (0 on the
    torch path); ``launches``: kernel launches (or torch copy lists) per layer, 1 (0 for a layer
    with nothing to copy)."""

    __slots__ = ("nbytes", "backend", "programs", "_table", "_layers", "_buffers", "_buffer_ids", "_runs",
                 "_keep", "_device", "_event", "_streams")

    def __init__(self, *args, **kwargs):
        raise TypeError("LayeredCopy is made by prepare_layered(...)")

    def __len__(self) -> int:
        return len(self._runs)

    def launch(self, layer: int) -> None:
        """Copy layer ``layer``'s pages: one kernel queued on the current stream (CUDA; nothing
        synchronizes) or its torch copies. Refuses with ``StaleTableError`` a layer whose tensors
        changed and with ``ValueError`` a buffer re-pointed or resized since prepare (nothing is
        copied then)."""
        self._table.verify_tensors(self._layers[layer])
        for buffer, ident in zip(self._buffers, self._buffer_ids):
            if (buffer.data_ptr(), buffer.untyped_storage().nbytes()) != ident:
                raise ValueError("a buffer was re-pointed or resized since prepare_layered: its addresses no longer "
                                 "hold; prepare the copy again")
        run = self._runs[layer]
        if self._device is None:
            run()
            return
        index = self._device.index
        if torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                self._launch_cuda(index, run)
        else:
            self._launch_cuda(index, run)

    def _launch_cuda(self, index: int, run: Callable) -> None:
        stream = _raw_stream(index)
        if stream not in self._streams:
            # The first launch on another stream than the upload's: it waits for the upload unless
            # that has landed, and the work array is recorded as used there.
            current = torch.cuda.current_stream(self._device)
            if self._event is not None and not self._event.query():
                current.wait_event(self._event)
            for t in self._keep:
                t.record_stream(current)
            self._streams.add(stream)
        run(stream)

    def __repr__(self) -> str:
        return f"LayeredCopy({len(self._runs)} layers, {sum(self.nbytes)} bytes, backend={self.backend})"


def prepare_layered(table: PageTable, layers: Sequence[Sequence[int]], buffers: Sequence[torch.Tensor],
                    ids: torch.Tensor | BlockIds | Sequence[int], where: torch.Tensor | None, offsets: torch.Tensor, *,
                    pack: bool, backend: str = "auto", max_programs: int | None = None,
                    tensor_tables: Sequence[PageTable] | None = None) -> LayeredCopy:
    """Check and build a step's copies (module docstring). ``table``: every tensor; ``layers``: the
    tensor indices of each layer (each tensor at most once); ``buffers``: 1-D contiguous uint8, on
    the table's device or (a CUDA table) pinned CPU memory, sharing no byte with a page or with each
    other; ``ids``: ``n`` page ids shared by every tensor; ``where``: int64 CPU ``[tensors, n]``, the
    buffer of each (tensor, page) (``None``: ``buffers[0]`` for all); ``offsets``: int64 CPU
    ``[tensors, n]``, its byte offset in that buffer. ``max_programs``: at most this many programs
    per layer's launch (each then strides over the layer's work; None: one per tile).
    ``tensor_tables``: one-tensor tables per tensor for the torch path (built when not given).

    On CUDA the work array is uploaded on the current stream and the first launch on another stream
    waits for it (an event). Refused before anything is copied, as :func:`prepare_scattered`
    refuses: a stale table, ids out of range (or repeated when unpacking), a region outside its
    buffer or (packing) two regions sharing a byte, a bad buffer, bad ``where`` / ``offsets``."""
    table = PageTable.of(table)
    groups = [list(group) for group in layers]
    flat = [t for group in groups for t in group]
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(table) for t in flat) or \
            len(set(flat)) != len(flat):
        raise ValueError(f"layers must name each of the table's {len(table)} tensors at most once, got {groups}")
    if max_programs is not None:
        max_programs = check_count(max_programs, "max_programs")
        check_in_range(max_programs, "max_programs", 1, MAX_PAGE_IDS)
    which, move = resolve_copy_backend(backend, table.device)
    buffers = list(buffers)
    if not buffers:
        raise ValueError("buffers must hold at least one buffer")
    for buffer in buffers:
        check_scattered_buffer(buffer, table)
    if not pack:
        check_unpack_target(table)
    blocks = check_block_ids(table, _as_ids(ids), unique=not pack)
    if blocks.dim() != 1:
        raise ValueError(f"ids must be 1-D (n ids, one column of offsets each), got shape {tuple(blocks.shape)}")
    n = blocks.numel()
    host_ids = blocks.on(torch.device("cpu"))
    sizes = [s.page_bytes for s in table.segments]
    where, offs = check_placements(where, offsets, buffers, sizes, table.names, n, disjoint=pack)

    copy = object.__new__(LayeredCopy)
    set_ = object.__setattr__
    nbytes = [n * sum(sizes[t] for t in group) for group in groups]
    for name, value in (("nbytes", nbytes), ("backend", which), ("programs", [0] * len(groups)),
                        ("_table", table), ("_layers", tuple(tuple(g) for g in groups)), ("_buffers", tuple(buffers)),
                        ("_buffer_ids", tuple((b.data_ptr(), b.untyped_storage().nbytes()) for b in buffers)),
                        ("_device", table.device if table.device.type == "cuda" else None), ("_event", None),
                        ("_streams", set()), ("_keep", ())):
        set_(copy, name, value)
    with torch.inference_mode(False):  # what the copy keeps is used on other threads (see prepare_scattered)
        if which == "triton":
            _prepare_triton(copy, table, groups, buffers, host_ids, where, offs, pack, max_programs)
        else:
            tables = tensor_tables if tensor_tables is not None else [
                PageTable([t], names=[name]) for t, name in zip(table.tensors, table.names)]
            set_(copy, "_runs", [_lazy(tables, group, buffers, host_ids, where, offs, pack, move) for group in groups])
    if not move and which == "triton":  # backend="null" (or null_copies()): prepared as for real, no copy
        set_(copy, "_runs", [_nothing] * len(groups))
    return copy


def _prepare_triton(copy: LayeredCopy, table: PageTable, groups: list[list[int]], buffers: list[torch.Tensor],
                    ids: torch.Tensor, where: torch.Tensor, offs: torch.Tensor, pack: bool,
                    max_programs: int | None) -> None:
    """The work array of every layer (rows ordered layer by layer), uploaded once, and one launcher
    per layer (an offset into it)."""
    set_ = object.__setattr__
    n = ids.numel()
    order = [t for group in groups for t in group]
    if n == 0 or not order:
        set_(copy, "_runs", [_nothing] * len(groups))
        return
    seg = table.segments
    rows = torch.tensor(order, dtype=torch.int64)
    bases = torch.tensor([s.base for s in seg], dtype=torch.int64)[rows].unsqueeze(1)
    strides = torch.tensor([s.page_stride for s in seg], dtype=torch.int64)[rows].unsqueeze(1)
    sizes = torch.tensor([s.page_bytes for s in seg], dtype=torch.int64)[rows].unsqueeze(1)
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pages = bases + ids.unsqueeze(0) * strides  # [rows, n]
    places = addresses[where[rows]] + offs[rows]
    src, dst = (pages, places) if pack else (places, pages)
    # [rows, n, 3], layer by layer; once per step, on the current stream (the path's own)
    device = table.device
    work = upload_work(copy, torch.stack([src, dst, sizes.expand_as(src)], dim=2).contiguous(), device)
    set_(copy, "_keep", (work,))
    runs, programs, first = [], [], 0
    for group in groups:
        tensors = len(group)
        if not tensors:
            runs.append(_nothing)
            programs.append(0)
            continue
        cfg = config_for_bytes(max(seg[t].page_bytes for t in group))
        tiles = min(cfg.tiles, MAX_GRID_YZ)
        total = n * tensors * tiles
        persistent = max_programs is not None and max_programs < total
        grid = (max_programs,) if persistent else (n, tensors, tiles)
        if tensors > MAX_TENSORS:
            raise ValueError(f"a layer of {tensors} tensors: one launch covers at most {MAX_TENSORS}")
        runs.append(launcher_for(_scattered_kernel, device, grid, (work, first, n, tensors, tiles, total),
                                 dict(WORDS=cfg.words, BYTES=cfg.bytes, PERSISTENT=persistent), cfg.num_warps))
        programs.append(max_programs if persistent else total)
        first += tensors * n
    set_(copy, "_runs", runs)
    set_(copy, "programs", programs)


def _nothing(stream=None) -> None:
    return None


def _lazy(tables: Sequence[PageTable], group: list[int], buffers: list[torch.Tensor], ids: torch.Tensor,
          where: torch.Tensor, offs: torch.Tensor, pack: bool, move: bool = True) -> Callable:
    """The torch path's layer ``group``: its copies worked out (from the step's checked placement)
    at its first launch, then kept (``move`` False: the null backend, worked out and not run). On the CPU a layer's copies run at once on the thread that
    launches them, so layer ``l``'s copies are then under way while nothing waits on layer
    ``l + 1``'s; worked out for every layer before the first, they would hold back the first
    layer by the whole step's (a few ms for 36 layers of 16 chunks)."""
    plan: list[Callable] = []

    def run(stream=None):
        if not plan:
            with torch.inference_mode(False):
                plan.append(_torch_layer(tables, group, buffers, ids, where, offs, pack))
        if move:
            plan[0]()

    return run


def _torch_layer(tables: Sequence[PageTable], group: list[int], buffers: list[torch.Tensor], ids: torch.Tensor,
                 where: torch.Tensor, offs: torch.Tensor, pack: bool) -> Callable:
    """One layer's torch copies: per tensor and buffer, the pages placed there (as prepare_scattered's
    torch path copies them)."""
    ops: list[Callable] = []
    singles: list[Callable] = []
    for t in group:
        row_where, row = where[t], offs[t]
        used = range(len(buffers)) if len(buffers) > 1 else (0,)
        for b in used:
            mask = row_where == b if len(buffers) > 1 else None
            if mask is not None and not bool(mask.any()):
                continue
            chosen = ids if mask is None else ids[mask]
            at = row if mask is None else row[mask]
            o, s = _torch_ops(tables[t], 0, buffers[b], at, chosen, pack)
            ops.extend(o)
            singles.extend(s)
    ops.extend(singles)
    return run_all(ops)



def warm_layered(table: PageTable, layers: Sequence[Sequence[int]], max_programs: int | None) -> list[tuple]:
    """Compile (record, under the interpreter) every variant :func:`prepare_layered` can launch for
    ``table`` grouped as ``layers`` with this cap: per layer's launch rule (its largest page), the
    one-program-per-tile grid and, with a cap, the persistent one. Returns their keys."""
    device = table.device
    work = torch.zeros((1, 3), dtype=torch.int64, device=device)
    keys = []
    for largest in sorted({max(table.segments[t].page_bytes for t in group) for group in layers if group}):
        cfg = config_for_bytes(largest)
        for persistent in ((False, True) if max_programs is not None else (False,)):
            keys.append(warm(_scattered_kernel, device, (work, 0, 1, 1, 1, 1),
                             dict(WORDS=cfg.words, BYTES=cfg.bytes, PERSISTENT=persistent), cfg.num_warps))
    return keys
