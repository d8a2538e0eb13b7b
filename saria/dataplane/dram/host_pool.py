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

import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from saria.dataplane.dram.numa import bind_memory

PAGE = 4096
log = logging.getLogger("saria.dataplane.dram")


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
        return {name: getattr(self, name) for name in self.__dataclass_fields__}  # numbers: no deep copy (asdict)


def physical_memory_bytes() -> int:
    """This machine's memory (what a host pool can never exceed)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart torch already loaded (``RTLD_NOLOAD``: never loads one), or ``None``."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call we reported ourselves: left set, the
    next kernel launch's check in torch raises it there, far from its cause (seen on an H200: a
    failed cudaHostRegister surfaced as a tensor ``clone`` failing "memory range already mapped").
    Uses the libcudart torch already loaded; does nothing if none is found."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


# cudaDevAttrCanUseHostPointerForRegisteredMem (driver_types.h): the device reads registered host
# memory at the CPU's own virtual address
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91


def cuda_host_pointer_attribute(index: int) -> int | None:
    """GPU ``index``'s ``cudaDevAttrCanUseHostPointerForRegisteredMem`` (1: yes), or ``None`` where
    CUDA cannot be asked."""
    lib = _loaded_cudart()
    if lib is None:
        return None
    value = ctypes.c_int(-1)
    if lib.cudaDeviceGetAttribute(ctypes.byref(value), CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, index) != 0:
        _clear_last_cuda_error()
        return None
    return value.value


def cuda_device_pointer(host_address: int, index: int) -> int | None:
    """The device pointer on GPU ``index`` of registered host memory at ``host_address``
    (``cudaHostGetDevicePointer``), or ``None`` where CUDA gives none."""
    lib = _loaded_cudart()
    if lib is None:
        return None
    pointer = ctypes.c_void_p()
    with torch.cuda.device(index):
        err = lib.cudaHostGetDevicePointer(ctypes.byref(pointer), ctypes.c_void_p(host_address), 0)
    if err != 0:
        _clear_last_cuda_error()
        return None
    return pointer.value or 0


def host_address_refusal(device: torch.device | str, segments: Sequence[int], pinned: bool, *,
                         attribute: Callable[[int], int | None] = cuda_host_pointer_attribute,
                         device_pointer: Callable[[int, int], int | None] = cuda_device_pointer) -> str | None:
    """Why kernels on ``device`` cannot read a host pool's registered segments (host addresses
    ``segments``) by their host address, or ``None`` when they can. The layer-wise copies do (the
    scattered kernel's work array holds host addresses of slots, :func:`saria.kernels.prepare_scattered`):
    on CUDA that needs ``cudaDevAttrCanUseHostPointerForRegisteredMem`` and, for each segment, a
    device pointer equal to its host address (``cudaHostGetDevicePointer``); on the CPU the device
    is the host. Asked once, at start; ``attribute`` and ``device_pointer`` are CUDA's answers
    (tests feed their own)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else 0
    value = attribute(index)
    if value is None:
        return f"cannot ask CUDA whether GPU {index} reads registered host memory at its host address"
    if value != 1:
        return (f"GPU {index} cannot read registered host memory at its host address "
                f"(cudaDevAttrCanUseHostPointerForRegisteredMem is {value})")
    if not pinned:
        return "the host pool is not registered with CUDA (pageable memory)"
    for address in segments:
        mapped = device_pointer(address, index)
        if mapped != address:
            where = "none" if mapped is None else f"{mapped:#x}"
            return f"a host pool segment at {address:#x} has device pointer {where} on GPU {index}, not its host address"
    return None


class HostRegistry:
    """Every host range a :class:`HostPool` has registered, in this process: the one place that
    calls ``cudaHostRegister`` / ``cudaHostUnregister``, and the CPU twin of CUDA's own bookkeeping.

    CUDA refuses to register a range that overlaps one still registered (error 712,
    ``cudaErrorHostMemoryAlreadyRegistered``); a range left registered after its memory is unmapped
    poisons the next mapping at that address. The registry refuses the same overlap on every
    machine (on one without CUDA nothing is pinned, but pools still register their ranges here), and
    an unregistration of a range it does not hold (a double unregistration). Tests read
    :meth:`ranges` to check that every registered range is unregistered exactly once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[int, bool]] = {}  # start -> (bytes, pinned with CUDA)
        # ranges of pools garbage collection dropped, with their memory: unregistered by whichever
        # call holds the lock next (release(wait=False))
        self._orphans: deque[tuple[list[int], object]] = deque()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._drain()
            try:
                yield
            finally:
                self._drain()

    def register(self, ptr: int, nbytes: int, pin: bool) -> None:
        if nbytes < 1:
            raise ValueError(f"cannot register {nbytes} bytes")
        with self._locked():
            for start, (length, _) in self._ranges.items():
                if start < ptr + nbytes and ptr < start + length:
                    raise RuntimeError(
                        f"host range [{ptr:#x}, +{nbytes}) overlaps [{start:#x}, +{length}), which is still "
                        "registered (CUDA error 712, cudaErrorHostMemoryAlreadyRegistered): a pool's memory was "
                        "unmapped without unregistering it")
            if pin:
                err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
                if err != 0:
                    _clear_last_cuda_error()
                    raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err} "
                                       "(too much pinned memory? try a smaller pool or segment size)")
            self._ranges[ptr] = (nbytes, pin)

    def unregister(self, ptr: int) -> None:
        with self._locked():
            self._unregister(ptr)

    def release(self, starts: list[int], keep: object = None, *, wait: bool = True) -> None:
        """Unregister every range in ``starts`` (emptying the list), and only then let go of
        ``keep``, the memory they cover: a pool's ``close``, or its weakref finalizer when a pool
        nobody closed is collected. Collection runs inside any code, a registry call on this very
        thread included (seen: a pool dropped while ``register`` held the lock, a deadlock), so a
        finalizer passes ``wait=False``: the ranges queue when the lock is taken and the call that
        holds it (or the next one) unregisters them before it lets go; their memory stays mapped until
        then. With ``wait`` the first failure is raised (after trying the others); without, logged."""
        if wait:
            with self._locked():
                self._unregister_each(starts)
            return
        self._orphans.append((starts, keep))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def ranges(self) -> list[tuple[int, int, bool]]:
        """``(start, bytes, pinned)`` of every range registered now."""
        with self._locked():
            return [(start, length, pinned) for start, (length, pinned) in sorted(self._ranges.items())]

    def _unregister(self, ptr: int) -> None:
        entry = self._ranges.pop(ptr, None)
        if entry is None:
            raise RuntimeError(f"host range at {ptr:#x} is not registered (unregistered twice?)")
        if entry[1]:
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if err != 0:
                _clear_last_cuda_error()
                raise RuntimeError(f"cudaHostUnregister of the range at {ptr:#x} failed with CUDA error {err}")

    def _unregister_each(self, starts: list[int]) -> None:
        errors = []
        while starts:
            try:
                self._unregister(starts.pop())
            except Exception as exc:  # keep unregistering the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def _drain(self) -> None:
        while self._orphans:  # an append during the drain (collection inside it) is drained too
            starts, _keep = self._orphans.popleft()
            try:
                self._unregister_each(starts)
            except Exception as exc:  # a finalizer's failure has no caller to raise to
                log.error("unregistering a collected pool's host memory failed: %s", exc)


REGISTRY = HostRegistry()


class HostPool:
    """Fixed-size slots of (pinned) host memory with a thread-safe allocator.

    ``numa_node``: the NUMA node whose memory the segments prefer (``mbind`` before their pages are
    first touched, :mod:`~saria.dataplane.dram.numa`; :func:`~saria.dataplane.dram.numa.pool_numa_node`
    gives the engine's GPU's); ``None``: not bound. ``numa_node`` afterwards is the node the pool
    is bound to, ``None`` where the system refused (one warning line)."""

    def __init__(self, capacity_bytes: int, slot_bytes: int = 4 << 20, *, segment_bytes: int = 1 << 30,
                 pin: bool | None = None, evict: Callable[[int], None] | None = None, evict_attempts: int = 3,
                 numa_node: int | None = None):
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
        if capacity_bytes < slot_bytes and capacity_bytes != 0:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must hold at least one {slot_bytes}-byte slot "
                             "(or be 0: an empty pool, for an engine without a DRAM tier)")
        if segment_bytes < slot_bytes:
            raise ValueError(f"segment_bytes ({segment_bytes}) must hold at least one slot ({slot_bytes})")
        if evict_attempts < 0:
            raise ValueError("evict_attempts must be >= 0")
        if numa_node is not None and (isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < 0):
            raise ValueError(f"numa_node must be a node number (>= 0) or None, got {numa_node!r}")
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("pin=True needs CUDA; this machine has none (pin=None pins when it can)")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.pinned = cuda if pin is None else pin
        self.numa_node = numa_node
        self._evict = evict
        self._evict_attempts = evict_attempts
        self._lock = threading.Lock()
        # FIFO of free slots: taken from the front in one slice (a step takes hundreds), given back at the end
        self._free: list[int] = list(range(self.num_slots))
        self._used = bytearray(self.num_slots)
        self.counters = HostPoolCounters()
        self._maps: list[mmap.mmap] = []
        self._registered: list[int] = []
        self._segments: list[torch.Tensor] = []
        # Unregisters exactly once: at close(), or when a pool nobody closed is collected (before
        # its memory is unmapped; an unmapped range left registered breaks the next pool there).
        self._release = weakref.finalize(self, REGISTRY.release, self._registered, self._maps, wait=False)
        self._release.atexit = False  # at interpreter exit the process's registrations go with it
        per_segment = segment_bytes // slot_bytes
        try:
            for first in range(0, self.num_slots, per_segment):
                nbytes = min(per_segment, self.num_slots - first) * slot_bytes
                mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self._maps.append(mm)
                seg = torch.frombuffer(mm, dtype=torch.uint8)
                self._bind(seg.data_ptr(), nbytes)  # before registration faults the pages in
                REGISTRY.register(seg.data_ptr(), nbytes, pin=self.pinned)
                self._registered.append(seg.data_ptr())
                self._segments.append(seg)
        except BaseException:
            self.close()
            raise
        self._per_segment = per_segment

    def _bind(self, address: int, nbytes: int) -> None:
        if self.numa_node is None:
            return
        err = bind_memory(address, nbytes, self.numa_node)
        if err:
            log.warning("host pool: not NUMA-bound to node %d (mbind refused: %s); its memory goes where the OS "
                        "puts it", self.numa_node, os.strerror(err))
            self.numa_node = None

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
                    free, used = self._free, self._used
                    slots = free[:n]
                    del free[:n]
                    for s in slots:
                        used[s] = 1
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
            used, num_slots = self._used, self.num_slots
            if slots and min(slots) >= 0 and max(slots) < num_slots and all(map(used.__getitem__, slots)) \
                    and len(set(slots)) == len(slots):  # the common case, checked at C speed: all good
                for s in slots:
                    used[s] = 0
                self._free.extend(slots)
                self.counters.slots_freed += len(slots)
                return
            for s in slots:
                if not 0 <= s < num_slots:
                    raise ValueError(f"slot {s} is not in this pool (0..{num_slots - 1})")
                if not used[s]:
                    raise ValueError(f"slot {s} is not allocated (double free?)")
            if len(set(slots)) != len(slots):
                raise ValueError("the same slot is listed twice")
            for s in slots:
                used[s] = 0
            self._free.extend(slots)
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

    def segment_addresses(self) -> list[int]:
        """The host address of each registered segment."""
        return [seg.data_ptr() for seg in self._segments]

    def locate(self, s: int) -> tuple[torch.Tensor, int]:
        """Where slot ``s`` lives: its segment (one uint8 tensor of contiguous, pinned-when-CUDA host
        memory) and its byte offset in it. For copies that address many slots at once (the
        layer-wise reload reads each layer's pages straight out of the slots, one copy per segment)."""
        if not 0 <= s < self.num_slots:
            raise ValueError(f"slot {s} is not in this pool (0..{self.num_slots - 1})")
        seg, i = divmod(s, self._per_segment)
        return self._segments[seg], i * self.slot_bytes

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
        """Unregister (unpin) and drop the memory; idempotent. Tensors still viewing slots keep
        their segment mapped (as pageable memory): no copy may still be reading or writing them."""
        self._segments = []
        if self._release.detach():
            REGISTRY.release(self._registered, self._maps)
            self._maps.clear()

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPool({self.num_slots} x {self.slot_bytes} B slots, {self.free_slots} free, "
                f"{'pinned' if self.pinned else 'pageable'})")
