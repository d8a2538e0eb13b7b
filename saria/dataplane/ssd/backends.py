"""The SSD store's payload backends: what moves a part's payload between a drive file and a tensor.

* :class:`PosixPayloadIO` moves a part's payload between a drive file and a tensor with
  ``os.preadv`` / ``os.pwritev`` on memoryviews of the tensor's memory. Under O_DIRECT every buffer
  address, length and file offset must be a multiple of 4096: an aligned destination gets its whole
  blocks straight from the file and only the final partial block goes through an aligned
  (``mmap``) bounce buffer; an unaligned one goes through the bounce buffer entirely. CUDA tensors
  always go through the bounce buffer and a copy.
* :class:`KvikioPayloadIO` reads and writes CUDA tensors with ``kvikio.CuFile.pread`` /
  ``pwrite`` (GPUDirect Storage, or kvikio's POSIX compat mode) and hands CPU tensors to POSIX.
* What kvikio would do here, and so which backend ``auto`` picks, is decided once in
  :mod:`~saria.dataplane.ssd.kvikio_status` (:func:`kvikio_status`, :func:`choose_backend`), for
  :func:`open_payload_io` and ``saria doctor`` alike.

Headers always go through :class:`~saria.dataplane.ssd.files.DriveFile` (``files``), so both
backends share the header handling, verification and index of the store.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Protocol

import torch

from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import StoreConfigError
from saria.dataplane.ssd.files import AlignedPool, DriveFile, ShortTransfer, host_view
from saria.dataplane.ssd.format import BLOCK, round_up
from saria.dataplane.ssd.kvikio_status import BACKENDS, KvikioStatus, choose_backend, kvikio_status

log = logging.getLogger("saria.dataplane.ssd")


class PayloadIO(Protocol):
    """Moves the ``length`` payload bytes of one part between a drive file and a tensor."""

    name: str

    def read_payload(self, drive: int, offset: int, dest: torch.Tensor, length: int) -> None: ...

    def write_payload(self, drive: int, offset: int, src: torch.Tensor, length: int) -> None: ...

    def close(self) -> None: ...


class PosixPayloadIO:
    """Payload I/O with pread/pwrite through :class:`DriveFile` (see the module docstring)."""

    name = "posix"

    def __init__(self, files: list[DriveFile], part_bytes: int, pin: bool | None = None):
        self._files = files
        # Pinned where CUDA is: CUDA destinations and sources are copied through these buffers.
        self._bounce = AlignedPool(part_bytes, pin=torch.cuda.is_available() if pin is None else pin)

    def read_payload(self, drive: int, offset: int, dest: torch.Tensor, length: int) -> None:
        f = self._files[drive]
        if dest.device.type != "cpu":
            with self._bounce.acquire() as b:
                f.read_exact(b.view[:round_up(length) if f.direct else length], offset)
                dest[:length].copy_(b.tensor[:length])
            return
        view = host_view(dest)[:length]
        if not f.direct:
            f.read_exact(view, offset)
            return
        head = length - length % BLOCK if dest.data_ptr() % BLOCK == 0 else 0
        if head:
            f.read_exact(view[:head], offset)
        if head < length:
            with self._bounce.acquire() as b:
                f.read_exact(b.view[:round_up(length - head)], offset + head)
                view[head:] = b.view[:length - head]

    def write_payload(self, drive: int, offset: int, src: torch.Tensor, length: int) -> None:
        f = self._files[drive]
        if src.device.type != "cpu":
            with self._bounce.acquire() as b:
                b.tensor[:length].copy_(src[:length])
                size = length
                if f.direct:
                    size = round_up(length)
                    b.tensor[length:size].zero_()
                f.write_exact(b.view[:size], offset)
            return
        view = host_view(src)[:length]
        if not f.direct:
            f.write_exact(view, offset)
            return
        head = length - length % BLOCK if src.data_ptr() % BLOCK == 0 else 0
        if head:
            f.write_exact(view[:head], offset)
        if head < length:
            rest, size = length - head, round_up(length - head)
            with self._bounce.acquire() as b:
                b.view[:rest] = view[head:]
                b.tensor[rest:size].zero_()
                f.write_exact(b.view[:size], offset + head)

    def close(self) -> None:
        self._bounce.close()


class KvikioPayloadIO:
    """Payload I/O for CUDA tensors with kvikio 26.x ``CuFile`` (GDS, or kvikio's compat mode);
    CPU tensors go to the POSIX backend. Needs CUDA: kvikio loads libcuda even in compat mode.

    ``status`` (default :func:`kvikio_status`) is what kvikio does here: :attr:`mode` (``"gds"`` /
    ``"compat"``), :attr:`gds_active`, and :attr:`name` (``"kvikio (GDS)"`` / ``"kvikio (compat
    mode)"``, the store's ``backend_name``). A status that is not usable is refused (RuntimeError)."""

    name = "kvikio"

    def __init__(self, paths: list[Path], posix: PosixPayloadIO, counters: SSDCounters, *,
                 status: KvikioStatus | None = None, expect: list[tuple[int, int]] | None = None):
        self.status = status if status is not None else kvikio_status()
        if not self.status.usable:
            raise RuntimeError(f"kvikio is not usable here: {self.status.reason}")
        import kvikio

        self.mode = self.status.mode
        self.gds_active = self.status.gds_active
        self.name = self.status.name
        self.compat_mode = self.status.compat_mode or "unknown"
        self._posix = posix
        self._counters = counters
        self._paths = [str(p) for p in paths]
        self._files = []
        try:
            for i, p in enumerate(self._paths):
                self._files.append(kvikio.CuFile(p, "r+"))  # "r+": read/write, no truncation
                # kvikio opens by name: it must have the very file the store checked and has open
                # (its directory is the store's own, so no one else can swap it; this says so)
                fd = getattr(self._files[-1], "fd", None)
                if expect is not None and callable(fd):
                    st = os.fstat(fd())
                    if (st.st_dev, st.st_ino) != expect[i]:
                        raise OSError(errno.ESTALE, f"{p} is no longer the file the SSD store opened and checked")
        except BaseException:
            self.close()
            raise

    def read_payload(self, drive: int, offset: int, dest: torch.Tensor, length: int) -> None:
        if dest.device.type != "cuda":
            return self._posix.read_payload(drive, offset, dest, length)
        self._run("read", drive, lambda f: f.pread(dest[:length], length, offset), length)

    def write_payload(self, drive: int, offset: int, src: torch.Tensor, length: int) -> None:
        if src.device.type != "cuda":
            return self._posix.write_payload(drive, offset, src, length)
        self._run("write", drive, lambda f: f.pwrite(src[:length], length, offset), length)

    def _run(self, kind: str, drive: int, submit, length: int) -> None:
        start = time.perf_counter()
        try:
            done = submit(self._files[drive]).get()
        except (RuntimeError, OSError) as exc:  # kvikio raises RuntimeError for cuFile / POSIX errors
            self._counters.add(io_errors=1)
            raise OSError(errno.EIO, f"kvikio {kind} on {self._paths[drive]} failed: {exc}") from exc
        if done != length:
            self._counters.add(**{f"short_{kind}s": 1})
            raise ShortTransfer(errno.EIO, f"kvikio {kind} on {self._paths[drive]} moved {done} of {length} bytes")
        self._counters.add_io(self._paths[drive], kind, length, time.perf_counter() - start)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []
        self._posix.close()


def open_payload_io(backend: str, files: list[DriveFile], part_bytes: int, counters: SSDCounters, *,
                    status: KvikioStatus | None = None) -> PayloadIO:
    """The payload backend for ``backend``, chosen by :func:`choose_backend` from ``status``
    (default :func:`kvikio_status`, the decision ``saria doctor`` reports): ``auto`` is kvikio when
    it is usable, else POSIX, with one log line saying why (a warning when kvikio is installed
    and CUDA is there, so a broken install is seen). Asking for ``kvikio`` where it cannot run is
    a :class:`StoreConfigError`; so is kvikio failing to open the drive files then (``auto``
    falls back to POSIX, with a warning)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    posix = PosixPayloadIO(files, part_bytes)
    if backend == "posix":
        return posix
    if status is None:
        status = kvikio_status()
    choice = choose_backend(backend, status)
    if choice.backend == "posix":
        level = logging.WARNING if status.installed and status.cuda else logging.INFO
        log.log(level, "SSD store uses POSIX: %s", choice.reason)
        return posix
    try:
        return KvikioPayloadIO([f.path for f in files], posix, counters, status=status,
                               expect=[f.identity for f in files])
    except Exception as exc:
        if backend == "kvikio":
            raise StoreConfigError(f"kvikio ({choice.name}) could not open the drive files: "
                                   f"{type(exc).__name__}: {exc}") from exc
        log.warning("SSD store uses POSIX: kvikio (%s) could not open the drive files (%s: %s)",
                    choice.mode, type(exc).__name__, exc)
    return posix
