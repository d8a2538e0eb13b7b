"""``BlockIds``: block ids that :func:`~saria.kernels.checks.check_block_ids` accepted.

The proof that ids were checked, so that they are checked once: an op given ``BlockIds`` instead of
a tensor compares their bound with its table and does not look at every id again.
"""

from __future__ import annotations

import array
from typing import Sequence

import torch


class BlockIds:
    """Block ids that :func:`~saria.kernels.checks.check_block_ids` accepted: a private contiguous
    int64 copy on the CPU (shape ``[pages]`` or ``[chunks, pages_per_chunk]``), ``end`` (1 + the
    largest id; 0 if none), and whether they were checked to name no page twice (``unique``).
    Immutable.

    Pass one to :func:`~saria.kernels.pack_pages` / :func:`~saria.kernels.unpack_pages` (or the
    state ops) in place of a tensor: the op then checks only that ``end`` fits its table (and, for an
    unpack of ids not yet checked for duplicates, that none repeats), not every id again. Slices
    (``ids[skip:]``, ``ids[c]``) and :meth:`stack` keep what was checked. Made only by
    ``check_block_ids``, so it always holds checked values.

    Ids checked in a batch (:meth:`_rows`, ``Tables.ids_batch``) keep their values as Python ints
    until something reads them: the batch becomes one tensor on the first read, on whichever thread
    reads it (a path or save thread), so that the hook that checked them makes no torch op (each
    releases the GIL, and a hook's thread may then wait for saria's own threads to give it back)."""

    __slots__ = ("_h", "_lazy", "end", "unique", "chunks", "per_chunk")

    def __init__(self, *args, **kwargs):
        raise TypeError("BlockIds are made by check_block_ids(table, block_ids)")

    @classmethod
    def _new(cls, host: torch.Tensor, end: int, unique: bool, pages: int | None = None) -> "BlockIds":
        """``pages``: for 1-D ``host`` whose length the caller knows, that length."""
        self = object.__new__(cls)
        _set_h(self, host)
        _set_lazy(self, None)
        _set_end(self, end)
        _set_unique(self, unique)
        # How many chunks (1 for 1-D ids) and page ids per chunk: read on every op, so kept.
        if pages is None:
            shape = host.shape
            _set_chunks(self, 1 if len(shape) == 1 else shape[0])
            _set_per_chunk(self, shape[-1])
        else:
            _set_chunks(self, 1)
            _set_per_chunk(self, pages)
        return self

    @classmethod
    def _rows(cls, flat: list[int], ends: list[int], pages: int) -> list["BlockIds"]:
        """``len(ends)`` 1-D ids of ``pages`` each, row ``i`` being ``flat[i * pages:(i + 1) *
        pages]`` (Python ints the caller checked: in range, ``ends[i]`` 1 + the row's largest), as
        :meth:`_new` would make them from one ``[rows, pages]`` int64 tensor, which is built only
        when one of them is first read (:class:`_Rows`)."""
        batch = _Rows(flat, len(ends), pages)
        out = []
        for row, end in enumerate(ends):
            self = object.__new__(cls)
            _set_h(self, None)
            _set_lazy(self, (batch, row))
            _set_end(self, end)
            _set_unique(self, False)
            _set_chunks(self, 1)
            _set_per_chunk(self, pages)
            out.append(self)
        return out

    @property
    def _host(self) -> torch.Tensor:
        """The ids' tensor (for ids of a batch: built with the batch's on first read)."""
        host = self._h
        if host is None:
            batch, row = self._lazy
            host = batch.row(row)
            _set_h(self, host)
        return host

    def __setattr__(self, name, value):
        raise AttributeError(f"BlockIds are immutable (tried to set {name!r})")

    @property
    def shape(self) -> torch.Size:
        return self._host.shape

    def dim(self) -> int:
        return self._host.dim()

    def numel(self) -> int:
        return self._host.numel()

    def tolist(self) -> list:
        return self._host.tolist()

    def __len__(self) -> int:
        return self._host.shape[0]

    def __repr__(self) -> str:
        return f"BlockIds({self._host.tolist()}, unique={self.unique})"

    def __getitem__(self, key: int | slice) -> "BlockIds":
        """A slice (pages of 1-D ids, chunks of 2-D ids) or one chunk of 2-D ids: a subset of
        checked ids, so still checked (``end`` stays an upper bound)."""
        if isinstance(key, bool) or not isinstance(key, (int, slice)):
            raise TypeError(f"BlockIds take an int or a slice, got {type(key).__name__}")
        part = self._host[key]
        if part.dim() == 0:
            raise TypeError("indexing 1-D BlockIds with an int gives a single id: slice them instead")
        return BlockIds._new(part, self.end, self.unique)

    @staticmethod
    def stack(parts: Sequence["BlockIds"]) -> "BlockIds":
        """1-D checked ids of equal length as one ``[len(parts), pages]`` batch (each part one
        chunk). No id is checked again; duplicates across parts are checked by an unpack."""
        parts = list(parts)
        if not parts or not all(isinstance(p, BlockIds) and p.dim() == 1 for p in parts):
            raise ValueError("BlockIds.stack takes a non-empty sequence of 1-D BlockIds")
        if len({p.numel() for p in parts}) > 1:
            raise ValueError(f"BlockIds.stack: parts of different lengths {sorted({p.numel() for p in parts})}")
        return BlockIds._new(torch.stack([p._host for p in parts]), max(p.end for p in parts),
                             len(parts) == 1 and parts[0].unique)

    def on(self, device: torch.device) -> torch.Tensor:
        """The ids as the kernels read them: contiguous int64, 1-D, on ``device``. On the CPU this is
        the checked tensor itself (do not modify it). To a GPU they go through pinned memory: a copy
        from pageable memory makes CUDA synchronize the stream first, so the host would wait for
        everything queued before (a reload's whole batch of H2D copies) before it could launch the
        unpack and queue the next batch. torch's pinned allocator keeps the block until the copy ran."""
        flat = self._host.reshape(-1).contiguous()
        if device.type == "cpu":
            return flat
        return flat.pin_memory().to(device, non_blocking=True)


class _Rows:
    """A batch of checked ids held as Python ints (:meth:`BlockIds._rows`): one ``[rows, pages]``
    int64 tensor (a private copy: an ``array`` only it holds) and its rows, made on the first read
    of any row. Two threads reading at once may each make it: equal values, either one is kept."""

    __slots__ = ("flat", "count", "pages", "rows")

    def __init__(self, flat: list[int], count: int, pages: int):
        self.flat, self.count, self.pages, self.rows = flat, count, pages, None

    def row(self, i: int) -> torch.Tensor:
        rows = self.rows
        if rows is None:
            host = torch.frombuffer(array.array("q", self.flat), dtype=torch.int64).view(self.count, self.pages)
            rows = self.rows = host.unbind(0)
        return rows[i]


# The slots' own setters: BlockIds.__setattr__ refuses every assignment (immutable).
_set_h, _set_lazy, _set_end, _set_unique, _set_chunks, _set_per_chunk = (
    getattr(BlockIds, name).__set__ for name in BlockIds.__slots__)
