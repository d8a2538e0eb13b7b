"""The engine's page tables and object sizes, with the one check of a caller's block ids
(:class:`Tables`), and the unpack both reload paths end with (:func:`unpack_run`)."""

from __future__ import annotations

from itertools import chain

import logging
from typing import Sequence

import torch

from saria.orders import KV
from saria.kernels import (BlockIds, PageTable, check_block_ids, drop_leading_pages, fp8_staging_bytes, unpack_pages,
                           unpack_pages_fp8)
from saria.ssd_dtype import check_ssd_dtype

from saria.dataplane import nvtx
from saria.dataplane.transfer.load_job import LoadItem, LoadJob
from saria.dataplane.transfer.results import TransferCounters
from saria.dataplane.transfer.streams import Streams

log = logging.getLogger("saria.dataplane.transfer")

Blocks = Sequence[int] | torch.Tensor


class Tables:
    """The engine's page tables and object shapes: ``kv_table`` (a kv object is ``pages_per_chunk``
    of its pages) and, for hybrid models, ``state_table`` (a state object is ``state_pages``).

    ``ssd_dtype`` (:mod:`saria.ssd_dtype`): ``"fp8"`` stores kv objects on SSD in their FP8 form
    (``kv_ssd_bytes`` each, packed and unpacked by the quantizing kernels); ``ValueError`` here if
    the KV pages cannot take it (a dtype other than bf16/fp16/fp32, pages not whole groups)."""

    def __init__(self, kv_table: PageTable, state_table: PageTable | None, pages_per_chunk: int, state_pages: int,
                 ssd_dtype: str = "auto"):
        self.kv_table = kv_table
        self.state_table = state_table
        self.pages_per_chunk = pages_per_chunk
        self.state_pages = state_pages
        self.device = kv_table.device
        self.kv_bytes = kv_table.staging_bytes(pages_per_chunk)
        self.state_bytes = state_table.staging_bytes(state_pages) if state_table is not None else 0
        self.ssd_dtype = check_ssd_dtype(ssd_dtype)
        self.kv_dtype = kv_table.element_dtype  # None for mixed dtypes, which fp8 refuses
        self.kv_ssd_bytes = fp8_staging_bytes(kv_table, pages_per_chunk) if ssd_dtype == "fp8" else self.kv_bytes

    def table(self, kind: str) -> tuple[PageTable, int, int]:
        """(table, pages per object, bytes per object) for an object kind."""
        if kind == KV:
            return self.kv_table, self.pages_per_chunk, self.kv_bytes
        if self.state_table is None:
            raise ValueError("a state object was asked for but this engine has no state_table (not a hybrid model)")
        return self.state_table, self.state_pages, self.state_bytes

    def quantized(self, kind: str) -> bool:
        """Whether objects of ``kind`` are stored on SSD in their FP8 form (kv objects under
        ``ssd_dtype="fp8"``; state objects never are)."""
        return kind == KV and self.ssd_dtype == "fp8"

    def ssd_bytes(self, kind: str) -> int:
        """Bytes of one object of ``kind`` on SSD."""
        return self.kv_ssd_bytes if kind == KV else self.table(kind)[2]

    def ids(self, kind: str, what: str, blocks: Blocks | None) -> BlockIds:
        """An object's block ids, checked once here for every kernel that will use them
        (:class:`~saria.kernels.BlockIds`); ``ValueError`` if they are missing, not integers, the
        wrong number, or outside the table. ``what``: the object as the message names it, by its
        place (``"the kv object of chunk 3 of plan 7"``), never by its chunk hash (token-derived)."""
        table, pages, _ = self.table(kind)
        if blocks is None:
            raise ValueError(f"no block ids given for {what}")
        try:
            ids = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(list(blocks), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"the block ids of {what} are not integers: {exc}") from None
        if ids.dim() != 1 or ids.numel() != pages:
            raise ValueError(f"{what} needs {pages} block ids, got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"the block ids of {what} must be integers, got {ids.dtype}")
        try:
            return check_block_ids(table, ids.cpu())
        except IndexError:
            raise ValueError(f"{what} names block ids {ids.tolist()} outside [0, {table.num_pages})") from None

    def ids_batch(self, kind: str, blocks: Sequence[Blocks | None]) -> list[BlockIds | None]:
        """The block ids of several objects of ``kind`` checked together, for a step's objects:
        one tensor and one range check for all of them instead of one each. Entry ``i`` is what
        :meth:`ids` returns for ``blocks[i]`` (the same values, the same ``end``), or ``None``
        where the batch does not vouch for it (:meth:`vouch`). Never raises: the caller checks each
        ``None`` entry with :meth:`ids`, at the place it always did, so a bad object is refused
        with the same error, in the same order, as without the batch."""
        out: list[BlockIds | None] = [None] * len(blocks)
        vouched = self.vouch(kind, blocks)
        if vouched is not None:
            for i, ids in zip(vouched.rows, vouched.make()):
                out[i] = ids
        return out

    def step_ids(self, kind: str, gather) -> StepIds:
        """A step's block id lists (``gather()``, in the order its caller walks them) checked in one
        batch (:meth:`vouch`). Never raises (lists too malformed to gather: none is vouched for; the
        caller's own walk says which and why)."""
        try:
            lists = list(gather())
        except Exception:
            lists = []
        return StepIds(self, kind, lists)

    def vouch(self, kind: str, blocks: Sequence[Blocks | None]) -> "Vouched | None":
        """The check of :meth:`ids_batch` without making its :class:`~saria.kernels.BlockIds`
        (:meth:`Vouched.make` makes them, on whichever thread needs them): ``None`` where nothing
        is vouched for, else the entries vouched for (``Vouched.rows``). Vouched for: the entries
        that are lists or tuples of ``pages_per_chunk`` items, if every item of all of them is a
        Python int (``type(x) is int``: bools, floats, numpy ints, ... are left to :meth:`ids`,
        which converts them) in ``[0, num_pages)``; any such entry refused leaves every entry to
        :meth:`ids`. Never raises.

        Pure Python, no torch op: a torch op releases the GIL (as ``torch.tensor`` does), which
        lets saria's own threads take it, and the hook's thread may then wait for them to give it
        back. The ids' tensor is made on first read (:meth:`BlockIds._rows`), by the path or save
        thread that prepares the copies."""
        try:
            table, pages, _ = self.table(kind)
            rows = [i for i, b in enumerate(blocks) if isinstance(b, (list, tuple)) and len(b) == pages]
            if not rows or not pages:
                return None
            picked = [blocks[i] for i in rows]
            flat = list(chain.from_iterable(picked))  # at C speed: a step checks hundreds of ids
            # every item exactly a Python int: list.count compares by identity first (a set of the
            # types costs twice as much)
            if list(map(type, flat)).count(int) != len(flat):
                return None
            if min(flat) < 0:  # refused: ids() names the first bad one
                return None
            ends = list(map(max, picked))
            if max(ends) >= table.num_pages:
                return None
        except Exception:  # ids() says which and why
            return None
        return Vouched(rows, flat, ends, pages)


class StepIds:
    """A step's block id lists checked in one batch (:meth:`Tables.step_ids`): ``every`` when the batch
    vouched for all of them (the common case: :attr:`make` makes their ids, on the thread that needs
    them); else :meth:`checked` gives each list's ids, vouched for or checked one by one."""

    __slots__ = ("lists", "every", "make", "_made", "_tables", "_kind")

    def __init__(self, tables: "Tables", kind: str, lists: list):
        vouched = tables.vouch(kind, lists)
        self.lists, self._tables, self._kind = lists, tables, kind
        self.every = vouched is not None and len(vouched.rows) == len(lists)
        self.make = vouched.make if self.every else None
        self._made = None if self.every else dict(zip(vouched.rows, vouched.make())) if vouched is not None else {}

    def checked(self, k: int, blocks, what: str) -> BlockIds:
        """The ids of ``blocks``, entry ``k`` of the step's lists: those the batch vouched for, else
        :meth:`Tables.ids` (``ValueError`` naming ``what``, by place: never a chunk hash)."""
        made, lists = self._made, self.lists
        ids = made.get(k) if made and k < len(lists) and lists[k] is blocks else None
        return ids if ids is not None else self._tables.ids(self._kind, what, blocks)


class Vouched:
    """Block id lists a batch check vouched for (:meth:`Tables.vouch`): ``rows``, their positions
    in the batch; :meth:`make` their :class:`~saria.kernels.BlockIds`, in that order (int64 as
    :meth:`Tables.ids` makes them: in range, no value is past int64)."""

    __slots__ = ("rows", "flat", "ends", "pages")

    def __init__(self, rows: list[int], flat: list[int], ends: list[int], pages: int):
        self.rows, self.flat, self.ends, self.pages = rows, flat, ends, pages

    def make(self) -> list[BlockIds]:
        """The ids of every row, one lazy batch (its tensor made on first read: BlockIds._rows)."""
        return BlockIds._rows(self.flat, [end + 1 for end in self.ends], self.pages)


def _unpack(item: LoadItem, staging: torch.Tensor) -> None:
    """Unpack one object from its own staging (``item.nbytes`` bytes; its FP8 form if
    ``item.quantized``, then dequantized into the pages)."""
    if item.quantized:
        unpack_pages_fp8(staging, item.table, item.blocks[item.skip:], skip=item.skip)
        return
    if item.skip:
        staging = drop_leading_pages(staging, item.table, item.blocks.numel(), item.skip)
    unpack_pages(staging, item.table, item.blocks[item.skip:])


def unpack_run(job: LoadJob, items: list[LoadItem], staging: torch.Tensor, path: str, streams: Streams,
               counters: TransferCounters) -> None:
    """Unpack ``items`` (one page table, all quantized or none; ``staging`` their packed bytes
    back to back) with one launch on ``path``'s stream, and finish them on ``job`` (with an event
    on that stream). Never raises (its callers are the paths' threads, which must neither die nor leave a job waiting):
    if the launch is refused (e.g. two objects naming the same page), each object is unpacked
    alone and only those that fail alone fail."""
    try:
        with streams.on(path), nvtx.nvtx_range(nvtx.UNPACK):
            if job.after is not None:  # the pages are written only after the caller's queued work
                streams.wait(path, job.after)
            if len(items) == 1:
                _unpack(items[0], staging)
            else:
                ids = BlockIds.stack([i.blocks for i in items])
                if items[0].quantized:
                    unpack_pages_fp8(staging.view(len(items), -1), items[0].table, ids)
                else:
                    unpack_pages(staging, items[0].table, ids)
            event = streams.record(path)
    except Exception as exc:
        if len(items) == 1:
            log.warning("%s reload of %s failed: %s", path.upper(), items[0].key, exc)
            counters.add(load_failures=1)
            job.finish(items, error=exc)
            return
        offset = 0
        for item in items:
            unpack_run(job, [item], staging[offset:offset + item.nbytes], path, streams, counters)
            offset += item.nbytes
        return
    job.finish(items, event=event)
