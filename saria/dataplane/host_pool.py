"""Pinned host memory cut into fixed-size slots: saria's DRAM tier.

Memory comes in segments (default 1 GiB) of anonymous ``mmap`` memory, page aligned (so O_DIRECT
SSD I/O can use slots directly), each registered with CUDA (``cudaHostRegister``) on its own: one
huge registration fails on some systems and takes seconds, and segments let a pool grow past what
one call can pin. On a machine without CUDA nothing is pinned; the same slots are plain memory.

An object (a chunk's kv or state bytes) occupies a list of slots; slot ``i`` holds bytes
``[i * slot_bytes, (i + 1) * slot_bytes)`` of it. A full pool calls the owner's ``evict`` hook
(free at least N slots, e.g. by evicting DRAM objects through the control plane) and retries
before refusing with :class:`HostPoolFull`.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

PAGE = 4096


class HostPoolFull(RuntimeError):
    """Not enough free slots, even after asking the owner to evict."""


@dataclass
class HostPoolCounters:
    allocations: int = 0
    slots_allocated: int = 0
    slots_freed: int = 0
    evict_calls: int = 0
    full_refusals: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


def physical_memory_bytes() -> int:
    """This machine's memory (what a host pool can never exceed)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} "
                           "(too much pinned memory? try a smaller pool or segment size)")


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    """Fixed-size slots of (pinned) host memory with a thread-safe allocator."""

    def __init__(self, capacity_bytes: int, slot_bytes: int = 4 << 20, *, segment_bytes: int = 1 << 30,
                 pin: bool | None = None, evict: Callable[[int], None] | None = None, evict_attempts: int = 3):
        for name, value in (("capacity_bytes", capacity_bytes), ("slot_bytes", slot_bytes),
                            ("segment_bytes", segment_bytes), ("evict_attempts", evict_attempts)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if slot_bytes < PAGE or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
        memory = physical_memory_bytes()
        if capacity_bytes > memory:
            raise ValueError(f"a host pool of {capacity_bytes / 2**30:,.1f} GiB does not fit in this machine's "
                             f"{memory / 2**30:,.1f} GiB of memory")
        if capacity_bytes < slot_bytes:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must hold at least one {slot_bytes}-byte slot")
        if segment_bytes < slot_bytes:
            raise ValueError(f"segment_bytes ({segment_bytes}) must hold at least one slot ({slot_bytes})")
        if evict_attempts < 0:
            raise ValueError("evict_attempts must be >= 0")
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("pin=True needs CUDA; this machine has none (pin=None pins when it can)")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.pinned = cuda if pin is None else pin
        self._evict = evict
        self._evict_attempts = evict_attempts
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(self.num_slots))
        self._used = bytearray(self.num_slots)
        self.counters = HostPoolCounters()
        self._maps: list[mmap.mmap] = []
        self._segments: list[torch.Tensor] = []
        per_segment = segment_bytes // slot_bytes
        try:
            for first in range(0, self.num_slots, per_segment):
                nbytes = min(per_segment, self.num_slots - first) * slot_bytes
                mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self._maps.append(mm)
                seg = torch.frombuffer(mm, dtype=torch.uint8)
                if self.pinned:
                    _register(seg.data_ptr(), nbytes)
                self._segments.append(seg)
        except BaseException:
            self.close()
            raise
        self._per_segment = per_segment

    # --- allocation ------------------------------------------------------------------------------

    def slots_for(self, nbytes: int) -> int:
        """Slots an object of ``nbytes`` occupies."""
        return max(1, -(-nbytes // self.slot_bytes))

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots; under pressure ask ``evict`` to free the shortfall and retry."""
        if n < 1:
            raise ValueError(f"allocate needs n >= 1, got {n}")
        if n > self.num_slots:
            raise HostPoolFull(f"{n} slots requested but the pool has only {self.num_slots}")
        for attempt in range(self._evict_attempts + 1):
            with self._lock:
                if len(self._free) >= n:
                    slots = [self._free.popleft() for _ in range(n)]
                    for s in slots:
                        self._used[s] = 1
                    self.counters.allocations += 1
                    self.counters.slots_allocated += n
                    return slots
                shortfall = n - len(self._free)
                if self._evict is None or attempt == self._evict_attempts:
                    break
                self.counters.evict_calls += 1
            self._evict(shortfall)  # outside the lock: the hook frees slots through free()
        with self._lock:
            self.counters.full_refusals += 1
            free = len(self._free)
        raise HostPoolFull(f"host pool full: {n} slots requested, {free} free of {self.num_slots}")

    def free(self, slots: Sequence[int]) -> None:
        """Return slots to the pool. Freeing a slot that is not allocated is an error (and frees nothing)."""
        with self._lock:
            for s in slots:
                if not 0 <= s < self.num_slots:
                    raise ValueError(f"slot {s} is not in this pool (0..{self.num_slots - 1})")
                if not self._used[s]:
                    raise ValueError(f"slot {s} is not allocated (double free?)")
            if len(set(slots)) != len(slots):
                raise ValueError("the same slot is listed twice")
            for s in slots:
                self._used[s] = 0
                self._free.append(s)
            self.counters.slots_freed += len(slots)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - self.free_slots

    # --- memory ----------------------------------------------------------------------------------

    def slot(self, s: int) -> torch.Tensor:
        """Slot ``s`` as a uint8 tensor of ``slot_bytes`` (a view: no copy)."""
        if not 0 <= s < self.num_slots:
            raise ValueError(f"slot {s} is not in this pool (0..{self.num_slots - 1})")
        seg, i = divmod(s, self._per_segment)
        return self._segments[seg][i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def views(self, slots: Sequence[int], nbytes: int) -> list[torch.Tensor]:
        """The pieces of an ``nbytes`` object stored in ``slots``: full slots, then a partial last one."""
        if len(slots) != self.slots_for(nbytes):
            raise ValueError(f"an object of {nbytes} bytes takes {self.slots_for(nbytes)} slots, got {len(slots)}")
        out, left = [], nbytes
        for s in slots:
            take = min(left, self.slot_bytes)
            out.append(self.slot(s)[:take])
            left -= take
        return out

    def close(self) -> None:
        """Unpin and drop the memory. Tensors still viewing slots keep their segment alive."""
        segments, self._segments = self._segments, []
        if self.pinned:
            for seg in segments:
                _unregister(seg.data_ptr())
        self._maps = []

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPool({self.num_slots} x {self.slot_bytes} B slots, {self.free_slots} free, "
                f"{'pinned' if self.pinned else 'pageable'})")
