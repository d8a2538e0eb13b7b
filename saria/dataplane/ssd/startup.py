"""Opening an SSD store's drives: lock each directory and open its drive file, then scan every
slot header, rebuild the index, erase what is not served, wipe files that are not this store's to
serve, and size every file (docs/ssd.md, "Recovery" and "Identity").

At open every slot header is scanned; each key's newest complete generation is served, and
everything else (half-committed writes, torn or flipped headers, parts beyond the end of a
truncated file, older generations) is erased and counted. A drive file whose superblock says it
was written for another identity (or, with an identity given, another ``part_bytes``, or a damaged
or blank superblock over committed headers) is wiped: truncated to nothing, then preallocated and
formatted like a new file, with one warning line. A file with no saria superblock at all is not
saria's: the start is refused and the file left as it is, never wiped.

Files on the box (docs/security.md): each directory is opened without following a link and checked
on its descriptor (:class:`~saria.dataplane.ssd.files.DirectoryLock`); the drive file is opened
relative to it with ``O_NOFOLLOW | O_NONBLOCK``, created 0600, and must be a regular file of this
user with one link (checked on its descriptor); anything else is refused in one line.

Sealing (docs/ssd.md, "Sealed objects"): a sealed store (``key_id`` given) serves only parts sealed
under its key file; unsealed parts (a plaintext object must never be served by a sealed store) and
parts sealed under another key file are not read and their slots freed. An unsealed store cannot
open sealed parts and frees them too. Each case is one warning line with a count per start-up.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from saria.dataplane.ssd.alloc import SlotAllocator
from saria.seal.keys import LABEL_PREFIX
from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import StoreConfigError
from saria.dataplane.ssd.files import O_DIRECT, DirectoryLock, DriveFile, IoOps, probe_direct_io
from saria.dataplane.ssd.format import (FILE_NAME, SUPER_MAGIC, SUPERBLOCK_BYTES, Geometry, SlotHeader, SuperBlock,
                                        decode_header)
from saria.dataplane.ssd.index import IndexEntry, assemble
from saria.safe_files import O_NOFOLLOW, O_NONBLOCK, file_problem, shown

log = logging.getLogger("saria.dataplane.ssd")


@dataclass
class DriveScan:
    """What the open-time scan of one drive file found."""

    found: list[tuple[int, int, SlotHeader]] = field(default_factory=list)  # committed (drive, slot, header)
    corrupt: list[int] = field(default_factory=list)  # slots whose header is damaged or unreadable
    partial: list[int] = field(default_factory=list)  # the slot a truncation cut mid-payload
    foreign: str | None = None  # what the file was written for, when it is not this store's to serve
    foreign_objects: set[tuple[bytes, int]] | None = None  # (key, generation) it has parts of (None: unknown)


@dataclass
class Started:
    """What :meth:`Startup.recover` hands the store: the objects to serve, the free slots, the next
    write generation, and the slots whose header could not be erased (set aside until restart)."""

    index: dict[bytes, IndexEntry]
    alloc: SlotAllocator
    next_gen: int
    quarantined: set[tuple[int, int]]


_REFUSED = {  # the warning of each kind of part a store does not serve by its sealing (count, drive directories)
    "unsealed": "SSD store: %d object(s) on %s were not sealed: a sealed store never serves plaintext objects, "
                "their slots are freed",
    "other_key": "SSD store: %d object(s) on %s were sealed under another key file: not read, their slots are freed",
    "sealed": "SSD store: %d object(s) on %s are sealed and this store has no key file: not read, their slots "
              "are freed",
}


def written_for(identity: str, part_bytes: int) -> str:
    """How a log line names what a drive file is (or was) written for; a sealed store's label
    (:meth:`saria.seal.Keyring.store_label`, a MAC under the naming root) is never shown."""
    if identity.startswith(LABEL_PREFIX):
        shown = "a sealed store's identity (another key file, model or layout)"
    else:
        shown = f"identity {identity!r}" if identity else "no identity"
    return f"{shown} with part_bytes={part_bytes}"


class Startup:
    """Opens and recovers the drive files of one store of ``geometry`` written for ``identity``."""

    def __init__(self, geometry: Geometry, identity: str, ops: IoOps, counters: SSDCounters, durable: bool,
                 key_id: bytes | None = None):
        self._key_id = key_id  # of the key file the store seals with (None: an unsealed store)
        self._geometry = geometry
        self._identity = identity
        self._ops = ops
        self._counters = counters
        self._durable = durable

    def open_drive(self, directory: Path, direct: bool | str) -> DriveFile:
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
                use_direct = probe_direct_io(directory, self._ops, dir_fd=lock.fd)
            except OSError as exc:
                raise StoreConfigError(f"SSD path {directory} is not usable: {exc.strerror or exc}") from exc
            if direct is True and not use_direct:
                raise StoreConfigError(f"direct=True but the filesystem of {directory} refuses O_DIRECT "
                                       "(use direct='auto' to fall back to buffered I/O)")
        try:  # the name, not what it points to: a link there is refused at the open below
            os.stat(FILE_NAME, dir_fd=lock.fd, follow_symlinks=False)
            existed = True
        except FileNotFoundError:
            existed = False
        except OSError as exc:
            raise StoreConfigError(f"cannot open {path}: {exc.strerror or exc}") from exc
        # relative to the locked directory's descriptor, never through a link, never blocking on a FIFO
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (O_DIRECT if use_direct else 0)
        try:
            fd = self._open(path, flags, lock)
        except OSError as exc:
            if use_direct and exc.errno == errno.EINVAL and direct == "auto":
                use_direct = False
                fd = self._open_plain(path, flags & ~O_DIRECT, lock)
            else:
                raise self._open_error(path, exc) from exc
        try:
            st = self._check_own_file(path, fd)
            f = DriveFile(path, fd, use_direct, self._ops, self._counters, created=not existed and st.st_size == 0,
                          lock=lock)
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

    def _open(self, path: Path, flags: int, lock: DirectoryLock) -> int:
        return self._ops.open(FILE_NAME, flags, 0o600, dir_fd=lock.fd)

    def _open_plain(self, path: Path, flags: int, lock: DirectoryLock) -> int:
        try:
            return self._open(path, flags, lock)
        except OSError as exc:
            raise self._open_error(path, exc) from exc

    @staticmethod
    def _open_error(path: Path, exc: OSError) -> StoreConfigError:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the name is a symbolic link (followed by nothing)
            return StoreConfigError(f"SSD drive file {shown(path)} is a symbolic link, not a regular file: refused, "
                                    "left as it is (saria opens only its own files)")
        return StoreConfigError(f"cannot open {path}: {exc.strerror or exc}")

    @staticmethod
    def _check_own_file(path: Path, fd: int) -> os.stat_result:
        """The drive file just opened, checked on its descriptor (a regular file of this user with
        one link, :func:`~saria.safe_files.file_problem`), made 0600 (saria's own file: without a
        key it holds KV in the clear) and blocking again; :class:`StoreConfigError` otherwise."""
        st = os.fstat(fd)
        problem = file_problem(st)
        if problem:
            raise StoreConfigError(f"SSD drive file {shown(path)} {problem}: refused, left as it is "
                                   "(saria opens only its own files)")
        if st.st_mode & 0o177:
            os.fchmod(fd, 0o600)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_NONBLOCK)
        return st

    def recover(self, files: list[DriveFile], pool: Executor, erase: Callable[[int, int], bool]) -> Started:
        """Scan every drive's headers (on ``pool``), rebuild the index, erase what is not served
        (``erase(drive, slot)``: ``False`` when the header could not be erased), size the files."""
        g = self._geometry
        scans = list(pool.map(self._scan_drive, files, range(len(files))))
        headers, refused = self._by_seal([h for scan in scans for h in scan.found], files)
        rec = assemble(headers, g.part_bytes)
        to_erase = [(d, s) for d, s in rec.erase + refused if s < g.slots]
        for key, info in list(rec.objects.items()):  # parts cut off by a smaller capacity
            if any(p.slot >= g.slots for p in info.parts):
                del rec.objects[key]
                rec.dropped_objects += 1
                to_erase.extend((p.drive, p.slot) for p in info.parts if p.slot < g.slots)
        for d, (f, scan) in enumerate(zip(files, scans)):
            to_erase.extend((d, s) for s in scan.corrupt + scan.partial if s < g.slots)
            if scan.foreign is not None:  # after every scan: a start-up refused over another file wipes nothing
                self._wipe(f, scan)
        for f in files:
            self._size_file(f)
        failed = {(d, s) for d, s in to_erase if not erase(d, s)}
        for f in files:
            f.write_block(SuperBlock(g.part_bytes, g.slots, self._identity).encode(), 0)
            if self._durable:
                f.sync()
        used = {(p.drive, p.slot) for info in rec.objects.values() for p in info.parts} | failed
        alloc = SlotAllocator([[s for s in range(g.slots) if (d, s) not in used] for d in range(len(files))])
        self._counters.add(dropped_at_open=rec.dropped_objects,
                           corrupt_headers=sum(len(scan.corrupt) for scan in scans),
                           wiped_files=sum(scan.foreign is not None for scan in scans),
                           wiped_at_open=len(set().union(*(scan.foreign_objects or () for scan in scans))))
        if rec.dropped_objects:
            log.warning("SSD store: %d object(s) dropped at open (incomplete, inconsistent or stale)",
                        rec.dropped_objects)
        return Started({k: IndexEntry(info) for k, info in rec.objects.items()}, alloc, rec.max_generation + 1,
                       failed)

    def _by_seal(self, headers: list[tuple[int, int, SlotHeader]], files: list[DriveFile]
                 ) -> tuple[list[tuple[int, int, SlotHeader]], list[tuple[int, int]]]:
        """The headers this store can serve by their sealing, and the slots of the others (to
        erase), counted and logged once per kind (names and key ids are never logged)."""
        kept: list[tuple[int, int, SlotHeader]] = []
        refused: dict[str, list[tuple[int, int, SlotHeader]]] = {}
        for d, s, h in headers:
            if self._key_id is None:
                why = None if h.seal is None else "sealed"
            elif h.seal is None:
                why = "unsealed"
            else:
                why = None if h.seal.key_id == self._key_id else "other_key"
            if why is None:
                kept.append((d, s, h))
            else:
                refused.setdefault(why, []).append((d, s, h))
        for why, found in refused.items():
            objects = len({(h.key, h.generation) for _, _, h in found})
            where = ", ".join(str(files[d].path.parent) for d in sorted({d for d, _, _ in found}))
            self._counters.add(**{f"{why}_dropped_at_open": objects})
            log.warning(_REFUSED[why], objects, where)
        return kept, [(d, s) for found in refused.values() for d, s, _ in found]

    def _scan_drive(self, f: DriveFile, drive: int) -> DriveScan:
        """Committed headers, corrupt slots, and the slot cut mid-payload of drive ``drive``'s file
        ``f``; or, when its content is not this store's to serve, what it was written for."""
        g = self._geometry
        size = f.size()
        head = f.read_head() if size < SUPERBLOCK_BYTES else f.read_block(0)
        if any(head) and not head.startswith(SUPER_MAGIC):
            # not saria's (never formatted by it, or not saria's at all): never wiped, whatever the identity
            raise StoreConfigError(f"SSD drive file {shown(f.path)} is not a saria SSD store file (no saria "
                                   "superblock): refused, not wiped (move it away to start an empty store)")
        if size < SUPERBLOCK_BYTES:
            return DriveScan()
        try:
            sb = SuperBlock.decode(head)
        except ValueError as exc:
            if not self._identity:
                raise StoreConfigError(f"{f.path} is not a usable saria SSD store file: {exc} "
                                       "(remove it to start an empty store)") from exc
            return DriveScan(foreign=f"unknown (unusable superblock: {exc})")
        if sb is not None and (sb.identity != self._identity or (self._identity and sb.part_bytes != g.part_bytes)):
            return DriveScan(foreign=written_for(sb.identity, sb.part_bytes),
                             foreign_objects=objects_in(f, Geometry(sb.part_bytes, sb.slots)))
        if sb is not None and sb.part_bytes != g.part_bytes:
            raise StoreConfigError(f"{f.path} was formatted with part_bytes={sb.part_bytes}, the store was "
                                   f"opened with part_bytes={g.part_bytes} (remove the file to reformat)")
        whole = g.whole_slots_in(size)
        if sb is not None and whole < sb.slots:
            log.warning("SSD drive file %s is truncated: %d of its %d slots remain", f.path, whole, sb.slots)
            self._counters.add(truncated_slots=sb.slots - whole)
        found, corrupt = read_headers(f, g, whole)
        scan = DriveScan(found=[(drive, s, h) for s, h in found], corrupt=corrupt)
        scan.partial = [whole] if g.header_offset(whole) < size else []
        if sb is None and self._identity and scan.found:  # objects, but nothing says what they were written for
            return DriveScan(foreign="unknown (blank superblock)",
                             foreign_objects={(h.key, h.generation) for _, _, h in scan.found})
        return scan

    def _wipe(self, f: DriveFile, scan: DriveScan) -> None:
        """Wipe ``f``, whose content is not this store's to serve: truncate it to nothing
        (:meth:`recover` then preallocates and formats it like a new file) and log one line."""
        objects = scan.foreign_objects
        f.truncate(0)
        what = "an unknown number of objects" if objects is None else f"{len(objects)} object(s)"
        log.warning("SSD drive file %s was written for %s, this store is for %s: not served, wiped (%s dropped)",
                    f.path, scan.foreign, written_for(self._identity, self._geometry.part_bytes), what)

    def _size_file(self, f: DriveFile) -> None:
        """Make ``f`` exactly the configured size, fully allocated (clear error if it cannot be)."""
        want = self._geometry.file_bytes
        if f.size() > want:
            f.truncate(want)
        missing = want - f.allocated_bytes()
        try:
            st = os.fstatvfs(f.fd)
            free = st.f_bavail * st.f_frsize
            if missing > free:
                raise OSError(errno.ENOSPC, f"needs {missing} more bytes, {free} free")
            f.fallocate(want)
        except OSError as exc:
            if f.created:  # the file this start made, and only while its name still reaches it
                f.remove()
            raise StoreConfigError(f"cannot preallocate {want} bytes for {f.path}: "
                                   f"{exc.strerror or exc} (errno {exc.errno})") from exc


def read_headers(f: DriveFile, layout: Geometry, slots: int, log_damage: bool = True
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


def objects_in(f: DriveFile, layout: Geometry) -> set[tuple[bytes, int]]:
    """``(key, generation)`` of every object with a committed header in ``f`` (slots as in
    ``layout``; damaged or unreadable headers are passed over)."""
    found, _ = read_headers(f, layout, layout.whole_slots_in(f.size()), log_damage=False)
    return {(h.key, h.generation) for _, h in found}
