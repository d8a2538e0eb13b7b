"""The SSD store's read path, store side (docs/ssd.md, "Reads"): a read is checked and its object
pinned (:func:`start_read`: the key, the destinations, memory shared with operations in flight or
read-only, all before any I/O), then its parts are queued on the reader pool (:func:`submit`), one
read or many at once (:func:`read_many`). Each part is then read and verified by
:class:`~saria.dataplane.ssd.jobs.ReadJob`, which ends the read (``SSDStore._end_read``: the pin and
the memory claim released, a bad copy dropped).

Functions of an :class:`~saria.dataplane.ssd.store.SSDStore`'s state, which change it under its
``_lock`` as the store's own methods do.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from saria.dataplane.ssd.checks import check_key, read_targets
from saria.dataplane.ssd.errors import StoreClosed
from saria.dataplane.ssd.index import ObjectInfo
from saria.dataplane.ssd.jobs import ReadJob, ready_events


def start_read(store: Any, key: bytes, out: Any) -> ReadJob:
    """Check a read and pin its object; the returned job's parts are not submitted yet."""
    check_key(key)
    with store._lock:
        store._check_open()
        entry = store._index.get(key)
        if entry is None:
            raise store._not_found(key)
        targets = read_targets(entry.info, out, store._geometry.part_bytes)
        claim = store._memory.claim(f"the read of {store._name(key)}", True, targets)
        entry.pins += 1
    try:
        for name, dest in targets:
            if dest.device.type == "cpu" and not store._probe.writable(dest):
                raise ValueError(f"{name} is read-only memory (e.g. torch.frombuffer over a read-only "
                                 "buffer or mapping): a read needs writable destinations; nothing was read")
    except BaseException:
        store._end_read(entry, claim)
        raise
    dests = [dest for _, dest in targets]
    return ReadJob(store, entry, dests, claim, ready_events(dests))


def submit(store: Any, job: ReadJob) -> None:
    """Queue every part of ``job`` on the store's reader pool, in part order."""
    for i in range(len(job.dests)):
        store._readers.submit(job.read_part, i)


def read_many(store: Any, keys: Sequence[bytes], outs: Sequence[Any]
              ) -> list[Future[ObjectInfo] | BaseException]:
    """:meth:`SSDStore.read_many <saria.dataplane.ssd.store.SSDStore.read_many>`: every read
    started first (a read that cannot start is its exception in the list; ``StoreClosed`` unpins
    the reads started and is raised), then every part of every read queued, object after object."""
    if len(keys) != len(outs):
        raise ValueError(f"{len(keys)} keys but {len(outs)} destinations")
    jobs: list[ReadJob | BaseException] = []
    for key, out in zip(keys, outs):
        try:
            jobs.append(start_read(store, key, out))
        except StoreClosed:
            for job in jobs:
                if isinstance(job, ReadJob):
                    store._end_read(job.entry, job.claim)
            raise
        except Exception as exc:
            jobs.append(exc)
    for job in jobs:
        if isinstance(job, ReadJob):
            submit(store, job)
    return [job.future if isinstance(job, ReadJob) else job for job in jobs]
