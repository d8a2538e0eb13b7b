"""The caller's memory an SSD store operation reads into or writes from, and the checks that keep
one part's bytes from being another's.

A read writes each part into its destination and then verifies the checksum there, so a
destination byte that anything else in flight also uses (another part of the same read, another
read, the source of a write) can end up holding another part's bytes, or fail the checksum and
have a healthy object dropped. Writes only read their sources (checksums and bounce copies never
change them), so sources may share memory with each other.

* :func:`byte_span` is the address range a tensor can touch.
* :class:`MemoryInUse` records the spans of every part in flight and refuses, with a ``ValueError``
  naming both users and before any I/O, a read destination that overlaps anything in flight
  (including the other destinations of the same read) and a write source that overlaps a read
  destination in flight.
* :class:`WritableProbe` tells whether CPU memory can be written (a read into a read-only mapping
  fails with EFAULT in the kernel, or crashes a memcpy through a bounce buffer). Memory torch
  allocated itself is always writable; memory from outside (``torch.frombuffer``, ``from_numpy``,
  DLPack) is probed.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import threading
from typing import NamedTuple, Sequence

import torch

from saria.kernels import extent_bytes

from saria.dataplane.ssd.files import host_view


class Span(NamedTuple):
    """Bytes ``[start, end)`` of the address space of device ``space`` (CPU, or one CUDA device)."""

    space: torch.device
    start: int
    end: int

    def describe(self) -> str:
        return f"{self.space} bytes {self.start:#x}..{self.end:#x}"


def byte_span(t: torch.Tensor) -> Span:
    """The bytes ``t`` can touch, by address (so views of one buffer compare whatever their storage
    objects): exact for a contiguous tensor, and for a strided one the conservative span from its
    lowest to its highest byte (the gaps between its elements count as used)."""
    start = t.data_ptr()
    return Span(t.device, start, start + extent_bytes(t))


class _Use(NamedTuple):
    name: str  # the argument, e.g. "out[1]" or "data"
    owner: str  # e.g. "the read of object 6b6579"
    writes: bool  # the operation writes into this memory (a read destination)
    claim: int  # which claim() recorded it


Claim = list[tuple[torch.device, tuple[int, int, int]]]


class MemoryInUse:
    """The byte spans of the parts in flight, per address space, sorted by start address.

    Not thread-safe on its own: the store calls it under its lock.
    """

    def __init__(self) -> None:
        self._spans: dict[torch.device, list[tuple[int, int, int]]] = {}  # (start, end, seq)
        self._uses: dict[int, _Use] = {}  # seq -> who uses that span
        self._longest = 0  # bound on any recorded span's length: where an overlap search can start
        self._seq = itertools.count()

    def claim(self, owner: str, writes: bool, parts: Sequence[tuple[str, torch.Tensor]]) -> Claim:
        """Record the memory of ``parts`` (``(name, tensor)``) as used by ``owner`` until
        :meth:`release`; ``writes``: the operation writes into it (a read) rather than only
        reading it (a write).

        Raises ``ValueError`` naming both users, with nothing recorded, when a part overlaps a
        span it must not share: for ``writes``, any span in flight or another part of this claim;
        otherwise a span some read in flight writes into.
        """
        claim_id = next(self._seq)
        claimed: Claim = []
        try:
            for name, t in parts:
                span = byte_span(t)
                if span.end == span.start:
                    continue
                clash = self._clash(span, writes)
                if clash is not None:
                    raise ValueError(self._refusal(name, span, clash, claim_id, writes))
                use = _Use(name, owner, writes, claim_id)
                claimed.append((span.space, self._add(span, use)))
        except BaseException:
            self.release(claimed)
            raise
        return claimed

    def release(self, claimed: Claim) -> None:
        """Forget the spans of one :meth:`claim` (their operation is over)."""
        for space, entry in claimed:
            entries = self._spans[space]
            del entries[bisect.bisect_left(entries, entry)]
            del self._uses[entry[2]]
            if not entries:
                del self._spans[space]
        if not self._uses:
            self._longest = 0

    def __len__(self) -> int:
        return len(self._uses)

    def _add(self, span: Span, use: _Use) -> tuple[int, int, int]:
        seq = next(self._seq)
        entry = (span.start, span.end, seq)
        bisect.insort(self._spans.setdefault(span.space, []), entry)
        self._uses[seq] = use
        self._longest = max(self._longest, span.end - span.start)
        return entry

    def _clash(self, span: Span, writes: bool) -> tuple[Span, _Use] | None:
        entries = self._spans.get(span.space)
        if not entries:
            return None
        # a recorded span starting at or before span.start - longest ends at or before span.start
        i = bisect.bisect_right(entries, (span.start - self._longest, float("inf")))
        while i < len(entries) and entries[i][0] < span.end:
            start, end, seq = entries[i]
            use = self._uses[seq]
            if end > span.start and (writes or use.writes):
                return Span(span.space, start, end), use
            i += 1
        return None

    @staticmethod
    def _refusal(name: str, span: Span, clash: tuple[Span, _Use], claim_id: int, writes: bool) -> str:
        other_span, other = clash
        shared = min(span.end, other_span.end) - max(span.start, other_span.start)
        if other.claim == claim_id:
            where = f"{other_span.describe()} and {span.describe()}: {shared} bytes shared"
            return (f"{other.name} and {name} overlap in memory ({where}): each part of a read needs its own "
                    "bytes (the same tensor given twice, or overlapping views of one buffer); nothing was read")
        where = f"{span.describe()} and {other_span.describe()}: {shared} bytes shared"
        why = ("a read must not write into memory another read or write in flight is using" if writes
               else "a write must not store memory a read in flight is writing into")
        return f"{name} overlaps {other.name} of {other.owner}, still in flight ({where}): {why}"


class WritableProbe:
    """Tells whether CPU memory can be written, without changing it.

    A tensor whose storage torch allocated (a resizable storage) is writable. For memory from
    outside, one byte is copied into a pipe and read back in place, which the kernel refuses
    (EFAULT) on a read-only page; only the pages of the first and last bytes are probed: a
    read-only page in between is caught by the kernel when the read lands there (EFAULT again).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one probe at a time: the pipe carries one byte per probe
        self._pipe: tuple[int, int] | None = None

    def writable(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a contiguous CPU tensor) is writable, as far as its first and last pages tell."""
        if t.untyped_storage().resizable() or t.numel() == 0:
            return True
        view = host_view(t)
        first, last = t.data_ptr(), t.data_ptr() + len(view) - 1
        probes = [0] if first // mmap.PAGESIZE == last // mmap.PAGESIZE else [0, len(view) - 1]
        with self._lock:
            if self._pipe is None:
                self._pipe = os.pipe2(os.O_CLOEXEC)
            r, w = self._pipe
            for i in probes:
                try:
                    os.write(w, view[i:i + 1])
                except OSError as exc:  # not even readable
                    if exc.errno == errno.EFAULT:
                        return False
                    raise
                try:
                    os.readv(r, [view[i:i + 1]])
                except OSError as exc:
                    os.read(r, 1)  # the byte is still in the pipe
                    if exc.errno == errno.EFAULT:
                        return False
                    raise
        return True

    def close(self) -> None:
        with self._lock:
            if self._pipe is not None:
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None
