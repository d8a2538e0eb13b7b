"""Staging buffers that reloads land in, reused from one batch to the next (:class:`StagingPool`)."""

from __future__ import annotations

import mmap
import threading

import torch


class StagingPool:
    """Staging buffers for reloads, reused from one batch to the next.

    On CUDA, :meth:`take` is a plain ``torch.empty`` on the device: PyTorch's caching allocator
    already reuses memory in stream order (take it inside the stream that will use it). On the CPU
    a fresh ``torch.empty`` of tens of MiB is a new ``mmap`` whose every page faults on first touch
    (measured on the 2-core VM: a 72 MiB staging filled at ~1.2 GB/s, about 20x slower than a copy
    into warm memory), so buffers are kept: page-aligned (SSD reads land in them with O_DIRECT,
    without a bounce buffer), at most ``keep`` of them, each reused for any request it can hold.
    """

    ALIGN = 2 << 20  # buffer sizes are rounded up to 2 MiB so nearby sizes share a buffer

    def __init__(self, device: torch.device, keep: int = 4):
        self.device = device
        self.keep = keep
        self._free: list[tuple[mmap.mmap, torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[object, torch.Tensor]:
        """A uint8 tensor of exactly ``nbytes`` (contents undefined) and the handle to :meth:`give`
        back once nothing reads or writes it any more."""
        if self.device.type != "cpu":
            return None, torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            fits = [b for b in self._free if b[1].numel() >= nbytes]
            buf = min(fits, key=lambda b: b[1].numel()) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            size = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return buf, buf[1][:nbytes]

    def give(self, handle: object) -> None:
        """Return a buffer from :meth:`take` (``None``, a CUDA staging, is left to the allocator)."""
        if handle is None:
            return
        with self._lock:
            self._free.append(handle)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=lambda b: b[1].numel()))  # dropped when unreferenced

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b[1].numel() for b in self._free)
