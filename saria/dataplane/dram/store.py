"""The DRAM tier's index: which objects live in which host-pool slots (the DRAM-resident twin of
the SSD store's index).

:class:`DramStore` owns the map ``ObjectKey -> DramObject`` and the lock around it; the bytes live
in a :class:`~saria.dataplane.dram.host_pool.HostPool` it references (and whose slots it frees when an
object is replaced or dropped). It decides nothing: the transfer engine publishes objects once
their bytes are in their slots, and drops them when the control plane says so. Reading an object
that is being dropped is the control plane's business to prevent (it pins what a plan reads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator

import torch

from saria.orders import KV, ObjectKey

from saria.dataplane.dram.host_pool import HostPool


@dataclass
class DramObject:
    """An object resident in the host pool: its slots, size and per-slot checksums (a slot's
    ``None``: not computed, as for a layer-wise save's objects, whose pages were copied straight
    into the slots; an SSD write or a cluster put of it computes the part's checksum itself)."""

    slots: list[int]
    nbytes: int
    checksums: tuple[int | None, ...]


class DramStore:
    """Objects resident in host-pool slots, by :class:`~saria.orders.ObjectKey`. Thread-safe.

    ``put`` publishes an object (freeing the slots of the one it replaces), ``drop`` removes one and
    frees its slots, ``get`` looks one up; ``views`` gives an object's bytes as slot views.
    """

    def __init__(self, host_pool: HostPool):
        self.host_pool = host_pool
        self._objects: dict[ObjectKey, DramObject] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(key: ObjectKey | Hashable, kind: str | None) -> ObjectKey:
        if isinstance(key, ObjectKey):
            if kind is not None and kind != key.kind:
                raise ValueError(f"{key} given with kind {kind!r}")
            return key
        return ObjectKey(key, kind or KV)

    def put(self, key: ObjectKey, obj: DramObject) -> None:
        """Publish ``obj`` under ``key`` (its bytes must already be in its slots). An object it
        replaces has its slots freed."""
        if not isinstance(obj, DramObject):
            raise TypeError(f"put() takes a DramObject, got {type(obj).__name__}")
        if len(obj.slots) != self.host_pool.slots_for(obj.nbytes):
            raise ValueError(f"an object of {obj.nbytes} bytes takes {self.host_pool.slots_for(obj.nbytes)} slots, "
                             f"got {len(obj.slots)}")
        key = self._key(key, None)
        with self._lock:
            old = self._objects.get(key)
            self._objects[key] = obj
        if old is not None and old is not obj:
            self.host_pool.free(old.slots)

    def get(self, key: ObjectKey | Hashable, kind: str | None = None) -> DramObject | None:
        """The object under ``key`` (an :class:`ObjectKey`, or a chunk hash and ``kind``), or ``None``."""
        key = self._key(key, kind)
        with self._lock:
            return self._objects.get(key)

    def drop(self, key: ObjectKey | Hashable, kind: str | None = None) -> DramObject | None:
        """Remove the object under ``key`` and free its slots; returns it (``None``: there was none)."""
        key = self._key(key, kind)
        with self._lock:
            obj = self._objects.pop(key, None)
        if obj is not None:
            self.host_pool.free(obj.slots)
        return obj

    pop = drop

    def drop_many(self, keys: Iterable[ObjectKey]) -> int:
        """:meth:`drop` of several objects (:class:`ObjectKey` s) at once: one lock, one
        :meth:`HostPool.free` of all their slots; how many were resident. Every resident one leaves
        the index; a free the pool refuses (a slot not allocated: a bug) frees the objects one by
        one, so that only the bad one's slots stay taken, and raises its error."""
        pop = self._objects.pop
        with self._lock:
            objs = [obj for obj in [pop(key, None) for key in keys] if obj is not None]
        if not objs:
            return 0
        try:
            self.host_pool.free([slot for obj in objs for slot in obj.slots])
        except ValueError:  # the pool freed nothing: one by one, to keep only the bad one's slots
            error = None
            for obj in objs:
                try:
                    self.host_pool.free(obj.slots)
                except ValueError as exc:
                    error = error or exc
            if error is not None:
                raise error
        return len(objs)

    def views(self, obj: DramObject) -> list[torch.Tensor]:
        """The object's bytes: one uint8 view per slot (full slots, then a partial last one)."""
        return self.host_pool.views(obj.slots, obj.nbytes)

    def contiguous(self, obj: DramObject) -> torch.Tensor | None:
        """The object's bytes as one uint8 view when its slots follow each other in memory (as
        slots allocated together from a fresh pool do), else ``None``. No copy."""
        views = self.views(obj)
        first = views[0]
        step = self.host_pool.slot_bytes
        if any(v.data_ptr() != first.data_ptr() + i * step for i, v in enumerate(views)):
            return None
        storage_end = first.untyped_storage().nbytes() - first.storage_offset()
        if obj.nbytes > storage_end:  # slots of two segments that happen to be adjacent
            return None
        return first.as_strided((obj.nbytes,), (1,))

    def held_slots(self) -> int:
        """Host-pool slots owned by resident objects. With no store in flight, the pool's
        ``used_slots`` equals this: any difference is a leaked (or doubly owned) slot."""
        with self._lock:
            return sum(len(obj.slots) for obj in self._objects.values())

    def keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._objects

    def __iter__(self) -> Iterator[ObjectKey]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"DramStore({len(self)} objects in {self.host_pool!r})"
