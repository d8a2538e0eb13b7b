"""One object's parts in flight in the SSD store: a write (:class:`WriteJob`: payloads on the writer
pool, then sync, headers, sync, publish) and a read (:class:`ReadJob`: parts on the reader pool,
each verified where it landed), each gathering its parts' outcomes (:class:`Gather`) and resolving
one Future. The store (:class:`~saria.dataplane.ssd.store.SSDStore`, passed in as ``store``) owns
the index, the slots and the files; a job drives them through the store's internals for one object.
On CUDA memory a job waits for the caller's queued work (:func:`ready_events`) and runs its copies
and checksums on its worker's side stream (:class:`WorkerStreams`). In a sealed store
(``store._sealing``, :mod:`~saria.dataplane.ssd.sealing`) each part is sealed on its way out and
opened on its way back instead of checksummed, and messages name no object.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from saria.kernels import checksum
from saria.seal import PartContext, Unauthentic, UnknownEpoch

from saria.dataplane.nvtx import SSD_READ, SSD_WRITE, VERIFY, nvtx_range
from saria.dataplane.ssd.errors import (DriveLost, ObjectCorrupt, ObjectEpochUnknown, ObjectReadError,
                                        ObjectUnauthentic, ObjectUnreadable, ObjectWriteError)
from saria.dataplane.ssd.format import SlotHeader
from saria.dataplane.ssd.index import IndexEntry, ObjectInfo, PartLocation
from saria.dataplane.ssd.lost import drive_lost
from saria.dataplane.ssd.memory import Claim


class WorkerStreams:
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


def ready_events(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Events on the caller's current CUDA streams, so workers touch CUDA memory only after the
    caller's queued work on it (producing a source, or still reading a destination) is done."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return [torch.cuda.current_stream(d).record_event() for d in devices]


class Gather:
    """Completion of ``n`` part tasks: the first error wins; the last task to finish runs ``done``."""

    def __init__(self, n: int):
        self.remaining = n
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def finish_part(self, error: BaseException | None) -> bool:
        """Record one part's outcome; ``True`` for the caller that finished the last part."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            return self.remaining == 0


class WriteJob:
    """One object's write: payload tasks on the writer pool, then sync, headers, sync, publish."""

    def __init__(self, store: Any, key: bytes, generation: int, parts: list[torch.Tensor],
                 slots: list[tuple[int, int]], sums: list[int | None], claim: Claim, events: list[Any]):
        self.store, self.key, self.generation = store, key, generation
        self.parts, self.slots, self.sums, self.claim, self.events = parts, slots, sums, claim, events
        self.length = sum(t.numel() for t in parts)
        self.seals: list[Any] = [None] * len(parts)
        if store._sealing is not None:  # the tag replaces the checksum: callers' checksums are not kept
            self.sums = [0] * len(parts)
        self.gather = Gather(len(parts))
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()

    def write_part(self, i: int) -> None:
        store, error = self.store, None
        try:
            if not self.gather.failed:
                for e in self.events:
                    e.synchronize()
                drive, slot = self.slots[i]
                with store._streams.on(self.parts[i]):
                    if store._sealing is not None:
                        ctx = PartContext(self.key, i, len(self.parts), self.length, self.parts[i].numel())
                        self.seals[i] = store._sealing.write_part(drive, store._geometry.payload_offset(slot), ctx,
                                                                  self.parts[i])
                    else:
                        if self.sums[i] is None:
                            with nvtx_range(VERIFY):
                                self.sums[i] = checksum(self.parts[i])
                        with nvtx_range(SSD_WRITE):
                            store._payload.write_payload(drive, store._geometry.payload_offset(slot), self.parts[i],
                                                         self.parts[i].numel())
        except BaseException as exc:
            error = exc
        if self.gather.finish_part(error):
            self._commit()

    def _commit(self) -> None:
        store, g = self.store, self.store._geometry
        drives = sorted({d for d, _ in self.slots})
        headers_started = False
        error = self.gather.error
        try:
            if error is None:
                if store._durable:
                    for d in drives:
                        store._files[d].sync()
                length = self.length
                headers_started = True
                for i, (d, s) in enumerate(self.slots):
                    h = SlotHeader(self.key, self.generation, i, len(self.parts), length, self.parts[i].numel(),
                                   g.part_bytes, self.sums[i], self.seals[i])
                    store._files[d].write_block(h.encode(), g.header_offset(s))
                if store._durable:
                    for d in drives:
                        store._files[d].sync()
                for d in drives:  # never report success for bytes in a file no longer at its path
                    lost = drive_lost(store, d)
                    if lost is not None:
                        raise lost
        except BaseException as exc:
            error = exc
        if error is not None:
            self._fail(error, headers_started)
            return
        info = ObjectInfo(self.key, length, self.generation, tuple(
            PartLocation(d, s, t.numel(), c, seal) for (d, s), t, c, seal in zip(self.slots, self.parts, self.sums,
                                                                                 self.seals)))
        try:
            result = store._finish_write(self.key, self.generation, info)
        except DriveLost as exc:  # a drive of it went out of service before it was published
            store._counters.add(write_failures=1)
            self._complete(error=self._write_error(exc))
            return
        except BaseException as exc:  # an erase of a superseded copy failed: the write itself is done
            self._complete(error=exc)
            return
        if result is not None:
            store._counters.add(writes=1)
        self._complete(result)

    def _fail(self, error: BaseException, headers_started: bool) -> None:
        store = self.store
        if headers_started:
            store._release(self.slots)  # some headers may be on disk: erase them
        else:
            with store._lock:  # headers are still erased: the slots go straight back
                store._alloc.release(self.slots)
        store._finish_write(self.key, self.generation, None)
        store._counters.add(write_failures=1)
        self._complete(error=self._write_error(error))

    def _write_error(self, error: BaseException) -> ObjectWriteError:
        code = error.errno if isinstance(error, OSError) else None
        why = f"{error.strerror or error}" if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        exc = ObjectWriteError(f"writing {self.store._name(self.key)} failed: {why}; nothing of it is stored", code)
        exc.__cause__ = error
        return exc

    def _complete(self, result: ObjectInfo | None = None, error: BaseException | None = None) -> None:
        """Release the source memory, then resolve the Future (its callbacks may reuse that memory)."""
        self.store._release_memory(self.claim)
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class ReadJob:
    """One object's read: part tasks on the reader pool, each verified where it landed (a sealed
    part: opened from a private buffer into its destination)."""

    def __init__(self, store: Any, entry: IndexEntry, dests: list[torch.Tensor], claim: Claim, events: list[Any]):
        self.store, self.entry, self.dests, self.claim, self.events = store, entry, dests, claim, events
        self.gather = Gather(len(dests))
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()

    def read_part(self, i: int) -> None:
        store, info, error = self.store, self.entry.info, None
        part, name = info.parts[i], store._name(info.key)
        try:
            if not self.gather.failed:
                for e in self.events:
                    e.synchronize()
                dest = self.dests[i]
                if store._sealing is not None:
                    self._open_part(i, dest)
                else:
                    self._verify_part(i, dest, name)
        except OSError as exc:
            if exc.errno == errno.EFAULT:  # the destination memory, not the stored copy: keep the object
                error = ValueError(f"reading {name} part {i}: the kernel refused to write into the "
                                   "destination (EFAULT: read-only or unmapped memory); the object is kept")
            else:
                error = ObjectUnreadable(f"{name} part {i} (drive {store._files[part.drive].path}, slot "
                                         f"{part.slot}) unreadable: {exc.strerror or exc}", exc.errno)
            error.__cause__ = exc
        except BaseException as exc:
            error = exc
        self._part_done(error)

    def _verify_part(self, i: int, dest: torch.Tensor, name: str) -> None:
        """Read part ``i`` straight into ``dest`` and check its checksum there."""
        store, part = self.store, self.entry.info.parts[i]
        with store._streams.on(dest):
            with nvtx_range(SSD_READ):
                store._payload.read_payload(part.drive, store._geometry.payload_offset(part.slot), dest, part.length)
            with nvtx_range(VERIFY):
                good = checksum(dest) == part.checksum  # returns once the stream is done
        if not good:
            store._counters.add(verification_failures=1)
            raise ObjectCorrupt(f"{name} part {i} (drive {store._files[part.drive].path}, "
                                f"slot {part.slot}) does not match its checksum")

    def _open_part(self, i: int, dest: torch.Tensor) -> None:
        """Read sealed part ``i`` and open it into ``dest``; a tag that fails or an epoch the key
        file lacks is counted and raised as :class:`ObjectUnauthentic` (the object is then dropped)."""
        store, info = self.store, self.entry.info
        part = info.parts[i]
        ctx = PartContext(info.key, i, len(info.parts), info.length, part.length)
        where = f"a sealed object's part {i} (drive {store._files[part.drive].path}, slot {part.slot})"
        try:
            if part.seal is None:  # never indexed by a sealed store (start-up frees unsealed slots)
                raise Unauthentic("an unsealed part in a sealed store")
            with store._streams.on(dest):
                store._sealing.read_part(part.drive, store._geometry.payload_offset(part.slot), ctx, part.seal, dest)
        except UnknownEpoch:
            store._counters.add(unknown_epoch=1)
            raise ObjectEpochUnknown(f"{where} was sealed under a key epoch the key file does not hold "
                                     "(retired): not served, dropped") from None
        except Unauthentic:
            store._counters.add(auth_failures=1)
            raise ObjectUnauthentic(f"{where} failed its authentication tag: not served, dropped") from None

    def _part_done(self, error: BaseException | None) -> None:
        if self.gather.finish_part(error):
            self._finish()

    def _finish(self) -> None:
        error, store = self.gather.error, self.store
        bad_copy = isinstance(error, ObjectReadError)
        store._end_read(self.entry, self.claim, drop=bad_copy)
        if error is None:
            store._counters.add(reads=1)
            self.future.set_result(self.entry.info)
        else:
            store._counters.add(read_failures=1)
            self.future.set_exception(error)
