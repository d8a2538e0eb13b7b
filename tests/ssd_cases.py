"""Helpers for the SSD store tests: deterministic payloads, drive directories, ``FaultyOps``, the
real syscall layer with faults injected at chosen calls (the store itself is never mocked), and for
sealed stores a sealer over a real key file and header edits whose checksum is made valid again."""

from __future__ import annotations

import errno as errno_mod
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from saria.dataplane import IoOps
from saria.dataplane.ssd.format import BLOCK, FILE_NAME, HEADER_BYTES, SUPERBLOCK_BYTES, Geometry
from saria.seal import Keyring, Sealer, new_key_file

PB = 16384  # part_bytes of most tests: small parts keep the interpreted checksum cheap


def payload(n: int, seed: int) -> torch.Tensor:
    """``n`` deterministic random bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def read_back(store, key, length: int) -> torch.Tensor:
    """Object ``key`` of ``length`` bytes read into a fresh CPU tensor."""
    out = torch.zeros(length, dtype=torch.uint8)
    store.read(key, out).result(timeout=30)
    return out


def drives(tmp_path: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        d = tmp_path / f"nvme{i}"
        d.mkdir(exist_ok=True)
        out.append(d)
    return out


def drive_file(directory: Path) -> Path:
    return directory / FILE_NAME


def capacity(slots: int, part_bytes: int = PB) -> int:
    """capacity_bytes_per_drive for exactly ``slots`` slots."""
    return SUPERBLOCK_BYTES + slots * (HEADER_BYTES + part_bytes)


def is_header(offset: int, part_bytes: int = PB) -> bool:
    return offset >= SUPERBLOCK_BYTES and (offset - SUPERBLOCK_BYTES) % (HEADER_BYTES + part_bytes) == 0


def is_payload(offset: int, part_bytes: int = PB) -> bool:
    return offset >= SUPERBLOCK_BYTES and (offset - SUPERBLOCK_BYTES) % (HEADER_BYTES + part_bytes) >= HEADER_BYTES


@dataclass
class Call:
    op: str
    path: str
    length: int = 0
    offset: int = 0
    flags: int = 0
    data: bytes | None = None  # first bytes written (pwrite only)


@dataclass
class Fault:
    """What to do to calls of ``op`` matching ``when``: raise ``error`` (an errno), cut the
    transfer to ``short`` bytes, block until ``gate`` is set, or run ``then`` after the real call.
    ``times`` matching calls are hit (``-1``: all)."""

    op: str
    when: Callable[[Call], bool] = lambda c: True
    error: int | None = None
    short: int | None = None
    gate: threading.Event | None = None
    then: Callable[[Call], None] | None = None
    before: Callable[[Call], None] | None = None
    times: int = 1
    hits: int = 0


class FaultyOps(IoOps):
    """The real syscalls, with :class:`Fault` s applied to matching calls; every call is logged."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self.calls: list[Call] = []
        self.paths: dict[int, str] = {}
        self.direct: set[int] = set()  # fds opened with O_DIRECT
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _match(self, call: Call) -> Fault | None:
        with self._lock:
            self.calls.append(call)
            for f in self.faults:
                if f.op == call.op and f.times != 0 and f.when(call):
                    f.hits += 1
                    if f.times > 0:
                        f.times -= 1
                    return f
        return None

    def _raise(self, f: Fault, call: Call) -> None:
        if f.before:
            f.before(call)
        if f.gate is not None:
            f.gate.wait(30)
        if f.error is not None:
            raise OSError(f.error, f"injected {errno_mod.errorcode[f.error]}: {os.strerror(f.error)}", call.path)

    def open(self, path, flags, mode=0o600, *, dir_fd=None):
        shown = str(path) if dir_fd is None else os.path.normpath(os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"),
                                                                               str(path)))
        call = Call("open", shown, flags=flags)
        f = self._match(call)
        if f:
            self._raise(f, call)
        fd = super().open(path, flags, mode, dir_fd=dir_fd)
        with self._lock:
            self.paths[fd] = shown
            if flags & getattr(os, "O_DIRECT", 0):
                self.direct.add(fd)
        if f and f.then:
            f.then(call)
        return fd

    def _io(self, op, real, fd, buf, offset):
        call = Call(op, self.paths.get(fd, "?"), len(buf), offset,
                    data=bytes(buf[:64]) if op == "pwrite" else None)
        f = self._match(call)
        if f is None:
            return real(fd, buf, offset)
        self._raise(f, call)
        if f.short is None:
            n = real(fd, buf, offset)
        elif f.short == 0:
            n = 0
        elif fd in self.direct and f.short % BLOCK:
            # O_DIRECT refuses a partial block, so the kernel's own short transfers are whole blocks;
            # to cut one mid-block, do the whole transfer, report fewer bytes, and (for reads) spoil
            # the bytes not reported, which the caller must not trust
            n = min(real(fd, buf, offset), f.short)
            if op == "pread":
                buf[n:] = b"\xee" * (len(buf) - n)
        else:
            n = real(fd, buf[:f.short], offset)
        if f.then:
            f.then(call)
        return n

    def pread(self, fd, buf, offset):
        return self._io("pread", super().pread, fd, buf, offset)

    def pwrite(self, fd, buf, offset):
        return self._io("pwrite", super().pwrite, fd, buf, offset)

    def _simple(self, op, real, fd, *args):
        call = Call(op, self.paths.get(fd, "?"))
        f = self._match(call)
        if f:
            self._raise(f, call)
        real(fd, *args)
        if f and f.then:
            f.then(call)

    def fdatasync(self, fd):
        self._simple("fdatasync", super().fdatasync, fd)

    def fallocate(self, fd, offset, length):
        self._simple("fallocate", super().fallocate, fd, offset, length)

    def ftruncate(self, fd, length):
        self._simple("ftruncate", super().ftruncate, fd, length)

    def close(self, fd):
        with self._lock:
            self.paths.pop(fd, None)
            self.direct.discard(fd)
        super().close(fd)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def geometry(slots: int, part_bytes: int = PB) -> Geometry:
    return Geometry(part_bytes, slots)


# ------------------------------------------------------------------ sealed stores

SEALED_FIELDS = 128  # a sealed header's fields start here (slot versions 3 and 2), after the version-1 ones
SEALED_SUMMED = 188  # ... and a version-3 header's blake2b-64 covers bytes 0..188 (version 2: 0..176, 1: 0..128)
_SUMMED = {3: SEALED_SUMMED, 2: 176}


def header_block(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(HEADER_BYTES)


def put_header(path: Path, offset: int, block: bytes) -> None:
    """Write ``block`` as the header at ``offset`` after recomputing its blake2b-64 for its slot
    version (laid out here independently of the encoder): what an attacker with the file can do."""
    block = bytearray(block)
    version = int.from_bytes(block[8:10], "little")
    summed = _SUMMED.get(version, 128)
    block[summed:summed + 8] = hashlib.blake2b(bytes(block[:summed]), digest_size=8).digest()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(block))


def patch_header(path: Path, offset: int, at: int, data: bytes) -> None:
    """Overwrite bytes ``at..`` of the header at ``offset`` with ``data``, checksum made valid."""
    block = bytearray(header_block(path, offset))
    block[at:at + len(data)] = data
    put_header(path, offset, bytes(block))


def make_sealer(key_file: Path, identity: str = "") -> Sealer:
    """A store's sealer over the key file at ``key_file`` (made there first when missing)."""
    if not key_file.exists():
        new_key_file(key_file)
    return Sealer(Keyring.load(key_file), "ssd", identity)


__all__ = ["BLOCK", "Call", "Fault", "FaultyOps", "PB", "SEALED_FIELDS", "SEALED_SUMMED", "capacity", "drive_file",
           "drives", "flip_byte", "geometry", "header_block", "is_header", "is_payload", "make_sealer", "patch_header",
           "payload", "put_header"]
