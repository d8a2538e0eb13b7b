"""The SSD store: opaque objects striped over one preallocated file per drive, found again after a
restart, verified on every read, never served when their bytes are not the ones written.

An object (``key``: up to 64 bytes, e.g. chunk hash + object kind) is a list of parts of
``part_bytes`` (the last one may be shorter); part ``i`` lands in a free slot on drive
``(start + i) % D`` (see :class:`~saria.dataplane.ssd.alloc.SlotAllocator`), so the parts of one
object are read in parallel from several drives. The on-disk format is in ``ssd_format``.

Write protocol (one Future per object, on the writer pool):

1. allocate one free slot per part (free slots always have an erased, i.e. all-zero, header);
2. write every payload in parallel (checksums computed with ``saria.kernels.checksum`` on the
   source's device when the caller did not pass them);
3. ``fdatasync`` each touched drive file (``durable=True``);
4. write the committed headers, then ``fdatasync`` again: the committed header is the commit marker;
5. publish the object in the index. A failure anywhere erases what was written, frees the slots,
   counts the error and fails the Future with :class:`ObjectWriteError`: nothing of it is served.

Reads pin the object (a delete or overwrite waits for its readers before its slots are reused),
read each part straight into the destination on the reader pool, and check each part's checksum
on the destination's device. A mismatch, an I/O error or a short read that cannot be completed
fails the Future (:class:`ObjectCorrupt` / :class:`ObjectUnreadable`) and drops the object: its
headers are erased and its slots freed.

Caller memory (``ssd_memory``): a read's destinations must not overlap each other nor any memory
another read or write in flight uses, and a write's source must not overlap a read destination in
flight; CPU destinations must be writable. Such a misuse is refused with ``ValueError`` before any
I/O, and the object stays served: only evidence against the stored copy drops it.

Drives: each drive directory is locked (``flock`` on the directory) while the store is open, so a
second store on it fails at open. Before a write is published, the store checks that each drive
file it touched is still the file at its path (one ``stat``); a drive file found deleted or
replaced is taken out of service: the write fails, the objects with a part on it leave the index
(they are lost), one error line is logged, and writes go on with the drives left (``DriveLost``
once none is left). :meth:`SSDStore.check_drives` runs the same check on demand.

At open every slot header is scanned; each key's newest complete generation is served, and
everything else (half-committed writes, torn or flipped headers, parts beyond the end of a
truncated file, older generations) is erased and counted (``dropped_at_open``,
``corrupt_headers``). A truncated drive file is re-extended.

Identity: a store is opened for an ``identity`` (text of at most 3,000 UTF-8 bytes, e.g. a
canonical JSON of model, dtype, page geometry, TP size and rank; ``""``: none), which every drive
file's superblock records. Objects written for another identity are never served: at open, a drive
file whose content is not this store's to serve is *wiped* (truncated to nothing, then preallocated
and formatted like a new file; the directory lock makes that safe), with one warning line per file
naming what it was written for and what this store is, and how many objects went (counters
``wiped_files``, ``wiped_at_open``). With an identity given the store is a cache that must start,
so no content of a drive file refuses the start-up; with ``""`` the refusals of stores from before
identities stay. Per drive file, by its superblock:

=======================================================  =======================  =========================
superblock                                               identity given           identity ``""``
=======================================================  =======================  =========================
this identity, this ``part_bytes``                       served                   served
this identity, other ``part_bytes``                      wiped                    :class:`StoreConfigError`
other identity (a version-1 superblock has ``""``)        wiped                    wiped
damaged, not saria's, or of a newer format version       wiped (count unknown)    :class:`StoreConfigError`
blank (all zeros) over committed headers                 wiped                    served
none (a new file, or one shorter than a superblock)      formatted                formatted
=======================================================  =======================  =========================

An I/O error reading a superblock is a drive failure, not a foreign file: it fails the start-up
(:class:`StoreConfigError`) either way. Parts on other drives of an object striped over a wiped
file are incomplete and dropped as such (``dropped_at_open``): nothing half is served.

Durability: with ``durable=True`` a write's Future completes only after its headers are synced.
Deletes and the erasures that free slots are not synced on their own (the next write's sync or
``close`` syncs them); a crash before that can bring a deleted object back, whole and verified.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from saria.dataplane.ssd.alloc import SlotAllocator
from saria.dataplane.ssd.backends import DirectoryLock, DriveFile, IoOps, O_DIRECT, PayloadIO, open_payload_io, probe_direct_io
from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import DriveLost, ObjectNotFound, StoreClosed, StoreConfigError, StoreFull
from saria.dataplane.ssd.format import (BLOCK, EMPTY_HEADER, FILE_NAME, HEADER_BYTES, MAX_KEY_BYTES, SUPERBLOCK_BYTES, Geometry,
                         SlotHeader, SuperBlock, decode_header, encode_identity)
from saria.dataplane.ssd.index import IndexEntry, ObjectInfo, PartLocation, assemble
from saria.dataplane.ssd.jobs import ReadJob, WriteJob
from saria.dataplane.ssd.memory import Claim, MemoryInUse, WritableProbe

log = logging.getLogger("saria.dataplane.ssd")

CHECKSUM_LIMIT = 1 << 64


class _WorkerStreams:
    """A side CUDA stream per worker thread and device: the store's copies and checksums on CUDA
    tensors neither queue behind the caller's streams nor hold them up (each worker waits only for
    its own stream, when the checksum returns)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def on(self, t: torch.Tensor) -> contextlib.AbstractContextManager:
        if t.device.type != "cuda":
            return contextlib.nullcontext()
        streams = self._local.__dict__.setdefault("streams", {})
        if t.device not in streams:
            streams[t.device] = torch.cuda.Stream(t.device)
        return torch.cuda.stream(streams[t.device])


@dataclass
class _DriveScan:
    """What the open-time scan of one drive file found."""

    found: list[tuple[int, int, SlotHeader]] = field(default_factory=list)  # committed (drive, slot, header)
    corrupt: list[int] = field(default_factory=list)  # slots whose header is damaged or unreadable
    partial: list[int] = field(default_factory=list)  # the slot a truncation cut mid-payload
    foreign: str | None = None  # what the file was written for, when it is not this store's to serve
    foreign_objects: set[tuple[bytes, int]] | None = None  # (key, generation) it has parts of (None: unknown)


def _written_for(identity: str, part_bytes: int) -> str:
    """How a log line names what a drive file is (or was) written for."""
    return f"{f'identity {identity!r}' if identity else 'no identity'} with part_bytes={part_bytes}"


def _check_key(key: Any) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{what} must be a contiguous tensor, got layout {t.layout}")
    if not t.is_contiguous():
        expanded = any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))
        note = " (an expanded tensor: stride 0 repeats the same bytes)" if expanded else ""
        raise ValueError(f"{what} must be a contiguous tensor, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}{note}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be on CPU or CUDA, not {t.device}")
    return t.reshape(-1)


def _ready_events(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Events on the caller's current CUDA streams, so workers touch CUDA memory only after the
    caller's queued work on it (producing a source, or still reading a destination) is done."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return [torch.cuda.current_stream(d).record_event() for d in devices]


class SSDStore:
    """Objects on NVMe drives, one preallocated file per drive path (module docstring).

    Args:
        paths: one existing, writable directory per drive; the store keeps ``saria-ssd-store.bin``
            in each (created and preallocated when missing); each directory is locked while the
            store is open (a second store on it fails with :class:`StoreConfigError`).
        capacity_bytes_per_drive: size of each drive file; it holds
            ``(capacity - 4096) // (4096 + part_bytes)`` slots.
        part_bytes: payload bytes per slot, the striping unit (a multiple of 4096).
        backend: ``"auto"`` (kvikio when CUDA and kvikio are there, else POSIX), ``"posix"``, or
            ``"kvikio"`` (an error where it cannot run).
        direct: O_DIRECT policy: ``"auto"`` (use it where the filesystem allows it), ``True``
            (required: an error where refused), ``False`` (buffered I/O).
        durable: ``fdatasync`` payloads before headers and headers before a write completes.
        read_threads, write_threads: sizes of the separate reader and writer pools.
        io_ops: the syscall layer (default the real ``os`` calls); tests pass a wrapper to inject faults.
        identity: what the objects are written for (at most 3,000 UTF-8 bytes; ``""``: none). Drive
            files written for another identity are wiped at open (module docstring).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], capacity_bytes_per_drive: int,
                 part_bytes: int = 4 << 20, *, backend: str = "auto", direct: bool | str = "auto",
                 durable: bool = True, read_threads: int = 8, write_threads: int = 2,
                 io_ops: IoOps | None = None, identity: str = ""):
        if isinstance(paths, (str, os.PathLike)) or not len(paths):
            raise ValueError("paths must be a non-empty list of directories, one per drive")
        if not isinstance(part_bytes, int) or part_bytes < BLOCK or part_bytes % BLOCK:
            raise ValueError(f"part_bytes must be a positive multiple of {BLOCK}, got {part_bytes}")
        if direct not in ("auto", True, False):
            raise ValueError(f"direct must be 'auto', True or False, got {direct!r}")
        if read_threads < 1 or write_threads < 1:
            raise ValueError("read_threads and write_threads must be >= 1")
        encode_identity(identity)
        self._geometry = Geometry.for_capacity(int(capacity_bytes_per_drive), part_bytes)
        if self._geometry.slots < 1:
            raise ValueError(f"capacity_bytes_per_drive={capacity_bytes_per_drive} holds no slot: one needs "
                             f"{SUPERBLOCK_BYTES + HEADER_BYTES + part_bytes} bytes with part_bytes={part_bytes}")
        dirs = [Path(p) for p in paths]
        if len({os.path.realpath(d) for d in dirs}) != len(dirs):
            raise ValueError(f"paths must be distinct directories, got {[str(d) for d in dirs]}")
        self._durable = bool(durable)
        self._identity = identity
        self._ops = io_ops or IoOps()
        self._counters = SSDCounters()
        self._streams = _WorkerStreams()
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
        self._read_threads = read_threads
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="saria-ssd-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="saria-ssd-write")
        try:
            for d in dirs:
                self._files.append(self._open_drive(d, direct))
            self._recover()
            self._payload = open_payload_io(backend, self._files, part_bytes, self._counters)
        except BaseException as exc:
            self._shutdown(sync=False)
            if isinstance(exc, OSError):  # a drive failing while its headers are scanned or written
                raise StoreConfigError(f"SSD store start-up failed: {exc}") from exc
            raise

    # ---------------------------------------------------------------- start-up

    def _open_drive(self, directory: Path, direct: bool | str) -> DriveFile:
        """Lock ``directory`` (before anything is created in it), then open its drive file."""
        if not directory.exists():
            raise StoreConfigError(f"SSD path {directory} does not exist")
        if not directory.is_dir():
            raise StoreConfigError(f"SSD path {directory} is not a directory")
        lock = DirectoryLock(directory)
        try:
            return self._open_drive_file(directory, direct, lock)
        except BaseException:
            lock.release()
            raise

    def _open_drive_file(self, directory: Path, direct: bool | str, lock: DirectoryLock) -> DriveFile:
        path = directory / FILE_NAME
        use_direct = False
        if direct is not False:
            try:
                use_direct = probe_direct_io(directory, self._ops)
            except OSError as exc:
                raise StoreConfigError(f"SSD path {directory} is not usable: {exc.strerror or exc}") from exc
            if direct is True and not use_direct:
                raise StoreConfigError(f"direct=True but the filesystem of {directory} refuses O_DIRECT "
                                       "(use direct='auto' to fall back to buffered I/O)")
        existed = path.exists()
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (O_DIRECT if use_direct else 0)
        try:
            fd = self._ops.open(str(path), flags, 0o644)
        except OSError as exc:
            if use_direct and exc.errno == errno.EINVAL and direct == "auto":
                use_direct = False
                fd = self._open_plain(path, flags & ~O_DIRECT)
            else:
                raise StoreConfigError(f"cannot open {path}: {exc.strerror or exc}") from exc
        try:
            f = DriveFile(path, fd, use_direct, self._ops, self._counters, created=not existed, lock=lock)
        except BaseException:
            self._ops.close(fd)
            raise
        try:  # the same file reached through another directory (a hard link)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            f.close()
            raise StoreConfigError(f"{path} is in use by another SSD store (locked)") from exc
        log.info("SSD drive %s: %s I/O", path, "O_DIRECT" if use_direct else "buffered")
        return f

    def _open_plain(self, path: Path, flags: int) -> int:
        try:
            return self._ops.open(str(path), flags, 0o644)
        except OSError as exc:
            raise StoreConfigError(f"cannot open {path}: {exc.strerror or exc}") from exc

    def _recover(self) -> None:
        """Scan every drive's headers, rebuild the index, erase what is not served, size the files."""
        g = self._geometry
        scans = list(self._readers.map(self._scan_drive, range(len(self._files))))
        headers = [h for scan in scans for h in scan.found]
        rec = assemble(headers, g.part_bytes)
        erase = [(d, s) for d, s in rec.erase if s < g.slots]
        for key, info in list(rec.objects.items()):  # parts cut off by a smaller capacity
            if any(p.slot >= g.slots for p in info.parts):
                del rec.objects[key]
                rec.dropped_objects += 1
                erase.extend((p.drive, p.slot) for p in info.parts if p.slot < g.slots)
        for d, scan in enumerate(scans):
            erase.extend((d, s) for s in scan.corrupt + scan.partial if s < g.slots)
            if scan.foreign is not None:  # after every scan: a start-up refused over another file wipes nothing
                self._wipe(d, scan)
        for f in self._files:
            self._size_file(f)
        failed = {(d, s) for d, s in erase if not self._erase_header(d, s)}
        self._quarantined |= failed
        for f in self._files:
            f.write_block(SuperBlock(g.part_bytes, g.slots, self._identity).encode(), 0)
            if self._durable:
                f.sync()
        used = {(p.drive, p.slot) for info in rec.objects.values() for p in info.parts} | failed
        self._alloc = SlotAllocator([[s for s in range(g.slots) if (d, s) not in used]
                                     for d in range(len(self._files))])
        self._index = {k: IndexEntry(info) for k, info in rec.objects.items()}
        self._next_gen = rec.max_generation + 1
        self._counters.add(dropped_at_open=rec.dropped_objects,
                           corrupt_headers=sum(len(scan.corrupt) for scan in scans),
                           wiped_files=sum(scan.foreign is not None for scan in scans),
                           wiped_at_open=len(set().union(*(scan.foreign_objects or () for scan in scans))))
        if rec.dropped_objects:
            log.warning("SSD store: %d object(s) dropped at open (incomplete, inconsistent or stale)",
                        rec.dropped_objects)

    def _scan_drive(self, drive: int) -> _DriveScan:
        """Committed headers, corrupt slots, and the slot cut mid-payload of ``drive``'s file; or,
        when its content is not this store's to serve, what it was written for (module docstring)."""
        f, g = self._files[drive], self._geometry
        size = f.size()
        if size < SUPERBLOCK_BYTES:
            return _DriveScan()
        try:
            sb = SuperBlock.decode(f.read_block(0))
        except ValueError as exc:
            if not self._identity:
                raise StoreConfigError(f"{f.path} is not a usable saria SSD store file: {exc} "
                                       "(remove it to start an empty store)") from exc
            return _DriveScan(foreign=f"unknown (unusable superblock: {exc})")
        if sb is not None and (sb.identity != self._identity or (self._identity and sb.part_bytes != g.part_bytes)):
            return _DriveScan(foreign=_written_for(sb.identity, sb.part_bytes),
                              foreign_objects=self._objects_in(f, Geometry(sb.part_bytes, sb.slots)))
        if sb is not None and sb.part_bytes != g.part_bytes:
            raise StoreConfigError(f"{f.path} was formatted with part_bytes={sb.part_bytes}, the store was "
                                   f"opened with part_bytes={g.part_bytes} (remove the file to reformat)")
        whole = g.whole_slots_in(size)
        if sb is not None and whole < sb.slots:
            log.warning("SSD drive file %s is truncated: %d of its %d slots remain", f.path, whole, sb.slots)
            self._counters.add(truncated_slots=sb.slots - whole)
        found, corrupt = self._read_headers(f, g, whole)
        scan = _DriveScan(found=[(drive, s, h) for s, h in found], corrupt=corrupt)
        scan.partial = [whole] if g.header_offset(whole) < size else []
        if sb is None and self._identity and scan.found:  # objects, but nothing says what they were written for
            return _DriveScan(foreign="unknown (blank superblock)",
                              foreign_objects={(h.key, h.generation) for _, _, h in scan.found})
        return scan

    def _wipe(self, drive: int, scan: _DriveScan) -> None:
        """Wipe ``drive``'s file, whose content is not this store's to serve: truncate it to nothing
        (``_recover`` then preallocates and formats it like a new file) and log one line."""
        f, objects = self._files[drive], scan.foreign_objects
        f.truncate(0)
        what = "an unknown number of objects" if objects is None else f"{len(objects)} object(s)"
        log.warning("SSD drive file %s was written for %s, this store is for %s: not served, wiped (%s dropped)",
                    f.path, scan.foreign, _written_for(self._identity, self._geometry.part_bytes), what)

    @staticmethod
    def _read_headers(f: DriveFile, layout: Geometry, slots: int, log_damage: bool = True
                      ) -> tuple[list[tuple[int, SlotHeader]], list[int]]:
        """The committed headers ``(slot, header)`` among the first ``slots`` slots of ``f`` (laid
        out as in ``layout``), and the slots whose header is damaged or unreadable (each logged if
        ``log_damage``)."""
        found, damaged = [], []
        for s in range(slots):
            try:
                h = decode_header(f.read_block(layout.header_offset(s)))
            except (ValueError, OSError) as exc:
                if log_damage:
                    what = " header unreadable" if isinstance(exc, OSError) else ""
                    log.warning("SSD drive file %s slot %d%s: %s", f.path, s, what, exc)
                damaged.append(s)
                continue
            if h is not None:
                found.append((s, h))
        return found, damaged

    @classmethod
    def _objects_in(cls, f: DriveFile, layout: Geometry) -> set[tuple[bytes, int]]:
        """``(key, generation)`` of every object with a committed header in ``f`` (slots as in
        ``layout``; damaged or unreadable headers are passed over)."""
        found, _ = cls._read_headers(f, layout, layout.whole_slots_in(f.size()), log_damage=False)
        return {(h.key, h.generation) for _, h in found}

    def _size_file(self, f: DriveFile) -> None:
        """Make ``f`` exactly the configured size, fully allocated (clear error if it cannot be)."""
        want = self._geometry.file_bytes
        if f.size() > want:
            f.truncate(want)
        missing = want - f.allocated_bytes()
        try:
            st = os.statvfs(f.path.parent)
            free = st.f_bavail * st.f_frsize
            if missing > free:
                raise OSError(errno.ENOSPC, f"needs {missing} more bytes, {free} free")
            f.fallocate(want)
        except OSError as exc:
            if f.created:
                f.path.unlink(missing_ok=True)
            raise StoreConfigError(f"cannot preallocate {want} bytes for {f.path}: "
                                   f"{exc.strerror or exc} (errno {exc.errno})") from exc

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
        _check_key(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise ObjectNotFound(f"no object under key {key.hex()}")
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
        with self._lock:
            return {self._files[d].path: why for d, why in sorted(self._lost.items())}

    def check_drives(self) -> dict[Path, str]:
        """Check now that each drive file in service is still the file at its path (one ``stat``
        each); take any that was deleted or replaced out of service (see the module docstring).
        Returns :attr:`lost_drives`. Writes run this check on their own drives before publishing."""
        self._check_open()
        for d in range(len(self._files)):
            self._drive_lost(d)
        return self.lost_drives

    @property
    def free_parts(self) -> int:
        """Slots free now (slots of objects being read after a delete are freed when reads end)."""
        with self._lock:
            return self._alloc.free

    def counters(self) -> dict[str, Any]:
        """A snapshot of the counters (:class:`~saria.dataplane.ssd.counters.SSDCounters`)."""
        return self._counters.snapshot()

    def contains(self, key: bytes) -> bool:
        _check_key(key)
        with self._lock:
            return key in self._index

    def info(self, key: bytes) -> ObjectInfo | None:
        """Where the committed object under ``key`` lives, or ``None``."""
        _check_key(key)
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
        (they are trusted, not recomputed). The source must stay unchanged until the Future is done.

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
        _check_key(key)
        parts = self._split(data)
        sums = self._check_checksums(checksums, len(parts))
        names = ["data"] * len(parts) if isinstance(data, torch.Tensor) else [f"data[{i}]" for i in range(len(parts))]
        with self._lock:
            self._check_open()
            if len(self._lost) == len(self._files):
                lost = "; ".join(f"{self._files[d].path} {why}" for d, why in sorted(self._lost.items()))
                raise DriveLost(f"every drive of the SSD store is out of service ({lost}): nothing can be written")
            claim = self._memory.claim(f"the write of object {key.hex()}", False, list(zip(names, parts)))
            try:
                slots = self._alloc.allocate(len(parts))
            except StoreFull:
                self._memory.release(claim)
                self._counters.add(store_full=1)
                raise
            generation = self._next_gen
            self._next_gen += 1
            self._pending[key] = self._pending.get(key, 0) + 1
        job = WriteJob(self, key, generation, parts, slots, sums, claim, _ready_events(parts))
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
        :class:`ObjectCorrupt` (checksum mismatch) or :class:`ObjectUnreadable` (I/O error, short
        read), and the object is then dropped; or with ``ValueError`` (the object kept) when the
        kernel finds a destination page read-only (EFAULT) that the up-front probe missed.
        """
        job = self._start_read(key, out)
        for i in range(len(job.dests)):
            self._readers.submit(job.read_part, i)
        return job.future

    def read_many(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | Sequence[torch.Tensor]]
                  ) -> "list[Future[ObjectInfo] | BaseException]":
        """Read several objects in one submission: ``read(keys[i], outs[i])`` for each ``i``, with
        every part of every object queued on the reader pool at once, object after object (the
        first objects complete first). Returns, per object, its Future, or the exception ``read``
        would have raised for it (that object is not read; the others are). Same contract as
        :meth:`read` otherwise; ``StoreClosed`` is raised, not returned."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} destinations")
        jobs: list[ReadJob | BaseException] = []
        for key, out in zip(keys, outs):
            try:
                jobs.append(self._start_read(key, out))
            except StoreClosed:
                for job in jobs:
                    if isinstance(job, ReadJob):
                        self._end_read(job.entry, job.claim)
                raise
            except Exception as exc:
                jobs.append(exc)
        for job in jobs:
            if isinstance(job, ReadJob):
                for i in range(len(job.dests)):
                    self._readers.submit(job.read_part, i)
        return [job.future if isinstance(job, ReadJob) else job for job in jobs]

    def _start_read(self, key: bytes, out: Any) -> ReadJob:
        """Check a read and pin its object; the returned job's parts are not submitted yet."""
        _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None:
                raise ObjectNotFound(f"no object under key {key.hex()}")
            targets = self._read_targets(entry.info, out)
            claim = self._memory.claim(f"the read of object {key.hex()}", True, targets)
            entry.pins += 1
        try:
            for name, dest in targets:
                if dest.device.type == "cpu" and not self._probe.writable(dest):
                    raise ValueError(f"{name} is read-only memory (e.g. torch.frombuffer over a read-only "
                                     "buffer or mapping): a read needs writable destinations; nothing was read")
        except BaseException:
            self._end_read(entry, claim)
            raise
        dests = [dest for _, dest in targets]
        return ReadJob(self, entry, dests, claim, _ready_events(dests))

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (and void writes of it still in flight). ``True`` if there was anything.

        Its headers are erased and its slots freed now, or when the last read in progress ends.
        """
        _check_key(key)
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
                    if self._drive_lost(d) is None:
                        f.sync()
        finally:
            self._probe.close()
            if self._payload is not None:
                self._payload.close()
            for f in self._files:
                f.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the SSD store is closed")

    def _split(self, data: Any) -> list[torch.Tensor]:
        pb = self._geometry.part_bytes
        if isinstance(data, torch.Tensor):
            flat = _check_tensor(data, "data")
            if flat.numel() == 0:
                raise ValueError("data is empty: an object has at least one byte")
            parts = list(flat.split(pb))
        elif isinstance(data, (list, tuple)):
            if not data:
                raise ValueError("data is an empty list of parts")
            parts = [_check_tensor(t, f"data[{i}]") for i, t in enumerate(data)]
            for i, t in enumerate(parts):
                last = i == len(parts) - 1
                if (not last and t.numel() != pb) or not 0 < t.numel() <= pb:
                    raise ValueError(f"data[{i}] has {t.numel()} bytes: every part but the last must have "
                                     f"part_bytes={pb} and the last 1..{pb}")
        else:
            raise TypeError(f"data must be a uint8 tensor or a list of them, got {type(data).__name__}")
        return parts

    @staticmethod
    def _check_checksums(checksums: Any, n: int) -> list[int | None]:
        if checksums is None:
            return [None] * n
        sums = list(checksums)
        if len(sums) != n or not all(isinstance(c, int) and 0 <= c < CHECKSUM_LIMIT for c in sums):
            raise ValueError(f"checksums must be {n} integers in [0, 2**64), one per part")
        return sums

    def _read_targets(self, info: ObjectInfo, out: Any) -> list[tuple[str, torch.Tensor]]:
        """``(name, destination)`` of each part: exactly the bytes the read will write."""
        pb = self._geometry.part_bytes
        if isinstance(out, torch.Tensor):
            flat = _check_tensor(out, "out")
            if flat.numel() < info.length:
                raise ValueError(f"out has {flat.numel()} bytes, the object has {info.length}")
            return [("out", flat[i * pb:i * pb + p.length]) for i, p in enumerate(info.parts)]
        if isinstance(out, (list, tuple)):
            if len(out) != len(info.parts):
                raise ValueError(f"out has {len(out)} tensors, the object has {len(info.parts)} parts")
            targets = []
            for i, (t, p) in enumerate(zip(out, info.parts)):
                flat = _check_tensor(t, f"out[{i}]")
                if flat.numel() < p.length:
                    raise ValueError(f"out[{i}] has {flat.numel()} bytes, part {i} has {p.length}")
                targets.append((f"out[{i}]", flat[:p.length]))
            return targets
        raise TypeError(f"out must be a uint8 tensor or a list of them, got {type(out).__name__}")

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

    def _drive_lost(self, drive: int) -> DriveLost | None:
        """``None`` while ``drive`` is in service and its file is still the one at its path; else
        the :class:`DriveLost` error, after taking the drive out of service (the first time)."""
        if drive not in self._lost:
            why = self._files[drive].vanished()
            if why is not None:
                self._lose_drive(drive, why)
        return self._lost_error(drive)

    def _lost_error(self, drive: int) -> DriveLost | None:
        why = self._lost.get(drive)
        if why is None:
            return None
        path = self._files[drive].path
        return DriveLost(f"SSD drive file {path} {why} while the store had it open; the drive is out of service",
                         path, why)

    def _lose_drive(self, drive: int, why: str) -> None:
        """Take ``drive`` out of service: no more slots from it, its objects leave the index (their
        parts on other drives are erased and freed once no read pins them), one log line."""
        with self._lock:
            if drive in self._lost:
                return
            self._lost[drive] = why
            self._alloc.retire(drive)
            lost = [e for e in self._index.values() if any(p.drive == drive for p in e.info.parts)]
            for e in lost:
                del self._index[e.info.key]
            free_now = [e for e in lost if self._retire(e)]
            left = len(self._files) - len(self._lost)
        self._counters.add(drives_lost=1, objects_lost=len(lost))
        log.error("SSD drive file %s %s while the store had it open: drive taken out of service, %d object(s) on "
                  "it lost; %s", self._files[drive].path, why, len(lost),
                  f"{left} drive(s) left in service" if left else "no drive left: writes will fail")
        for e in free_now:
            self._release(e.info.parts)

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
            lost = None if info is None else next((p.drive for p in info.parts if p.drive in self._lost), None)
            void = info is None or lost is not None or generation < self._tombstones.get(key, -1) or (
                current is not None and current.info.generation > generation)
            if not n:
                self._tombstones.pop(key, None)
            if not void:
                self._index[key] = IndexEntry(info)
                if current is not None and self._retire(current):
                    old = current
        if info is not None and void:
            self._release(info.parts)
            if lost is not None:
                raise self._lost_error(lost)
            return None
        if old is not None:
            self._release(old.info.parts)
        return info
