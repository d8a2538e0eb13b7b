"""The SSD store's syscall and drive-file layer: everything that opens, moves, syncs or sizes a
drive file, below the payload backends (``backends``) and the store.

* :class:`IoOps` makes the POSIX path's syscalls that open, move, sync or size a drive file (open,
  pread, pwrite, fdatasync, fallocate, ftruncate, close; only ``fstat``, ``stat`` and ``flock``, and
  the directory lock's own open and close, are called directly). Tests wrap it to inject ENOSPC,
  EIO or short transfers at chosen calls; everything above it is the real code. kvikio's own I/O on
  CUDA tensors does not pass through it.
* :class:`DirectoryLock` is the exclusive ``flock`` on a drive directory that keeps a second store
  (in this process or another) off it while one has it open.
* :class:`DriveFile` is one open drive file: whole-buffer reads and writes that resume after short
  transfers, 4 KiB block I/O for headers, per-path byte and time counters, and
  :meth:`DriveFile.vanished`, which tells when the file at its path is no longer the one it has open.
* :class:`AlignedPool` hands out page-aligned buffers (O_DIRECT bounce buffers, header blocks);
  :func:`host_view` sees a CPU tensor's bytes as a memoryview; :func:`probe_direct_io` tells
  whether a directory's filesystem takes O_DIRECT.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import threading
import weakref
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from saria.dataplane.dram.host_pool import REGISTRY
from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import StoreConfigError
from saria.dataplane.ssd.format import BLOCK
from saria.safe_files import UnsafePath, dir_problem, open_dir, shown

O_DIRECT = getattr(os, "O_DIRECT", 0)


class IoOps:
    """The syscalls of the POSIX path, one method each (the real ``os`` functions)."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        """``os.open``; ``path`` relative to the directory ``dir_fd`` when given."""
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; the count read."""
        return os.preadv(fd, [buf], offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        """Write up to ``len(buf)`` bytes of ``buf`` at ``offset``; the count written."""
        return os.pwritev(fd, [buf], offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)


class ShortTransfer(OSError):
    """A read or write that stopped making progress (end of file, or repeated zero-length I/O)."""


class AlignedBuffer:
    """``nbytes`` of page-aligned anonymous memory, seen as a memoryview and a uint8 tensor."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


class AlignedPool:
    """Reusable :class:`AlignedBuffer` s of one size (one is made whenever none is free).

    ``pin``: register each buffer with CUDA, so the copies between a bounce buffer and GPU memory
    are DMA at the link's rate instead of CUDA's pageable path (which stages them through the
    driver's own buffers, one copy at a time across threads, after synchronizing the stream).
    Buffers are registered in the host pool's :data:`~saria.dataplane.dram.host_pool.REGISTRY` on every
    machine (pinned only with ``pin``), and unregistered exactly once: by :meth:`close`, or when a
    pool nobody closed is collected. Buffers made after :meth:`close` are plain memory."""

    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes = nbytes
        self.pin = pin
        self._free: list[AlignedBuffer] = []
        self._made: list[AlignedBuffer] = []  # every buffer registered: kept until unregistered
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._release = weakref.finalize(self, REGISTRY.release, self._registered, self._made, wait=False)
        self._release.atexit = False  # at interpreter exit the registrations go with the process

    def _new(self) -> AlignedBuffer:
        buf = AlignedBuffer(self.nbytes)
        with self._lock:
            if self._release.alive:
                REGISTRY.register(buf.tensor.data_ptr(), self.nbytes, pin=self.pin)
                self._registered.append(buf.tensor.data_ptr())
                self._made.append(buf)
        return buf

    @contextmanager
    def acquire(self) -> Iterator[AlignedBuffer]:
        with self._lock:
            buf = self._free.pop() if self._free else None
        buf = buf or self._new()
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)

    def close(self) -> None:
        """Unregister every buffer made so far (idempotent; they stay usable as plain memory)."""
        with self._lock:
            if self._release.detach():
                REGISTRY.release(self._registered, self._made)
                self._made.clear()


def host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of a contiguous uint8 CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).numpy()).cast("B")


def flock_holder(path: str | os.PathLike) -> int | None:
    """The pid of the process holding a ``flock`` on ``path``, from ``/proc/locks`` (Linux);
    ``None`` when it cannot be told (no procfs, the holder is in another pid namespace, ...)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 2587 fd:01:1835027 0 EOF"; waiters read "1: -> FLOCK ..."
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            found = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        if found == want and pid > 0:
            return pid
    return None


class DirectoryLock:
    """An exclusive ``flock`` on a drive directory, held while a store has the directory open.

    The lock is on the directory, not on the drive file: deleting or replacing the drive file cannot
    release it, so a second store on the directory (in this process or another; flock locks belong
    to open file descriptions) is refused with :class:`StoreConfigError` naming the directory and,
    where ``/proc/locks`` tells, the pid holding it.

    The directory is opened without following a symbolic link and checked on its descriptor
    (:func:`saria.safe_files.dir_problem`: a real directory, owned by the user running saria, that
    group and other cannot write), and :attr:`fd` is what the drive file and the direct-I/O probe
    are opened relative to, so a directory renamed or swapped after the check is never used.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        try:
            self._fd = open_dir(directory)
        except UnsafePath as exc:
            raise StoreConfigError(f"SSD path {exc}: refused") from exc
        try:
            problem = dir_problem(os.fstat(self._fd))
        except OSError as exc:
            problem = f"cannot be checked: {exc.strerror or exc}"
        if problem:
            os.close(self._fd)
            raise StoreConfigError(f"SSD path {shown(directory)} {problem}: refused (saria keeps its store only in "
                                   "a directory of its own user that no one else can write)")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreConfigError(f"cannot lock SSD path {directory}: {exc.strerror or exc}") from exc
            pid = flock_holder(directory)
            who = ("the lock holder is unknown" if pid is None else
                   f"held by this process, pid {pid}: another SSDStore on it is still open" if pid == os.getpid()
                   else f"held by process {pid}")
            raise StoreConfigError(f"SSD path {directory} is in use by another SSD store ({who}); "
                                   "close that store first") from exc

    @property
    def fd(self) -> int:
        """The directory's descriptor (``-1`` once released)."""
        return self._fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class DriveFile:
    """One open drive file. Transfers move whole buffers or raise; short transfers are resumed
    (from the last whole block under O_DIRECT) and counted, and OS errors are counted.

    ``lock``, when given, is the lock of the file's directory: released by :meth:`close`.
    """

    MAX_STALLS = 3  # consecutive attempts without progress before a transfer is given up

    def __init__(self, path: Path, fd: int, direct: bool, ops: IoOps, counters: SSDCounters,
                 created: bool = False, lock: DirectoryLock | None = None):
        self.path = path
        self.fd = fd
        self.direct = direct
        self.created = created  # this process made the file (removed again if it cannot be sized)
        self._ops = ops
        self._counters = counters
        self._blocks = AlignedPool(BLOCK)
        self._lock = lock
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._abs_path = os.path.abspath(path)  # stat()ed by vanished(), whatever the working directory

    @property
    def identity(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the file this object has open."""
        return self._identity

    def vanished(self) -> str | None:
        """Why the file at :attr:`path` is no longer the file this object has open (``"was deleted"``,
        ``"was replaced by another file ..."``), or ``None`` while it still is. One ``stat`` of the
        path (a microsecond or two). Other errors of that ``stat`` (EACCES, EIO) are raised."""
        try:
            st = os.stat(self._abs_path)
        except (FileNotFoundError, NotADirectoryError):
            return "was deleted"
        if (st.st_dev, st.st_ino) != self._identity:
            return (f"was replaced by another file (inode {st.st_ino} on device {st.st_dev:#x}; the store has "
                    f"inode {self._identity[1]} on device {self._identity[0]:#x} open)")
        return None

    def read_exact(self, buf: memoryview, offset: int) -> None:
        self._transfer(self._ops.pread, buf, offset, "read")

    def write_exact(self, buf: memoryview, offset: int) -> None:
        self._transfer(self._ops.pwrite, buf, offset, "write")

    def read_head(self) -> bytes:
        """The file's first block, or all of a file shorter than a block (one read)."""
        with self._blocks.acquire() as b:
            n = self._call(self._ops.pread, self.fd, b.view, 0)
            return bytes(b.view[:n])

    def remove(self) -> None:
        """Remove the file's name, relative to its locked directory, if the name still reaches this
        file (nothing else is ever removed; without a directory lock, nothing is)."""
        if self._lock is None or self._lock.fd < 0:
            return
        try:
            st = os.stat(self.path.name, dir_fd=self._lock.fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path.name, dir_fd=self._lock.fd)
        except FileNotFoundError:
            pass

    def read_block(self, offset: int) -> bytes:
        """The 4 KiB block at ``offset`` (through an aligned buffer, so O_DIRECT accepts it)."""
        with self._blocks.acquire() as b:
            self.read_exact(b.view, offset)
            return bytes(b.view)

    def write_block(self, data: bytes, offset: int) -> None:
        """Write one 4 KiB block (``len(data) == 4096``) at ``offset``."""
        with self._blocks.acquire() as b:
            b.view[:] = data
            self.write_exact(b.view, offset)

    def sync(self) -> None:
        self._call(self._ops.fdatasync, self.fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def fallocate(self, length: int) -> None:
        self._call(self._ops.fallocate, self.fd, 0, length)

    def truncate(self, length: int) -> None:
        self._call(self._ops.ftruncate, self.fd, length)

    def close(self) -> None:
        """Close the file, then release the directory lock (idempotent)."""
        try:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                self._ops.close(fd)
        finally:
            if self._lock is not None:
                self._lock.release()

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError:
            self._counters.add(io_errors=1)
            raise

    def _transfer(self, op, buf: memoryview, offset: int, kind: str) -> None:
        n, done, stalls = len(buf), 0, 0
        start = time.perf_counter()
        while done < n:
            got = self._call(op, self.fd, buf[done:], offset + done)
            if got >= n - done:
                break
            self._counters.add(**{f"short_{kind}s": 1})
            if got == 0 and kind == "read":
                raise ShortTransfer(errno.EIO, f"{self.path}: read hit end of file at offset {offset + done} "
                                               f"({n - done} of {n} bytes missing; file truncated?)")
            advanced = done + got
            if self.direct:  # O_DIRECT needs block-aligned offsets: redo the partial block
                advanced -= advanced % BLOCK
            stalls = 0 if advanced > done else stalls + 1
            if stalls >= self.MAX_STALLS:
                raise ShortTransfer(errno.EIO, f"{self.path}: {kind} at offset {offset} stalled after "
                                               f"{done} of {n} bytes ({stalls} attempts without progress)")
            self._counters.add(retries=1)
            done = advanced
        self._counters.add_io(str(self.path), kind, n, time.perf_counter() - start)


PROBE_PREFIX = ".saria-odirect-probe-"
O_TMPFILE = getattr(os, "O_TMPFILE", 0)


def probe_direct_io(path: str | os.PathLike, ops: IoOps | None = None, *, dir_fd: int | None = None) -> bool:
    """Can the filesystem holding directory ``path`` do O_DIRECT I/O?

    Writes one aligned 4 KiB block with O_DIRECT to a file of its own in ``path`` and reads it back,
    always through the descriptor it created, never by a name (docs/security.md, "Files on the
    box"): an unnamed ``O_TMPFILE`` where the filesystem has them, else a file of a random name
    created exclusively (``O_EXCL``, ``O_NOFOLLOW``, 0600) and unlinked at once, O_DIRECT then
    turned on for its descriptor. ``dir_fd``: the directory, already opened (and checked) by the
    caller; without it ``path`` is opened here. ``False`` when the filesystem refuses O_DIRECT
    (EINVAL); ``OSError`` when ``path`` is not a usable directory (missing, not a directory, not
    writable).
    """
    ops = ops or IoOps()
    directory = Path(path)
    if dir_fd is None and not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory" if directory.exists() else "no such directory",
                                 str(directory))
    if not O_DIRECT:
        return False
    own_dir = dir_fd is None
    if own_dir:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fd = -1
    try:
        fd = _probe_file(ops, dir_fd)
        if fd < 0:
            return False
        buf = AlignedBuffer(BLOCK)
        buf.view[:] = bytes(range(256)) * (BLOCK // 256)
        if ops.pwrite(fd, buf.view, 0) != BLOCK:
            return False
        back = AlignedBuffer(BLOCK)
        return ops.pread(fd, back.view, 0) == BLOCK and back.view == buf.view
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        if fd >= 0:
            ops.close(fd)
        if own_dir:
            os.close(dir_fd)


def _probe_file(ops: IoOps, dir_fd: int) -> int:
    """A descriptor of a new file no name reaches, opened O_DIRECT in directory ``dir_fd``;
    ``-1`` when the filesystem refuses O_DIRECT."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if O_TMPFILE:
        try:
            return ops.open(".", flags | O_TMPFILE | O_DIRECT, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EISDIR):
                raise
            if exc.errno == errno.EINVAL:  # O_DIRECT refused, or O_TMPFILE unknown here: tell which
                try:
                    ops.close(ops.open(".", flags | O_TMPFILE, 0o600, dir_fd=dir_fd))
                    return -1  # an O_TMPFILE without O_DIRECT opens: O_DIRECT is what is refused
                except OSError as again:
                    if again.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EISDIR):
                        raise
    name = PROBE_PREFIX + secrets.token_hex(8)  # random, so no one can plant it in advance
    fd = ops.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        mine = os.fstat(fd)
        try:  # the name goes at once; and only while it still reaches the file made here
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                ops.close(fd)
                return -1
            raise
    except BaseException:
        if fd >= 0:
            try:
                ops.close(fd)
            except OSError:
                pass
        raise
    return fd
