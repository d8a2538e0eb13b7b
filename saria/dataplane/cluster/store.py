"""The cluster store: saria objects in Mooncake Store, shared by every host of a cluster.

It stores the same objects as the SSD tier (packed chunk shards, per rank and pipeline stage,
under :func:`saria.dataplane.ssd.keys.object_key` keys) in the memory of Mooncake storage nodes,
moved with Mooncake's batch zero-copy calls straight from and into the pinned host pool. It takes
orders of bytes and knows nothing of tiers or policy: what to store, read or drop is the control
plane's decision. The design (layout, protocols, failure behaviour, numbers) is in
docs/cluster.md. In short, for a reader of this file:

* An object is its parts (each one host slot at most, one Mooncake key each, named by its
  checksum) and one metadata value, written last (``layout``).
* ``put_many`` / ``get_many`` submit one batch to a small thread pool and return one Future per
  object; the batch's protocol runs there (``jobs``), never on the caller's thread, with a
  deadline (a timeout is a miss). Every failure is a :class:`~saria.dataplane.cluster.errors.ClusterMiss`
  through the object's Future; a get hands back only bytes whose lengths and checksums matched.
* The tier's health (``connection``): a master found unreachable turns it off with one warning;
  calls are then quick misses while a background thread reconnects.
* Sealed (a :class:`~saria.seal.Sealer` given): every part and the metadata are sealed with
  AES-256-GCM (``sealed``, ``sealed_jobs``); only the store's own metadata arenas and ciphertext
  buffers are registered with Mooncake, never the host memory, so plaintext stays private.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from saria.dataplane.cluster import queries
from saria.dataplane.cluster.connection import Connection, import_store_class
from saria.dataplane.cluster.counters import ClusterCounters
from saria.dataplane.cluster.errors import ClusterClosed, ClusterOff
from saria.dataplane.cluster.jobs import Batch, Watchdog, Workspace
from saria.dataplane.cluster.layout import SEALED
from saria.dataplane.cluster.sealed import layout_of
from saria.dataplane.cluster.memory import Registered, memory_ranges
from saria.dataplane.cluster.sealed import TAG_BYTES
from saria.dataplane.cluster.sealed_jobs import SealedBatch
from saria.dataplane.devices import pool_initializer, resolve
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.keys import parse_object_key
from saria.seal import Sealer

log = logging.getLogger("saria.dataplane.cluster")


class ClusterStore:
    """Objects in Mooncake Store, moved from and into registered host memory (docs/cluster.md).

    Args:
        master: the Mooncake master's RPC address, ``host:port``.
        identity: what the objects are written for (model, dtype, page geometry, parallel layout,
            rank and stage, as the SSD store's identity); objects of another identity are never seen.
            ``max_part_bytes`` is added to it: stores with other part sizes do not see each other's objects.
        memory: the :class:`HostPool` whose slots the objects move from and into (or a list of
            contiguous uint8 CPU tensors); registered with Mooncake once per client, at open
            (unless sealed: then Mooncake never sees it).
        local_hostname: this host's address as the storage nodes reach it.
        max_part_bytes: the largest part (default: the host pool's slot size).
        threads: workers running batches (each holds one metadata arena of ``arena_bytes``).
        timeout_s: deadline of a batch, from its submission; a timed-out object is a miss.
        setup_wait_s: how long the constructor waits for the first client setup (it never raises
            for an unreachable master: the tier starts off and reconnects in the background).
        retry_min_s, retry_max_s: the reconnect backoff.
        protocol: Mooncake's transport, ``"tcp"`` (or ``"rdma"`` where the hosts have it).
        arena_bytes: each worker's registered buffer for metadata values (bounds a batch's parts).
        pipeline_bytes: a get fetches its parts in runs of about this many bytes, verifying one run
            (on a verifier thread) while the next is on the wire. A sealed store moves parts both
            ways in runs of this size at most (and one part at least), through two ciphertext
            buffers of that size per worker (registered with Mooncake): one run is sealed or opened
            while the other is on the wire.
        sealer: seal every object (docs/cluster.md "Sealed objects"): a
            ``Sealer(keyring, "cluster", identity)``. Sealed objects live under a layout of their own
            (plain stores never see them, nor they plain objects); no checksum is computed or checked.
        device: the engine's device, made current on each of the store's threads first
            (:mod:`saria.dataplane.devices`); ``None``: the device current on the opening thread.

    Raises ``ImportError`` (saying what to install) when Mooncake is not importable.
    """

    def __init__(self, master: str, identity: str, memory: HostPool | Sequence[torch.Tensor], *,
                 local_hostname: str = "127.0.0.1", max_part_bytes: int | None = None, threads: int = 2,
                 timeout_s: float = 5.0, setup_wait_s: float = 10.0, retry_min_s: float = 0.5,
                 retry_max_s: float = 10.0, protocol: str = "tcp", arena_bytes: int = 1 << 20,
                 pipeline_bytes: int = 32 << 20, sealer: Sealer | None = None,
                 device: torch.device | str | None = None):
        import_store_class()  # ImportError (what to install) before anything is started
        if sealer is not None and not isinstance(sealer, Sealer):
            raise TypeError(f"sealer must be a saria.seal.Sealer, got {type(sealer).__name__}")
        if isinstance(memory, HostPool):
            max_part_bytes = max_part_bytes or memory.slot_bytes
        if not max_part_bytes or max_part_bytes < 1:
            raise ValueError("max_part_bytes is needed (>= 1) when memory is not a HostPool")
        # The part size is part of the layout: a host whose slots differ would see another part
        # structure (each part is one slot); it sees no object instead of corrupt ones.
        self._identity = identity
        self._sealer = sealer
        self._layout = layout_of(f"{identity}|cluster parts of {max_part_bytes} bytes" + (SEALED if sealer else ""))
        if threads < 1 or timeout_s <= 0 or arena_bytes < self._layout.meta_bytes(1):
            raise ValueError("threads must be >= 1, timeout_s > 0, arena_bytes >= one metadata value")
        self._registered = Registered(memory_ranges(memory), mooncake=sealer is None)
        self._max_part = int(max_part_bytes)
        self._timeout = float(timeout_s)
        self._counters = ClusterCounters()
        self._arena_bytes = arena_bytes
        run = max(1, int(pipeline_bytes) // self._max_part) * (self._max_part + TAG_BYTES)  # whole parts, tags
        workspaces = [Workspace(torch.zeros(arena_bytes, dtype=torch.uint8),
                                [torch.zeros(run, dtype=torch.uint8) for _ in range(2 if sealer else 0)])
                      for _ in range(threads)]
        self._workspaces: queue.SimpleQueue[Workspace] = queue.SimpleQueue()
        for w in workspaces:
            self._workspaces.put(w)
        self._lock = threading.Lock()
        self._inflight: set[Batch] = set()
        self._closed = False
        self._pipeline_bytes = int(pipeline_bytes)
        device = resolve(device)
        bind = pool_initializer(device)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="saria-cluster", initializer=bind)
        self._verifier = ThreadPoolExecutor(threads, thread_name_prefix="saria-cluster-verify", initializer=bind)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="saria-cluster-lookup", initializer=bind)
        self._watchdog = Watchdog(device)
        # Mooncake's memory: the arenas, a sealed store's ciphertext buffers, a plain store's host memory
        ranges = [] if sealer else list(self._registered.ranges)
        ranges += [(t.data_ptr(), t.numel()) for w in workspaces for t in [w.arena, *w.cipher]]
        self._mooncake_ranges = sorted(ranges)
        self._conn = Connection(master, local_hostname, ranges, self._counters, setup_wait_s,
                                retry_min_s, retry_max_s, protocol, device=device)

    # ---------------------------------------------------------------- public API

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def sealed(self) -> bool:
        """Whether the store seals its objects (opened with a sealer)."""
        return self._sealer is not None

    @property
    def mooncake_ranges(self) -> list[tuple[int, int]]:
        """``(pointer, bytes)`` of every range registered with Mooncake: a sealed store's own
        arenas and ciphertext buffers only (its host memory is private), a plain store's host
        memory too."""
        return list(self._mooncake_ranges)

    @property
    def on(self) -> bool:
        """Whether the tier is on (the master was reachable at the last call)."""
        return self._conn.on

    @property
    def layout_identity(self) -> str:
        """What the objects' keys are derived from: the identity and the part size. A reader
        elsewhere (:class:`~saria.dataplane.cluster.index.ClusterIndex`) finds this store's
        objects from it."""
        return self._layout.identity

    @property
    def max_part_bytes(self) -> int:
        return self._max_part

    def counters(self) -> dict[str, Any]:
        """A snapshot of the counters (:class:`~saria.dataplane.cluster.counters.ClusterCounters`)."""
        return self._counters.snapshot()

    def put_many(self, keys: Sequence[bytes], views: Sequence[Sequence[torch.Tensor]],
                 checksums: Sequence[Sequence[int] | None] | None = None) -> "list[Future[int]]":
        """Store each object ``keys[i]``, whose parts are ``views[i]`` (host slot views, each at most
        ``max_part_bytes``), in one batch; one Future per object, resolving to its length once
        stored, or failing with a :class:`~saria.dataplane.cluster.errors.ClusterMiss`
        (``ClusterWriteError``, ``ClusterTimeout``, ``ClusterOff``, ...). ``checksums[i]`` are the
        parts' ``saria.kernels.checksum`` values if the caller has them (trusted, not recomputed;
        else, or where a part's is ``None``, computed on the worker; a sealed store neither takes
        nor computes any: the tag is its check). The views must stay unchanged until the Future is done (after a timeout: until its
        ``released`` event is set). A sealed store does not write an object that is in the cluster
        already, sound (its metadata opens under this key file, every part it names exists: the
        Future resolves to its length; ``present`` counts it); one whose metadata is junk or whose
        parts are gone is written again (``rewritten``).

        Raises at once, with nothing sent: ``TypeError`` / ``ValueError`` for bad arguments (a key
        that is not an object key, an object of more than :data:`~.layout.MAX_PARTS` parts, a view outside the registered memory or too large, a batch
        whose metadata exceeds ``arena_bytes``), :class:`ClusterClosed`.
        """
        sums = self._check("put", keys, views, checksums)
        return self._submit("put", keys, views, sums)

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Sequence[torch.Tensor]]) -> "list[Future[int]]":
        """Read each object ``keys[i]`` into ``outs[i]`` (its parts' destinations: host slot views
        of exactly the stored parts' lengths) in one batch; one Future per object, resolving to the
        object's length once every part arrived with its length and checksum, or failing with a
        :class:`~saria.dataplane.cluster.errors.ClusterMiss`: ``ObjectAbsent`` (never written,
        evicted, removed, a part gone), ``ObjectCorrupt`` (wrong sizes, bad metadata, a checksum
        mismatch: the object is dropped), ``ObjectUnauthentic`` / ``ObjectUnknownEpoch`` (a sealed
        store's: a value that fails its tag, of the wrong size or another key file's; a key epoch
        the key file lacks), ``ClusterTimeout``, ``ClusterOff``. After a miss the destination bytes
        are undefined (a sealed store's: zeroed, never unverified bytes). A sealed store's
        destinations are written only by its own decryption, never by Mooncake. Raises at once as
        :meth:`put_many` does.
        """
        self._check("get", keys, outs, None)
        return self._submit("get", keys, outs, [None] * len(keys))

    def exists_many(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool]:
        """Whether each object is complete in the cluster now (its metadata and every part), within
        ``timeout_s`` (default: the store's); all ``False`` when the tier is off, the check failed or
        timed out. A hint: an object may be evicted before a get reaches it (the get is then a miss).
        Runs on the store's lookup thread, so batches in flight do not delay it."""
        for k in keys:
            parse_object_key(k)
        self._check_open()
        if not keys:
            return []
        if self._conn.client() is None:
            self._counters.add(off_calls=1)
            return [False] * len(keys)
        self._counters.add(exists_calls=1)
        fut = self._lookups.submit(queries.exists, self._conn, [(self._layout, k) for k in keys], self._counters)
        try:
            return fut.result(timeout=self._timeout if timeout_s is None else timeout_s)
        except FutureTimeout:
            self._counters.add(exists_timeouts=1)
        except ClusterOff:
            pass
        except Exception:  # noqa: BLE001 - a lookup that failed answers "not there", never raises
            log.debug("cluster exists_many failed", exc_info=True)
        return [False] * len(keys)

    def remove_many(self, keys: Sequence[bytes]) -> int:
        """Remove objects (their metadata and parts), even while being read; how many were there.
        For callers that know an object must not be served any more; 0 when the tier is off."""
        for k in keys:
            parse_object_key(k)
        self._check_open()
        client = self._conn.client()
        if client is None or not keys:
            return 0
        fut = self._lookups.submit(queries.drop, self, client, [(k, None) for k in keys])
        try:
            return fut.result(timeout=self._timeout)
        except Exception:  # noqa: BLE001 - a removal that failed or timed out removed nothing known
            log.debug("cluster remove_many failed", exc_info=True)
            return 0

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait until no batch submitted so far is still inside a Mooncake call (so the memory of
        timed-out objects may be reused); whether that happened within ``timeout``."""
        with self._lock:
            batches = list(self._inflight)
        return all(b.released.wait(timeout) for b in batches)

    def close(self) -> None:
        """Stop accepting calls, wait for the batches in flight, close the client (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._verifier.shutdown(wait=True)
        self._lookups.shutdown(wait=True)
        self._watchdog.close()
        self._conn.close()

    def __enter__(self) -> "ClusterStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ClusterStore(master={self._conn.master}, {'on' if self.on else 'off'}{', sealed' if self.sealed else ''})"

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterClosed("the cluster store is closed")

    def _check(self, what: str, keys: Sequence[bytes], views: Sequence[Sequence[torch.Tensor]],
               checksums: Sequence[Sequence[int] | None] | None) -> list[list[int] | None]:
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} lists of views")
        if checksums is not None and len(checksums) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(checksums)} lists of checksums")
        if len(set(keys)) != len(keys):
            raise ValueError("the same key is listed twice in one batch")
        total = 0
        sums: list[list[int] | None] = []
        for i, (key, parts) in enumerate(zip(keys, views)):
            parse_object_key(key)
            if isinstance(parts, torch.Tensor) or not len(parts):
                raise ValueError(f"object {i}: views must be a non-empty list of part views")
            if len(parts) > self._layout.max_parts:
                raise ValueError(f"object {i}: {len(parts)} parts, an object has at most {self._layout.max_parts}")
            for j, v in enumerate(parts):
                self._registered.check(v, f"object {i} part {j}", self._max_part)
            total += self._layout.meta_bytes(len(parts))
            s = None if checksums is None or self._sealer is not None else checksums[i]
            if s is not None and any(c is None for c in s):  # not all computed yet (a layer-wise save's)
                s = None
            if s is not None:
                s = [int(c) for c in s]
                if len(s) != len(parts) or any(not 0 <= c < 1 << 64 for c in s):
                    raise ValueError(f"object {i}: one 64-bit checksum per part is needed")
            sums.append(s)
        if total > self._arena_bytes:
            raise ValueError(f"a {what} batch of {total} metadata bytes is more than arena_bytes "
                             f"({self._arena_bytes}): split it")
        self._check_open()
        return sums

    def _submit(self, kind: str, keys: Sequence[bytes], views: Sequence[Sequence[torch.Tensor]],
                sums: Sequence[Sequence[int] | None]) -> "list[Future[int]]":
        batch = (SealedBatch if self._sealer is not None else Batch)(self, keys, views, sums, self._timeout)
        if not keys:
            return []
        if self._conn.client() is None:
            self._counters.add(off_calls=1)
            batch.fail_all(ClusterOff, f"cluster tier off (master {self._conn.master} unreachable)")
            return batch.futures
        with self._lock:
            self._check_open()
            self._inflight.add(batch)
            self._pool.submit(batch.run, kind)
        self._watchdog.watch(batch)
        return batch.futures

    def _unwatch(self, batch: Batch) -> None:
        with self._lock:
            self._inflight.discard(batch)
