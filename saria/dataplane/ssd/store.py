"""The SSD store: opaque objects striped over one preallocated file per drive, found again after a
restart, verified on every read, never served when their bytes are not the ones written.

The whole design (on-disk format, write and read protocols, recovery, identity and wiping, lost
drives, backends, durability) is in docs/ssd.md. In short, for a reader of this file:

* An object (``key``: up to 64 bytes) is a list of parts of ``part_bytes``; part ``i`` lands in a
  free slot on drive ``(start + i) % D`` (``alloc``), so its parts are read from several drives at
  once. The on-disk format is in ``format``.
* A write (:class:`~saria.dataplane.ssd.jobs.WriteJob`, on the writer pool) allocates one slot per
  part, writes the payloads, syncs, writes the committed headers (the commit marker), syncs, and
  publishes the object in the index (:meth:`SSDStore._finish_write`). A failure erases what was
  written and frees the slots: nothing of it is served.
* A read (checked and started by ``reads``; :class:`~saria.dataplane.ssd.jobs.ReadJob` on the reader
  pool) pins the object (a delete or overwrite frees its slots only when the last read ends), reads
  each part into its destination and checks its checksum there; evidence against the stored copy
  drops the object.
* Misuse of caller memory is refused before any I/O (``checks``, ``memory``) and drops nothing.
* Start-up (locking, opening, scanning, recovery, wiping, sizing) is in ``startup``; drives whose
  file is deleted or replaced while open are taken out of service by ``lost``.
* With a ``sealer`` every part is sealed (AES-256-GCM, ``sealing``) instead of checksummed, a part
  whose tag fails is a miss that drops its object, and no message names an object.

Threads: the index, the allocator, ``_pending`` / ``_tombstones`` and ``_lost`` change under
``_lock``; header erasures and payload I/O run outside it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from saria.dataplane.ssd import lost, reads
from saria.dataplane.ssd.backends import PayloadIO, open_payload_io
from saria.dataplane.ssd.checks import check_checksums, check_key, check_options, split
from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import ObjectNotFound, StoreClosed, StoreConfigError, StoreFull
from saria.dataplane.ssd.files import DriveFile, IoOps
from saria.dataplane.ssd.format import EMPTY_HEADER
from saria.dataplane.ssd.index import IndexEntry, ObjectInfo, PartLocation
from saria.dataplane.ssd.jobs import WorkerStreams, WriteJob, ready_events
from saria.dataplane.ssd.keys import describe_key
from saria.dataplane.ssd.memory import Claim, MemoryInUse, WritableProbe
from saria.dataplane.ssd.sealing import SealedParts
from saria.dataplane.ssd.startup import Startup
from saria.dataplane.devices import pool_initializer, resolve
from saria.seal import Sealer

log = logging.getLogger("saria.dataplane.ssd")


class SSDStore:
    """Objects on NVMe drives, one preallocated file per drive path (docs/ssd.md).

    Args:
        paths: one existing, writable directory per drive, a real directory (not a symbolic
            link) of the user running saria that group and other cannot write; the store keeps
            ``saria-ssd-store.bin`` in each (created 0600 and preallocated when missing; never
            followed through a link: docs/security.md, "Files on the box"); each directory is
            locked while the store is open (a second store on it fails with :class:`StoreConfigError`).
        capacity_bytes_per_drive: size of each drive file; it holds
            ``(capacity - 4096) // (4096 + part_bytes)`` slots.
        part_bytes: payload bytes per slot, the striping unit (a multiple of 4096).
        backend: ``"auto"`` (kvikio when CUDA and kvikio are there, else POSIX), ``"posix"``, or
            ``"kvikio"`` (an error where it cannot run, and with a ``sealer``: a sealed store's parts
            move by POSIX, ``auto`` picks it).
        direct: O_DIRECT policy: ``"auto"`` (use it where the filesystem allows it), ``True``
            (required: an error where refused), ``False`` (buffered I/O).
        durable: ``fdatasync`` payloads before headers and headers before a write completes.
        read_threads, write_threads: sizes of the separate reader and writer pools.
        io_ops: the syscall layer (default the real ``os`` calls); tests pass a wrapper to inject faults.
        identity: what the objects are written for (at most 3,000 UTF-8 bytes; ``""``: none). Drive
            files written for another identity are wiped at open (docs/ssd.md, "Identity").
        sealer: a :class:`saria.seal.Sealer` of kind ``"ssd"`` made for this ``identity``: every part
            is then sealed, and only parts sealed under its key file are served (docs/ssd.md,
            "Sealed objects"). ``None``: unsealed, as before.
        device: the engine's device, made current on every reader and writer thread before its
            first task (:mod:`saria.dataplane.devices`; their bounce buffers are registered with
            CUDA there). ``None``: the device current on the thread that opens the store.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], capacity_bytes_per_drive: int,
                 part_bytes: int = 4 << 20, *, backend: str = "auto", direct: bool | str = "auto",
                 durable: bool = True, read_threads: int = 8, write_threads: int = 2,
                 io_ops: IoOps | None = None, identity: str = "", sealer: Sealer | None = None,
                 device: torch.device | str | None = None):
        self._geometry, dirs = check_options(paths, capacity_bytes_per_drive, part_bytes, direct, read_threads,
                                             write_threads, identity, sealer, backend)
        self._durable = bool(durable)
        self._identity = identity
        self._counters = SSDCounters()
        self._streams = WorkerStreams()
        self._lock = threading.Lock()
        self._index: dict[bytes, IndexEntry] = {}
        self._pending: dict[bytes, int] = {}  # writes in flight per key
        self._tombstones: dict[bytes, int] = {}  # key -> in-flight writes below this generation are void
        self._quarantined: set[tuple[int, int]] = set()  # slots whose header could not be erased
        self._lost: dict[int, str] = {}  # drive -> what happened to its file (the drive is out of service)
        self._memory = MemoryInUse()  # caller memory of the parts in flight
        self._probe = WritableProbe()
        self._closed = False
        self._files: list[DriveFile] = []
        self._payload: PayloadIO | None = None
        self._sealing: SealedParts | None = None
        self._read_threads = read_threads
        bind = pool_initializer(resolve(device))
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="saria-ssd-read", initializer=bind)
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="saria-ssd-write", initializer=bind)
        try:
            startup = Startup(self._geometry, identity, io_ops or IoOps(), self._counters, self._durable,
                              None if sealer is None else sealer.key_id)
            for d in dirs:
                self._files.append(startup.open_drive(d, direct))
            started = startup.recover(self._files, self._readers, self._erase_header)
            self._index, self._alloc, self._next_gen = started.index, started.alloc, started.next_gen
            self._quarantined |= started.quarantined
            # sealed parts go through the CPU: their store moves payloads by POSIX
            self._payload = open_payload_io("posix" if sealer else backend, self._files, part_bytes, self._counters)
            if sealer is not None:
                self._sealing = SealedParts(sealer, self._files, part_bytes)
        except BaseException as exc:
            self._shutdown(sync=False)
            if isinstance(exc, OSError):  # a drive failing while its headers are scanned or written
                raise StoreConfigError(f"SSD store start-up failed: {exc}") from exc
            raise

    # ---------------------------------------------------------------- public API

    @property
    def paths(self) -> list[Path]:
        """The drive files, in drive order."""
        return [f.path for f in self._files]

    @property
    def part_bytes(self) -> int:
        return self._geometry.part_bytes

    @property
    def identity(self) -> str:
        """What this store's objects are written for (recorded in every drive file's superblock)."""
        return self._identity

    @property
    def sealed(self) -> bool:
        """Whether parts are sealed (AES-256-GCM under the store's key file) instead of checksummed."""
        return self._sealing is not None

    @property
    def backend_name(self) -> str:
        """The payload backend in use: ``"posix"``, ``"kvikio (GDS)"`` or ``"kvikio (compat mode)"``
        (kvikio's own POSIX path: no GPUDirect), as ``saria doctor`` reports it."""
        assert self._payload is not None
        return self._payload.name

    @property
    def direct_io(self) -> bool:
        """Whether every drive file uses O_DIRECT (``False``: buffered I/O on at least one)."""
        return all(f.direct for f in self._files)

    @property
    def read_threads(self) -> int:
        """Threads of the reader pool (how many part reads run at once)."""
        return self._read_threads

    def part_extents(self, key: bytes) -> list[tuple[Path, int, int]]:
        """Where the payload of each part of the object under ``key`` lies: ``(drive file, byte
        offset, length)`` per part, in part order (offsets are 4 KiB aligned). For benchmarks that
        read the same bytes without the store; :class:`ObjectNotFound` if there is no such object."""
        check_key(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise self._not_found(key)
            return [(self._files[p.drive].path, self._geometry.payload_offset(p.slot), p.length)
                    for p in entry.info.parts]

    @property
    def total_parts(self) -> int:
        """Slots on the drives in service (each holds one part)."""
        with self._lock:
            return self._geometry.slots * (len(self._files) - len(self._lost))

    @property
    def lost_drives(self) -> dict[Path, str]:
        """Drive files taken out of service, each with what happened to it (e.g. ``"was deleted"``)."""
        return lost.lost_drives(self)

    def check_drives(self) -> dict[Path, str]:
        """Check now that each drive file in service is still the file at its path (one ``stat``
        each); take any that was deleted or replaced out of service (docs/ssd.md, "Lost drives").
        Returns :attr:`lost_drives`. Writes run this check on their own drives before publishing."""
        self._check_open()
        return lost.check_drives(self)

    @property
    def free_parts(self) -> int:
        """Slots free now (slots of objects being read after a delete are freed when reads end)."""
        with self._lock:
            return self._alloc.free

    def counters(self) -> dict[str, Any]:
        """A snapshot of the counters (:class:`~saria.dataplane.ssd.counters.SSDCounters`)."""
        return self._counters.snapshot()

    def contains(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            return key in self._index

    def info(self, key: bytes) -> ObjectInfo | None:
        """Where the committed object under ``key`` lives, or ``None``."""
        check_key(key)
        with self._lock:
            entry = self._index.get(key)
            return entry.info if entry else None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def write(self, key: bytes, data: torch.Tensor | Sequence[torch.Tensor],
              checksums: Sequence[int] | None = None) -> "Future[ObjectInfo | None]":
        """Store ``data`` under ``key``; the Future resolves once the object is committed.

        ``data`` is a contiguous uint8 tensor (cut into parts of ``part_bytes``) or a list of
        per-part tensors (every part ``part_bytes`` long except the last, e.g. host pool slots).
        ``checksums`` are the parts' ``saria.kernels.checksum`` values if the caller has them
        (they are trusted, not recomputed; a part's ``None``: computed here; a sealed store ignores
        them: each part's tag replaces its checksum). The source must stay unchanged until the Future is done.

        Sources may share memory with each other (the same tensor twice is fine: writes only read
        it) but not with the destination of a read in flight.

        Raises at once (nothing changed): ``TypeError`` / ``ValueError`` for bad input (including
        a source overlapping a read destination in flight), :class:`StoreFull` when not enough
        slots are free, :class:`DriveLost` when every drive is out of service,
        :class:`StoreClosed`. The Future resolves to the new :class:`ObjectInfo`; to ``None`` if the
        key was deleted while this write was in flight or a later write of it committed first
        (nothing of this one is kept); or fails with :class:`ObjectWriteError` (caused by
        :class:`DriveLost` when a drive file it used vanished).
        """
        check_key(key)
        named = split(data, self._geometry.part_bytes)
        parts = [t for _, t in named]
        sums = check_checksums(checksums, len(parts))
        with self._lock:
            self._check_open()
            none_left = lost.none_left_error(self)
            if none_left is not None:
                raise none_left
            claim = self._memory.claim(f"the write of {self._name(key)}", False, named)
            try:
                slots = self._alloc.allocate(len(parts))
            except StoreFull:
                self._memory.release(claim)
                self._counters.add(store_full=1)
                raise
            generation = self._next_gen
            self._next_gen += 1
            self._pending[key] = self._pending.get(key, 0) + 1
        job = WriteJob(self, key, generation, parts, slots, sums, claim, ready_events(parts))
        for i in range(len(parts)):
            self._writers.submit(job.write_part, i)
        return job.future

    def read(self, key: bytes, out: torch.Tensor | Sequence[torch.Tensor]) -> "Future[ObjectInfo]":
        """Read the object under ``key`` into ``out``; the Future resolves to its :class:`ObjectInfo`.

        ``out`` is a contiguous uint8 tensor (CPU or CUDA) of at least the object's length (part
        ``i`` lands at ``i * part_bytes``; bytes past the object are not touched) or a list of
        per-part tensors, each at least that part's length. The bytes a read writes (part ``i``'s
        length at the start of ``out[i]``) must not overlap each other, nor memory that another
        read or write in flight uses, and CPU destinations must be writable. ``out`` must not be
        used until the Future is done; on CUDA the read waits for work already queued on the
        caller's stream.

        Raises at once, with nothing read and the object still served: :class:`ObjectNotFound`,
        ``TypeError`` / ``ValueError`` for a bad ``out`` (wrong type, dtype, device, size, layout,
        overlapping or read-only memory), :class:`StoreClosed`. The Future fails with
        :class:`ObjectCorrupt` (checksum mismatch; in a sealed store :class:`ObjectUnauthentic`: a
        tag that fails or a retired key epoch) or :class:`ObjectUnreadable` (I/O error, short
        read), and the object is then dropped; or with ``ValueError`` (the object kept) when the
        kernel finds a destination page read-only (EFAULT) that the up-front probe missed.
        """
        job = reads.start_read(self, key, out)
        reads.submit(self, job)
        return job.future

    def read_many(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | Sequence[torch.Tensor]]
                  ) -> "list[Future[ObjectInfo] | BaseException]":
        """Read several objects in one submission: ``read(keys[i], outs[i])`` for each ``i``, with
        every part of every object queued on the reader pool at once, object after object (the
        first objects complete first). Returns, per object, its Future, or the exception ``read``
        would have raised for it (that object is not read; the others are). Same contract as
        :meth:`read` otherwise; ``StoreClosed`` is raised, not returned."""
        return reads.read_many(self, keys, outs)

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (and void writes of it still in flight). ``True`` if there was anything.

        Its headers are erased and its slots freed now, or when the last read in progress ends.
        """
        check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.pop(key, None)
            pending = key in self._pending
            if pending:
                self._tombstones[key] = self._next_gen
            release = entry is not None and self._retire(entry)
        if release:
            self._release(entry.info.parts)
        return entry is not None or pending

    def sync(self) -> None:
        """Make the deletes and the completed writes so far durable: ``fdatasync`` every drive file
        in service (whatever ``durable`` says: the caller asks for it)."""
        with self._lock:
            self._check_open()
            files = [f for drive, f in enumerate(self._files) if drive not in self._lost]
        for f in files:
            f.sync()

    def close(self) -> None:
        """Wait for reads and writes in flight, check the drive files are still in place (a vanished
        one is taken out of service and logged), sync the others (``durable``), close the files.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown(sync=self._durable)

    def __enter__(self) -> "SSDStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _shutdown(self, sync: bool) -> None:
        self._closed = True
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        try:
            if sync:
                for d, f in enumerate(self._files):
                    if lost.drive_lost(self, d) is None:
                        f.sync()
        finally:
            self._probe.close()
            if self._payload is not None:
                self._payload.close()
            if self._sealing is not None:
                self._sealing.close()
            for f in self._files:
                f.close()

    def _name(self, key: bytes) -> str:
        """How messages name the object under ``key``: its kind and key length, never the key (it
        holds a chunk hash or a chunk id)."""
        return f"sealed {describe_key(key)}" if self._sealing is not None else describe_key(key)

    def _not_found(self, key: bytes) -> ObjectNotFound:
        return ObjectNotFound(f"no object under that key ({len(key)} bytes)")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the SSD store is closed")

    def _retire(self, entry: IndexEntry) -> bool:
        """Under the lock: mark ``entry`` out of the index; ``True`` if its slots can go now."""
        entry.dead = True
        return entry.pins == 0

    def _end_read(self, entry: IndexEntry, claim: Claim, drop: bool = False) -> None:
        """End one read of ``entry``: release its memory claim and its pin; ``drop`` removes the
        object from the index (its copy is bad)."""
        with self._lock:
            self._memory.release(claim)
            if drop and self._index.get(entry.info.key) is entry:
                del self._index[entry.info.key]
                entry.dead = True
            entry.pins -= 1
            release = entry.dead and entry.pins == 0
        if release:
            self._release(entry.info.parts)

    def _release_memory(self, claim: Claim) -> None:
        with self._lock:
            self._memory.release(claim)

    def _erase_header(self, drive: int, slot: int) -> bool:
        try:
            self._files[drive].write_block(EMPTY_HEADER, self._geometry.header_offset(slot))
            return True
        except OSError as exc:
            log.warning("SSD drive file %s slot %d: header not erased (%s); slot set aside until restart",
                        self._files[drive].path, slot, exc)
            return False

    def _release(self, parts: Sequence[PartLocation] | Sequence[tuple[int, int]]) -> None:
        """Erase the headers of these slots and free them (a slot that cannot be erased is set
        aside; slots of a drive out of service are left alone: its file is gone)."""
        slots = [(p.drive, p.slot) if isinstance(p, PartLocation) else p for p in parts]
        slots = [s for s in slots if s[0] not in self._lost]
        ok = [s for s in slots if self._erase_header(*s)]
        with self._lock:
            self._alloc.release(ok)
            self._quarantined.update(set(slots) - set(ok))

    def _finish_write(self, key: bytes, generation: int, info: ObjectInfo | None) -> ObjectInfo | None:
        """Publish a written object (``None``: it failed). ``None`` back if it was overtaken;
        :class:`DriveLost` (the object released) if one of its drives went out of service first."""
        old = None
        with self._lock:
            n = self._pending[key] - 1
            if n:
                self._pending[key] = n
            else:
                del self._pending[key]
            current = self._index.get(key)
            gone = None if info is None else next((p.drive for p in info.parts if p.drive in self._lost), None)
            void = info is None or gone is not None or generation < self._tombstones.get(key, -1) or (
                current is not None and current.info.generation > generation)
            if not n:
                self._tombstones.pop(key, None)
            if not void:
                self._index[key] = IndexEntry(info)
                if current is not None and self._retire(current):
                    old = current
        if info is not None and void:
            self._release(info.parts)
            if gone is not None:
                raise lost.lost_error(self, gone)
            return None
        if old is not None:
            self._release(old.info.parts)
        return info
