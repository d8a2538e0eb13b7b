"""The work of one batch of puts or gets, run on the store's thread pool, and its deadline.

A :class:`Batch` owns its objects' Futures; whoever settles an object first wins: the worker
(stored, read and verified, or a miss) or the :class:`Watchdog` at the batch's deadline (a
:class:`~saria.dataplane.cluster.errors.ClusterTimeout` miss). A batch that timed out before it
started never calls Mooncake; one that times out while Mooncake's call runs lets the call finish
(it cannot be cancelled) and then sets ``released``, and commits nothing more: a put whose parts
were sent after its deadline writes no metadata. Protocols:

* put: checksums (computed here when the caller gave none), one ``batch_put_from`` of every part
  of every object, then one ``batch_upsert_from`` of the metadata of the objects whose parts all
  went in (the commit).
* get: one ``batch_get_into`` of the metadata (into the worker's arena), one of every part of the
  objects whose metadata matched their destinations, straight into them; then each part's length
  and checksum are checked. An object with a part missing or wrong is dropped from Mooncake
  (``batch_remove(force=True)``), so ``exists`` stops reporting it.

A sealed store's batches (:class:`~saria.dataplane.cluster.sealed_jobs.SealedBatch`) run their own
put and get protocols over the same Futures, deadline and workspace.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from saria.dataplane.cluster import queries
from saria.dataplane.cluster.errors import (ClusterMiss, ClusterOff, ClusterTimeout, ClusterWriteError,
                                            ObjectAbsent, ObjectCorrupt)
from saria.dataplane.cluster.layout import Meta, meta_bytes
from saria.dataplane.devices import bind_thread
from saria.kernels.checksum import checksum

OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600


@dataclass
class Workspace:
    """What one worker holds while it runs a batch, registered with Mooncake: its metadata arena,
    and (a sealed store's) two ciphertext buffers, one on the wire while the other is sealed or
    opened."""

    arena: torch.Tensor
    cipher: list[torch.Tensor] = field(default_factory=list)


class Batch:
    """Objects submitted together: their keys, memory, Futures and deadline."""

    def __init__(self, store: Any, keys: Sequence[bytes], views: Sequence[Sequence[torch.Tensor]],
                 sums: Sequence[Sequence[int] | None], timeout_s: float):
        self.store = store
        self.keys = list(keys)
        self.views = [list(v) for v in views]
        self.sums = list(sums)
        self.futures: list[Future] = [Future() for _ in self.keys]
        self.deadline = time.monotonic() + timeout_s
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.timed_out = False

    def name(self, i: int) -> str:
        """How messages name object ``i``: by its place in the batch, never by its key (it holds a
        chunk hash, or a sealed batch's chunk id)."""
        return f"object {i} of the batch"

    def settle(self, i: int, result: Any = None, miss: ClusterMiss | None = None) -> bool:
        """Resolve object ``i`` unless the deadline did; whether this call did."""
        with self.lock:
            if self.timed_out or self.futures[i].done():
                return False
            if miss is None:
                self.futures[i].set_result(result)
            else:
                self.futures[i].set_exception(miss)
        if miss is not None:
            self.store._counters.miss(miss.cause)
        return True

    def expire(self) -> None:
        """Time the batch out: fail every object not settled yet (idempotent)."""
        with self.lock:
            self.timed_out = True
            pending = [f for f in self.futures if not f.done()]
            for f in pending:
                f.set_exception(ClusterTimeout(f"cluster batch of {len(self.keys)} objects timed out",
                                               self.released))
        if pending:
            self.store._counters.miss("timeout", len(pending))

    def fail_all(self, miss_type: type[ClusterMiss], message: str, code: int | None = None) -> None:
        for i in range(len(self.keys)):
            self.settle(i, miss=miss_type(message, code))

    def run(self, kind: str) -> None:
        """The worker's entry: run the put or get protocol, always ending with ``released`` set."""
        store = self.store
        try:
            if time.monotonic() >= self.deadline:
                return self.expire()  # it waited in the queue past its deadline: no call at all
            client = store._conn.client()
            if client is None:
                store._counters.add(off_calls=1)
                self.fail_all(ClusterOff, f"cluster tier off (master {store._conn.master} unreachable)")
                return
            workspace = store._workspaces.get()
            try:
                (self._put if kind == "put" else self._get)(client, workspace)
            finally:
                store._workspaces.put(workspace)
        except BaseException as exc:  # noqa: BLE001 - a worker never dies and never leaves a Future hanging
            self.fail_all(ClusterMiss, f"cluster {kind} failed: {exc!r}")
        finally:
            self.released.set()
            store._unwatch(self)

    # ------------------------------------------------------------------------ put

    def _put(self, client: Any, workspace: Workspace) -> None:
        store, layout, arena = self.store, self.store._layout, workspace.arena
        sums = [list(s) if s is not None else [checksum(v) for v in views]
                for s, views in zip(self.sums, self.views)]
        keys, ptrs, sizes, owner = [], [], [], []
        for i, (key, views) in enumerate(zip(self.keys, self.views)):
            for j, (v, c) in enumerate(zip(views, sums[i])):
                keys.append(layout.part_key(key, j, c))
                ptrs.append(v.data_ptr())
                sizes.append(v.numel())
                owner.append(i)
        t0 = time.perf_counter()
        codes = client.batch_put_from(keys, ptrs, sizes)
        if store._conn.check(codes, "batch_put_from"):
            return self.fail_all(ClusterOff, "master unreachable during put", -900)
        bad: dict[int, int] = {}
        for i, code in zip(owner, codes):
            if code != 0:
                bad.setdefault(i, code)
        good = [i for i in range(len(self.keys)) if i not in bad]
        for i, code in bad.items():
            self.settle(i, miss=ClusterWriteError(f"Mooncake refused a part of {self.name(i)}", code))
        with self.lock:
            if self.timed_out or not good:
                return
        mkeys, mptrs, msizes, off = [], [], [], 0
        for i in good:
            meta = layout.encode(self.keys[i], [(v.numel(), c) for v, c in zip(self.views[i], sums[i])])
            arena[off:off + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            mkeys.append(layout.meta_key(self.keys[i]))
            mptrs.append(arena.data_ptr() + off)
            msizes.append(len(meta))
            off += len(meta)
        codes = client.batch_upsert_from(mkeys, mptrs, msizes)
        store._counters.add(put_seconds=time.perf_counter() - t0)
        if store._conn.check(codes, "batch_upsert_from"):
            return self.fail_all(ClusterOff, "master unreachable during put", -900)
        for i, code in zip(good, codes):
            nbytes = sum(v.numel() for v in self.views[i])
            if code != 0:
                self.settle(i, miss=ClusterWriteError(f"Mooncake refused the metadata of {self.name(i)}", code))
            elif self.settle(i, nbytes):
                store._counters.add(puts=1, put_bytes=nbytes)

    # ------------------------------------------------------------------------ get

    def _groups(self, metas: dict[int, Meta]) -> list[list[int]]:
        """The objects to fetch, in runs of about ``pipeline_bytes``: each run is verified (on the
        verifier thread) while the next one is on the wire."""
        groups: list[list[int]] = []
        size = self.store._pipeline_bytes
        for i, meta in metas.items():
            if not groups or sum(metas[k].length for k in groups[-1]) >= size:
                groups.append([])
            groups[-1].append(i)
        return groups

    def _verify(self, objects: list[int], metas: dict[int, Meta]) -> dict[int, ClusterMiss]:
        """Each part's checksum against its metadata: the objects that fail it."""
        failed: dict[int, ClusterMiss] = {}
        for i in objects:
            for j, (v, (_, c)) in enumerate(zip(self.views[i], metas[i].parts)):
                if checksum(v) != c:
                    failed[i] = ObjectCorrupt(f"part {j} of {self.name(i)} fails its checksum")
                    break
        return failed

    def _get(self, client: Any, workspace: Workspace) -> None:
        store, layout, arena = self.store, self.store._layout, workspace.arena
        t0 = time.perf_counter()
        mkeys = [layout.meta_key(k) for k in self.keys]
        msizes = [meta_bytes(len(v)) for v in self.views]
        offsets = list(itertools.accumulate(msizes, initial=0))
        codes = client.batch_get_into(mkeys, [arena.data_ptr() + o for o in offsets[:-1]], msizes)
        if store._conn.check(codes, "batch_get_into"):
            return self.fail_all(ClusterOff, "master unreachable during get", -900)
        metas: dict[int, Meta] = {}
        failed: dict[int, ClusterMiss] = {}  # settled last, after the objects found wrong are dropped
        for i, code in enumerate(codes):
            name = self.name(i)
            if code == OBJECT_NOT_FOUND:
                failed[i] = ObjectAbsent(f"{name} is not in the cluster", code)
            elif code == msizes[i]:
                try:
                    meta = layout.decode(self.keys[i], arena[offsets[i]:offsets[i + 1]].numpy().tobytes())
                except ValueError as exc:
                    failed[i] = ObjectCorrupt(f"{name} in the cluster: {exc}", code)
                    continue
                if [n for n, _ in meta.parts] != [v.numel() for v in self.views[i]]:
                    failed[i] = ObjectCorrupt(f"{name} in the cluster: its part lengths are not "
                                              "its destination's", code)
                else:
                    metas[i] = meta
            elif code == BUFFER_OVERFLOW or code >= 0:
                failed[i] = ObjectCorrupt(f"{name} in the cluster: its metadata is not the size its "
                                          f"destination implies ({code})", code)
            else:
                failed[i] = ClusterMiss(f"Mooncake get of the metadata of {name} failed", code)
        verifying = []
        for group in self._groups(metas):
            keys, ptrs, sizes, where = [], [], [], []
            for i in group:
                for j, (v, pkey) in enumerate(zip(self.views[i], layout.part_keys(self.keys[i], metas[i]))):
                    keys.append(pkey)
                    ptrs.append(v.data_ptr())
                    sizes.append(v.numel())
                    where.append((i, j))
            codes = client.batch_get_into(keys, ptrs, sizes)
            if store._conn.check(codes, "batch_get_into"):
                return self.fail_all(ClusterOff, "master unreachable during get", -900)
            for (i, j), code, size in zip(where, codes, sizes):
                if i in failed or code == size:
                    continue
                name = self.name(i)
                if code == OBJECT_NOT_FOUND:
                    failed[i] = ObjectAbsent(f"part {j} of {name} is gone from the cluster (evicted)", code)
                elif code == BUFFER_OVERFLOW or code >= 0:
                    failed[i] = ObjectCorrupt(f"part {j} of {name} has the wrong size ({code}, expected {size})",
                                              code)
                else:
                    failed[i] = ClusterMiss(f"Mooncake get of part {j} of {name} failed", code)
            arrived = [i for i in group if i not in failed]
            verifying.append(store._verifier.submit(self._verify, arrived, metas))
        for f in verifying:
            failed.update(f.result())
        with self.lock:
            if self.timed_out:
                return
        store._counters.add(get_seconds=time.perf_counter() - t0)
        self._finish_get(client, failed, metas)

    def _evidence(self, miss: ClusterMiss) -> bool:
        """Whether ``miss`` is evidence against the stored copy (which is then dropped)."""
        return isinstance(miss, ObjectCorrupt)

    def _finish_get(self, client: Any, failed: dict[int, ClusterMiss], metas: dict) -> None:
        """Drop the objects the get found evidence against, then settle every object's Future."""
        store = self.store
        drop = [i for i, miss in failed.items() if self._evidence(miss) or (isinstance(miss, ObjectAbsent) and i in metas)]
        if drop:  # evidence against the stored copy: gone before the caller hears of the miss
            queries.drop(store, client, [(self.keys[i], metas.get(i)) for i in drop])
        for i in range(len(self.keys)):
            if i in failed:
                self.settle(i, miss=failed[i])
            elif self.settle(i, metas[i].length):
                store._counters.add(gets=1, get_bytes=metas[i].length)


class Watchdog:
    """One thread that times out batches at their deadlines."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Batch]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="saria-cluster-watchdog", daemon=True)
        self._thread.start()

    def watch(self, batch: Batch) -> None:
        with self._cond:
            heapq.heappush(self._heap, (batch.deadline, next(self._seq), batch))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        bind_thread(self._device)
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, batch = heapq.heappop(self._heap)
            batch.expire()
